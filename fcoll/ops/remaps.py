"""Dynamo remaps: legacy in-place ``torch.distributed`` calls compile with no graph break.

Inside ``torch.compile`` these calls become PyTorch's own functional collectives
(``torch.ops._c10d_functional``, the ops PyTorch's remaps emit, so every backend, Inductor's comm
passes included, sees what it would see without fcoll) plus a ``copy_`` into the caller's
tensor; fcoll's backend lowers them to ``torch.ops.fcoll`` (``fcoll.passes.rewrites.lower``). Where
PyTorch's own remap compiles the call (no ``async_op``, PyTorch's shapes), the polyfill calls the
very function PyTorch's remap table names (``traceable_collective_remaps``), so the graph and
the return value are PyTorch's node for node: op packets, names, placeholder order.

The table's other rows (broadcast, reduce, barrier, ``async_op=True``, the ``[n, N, *]`` forms)
are where PyTorch graph-breaks or fails. They compile so only while fcoll's own backend traces
(:func:`compiling_for_fcoll`); under any other backend (``eager``, ``aot_eager``, Inductor,
``torch.export``) the polyfill graph-breaks at the call, or calls PyTorch's remap, as PyTorch
does without fcoll, so ``import fcoll`` changes nothing in another backend's graphs (issue
28.5; PyTorch's ``test_dynamo_graphbreaks_unsupported_async_op`` counts those frames). Under
``backend="fcoll"``:

=================================  ==========================================================
call (group: None, WORLD, a group)  graph
=================================  ==========================================================
``all_reduce(t, op)``               ``t.copy_(wait(all_reduce(t, op)))``
``all_gather_into_tensor(o, i)``,   ``o.copy_(wait(all_gather_into_tensor(i)).reshape(o))``
``_all_gather_base``,               (``o`` may be ``[n * N, *]`` or ``[n, N, *]``, as in torch)
``all_gather_single`` (2.13 on)
``all_gather(ts, i)``               one all_gather; ``ts[r].copy_(chunk r)``
``reduce_scatter_tensor(o, i, op)``,  ``o.copy_(wait(reduce_scatter_tensor(i.reshape(n*N, *))))``
``_reduce_scatter_base``,
``reduce_scatter_single`` (2.13 on)
``all_to_all_single(o, i, os, is)``  ``o.copy_(wait(all_to_all_single(i, os, is)))``; a None
                                    split list is an even split of that tensor's dim 0
``broadcast(t, src)``               ``t.copy_(wait(broadcast(t, group rank of src)))``
``reduce(t, dst, op)``              ``r = wait(all_reduce(t, op))``; ``t.copy_(r)`` on ``dst``
                                    only (see below)
``barrier()``                       ``wait(all_reduce(zeros(1), "sum"))``
=================================  ==========================================================

``async_op=True`` returns a traced work object (:class:`TracedWork`); the ``wait_tensor`` and the
``copy_`` are emitted where ``work.wait()`` is called, so the compute traced in between can run
while the collective is in flight. A work that leaves its frame (returned, or appended to a list
by a gradient hook that compiled autograd traces) is waited on later, in eager code or in a
frame another backend compiles, by fcoll's ``wait_tensor``, which finds fcoll's collective in
the in-flight registry, then the copies run (PyTorch's ``_c10d_functional.wait_tensor`` does not
know fcoll's collectives: the copies read an output still being written). A work that is never
waited on leaves its tensor unchanged (eager PyTorch leaves it unspecified until a wait).

``reduce``: PyTorch leaves the tensor on non-``dst`` ranks unspecified (gloo, measured with 2 and
3 ranks, leaves partial sums in it). fcoll reduces with an all_reduce and copies the result on
``dst`` only, so non-``dst`` tensors are left unchanged: a deterministic choice inside what
PyTorch allows. It costs an all_reduce instead of a reduce; a reduce has no functional op.

Reduce ops: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR map to "sum", "avg", "product", "min",
"max", "band", "bor", "bxor". Any other op (PREMUL_SUM, a ``_make_nccl_premul_sum`` op) raises
``ValueError`` while tracing (Dynamo wraps it in ``InternalTorchDynamoError``), naming the call
and the op, rather than compiling to a wrong sum.

Mechanism: each legacy function gets a polyfill through
``torch._dynamo.decorators.substitute_in_graph``. Dynamo's ``VariableBuilder`` looks functions up
in its id-dispatch map (where polyfills live) *before* it checks
``torch.distributed._functional_collectives.traceable_collective_remaps``, so the polyfill wins for
the functions PyTorch remaps too (PyTorch's remap graph-breaks on ``async_op=True`` in
``CollectiveFunctionRewriteVariable.call_function`` and has no entry for broadcast, reduce and
barrier). That remap table resolves a replacement by its ``__name__`` inside
``torch.distributed._functional_collectives`` (``_traceable_collectives_source`` builds an
``AttrSource`` on that module from ``fn.__name__``), so extending it would have meant adding
attributes to PyTorch's module and would still graph-break on ``async_op=True``; the polyfill
route avoids both. Calls PyTorch's own remap still handles (``isend``, ``irecv``,
``batch_isend_irecv``) produce ``_c10d_functional`` ops; ``lower_c10d_functional`` lowers what
has an fcoll twin.

:func:`install` runs on ``import fcoll`` (from ``fcoll.ops``) and is idempotent. It checks the
hooks it relies on first and raises ``ImportError`` naming what moved if a PyTorch version lacks
one, and ``TypeError`` (from ``substitute_in_graph``) if a legacy signature changed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _funcol

from fcoll import compat
from fcoll.ops.groups import group_from_name, group_rank, group_size

__all__ = ["install", "installed", "REMAPPED", "reduce_op_name", "group_rank_of", "rank_in",
           "FCOLL_BACKEND_ATTR", "is_fcoll_backend", "compiling_for_fcoll"]

log = logging.getLogger(__name__)

# PyTorch's namespace, not fcoll's: the graphs stay what PyTorch's own remaps would make.
_F = torch.ops._c10d_functional
_RO = dist.ReduceOp

_REDUCE_NAMES = {
    _RO.SUM: "sum", _RO.AVG: "avg", _RO.PRODUCT: "product", _RO.MIN: "min", _RO.MAX: "max",
    _RO.BAND: "band", _RO.BOR: "bor", _RO.BXOR: "bxor",
}



def _reduce_key(op: Any) -> Any:
    for key in _REDUCE_NAMES:
        if op is key or op == key:  # ``ReduceOp(MAX) == ReduceOp.MAX`` holds in c10d
            return key
    return None


@torch.compiler.assume_constant_result
def reduce_op_name(op: Any, call: str = "all_reduce") -> str:
    """The fcoll reduce-op string of a ``dist.ReduceOp`` (run once, at trace time).

    ``call`` names the ``torch.distributed`` function, for the error message.

    Raises:
        ValueError: ``op`` has no fcoll equivalent: ``PREMUL_SUM``, a premul-sum ``ReduceOp``
            made by ``_make_nccl_premul_sum``, or anything that is not a reduce op.
    """
    key = _reduce_key(op)
    if key is None:
        raise ValueError(f"fcoll: cannot compile torch.distributed.{call} with reduce op "
                         f"{op!r}: supported ops are SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, "
                         f"BXOR (PREMUL_SUM and premul-sum ReduceOps are not supported)")
    return _REDUCE_NAMES[key]


# The trace-time helpers below take the group's name, not the group: Dynamo 2.11 wraps a
# ProcessGroup subclass (fcoll's backend) as a plain object, which it cannot pass to them.
@torch.compiler.assume_constant_result
def group_rank_of(group_name: str, global_rank: int) -> int:
    """Rank inside the group of the global rank ``global_rank`` (run once, at trace time)."""
    return dist.get_group_rank(group_from_name(group_name), global_rank)


@torch.compiler.assume_constant_result
def rank_in(group_name: str) -> int:
    """This process's rank inside the group (run once, at trace time)."""
    return group_rank(group_name)


@torch.compiler.assume_constant_result
def _barrier_device(group_name: str) -> str:
    """"cuda" for an nccl group (it has no CPU tensors), else "cpu" (run once, at trace time)."""
    try:
        return "cuda" if group_from_name(group_name)._get_backend_name() == "nccl" else "cpu"
    except (AttributeError, RuntimeError):
        return "cpu"


#: The attribute that marks a Dynamo backend as fcoll's (``fcoll.compile.backend`` sets it on
#: ``fcoll_backend``); the remaps find it through the wrappers Dynamo and its test helpers put
#: around a backend (``_torchdynamo_orig_backend``, ``compiler_fn``, ``backend``, ``__wrapped__``,
#: ``functools.partial.func``), or its registered name ``"fcoll"`` where a wrapper keeps the
#: name (``torch._dynamo.testing.CompileCounterWithBackend("fcoll")``).
FCOLL_BACKEND_ATTR = "__fcoll_backend__"
_BACKEND_WRAPPER_ATTRS = ("_torchdynamo_orig_backend", "compiler_fn", "backend", "__wrapped__",
                          "func")


def is_fcoll_backend(backend: Any) -> bool:
    """True if ``backend`` is fcoll's compile backend or wraps it (a bounded walk)."""
    seen: set[int] = set()
    todo = [backend]
    while todo and len(seen) < 64:
        fn = todo.pop()
        if isinstance(fn, str) and fn == "fcoll":
            return True
        if fn is None or isinstance(fn, str) or id(fn) in seen:
            continue
        seen.add(id(fn))
        if getattr(fn, FCOLL_BACKEND_ATTR, False) is True:
            return True
        todo.extend(getattr(fn, attr, None) for attr in _BACKEND_WRAPPER_ATTRS)
    return False


@torch.compiler.assume_constant_result
def compiling_for_fcoll() -> bool:
    """True while Dynamo traces for fcoll's backend (run once, at trace time).

    Dynamo keys its cache entries on the backend (a backend-match guard), so a frame compiled
    for another backend is traced again, and asks again, under fcoll's.
    """
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    return tx is not None and is_fcoll_backend(tx.output.compiler_fn)


def _unless_fcoll_graph_break() -> None:
    """Graph-break here, at the legacy call, unless fcoll's backend traces: what Dynamo does
    without fcoll where PyTorch has no remap (broadcast, reduce, barrier) or refuses one
    (``async_op=True``: ``CollectiveFunctionRewriteVariable`` calls ``unimplemented``)."""
    if not compiling_for_fcoll():
        torch._dynamo.graph_break()


def _root(group: Any, global_rank: Any, group_rank: Any, call: str, arg: str) -> int:
    """The root's rank inside ``group``: ``group_<arg>`` if given, else that of global ``arg``."""
    if group_rank is not None:
        return group_rank
    if global_rank is None:
        raise ValueError(f"fcoll: dist.{call} needs {arg} or group_{arg}")
    return group_rank_of(group.group_name, global_rank)


class TracedWork:
    """The ``Work`` an ``async_op=True`` call returns while Dynamo traces.

    Holds the collective's output (not yet waited on) and where its values go: ``copies`` is a
    list of ``(dst, lo, hi)``; ``dst`` receives rows ``lo:hi`` of the waited result (all of it
    when ``lo`` is None), reshaped to ``dst``'s shape. :meth:`wait` emits ``wait_tensor`` and the
    copies at the place it is called, once.
    """

    def __init__(self, result: torch.Tensor, copies: list) -> None:
        self._result = result
        self._copies = copies
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            self._done = True
            _finish(self._result, self._copies)
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done


def _finish(result: torch.Tensor, copies: list) -> None:
    if torch.compiler.is_compiling() and compiling_for_fcoll():
        waited = _F.wait_tensor(result)   # lowered to fcoll's with the collective
    else:   # a work that left its frame, waited on in eager code or another backend's graph
        waited = torch.ops.fcoll.wait_tensor(result)
    for dst, lo, hi in copies:
        src = waited if lo is None else waited[lo:hi]
        if src.shape != dst.shape:  # [n * N, *] results into [n, N, *] outputs, 0-dim chunks
            src = src.reshape(dst.shape)
        dst.copy_(src)


def _complete(result: torch.Tensor, copies: list, async_op: bool) -> TracedWork | None:
    if async_op:
        return TracedWork(result, copies)
    _finish(result, copies)
    return None


#: torch.distributed name -> what PyTorch's own Dynamo remap calls for it (the 2.13
#: ``_remapped_*`` wrappers returning None; 2.11's ``*_inplace`` functions returning the
#: ``copy_``), read once here: a polyfill calling it records PyTorch's graph node for node.
_TORCH_REMAP = {name: _funcol.traceable_collective_remaps[getattr(dist, name)]
                for name in ("all_reduce", "all_gather_into_tensor", "all_gather",
                             "reduce_scatter_tensor", "all_to_all_single")}


def _world(group: Any) -> Any:
    return dist.group.WORLD if group is None else group


# ---------------------------------------------------------------------------------------------
# Polyfills: same signatures and defaults as the torch.distributed functions they stand for.

def all_reduce(tensor, op=_RO.SUM, group=None, async_op=False):
    """``dist.all_reduce``: ``tensor [*]`` is replaced by the reduction over the group."""
    group = _world(group)
    if not async_op:
        return _TORCH_REMAP["all_reduce"](tensor, reduce_op_name(op), group.group_name)
    _unless_fcoll_graph_break()
    r = _F.all_reduce(tensor, reduce_op_name(op), group.group_name)
    return _complete(r, [(tensor, None, None)], async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """``dist.all_gather_into_tensor``: ``input [N, *]`` -> ``output [n * N, *]`` or ``[n, N, *]``."""
    group = _world(group)
    name = group.group_name
    if not async_op and (output_tensor.dim() == input_tensor.dim()  # not [n, N, *]
                         or not compiling_for_fcoll()):
        return _TORCH_REMAP["all_gather_into_tensor"](output_tensor, input_tensor, name)
    _unless_fcoll_graph_break()
    r = _F.all_gather_into_tensor(input_tensor, group_size(name), name)
    return _complete(r, [(output_tensor, None, None)], async_op)


def _all_gather_base(output_tensor, input_tensor, group=None, async_op=False):
    """``dist._all_gather_base``: as :func:`all_gather_into_tensor`."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
    """``dist.all_gather_single`` (2.13's name for all_gather_into_tensor): the same."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """``dist.all_gather``: ``tensor_list[r] <- rank r's tensor``; one all_gather, then copies.

    Every entry of ``tensor_list`` must have ``tensor``'s shape (as gloo and nccl require).
    """
    group = _world(group)
    if not async_op:
        return _TORCH_REMAP["all_gather"](tensor_list, tensor, group.group_name)
    _unless_fcoll_graph_break()
    n = group_size(group.group_name)
    rows = tensor.shape[0] if tensor.dim() > 0 else 1
    r = _F.all_gather_into_tensor(tensor, n, group.group_name)
    return _complete(r, [(t, i * rows, (i + 1) * rows) for i, t in enumerate(tensor_list)],
                     async_op)


def reduce_scatter_tensor(output, input, op=_RO.SUM, group=None, async_op=False):
    """``dist.reduce_scatter_tensor``: ``input [n * N, *]`` or ``[n, N, *]`` -> ``output [N, *]``."""
    group = _world(group)
    if not async_op and (input.dim() == output.dim()  # not [n, N, *]
                         or not compiling_for_fcoll()):
        return _TORCH_REMAP["reduce_scatter_tensor"](
            output, input, reduce_op_name(op, "reduce_scatter_tensor"), group.group_name)
    _unless_fcoll_graph_break()
    reduce_op = reduce_op_name(op, "reduce_scatter_tensor")
    n = group_size(group.group_name)
    flat = input.reshape(n * output.shape[0], *output.shape[1:]) if output.dim() > 0 else input
    r = _F.reduce_scatter_tensor(flat, reduce_op, n, group.group_name)
    return _complete(r, [(output, None, None)], async_op)


def _reduce_scatter_base(output, input, op=_RO.SUM, group=None, async_op=False):
    """``dist._reduce_scatter_base``: as :func:`reduce_scatter_tensor`."""
    return reduce_scatter_tensor(output, input, op, group, async_op)


def reduce_scatter_single(output, input, op=_RO.SUM, group=None, async_op=False):
    """``dist.reduce_scatter_single`` (2.13's name for reduce_scatter_tensor): the same."""
    return reduce_scatter_tensor(output, input, op, group, async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    """``dist.all_to_all_single``: ``input [sum(in_splits), *] -> output [sum(out_splits), *]``.

    A None split list splits that tensor's dim 0 evenly over the group, as PyTorch does.
    """
    group = _world(group)
    if not async_op:
        return _TORCH_REMAP["all_to_all_single"](output, input, output_split_sizes,
                                                 input_split_sizes, group.group_name)
    _unless_fcoll_graph_break()
    n = group_size(group.group_name)
    out_splits = (list(output_split_sizes) if output_split_sizes is not None
                  else [output.shape[0] // n] * n)
    in_splits = (list(input_split_sizes) if input_split_sizes is not None
                 else [input.shape[0] // n] * n)
    r = _F.all_to_all_single(input, out_splits, in_splits, group.group_name)
    return _complete(r, [(output, None, None)], async_op)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """``dist.broadcast``: every rank's ``tensor`` <- the root's (``src`` global rank, or
    ``group_src`` rank inside ``group``)."""
    _unless_fcoll_graph_break()
    group = _world(group)
    root = _root(group, src, group_src, "broadcast", "src")
    r = _F.broadcast(tensor, root, group.group_name)
    return _complete(r, [(tensor, None, None)], async_op)


def reduce(tensor, dst=None, op=_RO.SUM, group=None, async_op=False, group_dst=None):
    """``dist.reduce``: the root's ``tensor`` <- the reduction; other ranks' tensors unchanged.

    Compiled as an all_reduce whose result is copied on the root only (module docstring).
    """
    _unless_fcoll_graph_break()
    group = _world(group)
    root = _root(group, dst, group_dst, "reduce", "dst")
    r = _F.all_reduce(tensor, reduce_op_name(op, "reduce"), group.group_name)
    copies = [(tensor, None, None)] if rank_in(group.group_name) == root else []
    return _complete(r, copies, async_op)


def barrier(group=None, async_op=False, device_ids=None, timeout=None):
    """``dist.barrier``: a one-element all_reduce and its wait (every rank must arrive)."""
    _unless_fcoll_graph_break()
    group = _world(group)
    r = _F.all_reduce(torch.zeros(1, device=_barrier_device(group.group_name)), "sum",
                      group.group_name)
    return _complete(r, [], async_op)


#: torch.distributed function -> fcoll polyfill (``all_gather_single`` and
#: ``reduce_scatter_single`` only on a torch that has them, 2.13 on).
REMAPPED: dict[Any, Any] = compat.dist_polyfills({
    "all_reduce": all_reduce,
    "all_gather_into_tensor": all_gather_into_tensor,
    "_all_gather_base": _all_gather_base,
    "all_gather_single": all_gather_single,
    "all_gather": all_gather,
    "reduce_scatter_tensor": reduce_scatter_tensor,
    "_reduce_scatter_base": _reduce_scatter_base,
    "reduce_scatter_single": reduce_scatter_single,
    "all_to_all_single": all_to_all_single,
    "broadcast": broadcast,
    "reduce": reduce,
    "barrier": barrier,
})


# ---------------------------------------------------------------------------------------------
# Installation

def _hooks():
    """The Dynamo hooks the remaps use; ImportError naming what moved if one is gone."""
    try:
        from torch._dynamo.decorators import substitute_in_graph
        from torch._dynamo.variables.builder import VariableBuilder
        from torch._dynamo.variables.functions import PolyfilledFunctionVariable
    except ImportError as e:
        raise ImportError(f"fcoll remaps: a Dynamo hook moved in torch {torch.__version__}: "
                          f"{e} (fcoll needs torch._dynamo.decorators.substitute_in_graph, "
                          f"torch._dynamo.variables.builder.VariableBuilder and "
                          f"torch._dynamo.variables.functions.PolyfilledFunctionVariable)") from e
    for owner, attr in ((VariableBuilder, "_id_dispatch"),
                        (PolyfilledFunctionVariable, "_get_polyfill_handlers")):
        if not callable(getattr(owner, attr, None)):
            raise ImportError(f"fcoll remaps: {owner.__module__}.{owner.__qualname__}.{attr} is "
                              f"gone in torch {torch.__version__}; Dynamo's polyfill hook moved")
    return substitute_in_graph, VariableBuilder, PolyfilledFunctionVariable


def _ours(handler: Any) -> bool:
    return getattr(handler, "__torch_dynamo_polyfill__", None) in REMAPPED.values()


def installed() -> bool:
    """True if every remap is installed (Dynamo will trace fcoll's polyfills)."""
    _, builder, polyfilled = _hooks()
    handlers = polyfilled._get_polyfill_handlers()
    return all(_ours(handlers.get(fn)) and id(fn) in builder._id_dispatch() for fn in REMAPPED)


def install() -> None:
    """Register every polyfill with Dynamo (idempotent; runs on ``import fcoll``).

    Raises:
        ImportError: a Dynamo hook this relies on is gone (names it).
        RuntimeError: another library already polyfills one of the functions.
        TypeError: a torch.distributed signature changed (from ``substitute_in_graph``).
    """
    substitute_in_graph, builder, polyfilled = _hooks()
    compat.let_dynamo_trace_reduce_ops()
    handlers = polyfilled._get_polyfill_handlers()
    for fn, poly in REMAPPED.items():
        existing = handlers.get(fn)
        if existing is not None:
            if not _ours(existing):
                raise RuntimeError(f"fcoll remaps: torch.distributed.{fn.__name__} is already "
                                   f"polyfilled by {existing!r}; refusing to replace it")
            continue
        substitute_in_graph(fn)(poly)
        log.debug("remaps: Dynamo traces fcoll's polyfill for torch.distributed.%s", fn.__name__)
    missing = [fn.__name__ for fn in REMAPPED if id(fn) not in builder._id_dispatch()]
    if missing:
        raise ImportError(f"fcoll remaps: installing the polyfills did not reach Dynamo's "
                          f"VariableBuilder id dispatch for {missing} (torch "
                          f"{torch.__version__}); the hook moved")


install()
