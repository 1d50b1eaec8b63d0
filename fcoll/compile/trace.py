"""Chrome/Perfetto traces of real runs of compiled graphs, one JSON file per rank.

When ``trace_dir`` is set (``options={"trace_dir": ...}`` or the ``FCOLL_TRACE_DIR`` environment
variable), every run of a compiled graph appends its events to ``{trace_dir}/rank{R}.json``, which
is rewritten (atomically: temporary file, then ``os.replace``) at the end of each run and holds
the events of the last :data:`KEEP_RUNS` graph runs of this process (a training step is usually two
runs: forward and backward). The format, which ``fcoll.inspect.compare(trace, gm)`` reads:

- ``{"traceEvents": [...]}``, times in microseconds (``ts``, ``dur``) on the host's monotonic
  clock (``time.perf_counter_ns``, CLOCK_MONOTONIC on Linux), so the ranks of one host line up.
- A compute node: ``{"ph": "X", "cat": "compute", "name": <node name>, "ts", "dur",
  "pid": rank, "tid": "compute", "args": {"target": str(node.target)}}``.
- A collective: an async pair with one unique ``id``: ``"ph": "b"`` when its node runs (the
  collective is issued) and ``"ph": "e"`` when its (last) ``wait_tensor`` returns, both with
  ``"cat": "comm"``, ``"name": <collective node name>``, ``"pid": rank``,
  ``"tid": "comm:<group name>"`` and ``args = {"op", "group", "bytes", "busbw_gbps",
  "wait_node"}``. A collective whose wait never ran in the same graph run ends at the end of
  the run with ``"wait_node": None``.

``bytes`` follows the nccl-tests convention for the size of one collective
(:func:`fcoll.ops.facts.comm_bytes`): the larger of the input and output buffers on this rank
(the full tensor for all_reduce and broadcast, the gathered output for all_gather, the
unscattered input for reduce_scatter), the input for all_to_all.
``busbw_gbps = bytes / time * factor / 1e9`` with the nccl-tests bus-bandwidth factor of
:func:`fcoll.ops.facts.busbw_factor` (all_reduce ``2(n-1)/n``; all_gather, reduce_scatter,
all_to_all ``(n-1)/n``; broadcast 1; 0 on one rank), where ``time`` is issue to wait return (so
it includes time the wait was not yet asked for; it is a lower bound of the bandwidth).

The recorder's own rewrite of the file after a run is an event too, in the files written after
it: ``{"ph": "X", "cat": "trace", "name": "trace_write", "ts", "dur", "pid": rank,
"tid": "compute", "args": {"events": n}}`` (tens to hundreds of ms per run for graphs of
thousands of nodes; :func:`fcoll.sim.measured.outside_graphs_us` subtracts it from a step).
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import threading
import time
from typing import Any

__all__ = ["TraceRecorder", "RunTrace", "recorder_for", "trace_dir_from", "KEEP_RUNS", "now_us"]

#: Graph runs kept in each rank's trace file (the oldest are dropped first).
KEEP_RUNS = 16


def now_us() -> float:
    """The host's monotonic clock, in microseconds."""
    return time.perf_counter_ns() / 1e3


def trace_dir_from(option: str | None) -> str | None:
    """The trace directory: the ``trace_dir`` option, else ``$FCOLL_TRACE_DIR``, else None."""
    return option if option else (os.environ.get("FCOLL_TRACE_DIR") or None)


class RunTrace:
    """Events of one run of one graph (filled by the executor, then handed to the recorder)."""

    __slots__ = ("recorder", "events", "open")

    def __init__(self, recorder: "TraceRecorder") -> None:
        self.recorder = recorder
        self.events: list[dict[str, Any]] = []
        self.open: dict[str, dict[str, Any]] = {}  # collective node name -> shared args dict

    def compute(self, name: str, target: str, t0_us: float, t1_us: float) -> None:
        """A compute node (or compiled compute segment) that ran from ``t0_us`` to ``t1_us``."""
        self.events.append({"name": name, "cat": "compute", "ph": "X", "ts": t0_us,
                            "dur": t1_us - t0_us, "pid": self.recorder.rank, "tid": "compute",
                            "args": {"target": target}})

    def comm_begin(self, name: str, op: str, group: str, nbytes: int, factor: float,
                   t_us: float) -> None:
        """Collective ``name`` was issued at ``t_us``."""
        args = {"op": op, "group": group, "bytes": nbytes, "busbw_gbps": None,
                "wait_node": None}
        ev = {"name": name, "cat": "comm", "ph": "b", "id": next(self.recorder.ids),
              "ts": t_us, "pid": self.recorder.rank, "tid": f"comm:{group}", "args": args}
        self.events.append(ev)
        self.open[name] = {"ev": ev, "factor": factor}

    def comm_end(self, name: str, wait_node: str | None, t_us: float) -> None:
        """The last wait of collective ``name`` (the node ``wait_node``) returned at ``t_us``."""
        entry = self.open.pop(name, None)
        if entry is None:
            return
        begin = entry["ev"]
        args = begin["args"]  # shared by the begin and end events
        seconds = max(t_us - begin["ts"], 1e-3) / 1e6
        args["busbw_gbps"] = args["bytes"] * entry["factor"] / seconds / 1e9
        args["wait_node"] = wait_node
        self.events.append({"name": name, "cat": "comm", "ph": "e", "id": begin["id"],
                            "ts": t_us, "pid": begin["pid"], "tid": begin["tid"],
                            "args": args})

    def finish(self) -> None:
        """Close collectives still open and hand the run to the recorder (rewrites the file)."""
        t = now_us()
        for name in list(self.open):
            self.comm_end(name, None, t)
        self.recorder.add_run(self.events)


class TraceRecorder:
    """The trace file of one rank: keeps the last ``keep_runs`` runs and rewrites the file.

    Args:
        path: the JSON file (``{trace_dir}/rank{R}.json``).
        rank: the global rank (the events' ``pid``).
        keep_runs: graph runs kept.
    """

    def __init__(self, path: str, rank: int, keep_runs: int = KEEP_RUNS) -> None:
        self.path = path
        self.rank = rank
        self.ids = itertools.count(rank << 32)  # unique across ranks too
        self._runs: collections.deque[list[dict[str, Any]]] = collections.deque(maxlen=keep_runs)
        self._lock = threading.Lock()

    def start_run(self) -> RunTrace:
        return RunTrace(self)

    def add_run(self, events: list[dict[str, Any]]) -> None:
        with self._lock:
            self._runs.append(events)
            all_events = [e for run in self._runs for e in run]
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            tmp = f"{self.path}.tmp{os.getpid()}"
            t0 = now_us()
            with open(tmp, "w") as f:
                json.dump({"traceEvents": all_events, "displayTimeUnit": "ms"}, f)
            os.replace(tmp, self.path)
            # in the next rewrite: readers tell the tracer's own cost from the step's
            events.append({"name": "trace_write", "cat": "trace", "ph": "X", "ts": t0,
                           "dur": now_us() - t0, "pid": self.rank, "tid": "compute",
                           "args": {"events": len(all_events)}})


_recorders: dict[str, TraceRecorder] = {}  # path -> recorder: one file, one writer per process
_recorders_lock = threading.Lock()


def recorder_for(trace_dir: str, rank: int) -> TraceRecorder:
    """The process's recorder for ``{trace_dir}/rank{rank}.json`` (shared by every graph)."""
    path = os.path.join(os.path.abspath(trace_dir), f"rank{rank}.json")
    with _recorders_lock:
        rec = _recorders.get(path)
        if rec is None:
            rec = _recorders[path] = TraceRecorder(path, rank)
        return rec
