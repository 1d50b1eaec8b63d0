"""``CudaSubmission``: the CUDA half of :class:`~fcoll.shm.group.process_group.FcollProcessGroup`.

A mixin of the group's private helpers for CUDA tensors: the device check, the choice of the
group's CUDA path at its first CUDA collective (``_cuda_setup``), the
CUDA part of ``_submit`` (``_cuda_job``: the event a ``Work`` makes the caller's stream wait
on), IPC submission on the side stream (``_submit_ipc``, with the allocator-safety rule of
:mod:`fcoll.shm.cuda.paths`), the contiguous views an IPC kernel reads and writes (``_dense``,
``_dense_out``, ``_write_back``) and the IPC bodies of all_reduce / reduce and
all_reduce_coalesced.

It is separate from ``process_group.py`` so that the CUDA paths (which path, stream order,
allocator safety) read in one place, next to :mod:`fcoll.shm.cuda.paths`, while the process group
keeps each collective's argument checks and CPU submission. Only underscore helpers live here:
they are called from the group's entry points, which
:func:`fcoll.compat.run_eagerly_under_dynamo` already runs eagerly. The host class provides
``_rank``, ``_cuda`` (a :class:`~fcoll.shm.cuda.paths.CudaGroup`) and ``_submit``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from fcoll.shm.cuda.paths import IpcBuffers, device_error
from fcoll.shm.work import Job
from fcoll.shm.transport.headers import NO_ROOT
from fcoll.shm.transport.phases import Call
from fcoll.shm.group.validate import Staging


class CudaSubmission:
    """Mixin: :class:`~fcoll.shm.group.process_group.FcollProcessGroup`'s CUDA submission
    helpers."""

    def _device_error(self, tensors: list[tuple[str, torch.Tensor]]) -> str | None:
        """Mixed CPU/CUDA tensors, or a CUDA tensor off this rank's device (None if fine)."""
        if all(t.is_cpu for _, t in tensors):
            return None
        return device_error(tensors, self._cuda.device)

    def _cuda_setup(self, name: str, t: torch.Tensor | None, **header: Any) -> str:
        """The group's CUDA path; at its first CUDA collective, choose it with the peers.

        The setup runs as a collective of its own, synchronously, with the header of the
        collective it precedes: a rank that calls the same collective on CPU tensors fails
        its header check (dtype ``float32 on cuda`` vs ``float32``) on every rank instead
        of hanging.

        Raises:
            CollectiveMismatchError: the peers called something else.
            RuntimeError: ``FCOLL_CUDA_PATH=ipc`` but the ranks cannot map each other's GPUs.
        """
        cg = self._cuda
        if cg.path is None:
            cg.bind()
            self._submit(name, t, run=cg.setup, **header).wait()
        return cg.path

    def _submit_ipc(self, name: str, shape_of: torch.Tensor,
                    body: Callable[[Call, IpcBuffers], None], keep: list[torch.Tensor],
                    result: Any, opts: Any = None, **header: Any) -> dist.Work:
        """Queue an IPC-path collective: ``body`` runs on the side stream after an event
        recorded now on the caller's current stream. ``keep`` (the user's tensors and
        temporaries) are marked used on the side stream; the job holds them until its
        kernels are enqueued (allocator safety, see :mod:`fcoll.shm.cuda.paths`)."""
        cg = self._cuda
        issued = torch.cuda.Event()
        issued.record(torch.cuda.current_stream(cg.device))
        seen = set()
        for x in keep:
            if id(x) not in seen:
                seen.add(id(x))
                x.record_stream(cg.stream)
        return self._submit(name, shape_of, result=result, opts=opts,
                            cuda_run=lambda c, k=keep: cg.run_ipc(issued, body, c), **header)

    @staticmethod
    def _cuda_job(job: Job, run: Callable[[Call], None] | None, finish: Callable[[], None] | None,
                  st: Staging | None, cuda_run: Callable[[Call], Any] | None) -> None:
        """The CUDA part of ``_submit``: make ``job`` (made from ``run`` and ``finish``) set
        ``job.cuda_event``, the event the ``Work``'s ``wait()`` makes the caller's stream wait on.

        ``cuda_run`` (the IPC path) runs instead of ``run`` and returns that event; otherwise
        ``st`` is a :class:`CudaStaging` (the staged path), sealed here, whose inputs ``run``
        waits for and whose copies back supply the event."""
        if cuda_run is not None:
            def run_ipc(c: Call) -> None:
                job.cuda_event = cuda_run(c)

            job.run = run_ipc
        else:
            st.seal()

            def run_staged(c: Call) -> None:
                st.wait_inputs()
                run(c)

            def finish_staged() -> None:
                if finish is not None:
                    finish()
                job.cuda_event = st.event

            job.run, job.finish = run_staged, finish_staged

    @staticmethod
    def _dense(t: torch.Tensor) -> torch.Tensor:
        """``t`` detached, or a contiguous copy of it (made on the caller's stream)."""
        t = t.detach()
        return t if t.is_contiguous() else t.contiguous()

    @staticmethod
    def _dense_out(t: torch.Tensor) -> torch.Tensor:
        """Where an IPC kernel writes ``t``'s result: ``t`` itself when contiguous, else a
        contiguous scratch tensor that :meth:`_write_back` copies into ``t``."""
        t = t.detach()
        return t if t.is_contiguous() else torch.empty_like(
            t, memory_format=torch.contiguous_format)

    @staticmethod
    def _write_back(t: torch.Tensor, dense: torch.Tensor) -> None:
        """Copy ``dense`` (from :meth:`_dense` / :meth:`_dense_out`) into ``t`` unless it
        already is ``t`` (runs on the side stream, in the collective's body)."""
        if dense.data_ptr() != t.data_ptr() or not t.is_contiguous():
            t.detach().copy_(dense.view(t.shape))

    def _ipc_all_reduce(self, name: str, x: torch.Tensor, y: torch.Tensor | None, op: str,
                        result: Any, opts: Any, root: int = NO_ROOT) -> dist.Work:
        """all_reduce / reduce on the IPC path: ``x`` into ``y`` (``y`` None: in place; a
        reduce's non-root ranks compute into scratch)."""
        cg = self._cuda
        src = self._dense(x)
        target = x if y is None else y
        writes = root == NO_ROOT or root == self._rank
        if not writes:
            dst = torch.empty_like(src, memory_format=torch.contiguous_format)
        elif y is None:
            dst = src
        else:
            dst = self._dense_out(y)

        def body(c: Call, ipc: IpcBuffers) -> None:
            cg.all_reduce(c, ipc, src, dst, op)
            if writes:
                self._write_back(target, dst)

        return self._submit_ipc(name, x, body, [x, target, src, dst], result, opts,
                                reduce_op=op, root=root)

    def _ipc_coalesced(self, inputs, outputs, op: str, sig: tuple, opts) -> dist.Work:
        """``_coalesced`` (:mod:`fcoll.shm.group.reducing`) on the IPC path (validated; see
        :meth:`CudaGroup.all_reduce_coalesced`)."""
        cg = self._cuda
        pairs, back, keep = [], [], []
        for i, x in enumerate(inputs):
            y = x if outputs is None else outputs[i]
            src = self._dense(x)
            dst = src if outputs is None else self._dense_out(y)
            pairs.append((src.view(-1), dst.view(-1)))
            keep += [x, y, src, dst]
            back.append((y, dst))

        def body(c: Call, ipc: IpcBuffers) -> None:
            with torch.no_grad():
                cg.all_reduce_coalesced(c, ipc, pairs, op)
                for y, dst in back:
                    self._write_back(y, dst)

        return self._submit_ipc("all_reduce_coalesced", None, body, keep,
                                list(inputs if outputs is None else outputs),
                                opts if opts is not None else dist.AllreduceCoalescedOptions(),
                                reduce_op=op, extra=sig)
