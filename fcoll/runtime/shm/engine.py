"""The per-group worker: one background thread that runs the group's collectives in issue order.

Collectives are *issued* on the caller's thread (validated, staged, queued, returned as a
``Work`` at once) and *executed* here, so compute on the caller's thread overlaps them: torch
kernels and the futex syscalls release the GIL. Each job completes a ``torch.futures.Future``;
``Work.wait()`` blocks on it without spinning.

Failure model: a header mismatch or invalid input raises on every rank at the same phase, so the
group stays usable. A dead peer, a timeout or an unexpected error leaves the ranks at different
phases: the group is marked broken and every later collective fails at once with that error.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from typing import Any, Callable

import torch

from fcoll.runtime.shm.algorithms import Call
from fcoll.runtime.shm.headers import CollectiveMismatchError
from fcoll.runtime.shm.segment import Segment
from fcoll.runtime.shm.sync import Channel, PeerError

log = logging.getLogger(__name__)
_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()


class Job:
    """A queued collective: ``run(call)`` moves the data, then ``finish()`` writes back staged
    outputs; the future gets ``result`` (the output tensors, as PyTorch backends return them)."""

    __slots__ = ("name", "seq", "payload", "run", "finish", "result", "future")

    def __init__(self, name: str, seq: int, payload: bytes, run: Callable[[Call], None],
                 finish: Callable[[], None] | None, result: Any):
        self.name, self.seq, self.payload = name, seq, payload
        self.run, self.finish, self.result = run, finish, result
        self.future: torch.futures.Future = torch.futures.Future()


class Engine:
    """Owns the channel (segment + counters) of one group and its worker thread."""

    def __init__(self, seg: Segment, ch: Channel, label: str):
        self.seg = seg
        self.ch = ch
        self.broken: BaseException | None = None
        self._queue: "queue.SimpleQueue[Job | None]" = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"fcoll-{label}", daemon=True)
        self._thread.start()
        _engines.add(self)

    def submit(self, job: Job) -> torch.futures.Future:
        if self._closed:
            raise RuntimeError(f"fcoll {job.name}: the process group was destroyed")
        self._queue.put(job)
        return job.future

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._execute(job)

    def _execute(self, job: Job) -> None:
        if self.broken is not None:
            job.future.set_exception(RuntimeError(
                f"fcoll {job.name}: the process group is unusable after an earlier error: "
                f"{self.broken}"))
            return
        call = Call(self.ch, job.name, f"{job.name} (collective #{job.seq})", time.monotonic(),
                    job.payload)
        try:
            job.run(call)
            if job.finish is not None:
                job.finish()
        except CollectiveMismatchError as e:  # raised by every rank at the same phase
            job.future.set_exception(e)
            return
        except BaseException as e:  # noqa: BLE001  the future carries it to wait()
            if not isinstance(e, PeerError):
                log.exception("fcoll %s failed", job.name)
            self.broken = e
            job.future.set_exception(e)
            return
        job.future.set_result(job.result)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the worker after the queued jobs (bounded by ``timeout_s``) and unmap."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.seg.close()


@atexit.register
def _close_all() -> None:
    for eng in list(_engines):
        eng.broken = eng.broken or RuntimeError("interpreter exiting")
        eng.close(timeout_s=1.0)


class FcollWork(torch.distributed.Work):
    """The ``Work`` of one queued collective (or of several, for coalescing).

    ``wait()`` blocks on an event without spinning, re-raises the collective's error (unlike
    ``_create_work_from_future``, whose ``wait`` drops it), and honours a ``timeout``.
    """

    def __init__(self, future: torch.futures.Future, name: str):
        super().__init__()
        self._fut = future
        self._name = name
        self._done = threading.Event()
        future.add_done_callback(lambda _f: self._done.set())

    def wait(self, timeout=None) -> bool:
        secs = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        if secs:
            if not self._done.wait(secs):
                raise RuntimeError(f"fcoll {self._name}: Work.wait timed out after {secs:.1f} s")
        else:
            self._done.wait()
        self._fut.value()  # raises the collective's error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done() and self.exception() is None

    def exception(self):
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except BaseException as e:  # noqa: BLE001
            return e
        return None

    def result(self):
        return self._fut.value()

    def synchronize(self) -> None:
        self.wait()
