"""The list scheduler behind every reorder pass.

Everything here is pure planning: functions read a graph and return orders and records
(:func:`fcoll.passes.rewrites.ordering.apply_order` applies one).

The constraints every order keeps (data edges, the collectives' relative order, writes after
reads of a storage, barriers, FSDP bounds) are
:func:`fcoll.passes.rewrites.ordering.dependencies`'s.

One scheduler (:class:`ListScheduler`) places nodes from a ready set, backwards or forwards, so
that every order it makes keeps these constraints by construction; a reorder differs only in its
priority: a static key (:class:`KeyScheduler`: ``sink_waits``, ``raise_collectives``) or the
cost-model rule of :class:`OverlapScheduler` (``reorder_for_overlap``). Predictions come from
the simulator of :mod:`fcoll.passes.analysis.lanes`.

Data-dependent (unbacked) sizes are never compared or converted with ``int()`` here: a
collective's bytes come from :func:`fcoll.passes.analysis.cost.collective_size`, which estimates
them by the cost model's documented fallback; the estimate guides the plan (its time, the in-flight
cap) and is reported in :attr:`Plan.size_estimates`, never needed for correctness, since the
constraints above do not depend on sizes.
"""

from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch.fx as fx

from fcoll.passes.analysis.cost import SizeEstimate, collective_size
from fcoll.passes.graph import arg_of, only_leaves_graph
from fcoll.passes.analysis.memory import COLLECTIVE, OTHER, WAIT, LiveBytes, OpClass, Storage, \
    peak_bytes, storage_model
from fcoll.passes.rewrites.ordering import FIXED_OPS, Deps, dependencies
from fcoll.passes.analysis.lanes import (
    CollectiveRecord, PredictedEvent, Timeline, records, timeline_of,
)

__all__ = ["PredictedEvent", "Timeline", "timeline_of", "Plan", "CollectiveRecord",
           "ListScheduler", "KeyScheduler", "OverlapScheduler", "list_schedule"]

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# The list scheduler

class ListScheduler:
    """List scheduling over a graph's ordering constraints: one node at a time from a ready set.

    Backwards (from the graph's end), a node is *ready* once every scheduled node that must run
    after it is placed; forwards, once every scheduled node that must run before it is placed.
    So every order a scheduler makes keeps :func:`dependencies` by construction, whatever its
    priority: a reorder is only a choice among ready nodes. A step is :meth:`select` (the
    priority) and :meth:`place` (:meth:`on_place` bookkeeping, then :meth:`on_ready` for each
    node it unblocks). Subclasses define those three. Cost: O(N + E) plus the priority's.

    Args:
        releases: node -> the nodes whose blocker count placing it decrements (backwards: its
            predecessors; forwards: its successors); nodes not in ``blockers`` are skipped.
        blockers: each scheduled node -> how many scheduled nodes must be placed before it is
            ready, in the order ready ties are first offered (graph order).
    """

    def __init__(self, releases: dict[fx.Node, list[fx.Node]],
                 blockers: dict[fx.Node, int]) -> None:
        self.releases = releases
        self.left = dict(blockers)
        self.placed: list[fx.Node] = []

    def run(self) -> list[fx.Node]:
        """Place every scheduled node; returns them in placement order."""
        for node, count in self.left.items():
            if count == 0:
                self.on_ready(node)
        total = len(self.left)
        while len(self.placed) < total:
            self.place(self.select())
        return self.placed

    def place(self, node: fx.Node) -> None:
        """Append ``node`` to the schedule and offer the nodes it unblocks."""
        self.placed.append(node)
        self.on_place(node)
        left = self.left
        for p in self.releases[node]:
            count = left.get(p)
            if count is None:   # not scheduled (fixed nodes)
                continue
            left[p] = count - 1
            if count == 1:
                self.on_ready(p)

    def select(self) -> fx.Node:   # pragma: no cover - abstract
        """The ready node that goes next (removed from the ready set)."""
        raise NotImplementedError

    def on_ready(self, node: fx.Node) -> None:   # pragma: no cover - abstract
        """``node`` just became ready."""
        raise NotImplementedError

    def on_place(self, node: fx.Node) -> None:
        """Bookkeeping when ``node`` is placed, before the nodes it unblocks are offered."""


class KeyScheduler(ListScheduler):
    """A list scheduler whose priority is a static key: the ready node of least
    ``key(node, step)`` goes next, ``step`` being the number of nodes placed when it became
    ready (so a key can prefer the nodes a placement just unblocked: depth first). Keys must
    be distinct (include the node's original position)."""

    def __init__(self, releases: dict[fx.Node, list[fx.Node]], blockers: dict[fx.Node, int],
                 key: Callable[[fx.Node, int], tuple]) -> None:
        super().__init__(releases, blockers)
        self.key = key
        self.heap: list[tuple[tuple, fx.Node]] = []

    def on_ready(self, node: fx.Node) -> None:
        heapq.heappush(self.heap, (self.key(node, len(self.placed)), node))

    def select(self) -> fx.Node:
        return heapq.heappop(self.heap)[1]


def ready_counts(deps: Deps, nodes: Iterable[fx.Node], *, backward: bool,
                 extra: dict[fx.Node, list[fx.Node]] | None = None
                 ) -> tuple[dict[fx.Node, list[fx.Node]], dict[fx.Node, int]]:
    """``(releases, blockers)`` of :class:`ListScheduler` for scheduling ``nodes`` (in graph
    order) backwards or forwards under ``deps``, plus ``extra`` edges (node -> nodes it
    releases, in the scheduling direction)."""
    releases = dict(deps.preds if backward else deps.succs)
    for n, more in (extra or {}).items():
        releases[n] = list(dict.fromkeys([*releases[n], *more]))
    blockers = dict.fromkeys(nodes, 0)
    for n in blockers:
        for m in releases[n]:
            if m in blockers:
                blockers[m] += 1
    return releases, blockers


@dataclass
class Plan:
    """A schedule: the new order, predictions and memory figures (bytes)."""

    order: list[fx.Node]
    records: dict[fx.Node, CollectiveRecord] = field(default_factory=dict)
    timeline: Timeline | None = None
    baseline_peak_bytes: int = 0
    peak_bytes: int = 0
    makespan_us: float = 0.0
    #: collectives whose bytes are data-dependent: the cost model's estimate of them
    size_estimates: dict[fx.Node, SizeEstimate] = field(default_factory=dict)


@dataclass
class _Facts:
    """Per-node facts the overlap scheduler needs, computed once per graph (all O(N + E))."""

    deps: Deps
    movable: list[fx.Node]          # every node but placeholders, attributes and the output
    kind: dict[fx.Node, OpClass]    # Storage.cls
    est: dict[fx.Node, float]       # estimated us, asked once per node
    dep: dict[fx.Node, int]         # index of the latest collective whose wait it depends on
    colls: list[fx.Node]            # collectives in (fixed) order
    start: dict[fx.Node, fx.Node]   # wait -> its collective (Storage.start)
    nbytes: dict[fx.Node, int]      # collective -> max(in, out) bytes on this rank
    sizes: dict[fx.Node, SizeEstimate]   # collectives whose bytes are data-dependent estimates
    group: dict[fx.Node, str]       # collective -> group name (its lane)
    n_succ: dict[fx.Node, int]      # movable successors (the output is always last)


def _facts(deps: Deps, storage: Storage, estimate: Callable[[fx.Node], float]) -> _Facts:
    movable = [n for n in deps.order if n.op not in FIXED_OPS]
    est, dep, nbytes, group, sizes = {}, {}, {}, {}, {}
    colls: list[fx.Node] = []
    index: dict[fx.Node, int] = {}
    preds, kind, start = deps.preds, storage.cls, storage.start
    for n in deps.order:
        d = -1
        for p in preds[n]:
            if dep[p] > d:
                d = dep[p]
        k = kind[n]
        if k == COLLECTIVE:
            index[n] = len(colls)
            colls.append(n)
            size = collective_size(n)   # data-dependent sizes: cost.py's fallback, marked
            if size.estimated:
                sizes[n] = size
            nbytes[n], group[n] = size.nbytes, str(arg_of(n, "group_name"))
            est[n] = max(0.0, float(estimate(n)))
        elif k == WAIT:
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
    return _Facts(deps, movable, kind, est, dep, colls, start, nbytes, sizes, group, n_succ)


class OverlapScheduler(ListScheduler):
    """One plan of :func:`list_schedule`'s policy, backwards, under a memory limit.

    Scheduling runs from the end of the graph backwards, so a node placed later runs earlier,
    and "how much compute runs between a collective's issue and its first wait" is known
    exactly when the issue is placed. State, in the backward sense (``now`` = compute
    microseconds placed so far, from the end): each collective's first-run wait time
    (``wait_at``), the next issue per lane (``lane_next``), the collectives in flight and their
    bytes, the live bytes (:class:`LiveBytes`) and the ``dep`` of the ready compute. Every step is a heap operation or a constant-time
    update: O((N + E) log N).
    """

    def __init__(self, facts: _Facts, storage: Storage, limit_bytes: int,
                 max_in_flight_bytes: int) -> None:
        super().__init__(facts.deps.preds, facts.n_succ)
        self.f = facts
        self.order, self.pos = facts.deps.order, facts.deps.pos
        self.limit_bytes = limit_bytes
        self.max_in_flight_bytes = max_in_flight_bytes
        self.memory = LiveBytes(storage)
        self.compute: list[tuple[int, int]] = []   # (-dep, -pos): descendants of later waits first
        self.waits: list[int] = []                 # -pos
        self.deferred: list[int] = []              # -pos of waits held back by the in-flight cap
        self.k = len(facts.colls) - 1              # the next collective (placed in reverse)
        self.now = 0.0
        self.wait_at: dict[fx.Node, float] = {}    # collective -> `now` at its first-run wait
        self.lane_next: dict[str, float] = {}      # group -> `now` at its next collective's issue
        self.in_flight: set[fx.Node] = set()
        self.flight = 0                            # bytes of the collectives in flight
        self._due_of: fx.Node | None = None        # the collective `_due` was computed for
        self._due = self._start = 0.0
        # ready compute per dep (the least dep: a lazy heap)
        self.ready_dep: dict[int, int] = {}
        self.dep_heap: list[int] = []
        waits: dict[fx.Node, list[fx.Node]] = {}
        for w, c in facts.start.items():
            waits.setdefault(c, []).append(w)
        # collectives whose results only leave the graph: issued as soon as they are ready
        self.asap = {c for c, ws in waits.items() if all(only_leaves_graph(w) for w in ws)}

    def select(self) -> fx.Node:
        """The scheduler's one priority rule (backwards: the node chosen runs before every node
        placed so far), first match wins; ties always go to the latest original position:

        1. a ready wait: each wait runs just before its first user (sink). One whose collective
           would push the bytes in flight over ``max_in_flight_bytes`` is deferred (it will run
           earlier) until a collective completes, i.e. is placed;
        2. the next collective (in reverse of their fixed order), once ready, if
           :meth:`_issue_now` says so (as soon as its inputs are ready, unless a documented
           reason holds it back);
        3. ready compute, highest ``dep`` first (``dep`` = index of the latest collective whose
           wait it depends on): compute that depends on a collective stays after its wait,
           independent compute moves in front of waits and hides the collective being placed;
        4. a deferred wait: the cap cannot hold (no collective can complete first).
        """
        while self.waits:
            w = self.order[-heapq.heappop(self.waits)]
            if self._fits(w):
                return w
            heapq.heappush(self.deferred, -self.pos[w])
        k, colls = self.k, self.f.colls
        if k >= 0 and self.left[colls[k]] == 0 and self._issue_now(colls[k]):
            return colls[k]
        if self.compute:
            return self.order[-heapq.heappop(self.compute)[1]]
        if self.deferred:
            w = self.order[-heapq.heappop(self.deferred)]
            log.debug("reorder_for_overlap: %s: max_in_flight_mb cannot hold (no collective "
                      "can complete first)", w.name)
            return w
        raise RuntimeError("reorder_for_overlap: no ready node (dependency cycle?)")

    def _contested(self, c: fx.Node) -> int | None:
        """The earlier collective that ready compute could hide if ``c`` is not issued before
        it, or None.

        ``c`` runs after the wait of collective ``d = dep[c]`` (its inputs read that wait's
        result; -1: none). Compute placed now (backwards) runs after ``c``'s issue, so after
        that wait; left for later, compute that does not depend on that wait (``dep`` below
        ``d``) can run before it and hide collective ``d``. Otherwise issuing ``c`` first takes
        nothing from any collective: every earlier one is issued before ``c`` anyway (the fixed
        order), so compute after ``c`` and before an earlier wait hides both."""
        d = self.f.dep[c]
        if d < 0:
            return None
        deps, ready = self.dep_heap, self.ready_dep
        while deps and ready.get(deps[0], 0) == 0:
            heapq.heappop(deps)
        return d if deps and deps[0] < d else None

    def _issue_now(self, c: fx.Node) -> bool:
        """Whether collective ``c`` (the next one; everything that reads it is placed) is
        placed now. Backwards, placing it last means issuing it first: by default ``c`` is
        issued **as soon as its inputs are ready** (after the collective before it), i.e.
        placed only once no ready compute is left to run after it. Issuing a collective early
        costs the compute lane nothing (it runs on its group's lane: fcoll's worker, the
        link), and the rule reads no timing, so a small estimate error or a calibration a few
        percent off cannot put a collective after independent compute it could have
        overlapped (the old "just early enough" rule ran ``ar; mm; cheap op; use`` as ``mm;
        ar; cheap op; use``). Documented reasons that issue it later:

        - the memory limit: the plan's live bytes already exceed ``limit_bytes``
          (``memory_budget_mb``): issued now, so its buffers live no longer;
        - the in-flight cap: a wait was deferred (``max_in_flight_mb``): issued now;
        - hiding an earlier collective (:meth:`_contested`): some ready compute could instead
          run before the wait of an earlier collective and hide it. Then ``c`` is issued once
          the compute after its first wait (or after the issue of the next collective on its
          lane, whichever is later) covers its estimate, and the rest of that compute is left
          for the earlier one (an MoE block's second all_to_all and the first one's hiding
          compute). The one timing-dependent choice, logged at DEBUG with its numbers. It has
          no margin: a margin would move the point where a timing change flips it, not remove
          it, and would take compute from the earlier collective whenever it is not needed.

        Ordering edges of :func:`dependencies` hold whatever this says: the fixed collective
        order (every rank issues the same sequence) and the FSDP prefetch window of one block
        (``META_NOT_BEFORE``, ``META_WAIT_BY``). A collective whose result only leaves the
        graph (DDP's gradients) is never held back to hide another."""
        over = self.memory.live > self.limit_bytes
        if not self.compute or self.deferred or over:
            if self.compute:
                log.debug("reorder_for_overlap: %s issued later than its inputs allow: %s",
                          c.name, "in-flight cap (max_in_flight_mb)" if self.deferred else
                          f"memory limit ({self.memory.live} live bytes > "
                          f"{self.limit_bytes}, memory_budget_mb)")
            return True
        if c in self.asap:
            return False
        j = self._contested(c)
        if j is None:
            return False
        if c is not self._due_of:
            # Fixed while c is the next collective: its waits are placed, and lane_next
            # changes only when a collective is placed.
            self._due_of = c
            self._start = max(self.wait_at.get(c, 0.0), self.lane_next.get(self.f.group[c], 0.0))
            self._due = self._start + self.f.est[c] \
                if c in self.wait_at else -math.inf   # nothing waits for it: now
        if self.now < self._due:
            return False
        if c in self.wait_at:
            log.debug("reorder_for_overlap: %s issued after part of the independent compute: "
                      "the compute between its issue and its use covers %.1f us >= its "
                      "estimate %.1f us; the compute before it is left to hide %s (%s reads "
                      "its result)", c.name, self.now - self._start, self.f.est[c],
                      self.f.colls[j].name, c.name)
        return True

    def _fits(self, w: fx.Node, reserved: int = 0) -> bool:
        """``w`` may run (backwards: its collective goes in flight) with ``reserved`` more
        bytes already promised to other waits."""
        c = self.f.start.get(w)
        return c is None or c in self.in_flight or not (self.flight or reserved) or \
            self.flight + reserved + self.f.nbytes[c] <= self.max_in_flight_bytes

    def on_ready(self, node: fx.Node) -> None:
        kind = self.f.kind[node]
        if kind == OTHER:
            d = self.f.dep[node]
            heapq.heappush(self.compute, (-d, -self.pos[node]))
            if not self.ready_dep.get(d):
                heapq.heappush(self.dep_heap, d)
            self.ready_dep[d] = self.ready_dep.get(d, 0) + 1
        elif kind == WAIT:
            heapq.heappush(self.waits, -self.pos[node])
        # collectives are taken in their fixed order (select), not from a ready heap

    def on_place(self, n: fx.Node) -> None:
        self.memory.place(n)
        f = self.f
        kind = f.kind[n]
        if kind == OTHER:
            self.now += f.est[n]
            self.ready_dep[f.dep[n]] -= 1
        elif kind == WAIT and n in f.start:
            c = f.start[n]
            self.wait_at[c] = self.now   # the last placed: its first wait
            if c not in self.in_flight:
                self.in_flight.add(c)
                self.flight += f.nbytes[c]
        elif kind == COLLECTIVE:
            if n in self.in_flight:
                self.in_flight.discard(n)
                self.flight -= f.nbytes[n]
            self.lane_next[f.group[n]] = self.now
            self.k -= 1
            self._release_deferred()

    def _release_deferred(self) -> None:
        """A collective completed: release held-back waits that now fit, counting the bytes of
        those released before them (releasing every wait that fits the current flight one by
        one, then holding most of them back again, is quadratic)."""
        reserved, deferred = 0, self.deferred
        while deferred and self._fits(w := self.order[-deferred[0]], reserved):
            heapq.heappush(self.waits, heapq.heappop(deferred))
            c = self.f.start.get(w)
            reserved += 0 if c is None or c in self.in_flight else self.f.nbytes[c]


def list_schedule(graph: fx.Graph, estimate: Callable[[fx.Node], float], *,
                  memory_budget_bytes: int, max_in_flight_bytes: int) -> Plan:
    """Plan an order of ``graph`` that hides collectives behind independent compute.

    Policy: list scheduling *backwards* from the output over the ready set, with heaps, by the
    priority of :meth:`OverlapScheduler.select`; ties always broken by original position, so it
    is deterministic and every rank plans the same order. Each collective is issued *as soon as
    its inputs are ready* (Inductor's ``raise_comms``), each wait just before its first use, and
    independent compute goes between them; only the memory limit, the in-flight cap and compute
    that an earlier collective needs for hiding issue a collective later
    (:meth:`OverlapScheduler._issue_now`). Only that last case reads the time estimates;
    ``estimate`` (microseconds per node, asked once per node)
    otherwise only feeds the predicted timeline and records. Cost: O((N + E) log N).

    The memory limit is checked on the finished order's peak (the :class:`LiveBytes` model of
    :func:`fcoll.passes.analysis.memory.peak_bytes`, counted while planning; the planner's choices
    follow the live bytes of a partial plan, a guide); over budget, the plan is redone with a
    quarter of the budget, then none, then the original order is kept (at most 3 plans; logged at
    DEBUG).

    Returns:
        The :class:`Plan` (order, per-collective records, memory figures in bytes).
    """
    storage = storage_model(graph)
    deps = dependencies(graph, storage)
    facts = _facts(deps, storage, estimate)
    head = [n for n in deps.order if n.op in ("placeholder", "get_attr")]
    tail = [n for n in deps.order if n.op == "output"]
    baseline = peak_bytes(deps.order, storage)
    # The fixed nodes run with nothing else live (before, or after, every other node): what
    # they allocate (the output node: its value) is a peak of its own.
    fixed_peak = max((storage.alloc(n) for n in head + tail), default=0)
    budgets = sorted({memory_budget_bytes, memory_budget_bytes // 4, 0}, reverse=True)
    for attempt, budget in enumerate(budgets):
        sched = OverlapScheduler(facts, storage, baseline + budget, max_in_flight_bytes)
        order = head + sched.run()[::-1] + tail
        peak = max(sched.memory.peak, fixed_peak)
        if peak <= baseline + memory_budget_bytes:
            break
        log.debug("reorder_for_overlap: plan %d peaks at %d bytes, over baseline %d + budget "
                  "%d; retrying with a smaller budget", attempt, peak, baseline,
                  memory_budget_bytes)
    else:
        log.debug("reorder_for_overlap: no plan within the memory budget; keeping the order")
        order, peak = deps.order, baseline
    tl = timeline_of(order, facts.est.__getitem__, storage.cls, starts=storage.start,
                     groups=facts.group, size_estimated=facts.sizes)
    return Plan(order=order, records=records(tl), timeline=tl, baseline_peak_bytes=baseline,
                peak_bytes=peak, makespan_us=tl.now_us, size_estimates=facts.sizes)
