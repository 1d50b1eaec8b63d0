"""What fcoll uses from torch that not every supported torch has (2.11 to 2.13).

Each name here is feature-detected once, at import; the rest of fcoll imports it from this module
and has no version checks of its own. What torch 2.11 lacks, and the stand-in used there:

=====================================  ============================================================
torch 2.13                             torch 2.11
=====================================  ============================================================
``torch.Tag.inplace``, ``Tag.out``     no tag (the empty tuple)
AOTAutograd functionalizes in-place    it rejects them ("a custom (non-ATen) operator whose output
and out= custom ops (they return an    has alias annotations"): :func:`functionalize_as_twins`
alias of a mutated argument) with      gives each such op a Functionalize kernel that calls its
``auto_functionalized_v2``             functional twin
``dist.all_gather_single``             ``dist.all_gather_into_tensor`` (same signature and
                                       behaviour; 2.13 renamed it and deprecates the old name)
``dist.reduce_scatter_single``         ``dist.reduce_scatter_tensor`` (likewise)
``dist.barrier(..., timeout)``         no ``timeout`` parameter (see :func:`dist_polyfills`)
``_c10d_functional`` ops take ``Any``   ``str group_name`` only: :data:`GROUP_NAME_TYPE`
``group_name`` (a name or a group)      (fcoll: ``str`` always, ``.group`` for ``Any``)
Dynamo traces pybind11 enum members    "SourcelessBuilder.create does not know how to wrap
(``dist.ReduceOp.SUM``) as constants   RedOpType": :func:`let_dynamo_trace_reduce_ops`
=====================================  ============================================================
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping

import torch
import torch._dynamo.eval_frame as _dynamo_eval_frame
import torch.distributed as dist
from torch.utils import _pytree as pytree

try:  # what torch's disable wrapper calls (eager_entry_point); torch's wrapper where absent
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
except ImportError:
    _set_eval_frame = None

__all__ = ["INPLACE_TAGS", "OUT_TAGS", "GROUP_NAME_TYPE", "AUTO_FUNCTIONALIZES_ALIASED_RETURNS",
           "takes_a_group_object", "functionalize_as_twins", "all_gather_single",
           "reduce_scatter_single", "dist_polyfills", "let_dynamo_trace_reduce_ops"]


def _tags(name: str) -> tuple[torch.Tag, ...]:
    tag = getattr(torch.Tag, name, None)
    return () if tag is None else (tag,)


#: Tags for an in-place op (``op_(Tensor(a!) self, ...) -> Tensor(a!)``): ``(torch.Tag.inplace,)``,
#: or ``()`` on a torch without that tag.
INPLACE_TAGS = _tags("inplace")

#: Tags for an out= op (``op(..., *, Tensor(a!) out) -> Tensor(a!)``): ``(torch.Tag.out,)``,
#: or ``()``.
OUT_TAGS = _tags("out")

#: Whether AOTAutograd wraps in-place / out= custom ops in ``auto_functionalized_v2`` (2.13); the
#: tags came with that support (``is_inplace`` / ``is_out`` in ``can_auto_functionalize``).
AUTO_FUNCTIONALIZES_ALIASED_RETURNS = bool(INPLACE_TAGS and OUT_TAGS)


def functionalize_as_twins(lib: torch.library.Library, twins: Mapping[str, str], *,
                           always: bool = False) -> None:
    """Let AOTAutograd functionalize ``lib``'s in-place and out= ops on a torch that cannot.

    ``twins`` maps each op (``all_reduce_``, returning ``Tensor(a!)``) to its functional twin in the
    same namespace (``all_reduce``), which takes the same arguments less a keyword-only ``out``;
    the namespace has a ``wait_tensor(Tensor) -> Tensor``.
    Where torch auto-functionalizes such ops (2.13: ``auto_functionalized_v2``, given the
    ``inplace`` / ``out`` tags) this does nothing. Elsewhere each op gets a ``Functionalize``
    kernel that calls the twin on the unwrapped arguments and makes its result the new value of the
    mutated argument, as PyTorch's ``CppFunctionalizeAPI`` does for higher-order ops: the traced
    graph holds ``r = all_reduce(x)`` where 2.13's holds ``auto_functionalized_v2(all_reduce_, x)``
    (the same graph once ``lower_c10d_functional`` has rewritten that), and a mutated graph input
    is copied back at the end. A mutated *view* (``all_reduce_(y[1:])``) is written back into its
    base by a copy that would read the collective's buffer before it is filled, so there the kernel
    waits first (``wait_tensor`` of the twin's result): the values are right, the collective is
    not overlapped (2.13 keeps it asynchronous as ``auto_functionalized_v2``). A mutated
    ``Tensor[](a!)`` argument (returned as ``Tensor[](a!)``) is handled element by element.

    ``always``: install the kernels on every torch, for ops no torch auto-functionalizes
    (aliased list returns).
    """
    if AUTO_FUNCTIONALIZES_ALIASED_RETURNS and not always:
        return
    ns = getattr(torch.ops, lib.ns)
    for name, twin in twins.items():
        lib.impl(name, _twin_kernel(getattr(ns, name).default, getattr(ns, twin).default,
                                    ns.wait_tensor.default), "Functionalize")


def _twin_kernel(op: torch._ops.OpOverload, twin: torch._ops.OpOverload,
                 wait: torch._ops.OpOverload) -> Callable[..., Any]:
    mutated = next(i for i, a in enumerate(op._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write)
    arg = op._schema.arguments[mutated]

    def unwrap(t: torch.Tensor) -> torch.Tensor:
        torch._functionalize_sync(t)
        return torch._from_functional_tensor(t)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        target = kwargs.pop(arg.name) if arg.kwarg_only else args[mutated]
        targets = list(target) if isinstance(target, (list, tuple)) else [target]
        args, kwargs = pytree.tree_map_only(torch.Tensor, unwrap, (args, kwargs))
        with torch._C._ExcludeDispatchKeyGuard(
                torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
            result = twin(*args, **kwargs)
            results = list(result) if isinstance(result, (list, tuple)) else [result]
            results = [wait(r) if torch._C._functionalization.get_view_meta_sequence(t) else r
                       for t, r in zip(targets, results)]
        for t, r in zip(targets, results):
            torch._functionalize_replace(t, r)
            torch._functionalize_commit_update(t)
            torch._functionalize_sync(t)
        return target
    return kernel


def takes_a_group_object(name: str) -> bool:
    """Whether torch's ``_c10d_functional.<name>`` types ``group_name`` ``Any`` (a name or a
    ``ProcessGroup``: 2.13's collectives); False for ``str`` and for an op torch lacks."""
    import torch.distributed._functional_collectives  # noqa: F401  defines _c10d_functional ops

    twin = getattr(torch.ops._c10d_functional, name, None)
    return twin is not None and any(a.name == "group_name" and isinstance(a.type, torch.AnyType)
                                    for a in twin.default._schema.arguments)


#: Schema type of ``group_name`` in torch's own ``_c10d_functional`` collectives: ``"Any"`` on
#: 2.13 (a group name or a ``ProcessGroup``), ``"str"`` before. fcoll's default overloads take
#: ``str`` on every torch, and where this is ``"Any"`` an overload ``.group`` takes the group
#: object (:data:`fcoll.ops.schemas.GROUP_OVERLOADS`).
GROUP_NAME_TYPE = "Any" if takes_a_group_object("all_reduce") else "str"


#: ``dist.all_gather_single(output [n * N, *], input [N, *], group, async_op)``; before torch 2.13
#: the same function is ``dist.all_gather_into_tensor``.
all_gather_single: Callable[..., Any] = getattr(dist, "all_gather_single",
                                                dist.all_gather_into_tensor)

#: ``dist.reduce_scatter_single(output [N, *], input [n * N, *], op, group, async_op)``; before
#: torch 2.13 the same function is ``dist.reduce_scatter_tensor``.
reduce_scatter_single: Callable[..., Any] = getattr(dist, "reduce_scatter_single",
                                                    dist.reduce_scatter_tensor)


def dist_polyfills(by_name: Mapping[str, Callable[..., Any]]) -> dict[Callable[..., Any], Any]:
    """Key polyfills (``torch.distributed`` function name -> polyfill) by the function itself.

    Names this torch lacks are left out (``all_gather_single`` and ``reduce_scatter_single``
    before 2.13). A polyfill written for 2.13 may take optional parameters an older function lacks
    (``barrier``'s ``timeout``); its ``__signature__`` then drops them, since Dynamo's
    ``substitute_in_graph`` requires the same parameter names and defaults. Any other difference is
    left for ``substitute_in_graph`` to reject (``TypeError``).
    """
    out = {}
    for name, poly in by_name.items():
        fn = getattr(dist, name, None)
        if fn is not None:
            out[fn] = _trim_signature(poly, fn)
    return out


def _trim_signature(poly: Callable[..., Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    theirs = inspect.signature(fn).parameters
    sig = inspect.signature(poly)
    kept = [p for p in sig.parameters.values()
            if p.name in theirs or p.default is inspect.Parameter.empty]
    if len(kept) < len(sig.parameters):
        poly.__signature__ = sig.replace(parameters=kept)
    return poly


def let_dynamo_trace_reduce_ops() -> None:
    """Let Dynamo treat reduce ops (``ReduceOp.SUM``, a ``ReduceOp`` object) as constants.

    Dynamo 2.13 wraps any pybind11 enum member as a constant
    (``torch._dynamo.utils.is_pybind11_enum_member``); 2.11 raises "Unexpected type in sourceless
    builder" on one, such as the ``op=ReduceOp.SUM`` default of the remap polyfills, and cannot
    pass a ``ReduceOp`` object (``dist._make_nccl_premul_sum(2.0)``) to ``reduce_op_name``. There
    both types join ``torch._dynamo.utils.common_constant_types``, as PyTorch lists its own
    pybind11 enums (``SDPBackend``); values are guarded by equality. Idempotent; a no-op on 2.13.
    """
    import torch._dynamo.utils as dynamo_utils

    if not hasattr(dynamo_utils, "is_pybind11_enum_member"):
        dynamo_utils.common_constant_types.update((dist.ReduceOp.RedOpType, dist.ReduceOp))


#: Underscore methods that c10d's Python wrappers call on a process group (the others of fcoll's
#: classes are internal helpers and are not wrapped: each wrapper costs ~0.2 us per call).
C10D_PRIVATE_ENTRY_POINTS = frozenset({
    "_start_coalescing", "_end_coalescing", "_allgather_base", "_reduce_scatter_base",
    "_set_sequence_number_for_group", "_get_sequence_number_for_group", "_get_backend_name",
    "_set_group_name", "_set_group_desc", "_get_backend", "_register_backend",
})


def eager_entry_point(fn: Callable[..., Any], reason: str) -> Callable[..., Any]:
    """``torch._dynamo.disable(fn, reason=reason)`` at a third of its cost per eager call.

    To Dynamo the result is torch's wrapper: it carries the same ``_torchdynamo_*`` attributes
    (``_torchdynamo_disable``, its message, ``_torchdynamo_orig_callable`` = ``fn``), so a
    traced call graph-breaks and runs it eagerly. Called, it does what torch's wrapper does in
    the default stance outside ``torch.export`` (no callback inside ``fn``: nothing it calls is
    compiled; the caller's callback back afterwards) without the per-call stance, export and
    name look-ups that make torch's cost about 0.6-0.9 us against 0.2-0.3 us here (measured on
    this machine class, a no-op function). Under another stance (``torch.compiler.set_stance``)
    or while exporting it calls torch's wrapper itself. A collective pays this twice per
    synchronous call (the group's method and its ``Work.wait``).
    """
    slow = torch._dynamo.disable(fn, reason=reason)
    if _set_eval_frame is None:
        return slow

    def entry(*args, **kwargs):
        if _dynamo_eval_frame._stance.stance != "default" or torch.compiler._is_exporting_flag:
            return slow(*args, **kwargs)
        prior = _set_eval_frame(None)
        try:
            return fn(*args, **kwargs)
        finally:
            _set_eval_frame(prior)

    functools.update_wrapper(entry, fn)
    for attr, value in vars(slow).items():
        if attr.startswith("_torchdynamo_"):
            setattr(entry, attr, value)
    entry._torchdynamo_wrapper_id = id(entry)
    return entry


def run_eagerly_under_dynamo(cls: type, *, keep: tuple[str, ...] = ("size", "rank")) -> type:
    """Class decorator: every method of ``cls`` and of its fcoll bases runs eagerly when compiled
    code calls it.

    A Python ``dist.ProcessGroup`` (or ``dist.Work``) subclass looks to Dynamo like the C++ class
    it derives from, but its methods are Python code, which Dynamo would inline. Inlining a
    collective is wrong (it has side effects on other ranks) and, on torch 2.13, fails at the first
    private attribute, since ``ProcessGroup`` is an opaque reference type whose only traceable
    members are ``size``, ``rank``, ``group_name`` and ``group_desc``
    (``torch.distributed.device_mesh``'s ``register_opaque_type``). Wrapping each method in
    ``torch._dynamo.disable`` (:func:`eager_entry_point`) makes a call graph-break and run
    eagerly, as a call to gloo's C++ methods does. ``keep`` names the methods left alone (read
    at trace time for real; wrapping them would only add ~0.2 us to every eager call). Dunder
    methods, and underscore methods other than :data:`C10D_PRIVATE_ENTRY_POINTS`, are left
    alone.

    The methods are those ``cls`` resolves along its MRO to a class defined in fcoll (its mixins
    included; never ``dist.ProcessGroup``, ``dist.Work`` or ``object``), so a mixin is an ordinary
    class: the wrapper is set on ``cls``, the mixin itself is unchanged. A method already wrapped
    (inherited from a decorated fcoll class) is not wrapped again.
    """
    seen: set[str] = set()
    for klass in cls.__mro__:
        ours = klass.__module__.split(".")[0] == "fcoll"
        for name, value in list(vars(klass).items()):
            if name in seen:
                continue   # overridden by a class earlier in the MRO
            seen.add(name)
            if not ours or name.startswith("__") or name in keep or not inspect.isfunction(value):
                continue
            if name.startswith("_") and name not in C10D_PRIVATE_ENTRY_POINTS:
                continue   # an internal helper: only ever called from an already-disabled method
            if getattr(value, "_torchdynamo_disable", False):
                continue   # inherited from an fcoll class that is decorated already
            setattr(cls, name, eager_entry_point(
                value, f"fcoll: {cls.__name__}.{name} is a collective's eager entry point"))
    if issubclass(cls, dist.ProcessGroup):
        _let_dynamo_211_see_a_process_group(cls)
    return cls


_PROCESS_GROUP_CLASSES: set[type] = set()


def _let_dynamo_211_see_a_process_group(cls: type) -> None:
    """Make Dynamo 2.11 wrap instances of ``cls`` as it wraps c10d's own ``ProcessGroup``.

    Dynamo 2.11's ``ProcessGroupVariable.is_process_group`` accepts the exact C++ class only
    (``istype``), so a Python subclass became a user-defined object: ``group.size()`` still
    traced (by inlining), but ``dist.get_world_size(group)`` and ``dist.get_rank(group)``, which
    Dynamo constant-folds for a ``ProcessGroupVariable``, failed under ``fullgraph=True``. The
    check is widened to the classes registered here, guarded by identity as for c10d's groups.
    2.13 has no ``ProcessGroupVariable`` (every subclass is an opaque reference): a no-op there.
    """
    try:
        from torch._dynamo.variables.distributed import ProcessGroupVariable
    except ImportError:
        return
    if not _PROCESS_GROUP_CLASSES:
        exact = ProcessGroupVariable.is_process_group

        def is_process_group(value: object) -> bool:
            return exact(value) or type(value) in _PROCESS_GROUP_CLASSES

        ProcessGroupVariable.is_process_group = staticmethod(is_process_group)
    _PROCESS_GROUP_CLASSES.add(cls)


def optimization_hint(x: Any, fallback: int) -> int:
    """An int estimate of ``x`` (an int or ``SymInt``, possibly data-dependent) that never guards.

    torch 2.13's ``torch.fx.experimental.symbolic_shapes.optimization_hint``: the shape env's
    hint, else each unbacked symbol replaced by ``fallback`` clamped to its value range. torch
    2.11 lacks it; there the same rule is applied here (``ShapeEnv.size_hint(allow_none=True)``,
    then the clamped substitution, as Inductor's ``unbacked_symint_fallback`` does).
    """
    from torch.fx.experimental import symbolic_shapes

    if not isinstance(x, torch.SymInt):
        return int(x)
    native = getattr(symbolic_shapes, "optimization_hint", None)
    if native is not None:
        return int(native(x, fallback=fallback))
    node = x.node
    if node.hint is not None:
        return int(node.hint)
    env, expr = node.shape_env, node.expr
    hint = env.size_hint(expr, allow_none=True)
    if hint is not None:
        return int(hint)
    backed = getattr(env, "backed_var_to_val", None) or getattr(env, "var_to_val", {})
    expr = expr.xreplace(backed)   # backed symbols: their hints
    subs = {}
    for sym in expr.free_symbols:
        value = fallback
        vr = env.var_to_range.get(sym)
        if vr is not None:
            lower, upper = _finite_int(vr.lower), _finite_int(vr.upper)
            if lower is not None:
                value = max(value, lower)
            if upper is not None:
                value = min(value, upper)
        subs[sym] = value
    return int(expr.xreplace(subs))


def _finite_int(bound: Any) -> int | None:
    """A value-range bound as an int, None when infinite (sympy's ``oo`` or torch's ``int_oo``)."""
    try:
        return int(bound)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None
