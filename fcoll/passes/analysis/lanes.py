"""The lane simulator: compute serial, one lane per group, a wait blocks compute.

One execution model, the executor's (:mod:`fcoll.compile.executor`), in :class:`LaneClock`:
nodes are issued in order by one compute lane; a compute node runs when compute reaches it; a
collective is issued when compute reaches it and starts when its group's lane is free, which it
then holds for its duration (collectives of one group run serially, in issue order); a wait
blocks compute until its collective ends, and the time blocked is exposed communication. Times
are microseconds from the graph's start; durations are the caller's (the cost model, or a
test's), negative ones counted as 0.

Two users, one clock: :class:`Timeline` (here) runs an order of FX nodes for the passes, the
scheduler and ``fcoll.inspect``, and records an event per node; :func:`fcoll.sim.replay.replay`
runs a recorded program for ``fcoll.sim`` and adds the storage model's memory. They differ where
their inputs do: a wait whose collective is not among the nodes run so far blocks nothing in a
:class:`Timeline` (the scheduler simulates partial orders), while a recorded program must
issue every collective before its wait, so :func:`~fcoll.sim.replay.replay` raises there.

A collective whose size is data-dependent (unbacked split sizes, e.g. MoE routing) is costed
with the cost model's documented fallback (:mod:`fcoll.passes.analysis.cost`); its event and
record carry ``size_estimated = True`` so that a report can say the prediction assumed a size.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Collection, Sequence

import torch.fx as fx

from fcoll.passes.graph import arg_of, start_of
from fcoll.passes.analysis.memory import COLLECTIVE, WAIT, OpClass, op_class

__all__ = ["LaneClock", "PredictedEvent", "Timeline", "timeline_of", "CollectiveRecord",
           "records"]


class LaneClock:
    """The clock of the lane model (module docstring): where compute is, and when each lane is
    free. Every update is one of three steps, in the order the nodes are issued.

    Attributes:
        now_us: the compute lane's time (microseconds from the start).
        lane_free: lane (a group name) -> when its last issued collective ends.
    """

    def __init__(self) -> None:
        self.now_us = 0.0
        self.lane_free: dict[str, float] = {}

    def compute(self, dur_us: float) -> float:
        """Run ``dur_us`` of compute (at least 0) from :attr:`now_us`; returns its end, the
        new :attr:`now_us`."""
        self.now_us = self.now_us + max(0.0, dur_us)
        return self.now_us

    def issue(self, lane: str, dur_us: float) -> tuple[float, float]:
        """Issue a collective of ``dur_us`` (at least 0) on ``lane`` now: it starts when the
        lane is free (at :attr:`now_us` or after the lane's previous collective). Returns
        ``(start_us, end_us)``; compute does not move."""
        start = max(self.now_us, self.lane_free.get(lane, 0.0))
        end = start + max(0.0, dur_us)
        self.lane_free[lane] = end
        return start, end

    def wait(self, end_us: float) -> float:
        """Block compute until ``end_us`` (a collective's end); returns the time blocked."""
        blocked = max(0.0, end_us - self.now_us)
        self.now_us += blocked
        return blocked

    @property
    def end_us(self) -> float:
        """When compute and every lane are done."""
        return max([self.now_us, *self.lane_free.values()])


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
        size_estimated: a collective whose bytes are data-dependent, so its duration assumes
            the cost model's fallback size (:mod:`fcoll.passes.analysis.cost`); False otherwise.
    """

    node: str
    kind: str
    lane: str
    start_us: float
    end_us: float
    exposed_us: float = 0.0
    size_estimated: bool = False

    @property
    def dur_us(self) -> float:
        """``end_us - start_us``, never negative."""
        return max(0.0, self.end_us - self.start_us)


class Timeline(LaneClock):
    """Runs FX nodes on a :class:`LaneClock` in the order they are fed (the module docstring's
    model), with one :class:`PredictedEvent` per ``call_function`` node.

    Attributes:
        events: the events in the order run; ``by_node``: node -> its event.
        issued: collective node -> its event (``exposed_us`` sums its waits' blocked time).
    """

    def __init__(self, estimate: Callable[[fx.Node], float],
                 classes: dict[fx.Node, OpClass] | None = None, *,
                 starts: dict[fx.Node, fx.Node] | None = None,
                 groups: dict[fx.Node, str] | None = None,
                 size_estimated: Collection[fx.Node] = ()) -> None:
        self.estimate = estimate
        self.size_estimated = size_estimated
        self.classes = classes if classes is not None else {}
        super().__init__()
        self.issued: dict[fx.Node, PredictedEvent] = {}
        self.events: list[PredictedEvent] = []
        self.by_node: dict[fx.Node, PredictedEvent] = {}
        self._starts: dict[fx.Node, fx.Node | None] = dict(starts) if starts else {}
        self._groups = groups if groups is not None else {}

    def _start(self, wait: fx.Node) -> fx.Node | None:
        if wait not in self._starts:
            self._starts[wait] = start_of(wait)
        return self._starts[wait]

    def run(self, node: fx.Node) -> PredictedEvent | None:
        """Run ``node`` (placeholders and other non-calls are skipped: None); returns its
        event."""
        if node.op != "call_function":
            return None
        cls = self.classes.get(node)
        if cls is None:
            cls = op_class(node)
        if cls == COLLECTIVE:
            lane = self._groups.get(node)
            if lane is None:
                lane = str(arg_of(node, "group_name"))
            start, end = self.issue(lane, self.estimate(node))
            ev = PredictedEvent(node.name, "collective", lane, start, end,
                                size_estimated=node in self.size_estimated)
            self.issued[node] = ev
        elif cls == WAIT:
            at = self.now_us
            coll = self.issued.get(self._start(node))
            blocked = self.wait(coll.end_us) if coll is not None else 0.0
            ev = PredictedEvent(node.name, "wait", "compute", at, at + blocked, blocked)
            if coll is not None:
                coll.exposed_us += blocked
        else:
            at = self.now_us
            ev = PredictedEvent(node.name, "compute", "compute", at,
                                self.compute(self.estimate(node)))
        self.events.append(ev)
        self.by_node[node] = ev
        return ev


def timeline_of(nodes: Sequence[fx.Node], estimate: Callable[[fx.Node], float],
                classes: dict[fx.Node, OpClass] | None = None, *,
                starts: dict[fx.Node, fx.Node] | None = None,
                groups: dict[fx.Node, str] | None = None,
                size_estimated: Collection[fx.Node] = ()) -> Timeline:
    """Run ``nodes`` in order through a fresh :class:`Timeline`.

    Known facts of the nodes, each optional (asked of the node when missing): ``classes``,
    their :func:`~fcoll.passes.analysis.memory.op_class` (e.g. ``Storage.cls``); ``starts``, wait ->
    its collective (``Storage.start``); ``groups``, collective -> its group name;
    ``size_estimated``, the collectives whose data-dependent sizes the estimate assumed (their
    events are marked ``size_estimated``).
    """
    tl = Timeline(estimate, classes, starts=starts, groups=groups,
                  size_estimated=size_estimated)
    for n in nodes:
        tl.run(n)
    return tl



@dataclass
class CollectiveRecord:
    """What the scheduler predicts for one collective (times in microseconds).

    Attributes:
        estimated_us: its predicted duration.
        exposed_us: the part of it compute waits for.
        hiding: names of the compute nodes predicted to run while it is in flight.
        size_estimated: its bytes are data-dependent and were estimated (the cost model's
            fallback), so ``estimated_us`` assumes a size.
    """

    estimated_us: float
    exposed_us: float
    hiding: list[str]
    size_estimated: bool = False


def records(tl: Timeline) -> dict[fx.Node, CollectiveRecord]:
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
        out[node] = CollectiveRecord(ev.end_us - ev.start_us, ev.exposed_us, hiding,
                                     ev.size_estimated)
    return out
