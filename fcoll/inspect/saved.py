"""``saved_report(gm)``: what a compiled step keeps between its forward and its backward.

The numbers are the partition fcoll's backend made (:mod:`fcoll.compile.saved`, recorded in the
forward and the backward graph's ``meta``): every value the forward graph saves for the backward
(producing op, shape, dtype, bytes, the view base it keeps alive, and whether that is a
collective's result such as a gathered parameter), the bytes kept alive, and the forward's
collectives that the backward graph issues again instead (recomputed: ``MUST_RECOMPUTE`` tags,
``fcoll.parallel.fully_shard(reshard_after_forward=True)``). This is how a user checks that a
recompute policy was honoured: with resharding, no gathered parameter is saved and the
backward re-issues its all_gathers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from fcoll.compile.saved import META_SAVED, SavedForBackward
from fcoll.inspect.text import fmt_bytes, text_table

__all__ = ["SavedReport", "saved_report"]


@dataclass(frozen=True)
class SavedReport:
    """The saved-for-backward section of one graph's report; ``str()`` is the text.

    Attributes:
        graph: the graph's name ("" when not given).
        record: the partition's record.
    """

    graph: str
    record: SavedForBackward

    @property
    def saved_collectives(self) -> list[str]:
        """Names of the saved values that are (views of) a collective's result."""
        return [v.name for v in self.record.saved if v.collective is not None]

    @property
    def recomputed_collectives(self) -> tuple[str, ...]:
        """The forward's collectives the backward issues again."""
        return self.record.recomputed_collectives

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the graph's name and :meth:`SavedForBackward.as_dict`."""
        return {"graph": self.graph, **self.record.as_dict()}

    def __str__(self) -> str:
        r = self.record
        inputs = sum(1 for v in r.saved if v.is_input)
        head = (f"saved for backward{' by ' + self.graph if self.graph else ''}: "
                f"{len(r.saved)} values ({inputs} graph inputs), "
                f"{fmt_bytes(r.saved_bytes)} kept alive, of which "
                f"{fmt_bytes(r.saved_collective_bytes)} collectives' results")
        rows = [(v.name, v.op, list(v.shape), v.dtype.replace("torch.", ""), v.bytes,
                 v.base if v.base != v.name else "", fmt_bytes(v.base_bytes),
                 "input" if v.is_input else (v.collective or "")) for v in r.saved]
        table = text_table(("value", "op", "shape", "dtype", "bytes", "view of",
                            "keeps alive", "collective"), rows,
                           (False, False, False, False, True, False, True, False))
        names = ", ".join(r.recomputed_collectives) or "none"
        tail = (f"backward: {r.backward_collectives} collectives, "
                f"{len(r.recomputed_collectives)} re-issued from the forward (recomputed, "
                f"not saved): {names}")
        return "\n".join([head, table, tail])


def saved_report(gm: fx.GraphModule, graph: str = "") -> SavedReport | None:
    """The saved-for-backward report of a forward or backward graph fcoll compiled.

    Args:
        gm: a graph as a compile listener receives it (``record.after`` or ``record.before``).
        graph: its name, for the heading.

    Returns:
        The report, or None when ``gm`` came from no partition (an inference graph, compiled
        autograd's backward, a graph made by hand).
    """
    record = gm.meta.get(META_SAVED)
    if not isinstance(record, SavedForBackward):
        return None
    return SavedReport(graph, record)
