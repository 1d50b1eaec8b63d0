"""Per-rank wrapper of ``python -m fcoll.inspect``: capture every fcoll graph, then run a script.

Started on every rank by the launcher as a script path (so it works with any launcher):
``rank_main.py --out DIR SCRIPT ARGS...``. It registers a compile listener that writes
:func:`fcoll.inspect.write_record` files for each compiled graph to ``DIR/rank{R}/``, points the
runtime's traces at ``DIR/traces`` (``FCOLL_TRACE_DIR``, unless already set), runs ``SCRIPT``
with ``runpy.run_path(..., run_name="__main__")`` and ``sys.argv = [SCRIPT, *ARGS]``, and at exit
compares each graph's predicted schedule with the rank's trace, the other ranks' traces giving
when the last rank started each collective (``{name}.compare.txt`` and ``.json``:
:mod:`fcoll.inspect.trace_compare`), and writes ``DIR/rank{R}/summary.json``.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == \
        os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # started as a file: do not let this package's folder shadow top-level names

import json  # noqa: E402
import logging  # noqa: E402
import runpy  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

from fcoll.compile.backend import register_compile_listener  # noqa: E402
from fcoll.inspect.artifacts import write_record  # noqa: E402
from fcoll.inspect.overlap_report import overlap_report  # noqa: E402
from fcoll.inspect.saved import saved_report  # noqa: E402
from fcoll.inspect.trace_compare import compare, load_trace  # noqa: E402

log = logging.getLogger("fcoll.inspect.rank_main")

SUMMARY = "summary.json"
TRACES = "traces"


class _Capture:
    """The compile listener: writes each record's files and remembers it for the summary."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.records: list[Any] = []
        self.errors: list[str] = []

    def __call__(self, record: Any) -> None:
        try:
            write_record(record, self.out_dir)
            self.records.append(record)
        except Exception:  # noqa: BLE001  a broken report must not stop the training script
            msg = f"{record.name}: {traceback.format_exc()}"
            log.warning("fcoll.inspect: could not write the files of %s", msg)
            self.errors.append(msg)


def _peer_traces(trace_path: str) -> list[list[dict[str, Any]]]:
    """The other ranks' traces beside ``trace_path`` (``rank*.json``), loaded; one that cannot
    be read (a peer still appending its last run) is retried briefly, then left out (its
    collectives' own times then start at this rank's start)."""
    folder, mine = os.path.split(trace_path)
    peers = []
    for name in sorted(os.listdir(folder)):
        if name == mine or not (name.startswith("rank") and name.endswith(".json")):
            continue
        for attempt in range(4):
            try:
                peers.append(load_trace(os.path.join(folder, name)))
                break
            except (OSError, ValueError):
                if attempt == 3:
                    log.warning("fcoll.inspect: could not read the peer trace %s", name)
                else:
                    time.sleep(0.5)
    return peers


def _summarize(cap: _Capture, trace_path: str) -> list[dict[str, Any]]:
    rows = []
    have_trace = os.path.exists(trace_path)
    # read once for every graph's compare (each graph's events are told apart by name)
    mine = load_trace(trace_path) if have_trace else []
    peers = _peer_traces(trace_path) if have_trace else []
    for rec in cap.records:
        report = overlap_report(rec.before, rec.after).as_dict()
        saved = saved_report(rec.after, rec.name)
        entry: dict[str, Any] = {
            "name": rec.name, **report, "measured_exposed_us": None, "trace_collectives": None,
            "saved_bytes": saved.record.saved_bytes if saved else None,
            "recomputed_collectives": len(saved.recomputed_collectives) if saved else None}
        if have_trace:
            cmp = compare(mine, rec.after, graph=rec.name, peers=peers)
            with open(os.path.join(cap.out_dir, f"{rec.name}.compare.txt"), "w") as f:
                f.write(str(cmp) + "\n")
            with open(os.path.join(cap.out_dir, f"{rec.name}.compare.json"), "w") as f:
                json.dump(cmp.as_dict(), f, indent=1)
            entry["measured_exposed_us"] = cmp.measured_exposed_us
            entry["trace_collectives"] = sum(1 for r in cmp.rows if r.occurrences)
            entry["model_judged"], entry["model_within"] = len(cmp.judged), cmp.within
            entry["model_worst_ratio"] = cmp.worst_ratio
            entry["model_quiet_judged"] = len(cmp.quiet)
            entry["model_quiet_within"] = sum(bool(r.holds) for r in cmp.quiet)
        rows.append(entry)
    return rows


def main(argv: list[str]) -> None:
    """``[--out DIR] SCRIPT ARGS...``; see the module docstring."""
    if len(argv) < 3 or argv[0] != "--out":
        raise SystemExit("usage: rank_main.py --out DIR SCRIPT [ARGS...]")
    out, script, args = os.path.abspath(argv[1]), os.path.abspath(argv[2]), argv[3:]
    rank = int(os.environ.get("RANK", "0"))
    rank_dir = os.path.join(out, f"rank{rank}")
    os.makedirs(rank_dir, exist_ok=True)
    trace_dir = os.environ.setdefault("FCOLL_TRACE_DIR", os.path.join(out, TRACES))
    cap = _Capture(rank_dir)
    handle = register_compile_listener(cap)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    exit_code: Any = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        exit_code = e.code
    finally:
        handle.remove()
        summary = {"rank": rank, "script": script, "args": args, "exit_code": exit_code,
                   "errors": cap.errors, "graphs": []}
        try:
            summary["graphs"] = _summarize(cap, os.path.join(trace_dir, f"rank{rank}.json"))
        except Exception:  # noqa: BLE001  report it in the summary, keep the script's status
            summary["errors"].append(f"summary: {traceback.format_exc()}")
        with open(os.path.join(rank_dir, SUMMARY), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    if exit_code not in (0, None):
        raise SystemExit(exit_code)


if __name__ == "__main__":
    main(sys.argv[1:])
