"""``FcollProcessGroup``: the shared-memory backend as a pure-Python ``dist.ProcessGroup``.

Each method mirrors what ``torch.distributed.distributed_c10d`` (and C++ callers such as DDP's
reducer, through the ``PyProcessGroup`` trampoline) call on a process group. A synchronous call
of a small collective runs first through :mod:`fcoll.shm.group.fast_paths`. Otherwise the method
validates its arguments on the calling thread, stages inputs (CUDA -> host, non-contiguous ->
contiguous), queues a :class:`~fcoll.shm.work.Job` whose ``run`` is an algorithm of
:mod:`fcoll.shm.kernels.reductions` or :mod:`fcoll.shm.kernels.movement`, and returns a ``Work``
made from the job's future. Invalid arguments still queue a header-only job flagged invalid, so
every peer raises the same message instead of hanging; the calling rank raises ``ValueError`` at
once.

Shapes per rank (n = group size): all_reduce ``[*] -> [*]``; all_gather ``[*] -> [n * N, ...]``;
reduce_scatter ``[n * N, ...] -> [N, ...]``; all_to_all_single ``[sum(in_splits), ...] ->
[sum(out_splits), ...]``; broadcast / reduce in place. Reduce ops follow
:mod:`fcoll.ops.reduce`: ``avg`` is valid on every dtype but bool, and truncates toward zero on
integers.

The class holds the group's lifecycle, submission (``_submit``) and its data-movement
collectives (all_gather, all_to_all, broadcast, barrier, gather, scatter, point-to-point). Its
mixins: the collectives that take a reduce op (all_reduce, reduce, their coalesced forms,
reduce_scatter: :class:`~fcoll.shm.group.reducing.ReducingCollectives`), the CUDA submission
helpers (path setup, staging, the IPC path: :class:`~fcoll.shm.cuda.submission.CudaSubmission`)
and the c10d identity (:class:`~fcoll.shm.group.identity.GroupIdentity`).
"""

from __future__ import annotations

import datetime
import functools
import math
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from fcoll.compat import run_eagerly_under_dynamo
from fcoll.shm.group.identity import GroupIdentity
from fcoll.shm.group.reducing import ReducingCollectives
from fcoll.shm.kernels import movement
from fcoll.shm.group import arg_checks as checks
from fcoll.shm.cuda.paths import CudaGroup, IpcBuffers
from fcoll.shm.cuda.staging import CudaStaging
from fcoll.shm.engine import Engine, exception_note
from fcoll.shm.work import FcollWork
from fcoll.shm.group.fast_paths import FastPaths
from fcoll.shm.cuda.submission import CudaSubmission
from fcoll.shm.transport.headers import (NO_ROOT, CollectiveMismatchError, Header, dtype_name,
                                         header_dtype)
from fcoll.shm.p2p.sendrecv import P2P
from fcoll.shm.transport.phases import Call
from fcoll.shm.transport.segment import default_slot_bytes, open_segment
from fcoll.shm.transport.sync import Channel
from fcoll.shm.group.validate import Staging, check_all_gather, check_tensor

ABORT_TIMEOUT_S = 0.5  # abort() waits this long for a running collective, then leaves it the unmap


# size and rank trace; peers_ahead and abandon are fcoll's own hooks (the rank check and the
# executor call them outside any traced code), not c10d entry points
@functools.partial(run_eagerly_under_dynamo, keep=("size", "rank", "peers_ahead", "abandon"))
class FcollProcessGroup(ReducingCollectives, CudaSubmission, GroupIdentity, dist.ProcessGroup):
    """Shared-memory process group of the ranks of one host (CPU tensors; CUDA staged).

    Args:
        store: the group's (prefix) store, used once to share the segment name.
        rank, size: this rank and the group size.
        timeout: every wait of every collective gives up after this long.
        global_ranks: global rank of each group rank (for error messages).
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                 global_ranks: list[int] | None = None, slot_bytes: int | None = None):
        super().__init__(rank, size)
        self._init_identity(rank, size, global_ranks)
        self._timeout_s = timeout.total_seconds()
        seg = open_segment(store, rank, size, slot_bytes or default_slot_bytes(), timeout)
        ch = Channel(seg, rank, size, self._timeout_s, self._global_ranks)
        self._engine = Engine(seg, ch, f"g{self._global_ranks[0]}x{size}r{rank}")
        self._fast = FastPaths(self._engine)
        self._coalescing: list[Any] | None = None
        self._cuda = CudaGroup(rank, size)

    # ---- identity (GroupIdentity), lifecycle -----------------------------------------------
    def __repr__(self) -> str:
        return f"FcollProcessGroup(rank={self._rank}, size={self._size}, name={self._group_name!r})"

    def shutdown(self) -> None:
        """c10d's shutdown (``dist.destroy_process_group``): run what was queued, then fence
        the next collective (a peer still to call it raises at once, naming this rank) and
        release the segment, the worker and the inboxes."""
        self._close_p2p()
        self._fast.clear()  # the fast paths' views of the mapping, so close() can unmap it
        self._fast = _NO_FAST_PATHS  # a plan made now would view the unmapped segment
        self._engine.close()
        self._cuda.close()

    def abort(self) -> None:
        """c10d's abort (``ProcessGroup.abort``,
        ``torch.distributed.distributed_c10d._abort_process_group``): this rank gives up the
        group, on this rank alone (no peer needs to call it).

        The first collective this rank has not completed is fenced in shared memory before
        anything else (:meth:`Engine.abort`): every peer waiting in it, or arriving at it or a
        later collective of the group, raises at once (within a wake-up) naming this rank and
        "aborted its process group", and the group is unusable on every rank until it is
        created again. Called while an exception is being handled (in an ``except`` block,
        or by :func:`fcoll.fence_on_error`), the fence carries that exception's type and first
        line, and the peers quote it. This rank's pending collectives (an un-waited ``Work``,
        queued or running) fail with an error saying the group was aborted: a running one
        gives up at its wait's next tick (0.1 s). Every later call raises
        ``RuntimeError`` saying to create the group again. The worker, the inboxes and the
        segment are released: the segment after at most ``ABORT_TIMEOUT_S`` here, or, if a
        collective still runs on another thread then, by that thread when it ends.
        """
        exc = sys.exc_info()[1]
        self._engine.abort(exception_note(exc) if exc is not None else "")
        self._close_p2p()
        self._fast.clear()
        self._fast = _NO_FAST_PATHS
        self._engine.close(timeout_s=ABORT_TIMEOUT_S)
        self._cuda.close()

    def peers_ahead(self) -> list[int]:
        """Group ranks waiting in a collective of this group that this rank has not issued
        (:meth:`Engine.peers_ahead`); the compile-time rank check asks while it waits."""
        return self._engine.peers_ahead()

    def abandon(self, e: BaseException, where: str) -> bool:
        """Fence this group because ``e`` leaves ``where`` on this rank
        (:meth:`Engine.abandon`); returns whether it fenced."""
        return self._engine.abandon(e, where)

    def _close_p2p(self) -> None:
        """Fail pending sends and receives, stop the inbox's thread and unmap the inboxes now,
        not when the group is garbage collected."""
        p2p = getattr(self, "_p2p_state", None)
        if p2p is not None:
            p2p.close()

    @property
    def engine(self) -> Engine:
        """The group's executor: the direct path (:mod:`fcoll.shm.group.direct`) issues its
        collectives into it."""
        return self._engine

    @property
    def cuda_path(self) -> str | None:
        """``"ipc"`` or ``"staged"``: the path of this group's CUDA collectives (see
        :mod:`fcoll.shm.cuda.paths`), None before its first CUDA collective."""
        return self._cuda.path

    # ---- submission -----------------------------------------------------------------------
    def _staging(self, t: torch.Tensor) -> Staging:
        """How ``t``'s data reaches the shared slots: :class:`Staging` for a CPU tensor (no CUDA
        code on its path), :class:`~fcoll.shm.cuda.staging.CudaStaging` for a CUDA one."""
        return CudaStaging(self._cuda) if t.is_cuda else Staging()

    def _submit(self, name: str, shape_of: torch.Tensor | None, *, reduce_op: str = "",
                root: int = NO_ROOT, extra: Any = None, error: str | None = None,
                run: Callable[[Call], None] | None = None, st: Staging | None = None,
                result: Any = None, post: Callable[[], None] | None = None,
                opts: Any = None, cuda_run: Callable[[Call], Any] | None = None) -> dist.Work:
        """Queue collective ``name`` (its header from ``shape_of``'s dtype and shape and the
        other arguments) to run ``run``, then ``st.finish()`` and ``post()``; return its Work.

        ``cuda_run`` (the IPC path) is run instead of ``run`` and returns the CUDA event that
        the ``Work``'s ``wait()`` makes the caller's stream wait on; a :class:`CudaStaging`
        ``st`` (the staged path) supplies that event from its copies back.

        Raises:
            ValueError: ``error`` (this rank's arguments are invalid), after queueing a
                header-only job that makes every peer raise the same message.
        """
        eng = self._engine
        if error is not None:
            error = f"fcoll {name}: {eng.ch.describe(self._rank)}: {error}"
            if not isinstance(shape_of, torch.Tensor):
                shape_of = None  # the header of an invalid call needs no dtype or shape
        dtype = header_dtype(dtype_name(shape_of.dtype), shape_of) if shape_of is not None else ""
        shape = tuple(shape_of.shape) if shape_of is not None else ()

        def encode(seq: int) -> bytes:
            return Header(seq, name, dtype, shape, reduce_op, root, extra, error).encode()

        if error is not None:
            eng.submit(eng.job(name, encode, movement.barrier))
            raise CollectiveMismatchError(error)  # a ValueError, raised by every rank
        finish = st.finish if st is not None and st.needed() else None
        if post is not None:
            finish = post if finish is None else (lambda f=finish: (f(), post()))
        # A synchronous call (asyncOp False: c10d waits right away) runs on the caller's thread
        # in wait(); waking the worker would only make the two threads fight over the GIL.
        wake = (getattr(opts, "asyncOp", True) if opts is not None else True) or (
            self._coalescing is not None)
        job = eng.job(name, encode, run, finish, result)
        if cuda_run is not None or (st is not None and st.on_cuda):
            self._cuda_job(job, run, finish, st, cuda_run)
        if not wake and eng.run_inline(job):
            return FcollWork(eng, [job], name)
        eng.submit(job, wake=wake)
        if self._coalescing is not None:
            self._coalescing.append(job)
        return FcollWork(eng, [job], name)

    # ---- all_gather ---------------------------------------------------------------------------
    def all_gather_single(self, output, input, opts=None) -> dist.Work:  # noqa: A002
        if opts is not None and not opts.asyncOp and self._coalescing is None:
            work = self._fast.all_gather(output, input)
            if work is not None:
                return work
        name = "all_gather_into_tensor"
        n = self._size
        err = check_all_gather(input, output, n, self._rank) or self._device_error(
            [("input_tensor", input), ("output_tensor", output)])
        if err:
            return self._submit(name, input, error=err)
        if input.is_cuda and self._cuda_setup(name, input) == "ipc":
            cg = self._cuda
            src = self._dense(input).view(-1).view(torch.uint8)
            dst = self._dense_out(output)

            def body(c: Call, ipc: IpcBuffers) -> None:
                cg.all_gather(c, ipc, src, dst.view(-1).view(torch.uint8))
                self._write_back(output, dst)

            return self._submit_ipc(name, input, body, [input, output, src, dst], [output],
                                    opts)
        st = self._staging(input)
        src = st.input(input).view(-1).view(torch.uint8)
        dst = st.output(output).view(-1).view(torch.uint8).view(n, src.numel())
        return self._submit(name, input, run=lambda c: movement.all_gather(c, src, dst), st=st,
                            result=[output], opts=opts)

    _allgather_base = all_gather_single

    def allgather(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        """List form: ``output_tensors[0][p]`` receives rank p's ``input_tensors[0]``."""
        return self._allgather("all_gather", output_tensors, input_tensors, opts)

    def _allgather(self, name: str, output_tensors, input_tensors, opts=None) -> dist.Work:
        """:meth:`allgather` under another name (``gather`` goes through it). Every output is
        checked, element by element, before anything is written."""
        n = self._size
        err = checks.all_gather_list_error(output_tensors, input_tensors, n, self._rank)
        if err:
            return self._submit(name, checks.first(input_tensors), error=err)
        inp, outs = input_tensors[0], output_tensors[0]
        for i, o in enumerate(outs):
            err = self._device_error([("input_tensors[0]", inp), (f"output_tensors[{i}]", o)])
            if err:
                return self._submit(name, inp, error=err)
        st = Staging()
        src = st.input(inp).view(-1).view(torch.uint8)
        dst = torch.empty((n, src.numel()), dtype=torch.uint8)

        def run(c: Call) -> None:
            movement.all_gather(c, src, dst)
            for p, o in enumerate(outs):
                st.scatter_into(o, dst[p])

        return self._submit(name, inp, run=run, st=st, result=[list(outs)], opts=opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None) -> dist.Work:
        err = checks.pairs_error("output_lists", output_lists, "input_list", input_list)
        if err:
            return self._submit("all_gather", None, error=err)
        works = [self.allgather([o], [i]) for o, i in zip(output_lists, input_list)]
        return works[-1] if works else self.barrier()

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        err = checks.pairs_error("outputs", outputs, "inputs", inputs)
        if err:
            return self._submit("all_gather_into_tensor", None, error=err)
        works = [self.all_gather_single(o, i) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self.barrier()

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # ---- all_to_all ---------------------------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,  # noqa: A002
                          opts=None, _post=None, _result=None) -> dist.Work:
        if (opts is not None and not opts.asyncOp and self._coalescing is None
                and _post is None):
            work = self._fast.all_to_all(output, input, output_split_sizes, input_split_sizes)
            if work is not None:
                return work
        name = "all_to_all_single"
        n = self._size
        err = checks.all_to_all_single_error(output, input, output_split_sizes,
                                             input_split_sizes, n) or self._device_error(
            [("input", input), ("output", output)])
        if err:
            return self._submit(name, input, extra=None, error=err)
        in_s, out_s, _ = Staging.check_splits(
            input, output, list(input_split_sizes or []), list(output_split_sizes or []), n)
        row = math.prod(input.shape[1:]) * input.element_size()  # also with 0 rows
        if input.is_cuda and self._cuda_setup(name, input, extra=(in_s, out_s)) == "ipc":
            cg = self._cuda
            src = self._dense(input).view(-1).view(torch.uint8)
            dst = self._dense_out(output)

            def body(c: Call, ipc: IpcBuffers) -> None:
                cg.all_to_all(c, ipc, src, dst.view(-1).view(torch.uint8), row)
                self._write_back(output, dst)
                if _post is not None:
                    _post()

            return self._submit_ipc(name, input, body, [input, output, src, dst],
                                    _result or [output], opts, extra=(in_s, out_s))
        st = self._staging(input)
        src = st.input(input).view(-1).view(torch.uint8)
        dst = st.output(output).view(-1).view(torch.uint8)
        send = _offsets(in_s, row)
        recv = _offsets(out_s, row)
        return self._submit(name, input, extra=(in_s, out_s),
                            run=lambda c: movement.all_to_all(c, src, dst, send, recv, row), st=st,
                            result=_result or [output], post=_post, opts=opts)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        """List form, via ``all_to_all_single`` on flattened, concatenated tensors: rank p
        receives ``input_tensors[p]`` of every rank into its ``output_tensors``. Every tensor is
        checked (one dtype for all) before anything moves."""
        n = self._size
        name = "all_to_all"
        err = checks.all_to_all_error(output_tensors, input_tensors, n)
        if err:
            return self._submit(name, None, error=err)
        dt = input_tensors[0].dtype
        src = torch.cat([t.detach().reshape(-1).cpu() for t in input_tensors])
        dst = torch.empty(sum(o.numel() for o in output_tensors), dtype=dt)

        def post() -> None:
            off = 0
            for o in output_tensors:
                o.copy_(dst[off:off + o.numel()].view(o.shape))
                off += o.numel()

        return self.all_to_all_single(dst, src, [o.numel() for o in output_tensors],
                                      [t.numel() for t in input_tensors], _post=post,
                                      _result=[list(output_tensors)])

    # ---- broadcast / barrier / coalescing ----------------------------------------------------
    def broadcast(self, tensors, opts=None) -> dist.Work:
        if (opts is not None and not opts.asyncOp and self._coalescing is None
                and len(tensors) == 1):
            work = self._fast.broadcast(tensors[0], opts.rootRank)
            if work is not None:
                return work
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._broadcast(tensors, opts.rootRank, opts=opts)

    def _broadcast(self, tensors, root: int, name: str = "broadcast", post=None,
                   result=None, opts=None) -> dist.Work:
        err = checks.broadcast_error(tensors, root, self._size)
        t = tensors[0] if len(tensors) == 1 and not err else None
        err = err or (self._device_error([("tensor", t)]) if t is not None else None)
        if err:
            return self._submit(name, t, root=root, error=err)
        if t.is_cuda and self._cuda_setup(name, t, root=root) == "ipc":
            cg = self._cuda
            buf = self._dense(t)

            def body(c: Call, ipc: IpcBuffers) -> None:
                cg.broadcast(c, ipc, buf.view(-1).view(torch.uint8), root)
                self._write_back(t, buf)
                if post is not None:
                    post()

            return self._submit_ipc(name, t, body, [t, buf], result or [t], opts, root=root)
        st = self._staging(t)
        buf = st.inout(t, read=root == self._rank).view(-1).view(torch.uint8)
        return self._submit(name, t, root=root, run=lambda c: movement.broadcast(c, buf, root),
                            st=st, result=result or [t], post=post, opts=opts)

    def barrier(self, opts=None) -> dist.Work:
        return self._submit("barrier", None, run=movement.barrier, opts=opts)

    def _start_coalescing(self, device=None) -> None:
        self._coalescing = []

    def _end_coalescing(self, device=None) -> dist.Work:
        jobs, self._coalescing = self._coalescing or [], None
        self._engine.kick()
        return FcollWork(self._engine, jobs, "coalesced")

    # ---- point-to-point (fcoll.shm.p2p.sendrecv: an inbox per rank, made at its first use) ---
    def send(self, tensors, dstRank, tag=0) -> dist.Work:  # noqa: N803  (c10d's names)
        """Send ``tensors[0]`` to group rank ``dstRank``; the Work completes once the bytes are
        in shared memory and the receiver accepted them (a mismatch raises ValueError on
        both ranks). ``dist.isend`` returns this Work; ``dist.send`` waits on it."""
        return self._p2p().issue("send", tensors, dstRank, tag)

    def recv(self, tensors, srcRank, tag=0) -> dist.Work:  # noqa: N803
        """Receive into ``tensors[0]`` the next message of ``srcRank`` with ``tag``."""
        return self._p2p().issue("recv", tensors, srcRank, tag)

    def recv_anysource(self, tensors, tag=0) -> dist.Work:
        """Receive the next message with ``tag`` from any rank; ``Work._source_rank()`` says
        which (``dist.recv(t)`` with no ``src`` returns it)."""
        return self._p2p().issue("recv", tensors, None, tag)

    def _p2p(self) -> P2P:
        p2p = getattr(self, "_p2p_state", None)
        if p2p is None:
            p2p = self._p2p_state = P2P(self._engine.seg, self._rank, self._size,
                                        self._timeout_s, self._engine.ch.describe, owner=self,
                                        quit_why=self._engine.ch.fences.left_group)
        return p2p

    # ---- rooted gather / scatter (via all_gather / broadcast) ------------------------------
    def gather(self, output_lists, input_tensors, opts=None) -> dist.Work:
        """``output_lists[0][p]`` on the root receives rank p's ``input_tensors[0]`` (an
        all_gather: every rank gets them; non-root ranks may pass no outputs)."""
        root = opts.rootRank if opts is not None else 0
        n = self._size
        name = "gather"
        err = checks.list_error("input_tensors", input_tensors, 1)
        err = err or check_tensor(input_tensors[0], "input_tensors[0]")
        if not err and not 0 <= root < n:
            err = f"root (dst) {root} is out of range for a group of size {n}"
        if err:
            return self._submit(name, None, root=root, error=err)
        inp = input_tensors[0]
        outs = output_lists[0] if output_lists and output_lists[0] else [
            torch.empty_like(inp) for _ in range(n)]
        return self._allgather(name, [outs], [inp], opts)

    def scatter(self, output_tensors, input_lists, opts=None) -> dist.Work:
        """``output_tensors[0]`` receives the root's ``input_lists[0][rank]`` (a broadcast of
        the stacked inputs); the root's inputs are checked before anything moves."""
        root = opts.rootRank if opts is not None else 0
        n = self._size
        name = "scatter"
        err = checks.scatter_error(output_tensors, input_lists, root, self._rank, n)
        if err:
            return self._submit(name, None, root=root, error=err)
        out = output_tensors[0]
        if self._rank == root:
            stacked = torch.stack([t.detach().cpu() for t in input_lists[0]])
        else:
            stacked = torch.empty((n, *out.shape), dtype=out.dtype)
        return self._broadcast([stacked], root, name="scatter",
                               post=lambda: out.copy_(stacked[self._rank]), result=[out])


class _NoFastPaths:
    """The fast paths of a closed group: none, so every call takes the general path, whose
    engine refuses it with the reason (destroyed, or aborted: create it again)."""

    def clear(self) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., None]:
        return _not_eligible


def _not_eligible(*args, **kwargs) -> None:
    return None


_NO_FAST_PATHS = _NoFastPaths()


def _offsets(splits: list[int], row_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` in bytes of each rank's rows, for rows of ``row_bytes``."""
    out, off = [], 0
    for s in splits:
        out.append((off * row_bytes, s * row_bytes))
        off += s
    return out
