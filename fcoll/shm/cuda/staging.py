"""``CudaStaging``: the staged path of CUDA collectives (:mod:`fcoll.shm.cuda.paths`).

CUDA inputs are copied to pinned host memory on the group's side stream, the CPU path's
shared-memory algorithm runs on the host copies, and the outputs are copied back on the side
stream; the ``Work``'s ``wait()`` makes the caller's stream wait on the event recorded after
them. ``group`` is the group's :class:`~fcoll.shm.cuda.paths.CudaGroup` (its ``stream`` and
``device``).
"""

from __future__ import annotations

from typing import Any

import torch

from fcoll.shm.group.validate import Staging

__all__ = ["CudaStaging"]


class CudaStaging(Staging):
    """Staging of CUDA tensors through pinned host memory, ordered on the group's side stream.

    ``input``/``inout`` enqueue the device-to-host copy on the side stream at issue (after
    the caller's current stream, through an event); :meth:`seal` records when they are done;
    the worker calls :meth:`wait_inputs` before the shared-memory algorithm reads the host
    buffers, and :meth:`finish` enqueues the host-to-device copies of the outputs and records
    :attr:`event`, on which the ``Work``'s ``wait()`` makes the caller's stream wait. CPU
    tensors in the same call (never mixed by validated calls) behave as in :class:`Staging`.
    """

    on_cuda = True

    def __init__(self, group: Any):
        super().__init__()
        self._g = group
        self._started = False
        self._ready: torch.cuda.Event | None = None
        self.event: torch.cuda.Event | None = None

    def _start(self) -> None:
        if not self._started:
            self._started = True
            self._g.stream.wait_stream(torch.cuda.current_stream(self._g.device))

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)

    def input(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if not t.is_cuda:
            return super().input(t)
        self._start()
        host = self._pinned(t)
        s = self._g.stream
        with torch.cuda.stream(s):
            host.copy_(t, non_blocking=True)
        t.record_stream(s)
        return host

    def output(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if not t.is_cuda:
            return super().output(t)
        self._start()  # the write-back must also follow the caller's earlier work on t
        host = self._pinned(t)
        t.record_stream(self._g.stream)
        self._back.append((t, host))
        return host

    def inout(self, t: torch.Tensor, read: bool = True) -> torch.Tensor:
        t = t.detach()
        if not t.is_cuda:
            return super().inout(t, read)
        host = self.input(t) if read else self.output(t)
        if read:
            self._back.append((t, host))
        return host

    def seal(self) -> None:
        """Record the end of the device-to-host copies (call once every input is staged)."""
        if self._started:
            self._ready = torch.cuda.Event()
            self._ready.record(self._g.stream)

    def wait_inputs(self) -> None:
        """Block this (worker) thread until the input copies are done."""
        if self._ready is not None:
            self._ready.synchronize()

    def needed(self) -> bool:
        return self._started or bool(self._back)

    def finish(self) -> None:
        s = self._g.stream
        with torch.cuda.device(self._g.device), torch.cuda.stream(s):
            for t, host in self._back:
                t.copy_(host, non_blocking=t.is_cuda)
            ev = torch.cuda.Event()
            ev.record(s)
        self.event = ev
