"""``overlap_report(before, after)``: communication totals of a graph before and after the passes.

Metric names follow the house convention: ``comm_us`` (sum of predicted collective times),
``exposed_comm_us`` (time the compute stream waits on communication), ``hidden_comm_us =
comm_us - exposed_comm_us`` and ``overlap_ratio = hidden_comm_us / comm_us``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable

import torch.fx as fx

from fcoll.inspect.predicted import PredictFn, collective_timings, predicted_events
from fcoll.inspect.text import text_table
from fcoll.passes.analysis.memory import peak_bytes
from fcoll.passes.graph import collectives

__all__ = ["OverlapTotals", "OverlapReport", "overlap_totals", "overlap_report"]


@dataclass(frozen=True)
class OverlapTotals:
    """Communication totals of one graph; times in microseconds.

    Attributes:
        n_collectives: collective nodes in the graph (a bucket counts once).
        comm_us: sum of the predicted collective times.
        hidden_comm_us: ``comm_us - exposed_comm_us`` (never below 0).
        exposed_comm_us: sum of the predicted exposed times.
        overlap_ratio: ``hidden_comm_us / comm_us``; 0.0 when there is no communication.
        step_us: predicted time from the first node's start to the last node's end (None
            without a predicted schedule).
        peak_bytes: peak live bytes of the graph in its order (fcoll's storage model).
    """

    n_collectives: int
    comm_us: float
    hidden_comm_us: float
    exposed_comm_us: float
    overlap_ratio: float
    step_us: float | None
    peak_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def overlap_totals(gm: fx.GraphModule, *, events: Iterable[Any] | None = None,
                   predict: PredictFn | None = None) -> OverlapTotals:
    """Totals of ``gm`` in its current order (see :func:`overlap_report` for the sources).

    Collectives with unknown estimates count as 0 µs.
    """
    evs = predicted_events(gm, events=events, predict=predict)
    timings = collective_timings(gm, evs)
    comm = sum(t.estimated_us or 0.0 for t in timings.values())
    exposed = min(comm, sum(t.exposed_us or 0.0 for t in timings.values()))
    hidden = max(0.0, comm - exposed)
    step = (max(e.end_us for e in evs) - min(e.start_us for e in evs)) if evs else None
    return OverlapTotals(
        n_collectives=len(collectives(gm)), comm_us=comm, hidden_comm_us=hidden,
        exposed_comm_us=exposed, overlap_ratio=hidden / comm if comm > 0 else 0.0, step_us=step,
        peak_bytes=peak_bytes(gm.graph.nodes),
    )


@dataclass(frozen=True)
class OverlapReport:
    """Totals before and after the passes (``after`` None for a one-graph report).

    ``str()`` is a table with one column per graph and, with both, a change column.
    """

    before: OverlapTotals
    after: OverlapTotals | None = None

    def as_dict(self) -> dict[str, Any]:
        """``{"before": {...}, "after": {...} or None}``."""
        return {"before": self.before.as_dict(),
                "after": None if self.after is None else self.after.as_dict()}

    def __str__(self) -> str:
        fields = [("collectives", "n_collectives", "{:d}"), ("comm_us", "comm_us", "{:.1f}"),
                  ("hidden_comm_us", "hidden_comm_us", "{:.1f}"),
                  ("exposed_comm_us", "exposed_comm_us", "{:.1f}"),
                  ("overlap_ratio", "overlap_ratio", "{:.1%}"), ("step_us", "step_us", "{:.1f}"),
                  ("peak_bytes", "peak_bytes", "{:d}")]
        cols = [self.before] if self.after is None else [self.before, self.after]
        headers = ["metric", "graph"] if self.after is None else ["metric", "before", "after",
                                                                  "change"]
        rows = []
        for label, attr, fmt in fields:
            vals = [getattr(c, attr) for c in cols]
            row = [label] + ["-" if v is None else fmt.format(v) for v in vals]
            if self.after is not None:
                a, b = vals
                if a is None or b is None:
                    row.append("-")
                elif attr == "overlap_ratio":
                    row.append(f"{(b - a) * 100:+.1f} pt")
                else:
                    row.append(fmt.replace(":", ":+").format(b - a))
            rows.append(row)
        return text_table(headers, rows, [False] + [True] * (len(headers) - 1))


def overlap_report(before: fx.GraphModule, after: fx.GraphModule | None = None, *,
                   events_before: Iterable[Any] | None = None,
                   events_after: Iterable[Any] | None = None,
                   predict: PredictFn | None = None) -> OverlapReport:
    """Compare communication, hidden and exposed time of a graph before and after the passes.

    Both graphs are simulated in their own node order with the same predictor
    (``fcoll.passes.rewrites.overlap.predict`` by default), so the difference is what the passes
    did. Without a predictor, the overlap scheduler's ``node.meta`` estimates are summed.

    Args:
        before: the graph as traced (or any graph, for a one-column report).
        after: the same graph after the passes, or None.
        events_before: precomputed predicted events of ``before``.
        events_after: precomputed predicted events of ``after``.
        predict: a simulator ``gm -> events`` to use instead of the default.

    Returns:
        An :class:`OverlapReport`; ``str()`` is a table, ``as_dict()`` plain values.
    """
    tb = overlap_totals(before, events=events_before, predict=predict)
    ta = None if after is None else overlap_totals(after, events=events_after, predict=predict)
    return OverlapReport(tb, ta)
