"""Ordering constraints, the timeline simulator, and the overlap list scheduler.

Everything here is pure planning: functions read a graph and return orders, events and records;
:func:`apply_order` is the only mutation (``Node.append``, so ``node.meta`` is kept).

Constraints every reorder keeps (:func:`dependencies`):

- data edges (``node.all_input_nodes``);
- collectives keep their original relative order, across all groups: every rank issues the
  same sequence, because a different order on different ranks hangs (ranks run the same
  graph with the same cost numbers, so the scheduler's choices are the same on every rank);
- writes stay ordered with the reads of the same storage (:func:`fcoll.passes.memory.mutation_deps`);
- other side-effectful nodes (not waits, not collectives) are barriers: nothing crosses them.

Timeline model (:class:`Timeline`, the contract of ``predict``): compute runs serially on one
lane; each collective runs on its group's lane from its issue, serially per group; a wait
blocks compute until its collective ends; exposed time = the blocked time.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch.fx as fx

from fcoll.passes.graph import collective_info, is_collective, is_wait, start_of, waits_of
from fcoll.passes.memory import MemoryTracker, Storage, mutation_deps, peak_bytes, \
    storage_model

__all__ = ["Deps", "dependencies", "apply_order", "PredictedEvent", "Timeline", "simulate",
           "Plan", "CollectiveRecord", "list_schedule"]

log = logging.getLogger(__name__)

_FIXED = ("placeholder", "get_attr", "output")


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


def _is_barrier(node: fx.Node, storage: Storage) -> bool:
    if node.op == "call_module" or node.op == "call_method":
        return True
    if node.op != "call_function" or is_wait(node) or is_collective(node):
        return False
    from fcoll.passes.memory import _written_inputs

    return node.is_impure() and not _written_inputs(node)


def dependencies(graph: fx.Graph, storage: Storage | None = None) -> Deps:
    """All ordering constraints of ``graph`` (see the module docstring)."""
    order = list(graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    storage = storage if storage is not None else storage_model(graph)
    edges: set[tuple[fx.Node, fx.Node]] = set()
    for n in order:
        edges.update((i, n) for i in n.all_input_nodes)
    colls = [n for n in order if is_collective(n)]
    edges.update(zip(colls, colls[1:]))
    edges.update(mutation_deps(order, storage))
    barrier: fx.Node | None = None
    since: list[fx.Node] = []
    for n in order:
        if n.op in _FIXED:
            continue
        if _is_barrier(n, storage):
            edges.update((m, n) for m in since)
            since = []
            barrier = n
        elif barrier is not None:
            edges.add((barrier, n))
        since.append(n)
    preds: dict[fx.Node, list[fx.Node]] = {n: [] for n in order}
    succs: dict[fx.Node, list[fx.Node]] = {n: [] for n in order}
    for a, b in edges:
        if pos[a] >= pos[b]:
            raise ValueError(f"graph is not in topological order: {a.name} must run before "
                             f"{b.name}")
        preds[b].append(a)
        succs[a].append(b)
    for n in order:
        preds[n].sort(key=pos.__getitem__)
        succs[n].sort(key=pos.__getitem__)
    return Deps(order, pos, preds, succs)


def apply_order(graph: fx.Graph, order: Sequence[fx.Node]) -> bool:
    """Reorder ``graph``'s nodes to ``order`` (a permutation of them); True if anything moved."""
    current = list(graph.nodes)
    if len(current) != len(order) or set(current) != set(order):
        raise ValueError("apply_order: the new order is not a permutation of the graph's nodes")
    if current == list(order):
        return False
    for prev, node in zip(order, order[1:]):
        if prev.next is not node:
            prev.append(node)
    graph.lint()
    return True


# ---------------------------------------------------------------------------------------------
# Timeline simulator

@dataclass
class PredictedEvent:
    """One node on the predicted timeline (times in microseconds from the graph's start).

    Attributes:
        node: the node's name.
        kind: "compute", "collective" or "wait".
        lane: "compute", or the collective's group name.
        start_us / end_us: when it starts and ends (a collective: on its group's lane; a wait:
            when compute reaches it and when it unblocks).
        exposed_us: a wait: time compute is blocked on it; a collective: the sum over its waits.
    """

    node: str
    kind: str
    lane: str
    start_us: float
    end_us: float
    exposed_us: float = 0.0


class Timeline:
    """Simulates nodes in the order they are fed (see the module docstring for the model)."""

    def __init__(self, estimate: Callable[[fx.Node], float]) -> None:
        self.estimate = estimate
        self.now_us = 0.0
        self.lane_free: dict[str, float] = {}
        self.issued: dict[fx.Node, PredictedEvent] = {}
        self.events: list[PredictedEvent] = []
        self.by_node: dict[fx.Node, PredictedEvent] = {}
        self._starts: dict[fx.Node, fx.Node | None] = {}

    def _start(self, wait: fx.Node) -> fx.Node | None:
        if wait not in self._starts:
            self._starts[wait] = start_of(wait)
        return self._starts[wait]

    def blocked_us(self, wait: fx.Node) -> float:
        """How long ``wait`` would block compute if it ran now."""
        start = self._start(wait)
        ev = self.issued.get(start) if start is not None else None
        return max(0.0, ev.end_us - self.now_us) if ev is not None else 0.0

    def run(self, node: fx.Node) -> PredictedEvent | None:
        if node.op != "call_function":
            return None
        if is_collective(node):
            lane = collective_info(node).group_name
            start = max(self.now_us, self.lane_free.get(lane, 0.0))
            ev = PredictedEvent(node.name, "collective", lane, start,
                                start + max(0.0, self.estimate(node)))
            self.lane_free[lane] = ev.end_us
            self.issued[node] = ev
        elif is_wait(node):
            blocked = self.blocked_us(node)
            ev = PredictedEvent(node.name, "wait", "compute", self.now_us,
                                self.now_us + blocked, blocked)
            self.now_us += blocked
            coll = self.issued.get(self._start(node))
            if coll is not None:
                coll.exposed_us += blocked
        else:
            ev = PredictedEvent(node.name, "compute", "compute", self.now_us,
                                self.now_us + max(0.0, self.estimate(node)))
            self.now_us = ev.end_us
        self.events.append(ev)
        self.by_node[node] = ev
        return ev


def simulate(nodes: Sequence[fx.Node], estimate: Callable[[fx.Node], float]) -> Timeline:
    """Run ``nodes`` in order through a fresh :class:`Timeline`."""
    tl = Timeline(estimate)
    for n in nodes:
        tl.run(n)
    return tl


# ---------------------------------------------------------------------------------------------
# The list scheduler

@dataclass
class CollectiveRecord:
    """What the scheduler predicts for one collective (times in microseconds)."""

    estimated_us: float
    exposed_us: float
    hiding: list[str]


@dataclass
class Plan:
    """A schedule: the new order, predictions and memory figures (bytes)."""

    order: list[fx.Node]
    records: dict[fx.Node, CollectiveRecord] = field(default_factory=dict)
    timeline: Timeline | None = None
    baseline_peak_bytes: int = 0
    peak_bytes: int = 0
    makespan_us: float = 0.0


def _records(tl: Timeline) -> dict[fx.Node, CollectiveRecord]:
    compute = [(n, e) for n, e in tl.by_node.items() if e.kind == "compute"]
    out = {}
    for node, ev in tl.issued.items():
        hiding = [n.name for n, c in compute
                  if min(c.end_us, ev.end_us) - max(c.start_us, ev.start_us) > 0]
        out[node] = CollectiveRecord(ev.end_us - ev.start_us, ev.exposed_us, hiding)
    return out


def _ancestor_masks(deps: Deps) -> dict[fx.Node, int]:
    """Bit ``pos[m]`` of ``mask[n]`` is set when ``m`` must run before ``n``."""
    mask: dict[fx.Node, int] = {}
    for n in deps.order:
        m = 0
        for p in deps.preds[n]:
            m |= mask[p] | (1 << deps.pos[p])
        mask[n] = m
    return mask


class _Scheduler:
    """One greedy pass; see :func:`list_schedule` for the policy."""

    def __init__(self, deps: Deps, storage: Storage, estimate, limit_bytes: int,
                 max_in_flight_bytes: int) -> None:
        self.d, self.st, self.estimate = deps, storage, estimate
        self.limit, self.cap = limit_bytes, max_in_flight_bytes
        self.masks = _ancestor_masks(deps)
        self.colls = [n for n in deps.order if is_collective(n)]
        self.bytes = {c: max(collective_info(c).in_bytes, collective_info(c).out_bytes)
                      for c in self.colls}
        self.told: set[tuple[fx.Node, str]] = set()
        self.is_wait = {n: is_wait(n) for n in deps.order}
        self.is_compute = {n: not self.is_wait[n] and not is_collective(n) for n in deps.order}

    def _why_not(self, c: fx.Node, mem: MemoryTracker, flight: int) -> str | None:
        if mem.would_reach(c) > self.limit:
            return (f"issuing it would raise live memory to {mem.would_reach(c)} bytes, over "
                    f"the limit {self.limit} (baseline peak + memory_budget_mb)")
        if flight and flight + self.bytes[c] > self.cap:
            return (f"{flight} bytes already in flight + {self.bytes[c]} > max_in_flight_mb "
                    f"({self.cap} bytes)")
        return None

    def run(self) -> tuple[list[fx.Node], Timeline]:
        d, pos = self.d, self.d.pos
        order = [n for n in d.order if n.op in ("placeholder", "get_attr")]
        done = set(order)
        mem, tl = MemoryTracker(self.st), Timeline(self.estimate)
        for n in order:
            mem.schedule(n)
        missing = {n: sum(1 for p in d.preds[n] if p not in done) for n in d.order}
        ready = sorted((pos[n] for n in d.order if n.op not in _FIXED and missing[n] == 0))
        flight: dict[fx.Node, int] = {}
        nxt = 0
        while ready:
            node = self._choose(ready, nxt, mem, tl, sum(flight.values()))
            ready.remove(pos[node])
            order.append(node)
            mem.schedule(node)
            tl.run(node)
            if is_collective(node):
                nxt += 1
                flight[node] = self.bytes[node]
            elif self.is_wait[node]:
                start = tl._start(node)
                if start in flight and waits_of(start)[-1] is node:
                    del flight[start]
            for s in d.succs[node]:
                missing[s] -= 1
                if missing[s] == 0 and s.op != "output":
                    bisect.insort(ready, pos[s])
        order.extend(n for n in d.order if n.op == "output")
        return order, tl

    def _choose(self, ready: list[int], nxt: int, mem: MemoryTracker, tl: Timeline,
                flight: int) -> fx.Node:
        nodes = [self.d.order[i] for i in ready]
        why = None
        if nxt < len(self.colls) and self.colls[nxt] in nodes:
            c = self.colls[nxt]
            why = self._why_not(c, mem, flight)
            if why is None:
                return c
            if (c, why[:8]) not in self.told:
                self.told.add((c, why[:8]))
                log.debug("reorder_for_overlap: %s not issued as early as possible: %s",
                          c.name, why)
        waits = [n for n in nodes if self.is_wait[n]]
        finished = [w for w in waits if tl.blocked_us(w) == 0.0]
        if finished and why is not None and "in flight" in why:
            return finished[0]  # frees in-flight bytes for the next collective
        compute = [n for n in nodes if self.is_compute[n] and mem.would_reach(n) <= self.limit]
        if nxt < len(self.colls):
            cone = self.masks[self.colls[nxt]]
            for n in sorted(compute + finished, key=self.d.pos.__getitem__):
                if cone >> self.d.pos[n] & 1:
                    return n
        if compute:
            return compute[0]
        if waits:
            return min(waits, key=lambda w: (tl.blocked_us(w), self.d.pos[w]))
        return nodes[0]


def list_schedule(graph: fx.Graph, estimate: Callable[[fx.Node], float], *,
                  memory_budget_bytes: int, max_in_flight_bytes: int) -> Plan:
    """Plan an order of ``graph`` that hides collectives behind independent compute.

    Policy (greedy list scheduling over the ready set, one node at a time, simulated with
    :class:`Timeline`; ties always broken by original position, so it is deterministic):

    1. issue the next collective (in original collective order) as soon as it is ready, unless
       that would exceed the memory limit (baseline peak + budget) or the in-flight cap (then
       a wait whose collective has finished runs first, if there is one, to free the cap);
    2. run an ancestor of the next collective (ready compute within the memory limit, or a
       wait whose collective has finished), so the collective can be issued sooner;
    3. run other ready compute within the memory limit, in original order;
    4. run a ready wait, the one that blocks least (finished ones block 0 us);
    5. otherwise the first ready node in original order.

    Waits are therefore as late as their users allow, and every collective is issued as early
    as its inputs, the collective order and the budgets allow; the compute between issue and
    wait hides it. The memory budget is verified on the finished order with
    :func:`fcoll.passes.memory.peak_bytes`; if greedy choices overshoot it, the plan is retried
    with half the budget, and finally the original order is kept (logged at DEBUG).

    Returns:
        The :class:`Plan` (order, per-collective records, memory figures in bytes).
    """
    storage = storage_model(graph)
    deps = dependencies(graph, storage)
    memo: dict[fx.Node, float] = {}

    def estimate_once(node: fx.Node) -> float:
        if node not in memo:
            memo[node] = estimate(node)
        return memo[node]

    baseline = peak_bytes(deps.order, storage)
    budget = memory_budget_bytes
    for attempt in range(4):
        order, tl = _Scheduler(deps, storage, estimate_once, baseline + budget,
                               max_in_flight_bytes).run()
        peak = peak_bytes(order, storage)
        if peak <= baseline + memory_budget_bytes:
            break
        log.debug("reorder_for_overlap: plan %d peaks at %d bytes, over baseline %d + budget "
                  "%d; retrying with half the budget", attempt, peak, baseline,
                  memory_budget_bytes)
        budget //= 2
    else:
        log.debug("reorder_for_overlap: no plan within the memory budget; keeping the order")
        order, tl = deps.order, simulate(deps.order, estimate_once)
        peak = baseline
    return Plan(order=order, records=_records(tl), timeline=tl, baseline_peak_bytes=baseline,
                peak_bytes=peak, makespan_us=tl.now_us)
