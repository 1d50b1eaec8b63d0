"""``FcollProcessGroup``: the shared-memory backend as a pure-Python ``dist.ProcessGroup``.

Each method mirrors what ``torch.distributed.distributed_c10d`` (and C++ callers such as DDP's
reducer, through the ``PyProcessGroup`` trampoline) call on a process group. A synchronous call
of a small collective runs first through :mod:`fcoll.shm.fast_paths`. Otherwise the method
validates its arguments on the calling thread, stages inputs (CUDA -> host, non-contiguous ->
contiguous), queues a :class:`~fcoll.shm.engine.Job` whose ``run`` is an algorithm of
:mod:`fcoll.shm.reductions` or :mod:`fcoll.shm.movement`, and returns a ``Work`` made from the
job's future. Invalid arguments still queue a header-only job flagged invalid, so every peer
raises the same message instead of hanging; the calling rank raises ``ValueError`` at once.

Shapes per rank (n = group size): all_reduce ``[*] -> [*]``; all_gather ``[*] -> [n * N, ...]``;
reduce_scatter ``[n * N, ...] -> [N, ...]``; all_to_all_single ``[sum(in_splits), ...] ->
[sum(out_splits), ...]``; broadcast / reduce in place. Reduce ops follow
:mod:`fcoll.ops.reduce`: ``avg`` is valid on every dtype but bool, and truncates toward zero on
integers.
"""

from __future__ import annotations

import datetime
import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from fcoll.compat import run_eagerly_under_dynamo
from fcoll.ops.reduce import check_reduce_op, reduce_op_name
from fcoll.shm import movement, reductions
from fcoll.shm.arg_checks import inputs_like_error
from fcoll.shm.arg_checks import is_seq as _is_seq
from fcoll.shm.arg_checks import list_error as _list_error
from fcoll.shm.arg_checks import pairs_error as _pairs_error
from fcoll.shm.cuda import CudaGroup, CudaStaging, IpcBuffers, device_error, header_dtype
from fcoll.shm.engine import Engine, FcollWork, Job
from fcoll.shm.fast_paths import FastPaths, plain
from fcoll.shm.headers import NO_ROOT, Header, dtype_name
from fcoll.shm.p2p import P2P
from fcoll.shm.phases import Call
from fcoll.shm.segment import default_slot_bytes, open_segment
from fcoll.shm.sync import Channel
from fcoll.shm.validate import (Staging, check_all_gather, check_no_overlap, check_reduce_scatter,
                                check_tensor, check_tensors)

ABORT_TIMEOUT_S = 0.5  # abort() waits this long for the worker before unmapping anyway

@run_eagerly_under_dynamo
class FcollProcessGroup(dist.ProcessGroup):
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
        self._rank = rank
        self._size = size
        self._global_ranks = list(global_ranks) if global_ranks else list(range(size))
        self._group_name = ""
        self._group_desc = ""
        self._timeout_s = timeout.total_seconds()
        seg = open_segment(store, rank, size, slot_bytes or default_slot_bytes(), timeout)
        ch = Channel(seg, rank, size, self._timeout_s, self._global_ranks)
        self._engine = Engine(seg, ch, f"g{self._global_ranks[0]}x{size}r{rank}")
        self._fast = FastPaths(self._engine)
        self._coalescing: list[Any] | None = None
        self._cuda = CudaGroup(rank, size)

    # ---- identity -------------------------------------------------------------------------
    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:  # noqa: N802  (PyTorch's name)
        return "fcoll"

    def name(self) -> str:
        return "fcoll"

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def __repr__(self) -> str:
        return f"FcollProcessGroup(rank={self._rank}, size={self._size}, name={self._group_name!r})"

    def shutdown(self) -> None:
        self._close_p2p()
        self._fast.clear()  # the fast paths' views of the mapping, so close() can unmap it
        self._engine.close()
        self._cuda.close()

    def abort(self) -> None:
        self._close_p2p()
        self._fast.clear()
        self._engine.close(timeout_s=ABORT_TIMEOUT_S)
        self._cuda.close()

    def _close_p2p(self) -> None:
        """Fail pending sends and receives, stop the inbox's thread and unmap the inboxes now,
        not when the group is garbage collected."""
        p2p = getattr(self, "_p2p_state", None)
        if p2p is not None:
            p2p.close()

    @property
    def cuda_path(self) -> str | None:
        """``"ipc"`` or ``"staged"``: the path of this group's CUDA collectives (see
        :mod:`fcoll.shm.cuda`), None before its first CUDA collective."""
        return self._cuda.path

    # ---- submission -----------------------------------------------------------------------
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
        seq = eng.seq
        eng.seq = seq + 1
        if error is not None:
            error = f"fcoll {name}: {eng.ch.describe(self._rank)}: {error}"
            if not isinstance(shape_of, torch.Tensor):
                shape_of = None  # the header of an invalid call needs no dtype or shape
        dtype = header_dtype(dtype_name(shape_of.dtype), shape_of) if shape_of is not None else ""
        shape = tuple(shape_of.shape) if shape_of is not None else ()
        payload = Header(seq, name, dtype, shape, reduce_op, root, extra, error).encode()
        if error is not None:
            eng.submit(Job(name, seq, payload, movement.barrier, None, None))
            raise ValueError(error)
        finish = st.finish if st is not None and st.needed() else None
        if post is not None:
            finish = post if finish is None else (lambda f=finish: (f(), post()))
        # A synchronous call (asyncOp False: c10d waits right away) runs on the caller's thread
        # in wait(); waking the worker would only make the two threads fight over the GIL.
        wake = (getattr(opts, "asyncOp", True) if opts is not None else True) or (
            self._coalescing is not None)
        job = Job(name, seq, payload, run, finish, result)
        if cuda_run is not None:
            def run_ipc(c: Call) -> None:
                job.cuda_event = cuda_run(c)

            job.run = run_ipc
        elif isinstance(st, CudaStaging):
            st.seal()

            def run_staged(c: Call) -> None:
                st.wait_inputs()
                run(c)

            def finish_staged() -> None:
                if finish is not None:
                    finish()
                job.cuda_event = st.event

            job.run, job.finish = run_staged, finish_staged
        if not wake and eng.run_inline(job):
            return FcollWork(eng, [job], name)
        eng.submit(job, wake=wake)
        if self._coalescing is not None:
            self._coalescing.append(job)
        return FcollWork(eng, [job], name)

    # ---- CUDA: device checks, path setup, IPC submission (see fcoll.shm.cuda) ---------------
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

    def _staging(self, t: torch.Tensor) -> Staging:
        return CudaStaging(self._cuda) if t.is_cuda else Staging()

    def _submit_ipc(self, name: str, shape_of: torch.Tensor,
                    body: Callable[[Call, IpcBuffers], None], keep: list[torch.Tensor],
                    result: Any, opts: Any = None, **header: Any) -> dist.Work:
        """Queue an IPC-path collective: ``body`` runs on the side stream after an event
        recorded now on the caller's current stream. ``keep`` (the user's tensors and
        temporaries) are marked used on the side stream; the job holds them until its
        kernels are enqueued (allocator safety, see :mod:`fcoll.shm.cuda`)."""
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

    # ---- all_reduce / reduce ----------------------------------------------------------------
    def allreduce(self, tensors, opts=None) -> dist.Work:
        if (opts is not None and not opts.asyncOp and len(tensors) == 1
                and self._coalescing is None):
            work = self._fast.all_reduce(tensors[0], opts.reduceOp)
            if work is not None:
                return work
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._allreduce("all_reduce", tensors, reduce_op_name(opts.reduceOp), opts=opts)

    def _allreduce(self, name: str, tensors, op: str, root: int | None = None,
                   opts=None) -> dist.Work:
        if len(tensors) != 1:
            return self._submit(name, None, reduce_op=op, error=f"tensors: expects 1 tensor, "
                                f"got {len(tensors)}")
        t = tensors[0]
        err = (check_tensor(t, "tensor", True) or check_reduce_op(op, t.dtype)
               or self._device_error([("tensor", t)]))
        if root is not None and not 0 <= root < self._size:
            err = err or f"root {root} is out of range for a group of size {self._size}"
        hroot = NO_ROOT if root is None else root
        if err:
            return self._submit(name, t, reduce_op=op, root=hroot, error=err)
        if t.is_cuda and self._cuda_setup(name, t, reduce_op=op, root=hroot) == "ipc":
            return self._ipc_all_reduce(name, t, None, op, [t], opts, root=hroot)
        st = self._staging(t)
        flat = st.inout(t).view(-1)
        writes = root is None or root == self._rank

        def run(c: Call) -> None:
            reductions.all_reduce(c, flat, flat if writes else None, op)

        return self._submit(name, t, reduce_op=op, root=NO_ROOT if root is None else root,
                            run=run, st=st, result=[t], opts=opts)

    def allreduce_out_of_place(self, input: torch.Tensor, output: torch.Tensor,
                               op: dist.ReduceOp) -> dist.Work:
        """All-reduce ``input`` into ``output`` (same shape and dtype), leaving ``input`` alone,
        asynchronously (the call returns at once; the ``Work`` completes it).

        The functional ``all_reduce`` would otherwise clone its input and reduce the clone in
        place: a full extra copy, which this path does not make (the algorithm reads the input
        into the shared slots and reduces into the output). Ranks may mix this and
        ``allreduce``: the header is the same.

        Raises (through the Work, on every rank): the errors of ``allreduce`` for ``input``;
        ``output`` of another shape or dtype is a ``ValueError`` here.
        """
        if output.shape != input.shape or output.dtype != input.dtype:
            raise ValueError(f"fcoll all_reduce: rank {self._rank}: output {tuple(output.shape)} "
                             f"{output.dtype} does not match input {tuple(input.shape)} "
                             f"{input.dtype}")
        name, red = "all_reduce", reduce_op_name(op)
        err = (check_tensor(input, "input") or check_tensor(output, "output", True)
               or check_reduce_op(red, input.dtype)
               or self._device_error([("input", input), ("output", output)]))
        if err:
            return self._submit(name, input, reduce_op=red, error=err)
        if input.is_cuda and self._cuda_setup(name, input, reduce_op=red) == "ipc":
            return self._ipc_all_reduce(name, input, output, red, [output],
                                        dist.AllreduceOptions())
        st = self._staging(input)
        src, dst = st.input(input).view(-1), st.output(output).view(-1)

        return self._submit(name, input, reduce_op=red,
                            run=lambda c: reductions.all_reduce(c, src, dst, red), st=st,
                            result=[output], opts=dist.AllreduceOptions())

    def reduce(self, tensors, opts=None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._allreduce("reduce", tensors, reduce_op_name(opts.reduceOp), opts.rootRank,
                               opts=opts)

    def allreduce_coalesced(self, tensors, opts=None) -> dist.Work:
        """All-reduce every tensor of ``tensors`` in place (any shapes, dtypes mixed): one
        collective, in which the tensors of each dtype (in order of first appearance) are
        reduced as if concatenated, through :func:`fcoll.shm.reductions.all_reduce_many` (no
        concatenated copy). Shapes and dtypes may differ by tensor, not by rank.

        The header of the first phase carries every tensor's dtype and shape, so ranks that
        pass different lists raise the same ``ValueError`` instead of hanging.
        """
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._coalesced(tensors, None, opts.reduceOp, opts)

    def allreduce_coalesced_out_of_place(self, inputs: list[torch.Tensor],
                                         outputs: list[torch.Tensor],
                                         op: dist.ReduceOp) -> dist.Work:
        """All-reduce ``inputs[i]`` into ``outputs[i]`` (same shape and dtype) for every i in one
        collective, leaving the inputs alone, asynchronously (the ``Work`` completes it).

        The functional ``all_reduce_coalesced`` would otherwise clone every input and reduce
        the clones in place; here the algorithm reads each input into the shared slots and
        reduces straight into its output. Ranks may mix this and ``allreduce_coalesced``: the
        header is the same. Outputs must not overlap any input.

        Raises (through the Work, on every rank): the errors of ``allreduce_coalesced`` for
        ``inputs``; lists of different lengths, or an output of another shape or dtype than
        its input, are a ``ValueError`` here.
        """
        if len(inputs) != len(outputs):
            raise ValueError(f"fcoll all_reduce_coalesced: rank {self._rank}: {len(outputs)} "
                             f"outputs for {len(inputs)} inputs")
        for i, (x, y) in enumerate(zip(inputs, outputs)):
            if y.shape != x.shape or y.dtype != x.dtype:
                raise ValueError(f"fcoll all_reduce_coalesced: rank {self._rank}: outputs[{i}] "
                                 f"{tuple(y.shape)} {y.dtype} does not match inputs[{i}] "
                                 f"{tuple(x.shape)} {x.dtype}")
        return self._coalesced(inputs, outputs, op, None)

    def _coalesced(self, inputs, outputs, rop, opts) -> dist.Work:
        """``allreduce_coalesced`` (``outputs`` None: in place) and its out-of-place form.

        A bucket holds hundreds of tensors, so the per-tensor work on the calling thread is
        kept to one pass: dense contiguous CPU tensors outside autograd (the common case) are
        used as they are, without ``Staging``'s detach and device checks. The algorithm runs
        under ``no_grad``: autograd may wrap an output once the op has returned it, before
        the collective writes it."""
        op = reduce_op_name(rop)
        name = "all_reduce_coalesced"
        err = None
        on_cuda = False
        for i, x in enumerate(inputs):  # one pass; the usual tensor costs two attribute reads
            if type(x) is not torch.Tensor or not x.is_cpu:
                err = err or check_tensor(x, f"tensors[{i}]", outputs is None)
                on_cuda = on_cuda or getattr(x, "is_cuda", False)
        if outputs is not None:
            for i, y in enumerate(outputs):
                if type(y) is not torch.Tensor or not y.is_cpu:
                    err = err or check_tensor(y, f"outputs[{i}]", True)
                    on_cuda = on_cuda or getattr(y, "is_cuda", False)
        if err is not None:
            return self._submit(name, None, reduce_op=op, error=err)
        if on_cuda:
            named = [(f"tensors[{i}]", x) for i, x in enumerate(inputs)]
            if outputs is not None:
                named += [(f"outputs[{i}]", y) for i, y in enumerate(outputs)]
            err = self._device_error(named)
        st = CudaStaging(self._cuda) if on_cuda and err is None else Staging()
        groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        sig = []
        for i, x in enumerate(inputs):
            dt = x.dtype
            sig.append((header_dtype(dtype_name(dt), x), tuple(x.shape)))
            if err is not None:
                continue  # the whole signature still goes into the header
            o = x if outputs is None else outputs[i]
            is_plain = plain(o)
            err = check_reduce_op(op, dt)
            if err is not None:
                err = f"tensors[{i}]: {err}"
            elif not is_plain:
                err = (check_tensor(o, f"tensors[{i}]" if outputs is None else f"outputs[{i}]",
                                    True) or check_tensor(x, f"tensors[{i}]"))
            if err is not None:
                continue
            srcs, dsts = groups.get(dt) or groups.setdefault(dt, ([], []))
            if outputs is None:
                srcs.append(_flat(x) if is_plain else st.inout(x).view(-1))
            else:
                srcs.append(_flat(x) if plain(x) else st.input(x).view(-1))
                dsts.append(_flat(o) if is_plain else st.output(o).view(-1))
        sig = tuple(sig)
        if err:
            return self._submit(name, None, reduce_op=op, extra=sig, error=err)
        if on_cuda and self._cuda_setup(name, None, reduce_op=op, extra=sig) == "ipc":
            return self._ipc_coalesced(inputs, outputs, op, sig, opts)

        def run(c: Call) -> None:
            with torch.no_grad():
                reductions.all_reduce_by_dtype(c, groups, outputs is None, op)

        return self._submit(name, None, reduce_op=op, extra=sig, run=run, st=st,
                            result=list(inputs if outputs is None else outputs),
                            opts=opts if opts is not None else dist.AllreduceCoalescedOptions())

    def _ipc_coalesced(self, inputs, outputs, op: str, sig: tuple, opts) -> dist.Work:
        """``_coalesced`` on the IPC path (validated; see :meth:`CudaGroup.all_reduce_coalesced`)."""
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
        err = _list_error("input_tensors", input_tensors, 1) or _list_error(
            "output_tensors", output_tensors, 1)
        if not err:
            err = (_list_error("output_tensors", output_tensors[0], n)
                   or check_tensor(input_tensors[0], "input_tensors[0]"))
        if err:
            inp = input_tensors[0] if err and _is_seq(input_tensors) and input_tensors else None
            return self._submit(name, inp, error=err)
        inp, outs = input_tensors[0], output_tensors[0]
        for i, o in enumerate(outs):
            arg = f"output_tensors[{i}]"
            err = (check_tensor(o, arg, True) or Staging.check_same_dtype(inp, o, arg)
                   or (None if o.numel() == inp.numel() else
                       f"{arg} has {o.numel()} elements, input_tensors[0] has {inp.numel()}")
                   or check_no_overlap(inp, o, o if i == self._rank else None)
                   or self._device_error([("input_tensors[0]", inp), (arg, o)]))
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
        err = _pairs_error("output_lists", output_lists, "input_list", input_list)
        if err:
            return self._submit("all_gather", None, error=err)
        works = [self.allgather([o], [i]) for o, i in zip(output_lists, input_list)]
        return works[-1] if works else self.barrier()

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        err = _pairs_error("outputs", outputs, "inputs", inputs)
        if err:
            return self._submit("all_gather_into_tensor", None, error=err)
        works = [self.all_gather_single(o, i) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self.barrier()

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # ---- reduce_scatter -----------------------------------------------------------------------
    def reduce_scatter_single(self, output, input, opts=None) -> dist.Work:  # noqa: A002
        if opts is not None and not opts.asyncOp and self._coalescing is None:
            work = self._fast.reduce_scatter(output, input, opts.reduceOp)
            if work is not None:
                return work
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        name = "reduce_scatter_tensor"
        op = reduce_op_name(opts.reduceOp)
        n = self._size
        err = (check_reduce_scatter(input, output, n) or check_reduce_op(op, input.dtype)
               or self._device_error([("input", input), ("output", output)]))
        if err:
            return self._submit(name, input, reduce_op=op, error=err)
        if input.is_cuda and self._cuda_setup(name, input, reduce_op=op) == "ipc":
            cg = self._cuda
            src = self._dense(input).view(-1)
            dst = self._dense_out(output)

            def body(c: Call, ipc: IpcBuffers) -> None:
                cg.reduce_scatter(c, ipc, src, dst.view(-1), op)
                self._write_back(output, dst)

            return self._submit_ipc(name, input, body, [input, output, src, dst], [output],
                                    opts, reduce_op=op)
        st = self._staging(input)
        src = st.input(input).view(n, -1)
        dst = st.output(output).view(-1)
        return self._submit(name, input, reduce_op=op,
                            run=lambda c: reductions.reduce_scatter(c, src, dst, op), st=st,
                            result=[output], opts=opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_lists, opts=None) -> dist.Work:
        """List form: ``output_tensors[0]`` receives the reduction over ranks of their
        ``input_lists[0][rank]``; every input is checked before anything moves."""
        n = self._size
        name = "reduce_scatter"
        op = reduce_op_name(opts.reduceOp) if opts is not None else "sum"
        err = _list_error("output_tensors", output_tensors, 1) or _list_error(
            "input_tensors", input_lists, 1)
        err = err or _list_error("input_tensors", input_lists[0], n) or check_tensor(
            output_tensors[0], "output_tensors[0]", True)
        err = err or inputs_like_error(input_lists[0], output_tensors[0])
        if err:
            return self._submit(name, None, reduce_op=op, error=err)
        stacked = torch.stack([i.detach().reshape(-1).cpu() for i in input_lists[0]])
        return self.reduce_scatter_single(output_tensors[0], stacked.view(-1), opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        err = _pairs_error("outputs", outputs, "inputs", inputs)
        if err:
            return self._submit("reduce_scatter_tensor", None, error=err)
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self.barrier()

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

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
        err = check_tensor(input, "input") or check_tensor(output, "output", True)
        in_s = out_s = []
        if not err:
            in_s, out_s, err = Staging.check_splits(
                input, output, list(input_split_sizes or []), list(output_split_sizes or []), n)
        err = err or Staging.check_same_dtype(input, output) or check_no_overlap(
            input, output) or self._device_error([("input", input), ("output", output)])
        if err:
            return self._submit(name, input, extra=None, error=err)
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
        err = _list_error("input_tensors", input_tensors, n) or _list_error(
            "output_tensors", output_tensors, n)
        if not err:
            named = [(f"input_tensors[{i}]", t, False) for i, t in enumerate(input_tensors)]
            named += [(f"output_tensors[{i}]", t, True) for i, t in enumerate(output_tensors)]
            err = check_tensors(named)
            dt = input_tensors[0].dtype if not err else None
            for arg, t, _ in named:
                if not err and t.dtype != dt:
                    err = (f"{arg} has dtype {str(t.dtype)[6:]} but input_tensors[0] has "
                           f"{str(dt)[6:]}; one dtype for every tensor")
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
        err = None
        if len(tensors) != 1:
            err = f"tensors: expects 1 tensor, got {len(tensors)}"
        elif not 0 <= root < self._size:
            err = f"root (src) {root} is out of range for a group of size {self._size}"
        else:
            err = check_tensor(tensors[0], "tensor", True)
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

    # ---- point-to-point (fcoll.shm.p2p: one inbox per rank, made at its first send/recv) ---
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
                                        self._timeout_s, self._engine.ch.describe, owner=self)
        return p2p

    # ---- rooted gather / scatter (via all_gather / broadcast) ------------------------------
    def gather(self, output_lists, input_tensors, opts=None) -> dist.Work:
        """``output_lists[0][p]`` on the root receives rank p's ``input_tensors[0]`` (an
        all_gather: every rank gets them; non-root ranks may pass no outputs)."""
        root = opts.rootRank if opts is not None else 0
        n = self._size
        name = "gather"
        err = _list_error("input_tensors", input_tensors, 1)
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
        err = _list_error("output_tensors", output_tensors, 1)
        err = err or check_tensor(output_tensors[0], "output_tensors[0]", True)
        if not err and not 0 <= root < n:
            err = f"root (src) {root} is out of range for a group of size {n}"
        if not err and self._rank == root:
            out = output_tensors[0]
            err = _list_error("input_tensors", input_lists, 1) or _list_error(
                "input_tensors", input_lists[0], n)
            for i, x in enumerate(input_lists[0] if not err else ()):
                arg = f"input_tensors[{i}]"
                err = (check_tensor(x, arg) or Staging.check_same_dtype(x, out)
                       or (None if x.shape == out.shape else
                           f"{arg} has shape {list(x.shape)}, output_tensors[0] has "
                           f"{list(out.shape)}"))
                if err:
                    break
        if err:
            return self._submit(name, None, root=root, error=err)
        out = output_tensors[0]
        if self._rank == root:
            stacked = torch.stack([t.detach().cpu() for t in input_lists[0]])
        else:
            stacked = torch.empty((n, *out.shape), dtype=out.dtype)
        return self._broadcast([stacked], root, name="scatter",
                               post=lambda: out.copy_(stacked[self._rank]), result=[out])


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.view(-1)


def _offsets(splits: list[int], row_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` in bytes of each rank's rows, for rows of ``row_bytes``."""
    out, off = [], 0
    for s in splits:
        out.append((off * row_bytes, s * row_bytes))
        off += s
    return out
