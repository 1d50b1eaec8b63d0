"""Graph queries: the one place that knows what a collective, a wait and a bucket key look like.

Passes never match on node names or op-name strings; they ask this module. Both namespaces are
understood: ``torch.ops.fcoll`` and ``torch.ops._c10d_functional`` (same schemas), so every pass
works on graphs produced by PyTorch's own tracing too.

A *collective* is a ``call_function`` node whose target is a collective op (functional,
coalesced, in-place or ``_out``). Its result is consumed by ``wait_tensor`` nodes, directly or,
for the coalesced ops that return a list, through ``operator.getitem``.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from fcoll.ops.facts import OPS

__all__ = [
    "NAMESPACES", "META_ESTIMATED_US", "META_HIDING", "META_EXPOSED_US", "META_PASSES",
    "CollectiveInfo", "is_collective", "is_wait", "is_fcoll_op", "collective_kind",
    "op_kind", "collective_info", "waits_of", "wait_of", "start_of", "size_hint",
    "tensor_bytes", "node_bytes", "input_bytes", "collective_bytes", "collectives",
    "args_by_name", "arg_of", "check_topological", "per_op", "only_leaves_graph",
]

NAMESPACES = ("fcoll", "_c10d_functional")

#: node.meta key: estimated time of a collective (or compute node), in microseconds.
META_ESTIMATED_US = "fcoll_estimated_us"
#: node.meta key on a collective: names of the compute nodes scheduled while it is in flight.
META_HIDING = "fcoll_hiding_nodes"
#: node.meta key on a collective: estimated exposed (not hidden) time, in microseconds.
META_EXPOSED_US = "fcoll_exposed_us"
#: graph_module.meta key: list of ``{"pass": name, "modified": bool, "seconds": float}``.
META_PASSES = "fcoll_passes"

#: Op names of :data:`fcoll.ops.facts.OPS` that are not collectives to the passes.
#: ``_c10d_functional.reduce_scatter_tensor_out`` has no fcoll twin, and PyTorch's tracing
#: records its wait on ``out`` rather than on the op, so the wait could not be linked to it;
#: ``lower_c10d_functional`` rewrites it into ``fcoll.reduce_scatter_tensor`` + ``copy_``.
_NOT_PASS_COLLECTIVES = frozenset({"reduce_scatter_tensor_out"})

# op name -> kind, for every collective op the passes handle (wait_tensor excluded)
_KINDS = {name: f.kind for name, f in OPS.items() if name not in _NOT_PASS_COLLECTIVES}


def _op_name(target: Any) -> tuple[str, str] | None:
    """(namespace, op name) of an ``OpOverload`` target, or None."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return target.namespace, target._schema.name.split("::", 1)[-1]


def is_fcoll_op(node: fx.Node) -> bool:
    """True for any ``torch.ops.fcoll`` call (collective or wait)."""
    name = _op_name(node.target) if node.op == "call_function" else None
    return name is not None and name[0] == "fcoll"


def is_collective(node: fx.Node) -> bool:
    """True if ``node`` starts a collective (any namespace in :data:`NAMESPACES`)."""
    if node.op != "call_function":
        return False
    name = _op_name(node.target)
    return name is not None and name[0] in NAMESPACES and name[1] in _KINDS


def is_wait(node: fx.Node) -> bool:
    """True if ``node`` is a ``wait_tensor`` (any namespace in :data:`NAMESPACES`)."""
    if node.op != "call_function":
        return False
    name = _op_name(node.target)
    return name is not None and name[0] in NAMESPACES and name[1] == "wait_tensor"


def collective_kind(node: fx.Node) -> str:
    """One of "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast".

    Raises:
        ValueError: ``node``'s target is not a collective op.
    """
    kind = op_kind(node.target)
    if kind is None:
        raise ValueError(f"{node.name} ({node.target}) is not a collective")
    return kind


def per_op(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Memoize ``fn(op)``, a fact of an op's schema, by the op's identity.

    ``OpOverload.__hash__`` is Python code; these facts are asked per node, so the memo is keyed
    by ``id`` (the op is kept in the entry, so its id cannot be reused).
    """
    memo: dict[int, tuple[Any, Any]] = {}

    @functools.wraps(fn)
    def wrapper(op: Any) -> Any:
        hit = memo.get(id(op))
        if hit is not None and hit[0] is op:
            return hit[1]
        value = fn(op)
        memo[id(op)] = (op, value)
        return value

    return wrapper


@per_op
def op_kind(target: Any) -> str | None:
    """The collective kind of an op (:func:`collective_kind` of its nodes), or None for an op
    that is not a collective; memoized per op."""
    name = _op_name(target)
    return _KINDS.get(name[1]) if name is not None else None


@per_op
def _arg_positions(target: Any) -> dict[str, int]:
    """Schema argument name -> position, for one op."""
    return {a.name: i for i, a in enumerate(target._schema.arguments)}


_MISSING = object()


def arg_of(node: fx.Node, name: str, default: Any = _MISSING) -> Any:
    """The argument ``name`` of an op node, positional or keyword, without building
    :func:`args_by_name`'s dict (schema positions are read once per op).

    Raises:
        KeyError: the node does not give ``name`` and there is no ``default``.
    """
    pos = _arg_positions(node.target).get(name)
    if pos is not None and pos < len(node.args):
        return node.args[pos]
    if name in node.kwargs:
        return node.kwargs[name]
    if default is _MISSING:
        raise KeyError(f"{node.name} ({node.target}) has no argument {name!r}")
    return default


def args_by_name(node: fx.Node) -> dict[str, Any]:
    """The node's arguments keyed by schema argument name (positional and keyword)."""
    schema = node.target._schema
    out = {a.name: v for a, v in zip(schema.arguments, node.args)}
    out.update(node.kwargs)
    return out


#: Value assumed for a data-dependent (unbacked) symbol without a hint: Inductor's default
#: ``unbacked_symint_fallback``, as ``fcoll.passes.analysis.cost.UNBACKED_SIZE_FALLBACK``.
UNBACKED_SIZE_FALLBACK = 8192


def size_hint(x: Any) -> int:
    """An int for an int, a ``SymInt`` or a sympy expression, using the shape env's hints.

    Never guards. A data-dependent (unbacked) ``SymInt`` has no hint: it is estimated by
    PyTorch's ``optimization_hint`` (a user hint, equalities the shape env knows, else
    :data:`UNBACKED_SIZE_FALLBACK` per unbacked symbol, clamped to its value range): the rule
    of :mod:`fcoll.passes.analysis.cost`, which also says whether a size was estimated.
    """
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        node = x.node
        hint = node.hint if node.hint is not None else None
        if hint is None:
            hint = node.shape_env.size_hint(node.expr, allow_none=True)
        if hint is None:
            from fcoll.compat import optimization_hint

            hint = optimization_hint(x, fallback=UNBACKED_SIZE_FALLBACK)
        return int(hint)
    try:
        import sympy

        if isinstance(x, sympy.Expr):
            return int(x)
    except (ImportError, TypeError):
        pass
    return int(x)


def tensor_bytes(val: Any) -> int:
    """Bytes of a (fake) tensor, or of every tensor in a list/tuple (0 for anything else).

    Static shapes read ``nbytes`` (``numel() * element_size()`` in one call); symbolic sizes
    are evaluated with their hints (:func:`size_hint`).
    """
    if isinstance(val, torch.Tensor):
        if not val._has_symbolic_sizes_strides:
            try:
                return val.nbytes
            except RuntimeError:    # sparse layouts define no nbytes
                return val.numel() * val.element_size()
        return math.prod(size_hint(s) for s in val.shape) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(tensor_bytes(v) for v in val)
    return 0


def node_bytes(node: fx.Node) -> int:
    """Bytes of the value a node produces (from ``node.meta["val"]``); 0 if unknown."""
    return tensor_bytes(node.meta.get("val"))


def input_bytes(node: fx.Node) -> int:
    """Bytes of the values of ``node``'s input nodes (each input node counted once)."""
    total = 0
    for i in node.all_input_nodes:
        total += tensor_bytes(i.meta.get("val"))
    return total


def collective_bytes(node: fx.Node) -> int:
    """Message size of collective ``node`` on this rank, in bytes: the larger of its input
    nodes' values and its output, read from ``meta["val"]`` without building
    :class:`CollectiveInfo`.

    This is nccl-tests' count (:func:`fcoll.ops.facts.comm_bytes`) for every kind except an
    all_to_all with uneven splits, where it is the larger of input and output rather than the
    input; the cost model and the scheduler have always used it so.
    """
    return max(input_bytes(node), node_bytes(node))


@dataclass(frozen=True)
class CollectiveInfo:
    """What a collective node does, in plain values.

    Attributes:
        kind: "all_reduce", "all_gather", "reduce_scatter", "all_to_all" or "broadcast".
        op: the op name without namespace (e.g. "all_reduce_coalesced").
        group_name: the process group's name.
        group_size: ranks in the group, or None where the op does not carry it and no group is
            registered under that name.
        reduce_op: "sum", "avg", ... for reductions, else None.
        dtypes: dtype of each input tensor.
        shapes: shape of each input tensor (ints, evaluated with hints).
        in_bytes: bytes of all inputs on this rank.
        out_bytes: bytes of all outputs on this rank.
        src: root rank of a broadcast, else None.
        coalesced: True when the op takes a list of tensors.
    """

    kind: str
    op: str
    group_name: str
    group_size: int | None
    reduce_op: str | None
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    in_bytes: int
    out_bytes: int
    src: int | None
    coalesced: bool


def _input_vals(node: fx.Node, first: Any) -> list[Any]:
    items = first if isinstance(first, (list, tuple)) else [first]
    return [i.meta.get("val") if isinstance(i, fx.Node) else i for i in items]


def _registered_group_size(group_name: str) -> int | None:
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._resolve_process_group(group_name).size()
    except Exception:  # noqa: BLE001  not initialised, unknown name: the size is simply unknown
        return None


def collective_info(node: fx.Node) -> CollectiveInfo:
    """Describe the collective ``node``.

    Raises:
        ValueError: ``node`` is not a collective.
    """
    kind = collective_kind(node)
    a = args_by_name(node)
    first = a.get("input", a.get("inputs"))
    vals = _input_vals(node, first)
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    group_name = str(a["group_name"])
    group_size = a.get("group_size")
    if group_size is None:
        group_size = _registered_group_size(group_name)
    out_bytes = node_bytes(node)
    if out_bytes == 0 and node.target._schema.name.endswith("_"):
        out_bytes = tensor_bytes(tensors)
    return CollectiveInfo(
        kind=kind,
        op=_op_name(node.target)[1],
        group_name=group_name,
        group_size=group_size,
        reduce_op=a.get("reduce_op"),
        dtypes=tuple(t.dtype for t in tensors),
        shapes=tuple(tuple(size_hint(s) for s in t.shape) for t in tensors),
        in_bytes=tensor_bytes(tensors),
        out_bytes=out_bytes,
        src=a.get("src"),
        coalesced=isinstance(first, (list, tuple)),
    )


def waits_of(start: fx.Node) -> list[fx.Node]:
    """The ``wait_tensor`` nodes that wait on ``start``'s outputs, in graph order.

    Waits are found through ``start``'s own users (and ``getitem`` of a list result). For the
    in-place ops that is the wait on the value the op returns; a wait taken on the mutated input
    node itself is not linked to ``start`` (``lower_c10d_functional`` rewrites in-place
    collectives into functional ones so that every wait is linked).
    """
    waits: list[fx.Node] = []
    for user in start.users:
        if is_wait(user):
            waits.append(user)
        elif user.op == "call_function" and user.target is operator.getitem:
            waits.extend(u for u in user.users if is_wait(u))
    order = {n: i for i, n in enumerate(start.graph.nodes)} if len(waits) > 1 else None
    return sorted(waits, key=order.__getitem__) if order else waits


def wait_of(start: fx.Node) -> fx.Node | None:
    """The single ``wait_tensor`` of a non-coalesced collective (None if it has none).

    Raises:
        ValueError: ``start`` has more than one wait (use :func:`waits_of`).
    """
    waits = waits_of(start)
    if len(waits) > 1:
        raise ValueError(f"{start.name} has {len(waits)} waits; use waits_of")
    return waits[0] if waits else None


def start_of(wait: fx.Node) -> fx.Node | None:
    """The collective whose output ``wait`` waits on (through ``getitem``), or None."""
    src = wait.args[0] if wait.args else None
    if isinstance(src, fx.Node) and src.op == "call_function" and src.target is operator.getitem:
        src = src.args[0]
    if isinstance(src, fx.Node) and is_collective(src):
        return src
    return None


def check_topological(graph: fx.Graph) -> None:
    """Raise unless every node's inputs are nodes of ``graph`` placed before it.

    This is the invariant fcoll's passes can break (they move, insert and erase nodes): the part
    of ``graph.lint()`` that matters after a reorder, at a fraction of its cost: one walk over
    the nodes and their input sets, where ``lint`` also re-checks names, targets and
    ``check_arg`` for every argument, which fcoll's passes never change.

    Raises:
        RuntimeError: naming the first node that uses an input that is erased, belongs to
            another graph, or runs after it.
    """
    seen: set[fx.Node] = set()
    for node in graph.nodes:
        for i in node._input_nodes:   # all_input_nodes without the list copy
            if i not in seen:
                erased = getattr(i, "_erased", False)
                where = ("erased" if erased else "ordered after it" if i.graph is graph
                         else "in another graph")
                raise RuntimeError(f"graph is not in topological order: {node.name} "
                                   f"({node.format_node()}) uses {i.name}, which is {where}")
        seen.add(node)


def collectives(graph: fx.Graph | fx.GraphModule) -> list[fx.Node]:
    """Every collective node, in graph order."""
    g = graph.graph if isinstance(graph, fx.GraphModule) else graph
    return [n for n in g.nodes if is_collective(n)]



_MOVES_DATA = frozenset({torch.ops.aten.copy.default, torch.ops.aten.copy_.default,
                         torch.ops.aten.clone.default, torch.ops.aten.reshape.default,
                         torch.ops.aten.split_with_sizes.default, torch.ops.aten.split.Tensor,
                         operator.getitem})


def only_leaves_graph(wait: fx.Node) -> bool:
    """Whether ``wait``'s result only leaves the graph: every path from it reaches the output
    through data movement alone (views, ``getitem``, splits, copies: compiled autograd's DDP
    backward copies each gradient into its buffer, ``wait -> copy -> output``, and a bucket
    splits and views its result first). Nothing in the graph waits for such a collective."""
    stack, seen = list(wait.users), set()
    if not stack:
        return False
    while stack:
        u = stack.pop()
        if u in seen or u.op == "output":
            continue
        seen.add(u)
        moves = u.op == "call_function" and (u.target in _MOVES_DATA
                                             or getattr(u.target, "is_view", False))
        if not moves or not u.users:
            return False
        stack.extend(u.users)
    return True
