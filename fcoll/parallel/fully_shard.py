"""``fully_shard``: FSDP the way torch 2.13 compiles it (SimpleFSDP), on PyTorch's own DTensor.

Each parameter of the module becomes ``distribute_tensor(p, mesh, [Shard(0)])`` (dim 0 split
over the mesh; uneven sizes are DTensor's: the first ranks hold ``ceil(d0 / n)`` rows, later ones
fewer or none), and the module reads it through a property (the parametrization) as::

    p.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial("sum")])

so reading a parameter is an all_gather, and its gradient is a reduce_scatter of the sum, divided
by ``n`` (the mean over the mesh, as FSDP2's default ``gradient_divide_factor``). Under
``torch.compile`` both are ``_c10d_functional`` ops in the forward and backward graphs, where a
compiler (``backend="fcoll"``, or Inductor with its FX bucketing) buckets and schedules them;
there is no FSDP machinery beyond the property: no hooks, no streams, no flat buffers.

``reshard_after_forward=True`` (FSDP2's choice for non-root modules) runs each gather inside a
selective activation checkpoint whose policy makes every op of the gather ``MUST_RECOMPUTE``:
autograd keeps only the shard, and the backward gathers the parameter again (AOTAutograd's
partitioner reads the same tags, so in a compiled step the backward graph holds its own
all_gathers). ``None`` means what it means to FSDP2: ``True`` for every module ``fully_shard``
was called on that lies inside another such module (a block), ``False`` for the outermost (the
root, whose parameters the backward needs first): a unit starts as a root and becomes a
non-root when ``fully_shard`` is called on a module containing it. This is torchtitan's
SimpleFSDP design (Zhang et al., "SimpleFSDP: Simpler Fully Sharded Data Parallel with
torch.compile", 2024); the code here is fcoll's own.

Memory: compiled with ``backend="fcoll"``, each block's parameters are one all_gather bucket
(``fcoll.passes.rewrites.fsdp_plan``), issued as coalesced collectives by the default
``bucket_mode="auto"``: no copy of a block's shards into one input, of the gathered bucket out
into its parameters or of each gradient bucket in, which keeps the step's peak memory within
FSDP2's (``benchmarks/overlap.py`` reports both; ``options={"bucket_mode": "concat"}`` makes
those copies: 1.11x FSDP2's peak on the 4-block GPT, against 1.02x).

What differs from ``torch.distributed.fsdp.fully_shard`` (FSDP2):

- Compiled-only: prefetch, bucketing and freeing gathered parameters between blocks. Run
  eagerly, every read of a parameter is one blocking all_gather, at the point of use (correct,
  and slow: a parameter read twice is gathered twice).
- ``reshard_after_forward`` is a bool or None (FSDP2's int, resharding to a smaller mesh, is
  refused); its default is ``True`` (FSDP2's is ``None``: the root's parameters kept);
  ``offload_policy`` is not offered; ``shard_placement_fn`` may return ``Shard(dim)`` or None
  (FSDP2's ``ShardPlacementResult``, another mesh per parameter, is refused).
- ``fully_shard([a, b])`` shards each module of the list as its own unit with the same
  arguments (FSDP2 makes them one communication group; fcoll's plan gathers each unit as a
  block of its own).
- With uneven shards (a sharded dim that does not divide by the mesh size) the call keys
  PyTorch's compile caches per rank for the rest of the process
  (:func:`fcoll.ops.cache_key.key_caches_per_rank`): DTensor's AOTAutograd cache key holds the
  global shape only, and ranks whose local shapes differ loaded each other's artifacts under
  ``backend="inductor"`` on a warm cache (a PyTorch bug; the cost is one compile per rank).
- The module keeps its class's methods (its class becomes a subclass named ``SimpleFSDP<Name>``,
  and a submodule that owns parameters sharded here ``Sharded<Name>``); there is no
  ``unshard()`` / ``reshard()`` / ``set_requires_gradient_sync``.

What is the same: nested calls (the innermost module that called ``fully_shard`` owns a
parameter; a later call on a parent shards only what is left), ``mesh=None`` meaning a 1-D mesh
over the default group's ranks on the default device type, the module returned, sharded
parameters (``module.parameters()`` are DTensors; a plain optimizer updates each rank's shard),
``state_dict`` keys unchanged, tied weights (one ``Parameter`` registered in two modules,
say an embedding and the output head) stay one sharded parameter, mixed precision
(``mp_policy``, FSDP2's :class:`~torch.distributed.fsdp.MixedPrecisionPolicy` with FSDP2's
meaning, below), ``shard_placement_fn`` returning ``Shard(dim)`` (a dimension other than 0
must divide evenly over the mesh) and ``ignored_params`` (not sharded, gradients not reduced).

Mixed precision: with ``param_dtype`` (say bfloat16) each floating-point shard is cast before
its all_gather (half the bytes of float32), the module computes with the gathered
``param_dtype`` parameter, its gradient is cast to ``reduce_dtype`` (``param_dtype`` when
None, as FSDP2) before the reduce_scatter, and the sharded gradient is cast back to the
stored parameter's dtype, which the optimizer updates (the shards stay float32: no extra
copy). Both casts are DTensor's (``redistribute(forward_dtype=, backward_dtype=)``). The
division by ``n`` of the mean is applied to the reduced shard, in the stored dtype, as NCCL's
``avg`` and FSDP2 with a float32 or bfloat16 reduction; with a float16 ``reduce_dtype`` to the
gradient before the reduction, in ``param_dtype`` (a float16 sum can overflow).
``cast_forward_inputs`` casts the floating-point tensors among the unit's forward arguments to
``param_dtype`` and ``output_dtype`` its outputs, per ``fully_shard`` call, as FSDP2 (forward
hooks on the unit).

HSDP: with a 2-D ``mesh`` (FSDP2's convention: dim 0 replicates, dim 1 shards) a parameter is
``distribute_tensor(p, mesh, [Replicate(), Shard(0)])``, gathered over the shard dimension, its
gradient reduce-scattered over the shard dimension and all-reduced over the replicate one (both
DTensor's, from ``Partial`` grad placements), divided by the mesh size.

FSDP with tensor parallel (2-D, torchtitan's usual layout): call ``parallelize_module`` with
``mesh["tp"]`` first, then ``fully_shard(..., mesh=mesh["dp"])``, both meshes slices of one
named mesh. A tensor-parallel parameter (a DTensor on the 1-D tp mesh, ``Shard(k)`` or
``Replicate()``) is sharded again over dp, dim 0 of its tp-local tensor, and stored as a DTensor
on the 2-D ``(dp, tp)`` mesh with FSDP2's placements: ``(Shard(0), tp)``, or
``(_StridedShard(0, split_factor=tp size), Shard(0))`` when tp already splits dim 0, so
``full_tensor()`` and ``state_dict`` give the model's parameter. Reading it gathers the tp-local
tensor over dp (one all_gather of the dp group, its gradient a reduce_scatter over dp, divided by
the dp size) and hands the module the tp DTensor it had, so tensor parallel's own collectives
are unchanged. A DTensor parameter fcoll cannot place this way (a mesh that is not a slice of
``mesh``'s root, a ``Partial`` placement, a 2-D tp mesh) raises ``ValueError``: it would
otherwise be left unsharded with gradients never averaged over dp.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, \
    create_selective_checkpoint_contexts

from fcoll.ops.cache_key import key_caches_per_rank

__all__ = ["fully_shard", "is_fully_sharded", "CLASS_PREFIX"]

#: Prefix of the class the module given to :func:`fully_shard` gets (``SimpleFSDPGPTBlock``);
#: a submodule that only owns sharded parameters gets ``Sharded<Name>``.
CLASS_PREFIX = "SimpleFSDP"
#: Class attribute of every class made here.
_MADE_HERE = "_fcoll_fully_shard"
#: Attribute set on a parameter that was replaced here: (its sharded parameter, the read), so
#: another registration of the same Parameter (tied weights: an embedding and the output head),
#: in this call or a later one, gets the same sharded parameter instead of a copy of its own.
_SHARDED_AS = "_fcoll_sharded_as"
#: Attribute set on a parameter a call was given in ``ignored_params``: later calls skip it.
_IGNORED = "_fcoll_ignored"
#: Class attribute of a unit's class (made here, one per unit): the unit's :class:`_Gather`.
_UNIT_GATHER = "_fcoll_unit_gather"
#: Attribute of a unit: the handles of its mixed-precision forward hooks.
_MP_HOOKS = "_fcoll_mp_hooks"


class _MeanGrad(torch.autograd.Function):
    """Identity forward; backward divides the gradient by the size of ``mesh`` (the mean of
    the ranks' gradients that the reduce_scatter sums). Applied to the sharded parameter, so
    the division is of the reduced shard in the stored dtype (what NCCL's ``avg`` does, and
    FSDP2 where the reduce dtype is float32 or bfloat16); with a float16 reduction it is
    applied to the gathered parameter instead, dividing before the sum, since a sum of
    float16 gradients can overflow (FSDP2 divides before it too).

    The divisor is read from the mesh inside the backward, where Dynamo evaluates
    ``DeviceMesh.size()`` to a constant: a float factor passed to ``apply`` instead becomes a
    symbolic input once the same code is compiled for a second mesh size in one process, and
    Dynamo cannot lift it into the reshard-after-forward checkpoint ("lift_tracked_freevar_to_
    input should not be called on root SubgraphTracer", with ``aot_eager`` too)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.mesh.size(), None


def _recompute_everything(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy of a gather: nothing inside is saved (the gathered
    parameter, its padding and unpadding), so only the shard outlives the forward."""
    return CheckpointPolicy.MUST_RECOMPUTE


class _Gather(nn.Module):
    """The parametrization: sharded DTensor -> gathered local tensor (see module docstring)."""

    def __init__(self, mesh: DeviceMesh, reshard_after_forward: bool | None,
                 mp_policy: MixedPrecisionPolicy) -> None:
        super().__init__()
        self.mesh = mesh
        #: None (FSDP2's "True unless root"): resolved to False here, and to True by
        #: :func:`fully_shard` when it is called on a module containing this unit
        self.reshard_unless_root = reshard_after_forward is None
        self.reshard_after_forward = bool(reshard_after_forward)
        self.param_dtype = mp_policy.param_dtype
        #: the gradient's dtype in the reduction (FSDP2: param_dtype's when not given)
        self.reduce_dtype = mp_policy.reduce_dtype or mp_policy.param_dtype
        #: placements of a stored parameter: ``Shard(0)`` over the last mesh dimension,
        #: replicated over a leading one (HSDP)
        self.sharded = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]

    def gather(self, p: DTensor) -> torch.Tensor:
        mixed = p.dtype.is_floating_point
        reduced_in = (self.reduce_dtype if mixed else None) or p.dtype
        divide_first = reduced_in == torch.float16
        if not divide_first:
            p = _MeanGrad.apply(p, self.mesh)
        full = p.redistribute(
            placements=[Replicate()] * p.device_mesh.ndim,
            forward_dtype=self.param_dtype if mixed else None,
            # explicit: DTensor's default reduces in the stored dtype, FSDP2's in param_dtype
            backward_dtype=self.reduce_dtype if mixed else None,
        ).to_local(grad_placements=[Partial("sum")] * p.device_mesh.ndim)
        return _MeanGrad.apply(full, self.mesh) if divide_first else full

    def forward(self, p: DTensor) -> torch.Tensor:
        if not self.reshard_after_forward or not torch.is_grad_enabled():
            return self.gather(p)
        return checkpoint(self.gather, p, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                       _recompute_everything))


class _TensorParallelGather:
    """The parametrization of a tensor-parallel parameter sharded again over dp (module
    docstring): 2-D DTensor ``(dp, tp)`` -> the tp DTensor the module was parallelized with.

    The tp-local tensor ``[l0, *]`` is gathered over dp by the 1-D :class:`_Gather` (its
    reshard-after-forward checkpoint included) from this rank's ``[ceil-chunk of l0, *]``."""

    def __init__(self, gather: _Gather, tp_mesh: DeviceMesh, tp_placement: Placement,
                 tp_local_shape: torch.Size) -> None:
        self.gather = gather
        self.tp_mesh = tp_mesh
        self.tp_placement = tp_placement
        self.tp_local_shape = tp_local_shape
        self.tp_local_stride = torch.empty(tp_local_shape, device="meta").stride()

    def __call__(self, p: DTensor) -> DTensor:
        dp_shard = DTensor.from_local(p.to_local(), self.gather.mesh, [Shard(0)],
                                      run_check=False, shape=self.tp_local_shape,
                                      stride=self.tp_local_stride)
        return DTensor.from_local(self.gather(dp_shard), self.tp_mesh, [self.tp_placement],
                                  run_check=False, shape=p.shape, stride=p.stride())


def _cast_floating(dtype: torch.dtype | None, tree):
    """``tree`` (args, kwargs, outputs: nested containers) with every floating-point tensor
    cast to ``dtype``; ``tree`` itself when ``dtype`` is None."""
    if dtype is None:
        return tree
    return tree_map_only(torch.Tensor,
                         lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _mixed_precision_hooks(module: nn.Module, mp_policy: MixedPrecisionPolicy) -> None:
    """FSDP2's casts of the unit's forward, as forward hooks on ``module`` (so they apply
    whatever ``forward`` is, a class's or an instance attribute): ``cast_forward_inputs``
    casts the floating-point tensors among its arguments to ``param_dtype``, ``output_dtype``
    its outputs. A later call on the same module replaces the hooks of an earlier one."""
    for handle in getattr(module, _MP_HOOKS, ()):
        handle.remove()
    hooks = []
    if mp_policy.cast_forward_inputs and mp_policy.param_dtype is not None:
        hooks.append(module.register_forward_pre_hook(
            lambda _m, args, kwargs: _cast_floating(mp_policy.param_dtype, (args, kwargs)),
            with_kwargs=True))
    if mp_policy.output_dtype is not None:
        hooks.append(module.register_forward_hook(
            lambda _m, _args, output: _cast_floating(mp_policy.output_dtype, output)))
    setattr(module, _MP_HOOKS, hooks)


def _property(name: str, gather: Callable[[DTensor], torch.Tensor]) -> property:
    return property(lambda self: gather(self._parameters[name]))


def _mesh_dim_name(mesh: DeviceMesh, what: str) -> str:
    names = mesh.mesh_dim_names
    if not names or len(names) != 1:
        raise ValueError(f"fully_shard: the {what} mesh must be a 1-D slice of a mesh with named "
                         f"dimensions (init_device_mesh(..., mesh_dim_names=...)), got "
                         f"{mesh}")
    return names[0]


def _shard_tensor_parallel(p: DTensor, where: str, mesh: DeviceMesh,
                           gather: _Gather) -> tuple[DTensor, _TensorParallelGather]:
    """``p`` (a tensor-parallel DTensor parameter, at ``where``) sharded again over ``mesh``
    (dp): the 2-D DTensor to store and the parametrization that reads it (module docstring).

    Raises:
        ValueError: ``mesh`` is 2-D (HSDP), ``p``'s mesh is not a 1-D named slice of
            ``mesh``'s root other than ``mesh``, or its placement is not ``Shard`` /
            ``Replicate``.
    """
    tp_mesh = p.device_mesh
    why = None
    if mesh.ndim != 1:
        why = "tensor parallel with HSDP (a 2-D fully_shard mesh) is not supported"
    elif tp_mesh.ndim != 1:
        why = (f"its mesh has {tp_mesh.ndim} dimensions (only a 1-D tensor-parallel mesh is "
               "supported)")
    elif not isinstance(p.placements[0], (Shard, Replicate)) or \
            isinstance(p.placements[0], _StridedShard):
        why = f"its placement {p.placements[0]} is neither Shard nor Replicate"
    elif tp_mesh._get_root_mesh() is not mesh._get_root_mesh() or \
            mesh._get_root_mesh() is mesh:
        why = "its mesh and the fully_shard mesh are not slices of one device mesh"
    if why is None:
        dp_name = _mesh_dim_name(mesh, "fully_shard")
        tp_name = _mesh_dim_name(tp_mesh, "parameter's")
        if dp_name == tp_name:
            why = f"it is already sharded over the fully_shard mesh dimension {dp_name!r}"
    if why is not None:
        raise ValueError(f"fully_shard: parameter {where!r} (shape {list(p.shape)}) is a DTensor "
                         f"on {tp_mesh} with placements {p.placements}, not made by fully_shard; "
                         f"it cannot be sharded over {mesh}: {why}")
    root = mesh._get_root_mesh()
    order = [n for n in root.mesh_dim_names if n in (dp_name, tp_name)]
    tp_placement = p.placements[0]
    dp_placement = (_StridedShard(0, split_factor=tp_mesh.size())
                    if isinstance(tp_placement, Shard) and tp_placement.dim == 0 else Shard(0))
    by_name = {dp_name: dp_placement, tp_name: tp_placement}
    tp_local = p.to_local().detach()
    dp_shard = distribute_tensor(tp_local, mesh, [Shard(0)]).to_local()
    stored = DTensor.from_local(dp_shard, root[tuple(order)], [by_name[n] for n in order],
                                run_check=False, shape=p.shape, stride=p.stride())
    return stored, _TensorParallelGather(gather, tp_mesh, tp_placement, tp_local.shape)


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether :func:`fully_shard` was called on ``module`` itself."""
    return type(module).__name__.startswith(CLASS_PREFIX)


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard(mesh=None) needs an initialized default process group")
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, (dist.get_world_size(),))


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | None = True,
                shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                ignored_params: set[nn.Parameter] | None = None
                ) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters over ``mesh`` (dim 0), SimpleFSDP style (module docstring).

    Every parameter of ``module`` and its submodules not owned by an earlier ``fully_shard``
    call on a submodule becomes an ``nn.Parameter`` holding ``distribute_tensor(p, mesh,
    [Shard(0)])``: rank ``r`` keeps rows ``[r * c, (r + 1) * c)`` of dim 0 with
    ``c = ceil(d0 / n)`` (clipped; uneven and empty shards are allowed; a 0-dim parameter is
    replicated). Each module that owns such a parameter reads it gathered: ``[c, *] -> [d0, *]``
    on every rank, its gradient reduce-scattered (sum; all-reduced for a 0-dim one) and divided
    by ``n``. A tensor-parallel parameter (a DTensor on
    another 1-D slice of ``mesh``'s root) is sharded the same way on its tp-local tensor and
    stored on the 2-D mesh (module docstring, "FSDP with tensor parallel"). The parameters
    are new objects, so make the optimizer after this call (as with FSDP2): one made before
    holds the replaced parameters and updates nothing the module reads.

    Args:
        module: the module to shard, modified in place (its class becomes a subclass named
            ``SimpleFSDP<Name>``; each submodule owning parameters sharded here,
            ``Sharded<Name>``); or a list of modules, each sharded as its own unit with the
            same arguments.
        mesh: a 1-D device mesh (FSDP), or a 2-D one (HSDP: parameters replicated over dim 0,
            sharded over dim 1, as FSDP2 with a 2-D mesh; gradients averaged over all of it);
            None: all ranks of the default group on the default device.
        reshard_after_forward: True: the gathered parameters are not kept for the backward,
            which gathers them again (FSDP2's default for blocks); False: autograd keeps them
            from the forward (no second all_gather; more memory); None: FSDP2's meaning,
            True if ``module`` is inside another module ``fully_shard`` is called on (before
            or after this call), else False.
        shard_placement_fn: FSDP2's: called with each parameter to shard (not 0-dim ones, not
            tensor-parallel ones), returns ``Shard(dim)`` (negative dims count from the end)
            to split that dimension instead of dim 0, or None for dim 0. A dimension other
            than 0 must divide evenly over the mesh (as FSDP2 requires).
        mp_policy: FSDP2's mixed precision policy (module docstring, "Mixed precision"):
            ``param_dtype`` for the all_gather and the compute, ``reduce_dtype`` for the
            gradient's reduction, ``output_dtype`` and ``cast_forward_inputs`` for the
            unit's forward; the default casts nothing. Non-floating-point parameters are
            never cast.
        ignored_params: parameters left as they are (FSDP2's): not sharded, read directly,
            their gradients not reduced (each rank keeps its own); by this call and by later
            calls on modules containing them (as FSDP2, which does not look into a unit
            again).

    Returns:
        ``module`` (the list, for a list).

    Raises:
        ValueError: ``mesh`` is neither 1-D nor 2-D, ``reshard_after_forward`` is neither a
            bool nor None (FSDP2's int form is not supported), ``mp_policy`` is not a
            ``MixedPrecisionPolicy`` or names a dtype that is not floating point,
            ``shard_placement_fn`` returns something other than ``Shard`` / None, a dimension
            the parameter does not have or one that does not divide evenly (named, with its
            shape), or a DTensor parameter cannot be sharded over ``mesh`` (named, with its
            mesh, placements and the reason).
    """
    if isinstance(module, (list, tuple)):
        return [fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward,
                            shard_placement_fn=shard_placement_fn, mp_policy=mp_policy,
                            ignored_params=ignored_params) for m in module]
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError("fully_shard: reshard_after_forward must be a bool or None (resharding "
                         f"to a smaller mesh is not supported), got {reshard_after_forward!r}")
    _check_mp_policy(mp_policy)
    mesh = mesh if mesh is not None else _default_mesh()
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard: expected a 1-D mesh (FSDP) or a 2-D one (HSDP: "
                         f"replicate, shard), got {mesh.ndim} dimensions")
    gather = _Gather(mesh, reshard_after_forward, mp_policy)
    ignored = {id(q) for q in ignored_params or ()}
    ignored.update(id(q) for q in module.parameters() if getattr(q, _IGNORED, False))
    # every parameter's placement first, so that a refused one leaves the module untouched
    placement_of = {id(p): _shard_placement(shard_placement_fn, p, where, mesh)
                    for where, p in module.named_parameters()
                    if not isinstance(p, DTensor) and p.dim() > 0 and id(p) not in ignored}
    for q in ignored_params or ():
        # FSDP2 never looks inside a unit again: a later call on a parent ignores it too
        setattr(q, _IGNORED, True)
    for path, sub in list(module.named_modules()):
        inner = vars(type(sub)).get(_UNIT_GATHER) if sub is not module else None
        if inner is not None and inner.reshard_unless_root:   # a unit of an earlier call is
            inner.reshard_after_forward = True                # not a root any more
        sharded_here = vars(type(sub)) if getattr(type(sub), _MADE_HERE, False) else {}
        props = {}
        for name, p in list(sub.named_parameters(recurse=False)):
            if p is None or name in sharded_here or id(p) in ignored:
                continue    # an earlier call on a submodule owns it, or FSDP is to ignore it
            tied = getattr(p, _SHARDED_AS, None)
            if tied is not None:    # the same Parameter registered again (tied weights)
                sub._parameters[name], props[name] = tied[0], _property(name, tied[1])
                continue
            where = f"{path}.{name}".lstrip(".")
            if isinstance(p, DTensor):
                asked = shard_placement_fn(p) if shard_placement_fn is not None else None
                if asked not in (None, Shard(0)):
                    raise ValueError(f"fully_shard: shard_placement_fn returned {asked} for "
                                     f"tensor-parallel parameter {where!r}; only dim 0 (or "
                                     "None) is supported there")
                stored, read = _shard_tensor_parallel(p, where, mesh, gather)
            else:
                # a 0-dim parameter has no dim 0 to split: replicated, its gradient all-reduced
                placements = [Replicate()] * mesh.ndim
                if p.dim() > 0:
                    placements = [*gather.sharded[:-1], placement_of[id(p)]]
                stored, read = distribute_tensor(p.detach(), mesh, placements), gather
            sub._parameters[name] = nn.Parameter(stored, requires_grad=p.requires_grad)
            props[name] = _property(name, read)
            setattr(p, _SHARDED_AS, (sub._parameters[name], read))
        if getattr(type(sub), _MADE_HERE, False):   # a class of an earlier call: extend it
            for name, prop in props.items():
                setattr(type(sub), name, prop)
        elif props or sub is module:
            # the unit (``module``) is named SimpleFSDP<Name>: fcoll's FSDP plan reads units
            # from the graph's module stacks by that prefix (torchtitan's too)
            prefix = CLASS_PREFIX if sub is module else "Sharded"
            sub.__class__ = type(f"{prefix}{type(sub).__name__}", (type(sub),),
                                 {**props, _MADE_HERE: True})
    setattr(type(module), _UNIT_GATHER, gather)
    _mixed_precision_hooks(module, mp_policy)
    if any(_uneven(p) for p in module.parameters() if isinstance(p, DTensor)):
        # ranks with different local shapes must not share compiled artifacts: DTensor's
        # AOTAutograd cache key holds only the global shape (fcoll.ops.cache_key)
        key_caches_per_rank(dist.get_rank())
    return module


def _uneven(t: DTensor) -> bool:
    """Whether ``t``'s ranks may hold local tensors of different shapes: a dimension it is
    sharded along does not divide by that mesh dimension's size."""
    return any(isinstance(pl, Shard) and t.shape[pl.dim] % t.device_mesh.size(i)
               for i, pl in enumerate(t.placements))


def _shard_placement(fn: Callable[[nn.Parameter], Shard | None] | None, p: nn.Parameter,
                     where: str, mesh: DeviceMesh) -> Shard:
    """The ``Shard`` placement of parameter ``p`` (at ``where``) over ``mesh``'s last
    dimension: ``fn(p)``'s, dim 0 when ``fn`` is None or returns None.

    Raises:
        ValueError: ``fn`` returns something else, a dimension ``p`` does not have, or a
            dimension other than 0 that does not divide evenly over the mesh dimension.
    """
    placement = fn(p) if fn is not None else None
    if placement is None:
        return Shard(0)
    if type(placement) is not Shard:
        raise ValueError(f"fully_shard: shard_placement_fn returned {placement!r} for parameter "
                         f"{where!r}; expected Shard(dim) or None (a ShardPlacementResult, "
                         "another mesh per parameter, is not supported)")
    dim, n = placement.dim, mesh.size(mesh.ndim - 1)
    if not -p.dim() <= dim < p.dim():
        raise ValueError(f"fully_shard: shard_placement_fn returned Shard({dim}) for parameter "
                         f"{where!r} of shape {list(p.shape)}, which has no dimension {dim}")
    dim %= p.dim()
    if dim != 0 and p.shape[dim] % n:
        raise ValueError(f"fully_shard: shard_placement_fn returned Shard({dim}) for parameter "
                         f"{where!r} of shape {list(p.shape)}: size {p.shape[dim]} does not "
                         f"divide evenly over {n} ranks (required on a dimension other than "
                         "0, as FSDP2)")
    return Shard(dim)


def _check_mp_policy(mp_policy: MixedPrecisionPolicy) -> None:
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError("fully_shard: mp_policy must be a torch.distributed.fsdp."
                         f"MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, field)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"fully_shard: mp_policy.{field} must be a floating-point "
                             f"torch.dtype or None, got {dtype!r}")
