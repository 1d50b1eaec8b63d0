"""Compute times measured in a run's trace, in place of the cost model's predictions.

The runtime's trace (``DIR/traces/rank{R}.json``, :mod:`fcoll.inspect.trace_compare`) has one
complete event per executed compute node (``"cat": "compute"``, name = node name), or, for a
graph whose compute Inductor compiled (``compute="inductor"``, the default ``"auto"``'s choice for
large inputs), one per *segment*: a maximal run of compute nodes between communication nodes,
named ``segment_<i>``, whose ``args["target"]`` is ``"inductor:<first node>..<last node>"``
(:func:`fcoll.compile.trace.segment_target`). :func:`node_events` splits such an event into one per
node of the run, in program order, sharing the segment's duration in proportion to the nodes'
predicted times (equally where those are all 0), so what follows reads per-node events either
way; a segment's measured time is then exact per segment and only its split is modelled. A node's
measured time is its event's duration plus the idle gap before it on the compute thread, since
the previous compute event ended or the previous wait returned (a comm ``"e"`` event): that gap
is the executor's own per-node cost (dispatch, bookkeeping), which the step pays too. Exposed
communication is not in it (a wait's blocked time ends at its ``"e"`` event). Per node, the
mean over the trace's occurrences (steps) after the first (which compiles and warms up) is
used: the mean, not the median, because a step is a sum of nodes and the sum of per-node
medians falls well short of the typical step when durations are skewed (measured on a loaded
2-core machine: 687 ms against graph spans of 950 ms). The first compute node of a graph gets
no gap (what precedes it is the previous step, not this graph), and the median gap over all
nodes becomes the program's fixed per-op cost (``op_overhead_us``: a shard's op is as slow to
launch as a whole one's).

The time a step spends *outside* its compiled graphs (the training loop's Python, Dynamo's guards
and wrappers, the autograd engine between a forward and a backward graph, data loading) is
measured in the same trace by :func:`outside_graphs_us`: the step's period (from one step's first
graph run to the next step's) minus the spans of its graph runs and minus the tracer's own
rewrites of the trace file in that period (``"cat": "trace"`` events, :mod:`fcoll.compile.trace`:
a traced run pays them, an untraced one does not). A graph run is found by its compute events,
which follow the program's compute nodes in order; its span runs from its first compute event (or
the issue of a collective the program issues before any compute) to its last (or the return of a
wait the program runs after all compute).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass

from fcoll.compile.trace import SEGMENT_TARGET_PREFIX
from fcoll.inspect.trace_compare import load_trace
from fcoll.sim.program import Program

__all__ = ["OutsideGraphs", "measured_compute_us", "node_events", "outside_graphs_us",
           "with_measured_compute"]

def node_events(events: list[dict], programs: list[Program]) -> list[dict]:
    """``events`` with each Inductor segment's compute event (module docstring) replaced by one
    event per compute node of ``programs`` that the segment ran, from its first node to its
    last in program order: the first at the segment's start, each next one where the previous
    ends, durations in proportion to the nodes' predicted ``us`` (equal shares where those sum
    to 0). The program is the one named by the event's ``args["graph"]`` (any program where
    the event names none). An event of a graph not in ``programs``, or whose nodes its program
    does not have in that order, is kept as it is. Other events are kept, in their order."""
    compute = {p.name: [n for n in p.nodes if n.cls == "compute"] for p in programs}
    where = {name: {n.name: i for i, n in enumerate(nodes)} for name, nodes in compute.items()}
    out = []
    for e in events:
        target = str((e.get("args") or {}).get("target", ""))
        if (e.get("cat") != "compute" or e.get("ph") != "X"
                or not target.startswith(SEGMENT_TARGET_PREFIX) or ".." not in target):
            out.append(e)
            continue
        first, _, last = target[len(SEGMENT_TARGET_PREFIX):].partition("..")
        graph = (e.get("args") or {}).get("graph")
        names = [graph] if graph in compute else list(compute) if graph is None else []
        run = next((compute[g][where[g][first]:where[g][last] + 1] for g in names
                    if first in where[g] and last in where[g]
                    and where[g][first] <= where[g][last]), None)
        if not run:
            out.append(e)
            continue
        total = sum(max(n.us, 0.0) for n in run)
        shares = ([max(n.us, 0.0) / total for n in run] if total > 0
                  else [1.0 / len(run)] * len(run))
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        for n, share in zip(run, shares):
            out.append({**e, "name": n.name, "ts": ts, "dur": dur * share})
            ts += dur * share
    return out


def measured_compute_us(trace: str | os.PathLike | dict | list, *, rank: int | None = None,
                        graph: str | None = None, programs: list[Program] | None = None
                        ) -> dict[str, tuple[float, float]]:
    """Node name -> (mean duration, mean idle gap before it), in microseconds (module
    docstring), of every compute node in ``trace``; ``rank`` keeps only events of that
    ``pid``; ``graph`` only events whose ``args["graph"]`` is it, where the runtime records
    one; ``programs``: split Inductor segments' events into their nodes
    (:func:`node_events`; without them a segment counts as one node named ``segment_<i>``).

    Raises:
        ValueError: not a Chrome trace (:func:`fcoll.inspect.trace_compare.load_trace`).
    """
    events = [e for e in load_trace(trace) if rank is None or e.get("pid", rank) == rank]
    if graph is not None:
        events = [e for e in events if (e.get("args") or {}).get("graph", graph) == graph]
    if programs:
        events = node_events(events, programs)
    marks = []       # (time, order, kind, event): compute starts/ends and wait returns
    for e in events:
        if e.get("cat") == "compute" and e.get("ph") == "X":
            marks.append((float(e["ts"]), 1, e))
        elif e.get("cat") == "comm" and e.get("ph") == "e":
            marks.append((float(e["ts"]), 0, e))
    marks.sort(key=lambda m: (m[0], m[1]))
    samples: dict[str, list[tuple[float, float]]] = defaultdict(list)
    idle_from: float | None = None
    for ts, order, e in marks:
        if order == 0:                       # a wait returned: compute resumes from here
            idle_from = ts if idle_from is None else max(idle_from, ts)
            continue
        dur = float(e.get("dur", 0.0))
        gap = ts - idle_from if idle_from is not None and ts >= idle_from else 0.0
        samples[e["name"]].append((dur, gap))
        idle_from = ts + dur
    out = {}
    for name, v in samples.items():
        v = v[1:] if len(v) > 1 else v           # the first occurrence compiles / warms up
        out[name] = (statistics.fmean(d for d, _ in v), statistics.fmean(g for _, g in v))
    return out


def with_measured_compute(program: Program, measured: dict[str, tuple[float, float]]
                          ) -> tuple[Program, int]:
    """``program`` with each compute node's ``us`` replaced by its measured duration plus gap
    (:func:`measured_compute_us`; the first compute node the trace has: no gap, since what
    precedes it is another graph or the step outside the graphs) where the trace has it;
    returns the new program and how many compute nodes the trace lacked (they keep their
    predicted time)."""
    nodes, missing, gaps, first = [], 0, [], True
    for n in program.nodes:
        if n.cls == "compute":
            if n.name in measured:
                dur, gap = measured[n.name]
                gap = 0.0 if first else gap  # before a graph's first traced node: another graph
                first = False
                gaps.append(gap)
                n = dataclasses.replace(n, us=float(dur + gap))
            else:
                missing += 1
        nodes.append(n)
    overhead = statistics.median(gaps) if gaps else 0.0
    return dataclasses.replace(program, nodes=tuple(nodes), by_name={},
                               cost_source="measured (trace)", op_overhead_us=overhead), missing


@dataclass(frozen=True)
class OutsideGraphs:
    """A step's time outside its compiled graphs, measured in a trace (microseconds; medians
    over the trace's complete steps, each step = one run of every program, in order).

    Attributes:
        outside_us: median of (period - graph-run spans - tracer) over the steps.
        period_us: median step period (one step's first graph run start to the next's).
        graphs_us: median sum of the step's graph-run spans.
        steps: how many steps (with a following step, so a period) the medians are over.
        tracer_us: median time per step the tracer spent rewriting its file (0 in traces
            written before the recorder recorded it).
    """

    outside_us: float
    period_us: float
    graphs_us: float
    steps: int
    tracer_us: float = 0.0


def _edges(program: Program) -> tuple[set[str], set[str]]:
    """Names of the collectives ``program`` issues before its first compute node (their issue
    may start a run) and of those it waits for after its last compute node (their wait's
    return may end a run)."""
    order = [n for n in program.nodes if n.cls != "placeholder"]
    comp = [i for i, n in enumerate(order) if n.cls == "compute"]
    if not comp:
        return set(), set()
    lead = {n.name for n in order[:comp[0]] if n.cls == "collective"}
    trail = {n.collective for n in order[comp[-1] + 1:] if n.cls == "wait"}
    return lead, trail


def outside_graphs_us(trace: str | os.PathLike | dict | list, programs: list[Program], *,
                      rank: int | None = None) -> OutsideGraphs:
    """The step time outside ``programs`` (one step: each program run once) in ``trace``
    (module docstring). ``rank``: only events of that ``pid``.

    The programs run in the order the trace first shows each one's compute (its events'
    ``args["graph"]``), so a step's forward and backward pair up whatever their file names'
    order (``graph_0_backward`` sorts before ``graph_0_forward``); in the order given where
    the events name no graph. Any rotation of a step's order measures the same: every period
    holds each graph run once.

    The trace's compute events (Inductor segments split into their nodes: :func:`node_events`)
    are matched, in order, against the step's compute nodes that appear in the trace (nodes
    the executor does not trace are skipped); a step is counted
    when all of its programs' events follow in that order and the next step starts right
    after it. Nothing is dropped for compilation: the first step's compute runs after its
    compile (the backend compiles before the first run), and the median absorbs a slow one.

    Raises:
        ValueError: the trace holds fewer than two consecutive steps of these programs
            (naming the programs and how many compute events matched).
    """
    events = node_events([e for e in load_trace(trace)
                          if rank is None or e.get("pid", rank) == rank], programs)
    comp = sorted((e for e in events if e.get("cat") == "compute" and e.get("ph") == "X"),
                  key=lambda e: float(e["ts"]))
    comm = sorted((e for e in events if e.get("cat") == "comm" and e.get("ph") in ("b", "e")),
                  key=lambda e: float(e["ts"]))
    writes = [(float(e["ts"]), float(e.get("dur", 0.0))) for e in events
              if e.get("cat") == "trace" and e.get("ph") == "X"]
    # events are keyed by (graph, node name) where the runtime records the graph: a forward
    # and its backward both have a getitem_38, which may run as compute in one only
    names = [((e.get("args") or {}).get("graph"), e["name"]) for e in comp]
    traced = set(names)
    first_seen: dict[str | None, int] = {}
    for i, (graph, _) in enumerate(names):
        first_seen.setdefault(graph, i)
    if all(p.name in first_seen for p in programs):
        programs = sorted(programs, key=lambda p: first_seen[p.name])
    seqs = []
    for p in programs:
        graph = p.name if p.name in first_seen else None
        seqs.append([(graph, n.name) for n in p.nodes
                     if n.cls == "compute" and (graph, n.name) in traced])
    step_names = [name for seq in seqs for name in seq]
    size = len(step_names)
    if not size or any(not seq for seq in seqs):
        raise ValueError(f"outside the graphs: the trace has no compute events of "
                         f"{[p.name for p in programs]} (another run's trace?)")
    starts = [i for i in range(len(names) - size + 1) if names[i:i + size] == step_names]
    steps = [i for i in starts if i + size in starts]    # complete, with a following step
    if not steps:
        raise ValueError(f"outside the graphs: the trace holds {len(starts)} step(s) of "
                         f"{[p.name for p in programs]} ({size} compute events each) and no "
                         "two in a row; run more steps")
    edges = [_edges(p) for p in programs]

    def spans(first: int) -> list[tuple[float, float]]:
        out, i = [], first
        for seq, (lead, trail) in zip(seqs, edges):
            a, b = comp[i], comp[i + len(seq) - 1]
            lo = float(a["ts"])
            prev_end = float(comp[i - 1]["ts"]) + float(comp[i - 1].get("dur", 0.0)) \
                if i > 0 else float("-inf")
            hi = float(b["ts"]) + float(b.get("dur", 0.0))
            nxt = float(comp[i + len(seq)]["ts"]) if i + len(seq) < len(comp) else float("inf")
            for e in comm:
                ts = float(e["ts"])
                if e["ph"] == "b" and e["name"] in lead and prev_end <= ts < lo:
                    lo = ts
                elif e["ph"] == "e" and e["name"] in trail and hi < ts <= nxt:
                    hi = ts
            out.append((lo, hi))
            i += len(seq)
        return out

    rows = []
    for i in steps:
        runs, after = spans(i), spans(i + size)
        t0, t1 = runs[0][0], after[0][0]
        inside = sum(hi - lo for lo, hi in runs)
        tracer = sum(d for ts, d in writes if t0 <= ts < t1)
        rows.append((t1 - t0 - inside - tracer, t1 - t0, inside, tracer))
    return OutsideGraphs(*(statistics.median(r[k] for r in rows) for k in range(3)),
                         len(rows), statistics.median(r[3] for r in rows))
