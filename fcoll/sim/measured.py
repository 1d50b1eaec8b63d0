"""Compute times measured in a run's trace, in place of the cost model's predictions.

The runtime's trace (``DIR/traces/rank{R}.json``, :mod:`fcoll.inspect.trace_compare`) has one
complete event per executed compute node (``"cat": "compute"``, name = node name). A node's
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
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections import defaultdict
from fcoll.inspect.trace_compare import load_trace
from fcoll.sim.program import Program

__all__ = ["measured_compute_us", "with_measured_compute"]


def measured_compute_us(trace: str | os.PathLike | dict | list, *, rank: int | None = None,
                        graph: str | None = None) -> dict[str, tuple[float, float]]:
    """Node name -> (mean duration, mean idle gap before it), in microseconds (module
    docstring), of every compute node in ``trace``; ``rank`` keeps only events of that
    ``pid``; ``graph`` only events whose ``args["graph"]`` is it, where the runtime records
    one.

    Raises:
        ValueError: not a Chrome trace (:func:`fcoll.inspect.trace_compare.load_trace`).
    """
    events = [e for e in load_trace(trace) if rank is None or e.get("pid", rank) == rank]
    if graph is not None:
        events = [e for e in events if (e.get("args") or {}).get("graph", graph) == graph]
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
    (:func:`measured_compute_us`; the first compute node: no gap) where the trace has it;
    returns the new program and how many compute nodes the trace lacked (they keep their
    predicted time)."""
    nodes, missing, gaps, first = [], 0, [], True
    for n in program.nodes:
        if n.cls == "compute":
            if n.name in measured:
                dur, gap = measured[n.name]
                gap = 0.0 if first else gap
                gaps.append(gap)
                n = dataclasses.replace(n, us=float(dur + gap))
            else:
                missing += 1
            first = False
        nodes.append(n)
    overhead = statistics.median(gaps) if gaps else 0.0
    return dataclasses.replace(program, nodes=tuple(nodes), by_name={},
                               cost_source="measured (trace)", op_overhead_us=overhead), missing
