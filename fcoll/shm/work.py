"""A collective's life after it is issued: the queued :class:`Job`, its torch future, and the
c10d ``Work`` objects a caller of :class:`~fcoll.shm.group.process_group.FcollProcessGroup`
gets back (:class:`FcollWork` for queued collectives, :class:`DoneWork` for one already run on
the caller's thread).

The executor that runs the jobs is :class:`fcoll.shm.engine.Engine`; a ``Work`` reaches it only
through its ``wait`` (:class:`Executor`), so this module does not import it.

A job's torch future, and a point-to-point operation's, is completed off the thread that
finished the operation (:func:`settle_future_later`): ``Future.set_result`` runs the future's
``then`` callbacks on the thread that calls it, and a callback may issue a collective and block
on its future (PyTorch's PowerSGD DDP hook does, three levels deep). On the worker thread, or on
a caller's thread still holding the executor, that collective could never run: the rank hung
while gloo, whose futures complete on a pool of worker threads, ran the same hook. A p2p
operation finishes inside a step of the p2p protocol, which a callback's own send or receive
re-entered ("message 0 from rank 1, expected 1").
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any, Callable, Protocol

import torch

from fcoll.compat import run_eagerly_under_dynamo
from fcoll.shm.transport.phases import Call

__all__ = ["DoneWork", "Executor", "FcollWork", "Job", "settle_future", "settle_future_later"]

log = logging.getLogger(__name__)


class _Settler:
    """Completes torch futures on threads of its own, one thread per settlement in progress.

    Each :meth:`settle` reserves a thread, an idle one or a new one, before queueing, so a
    callback that blocks on a later job's future (which needs a settlement of its own) never
    waits behind itself: threads = settlements in progress + idle ones, and as many threads
    exist as the deepest chain of blocking callbacks needed (PowerSGD: 3); they stay for reuse
    (daemon threads, blocked on the queue when idle). A forked child starts with none.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """No threads, nothing queued: a new settler, or one in a forked child (whose threads
        did not survive the fork)."""
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0

    def settle(self, fut: torch.futures.Future, error: BaseException | None, result) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._serve, name="fcoll-future", daemon=True).start()
            self._queue.put((fut, error, result))

    def _serve(self) -> None:
        while True:
            fut, error, result = self._queue.get()
            try:
                settle_future(fut, error, result)
            except Exception:  # noqa: BLE001  the thread outlives one bad future
                log.exception("fcoll: completing a collective's future failed")
            with self._lock:
                self._idle += 1


_settler = _Settler()
os.register_at_fork(after_in_child=_settler._reset)


def settle_future_later(fut: torch.futures.Future, error: BaseException | None, result) -> None:
    """:func:`settle_future` on a thread of fcoll's own (module docstring), for the thread that
    finished an operation and still holds what the future's callbacks may need: a group's
    executor, the p2p protocol's progress."""
    _settler.settle(fut, error, result)


class Job:
    """A queued collective: ``run(call)`` moves the data, then ``finish()`` writes back staged
    outputs. Its result is ``result`` (the output tensors, as PyTorch backends return them) or
    ``error``; ``done_lock`` is held until it completes. The torch future is made on demand.
    A CUDA collective sets ``cuda_event`` (recorded on the group's side stream after its
    kernels or copies): its results are ready for a stream that waited on it."""

    __slots__ = ("name", "seq", "payload", "run", "finish", "result", "error", "done",
                 "done_lock", "_fut", "_fut_lock", "cuda_event")

    def __init__(self, name: str, seq: int, payload: bytes, run: Callable[[Call], None],
                 finish: Callable[[], None] | None, result: Any):
        self.name, self.seq, self.payload = name, seq, payload
        self.run, self.finish, self.result = run, finish, result
        self.error: BaseException | None = None
        self.done = False
        self.cuda_event = None
        self.done_lock = threading.Lock()
        self.done_lock.acquire()
        self._fut: torch.futures.Future | None = None
        self._fut_lock = threading.Lock()

    def complete(self, error: BaseException | None) -> None:
        """Mark the job done (called by the thread that executed it, which still holds the
        executor) and complete its future, if one was asked for, on another thread (module
        docstring: its callbacks may issue collectives and wait for them)."""
        with self._fut_lock:
            self.error = error
            self.done = True
            fut = self._fut
        self.done_lock.release()
        if fut is not None:
            settle_future_later(fut, self.error, self.result)

    def future(self) -> torch.futures.Future:
        with self._fut_lock:
            if self._fut is None:
                self._fut = torch.futures.Future()
                if self.done:
                    settle_future(self._fut, self.error, self.result)
            return self._fut


def settle_future(fut: torch.futures.Future, error: BaseException | None, result) -> None:
    """Complete ``fut`` (a completed job's or p2p operation's future) with ``error`` if there
    is one, else with ``result``."""
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class Executor(Protocol):
    """What a :class:`FcollWork` needs of the executor that runs its jobs
    (:class:`fcoll.shm.engine.Engine`)."""

    def wait(self, job: Job, timeout_s: float | None = None) -> None:
        """Block until ``job`` completed (running it on this thread if nobody started it);
        raise its error."""


@run_eagerly_under_dynamo
class FcollWork(torch.distributed.Work):
    """The ``Work`` of queued collectives (one, or several for coalescing).

    ``wait()`` re-raises the collective's error (``_create_work_from_future``'s ``wait`` drops
    it), honours a ``timeout``, and never spins. For CUDA collectives it returns once the
    host part is done and the caller's current stream waits on the collective's event: the
    host does not wait for the GPU (as ``ProcessGroupNCCL``'s ``Work.wait``).
    """

    def __init__(self, engine: Executor, jobs: list[Job], name: str):
        super().__init__()
        self._engine = engine
        self._jobs = jobs
        self._name = name
        self._fut: torch.futures.Future | None = None

    def wait(self, timeout=None) -> bool:
        secs = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        for job in self._jobs:
            self._engine.wait(job, secs or None)
            if job.cuda_event is not None:
                job.cuda_event.wait()  # the caller's current stream waits; the host does not
        return True

    def get_future(self) -> torch.futures.Future:
        if self._fut is None:
            if len(self._jobs) == 1:
                self._fut = self._jobs[0].future()
            else:
                futs = [j.future() for j in self._jobs]
                self._fut = torch.futures.collect_all(futs).then(
                    lambda f: [x.value() for x in f.value()])
        return self._fut

    def is_completed(self) -> bool:
        return all(j.done and (j.cuda_event is None or j.cuda_event.query())
                   for j in self._jobs)

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self):
        return next((j.error for j in self._jobs if j.error is not None), None)

    def result(self):
        self.wait()
        return self._jobs[-1].result

    def synchronize(self) -> None:
        self.wait()


@run_eagerly_under_dynamo
class DoneWork(torch.distributed.Work):
    """The ``Work`` of a collective already executed on the caller's thread."""

    def __init__(self, result, error: BaseException | None):
        super().__init__()
        self._result = result
        self._error = error
        self._fut: torch.futures.Future | None = None

    def _reset(self, result) -> None:
        """Make this (successful, no longer referenced) Work stand for a new collective
        (:meth:`Engine.run_fast`). Underscored so that ``run_eagerly_under_dynamo`` leaves it
        unwrapped: no compiled code calls it, and a wrapper cost every fast call ~0.6 us."""
        self._result = result
        self._fut = None

    def wait(self, timeout=None) -> bool:
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        if self._fut is None:
            self._fut = torch.futures.Future()
            if self._error is not None:
                self._fut.set_exception(self._error)
            else:
                self._fut.set_result(self._result)
        return self._fut

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return self._error is None

    def exception(self):
        return self._error

    def result(self):
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()
