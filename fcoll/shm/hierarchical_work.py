"""The ``Work`` objects of :class:`fcoll.shm.hierarchical.HierarchicalProcessGroup`."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import torch
import torch.distributed as dist

from fcoll.compat import run_eagerly_under_dynamo

__all__ = ["ChainedWork", "HierarchicalWork"]


@run_eagerly_under_dynamo
class HierarchicalWork(dist.Work):
    """The ``Work`` of an op queued on a :class:`HierarchicalProcessGroup`'s worker.

    ``wait()`` re-raises the op's error; ``result()`` is the list of output tensors.
    """

    def __init__(self, futures: list[cf.Future]):
        super().__init__()
        self._futures = futures
        self._fut: torch.futures.Future | None = None

    def wait(self, timeout=None) -> bool:
        secs = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        for f in self._futures:
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

            def settle(_: Any = None) -> None:
                if all(f.done() for f in pending) and not fut.done():
                    err = self.exception()
                    if err is not None:
                        fut.set_exception(err)
                    else:
                        fut.set_result(pending[-1].result() if pending else [])

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
        return self._issued._futures[0].result()

    def wait(self, timeout=None) -> bool:
        return self._inner().wait() if timeout is None else self._inner().wait(timeout)

    def is_completed(self) -> bool:
        return self._issued.is_completed() and self._inner().is_completed()

    def _source_rank(self) -> int:
        return self._inner()._source_rank()

    def get_future(self) -> torch.futures.Future:
        return self._inner().get_future()
