"""``FcollProcessGroup``: the shared-memory backend as a pure-Python ``dist.ProcessGroup``.

Each method mirrors what ``torch.distributed.distributed_c10d`` (and C++ callers such as DDP's
reducer, through the ``PyProcessGroup`` trampoline) call on a process group. A method validates
its arguments on the calling thread, stages inputs (CUDA -> host, non-contiguous -> contiguous),
queues a :class:`~fcoll.shm.engine.Job`, and returns a ``Work`` made from the job's
future. Invalid arguments still queue a header-only job flagged invalid, so every peer raises the
same message instead of hanging; the calling rank raises ``ValueError`` at once.

Shapes per rank (n = group size): all_reduce ``[*] -> [*]``; all_gather ``[*] -> [n * N, ...]``;
reduce_scatter ``[n * N, ...] -> [N, ...]``; all_to_all_single ``[sum(in_splits), ...] ->
[sum(out_splits), ...]``; broadcast / reduce in place.
"""

from __future__ import annotations

import datetime
import logging
import marshal
import math
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from fcoll.shm import algorithms as alg
from fcoll.shm import headers as hdr
from fcoll.shm.engine import DoneWork, Engine, FcollWork, Job
from fcoll.shm.segment import open_segment
from fcoll.shm.sync import Channel, PeerError
from fcoll.ops.reduce import check_reduce_op, reduce_op_name
from fcoll.shm.validate import Staging

log = logging.getLogger("fcoll.shm.engine")
SLOT_BYTES = 1 << 20
SMALL_ALLREDUCE_BYTES = 64 << 10  # at 3+ ranks, one-phase all_reduce up to this size
# At 2 ranks, reduce_scatter pieces and all_to_all rows of at least this many bytes skip
# the slot for this rank's own part (half the copy-in); below it the extra tensor views
# (1.5-2 us each on the 2-core machine) cost more than the copy they save (measured: even at
# 128 KiB pieces the split is 2 us slower, at 512 KiB 20 us faster).
SPLIT_BYTES = 256 << 10


def slot_bytes_for(world: int) -> int:
    """Bytes of one data slot (per rank, two slots each): 1 MiB.

    Measured at 2 ranks on the 2-core machine (128 MiB all_reduce, same CPU time of about 43 ms
    per rank): 49 ms with 1 MiB slots against 86 ms with 2 or 8 MiB slots, because a peer's next
    chunk arrives within the bounded spin, so no rank sleeps, and the slots stay in cache;
    256-512 KiB slots add too many synchronisations. ``FCOLL_SHM_SLOT_BYTES`` overrides it (tests use small slots to
    exercise chunking).
    """
    if os.environ.get("FCOLL_SHM_SLOT_BYTES"):
        return max(4096, int(os.environ["FCOLL_SHM_SLOT_BYTES"]) // 4096 * 4096)
    return SLOT_BYTES


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
        self._seq = 0
        self._timeout_s = timeout.total_seconds()
        seg = open_segment(store, rank, size, slot_bytes or slot_bytes_for(size), timeout)
        ch = Channel(seg, rank, size, self._timeout_s, self._global_ranks)
        self._engine = Engine(seg, ch, f"g{self._global_ranks[0]}x{size}r{rank}")
        self._coalescing: list[Any] | None = None
        self._plans: dict = {}

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
        self._plans.clear()  # the fast paths' views of the mapping, so close() can unmap it
        self._engine.close()

    def abort(self) -> None:
        self._plans.clear()
        self._engine.close(timeout_s=0.5)

    def _desc_rank(self) -> str:
        g = self._global_ranks[self._rank]
        return f"rank {self._rank}" if g == self._rank else f"rank {self._rank} (global rank {g})"

    # ---- submission -----------------------------------------------------------------------
    def _submit(self, name: str, shape_of: torch.Tensor | None, *, reduce_op: str = "",
                root: int = -1, extra: Any = None, error: str | None = None,
                run: Callable[[alg.Call], None] | None = None, st: Staging | None = None,
                result: Any = None, post: Callable[[], None] | None = None,
                opts: Any = None) -> dist.Work:
        seq = self._seq
        self._seq += 1
        if error is not None:
            error = f"fcoll {name}: {self._desc_rank()}: {error}"
        dtype = str(shape_of.dtype)[6:] if shape_of is not None else ""
        shape = tuple(shape_of.shape) if shape_of is not None else ()
        payload = hdr.encode(seq, name, dtype, shape, reduce_op, root, extra, error)
        if error is not None:
            self._engine.submit(Job(name, seq, payload, alg.barrier, None, None))
            raise ValueError(error)
        finish = st.finish if st is not None and st.needed() else None
        if post is not None:
            finish = post if finish is None else (lambda f=finish: (f(), post()))
        # A synchronous call (asyncOp False: c10d waits right away) runs on the caller's thread
        # in wait(); waking the worker would only make the two threads fight over the GIL.
        wake = (getattr(opts, "asyncOp", True) if opts is not None else True) or (
            self._coalescing is not None)
        job = Job(name, seq, payload, run, finish, result)
        if not wake and self._engine.run_inline(job):
            return FcollWork(self._engine, [job], name)
        self._engine.submit(job, wake=wake)
        if self._coalescing is not None:
            self._coalescing.append(job)
        return FcollWork(self._engine, [job], name)

    # ---- all_reduce / reduce ----------------------------------------------------------------
    def allreduce(self, tensors, opts=None) -> dist.Work:
        if (opts is not None and not opts.asyncOp and len(tensors) == 1
                and self._coalescing is None):
            work = self._allreduce_fast(tensors[0], opts.reduceOp)
            if work is not None:
                return work
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._allreduce("all_reduce", tensors, reduce_op_name(opts.reduceOp), opts=opts)

    def _allreduce_fast(self, t, rop) -> dist.Work | None:
        """A synchronous all_reduce of a contiguous CPU tensor that fits one slot, run right here
        when nothing else is queued (see :func:`alg.all_reduce_small`); None: take the general
        path. Failures are handled as :meth:`Engine._execute` handles them.

        Plans are keyed by the ``ReduceOp`` itself: its hash and equality are by value and
        cost about a third of reading ``rop.op`` and hashing the enum."""
        key = (t.dtype, t.shape, rop)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._remember(key, self._ar_plan(t, rop) if _plain(t) else None)
        if not plan or not (t.layout is _STRIDED and t.is_cpu and t.is_contiguous()
                            and not t.requires_grad):
            return None
        return self._run_fast(plan, alg.all_reduce_small, (t,), [t])

    def _remember(self, key, plan):
        if len(self._plans) > 256:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _run_fast(self, plan, fn, args, result) -> dist.Work | None:
        """Run the one-slot fast path ``fn(ch, plan, *args, payload, what, start)`` here on the
        caller's thread if the executor is idle; errors as in :meth:`Engine._execute`.

        The executor is claimed and released inline (what ``Engine.begin_inline`` and
        ``end_inline`` do), to keep a few method calls off every small collective."""
        eng = self._engine
        lock = eng._lock
        with lock:
            if eng._running or eng._pending or eng._closed or eng.broken is not None:
                return None
            eng._running = True
        ch = eng.ch
        ch.spin_iters = ch.spin_sync
        seq = self._seq
        self._seq = seq + 1
        error = None
        try:
            fn(ch, plan, *args, marshal.dumps((seq,) + plan.tail),
               f"{plan.name} (collective #{seq})", time.monotonic())
        except hdr.CollectiveMismatchError as e:  # raised by every rank at the same phase
            error = e
        except BaseException as e:  # noqa: BLE001  carried to wait(), group unusable
            if not isinstance(e, PeerError):
                log.exception("fcoll %s failed", plan.name)
            eng.broken = error = e
        finally:
            with lock:
                eng._running = False
                more = bool(eng._pending)
            if more:
                eng.kick()  # queued meanwhile by another thread: the worker runs it
        if error is not None:
            return DoneWork(result, error)
        work = plan.work
        # Reuse the plan's last Work when nothing but the plan refers to it any more (c10d
        # drops a synchronous call's Work after wait()): making one costs about 1 us.
        if work is not None and sys.getrefcount(work) == 3:  # plan.work, ``work``, the argument
            work.reset(result)
            return work
        work = plan.work = DoneWork(result, None)
        return work

    def _fits(self, t) -> bool:
        return 0 < t.numel() * t.element_size() <= self._engine.seg.layout.slot_bytes

    def _ag_fast(self, output, input):  # noqa: A002
        if not (_plain(input) and _plain(output)):
            return None
        key = ("ag", input.dtype, input.shape, output.dtype, output.shape)
        plan = self._plans.get(key)
        if plan is None:
            plan = False
            n, numel = self._size, input.numel()
            if (input.dtype == output.dtype and output.numel() == n * numel
                    and self._fits(input)):
                seg = self._engine.seg
                r = self._rank
                views = []
                for slot in range(3):  # the packed layout of alg.all_gather
                    flat = seg.data[slot].view(-1).view(input.dtype)
                    views.append((flat[r * numel:(r + 1) * numel].view(input.shape),
                                  flat[:n * numel].view(output.shape)))
                plan = alg.OneSlotPlan(self._engine.ch, "all_gather_into_tensor",
                                       ("all_gather_into_tensor", str(input.dtype)[6:],
                                        tuple(input.shape), "", -1, None, None), views)
            self._remember(key, plan)
        if plan is False:
            return None
        return self._run_fast(plan, alg.all_gather_small, (input, output), [output])

    def _rs_fast(self, output, input, rop):  # noqa: A002
        if not (_plain(input) and _plain(output)):
            return None
        key = ("rs", input.dtype, input.shape, output.dtype, output.shape, rop)
        plan = self._plans.get(key)
        if plan is None:
            plan = False
            n, M = self._size, output.numel()
            op = reduce_op_name(rop)
            if (not check_reduce_op(op, input.dtype) and input.dtype == output.dtype
                    and input.numel() == n * M and self._fits(input)
                    and (input.dim() == 0 or input.shape[0] % n == 0
                         or output.dim() != input.dim())):
                seg = self._engine.seg
                r = self._rank
                split = n == 2 and M * input.element_size() >= SPLIT_BYTES
                views = []
                for slot in range(3):
                    rows = seg.rows(slot, input.dtype)
                    pieces = rows[:, r * M:(r + 1) * M].view(n, *output.shape)
                    mine = rows[r, :n * M]
                    views.append((mine.view(input.shape), pieces, list(pieces.unbind(0)),
                                  mine.view(n, *output.shape)[1 - r] if split else None))
                plan = alg.OneSlotPlan(self._engine.ch, "reduce_scatter_tensor",
                                       ("reduce_scatter_tensor", str(input.dtype)[6:],
                                        tuple(input.shape), op, -1, None, None), views, op=op,
                                       extra=(n, *output.shape) if split else None)
            self._remember(key, plan)
        if plan is False:
            return None
        return self._run_fast(plan, alg.reduce_scatter_small, (input, output), [output])

    def _a2a_fast(self, output, input, out_splits, in_splits):  # noqa: A002
        if not (_plain(input) and _plain(output)) or input.dim() == 0:
            return None
        n = self._size
        rows = input.shape[0]
        k = rows // n
        if in_splits and any(x != k for x in in_splits):
            return None
        if out_splits and any(x != k for x in out_splits):
            return None
        key = ("a2a", input.dtype, input.shape, output.dtype, output.shape,
               len(in_splits or ()), len(out_splits or ()))
        plan = self._plans.get(key)
        if plan is None:
            plan = False
            seg = self._engine.seg
            e = input.element_size()
            sub = (seg.layout.slot_bytes // n) // 64 * 64
            m = input.numel() // n
            if (input.dtype == output.dtype and rows % n == 0 and input.shape == output.shape
                    and 0 < m * e <= sub and len(in_splits or [0] * n) == n
                    and len(out_splits or [0] * n) == n):
                r = self._rank
                views = []
                for slot in range(3):
                    rws = seg.rows(slot, input.dtype)
                    se = sub // e
                    send = rws[r, :n * se].view(n, se)[:, :m]
                    views.append((send, rws[:, r * se:r * se + m]))
                row = input[0].numel() * e
                plan = alg.OneSlotPlan(self._engine.ch, "all_to_all_single",
                                       ("all_to_all_single", str(input.dtype)[6:],
                                        tuple(input.shape), "", -1, ([k] * n, [k] * n), None),
                                       views, extra=(row, sub),
                                       op="split" if n == 2 and m * e >= SPLIT_BYTES else "")
            self._remember(key, plan)
        if plan is False:
            return None
        n2 = (n, input.numel() // n)
        return self._run_fast(plan, alg.all_to_all_small, (input.view(n2), output.view(n2)),
                              [output])

    def _bc_fast(self, t, root):
        if not _plain(t):
            return None
        key = ("bc", t.dtype, t.shape, root)
        plan = self._plans.get(key)
        if plan is None:
            plan = False
            if 0 <= root < self._size and self._fits(t):
                seg = self._engine.seg
                views = [seg.rows(slot, t.dtype).view(-1)[:t.numel()].view(t.shape)
                         for slot in range(3)]
                plan = alg.OneSlotPlan(self._engine.ch, "broadcast",
                                       ("broadcast", str(t.dtype)[6:], tuple(t.shape), "", root,
                                        None, None), views)
            self._remember(key, plan)
        if plan is False:
            return None
        return self._run_fast(plan, alg.broadcast_small, (t, root), [t])

    def _ar_plan(self, t, rop):
        op = reduce_op_name(rop)
        if (check_reduce_op(op, t.dtype) or t.numel() == 0
                or t.numel() * t.element_size() > self._engine.seg.layout.slot_bytes):
            return False
        return alg.SmallAllReducePlan(self._engine.ch, t.dtype, tuple(t.shape), op)

    def _allreduce(self, name: str, tensors, op: str, root: int | None = None,
                   opts=None) -> dist.Work:
        if len(tensors) != 1:
            return self._submit(name, None, error=f"expects 1 tensor, got {len(tensors)}")
        t = tensors[0]
        err = check_reduce_op(op, t.dtype) or Staging.check_output(t, "tensor")
        if root is not None and not 0 <= root < self._size:
            err = err or f"root {root} is out of range for a group of size {self._size}"
        if err:
            return self._submit(name, t, reduce_op=op, root=-2 if root is None else root,
                                error=err)
        st = Staging()
        flat = st.inout(t).view(-1)
        writes = root is None or root == self._rank

        def run(c: alg.Call) -> None:
            alg.all_reduce(c, flat, flat if writes else None, op, SMALL_ALLREDUCE_BYTES)

        return self._submit(name, t, reduce_op=op, root=-1 if root is None else root, run=run,
                            st=st, result=[t], opts=opts)

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
        err = check_reduce_op(red, input.dtype) or Staging.check_output(output, "output")
        if err:
            return self._submit(name, input, reduce_op=red, root=-1, error=err)
        st = Staging()
        src, dst = st.input(input).view(-1), st.output(output).view(-1)

        def run(c: alg.Call) -> None:
            alg.all_reduce(c, src, dst, red, SMALL_ALLREDUCE_BYTES)

        return self._submit(name, input, reduce_op=red, root=-1, run=run, st=st,
                            result=[output], opts=dist.AllreduceOptions())

    def reduce(self, tensors, opts=None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._allreduce("reduce", tensors, reduce_op_name(opts.reduceOp), opts.rootRank,
                               opts=opts)

    def allreduce_coalesced(self, tensors, opts=None) -> dist.Work:
        """All-reduce every tensor of ``tensors`` in place (any shapes, dtypes mixed): one
        collective, in which the tensors of each dtype (in order of first appearance) are
        reduced as if concatenated, through :func:`alg.all_reduce_many` (no concatenated copy).

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
        st = Staging()
        groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        sig = []
        err = None
        for i, x in enumerate(inputs):
            dt = x.dtype
            sig.append((_dtype_name(dt), tuple(x.shape)))
            if err is not None:
                continue  # the whole signature still goes into the header
            o = x if outputs is None else outputs[i]
            plain = _plain(o)
            err = check_reduce_op(op, dt) or (
                None if plain else Staging.check_output(o, f"tensors[{i}]"))
            if err is not None:
                continue
            srcs, dsts = groups.get(dt) or groups.setdefault(dt, ([], []))
            if outputs is None:
                srcs.append(_flat(x) if plain else st.inout(x).view(-1))
            else:
                srcs.append(_flat(x) if _plain(x) else st.input(x).view(-1))
                dsts.append(_flat(o) if plain else st.output(o).view(-1))
        sig = tuple(sig)
        if err:
            return self._submit(name, None, reduce_op=op, extra=sig, error=err)

        def run(c: alg.Call) -> None:
            first = True
            with torch.no_grad():
                for dt, (srcs, dsts) in groups.items():
                    if not first:
                        c.payload = hdr.encode(-1, name, str(dt),
                                               (sum(x.numel() for x in srcs),), op, -1, None)
                    alg.all_reduce_many(c, srcs, srcs if outputs is None else dsts, op,
                                        SMALL_ALLREDUCE_BYTES)
                    first = False

        return self._submit(name, None, reduce_op=op, extra=sig, run=run, st=st,
                            result=list(inputs if outputs is None else outputs),
                            opts=opts if opts is not None else dist.AllreduceCoalescedOptions())

    # ---- all_gather ---------------------------------------------------------------------------
    def all_gather_single(self, output, input, opts=None) -> dist.Work:  # noqa: A002
        if opts is not None and not opts.asyncOp and self._coalescing is None:
            work = self._ag_fast(output, input)
            if work is not None:
                return work
        name = "all_gather_into_tensor"
        n = self._size
        err = (Staging.check_output(output, "output_tensor")
               or Staging.check_same_dtype(input, output))
        if not err and output.numel() != n * input.numel():
            err = (f"output_tensor has {output.numel()} elements but the group size {n} times "
                   f"input_tensor's {input.numel()} is {n * input.numel()}")
        if err:
            return self._submit(name, input, error=err)
        st = Staging()
        src = st.input(input).view(-1).view(torch.uint8)
        dst = st.output(output).view(-1).view(torch.uint8).view(n, -1)
        return self._submit(name, input, run=lambda c: alg.all_gather(c, src, dst), st=st,
                            result=[output], opts=opts)

    _allgather_base = all_gather_single

    def allgather(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        """List form: ``output_tensors[0][p]`` receives rank p's ``input_tensors[0]``."""
        name = "all_gather"
        n = self._size
        if len(input_tensors) != 1 or len(output_tensors) != 1 or len(output_tensors[0]) != n:
            return self._submit(name, None, error=f"expects one input tensor and a list of {n} "
                                                  "output tensors")
        inp, outs = input_tensors[0], output_tensors[0]
        err = next((Staging.check_output(o, f"output_tensors[{i}]")
                    or Staging.check_same_dtype(inp, o) for i, o in enumerate(outs)), None)
        bad = [i for i, o in enumerate(outs) if o.numel() != inp.numel()]
        if not err and bad:
            err = f"output_tensors[{bad[0]}] has {outs[bad[0]].numel()} elements, input has " \
                  f"{inp.numel()}"
        if err:
            return self._submit(name, inp, error=err)
        st = Staging()
        src = st.input(inp).view(-1).view(torch.uint8)
        dst = torch.empty((n, src.numel()), dtype=torch.uint8)

        def run(c: alg.Call) -> None:
            alg.all_gather(c, src, dst)
            for p, o in enumerate(outs):
                st.scatter_into(o, dst[p])

        return self._submit(name, inp, run=run, st=st, result=[list(outs)], opts=opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None) -> dist.Work:
        works = [self.allgather([o], [i]) for o, i in zip(output_lists, input_list)]
        return works[-1]

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        works = [self.all_gather_single(o, i) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self.barrier()

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # ---- reduce_scatter -----------------------------------------------------------------------
    def reduce_scatter_single(self, output, input, opts=None) -> dist.Work:  # noqa: A002
        if opts is not None and not opts.asyncOp and self._coalescing is None:
            work = self._rs_fast(output, input, opts.reduceOp)
            if work is not None:
                return work
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        name = "reduce_scatter_tensor"
        op = reduce_op_name(opts.reduceOp)
        n = self._size
        err = (check_reduce_op(op, input.dtype) or Staging.check_output(output, "output")
               or Staging.check_same_dtype(input, output))
        if not err and input.dim() > 0 and input.shape[0] % n and output.dim() == input.dim():
            err = f"input's first dimension {input.shape[0]} is not divisible by the group size {n}"
        if not err and input.numel() != n * output.numel():
            err = (f"output has {output.numel()} elements but input's {input.numel()} elements "
                   f"divided by the group size {n} is {input.numel() / n:g}")
        if err:
            return self._submit(name, input, reduce_op=op, error=err)
        st = Staging()
        src = st.input(input).view(n, -1)
        dst = st.output(output).view(-1)
        return self._submit(name, input, reduce_op=op,
                            run=lambda c: alg.reduce_scatter(c, src, dst, op), st=st,
                            result=[output], opts=opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_lists, opts=None) -> dist.Work:
        n = self._size
        if len(output_tensors) != 1 or len(input_lists) != 1 or len(input_lists[0]) != n:
            return self._submit("reduce_scatter", None,
                                error=f"expects one output tensor and a list of {n} inputs")
        ins = input_lists[0]
        if any(i.numel() != output_tensors[0].numel() or i.dtype != output_tensors[0].dtype
               for i in ins):
            return self._submit("reduce_scatter", output_tensors[0],
                                error="every input must match the output's size and dtype")
        stacked = torch.stack([i.detach().reshape(-1).cpu() for i in ins])
        return self.reduce_scatter_single(output_tensors[0], stacked.view(-1), opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self.barrier()

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- all_to_all ---------------------------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,  # noqa: A002
                          opts=None, _post=None, _result=None) -> dist.Work:
        if (opts is not None and not opts.asyncOp and self._coalescing is None
                and _post is None):
            work = self._a2a_fast(output, input, output_split_sizes, input_split_sizes)
            if work is not None:
                return work
        name = "all_to_all_single"
        n = self._size
        in_s, out_s, err = Staging.check_splits(input, output, list(input_split_sizes or []),
                                                list(output_split_sizes or []), n)
        err = err or Staging.check_output(output, "output") or Staging.check_same_dtype(
            input, output)
        if err:
            return self._submit(name, input, extra=None, error=err)
        row = math.prod(input.shape[1:]) * input.element_size()  # also with 0 rows
        st = Staging()
        src = st.input(input).view(-1).view(torch.uint8)
        dst = st.output(output).view(-1).view(torch.uint8)
        send = _offsets(in_s, row)
        recv = _offsets(out_s, row)
        return self._submit(name, input, extra=(in_s, out_s),
                            run=lambda c: alg.all_to_all(c, src, dst, send, recv, row), st=st,
                            result=_result or [output], post=_post, opts=opts)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        """List form, via ``all_to_all_single`` on flattened, concatenated tensors."""
        n = self._size
        if len(output_tensors) != n or len(input_tensors) != n:
            return self._submit("all_to_all", None, error=f"expects {n} inputs and {n} outputs")
        dt = input_tensors[0].dtype
        src = torch.cat([t.detach().reshape(-1).cpu().to(dt) for t in input_tensors])
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
            work = self._bc_fast(tensors[0], opts.rootRank)
            if work is not None:
                return work
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._broadcast(tensors, opts.rootRank, opts=opts)

    def _broadcast(self, tensors, root: int, name: str = "broadcast", post=None,
                   result=None, opts=None) -> dist.Work:
        err = None
        if len(tensors) != 1:
            err = f"expects 1 tensor, got {len(tensors)}"
        elif not 0 <= root < self._size:
            err = f"src {root} is out of range for a group of size {self._size}"
        else:
            err = Staging.check_output(tensors[0], "tensor")
        t = tensors[0] if tensors else None
        if err:
            return self._submit(name, t, root=root, error=err)
        st = Staging()
        buf = st.inout(t, read=root == self._rank).view(-1).view(torch.uint8)
        return self._submit(name, t, root=root, run=lambda c: alg.broadcast(c, buf, root),
                            st=st, result=result or [t], post=post, opts=opts)

    def barrier(self, opts=None) -> dist.Work:
        return self._submit("barrier", None, run=alg.barrier, opts=opts)

    def _start_coalescing(self, device=None) -> None:
        self._coalescing = []

    def _end_coalescing(self, device=None) -> dist.Work:
        jobs, self._coalescing = self._coalescing or [], None
        self._engine.kick()
        return FcollWork(self._engine, jobs, "coalesced")

    # ---- rooted gather / scatter (via all_gather / broadcast) ------------------------------
    def gather(self, output_lists, input_tensors, opts=None) -> dist.Work:
        root = opts.rootRank if opts is not None else 0
        n = self._size
        inp = input_tensors[0]
        outs = output_lists[0] if output_lists and output_lists[0] else [
            torch.empty_like(inp) for _ in range(n)]
        if not 0 <= root < n:
            return self._submit("gather", inp, root=root, error=f"dst {root} is out of range")
        return self.allgather([outs], [inp])

    def scatter(self, output_tensors, input_lists, opts=None) -> dist.Work:
        root = opts.rootRank if opts is not None else 0
        n = self._size
        out = output_tensors[0]
        if not 0 <= root < n:
            return self._submit("scatter", out, root=root, error=f"src {root} is out of range")
        if self._rank == root:
            stacked = torch.stack([t.detach().cpu() for t in input_lists[0]])
        else:
            stacked = torch.empty((n, *out.shape), dtype=out.dtype)
        return self._broadcast([stacked], root, name="scatter",
                               post=lambda: out.copy_(stacked[self._rank]), result=[out])

_STRIDED = torch.strided


def _plain(t) -> bool:
    """A dense, contiguous CPU tensor outside autograd: usable as is by the fast paths."""
    return (isinstance(t, torch.Tensor) and t.layout is _STRIDED and t.is_cpu
            and not t.requires_grad and t.is_contiguous())


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.view(-1)


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype: torch.dtype) -> str:
    """``str(dtype)`` ("torch.float32"), cached: a coalesced header lists hundreds."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _offsets(splits: list[int], row_bytes: int) -> list[tuple[int, int]]:
    out, off = [], 0
    for s in splits:
        out.append((off * row_bytes, s * row_bytes))
        off += s
    return out
