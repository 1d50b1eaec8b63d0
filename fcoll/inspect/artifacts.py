"""What the inspection tools produce for one compiled graph: files for the CLI, tlparse artifacts.

A *record* is what ``fcoll.compile.backend`` hands its compile listeners for every graph it
compiles: ``record.name`` (e.g. ``"graph_0_forward"``), ``record.before`` and ``record.after``
(GraphModules before and after the passes), ``record.config`` and ``record.rank``.

Importing this module subscribes :func:`emit_artifacts` to the backend's compile listener,
enabled while :func:`artifacts_enabled` (``TORCH_TRACE`` is set), so tlparse shows fcoll's graphs
and reports for every graph the backend compiles. ``import fcoll`` imports it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from typing import Any

from torch._logging import trace_structured

from fcoll.compile.backend import register_compile_listener
from fcoll.inspect.format import format_graph
from fcoll.inspect.overlap_report import overlap_report
from fcoll.inspect.schedule import step_schedule
from fcoll.inspect.predicted import PredictFn, predicted_events
from fcoll.inspect.saved import saved_report
from fcoll.inspect.table import collective_table
from fcoll.inspect.timeline import exposed_of, timeline_svg

__all__ = ["record_files", "write_record", "emit_artifacts", "artifacts_enabled", "RECORD_FILES"]

log = logging.getLogger(__name__)

#: File names written per record, with ``{name}`` the record's name.
RECORD_FILES = (
    "{name}.before.txt", "{name}.after.txt", "{name}.collectives_before.txt",
    "{name}.collectives.txt", "{name}.collectives.json", "{name}.overlap.txt",
    "{name}.overlap.json", "{name}.timeline_before.svg", "{name}.timeline.svg",
    "{name}.schedule.json", "{name}.saved.txt", "{name}.saved.json",
)
#: The text of ``{name}.saved.txt`` for a graph that no forward/backward partition made.
NO_PARTITION = ("saved for backward: none recorded (this graph is not one half of a "
                "forward/backward partition: an inference graph, compiled autograd's backward, "
                "or a graph made by hand)")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(name)) or "graph"


def _events(gm, predict: PredictFn | None):
    try:
        return predicted_events(gm, predict=predict)
    except Exception as e:  # noqa: BLE001  inspection must not break compilation
        log.warning("fcoll.inspect: predicting the schedule failed (%s: %s); tables use "
                    "node.meta estimates", type(e).__name__, e)
        return None


def record_files(record: Any, *, predict: PredictFn | None = None) -> dict[str, str]:
    """File name -> content for one compiled graph (see :data:`RECORD_FILES`).

    Timelines are left out when no predicted schedule is available, and every ``before`` file
    when ``record.before`` is None (the backend copies the graph only when someone inspects).
    """
    name = _safe(record.name)
    before, after = getattr(record, "before", None), record.after
    ev_a = _events(after, predict)
    table_a = collective_table(after, events=ev_a, predict=_no_predict)
    files = {}
    if before is not None:
        ev_b = _events(before, predict)
        report = overlap_report(before, after, events_before=ev_b, events_after=ev_a,
                                predict=_no_predict)
        files[f"{name}.before.txt"] = format_graph(before) + "\n"
    else:
        ev_b = None
        report = overlap_report(after, events_before=ev_a, predict=_no_predict)
    files[f"{name}.after.txt"] = format_graph(after) + "\n"
    if before is not None:
        table_b = collective_table(before, events=ev_b, predict=_no_predict)
        files[f"{name}.collectives_before.txt"] = str(table_b) + "\n"
    files.update({
        f"{name}.collectives.txt": str(table_a) + "\n",
        f"{name}.collectives.json": json.dumps(table_a.as_dicts(), indent=1) + "\n",
        f"{name}.overlap.txt": str(report) + "\n",
        f"{name}.overlap.json": json.dumps(report.as_dict(), indent=1) + "\n",
        # what fcoll.sim replays (fcoll.inspect.schedule)
        f"{name}.schedule.json": json.dumps(step_schedule(after, record.name, events=ev_a))
        + "\n",
    })
    saved = saved_report(after, record.name)   # the partition's cut (fcoll.compile.saved)
    files[f"{name}.saved.txt"] = (str(saved) if saved is not None else NO_PARTITION) + "\n"
    files[f"{name}.saved.json"] = json.dumps(
        saved.as_dict() if saved is not None else {"graph": record.name, "saved": None},
        indent=1) + "\n"
    if ev_b is not None:
        files[f"{name}.timeline_before.svg"] = timeline_svg(
            ev_b, f"{record.name} before passes", exposed_of(before, ev_b))
    if ev_a is not None:
        files[f"{name}.timeline.svg"] = timeline_svg(
            ev_a, f"{record.name} after passes", exposed_of(after, ev_a))
    return files


def _no_predict(gm) -> None:
    """A predictor that declines (events were computed once above, or could not be)."""
    return None


def write_record(record: Any, out_dir: str | os.PathLike, *,
                 predict: PredictFn | None = None) -> list[str]:
    """Write :func:`record_files` of ``record`` into ``out_dir`` (created); returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for fname, text in record_files(record, predict=predict).items():
        path = os.path.join(out_dir, fname)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        paths.append(path)
    log.debug("fcoll.inspect: wrote %d files for %s to %s", len(paths), record.name, out_dir)
    return paths


def artifacts_enabled() -> bool:
    """True when structured tracing (``TORCH_TRACE``) would record artifacts now.

    The backend can use it to copy the graph before the passes only when someone will look.
    """
    try:
        from torch._logging._internal import trace_log
    except ImportError:  # pragma: no cover - private location moved
        return True
    return bool(trace_log.handlers)


def emit_artifacts(record: Any, *, predict: PredictFn | None = None) -> None:
    """Emit tlparse artifacts for one compiled graph through ``torch._logging.trace_structured``.

    Artifacts (``encoding: "string"``): ``fcoll_<name>_graph_before``, ``fcoll_<name>_graph_after``
    (format_graph text), ``fcoll_<name>_collectives`` (table after the passes),
    ``fcoll_<name>_overlap_report`` and, for a forward or backward graph, ``fcoll_<name>_saved``
    (what the forward saves for the backward); ``graph_before`` only when ``record.before`` is
    not None (the report then has one column). Payloads are computed only when structured tracing is on
    (``TORCH_TRACE=dir``), so the call is free otherwise; a failure to build them becomes the
    payload text (and a warning) instead of an exception.
    """
    if not artifacts_enabled():  # the check trace_structured makes: tracing is off
        return
    name = _safe(record.name)
    # Built once, up front, for all the artifacts (trace_structured evaluates payloads lazily,
    # but only after the handler check above, which we have already made).
    try:
        files = record_files(record, predict=predict)
    except Exception as e:  # noqa: BLE001  never break compilation for a report
        log.warning("fcoll.inspect: artifacts of %s failed: %s: %s", record.name,
                    type(e).__name__, e)
        failed = f"fcoll.inspect failed: {type(e).__name__}: {e}"
        files = defaultdict(lambda: failed)
    parts = [("graph_before", f"{name}.before.txt")] if record.before is not None else []
    parts += [("graph_after", f"{name}.after.txt"), ("collectives", f"{name}.collectives.txt"),
              ("overlap_report", f"{name}.overlap.txt")]
    if saved_report(record.after) is not None:   # one half of a forward/backward partition
        parts.append(("saved", f"{name}.saved.txt"))
    for suffix, fname in parts:
        trace_structured(
            "artifact",
            metadata_fn=lambda s=suffix: {"name": f"fcoll_{name}_{s}", "encoding": "string"},
            payload_fn=lambda f=fname: files[f], expect_trace_id=False,
        )


_TLPARSE_LISTENER = register_compile_listener(emit_artifacts, enabled=artifacts_enabled)
