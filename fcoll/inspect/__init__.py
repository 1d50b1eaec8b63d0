"""Inspection tools for fcoll graphs: stable text, tables, reports, timelines and traces.

- :func:`format_graph`: stable text of a graph for ``assertExpectedInline`` snapshots.
- :func:`collective_table`: one row per collective (op, group, bytes, positions, estimated, hiding,
  exposed); ``str()`` is an aligned table.
- :func:`overlap_report`: communication, hidden and exposed time before and after the passes.
- :func:`timeline`: SVG/HTML picture of the predicted schedule.
- :func:`saved_report`: what the forward saves for the backward (op, shape, dtype, bytes, which
  are collectives' results) and which collectives the backward re-issues (recomputed).
- :func:`compare`: a runtime trace (Chrome/Perfetto JSON) against the predicted schedule.
- :func:`emit_artifacts` / :func:`write_record`: everything above for one compiled graph, as
  tlparse artifacts or files.
- ``python -m fcoll.inspect script.py --out DIR -- ARGS``: run a script on N ranks and write it all.

Times come from the overlap scheduler's simulator, ``fcoll.passes.rewrites.overlap.predict``; every
function also accepts ``events=`` or ``predict=``.
"""

from fcoll.inspect.artifacts import (
    artifacts_enabled, emit_artifacts, record_files, write_record,
)
from fcoll.inspect.format import format_graph, stable_names
from fcoll.inspect.overlap_report import (
    OverlapReport, OverlapTotals, overlap_report, overlap_totals,
)
from fcoll.inspect.predicted import Event, predicted_events
from fcoll.inspect.saved import SavedReport, saved_report
from fcoll.inspect.table import CollectiveRow, CollectivesTable, collective_table
from fcoll.inspect.timeline import timeline, timeline_svg
from fcoll.inspect.trace_compare import CompareRow, TraceComparison, compare, load_trace

__all__ = [
    "format_graph", "stable_names", "collective_table", "CollectiveRow", "CollectivesTable",
    "overlap_report", "overlap_totals", "OverlapReport", "OverlapTotals", "timeline",
    "timeline_svg", "compare", "CompareRow", "TraceComparison", "load_trace", "Event",
    "predicted_events", "saved_report", "SavedReport", "emit_artifacts", "artifacts_enabled",
    "write_record", "record_files",
]
