"""``collective_table(gm)``: one row per collective of a graph, printable as an aligned table."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable

import torch.fx as fx

from fcoll.inspect.format import dtype_abbr
from fcoll.inspect.predicted import (
    PredictFn, collective_timings, predicted_events, schedule_positions, wait_positions,
)
from fcoll.inspect.text import fmt_bytes, fmt_us, text_table
from fcoll.passes.graph import collective_info, collectives

__all__ = ["CollectiveRow", "CollectivesTable", "collective_table"]

_MAX_HIDING_SHOWN = 3


@dataclass(frozen=True)
class CollectiveRow:
    """One collective of a graph.

    Attributes:
        index: order among the graph's collectives (0-based).
        node: the collective node's name.
        op: the op name without namespace (``all_reduce``, ``all_gather_into_tensor``, ...).
        group: the process group's name.
        group_size: ranks in the group (None if unknown).
        dtype: dtype abbreviation of the inputs (``f32``; ``f32,bf16`` for mixed buckets).
        bytes: message size on this rank, in bytes, as nccl-tests counts it: the larger of the
            input and output (the full buffer for all_gather and reduce_scatter).
        issue_pos: position of the collective among executed nodes (placeholders, get_attr and
            output excluded), in graph order.
        wait_pos: position of its first ``wait_tensor`` (None if never waited).
        estimated_us: predicted time of the collective in microseconds (None if unknown).
        hiding: names of the compute nodes predicted to run while it is in flight.
        exposed_us: predicted time the compute stream waits for it, in microseconds.
    """

    index: int
    node: str
    op: str
    group: str
    group_size: int | None
    dtype: str
    bytes: int
    issue_pos: int
    wait_pos: int | None
    estimated_us: float | None
    hiding: tuple[str, ...]
    exposed_us: float | None

    def as_dict(self) -> dict[str, Any]:
        """The row as a JSON-friendly dict (``hiding`` as a list)."""
        d = asdict(self)
        d["hiding"] = list(self.hiding)
        return d


_HEADERS = ("#", "node", "op", "group", "ranks", "dtype", "bytes", "issue", "wait",
            "est_us", "exposed_us", "hidden by")
_RIGHT = (True, False, False, False, True, False, True, True, True, True, True, False)


def _hiding_text(names: tuple[str, ...]) -> str:
    if not names:
        return "-"
    shown = ", ".join(names[:_MAX_HIDING_SHOWN])
    more = len(names) - _MAX_HIDING_SHOWN
    return f"{shown} +{more}" if more > 0 else shown


class CollectivesTable(list):
    """A ``list[CollectiveRow]`` whose ``str()`` is an aligned text table (one line per row)."""

    def __str__(self) -> str:
        rows = [(r.index, r.node, r.op, r.group, "?" if r.group_size is None else r.group_size,
                 r.dtype, fmt_bytes(r.bytes), r.issue_pos, "-" if r.wait_pos is None else
                 r.wait_pos, fmt_us(r.estimated_us), fmt_us(r.exposed_us),
                 _hiding_text(r.hiding)) for r in self]
        return text_table(_HEADERS, rows, _RIGHT)

    def as_dicts(self) -> list[dict[str, Any]]:
        """Every row as a JSON-friendly dict."""
        return [r.as_dict() for r in self]


def collective_table(gm: fx.GraphModule, *, events: Iterable[Any] | None = None,
                predict: PredictFn | None = None) -> CollectivesTable:
    """Describe every collective of ``gm`` in graph order.

    Timing columns come from the predicted schedule of the graph in its current order
    (``fcoll.passes.rewrites.overlap.predict``, or ``events``/``predict`` given here); without one,
    from the overlap scheduler's ``node.meta`` entries, and None where those are missing.

    Args:
        gm: a graph holding ``fcoll`` or ``_c10d_functional`` collectives.
        events: precomputed predicted events for ``gm`` (see :mod:`fcoll.inspect.predicted`).
        predict: a simulator ``gm -> events`` to use instead of the default.

    Returns:
        A :class:`CollectivesTable` (a list of :class:`CollectiveRow`); ``str()`` of it is an
        aligned table. Empty when the graph has no collectives.
    """
    evs = predicted_events(gm, events=events, predict=predict)
    timings = collective_timings(gm, evs)
    pos = schedule_positions(gm)
    waits = wait_positions(gm)
    table = CollectivesTable()
    for i, node in enumerate(collectives(gm)):
        info = collective_info(node)
        t = timings[node]
        dtypes = ",".join(dict.fromkeys(dtype_abbr(d) for d in info.dtypes))
        table.append(CollectiveRow(
            index=i, node=node.name, op=info.op, group=info.group_name,
            group_size=info.group_size, dtype=dtypes or "-",
            bytes=max(info.in_bytes, info.out_bytes), issue_pos=pos[node],
            wait_pos=waits.get(node), estimated_us=t.estimated_us, hiding=t.hiding,
            exposed_us=t.exposed_us,
        ))
    return table
