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
import heapq
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.fx as fx

from fcoll.passes.cost import collective_bytes
from fcoll.passes.graph import arg_of, start_of
from fcoll.passes.memory import COLLECTIVE, OTHER, WAIT, Storage, _written_inputs, \
    mutation_deps, op_class, peak_bytes, per_op, storage_model

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


@per_op
def _op_is_impure(target: torch._ops.OpOverload) -> bool:
    # For an OpOverload, torch's purity check reads only the op (schema, effects, RNG).
    return torch._library.utils.is_impure(target)


def _is_barrier(node: fx.Node, cls: int) -> bool:
    if node.op == "call_module" or node.op == "call_method":
        return True
    if node.op != "call_function" or cls != OTHER:
        return False
    target = node.target
    impure = _op_is_impure(target) if isinstance(target, torch._ops.OpOverload) \
        else node.is_impure()
    return impure and not _written_inputs(node)


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
    barrier: fx.Node | None = None
    since: list[fx.Node] = []
    for n in order:
        if n.op in _FIXED:
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

    @property
    def dur_us(self) -> float:
        """``end_us - start_us``, never negative."""
        return max(0.0, self.end_us - self.start_us)


class Timeline:
    """Simulates nodes in the order they are fed (see the module docstring for the model)."""

    def __init__(self, estimate: Callable[[fx.Node], float],
                 classes: dict[fx.Node, int] | None = None, *,
                 starts: dict[fx.Node, fx.Node] | None = None,
                 groups: dict[fx.Node, str] | None = None) -> None:
        self.estimate = estimate
        self.classes = classes if classes is not None else {}
        self.now_us = 0.0
        self.lane_free: dict[str, float] = {}
        self.issued: dict[fx.Node, PredictedEvent] = {}
        self.events: list[PredictedEvent] = []
        self.by_node: dict[fx.Node, PredictedEvent] = {}
        self._starts: dict[fx.Node, fx.Node | None] = dict(starts) if starts else {}
        self._groups = groups if groups is not None else {}

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
        cls = self.classes.get(node)
        if cls is None:
            cls = op_class(node)
        if cls == COLLECTIVE:
            lane = self._groups.get(node)
            if lane is None:
                lane = str(arg_of(node, "group_name"))
            start = max(self.now_us, self.lane_free.get(lane, 0.0))
            ev = PredictedEvent(node.name, "collective", lane, start,
                                start + max(0.0, self.estimate(node)))
            self.lane_free[lane] = ev.end_us
            self.issued[node] = ev
        elif cls == WAIT:
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


def simulate(nodes: Sequence[fx.Node], estimate: Callable[[fx.Node], float],
             classes: dict[fx.Node, int] | None = None, *,
             starts: dict[fx.Node, fx.Node] | None = None,
             groups: dict[fx.Node, str] | None = None) -> Timeline:
    """Run ``nodes`` in order through a fresh :class:`Timeline`.

    Known facts of the nodes, each optional (asked of the node when missing): ``classes``,
    their :func:`~fcoll.passes.memory.op_class` (e.g. ``Storage.cls``); ``starts``, wait ->
    its collective (``Storage.start``); ``groups``, collective -> its group name.
    """
    tl = Timeline(estimate, classes, starts=starts, groups=groups)
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
    """Per collective: estimate, exposed time and the compute overlapping its lane interval.

    Compute events are serial (each starts where the previous ended), so their start times are
    sorted and the overlapping ones are found by bisection: O(C log N + overlaps).
    """
    compute = [e for e in tl.events if e.kind == "compute"]
    starts = [e.start_us for e in compute]
    out = {}
    for node, ev in tl.issued.items():
        i = max(bisect.bisect_right(starts, ev.start_us) - 1, 0)
        hiding = []
        while i < len(compute) and compute[i].start_us < ev.end_us:
            c = compute[i]
            if min(c.end_us, ev.end_us) - max(c.start_us, ev.start_us) > 0:
                hiding.append(c.node)
            i += 1
        out[node] = CollectiveRecord(ev.end_us - ev.start_us, ev.exposed_us, hiding)
    return out


# Node kinds of the scheduler: the op classes of :mod:`fcoll.passes.memory` (so that
# ``Storage.cls`` serves as the kind of every node).
_COMPUTE, _COLL, _WAIT = OTHER, COLLECTIVE, WAIT


@dataclass
class _Info:
    """Per-node facts the scheduler needs, computed once per plan (all O(N + E))."""

    deps: Deps
    movable: list[fx.Node]          # every node but placeholders, attributes and the output
    kind: dict[fx.Node, int]        # _COMPUTE, _COLL or _WAIT (Storage.cls)
    est: dict[fx.Node, float]       # estimated us, asked once per node
    dep: dict[fx.Node, int]         # index of the latest collective whose wait it depends on
    colls: list[fx.Node]            # collectives in (fixed) order
    start: dict[fx.Node, fx.Node]   # wait -> its collective (Storage.start)
    nbytes: dict[fx.Node, int]      # collective -> max(in, out) bytes on this rank
    group: dict[fx.Node, str]       # collective -> group name (its lane)
    n_succ: dict[fx.Node, int]      # movable successors (the output is always last)


def _prepare(deps: Deps, storage: Storage, estimate: Callable[[fx.Node], float]) -> _Info:
    movable = [n for n in deps.order if n.op not in _FIXED]
    est, dep, nbytes, group = {}, {}, {}, {}
    colls: list[fx.Node] = []
    index: dict[fx.Node, int] = {}
    preds, kind, start = deps.preds, storage.cls, storage.start
    for n in deps.order:
        d = -1
        for p in preds[n]:
            if dep[p] > d:
                d = dep[p]
        k = kind[n]
        if k == _COLL:
            index[n] = len(colls)
            colls.append(n)
            nbytes[n], group[n] = collective_bytes(n), str(arg_of(n, "group_name"))
            est[n] = max(0.0, float(estimate(n)))
        elif k == _WAIT:
            c = start.get(n)
            if c is not None:
                d = max(d, index[c])
        else:
            est[n] = max(0.0, float(estimate(n))) if n.op == "call_function" else 0.0
        dep[n] = d
    # Only the output can be a fixed successor; it does not count.
    succs = deps.succs
    n_succ = {n: len(succs[n]) for n in movable}
    outputs = [n for n in deps.order if n.op == "output"]
    for p in {p for out in outputs for p in preds[out]}:
        if p in n_succ:
            n_succ[p] -= 1
    return _Info(deps, movable, kind, est, dep, colls, start, nbytes, group, n_succ)


def _reverse_schedule(g: _Info, storage: Storage, limit_bytes: int,
                      max_in_flight_bytes: int) -> tuple[list[fx.Node], int]:
    """One pass of the policy of :func:`list_schedule`; returns the movable nodes in order and
    their :func:`~fcoll.passes.memory.peak_bytes`.

    Scheduling runs from the end of the graph backwards, so "how much compute runs between a
    collective's issue and its first wait" is known exactly when the issue is placed. Every step
    is a heap operation or a constant-time update: O((N + E) log N).
    """
    d, pos, order, kind = g.deps, g.deps.pos, g.deps.order, g.kind
    left = dict(g.n_succ)
    compute: list[tuple[int, int]] = []   # (-dep, -pos): descendants of later waits first
    waits: list[int] = []                 # -pos
    deferred: list[int] = []              # -pos of waits held back by the in-flight cap
    for n in g.movable:
        if left[n] == 0:
            if kind[n] == _COMPUTE:
                heapq.heappush(compute, (-g.dep[n], -pos[n]))
            elif kind[n] == _WAIT:
                heapq.heappush(waits, -pos[n])
    placed: list[fx.Node] = []
    k = len(g.colls) - 1
    now = 0.0                             # compute us placed so far (from the end)
    wait_at: dict[fx.Node, float] = {}    # collective -> `now` when its first-run wait was placed
    lane_next: dict[str, float] = {}      # group -> `now` at the issue of its next collective
    in_flight: set[fx.Node] = set()
    flight = live = peak = 0
    touched: set[fx.Node] = set()
    roots, size, touches = storage.root, storage.size, storage.touches

    def fits(w: fx.Node, reserved: int = 0) -> bool:
        """``w`` may run (backwards: its collective goes in flight) with ``reserved`` more
        bytes already promised to other waits."""
        c = g.start.get(w)
        return c is None or c in in_flight or not (flight or reserved) or \
            flight + reserved + g.nbytes[c] <= max_in_flight_bytes

    preds, est, dep, starts, nbytes = d.preds, g.est, g.dep, g.start, g.nbytes

    def place(n: fx.Node) -> None:
        nonlocal now, flight, live, peak, k
        placed.append(n)
        for r in touches[n]:
            if r not in touched:
                touched.add(r)
                live += size[r]
        # `live`: storages used at or after n and allocated before it, i.e. the live bytes
        # when n runs forwards, before it allocates (and peak_bytes counts peaks only there).
        if roots[n] is n:
            if n in touched:
                live -= size[n]  # running backwards: its storage is allocated here
            if live + size[n] > peak:
                peak = live + size[n]
        kn = kind[n]
        if kn == _COMPUTE:
            now += est[n]
        elif kn == _WAIT and n in starts:
            c = starts[n]
            wait_at[c] = now
            if c not in in_flight:
                in_flight.add(c)
                flight += nbytes[c]
        elif kn == _COLL:
            if n in in_flight:
                in_flight.discard(n)
                flight -= nbytes[n]
            lane_next[g.group[n]] = now
            k -= 1
            # Release held-back waits that now fit, counting the bytes of those released before
            # them: releasing every wait that fits the current flight one by one, then holding
            # most of them back again, made this quadratic (4,800 held waits: 3.9M heap moves).
            reserved = 0
            while deferred and fits(w := order[-deferred[0]], reserved):
                heapq.heappush(waits, heapq.heappop(deferred))
                c = starts.get(w)
                reserved += 0 if c is None or c in in_flight else nbytes[c]
        for p in preds[n]:
            count = left.get(p)
            if count is None:  # placeholders and attributes: not scheduled
                continue
            left[p] = count - 1
            if count == 1:
                if kind[p] == _COMPUTE:
                    heapq.heappush(compute, (-dep[p], -pos[p]))
                elif kind[p] == _WAIT:
                    heapq.heappush(waits, -pos[p])

    n_movable = len(g.movable)
    due_of: fx.Node | None = None          # the collective `due` was computed for
    due = 0.0
    while len(placed) < n_movable:
        if waits:  # a wait runs just before its first user: placed as soon as it is ready
            w = order[-heapq.heappop(waits)]
            if fits(w):
                place(w)
            else:
                heapq.heappush(deferred, -pos[w])
            continue
        c = g.colls[k] if k >= 0 and left[g.colls[k]] == 0 else None
        if c is not None:
            # Fixed while c is the next collective: its waits are placed, and lane_next
            # changes only when a collective is placed.
            if c is not due_of:
                due_of = c
                # done by its first wait, and before the next issue on its lane
                due = max(wait_at[c], lane_next.get(g.group[c], 0.0)) + est[c] \
                    if c in wait_at else -math.inf   # nothing waits on it: issue now
            pressure = bool(deferred) or live > limit_bytes
            if now >= due or pressure or not compute:
                if now < due:
                    log.debug("reorder_for_overlap: %s issued later than planned: %s", c.name,
                              "in-flight cap" if deferred else
                              "memory limit" if live > limit_bytes else
                              "no more independent compute to hide it")
                place(c)
                continue
        if compute:
            place(order[-heapq.heappop(compute)[1]])
        elif deferred:
            w = order[-heapq.heappop(deferred)]
            log.debug("reorder_for_overlap: %s: max_in_flight_mb cannot hold (no collective "
                      "can complete first)", w.name)
            place(w)
        else:  # pragma: no cover - a DAG always has a ready node
            raise RuntimeError("reorder_for_overlap: no ready node (dependency cycle?)")
    placed.reverse()
    return placed, peak


def list_schedule(graph: fx.Graph, estimate: Callable[[fx.Node], float], *,
                  memory_budget_bytes: int, max_in_flight_bytes: int) -> Plan:
    """Plan an order of ``graph`` that hides collectives behind independent compute.

    Policy: list scheduling *backwards* from the output, over the ready set (nodes whose
    successors are all placed), with heaps; ties always broken by original position, so it is
    deterministic and every rank plans the same order:

    1. a ready wait is placed at once: each wait runs just before its first user (sink). The
       in-flight cap may hold it back (it then runs earlier), while a collective can complete;
    2. the next collective (collectives are placed in reverse of their fixed order) is issued
       *just early enough*: once the compute placed after its first wait covers its estimated
       time, counted from its first wait or the issue of the next collective on its lane,
       whichever is later (that one assumed a free lane). It is issued earlier only when nothing
       else is ready (not enough independent compute), and later than planned when the memory
       limit or the in-flight cap presses;
    3. otherwise ready compute, highest ``dep`` first (``dep`` = index of the latest collective
       whose wait it depends on), then latest original position: compute that depends on a
       collective stays after its wait, independent compute moves in front of waits and hides
       the collective that is being placed.

    Issuing just early enough (rather than as early as possible, Inductor's ``raise_comms``)
    keeps buffers alive no longer than needed and avoids many collectives contending with
    compute at once. Cost: O((N + E) log N); estimates are asked once per node.

    The memory limit is checked on the finished order's peak (the model of
    :func:`fcoll.passes.memory.peak_bytes`, counted while planning; the planner's choices
    follow the live bytes of a partial plan, a guide); over
    budget, the plan is redone with a quarter of the budget, then none, then the original order
    is kept (at most 3 plans; logged at DEBUG).

    Returns:
        The :class:`Plan` (order, per-collective records, memory figures in bytes).
    """
    storage = storage_model(graph)
    deps = dependencies(graph, storage)
    info = _prepare(deps, storage, estimate)
    est = info.est.__getitem__
    head = [n for n in deps.order if n.op in ("placeholder", "get_attr")]
    tail = [n for n in deps.order if n.op == "output"]
    baseline = peak_bytes(deps.order, storage)
    # The fixed nodes run with nothing else live (before, or after, every other node): what
    # they allocate (the output node: its value) is a peak of its own.
    fixed_peak = max((storage.alloc(n) for n in head + tail), default=0)
    budgets = sorted({memory_budget_bytes, memory_budget_bytes // 4, 0}, reverse=True)
    for attempt, budget in enumerate(budgets):
        movable, peak = _reverse_schedule(info, storage, baseline + budget,
                                          max_in_flight_bytes)
        order = head + movable + tail
        peak = max(peak, fixed_peak)
        if peak <= baseline + memory_budget_bytes:
            break
        log.debug("reorder_for_overlap: plan %d peaks at %d bytes, over baseline %d + budget "
                  "%d; retrying with a smaller budget", attempt, peak, baseline,
                  memory_budget_bytes)
    else:
        log.debug("reorder_for_overlap: no plan within the memory budget; keeping the order")
        order, peak = deps.order, baseline
    tl = simulate(order, est, storage.cls, starts=storage.start, groups=info.group)
    return Plan(order=order, records=_records(tl), timeline=tl, baseline_peak_bytes=baseline,
                peak_bytes=peak, makespan_us=tl.now_us)
