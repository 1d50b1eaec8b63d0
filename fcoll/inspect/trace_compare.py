"""``compare(trace, gm)``: measured (Chrome/Perfetto trace of a real run) against predicted time.

The runtime writes one trace per rank (``{trace_dir}/rank{R}.json``): compute nodes are complete
events (``"ph": "X"``, ``"cat": "compute"``, name = node name); each collective is an async pair,
``"ph": "b"`` when issued and ``"ph": "e"`` when its wait returned (``"cat": "comm"``, same
``"id"``, name = collective node name, ``args``: op, group, bytes, busbw_gbps, wait_node). ``ts``
and ``dur`` are microseconds; ``pid`` is the rank.

Per collective the report sets the cost model's prediction (``pred_us``: the node's estimated
time from the calibrated piecewise alpha-beta curve, :mod:`fcoll.passes.analysis.comm_cost`) beside
the measured time (``meas_us``: issue to wait return, averaged over occurrences) and their ratio
``pred/meas``; a collective whose wait was not blocking (hidden) may have finished before its
wait was asked for, so for it ``meas_us`` is an upper bound and a ratio below 1 is expected.
The rows within :data:`TOLERANCE` of 1 are counted under the table.

Measured exposed time of one collective occurrence is the time the compute thread sat in its
wait: the ``"X"`` event of the wait node when the runtime recorded one, otherwise the gap between
the wait's return and the later of the issue and the end of the previous activity on that rank
(a compute event's end or another wait's return). Occurrences (steps, ranks) are averaged.
"""

from __future__ import annotations

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

__all__ = ["CompareRow", "TraceComparison", "compare", "load_trace", "measured_collectives",
           "TOLERANCE"]

log = logging.getLogger(__name__)

#: A prediction "holds" within this relative error of the measured time (+-30 %).
TOLERANCE = 0.30


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


def _busy_ends(events: list[dict[str, Any]]) -> dict[Any, list[float]]:
    """Per pid, the times activity ended: compute ends and wait returns, sorted."""
    ends: dict[Any, list[float]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "compute":
            ends[e.get("pid")].append(float(e["ts"]) + float(e.get("dur", 0.0)))
        elif e.get("ph") == "e" and e.get("cat") == "comm":
            ends[e.get("pid")].append(float(e["ts"]))
    return {pid: sorted(v) for pid, v in ends.items()}


def measured_collectives(trace: str | os.PathLike | dict | list, *, graph: str | None = None,
                         ) -> dict[str, list[_Occurrence]]:
    """Every completed collective occurrence in ``trace``, by collective node name.

    Args:
        trace: path, loaded dict, or list of events.
        graph: keep only events whose ``args["graph"]`` equals this (when the runtime records
            which compiled graph an event belongs to); None keeps everything.

    Returns:
        name -> occurrences (issue time, return time, exposed µs, args) in issue order. An issue
        without a matching end (run cut short) is dropped with a DEBUG log.
    """
    events = load_trace(trace)
    if graph is not None:
        events = [e for e in events if (e.get("args") or {}).get("graph", graph) == graph]
    ends = _busy_ends(events)
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
        out[str(e.get("name"))].append(_Occurrence(
            str(e.get("name")), e.get("pid"), issue, done,
            _exposed(e.get("pid"), issue, done, args.get("wait_node"), ends, xs), args))
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

    ``measured_us`` is issue to wait-return, so it includes any time the collective sat
    finished before its wait; ``busbw_gbps`` is the runtime's figure, averaged. ``bytes`` is
    the collective's size (nccl-tests' convention, :func:`fcoll.ops.facts.comm_bytes`): the
    trace's when it recorded one, else the graph's.
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

    def as_dict(self) -> dict[str, Any]:
        return {"rows": [r.as_dict() for r in self.rows],
                "predicted_exposed_us": self.predicted_exposed_us,
                "measured_exposed_us": self.measured_exposed_us, "unmatched": self.unmatched}

    def __str__(self) -> str:
        headers = ("node", "op", "bytes", "n", "pred_us", "meas_us", "pred/meas",
                   "pred_exposed_us", "meas_exposed_us", "busbw_GB/s")
        rows = [(r.node, r.op, "-" if r.bytes is None else r.bytes, r.occurrences,
                 fmt_us(r.predicted_us), fmt_us(r.measured_us),
                 "-" if r.ratio is None else f"{r.ratio:.2f}",
                 fmt_us(r.predicted_exposed_us), fmt_us(r.measured_exposed_us),
                 "-" if r.busbw_gbps is None else f"{r.busbw_gbps:.2f}") for r in self.rows]
        rows.append(("total", "", "", "", "", "", "", fmt_us(self.predicted_exposed_us),
                     fmt_us(self.measured_exposed_us), ""))
        text = text_table(headers, rows, (False, False, True, True, True, True, True, True,
                                          True, True))
        judged = [r for r in self.rows if r.holds is not None]
        if judged:
            text += (f"\npredicted within +-{TOLERANCE:.0%} of measured: "
                     f"{sum(bool(r.holds) for r in judged)} of {len(judged)} collectives "
                     f"(meas_us is issue to wait return: an upper bound for hidden ones)")
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
            graph: str | None = None) -> TraceComparison:
    """Measured against predicted exposed time, per collective of ``gm`` and in total.

    Args:
        trace: a rank's trace (path or loaded dict) of running ``gm``, as the runtime writes it.
        gm: the graph that ran (after the passes); its collective node names match the trace.
        events: precomputed predicted events of ``gm``.
        predict: a simulator ``gm -> events``, instead of ``fcoll.passes.rewrites.overlap.predict``.
        graph: only trace events with ``args["graph"] == graph`` (see
            :func:`measured_collectives`). Events of a collective whose ``args["op"]`` differs
            from the node's op (a same-named node of another graph) are ignored either way.

    Returns:
        A :class:`TraceComparison`. Collectives absent from the trace have ``measured`` None and
        count 0 in the measured total.

    Raises:
        ValueError: ``trace`` is not a Chrome trace.
    """
    measured = measured_collectives(trace, graph=graph)
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
        rows.append(CompareRow(
            node=node.name, op=op, occurrences=len(occ),
            predicted_us=t.estimated_us, measured_us=_mean([o.done_ts - o.issue_ts for o in occ]),
            predicted_exposed_us=t.exposed_us,
            measured_exposed_us=_mean([o.exposed_us for o in occ]), busbw_gbps=_mean(bw),
            bytes=max(sizes) if sizes else _graph_bytes(node),
        ))
    names = {n.name for n in collectives(gm)}
    return TraceComparison(
        rows=rows,
        predicted_exposed_us=sum(r.predicted_exposed_us or 0.0 for r in rows),
        measured_exposed_us=sum(r.measured_exposed_us or 0.0 for r in rows),
        unmatched=sorted(set(measured) - names),
    )
