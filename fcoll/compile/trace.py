"""Chrome/Perfetto traces of real runs of compiled graphs, one JSON file per rank.

When ``trace_dir`` is set (``options={"trace_dir": ...}`` or the ``FCOLL_TRACE_DIR`` environment
variable), every run of a compiled graph appends its events to ``{trace_dir}/rank{R}.json``. The
file is valid JSON after every run: a run's events are written in place of the closing ``]}``
(cost proportional to the run, not to the file), and once the file holds ``2 * KEEP_RUNS`` runs
it is rewritten (atomically: temporary file, then ``os.replace``) with the last
:data:`KEEP_RUNS` graph runs of this process (a training step is usually two runs: forward and
backward), so the cost per run is amortized O(run) and the file stays bounded. The format,
which ``fcoll.inspect.compare(trace, gm)`` reads:

- ``{"traceEvents": [...]}``, times in microseconds (``ts``, ``dur``) on the host's monotonic
  clock (``time.perf_counter_ns``, CLOCK_MONOTONIC on Linux), so the ranks of one host line up.
- A compute node: ``{"ph": "X", "cat": "compute", "name": <node name>, "ts", "dur",
  "pid": rank, "tid": "compute", "args": {"target": str(node.target), "graph": <graph name>}}``.
  A compute *segment* that Inductor compiled (``compute="inductor"``,
  :mod:`fcoll.compile.inductor_compute`) is one such event named ``segment_<i>``, its target
  :func:`segment_target`: ``"inductor:<first node>..<last node>"`` of the run of graph nodes it
  executes (:func:`fcoll.sim.measured.node_events` shares it among them).
- A collective: an async pair with one unique ``id``: ``"ph": "b"`` when its node runs (the
  collective is issued) and ``"ph": "e"`` when its (last) ``wait_tensor`` returns, both with
  ``"cat": "comm"``, ``"name": <collective node name>``, ``"pid": rank``,
  ``"tid": "comm:<group name>"`` and ``args = {"op", "group", "graph", "bytes", "busbw_gbps",
  "wait_node", "seq", "n_seq", "run_start_us", "run_end_us", "on_worker", "exposed_us"}``:

  - ``graph``: the compiled graph's name (``"graph_0_forward"``), so a reader tells apart
    same-named nodes of different graphs (a forward's and a backward's ``all_gather_3``).
  - ``seq``, ``n_seq``: the group's sequence numbers the node issued (``seq`` .. ``seq +
    n_seq - 1``; several for a coalesced bucket on the c10d path), the same on every rank of
    the group, so readers join one collective across the ranks' traces; None where the group
    is not fcoll's shared-memory group (gloo, nccl, hierarchical).
  - ``run_start_us``, ``run_end_us``: when this rank's engine executed them
    (:meth:`fcoll.shm.engine.Engine.executed`: from the moment the first began moving data to
    the moment the last completed on this rank; the collective's own time, which is what the
    cost model predicts), None where not known; ``on_worker``: the group's worker thread ran
    it (while the caller went on), not the thread that issued or waited for it.
  - ``exposed_us``: how long the compute thread sat blocked in the wait that ended it.

  A collective whose wait never ran in the same graph run ends at the end of the run with
  ``"wait_node": None`` and ``"exposed_us": 0``.

``bytes`` follows the nccl-tests convention for the size of one collective
(:func:`fcoll.ops.facts.comm_bytes`): the larger of the input and output buffers on this rank
(the full tensor for all_reduce and broadcast, the gathered output for all_gather, the
unscattered input for reduce_scatter), the input for all_to_all.
``busbw_gbps = bytes / time * factor / 1e9`` with the nccl-tests bus-bandwidth factor of
:func:`fcoll.ops.facts.busbw_factor` (all_reduce ``2(n-1)/n``; all_gather, reduce_scatter,
all_to_all ``(n-1)/n``; broadcast 1; 0 on one rank), where ``time`` is the collective's own
time on this rank (``run_end_us - run_start_us``) where known, else issue to wait return (which
includes time the wait was not yet asked for: a lower bound of the bandwidth).

The recorder's own write after a run is an event too, in the next run's events:
``{"ph": "X", "cat": "trace", "name": "trace_write", "ts", "dur", "pid": rank,
"tid": "compute", "args": {"events": n}}`` (``n``: events written; an append writes one run, a
rewrite the kept runs; :func:`fcoll.sim.measured.outside_graphs_us` subtracts it from a step).
A reader that opens the file while a run is being appended can see it cut short; read it after
the runs (or between steps).
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import threading
import time
from typing import Any

__all__ = ["TraceRecorder", "RunTrace", "recorder_for", "trace_dir_from", "KEEP_RUNS", "now_us",
           "SEGMENT_TARGET_PREFIX", "segment_target"]

#: Graph runs kept in each rank's trace file (the oldest are dropped first).
KEEP_RUNS = 16
#: How a compute segment's event target begins (:func:`segment_target`).
SEGMENT_TARGET_PREFIX = "inductor:"


def segment_target(first: str, last: str) -> str:
    """The ``args["target"]`` of an Inductor segment's compute event that runs the graph's
    nodes ``first`` .. ``last``: ``"inductor:<first>..<last>"``."""
    return f"{SEGMENT_TARGET_PREFIX}{first}..{last}"


def now_us() -> float:
    """The host's monotonic clock, in microseconds."""
    return time.perf_counter_ns() / 1e3


def trace_dir_from(option: str | None) -> str | None:
    """The trace directory: the ``trace_dir`` option, else ``$FCOLL_TRACE_DIR``, else None."""
    return option if option else (os.environ.get("FCOLL_TRACE_DIR") or None)


class RunTrace:
    """Events of one run of one graph (filled by the executor, then handed to the recorder).

    Args:
        recorder: the rank's recorder.
        graph: the graph's name, recorded in every event's ``args["graph"]``.
        engines: group name -> the group's executor (an object with ``seq``, the group's next
            sequence number, and ``executed(seq) -> (start_us, end_us) | None``), for the
            groups whose collectives' own times are known; others record None.
    """

    __slots__ = ("recorder", "graph", "engines", "events", "open", "_seq0")

    def __init__(self, recorder: "TraceRecorder", graph: str = "",
                 engines: dict[str, Any] | None = None) -> None:
        self.recorder = recorder
        self.graph = graph
        self.engines = engines or {}
        self.events: list[dict[str, Any]] = []
        self.open: dict[str, dict[str, Any]] = {}  # collective node name -> shared args dict
        self._seq0: int | None = None

    def compute(self, name: str, target: str, t0_us: float, t1_us: float) -> None:
        """A compute node (or compiled compute segment) that ran from ``t0_us`` to ``t1_us``."""
        self.events.append({"name": name, "cat": "compute", "ph": "X", "ts": t0_us,
                            "dur": t1_us - t0_us, "pid": self.recorder.rank, "tid": "compute",
                            "args": {"target": target, "graph": self.graph}})

    def before_issue(self, group: str) -> None:
        """A collective on ``group`` is about to be issued: note the group's next number."""
        eng = self.engines.get(group)
        self._seq0 = eng.seq if eng is not None else None

    def comm_begin(self, name: str, op: str, group: str, nbytes: int, factor: float,
                   t_us: float) -> None:
        """Collective ``name`` was issued at ``t_us`` (after :meth:`before_issue`)."""
        seq, n_seq = self._seq0, None
        eng = self.engines.get(group)
        if seq is not None and eng is not None:
            n_seq = eng.seq - seq
        if not n_seq:
            seq = n_seq = None
        self._seq0 = None
        args = {"op": op, "group": group, "graph": self.graph, "bytes": nbytes,
                "busbw_gbps": None, "wait_node": None, "seq": seq, "n_seq": n_seq,
                "run_start_us": None, "run_end_us": None, "on_worker": None,
                "exposed_us": None}
        ev = {"name": name, "cat": "comm", "ph": "b", "id": next(self.recorder.ids),
              "ts": t_us, "pid": self.recorder.rank, "tid": f"comm:{group}", "args": args}
        self.events.append(ev)
        self.open[name] = {"ev": ev, "factor": factor}

    def _run_times(self, args: dict[str, Any]) -> tuple[float, float, bool] | None:
        eng = self.engines.get(args["group"])
        if eng is None or args["seq"] is None:
            return None
        spans = [eng.executed(s) for s in range(args["seq"], args["seq"] + args["n_seq"])]
        if any(sp is None for sp in spans):
            return None
        return (min(sp[0] for sp in spans), max(sp[1] for sp in spans),
                any(sp[2] for sp in spans))

    def comm_end(self, name: str, wait_node: str | None, t_us: float,
                 wait_start_us: float | None = None) -> None:
        """The last wait of collective ``name`` (the node ``wait_node``), entered at
        ``wait_start_us`` (None: no wait ran), returned at ``t_us``."""
        entry = self.open.pop(name, None)
        if entry is None:
            return
        begin = entry["ev"]
        args = begin["args"]  # shared by the begin and end events
        run = self._run_times(args)
        if run is not None:
            args["run_start_us"], args["run_end_us"], args["on_worker"] = run
        elapsed = (run[1] - run[0]) if run is not None else (t_us - begin["ts"])
        args["busbw_gbps"] = args["bytes"] * entry["factor"] / (max(elapsed, 1e-3) / 1e6) / 1e9
        args["wait_node"] = wait_node
        args["exposed_us"] = (0.0 if wait_start_us is None
                              else max(0.0, t_us - max(wait_start_us, begin["ts"])))
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
    """The trace file of one rank: appends each run, keeps the last ``keep_runs`` runs.

    Args:
        path: the JSON file (``{trace_dir}/rank{R}.json``).
        rank: the global rank (the events' ``pid``).
        keep_runs: graph runs kept at a rewrite (the file holds between ``keep_runs`` and
            ``2 * keep_runs`` runs).
    """

    _HEAD = b'{"displayTimeUnit": "ms", "traceEvents": ['
    _TAIL = b"]}"

    def __init__(self, path: str, rank: int, keep_runs: int = KEEP_RUNS) -> None:
        self.path = path
        self.rank = rank
        self.ids = itertools.count(rank << 32)  # unique across ranks too
        self._runs: collections.deque[list[dict[str, Any]]] = collections.deque(maxlen=keep_runs)
        self._runs_in_file = 0
        self._file_size: int | None = None  # what this recorder last left there (None: nothing)
        self._last_write: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def start_run(self, graph: str = "", engines: dict[str, Any] | None = None) -> RunTrace:
        """A :class:`RunTrace` for one run of graph ``graph`` (see there for ``engines``)."""
        return RunTrace(self, graph, engines)

    def add_run(self, events: list[dict[str, Any]]) -> None:
        """Add one run's events to the file: append them, or rewrite the file with the last
        ``keep_runs`` runs once it holds ``2 * keep_runs`` (or was changed by someone else)."""
        with self._lock:
            if self._last_write is not None:
                # the previous write, with this run: readers tell the tracer's cost from a step's
                events.insert(0, self._last_write)
            self._runs.append(events)
            t0 = now_us()
            written = self._append(events)
            if written is None:
                written = self._rewrite()
            self._last_write = {"name": "trace_write", "cat": "trace", "ph": "X", "ts": t0,
                                "dur": now_us() - t0, "pid": self.rank, "tid": "compute",
                                "args": {"events": written}}

    def _append(self, events: list[dict[str, Any]]) -> int | None:
        """Write ``events`` in place of the file's closing ``]}``; the count, or None when the
        file must be rewritten instead (full, missing, or not as this recorder left it)."""
        if self._file_size is None or self._runs_in_file + 1 > 2 * self._runs.maxlen:
            return None
        try:
            with open(self.path, "r+b") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() != self._file_size:
                    return None
                f.seek(self._file_size - len(self._TAIL))
                if f.read(len(self._TAIL)) != self._TAIL:
                    return None
                body = ",".join(json.dumps(e) for e in events).encode()
                if not body:
                    return 0
                f.seek(self._file_size - len(self._TAIL))
                sep = b"" if self._file_size == len(self._HEAD) + len(self._TAIL) else b","
                f.write(sep + body + self._TAIL)
                self._file_size = f.tell()
        except OSError:
            return None
        self._runs_in_file += 1
        return len(events)

    def _rewrite(self) -> int:
        """Write the kept runs to a temporary file and move it over the trace; the count."""
        all_events = [e for run in self._runs for e in run]
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(self._HEAD + ",".join(json.dumps(e) for e in all_events).encode()
                    + self._TAIL)
            size = f.tell()
        os.replace(tmp, self.path)
        self._file_size = size
        self._runs_in_file = len(self._runs)
        return len(all_events)


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
