"""The queue and the ``Work`` objects of
:class:`fcoll.shm.multihost.hierarchical.HierarchicalProcessGroup`."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fcoll.compat import run_eagerly_under_dynamo
from fcoll.shm.work import settle_future_later

__all__ = ["ChainedWork", "HierarchicalWork", "OrderedRunner"]


class OrderedRunner:
    """Runs submitted functions one at a time, in submission order, on a worker thread or on
    the thread that waits for one of them.

    A caller that waits right after issuing an op (a blocking collective, most small ones)
    would otherwise hand the op to the worker and sleep until it is done: two thread
    wake-ups per op, which on ranks sharing loaded cores cost milliseconds.
    :meth:`run_until` instead runs the queue up to that op on the
    waiting thread, as the shared-memory engine does (``fcoll.shm.engine.Engine.wait``).

    Invariant: a job is taken from the queue and run while holding ``_run_lock``, so jobs run
    one at a time and in submission order whichever thread runs them; every rank therefore
    issues the inner groups' collectives in one order.
    """

    def __init__(self, name: str):
        self._jobs: collections.deque[tuple[cf.Future, Callable[[], Any]]] = collections.deque()
        self._cv = threading.Condition()
        # re-entrant: a done-callback of one op's future (run inside _execute) may wait for
        # a later op of the same group, which then runs on this thread after it
        self._run_lock = threading.RLock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> cf.Future:
        """Queue ``fn``; returns the future of its result (or exception).

        Raises:
            RuntimeError: the runner was shut down.
        """
        fut: cf.Future = cf.Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("fcoll: the hierarchical group was shut down")
            self._jobs.append((fut, fn))
            self._cv.notify()
        return fut

    def _take(self) -> tuple[cf.Future, Callable[[], Any]] | None:
        with self._cv:
            return self._jobs.popleft() if self._jobs else None

    @staticmethod
    def _execute(job: tuple[cf.Future, Callable[[], Any]]) -> None:
        fut, fn = job
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001  delivered through the future
            fut.set_exception(e)

    def run_until(self, fut: cf.Future) -> None:
        """Run queued jobs on this thread until ``fut`` is done (it ran here or elsewhere)."""
        if fut.done():
            return
        with self._run_lock:
            while not fut.done():
                job = self._take()
                if job is None:   # taken and finished by the worker before we held the lock
                    break
                self._execute(job)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if self._closed and not self._jobs:
                    return
            with self._run_lock:
                job = self._take()
                if job is not None:
                    self._execute(job)

    def shutdown(self, cancel: bool = False) -> None:
        """Stop accepting jobs. ``cancel=False``: the worker runs the queued jobs and is joined;
        ``cancel=True`` (abort): queued jobs are cancelled and nothing is waited for (a job
        already running finishes or fails on its own)."""
        with self._cv:
            self._closed = True
            if cancel:
                while self._jobs:
                    self._jobs.popleft()[0].cancel()
            self._cv.notify_all()
        if not cancel and threading.current_thread() is not self._thread:
            self._thread.join()


@run_eagerly_under_dynamo
class HierarchicalWork(dist.Work):
    """The ``Work`` of an op queued on a :class:`HierarchicalProcessGroup`'s worker.

    ``wait()`` re-raises the op's error; ``result()`` is the list of output tensors.
    """

    def __init__(self, futures: list[cf.Future], runner: OrderedRunner | None = None):
        super().__init__()
        self._futures = futures
        self._runner = runner
        self._fut: torch.futures.Future | None = None

    def wait(self, timeout=None) -> bool:
        """Run the group's queue up to this op on this thread if nobody started it, then wait
        for it and re-raise its error."""
        secs = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        for f in self._futures:
            if self._runner is not None:
                self._runner.run_until(f)
            f.result(timeout=secs or None)
        return True

    def is_completed(self) -> bool:
        return all(f.done() for f in self._futures)

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self):
        return next((f.exception() for f in self._futures if f.done() and f.exception()), None)

    def result(self):
        self.wait()
        return self._futures[-1].result() if self._futures else []

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        if self._fut is None:
            fut: torch.futures.Future = torch.futures.Future()
            pending = list(self._futures)

            once = threading.Lock()   # held for good by the call that settles

            def settle(_: Any = None) -> None:
                # on the thread that finished the last op, which may hold the run lock: the
                # callbacks run elsewhere (fcoll.shm.work), as they may wait for a later op
                if all(f.done() for f in pending) and once.acquire(blocking=False):
                    err = self.exception()
                    settle_future_later(fut, err, None if err is not None else
                                        (pending[-1].result() if pending else []))

            for f in pending:
                f.add_done_callback(settle)
            settle()
            self._fut = fut
        return self._fut


@run_eagerly_under_dynamo
class ChainedWork(dist.Work):
    """A gloo p2p ``Work`` issued on the worker: wait for the issue, then for gloo's Work."""

    def __init__(self, issued: HierarchicalWork):
        super().__init__()
        self._issued = issued

    def _inner(self) -> dist.Work:
        self._issued.wait()
        return self._issued._futures[0].result()

    def wait(self, timeout=None) -> bool:
        return self._inner().wait() if timeout is None else self._inner().wait(timeout)

    def is_completed(self) -> bool:
        return self._issued.is_completed() and self._inner().is_completed()

    def _source_rank(self) -> int:
        return self._inner()._source_rank()

    def get_future(self) -> torch.futures.Future:
        return self._inner().get_future()
