"""FSDP-aware bucket plans: parameter all_gathers per module block, one block ahead of use.

A SimpleFSDP graph (``fcoll.parallel.fully_shard``, torchtitan's SimpleFSDP) gathers every
parameter where a module reads it; all those all_gathers read graph inputs (the shards), so all
are ready at the start, and a plan by readiness alone merges the whole model into one all_gather
before the first layer: every parameter gathered at once (FSDP's memory saving gone) and nothing
to hide it behind. FSDP2 instead gathers one unit (the module ``fully_shard`` was called on) at a
time and prefetches the next. This module gives the bucket planner the same structure:

- **Parameter gather**: an all_gather whose input depends on graph inputs only through compute
  (no collective or wait upstream): the shard, perhaps padded (DTensor pads an uneven shard on the
  ranks that hold fewer rows, so its graph differs from rank 0's there).
- **Block** of a gather: the innermost module in the gather node's ``nn_module_stack`` whose class
  was made by ``fully_shard`` (name prefix ``SimpleFSDP``, torchtitan's prefix too); a gather with
  none belongs to the root block ``""``. Dynamo records the stack of the module whose code read
  the parameter, so this is the unit ``fully_shard`` was called on, read from the graph alone and
  the same on every rank. A graph where no gather names such a module (a hand-written FSDP step,
  or no ``nn_module_stack``) gets no FSDP plan and keeps the lane plan.
- **Order**: blocks by the first use of any of their gathers (graph order; ties by name).
  Block ``k``'s gathers are one segment (bucket, still bounded by ``bucket_cap_mb`` and
  ``memory_budget_mb``), issued not before the first use of block ``k - 1`` (prefetch one block
  ahead, as FSDP2's forward and backward prefetch) and waited before their first use. The
  first block is issued after the input computation of all gathers (so a rank that pads a
  shard orders its buckets as rank 0 does). The ``not before`` node is recorded on the merged
  collective (:data:`META_NOT_BEFORE`) and the
  scheduler keeps it as an ordering edge, so no later pass issues it earlier: at most two blocks'
  gathered parameters are live at once, whatever the cost model says.
- **Reduce_scatters** of a graph with parameter gathers (the backward, whose gathers are the
  recomputed ones of ``reshard_after_forward``): those traced between the first gathers of two
  consecutive blocks (where the partitioner put each block's regather: before its backward)
  are one segment (the gradients of the block whose backward runs there), issued when the
  last of them is ready and waited before the block after next starts: before the first use
  of any of that block's gathers (recorded on the wait, :data:`META_WAIT_BY`, and kept by the
  scheduler): a block's full-size gradients and its bucket are freed one block later instead
  of at the end of the backward. The anchor is that compute node, never the gather itself,
  which bucketing replaces by the merged collective (a name the scheduler would not find: the
  bound was dropped and every gradient bucket waited at the end, 13.5 MiB more at the peak of
  the 4-block GPT's backward than with the bound).

Why ranks agree: blocks, order and anchors read only the graph's module stacks and order, and
which collectives merge is still rank 0's plan on every rank (:mod:`fcoll.passes.rewrites.shared_plan`).
Bucketing first moves each gather's input computation (the padding) right after the graph
inputs, on every rank (:func:`fcoll.passes.rewrites.shared_plan.hoist_input_preparation`), so
that a rank whose shard is padded can issue a block's gathers where rank 0 does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch.fx as fx

from fcoll.passes.graph import collective_kind, is_collective, is_wait, waits_of
from fcoll.passes.analysis.memory import OTHER, op_class

__all__ = ["META_NOT_BEFORE", "META_WAIT_BY", "FsdpPlan", "parameter_gathers", "block_of",
           "plan_fsdp", "FSDP_CLASS_PREFIX"]

log = logging.getLogger(__name__)

#: node.meta key on a collective: name of the node it must not be issued before (prefetch).
META_NOT_BEFORE = "fcoll_not_before"
#: node.meta key on a wait: name of the node it must come before (FSDP gradient buckets).
META_WAIT_BY = "fcoll_wait_by"
#: Class-name prefix of the modules ``fully_shard`` was called on (fcoll's and torchtitan's).
FSDP_CLASS_PREFIX = "SimpleFSDP"
#: FSDP segments are numbered from here, apart from the lane plan's.
_SEGMENT_BASE = 1 << 20


@dataclass
class FsdpPlan:
    """Segments and prefetch anchors of one graph's FSDP collectives.

    Attributes:
        segment: collective -> its block's segment number (gathers and reduce_scatters).
        not_before: gather -> the node it is issued after at the earliest.
        wait_by: reduce_scatter -> the node its wait comes before at the latest.
        blocks: block names in order (gather blocks), for logs and tests.
    """

    segment: dict[fx.Node, int] = field(default_factory=dict)
    not_before: dict[fx.Node, fx.Node] = field(default_factory=dict)
    wait_by: dict[fx.Node, fx.Node] = field(default_factory=dict)
    blocks: list[str] = field(default_factory=list)


def _input_chain(node: fx.Node) -> list[fx.Node] | None:
    """The compute nodes ``node``'s input is made of, from graph inputs only (graph order), or
    None if a collective, a wait or a side effect is upstream."""
    chain, stack, seen = [], list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            continue
        if n.op != "call_function" or is_collective(n) or is_wait(n) or op_class(n) != OTHER \
                or n.is_impure():
            return None
        chain.append(n)
        stack.extend(n.all_input_nodes)
    return chain


def parameter_gathers(graph: fx.Graph) -> list[fx.Node]:
    """All_gathers whose input is computed from graph inputs only (module docstring), in
    graph order."""
    return [n for n in graph.nodes if is_collective(n) and collective_kind(n) == "all_gather"
            and _input_chain(n) is not None]


def block_of(node: fx.Node) -> str | None:
    """The FSDP unit whose code ``node`` ran in: the innermost ``nn_module_stack`` module whose
    class name starts with :data:`FSDP_CLASS_PREFIX` (its path), ``""`` for none, None without
    an ``nn_module_stack``."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    block = ""
    for path, cls in stack.values():
        name = cls if isinstance(cls, str) else getattr(cls, "__name__", "")
        if name.rsplit(".", 1)[-1].startswith(FSDP_CLASS_PREFIX):
            block = path
    return block


def _first_use(node: fx.Node, pos: dict[fx.Node, int]) -> int:
    users = [pos[u] for w in waits_of(node) for u in w.users]
    return min(users, default=len(pos))


def plan_fsdp(graph: fx.Graph) -> FsdpPlan | None:
    """The FSDP plan of ``graph`` (module docstring), or None if it has no FSDP gathers."""
    gathers = parameter_gathers(graph)
    blocks = {g: block_of(g) for g in gathers}
    if not any(blocks.values()):   # no gather ran inside a module fully_shard was called on
        return None
    pos = {n: i for i, n in enumerate(graph.nodes)}
    first: dict[str, int] = {}
    for g in gathers:
        b = blocks[g] or ""
        first[b] = min(first.get(b, len(pos)), _first_use(g, pos))
    order = sorted(first, key=lambda b: (first[b], b))
    index = {b: i for i, b in enumerate(order)}
    by_pos = list(graph.nodes)
    # the first block is issued after every gather's input computation (the hoisted prep, or
    # the graph inputs), where rank 0's and a padding rank's graphs agree on the order
    prep = [pos[n] for g in gathers for n in _input_chain(g) or ()]
    start = max(prep + [pos[n] for n in by_pos if n.op in ("placeholder", "get_attr")],
                default=0)
    plan = FsdpPlan(blocks=order)
    for g in gathers:
        k = index[blocks[g] or ""]
        plan.segment[g] = _SEGMENT_BASE + k
        plan.not_before[g] = by_pos[max(start, first[order[k - 1]]) if k > 0 else start]
    # a block's backward starts where its first gather was traced (just before its use); its
    # compute starts at the first use of any of its gathers (``first``): a compute node, which
    # bucketing keeps (it rewires the node's input), where a gather it merges would be gone
    traced: dict[str, int] = {}
    for g in gathers:
        b = blocks[g] or ""
        traced[b] = min(traced.get(b, len(pos)), pos[g])
    backward = sorted(traced, key=lambda b: (traced[b], b))
    starts = [traced[b] for b in backward]
    for n in graph.nodes:
        if is_collective(n) and collective_kind(n) == "reduce_scatter":
            k = sum(1 for s in starts if s <= pos[n])
            plan.segment[n] = _SEGMENT_BASE + len(order) + k
            # done before the backward reaches the block after next: its first use
            if k + 1 < len(starts) and first[backward[k + 1]] < len(by_pos):
                plan.wait_by[n] = by_pos[first[backward[k + 1]]]
    log.debug("fsdp plan: %d gathers in %d blocks %s", len(gathers), len(order), order)
    return plan
