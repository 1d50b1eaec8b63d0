"""``lower_c10d_functional``: rewrite PyTorch's functional collectives into ``torch.ops.fcoll``.

The first pass of the default pipeline. Graphs that PyTorch's own tracing makes (funcol calls,
Dynamo's remaps of ``dist.all_reduce`` and friends, DTensor redistribution) hold
``torch.ops._c10d_functional`` ops; after this pass they hold the ``fcoll`` twins, so they run on
fcoll's runtime and every later pass sees one namespace.

The pass is a rewrite table (tinygrad style): ``RULES`` maps each source ``OpOverload`` (or
higher-order op) to a small local rewrite. Sources and what they become:

==========================================  =================================================
source                                      replacement
==========================================  =================================================
``_c10d_functional.<op>`` with an fcoll     the fcoll op, same arguments, ``group_name``
twin (functional, ``_``, ``_out``,          normalised to ``str`` (the source schemas say
coalesced, ``wait_tensor``)                 ``Any group_name``)
``_c10d_functional_autograd.<op>``          the fcoll op (fcoll ops carry their own autograd)
``fcoll.<op>`` given a ``ProcessGroup``     the same node, ``group_name`` normalised to the
(a node built so by hand), or an            group's name (only then is the node changed);
``fcoll.<op>.group`` overload               ``.group`` becomes the default overload (tracing
                                            decomposes it so already)
``_c10d_functional.isend`` / ``irecv`` /    the fcoll op (same schema; both declare no
``batch_p2p_ops``                           alias, so the graph reads a receive through the
                                            op's result, which fcoll's op returns as a new
                                            tensor; PyTorch's C++ ``batch_p2p_ops`` cannot
                                            run on a Python process group such as fcoll's)
``_c10d_functional.all_reduce_coalesced_``  one ``fcoll.all_reduce_`` per tensor (fcoll's
                                            coalesced in-place op returns ``()``, and waits
                                            must stay linked to their collective; the
                                            bucketing pass may merge them again)
``_c10d_functional.reduce_scatter_tensor    ``fcoll.reduce_scatter_tensor``; each wait on it
_out``                                      becomes ``wait`` + ``aten.copy_(out, wait)``
legacy ``c10d_functional.<op>``             the fcoll op; ``(tag, ranks, group_size)`` is
(``tag, ranks, group_size`` schemas)        resolved to a group name as PyTorch's own legacy
                                            kernels do; ``None`` all_to_all splits become even
                                            splits
``auto_functionalized(_v2)`` of an          the functional fcoll op, when the mutated argument
in-place or ``_out`` collective             is a whole (non-view) contiguous base that is
                                            cloned anyway (then values, shapes and strides
                                            are the same); otherwise it is left as it is (it
                                            still runs correctly) and the reason is logged
==========================================  =================================================

A ``wait_tensor`` is lowered unless the tensor it waits on comes from an op this pass leaves in
PyTorch's namespace: a wait must belong to the same registry as its collective, or it would
return before the data arrives.

Invariants: the pass never reorders nodes (every replacement is inserted where its source was),
so collective order, which must be equal on every rank, is unchanged; it is deterministic (one
walk in graph order); new nodes carry the source node's ``meta`` (``val``, ``stack_trace``).
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable

import torch
import torch.distributed._functional_collectives  # noqa: F401  defines c10d_functional ops
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

import fcoll.ops  # noqa: F401  defines torch.ops.fcoll
from fcoll.ops.facts import OPS
from fcoll.ops.groups import resolve_group_name
from fcoll.ops.reduce import reduce_op_name
from fcoll.ops.schemas import GROUP_OVERLOADS
from fcoll.passes.graph import args_by_name
from fcoll.passes.registry import FcollPass, register_pass

__all__ = ["LowerC10dFunctional", "RULES", "lower_group_name", "lower_reduce_op"]

log = logging.getLogger(__name__)

_F = torch.ops.fcoll
_aten = torch.ops.aten

#: ``_c10d_functional`` ops with a rewrite of their own (below) instead of a same-schema swap.
_SPECIAL = frozenset({"all_reduce_coalesced_", "reduce_scatter_tensor_out"})

#: Ops whose schema is the same in ``_c10d_functional`` and ``fcoll``: every collective of the
#: facts table but those with a rewrite of their own.
_SAME_SCHEMA = tuple(name for name in OPS if name not in _SPECIAL)

#: Point-to-point ops (not collectives of the facts table), same schemas in both namespaces.
_P2P = ("isend", "irecv", "batch_p2p_ops")

#: Mutating op name -> its functional fcoll twin (facts table), for auto_functionalized.
_FUNCTIONAL_TWIN = {name: f.functional for name, f in OPS.items() if f.mutates}

# A rewrite gets the node and returns True if it rewrote it (in place or by replacement), False
# if it left it as it is.
Rewrite = Callable[[fx.Node], bool]


def lower_group_name(group: Any) -> str:
    """Normalise a ``group_name`` argument (``str``, ``ProcessGroup`` or any group form) to str."""
    return resolve_group_name(group)


def lower_reduce_op(op: Any) -> str:
    """Normalise a reduce op (PyTorch's kernels accept ``"SUM"``; a ``dist.ReduceOp``) to
    fcoll's lower-case name (:data:`fcoll.ops.reduce.REDUCE_OPS`)."""
    return reduce_op_name(op).lower()


def _op(ns: str, name: str) -> torch._ops.OpOverload | None:
    try:
        return getattr(getattr(torch.ops, ns), name).default
    except (AttributeError, RuntimeError):
        return None


def _retarget(node: fx.Node, target: Any, args: tuple, kwargs: dict | None = None) -> None:
    """Point ``node`` at ``target`` with new arguments, in place: its name, position, users and
    ``meta`` (``val``, ``stack_trace``) stay as they are.

    Only what changes is assigned: every ``Node`` attribute assignment also updates the graph's
    ``find_nodes`` table (a few microseconds each), and most rewrites change the target alone.
    """
    kwargs = kwargs or {}
    if node.target is not target:
        node.target = target
    if node.args != args:
        node.args = args
    if node.kwargs != kwargs:
        node.kwargs = kwargs


_FIXES = (("group_name", lower_group_name), ("reduce_op", lower_reduce_op))


def _swap(source: torch._ops.OpOverload, target: torch._ops.OpOverload) -> Rewrite:
    """Same schema: swap the target, normalise ``group_name`` to str and ``reduce_op`` to lower
    case (PyTorch's kernels accept "SUM"; fcoll's accept the lower-case names only).

    The positions of those arguments are read from ``source``'s schema once, not per node.
    """
    names = [a.name for a in source._schema.arguments]
    fixes = [(key, names.index(key) if key in names else None, fix) for key, fix in _FIXES]

    def rewrite(node: fx.Node) -> bool:
        args, kwargs = node.args, node.kwargs
        for key, i, fix in fixes:
            if key in kwargs:
                kwargs = {**kwargs, key: fix(kwargs[key])}
            elif i is not None and i < len(args):
                value = fix(args[i])
                if value != args[i]:
                    args = (*args[:i], value, *args[i + 1:])
        _retarget(node, target, args, kwargs)
        return True
    return rewrite


def _normalise(op: torch._ops.OpOverload) -> Rewrite:
    """fcoll's own op: leave the target, turn a ``group_name`` given as a group object (a node
    built by hand; the schema says ``str``) into the group's name, so later passes (bucket keys,
    the rank-consistency fingerprint, the cost model's per-group calibration) compare names.
    Returns False when the argument already is a ``str`` (the node is not touched)."""
    names = [a.name for a in op._schema.arguments]
    i = names.index("group_name")

    def rewrite(node: fx.Node) -> bool:
        if "group_name" in node.kwargs:
            value = node.kwargs["group_name"]
            if isinstance(value, str):
                return False
            node.kwargs = {**node.kwargs, "group_name": lower_group_name(value)}
            return True
        if i >= len(node.args) or isinstance(node.args[i], str):
            return False
        node.args = (*node.args[:i], lower_group_name(node.args[i]), *node.args[i + 1:])
        return True
    return rewrite


def _to_default(packet: torch._ops.OpOverloadPacket) -> Rewrite:
    """``fcoll.<op>.group`` (``Any group_name``) -> ``fcoll.<op>.default`` with the name."""
    normalise = _normalise(packet.group)

    def rewrite(node: fx.Node) -> bool:
        normalise(node)
        node.target = packet.default
        return True
    return rewrite


# ---------------------------------------------------------------------------------------------
# _c10d_functional ops without a same-schema twin

def _all_reduce_coalesced_inplace(node: fx.Node) -> bool:
    """``all_reduce_coalesced_(ts)`` -> one ``fcoll.all_reduce_`` per tensor, in list order."""
    a = args_by_name(node)
    users = list(node.users)
    if any(u.target is not operator.getitem for u in users):
        log.debug("lower: keeping %s: its list result is used other than by getitem", node.name)
        return False
    name = lower_group_name(a["group_name"])
    vals = node.meta.get("val") or [None] * len(a["inputs"])
    singles = []
    for t, val in zip(a["inputs"], vals):
        with node.graph.inserting_before(node):
            s = node.graph.call_function(_F.all_reduce_.default, (t, a["reduce_op"], name))
        s.meta.update(node.meta)
        s.meta["val"] = val
        singles.append(s)
    for u in users:
        u.replace_all_uses_with(singles[u.args[1]])
        node.graph.erase_node(u)
    node.graph.erase_node(node)
    return True


def _reduce_scatter_out(node: fx.Node) -> bool:
    """``reduce_scatter_tensor_out(x, out=o)`` -> ``r = fcoll.reduce_scatter_tensor(x)``; each
    wait on the op's result, or on ``o`` after it (``make_fx`` records the wait on ``o``),
    becomes ``copy_(o, wait(r))``, so ``o`` holds the result from where it was waited on."""
    a = args_by_name(node)
    if any(not _is_wait_target(u.target) for u in node.users):
        log.debug("lower: keeping %s: its result is read before a wait", node.name)
        return False
    out = a["out"]
    waits = list(node.users)
    if not waits:
        order = {n: i for i, n in enumerate(node.graph.nodes)}
        later = sorted((u for u in out.users if _is_wait_target(u.target)
                        and order[u] > order[node]), key=order.__getitem__)
        waits = later[:1]
    r = node
    _retarget(r, _F.reduce_scatter_tensor.default,
              (a["input"], lower_reduce_op(a["reduce_op"]), a["group_size"],
               lower_group_name(a["group_name"])))
    if not waits:  # the write into ``out`` must still happen: wait right away
        with node.graph.inserting_after(r):
            waits = [node.graph.call_function(_F.wait_tensor.default, (r,))]
        waits[0].meta.update(r.meta)
    for w in waits:
        w.target, w.args, w.kwargs = _F.wait_tensor.default, (r,), {}
        with node.graph.inserting_after(w):
            c = node.graph.call_function(_aten.copy_.default, (out, w))
        c.meta.update(w.meta)
        w.replace_all_uses_with(c, delete_user_cb=lambda u, c=c: u is not c)
    return True


# ---------------------------------------------------------------------------------------------
# Legacy c10d_functional (tag, ranks, group_size)

def _legacy_name(a: dict) -> str:
    import torch.distributed.distributed_c10d as c10d

    return str(c10d._resolve_group_name_by_ranks_and_tag(list(a["ranks"]), a["tag"]))


def _even_splits(node: fx.Node, a: dict) -> tuple[list, list]:
    if a.get("output_split_sizes") is not None and a.get("input_split_sizes") is not None:
        return list(a["output_split_sizes"]), list(a["input_split_sizes"])
    val = a["input"].meta.get("val") if isinstance(a["input"], fx.Node) else None
    if val is None or not isinstance(val.shape[0], int):
        raise ValueError(f"lower_c10d_functional: {node.name}: cannot derive even all_to_all "
                         f"splits without a static input size (meta['val'] is {val!r})")
    n = a["group_size"]
    return [val.shape[0] // n] * n, [val.shape[0] // n] * n


def _legacy_op(a: dict) -> str:
    return lower_reduce_op(a["reduceOp"])


_LEGACY_ARGS: dict[str, tuple[str, Callable[[fx.Node, dict], tuple]]] = {
    "all_reduce": ("all_reduce", lambda n, a: (a["self"], _legacy_op(a), _legacy_name(a))),
    "all_reduce_coalesced": ("all_reduce_coalesced",
                             lambda n, a: (a["self"], _legacy_op(a), _legacy_name(a))),
    "all_gather_into_tensor": ("all_gather_into_tensor",
                               lambda n, a: (a["shard"], a["group_size"], _legacy_name(a))),
    "all_gather_into_tensor_coalesced": (
        "all_gather_into_tensor_coalesced",
        lambda n, a: (a["input"], a["group_size"], _legacy_name(a))),
    "reduce_scatter_tensor": (
        "reduce_scatter_tensor",
        lambda n, a: (a["input"], _legacy_op(a), a["group_size"], _legacy_name(a))),
    "reduce_scatter_tensor_coalesced": (
        "reduce_scatter_tensor_coalesced",
        lambda n, a: (a["inputs"], _legacy_op(a), a["group_size"], _legacy_name(a))),
    "all_to_all_single": ("all_to_all_single",
                          lambda n, a: (a["input"], *_even_splits(n, a), _legacy_name(a))),
    "broadcast": ("broadcast", lambda n, a: (a["self"], a["src"], _legacy_name(a))),
}


def _legacy(fcoll_name: str, build: Callable[[fx.Node, dict], tuple]) -> Rewrite:
    target = getattr(_F, fcoll_name).default

    def rewrite(node: fx.Node) -> bool:
        _retarget(node, target, build(node, args_by_name(node)))
        return True
    return rewrite


# ---------------------------------------------------------------------------------------------
# wait_tensor

def _is_wait_target(target: Any) -> bool:
    return target in _WAITS


def _wait(node: fx.Node) -> bool:
    """Lower a wait unless what it waits on stays in PyTorch's namespace."""
    src = node.args[0]
    if isinstance(src, fx.Node) and src.target is operator.getitem:
        src = src.args[0]
    if isinstance(src, fx.Node) and _stays_torch(src):
        log.debug("lower: keeping %s: it waits on %s, which has no fcoll twin",
                  node.name, src.name)
        return False
    _retarget(node, _F.wait_tensor.default, (node.args[0],))
    return True


def _stays_torch(node: fx.Node) -> bool:
    t = node.target
    return (isinstance(t, torch._ops.OpOverload)
            and t.namespace in ("_c10d_functional", "c10d_functional")
            and not _is_wait_target(t))


# ---------------------------------------------------------------------------------------------
# auto_functionalized / auto_functionalized_v2 around in-place or out= collectives

_VIEW_KEYS = ("_size", "_stride", "_storage_offset", "_slice_dim")


def _contiguous(x: Any) -> bool:
    val = x.meta.get("val") if isinstance(x, fx.Node) else x
    return isinstance(val, torch.Tensor) and val.is_contiguous()


def _auto_functionalized(node: fx.Node) -> bool:
    """``auto_functionalized(_v2)(mutable_op, ...)`` -> the functional fcoll twin, when the
    replacement has the same values, shapes and strides; else keep it (logged).

    Results: an ``_out`` op's node *is* ``out``; an in-place op's node is the tuple
    ``(op result, *new bases)``: for ``all_reduce_``/``broadcast_`` items 0 and 1 are both the
    reduced tensor; for ``all_reduce_coalesced_`` item ``1 + i`` is the ``i``-th reduced tensor.
    """
    op = node.args[0] if node.args else None
    if getattr(op, "namespace", None) not in ("fcoll", "_c10d_functional"):
        return False
    name = op._schema.name.split("::", 1)[-1]
    twin = _FUNCTIONAL_TWIN.get(name)
    if twin is None:
        return False
    kw = dict(node.kwargs)
    v2 = node.target is torch.ops.higher_order.auto_functionalized_v2
    mutable = "inputs" if OPS[name].coalesced else "input"
    reason = _af_blocker(node, kw, name, mutable, v2)
    if reason:
        log.debug("lower: keeping %s around %s: %s", node.name, op, reason)
        return False
    target = getattr(_F, twin).default
    schema_args = [a.name for a in target._schema.arguments]
    if v2 and not name.endswith("_out"):
        kw[mutable] = kw["_all_bases"] if mutable == "inputs" else kw["_all_bases"][0]
    fix = dict(_FIXES)
    args = tuple(fix[a](kw[a]) if a in fix else kw[a] for a in schema_args)
    if name.endswith("_out"):
        _retarget(node, target, args)
        return True
    with node.graph.inserting_before(node):
        new = node.graph.call_function(target, args)
    new.meta.update(node.meta)
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        new.meta["val"] = list(val[1:]) if mutable == "inputs" else val[1]
    for u in list(node.users):
        if mutable == "inputs":
            u.args = (new, u.args[1] - 1)
            continue
        u.replace_all_uses_with(new)
        node.graph.erase_node(u)
    node.graph.erase_node(node)
    return True


def _af_blocker(node: fx.Node, kw: dict, name: str, mutable: str, v2: bool) -> str | None:
    """Why the functional rewrite of this auto_functionalized node would not be exact, or None."""
    if name.endswith("_out"):
        if not v2:
            return "auto_functionalized (v1) of an out= op"
        return None if _contiguous(node) else "the out tensor is not contiguous"
    if any(u.target is not operator.getitem for u in node.users):
        return "its tuple result is used other than by getitem"
    if mutable == "inputs" and any(u.args[1] == 0 for u in node.users):
        return "the op's own (empty) result is used"
    if not v2:
        ts = kw.get(mutable)
        ts = ts if isinstance(ts, (list, tuple)) else [ts]
        return None if all(map(_contiguous, ts)) else "a mutated input is not contiguous"
    bases = kw.get("_all_bases", [])
    prefixes = ([f"_{mutable}_{i}" for i in range(kw.get(f"_{mutable}_length") or 0)]
                if mutable == "inputs" else ["_input"])
    if len(bases) != len(prefixes) or any(kw.get(f"{p}_base_index") != i
                                          for i, p in enumerate(prefixes)):
        return f"the mutated tensors are not exactly the {len(bases)} bases, in order"
    if any(f"{p}{k}" in kw for p in prefixes for k in _VIEW_KEYS):
        return "a mutated tensor is a view of its base"
    only = kw.get("_only_clone_these_bases")
    if only is not None and set(only) != set(range(len(bases))):
        return "a base is mutated in place (not cloned), so other readers would see it"
    return None if all(map(_contiguous, bases)) else "a base is not contiguous"


# ---------------------------------------------------------------------------------------------
# The table

def _build_rules() -> dict[Any, Rewrite]:
    rules: dict[Any, Rewrite] = {}
    for ns in ("_c10d_functional", "_c10d_functional_autograd"):
        for name in _SAME_SCHEMA:
            src = _op(ns, name)
            if src is not None:
                rules[src] = _swap(src, getattr(_F, name).default)
    for name in _P2P:   # same schemas; fcoll's irecv returns a new tensor (see the table)
        src = _op("_c10d_functional", name)
        if src is not None:
            rules[src] = _swap(src, getattr(_F, name).default)
    for src, rewrite in ((_op("_c10d_functional", "all_reduce_coalesced_"),
                          _all_reduce_coalesced_inplace),
                         (_op("_c10d_functional", "reduce_scatter_tensor_out"),
                          _reduce_scatter_out)):
        if src is not None:
            rules[src] = rewrite
    for name, (twin, build) in _LEGACY_ARGS.items():
        src = _op("c10d_functional", name)
        if src is not None:
            rules[src] = _legacy(twin, build)
    for w in _WAITS:
        if w is not _F.wait_tensor.default:
            rules[w] = _wait
    for name in OPS:
        own = _op("fcoll", name)
        if own is not None and own not in rules and "group_name" in [
                a.name for a in own._schema.arguments]:
            rules[own] = _normalise(own)
    for name in GROUP_OVERLOADS:
        rules[getattr(_F, name).group] = _to_default(getattr(_F, name))
    rules[torch.ops.higher_order.auto_functionalized] = _auto_functionalized
    rules[torch.ops.higher_order.auto_functionalized_v2] = _auto_functionalized
    return rules


_WAITS = frozenset(w for w in (_op("_c10d_functional", "wait_tensor"),
                               _op("c10d_functional", "wait_tensor"),
                               _F.wait_tensor.default) if w is not None)

#: source op -> rewrite. Ops absent from this torch version are simply not listed.
RULES: dict[Any, Rewrite] = _build_rules()


@register_pass
class LowerC10dFunctional(FcollPass):
    """Rewrite every ``_c10d_functional`` / ``c10d_functional`` collective and wait into fcoll.

    See the module docstring for the table. ``modified`` is True if any node was rewritten.
    """

    name = "lower_c10d_functional"

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        modified = False
        for node in list(graph_module.graph.nodes):
            if node.op != "call_function" or node._erased:
                continue
            rewrite = RULES.get(node.target)
            if rewrite is not None and rewrite(node):
                modified = True
        if modified:   # FcollPass.ensures checks the result
            graph_module.recompile()
        return PassResult(graph_module, modified)
