"""``compare(trace, gm)``: measured (Chrome/Perfetto trace of a real run) against predicted time.

The runtime writes one trace per rank (``{trace_dir}/rank{R}.json``, format in
:mod:`fcoll.compile.trace`): compute nodes are complete events (``"ph": "X"``,
``"cat": "compute"``); each collective is an async pair, ``"ph": "b"`` when issued and
``"ph": "e"`` when its wait returned (``"cat": "comm"``, same ``"id"``, name = collective node
name), whose ``args`` name the graph, the group's sequence numbers, when this rank's engine
executed it (``run_start_us`` .. ``run_end_us``) and how long its wait blocked
(``exposed_us``). ``ts`` and ``dur`` are microseconds; ``pid`` is the rank.

What is compared with what, per collective (means over occurrences: steps, one rank):

- ``pred_us`` against ``meas_us``, and their ratio ``pred/meas``: the cost model's time of the
  collective (the calibrated piecewise alpha-beta curve of
  :mod:`fcoll.passes.analysis.comm_cost`) against its **own time**, which is what the curve
  was calibrated on: blocking calls of ranks that start together, each cell the slowest
  rank's median. So the own time starts when the **last rank started** executing it (the
  latest ``run_start_us`` of the same group and sequence number across the ranks' traces:
  the ranks of one host share the monotonic clock) and ends when it completed on this rank
  (``run_end_us``). Time a rank spends waiting inside the collective for a peer that came
  later is the peer's lateness, not the collective's cost (on a 2-core machine one rank's
  compute or a busy process can hold the core its peer needs); it is shown apart as
  ``late_us`` (this rank's start to the last rank's start). Without the peers' traces (one
  rank's file alone) the own time starts at this rank's own start and includes that wait.
  Issue and wait return do not bound the collective's time: a collective hidden behind
  compute is issued long before its wait (``span_us``, issue to wait return, shown for
  reference), and a queued one starts only when the group's earlier collectives are done.
  Collectives without recorded execution times (gloo, nccl, hierarchical groups; traces
  written before these fields) have ``meas_us`` None and are not judged.
- ``pred_exposed_us`` against ``meas_exposed_us``: the time the compute thread sat blocked in
  the collective's wait, as the schedule's simulator predicted it and as the trace recorded it
  (``args["exposed_us"]``; for older traces, the ``"X"`` event of the wait node, else the gap
  between the wait's return and the later of the issue and the previous activity on the rank).

- ``computing`` and ``worker``: which regime the collective ran in. The curve is of blocking
  calls on free cores (the calling thread spins through every phase); a hidden collective runs
  on the group's worker thread (short spins, then futex sleeps) while the ranks compute, and
  on a machine with as many cores as ranks each of its phases then waits for a core and for
  the GIL. ``computing`` is the largest share of the own time that any rank's compute thread
  computed, ``worker`` the share of occurrences the worker ran; the count under the table is
  repeated for the rows with ``computing`` under :data:`QUIET_COMPUTING`.

A row "holds" when ``pred/meas`` is within :data:`TOLERANCE` of 1 (+-30 %); the count is under
the table. Events are matched to the graph by ``args["graph"]`` when the trace records it, so a
forward's and a backward's same-named node are never mixed.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch.fx as fx

from fcoll.inspect.predicted import PredictFn, collective_timings, predicted_events
from fcoll.inspect.text import fmt_us, text_table
from fcoll.passes.analysis.cost import collective_size
from fcoll.passes.graph import collective_info, collectives

__all__ = ["CompareRow", "TraceComparison", "compare", "last_starts", "load_trace",
           "measured_collectives", "QUIET_COMPUTING", "TOLERANCE"]

log = logging.getLogger(__name__)

#: A prediction "holds" within this relative error of the measured time (+-30 %).
TOLERANCE = 0.30
#: A collective that ran with compute for less than this share of its own time counts as run
#: in the regime the model was calibrated in (the cores to itself).
QUIET_COMPUTING = 0.10


def load_trace(trace: str | os.PathLike | dict | list) -> list[dict[str, Any]]:
    """The ``traceEvents`` of a trace given as a path, a loaded dict, or a list of events.

    Raises:
        ValueError: the JSON holds neither a ``traceEvents`` list nor a list of events.
    """
    if isinstance(trace, (str, os.PathLike)):
        with open(trace, encoding="utf-8") as f:
            trace = json.load(f)
    if isinstance(trace, dict):
        trace = trace.get("traceEvents")
    if not isinstance(trace, list):
        raise ValueError("not a Chrome trace: expected {'traceEvents': [...]} or a list of events")
    return trace


@dataclass(frozen=True)
class _Occurrence:
    name: str
    pid: Any
    issue_ts: float
    done_ts: float
    exposed_us: float
    args: dict[str, Any]
    own_us: float | None = None
    late_us: float | None = None
    computing: float | None = None


def _compute_spans(events: list[dict[str, Any]]) -> dict[Any, list[tuple[float, float]]]:
    """Per pid, the (start, end) of every compute event, sorted."""
    spans: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "compute":
            t = float(e["ts"])
            spans[e.get("pid")].append((t, t + float(e.get("dur", 0.0))))
    return {pid: sorted(v) for pid, v in spans.items()}


def _computing(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """The fraction of ``start .. end`` during which this rank's compute thread computed."""
    if end <= start:
        return 0.0
    i = bisect.bisect_left(spans, (start, float("-inf")))
    i = max(0, i - 1)
    busy = 0.0
    while i < len(spans) and spans[i][0] < end:
        busy += max(0.0, min(end, spans[i][1]) - max(start, spans[i][0]))
        i += 1
    return min(1.0, busy / (end - start))


def _busy_ends(events: list[dict[str, Any]]) -> dict[Any, list[float]]:
    """Per pid, the times activity ended: compute ends and wait returns, sorted."""
    ends: dict[Any, list[float]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "compute":
            ends[e.get("pid")].append(float(e["ts"]) + float(e.get("dur", 0.0)))
        elif e.get("ph") == "e" and e.get("cat") == "comm":
            ends[e.get("pid")].append(float(e["ts"]))
    return {pid: sorted(v) for pid, v in ends.items()}


def _key(args: dict[str, Any]) -> tuple | None:
    """(group, first sequence number) of a collective event: one collective on every rank."""
    if args.get("seq") is None or args.get("group") is None:
        return None
    return (str(args["group"]), int(args["seq"]))


def last_starts(traces: Iterable[Any]) -> dict[tuple, float]:
    """(group, sequence number) -> the latest ``run_start_us`` over the given ranks' traces
    (each a path, loaded dict or event list): when the last rank began the collective."""
    latest: dict[tuple, float] = {}
    for trace in traces:
        for e in load_trace(trace):
            args = e.get("args") or {}
            if e.get("ph") != "e" or e.get("cat") != "comm" or args.get("run_start_us") is None:
                continue
            k = _key(args)
            if k is not None:
                latest[k] = max(latest.get(k, float("-inf")), float(args["run_start_us"]))
    return latest


def measured_collectives(trace: str | os.PathLike | dict | list, *, graph: str | None = None,
                         peers: Iterable[Any] = ()) -> dict[str, list[_Occurrence]]:
    """Every completed collective occurrence in ``trace``, by collective node name.

    Args:
        trace: path, loaded dict, or list of events.
        graph: keep only events whose ``args["graph"]`` equals this (events that record no
            graph, from older traces, are kept); None keeps everything.
        peers: the other ranks' traces of the same run: the own time starts at the latest
            start of the collective over this rank and these (see the module docstring), and
            ``computing`` is the largest share of it that any of these ranks computed.

    Returns:
        name -> occurrences (issue time, return time, exposed µs, own µs, late µs, args) in
        issue order. An issue without a matching end (run cut short) is dropped with a DEBUG
        log.
    """
    events = load_trace(trace)
    if graph is not None:
        events = [e for e in events if (e.get("args") or {}).get("graph", graph) == graph]
    peers = [load_trace(p) for p in peers]
    starts = last_starts([events, *peers])
    ends = _busy_ends(events)
    spans = _compute_spans(events)
    for peer in peers:  # every rank's compute, whatever graph it ran
        for pid, sp in _compute_spans(peer).items():
            spans.setdefault(pid, sp)
    xs: dict[tuple, list[dict]] = defaultdict(list)  # (pid, name) -> complete events
    for e in events:
        if e.get("ph") == "X":
            xs[(e.get("pid"), e.get("name"))].append(e)
    opened: dict[tuple, dict[str, Any]] = {}
    out: dict[str, list[_Occurrence]] = defaultdict(list)
    for e in sorted((e for e in events if e.get("cat") == "comm" and e.get("ph") in "be"),
                    key=lambda e: (float(e["ts"]), e["ph"] == "b")):
        key = (e.get("pid"), e.get("id"), e.get("name"))
        if e["ph"] == "b":
            opened[key] = e
            continue
        b = opened.pop(key, None)
        if b is None:
            log.debug("trace: end of %s (id %s) without a begin; ignored", e.get("name"),
                      e.get("id"))
            continue
        issue, done = float(b["ts"]), float(e["ts"])
        args = {**(b.get("args") or {}), **(e.get("args") or {})}
        exposed = args.get("exposed_us")
        if exposed is None:
            exposed = _exposed(e.get("pid"), issue, done, args.get("wait_node"), ends, xs)
        own = late = computing = None
        if args.get("run_start_us") is not None and args.get("run_end_us") is not None:
            first = float(args["run_start_us"])
            last = max(first, starts.get(_key(args), first))
            own, late = max(0.0, float(args["run_end_us"]) - last), last - first
            computing = max((_computing(sp, last, last + own) for sp in spans.values()),
                            default=0.0)
        out[str(e.get("name"))].append(_Occurrence(
            str(e.get("name")), e.get("pid"), issue, done, float(exposed), args, own, late,
            computing))
    for key in opened:
        log.debug("trace: collective %s (id %s, pid %s) never completed; ignored", key[2],
                  key[1], key[0])
    return dict(out)


def _exposed(pid: Any, issue: float, done: float, wait_node: str | None,
             ends: dict[Any, list[float]], xs: dict[tuple, list[dict]]) -> float:
    eps = 1e-3
    for x in xs.get((pid, wait_node), ()) if wait_node else ():
        start, end = float(x["ts"]), float(x["ts"]) + float(x.get("dur", 0.0))
        if start - eps <= done <= end + eps or abs(end - done) <= eps:
            return max(0.0, min(end, done) - max(start, issue))
    prev = max((t for t in ends.get(pid, ()) if t < done - eps), default=issue)
    return max(0.0, done - max(issue, prev))


@dataclass(frozen=True)
class CompareRow:
    """One collective: predicted and measured times (µs; measured = mean over occurrences).

    ``measured_us`` is the collective's own time (from the last rank's start to its completion
    on this rank; see the module docstring), None where the trace has no execution times;
    ``late_us`` how long this rank waited for that last start; ``span_us`` issue to wait
    return; ``computing`` the largest fraction of the own time during which a rank's compute
    thread ran compute (this rank's, or a peer's when their traces are given: a peer's
    worker that shares a core with its compute slows every phase; 0: the collective had the
    cores to itself, as when calibrated);
    ``on_worker`` the share of occurrences the group's worker thread ran (short spins, then
    sleeps) rather than the calling or waiting thread (long spins, as when calibrated).
    ``busbw_gbps`` is the runtime's figure (of the own time where known), averaged.
    ``bytes`` is the collective's size (nccl-tests' convention,
    :func:`fcoll.ops.facts.comm_bytes`): the trace's when it recorded one, else the graph's.
    """

    node: str
    op: str
    occurrences: int
    predicted_us: float | None
    measured_us: float | None
    predicted_exposed_us: float | None
    measured_exposed_us: float | None
    busbw_gbps: float | None
    bytes: int | None = None
    late_us: float | None = None
    span_us: float | None = None
    computing: float | None = None
    on_worker: float | None = None

    @property
    def ratio(self) -> float | None:
        """``predicted_us / measured_us`` (None if either is missing or measured is 0)."""
        if self.predicted_us is None or not self.measured_us:
            return None
        return self.predicted_us / self.measured_us

    @property
    def holds(self) -> bool | None:
        """Whether the prediction is within :data:`TOLERANCE` of the measured time."""
        r = self.ratio
        return None if r is None else abs(r - 1.0) <= TOLERANCE

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "holds": self.holds}


@dataclass(frozen=True)
class TraceComparison:
    """Per-collective rows and totals; ``str()`` is a table, ``as_dict()`` plain values.

    Totals are sums over collectives of the per-occurrence means (so one step's worth).
    ``unmatched`` names trace collectives that are not nodes of the graph.
    """

    rows: list[CompareRow]
    predicted_exposed_us: float
    measured_exposed_us: float
    unmatched: list[str] = field(default_factory=list)

    @property
    def judged(self) -> list[CompareRow]:
        """The rows with both a prediction and a measured own time."""
        return [r for r in self.rows if r.holds is not None]

    @property
    def within(self) -> int:
        """How many judged rows hold (:data:`TOLERANCE`)."""
        return sum(bool(r.holds) for r in self.judged)

    @property
    def quiet(self) -> list[CompareRow]:
        """The judged rows that ran with compute under :data:`QUIET_COMPUTING` of their own
        time: the regime the model was calibrated in."""
        return [r for r in self.judged if (r.computing or 0.0) < QUIET_COMPUTING]

    @property
    def worst_ratio(self) -> float | None:
        """The judged ``pred/meas`` farthest from 1 (by ``max(r, 1/r)``), or None."""
        rs = [r.ratio for r in self.judged if r.ratio]
        return max(rs, key=lambda r: max(r, 1 / r)) if rs else None

    def as_dict(self) -> dict[str, Any]:
        return {"rows": [r.as_dict() for r in self.rows],
                "predicted_exposed_us": self.predicted_exposed_us,
                "measured_exposed_us": self.measured_exposed_us, "unmatched": self.unmatched,
                "judged": len(self.judged), "within": self.within,
                "worst_ratio": self.worst_ratio, "quiet_judged": len(self.quiet),
                "quiet_within": sum(bool(r.holds) for r in self.quiet)}

    def __str__(self) -> str:
        headers = ("node", "op", "bytes", "n", "pred_us", "meas_us", "pred/meas", "late_us",
                   "computing", "worker", "span_us", "pred_exposed_us", "meas_exposed_us",
                   "busbw_GB/s")
        rows = [(r.node, r.op, "-" if r.bytes is None else r.bytes, r.occurrences,
                 fmt_us(r.predicted_us), fmt_us(r.measured_us),
                 "-" if r.ratio is None else f"{r.ratio:.2f}", fmt_us(r.late_us),
                 "-" if r.computing is None else f"{r.computing:.0%}",
                 "-" if r.on_worker is None else f"{r.on_worker:.0%}", fmt_us(r.span_us),
                 fmt_us(r.predicted_exposed_us), fmt_us(r.measured_exposed_us),
                 "-" if r.busbw_gbps is None else f"{r.busbw_gbps:.2f}") for r in self.rows]
        rows.append(("total", "", "", "", "", "", "", "", "", "", "",
                     fmt_us(self.predicted_exposed_us), fmt_us(self.measured_exposed_us), ""))
        text = text_table(headers, rows, (False, False) + (True,) * 12)
        if self.judged:
            quiet = self.quiet
            text += (f"\npredicted within +-{TOLERANCE:.0%} of measured: {self.within} of "
                     f"{len(self.judged)} collectives; of those that ran with compute under "
                     f"{QUIET_COMPUTING:.0%} of their time (the calibrated regime): "
                     f"{sum(bool(r.holds) for r in quiet)} of {len(quiet)}"
                     f"\n(meas_us: own time, from the last rank's start to completion; "
                     f"late_us: waiting for that start; computing: largest share of the own "
                     f"time a rank computed; worker: share run by the group's worker thread; "
                     f"span_us: issue to wait return)")
        if self.unmatched:
            text += f"\nin the trace but not in the graph: {', '.join(self.unmatched)}"
        return text


def _graph_bytes(node: fx.Node) -> int | None:
    try:
        return collective_size(node).nbytes
    except Exception:  # noqa: BLE001  a size the graph cannot evaluate: not shown
        return None


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def compare(trace: str | os.PathLike | dict | list, gm: fx.GraphModule, *,
            events: Iterable[Any] | None = None, predict: PredictFn | None = None,
            graph: str | None = None, peers: Iterable[Any] = ()) -> TraceComparison:
    """Measured against predicted time, per collective of ``gm``, and exposed time in total.

    Args:
        trace: a rank's trace (path or loaded dict) of running ``gm``, as the runtime writes it.
        gm: the graph that ran (after the passes); its collective node names match the trace.
        events: precomputed predicted events of ``gm``.
        predict: a simulator ``gm -> events``, instead of ``fcoll.passes.rewrites.overlap.predict``.
        graph: only trace events with ``args["graph"] == graph`` (see
            :func:`measured_collectives`). Events of a collective whose ``args["op"]`` differs
            from the node's op (a same-named node of another graph) are ignored either way.
        peers: the other ranks' traces (paths, dicts or event lists), for the last rank's start.

    Returns:
        A :class:`TraceComparison`. Collectives absent from the trace have ``measured`` None and
        count 0 in the measured total.

    Raises:
        ValueError: ``trace`` is not a Chrome trace.
    """
    measured = measured_collectives(trace, graph=graph, peers=peers)
    timings = collective_timings(gm, predicted_events(gm, events=events, predict=predict))
    rows = []
    for node in collectives(gm):
        op = collective_info(node).op
        occ = [o for o in measured.get(node.name, []) if o.args.get("op", op) == op]
        if len(occ) < len(measured.get(node.name, [])):
            log.debug("compare: %d trace events named %s are not %s (another graph's node); "
                      "ignored", len(measured[node.name]) - len(occ), node.name, op)
        t = timings[node]
        bw = [float(o.args["busbw_gbps"]) for o in occ if o.args.get("busbw_gbps") is not None]
        sizes = [int(o.args["bytes"]) for o in occ if o.args.get("bytes") is not None]
        own = [o for o in occ if o.own_us is not None]
        rows.append(CompareRow(
            node=node.name, op=op, occurrences=len(occ),
            predicted_us=t.estimated_us, measured_us=_mean([o.own_us for o in own]),
            predicted_exposed_us=t.exposed_us,
            measured_exposed_us=_mean([o.exposed_us for o in occ]), busbw_gbps=_mean(bw),
            bytes=max(sizes) if sizes else _graph_bytes(node),
            late_us=_mean([o.late_us for o in own]),
            span_us=_mean([o.done_ts - o.issue_ts for o in occ]),
            computing=_mean([o.computing for o in own]),
            on_worker=_mean([float(bool(o.args.get("on_worker"))) for o in own]),
        ))
    names = {n.name for n in collectives(gm)}
    return TraceComparison(
        rows=rows,
        predicted_exposed_us=sum(r.predicted_exposed_us or 0.0 for r in rows),
        measured_exposed_us=sum(r.measured_exposed_us or 0.0 for r in rows),
        unmatched=sorted(set(measured) - names),
    )
