"""The ordering constraints every reorder pass keeps, and the one mutation that applies an order.

:func:`dependencies` reads a graph and returns its constraints (:class:`Deps`); the schedulers of
:mod:`fcoll.passes.rewrites.list_scheduler` place nodes only where these allow, and
:func:`apply_order` moves the graph's nodes to the order they chose (``Node.append``, so
``node.meta`` is kept).

The constraints:

- data edges (``node.all_input_nodes``);
- collectives keep their original relative order, across all groups: every rank issues the
  same sequence, because a different order on different ranks hangs (ranks run the same
  graph with the same cost numbers, so the scheduler's choices are the same on every rank);
- writes stay ordered with the reads of the same storage
  (:func:`fcoll.passes.analysis.memory.mutation_deps`);
- other side-effectful nodes (not waits, not collectives) are barriers: nothing crosses them;
- a collective with ``meta[META_NOT_BEFORE]`` (FSDP prefetch,
  :mod:`fcoll.passes.rewrites.fsdp_plan`) stays after that node, and a wait with
  ``meta[META_WAIT_BY]`` before that one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx

from fcoll.passes.analysis.memory import COLLECTIVE, OTHER, WAIT, OpClass, Storage, \
    mutation_deps, per_op, storage_model, written_inputs
from fcoll.passes.rewrites.fsdp_plan import META_NOT_BEFORE, META_WAIT_BY

__all__ = ["FIXED_OPS", "Deps", "dependencies", "apply_order"]

log = logging.getLogger(__name__)

#: node kinds that never move (``node.op``)
FIXED_OPS = ("placeholder", "get_attr", "output")


@dataclass
class Deps:
    """Ordering constraints of a graph, on its original order.

    Attributes:
        order: the nodes in original order.
        pos: node -> index in ``order``.
        preds: node -> nodes that must run before it (sorted by ``pos``).
        succs: node -> nodes that must run after it (sorted by ``pos``).
    """

    order: list[fx.Node]
    pos: dict[fx.Node, int]
    preds: dict[fx.Node, list[fx.Node]]
    succs: dict[fx.Node, list[fx.Node]]


@per_op
def _op_is_impure(target: torch._ops.OpOverload) -> bool:
    # For an OpOverload, torch's purity check reads only the op (schema, effects, RNG).
    return torch._library.utils.is_impure(target)


def _is_barrier(node: fx.Node, cls: OpClass) -> bool:
    if node.op == "call_module" or node.op == "call_method":
        return True
    if node.op != "call_function" or cls != OTHER:
        return False
    target = node.target
    impure = _op_is_impure(target) if isinstance(target, torch._ops.OpOverload) \
        else node.is_impure()
    return impure and not written_inputs(node)


def dependencies(graph: fx.Graph, storage: Storage | None = None) -> Deps:
    """All ordering constraints of ``graph`` (see the module docstring). O(N + E log E)."""
    order = list(graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    storage = storage if storage is not None else storage_model(graph)
    extra: dict[fx.Node, list[fx.Node]] = {}  # node -> extra predecessors (non-data edges)

    def add(a: fx.Node, b: fx.Node) -> None:
        extra.setdefault(b, []).append(a)

    cls = storage.cls
    colls = [n for n in order if cls[n] == COLLECTIVE]
    for a, b in zip(colls, colls[1:]):
        add(a, b)
    for a, b in mutation_deps(order, storage):
        add(a, b)
    by_name = {n.name: n for n in order}

    def bound(n: fx.Node, key: str) -> fx.Node | None:
        """The node ``n.meta[key]`` names; a name no node of the graph has (a pass removed it)
        loses that FSDP memory bound: said at WARNING, since peak memory may then grow."""
        name = n.meta.get(key)
        if name is None:
            return None
        node = by_name.get(name)
        if node is None:
            log.warning("fcoll: %s's %s names %r, which is not in the graph: that bound is "
                        "dropped (peak memory may grow)", n.name, key, name)
        return node

    for n in colls:   # FSDP prefetch bounds (fsdp_plan): issued after that node at the earliest
        anchor = bound(n, META_NOT_BEFORE)
        if anchor is not None and pos[anchor] < pos[n]:
            add(anchor, n)
    for n in order:   # FSDP gradient buckets: waited before that node at the latest
        due = bound(n, META_WAIT_BY) if cls[n] == WAIT else None
        if due is not None and pos[n] < pos[due]:
            add(n, due)
    barrier: fx.Node | None = None
    since: list[fx.Node] = []
    for n in order:
        if n.op in FIXED_OPS:
            continue
        if _is_barrier(n, cls[n]):
            for m in since:
                add(m, n)
            since = []
            barrier = n
        elif barrier is not None:
            add(barrier, n)
        since.append(n)
    preds: dict[fx.Node, list[fx.Node]] = {}
    succs: dict[fx.Node, list[fx.Node]] = {n: [] for n in order}
    key = pos.__getitem__
    for n in order:
        ps = list(n._input_nodes)   # all_input_nodes without its Python property call
        if n in extra:
            ps = list(dict.fromkeys(ps + extra[n]))
        if len(ps) > 1:
            ps.sort(key=key)
        pn = pos[n]
        if ps and pos[ps[-1]] >= pn:
            raise ValueError(f"graph is not in topological order: {ps[-1].name} must run "
                             f"before {n.name}")
        preds[n] = ps
        for p in ps:
            succs[p].append(n)  # appended in order of pos[n]: already sorted
    return Deps(order, pos, preds, succs)


def apply_order(graph: fx.Graph, order: Sequence[fx.Node]) -> bool:
    """Reorder ``graph``'s nodes to ``order`` (a permutation of them); True if anything moved.

    One walk with ``Node.append`` (O(N), ``node.meta`` kept). It does not check the result:
    every fcoll pass is checked once by ``FcollPass.ensures`` (a check here would double it).
    """
    current = list(graph.nodes)
    if len(current) != len(order) or set(current) != set(order):
        raise ValueError("apply_order: the new order is not a permutation of the graph's nodes")
    if current == list(order):
        return False
    for prev, node in zip(order, order[1:]):
        if prev.next is not node:
            prev.append(node)
    return True
