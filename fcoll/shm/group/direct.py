"""The direct path: compiled graphs issue collectives straight into a group's :class:`Engine`.

An eager ``torch.ops.fcoll.all_reduce`` goes op dispatcher -> the op's Python kernel -> group
lookup by name -> argument checks -> ``FcollProcessGroup.allreduce_out_of_place`` (behind
Dynamo's eager wrapper) -> staging, header encoding, a ``Job`` and a c10d ``Work`` -> the
in-flight registry (:mod:`fcoll.ops.pending`); its ``wait_tensor`` looks the ``Work`` up again.
A compiled graph knows all of that when it is compiled: the group, the dtype, the shape and
the reduce op of each call site are constants of the graph. :class:`DirectAllReduce` checks them
once, when the executor is built, and keeps what each call needs: the engine, the encoded
header without its sequence number, the one-slot plan (views of the shared slots). A call then
allocates the output, takes a sequence number and either

- runs at once on the caller's thread through the one-slot kernel
  (:meth:`Engine.run_now`) when the executor says its wait comes right after it
  (``sync=True``: nothing could overlap it), the tensor fits one slot and nothing is queued; or
- queues a :class:`Job` running :func:`fcoll.shm.kernels.reductions.all_reduce` on the group's
  worker (as the c10d path does for an async call) and keeps it for :meth:`DirectAllReduce.wait`.

Both produce the same headers, slot layout and phases as the process group's own paths, so a
peer on the c10d path interoperates (and compares headers with this one), and the result is the
same, bit for bit (the same reduction kernels). Failures are the engine's: a cross-rank
mismatch (:class:`~fcoll.shm.transport.headers.CollectiveMismatchError`) raised on every rank with
the group still usable, a dead peer or a timeout (:class:`~fcoll.shm.transport.fences.PeerError`)
after which the group is broken, each raised by the call (sync) or its wait (async).

Call-site tag: the header's ``extra`` carries ``tag`` (``"site <digest>#<index>"``: the digest
of the graph's collective sequence on the group and the call's index in it), so two ranks that
run different call sites at the same sequence number (one rank skipped a call of the same shape,
or runs another graph) fail the header check on every rank instead of reducing unrelated data.
A peer that issues the same collective eagerly (no tag) fails it too.

Only what is checked once is skipped per call: a call whose input is not the checked dtype and
shape raises ``ValueError`` (graphs with static shapes guarantee it; symbolic shapes keep the
c10d path). Non-contiguous inputs are fine (copied into the slot or made contiguous).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.autograd.profiler as _profiler

from fcoll.ops.reduce import DIST_REDUCE_OPS, backend_reduce_op, check_reduce_op, divide_for_avg
from fcoll.shm.kernels import movement, one_slot, reductions
from fcoll.shm.work import Job
from fcoll.shm.transport.headers import NO_ROOT, Header, dtype_name

__all__ = ["DirectAllReduce", "DirectAllGather", "DirectReduceScatter", "direct_group",
           "group_engines", "wire_reduce_op"]


def direct_group(pg: Any) -> Any | None:
    """``pg`` if the direct path can use it (fcoll's process group of 2 ranks or more, alive),
    else None (gloo, nccl, fake, a group of one rank: the c10d path serves them)."""
    from fcoll.shm.group.process_group import FcollProcessGroup

    if not isinstance(pg, FcollProcessGroup) or pg.size() < 2:
        return None
    return pg if pg.engine is not None else None


def abandon_groups(names: Any, e: BaseException, where: str) -> list[str]:
    """``e`` leaves ``where`` (a compiled step) on this rank: fence each of fcoll's groups
    named in ``names`` that the step's collectives use (:meth:`Engine.abandon`), so the peers
    raise at once naming this rank and ``e``'s type; returns the names of the groups fenced.
    Other backends' groups, and errors that every rank raised alike, are left alone."""
    return [name for name, eng in group_engines(names).items() if eng.abandon(e, where)]


def group_engines(names: Any) -> dict[str, Any]:
    """Group name -> :class:`~fcoll.shm.engine.Engine`, for each name in ``names`` that is
    fcoll's shared-memory group of 2 ranks or more (see :func:`direct_group`); other groups,
    and names no longer registered, are left out."""
    from fcoll.ops.groups import group_from_name

    engines = {}
    for name in names:
        try:
            pg = direct_group(group_from_name(name))
        except ValueError:  # destroyed meanwhile
            continue
        if pg is not None:
            engines[name] = pg.engine
    return engines


def wire_reduce_op(reduce_op: str, dtype: torch.dtype) -> tuple[str, bool]:
    """The reduce op fcoll's backend runs for the functional op's ``reduce_op`` on ``dtype``,
    and whether ``avg`` is finished by a division afterwards: the c10d path's mapping
    (:func:`fcoll.ops.reduce.backend_reduce_op`; fcoll's backend averages floating dtypes
    itself, integer ``avg`` is a ``sum`` divided, truncating, afterwards).
    """
    return backend_reduce_op(reduce_op, dtype, dtype.is_floating_point)


class _DirectCall:
    """What every prepared call keeps: the engine, its encoded header without the sequence
    number (``tail``), the in-flight job between the call and its wait, and whether it runs
    synchronously. Subclasses check their arguments once and define ``__call__``.

    Args:
        pg: the group (see :func:`direct_group`).
        op_name: the collective's header name (``"all_reduce"``, ...), as the process group's.
        dtype, shape: the input's, as the compiled graph has them (static ints).
        reduce_op: the functional op's reduce op, or ``""`` for data movement.
        tag: the call-site tag carried in the header's ``extra`` (a short str), or None.
        sync: the caller waits right after the call (nothing to overlap): run it at once.

    Raises:
        ValueError: ``pg`` is not usable by the direct path, ``shape`` is not static, or
            ``reduce_op`` is not defined for ``dtype`` (named, as the op would say).
    """

    __slots__ = ("engine", "name", "dtype", "shape", "op", "avg_div", "size", "tail", "sync",
                 "job")

    def __init__(self, pg: Any, op_name: str, dtype: torch.dtype, shape: tuple[int, ...],
                 reduce_op: str, tag: str | None, sync: bool) -> None:
        if direct_group(pg) is None:
            raise ValueError(f"fcoll direct {op_name}: {pg!r} is not an fcoll process group "
                             f"of 2 ranks or more")
        if not all(isinstance(d, int) for d in shape):
            raise ValueError(f"fcoll direct {op_name}: shape {shape} is not static")
        self.op, self.avg_div = "", False
        if reduce_op:
            why = (check_reduce_op(reduce_op, dtype) if reduce_op in DIST_REDUCE_OPS
                   else f"unknown reduce op {reduce_op!r}")
            if why:
                raise ValueError(f"fcoll direct {op_name}: reduce_op={reduce_op!r}, {dtype}: "
                                 f"{why}")
            self.op, self.avg_div = wire_reduce_op(reduce_op, dtype)
        self.name = op_name
        self.engine = pg.engine
        self.dtype, self.shape, self.size = dtype, tuple(shape), pg.size()
        self.tail = Header(0, op_name, dtype_name(dtype), self.shape, self.op, NO_ROOT,
                           tag).tail()
        self.sync = sync
        self.job: Job | None = None

    def _check(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        """``input`` as the data movement reads it (detached: the op's kernel runs below
        autograd, and copying a tensor that requires grad into the slots' views, made without
        grad, is an error in grad mode).

        Raises:
            ValueError: ``input`` is not the dtype/shape checked at compile time, or not CPU.
        """
        if input.dtype != self.dtype or input.shape != self.shape or not input.is_cpu:
            raise ValueError(f"fcoll {self.name} (compiled call): input {tuple(input.shape)} "
                             f"{input.dtype} on {input.device}, but the graph was compiled for "
                             f"{self.shape} {self.dtype} on cpu")
        return input.detach() if input.requires_grad else input

    def _issue(self, run: Any, out: torch.Tensor) -> torch.Tensor:
        """Queue ``run`` (an algorithm of :mod:`fcoll.shm.kernels.reductions` / ``movement`` bound
        to its tensors) as the group's next collective (:meth:`Engine.job`, the process group's
        way); sync: complete it here."""
        eng = self.engine
        job = eng.submit(eng.job(self.name, self.tail.encode, run), wake=not self.sync)
        self.job = job
        if self.sync:
            self.wait(out)
        return out

    def wait(self, out: torch.Tensor) -> torch.Tensor:
        """Block until the call that returned ``out`` is done; return ``out``.

        Runs the group's queue up to it on this thread if the worker has not started it
        (:meth:`Engine.wait`). Shown as ``fcoll::wait_tensor`` in ``torch.profiler``.

        Raises:
            The collective's error (mismatch, dead peer, timeout), on every rank.
        """
        job = self.job
        if job is None:  # done already (sync), or a second wait of the same output
            return out
        self.job = None
        if _profiler._is_profiler_enabled:
            with torch.profiler.record_function("fcoll::wait_tensor"):
                self.engine.wait(job)
        else:
            self.engine.wait(job)
        if self.avg_div:
            divide_for_avg(out, self.size)
        return out


class DirectAllReduce(_DirectCall):
    """One compiled call site of ``fcoll.all_reduce(input, reduce_op, group)``, prepared once.

    Shapes: ``input [*] -> output [*]`` (a fresh contiguous tensor), dtype ``dtype``, CPU.
    A synchronous call that fits one slot runs the one-slot kernel on the caller's thread
    (:meth:`Engine.run_now`: no ``Job``, no ``Work``). Arguments and errors:
    :class:`_DirectCall`.
    """

    #: the name FX's generated code gives the call (an executor graph calls the instance)
    __name__ = "fcoll_direct_all_reduce"
    __slots__ = ("plan",)

    def __init__(self, pg: Any, dtype: torch.dtype, shape: tuple[int, ...], reduce_op: str,
                 tag: str | None = None, sync: bool = False) -> None:
        super().__init__(pg, "all_reduce", dtype, shape, reduce_op, tag, sync)
        nbytes = dtype.itemsize * _numel(self.shape)
        self.plan = None
        if sync and 0 < nbytes <= self.engine.seg.layout.slot_bytes:
            self.plan = one_slot.AllReducePlan(self.engine.ch, dtype, self.shape, self.op)
            self.plan.use_tail(self.tail)  # the tagged header (same fields otherwise)

    def __call__(self, input: torch.Tensor, reduce_op: str = "", group_name: Any = None
                 ) -> torch.Tensor:  # noqa: A002
        """Start the all_reduce of ``input``; returns its output (ready after :meth:`wait`).

        The extra arguments are the graph node's (already checked once) and ignored.

        Raises:
            ValueError: ``input`` is not the dtype/shape checked at compile time, or not CPU.
            CollectiveMismatchError, PeerError, RuntimeError: a synchronous call's failure.
        """
        input = self._check(input)  # noqa: A001
        out = torch.empty(self.shape, dtype=self.dtype)
        plan = self.plan
        if plan is not None:
            done = self.engine.run_now(plan, one_slot.all_reduce_small_into, (input, out))
            if done is not False:
                if done is not True:
                    raise done
                if self.avg_div:
                    divide_for_avg(out, self.size)
                return out
        # async, larger than a slot, or the engine is busy: a job behind the earlier ones
        src = input if input.is_contiguous() else input.contiguous()
        flat_in, flat_out, op = src.view(-1), out.view(-1), self.op
        return self._issue(lambda c: reductions.all_reduce(c, flat_in, flat_out, op), out)


class DirectAllGather(_DirectCall):
    """One compiled call site of ``fcoll.all_gather_into_tensor(input, n, group)``.

    Shapes: ``input [N, *] -> output [n * N, *]`` (rank p's input at rows ``p*N..``), any
    dtype, CPU; the algorithm is :func:`fcoll.shm.kernels.movement.all_gather` (the process
    group's). Arguments and errors: :class:`_DirectCall` (``shape`` has at least one dim).
    """

    __name__ = "fcoll_direct_all_gather_into_tensor"
    __slots__ = ("out_shape",)

    def __init__(self, pg: Any, dtype: torch.dtype, shape: tuple[int, ...],
                 tag: str | None = None, sync: bool = False) -> None:
        super().__init__(pg, "all_gather_into_tensor", dtype, shape, "", tag, sync)
        if not self.shape:
            raise ValueError("fcoll direct all_gather_into_tensor: a 0-dim input")
        self.out_shape = (self.size * self.shape[0], *self.shape[1:])

    def __call__(self, input: torch.Tensor, group_size: int = 0, group_name: Any = None
                 ) -> torch.Tensor:  # noqa: A002
        """Start the all_gather of ``input``; returns its output (ready after :meth:`wait`)."""
        input = self._check(input)  # noqa: A001
        out = torch.empty(self.out_shape, dtype=self.dtype)
        src = (input if input.is_contiguous() else input.contiguous()).view(-1).view(torch.uint8)
        dst = out.view(-1).view(torch.uint8).view(self.size, src.numel())
        return self._issue(lambda c: movement.all_gather(c, src, dst), out)


class DirectReduceScatter(_DirectCall):
    """One compiled call site of ``fcoll.reduce_scatter_tensor(input, reduce_op, n, group)``.

    Shapes: ``input [n * N, *] -> output [N, *]`` (rank p gets rows ``p*N..`` reduced), dtype
    ``dtype``, CPU; the algorithm is :func:`fcoll.shm.kernels.reductions.reduce_scatter`. Arguments
    and errors: :class:`_DirectCall` (``shape[0]`` a multiple of the group size).
    """

    __name__ = "fcoll_direct_reduce_scatter_tensor"
    __slots__ = ("out_shape",)

    def __init__(self, pg: Any, dtype: torch.dtype, shape: tuple[int, ...], reduce_op: str,
                 tag: str | None = None, sync: bool = False) -> None:
        super().__init__(pg, "reduce_scatter_tensor", dtype, shape, reduce_op, tag, sync)
        if not self.shape or self.shape[0] % self.size:
            raise ValueError(f"fcoll direct reduce_scatter_tensor: input {self.shape} has no "
                             f"first dim divisible by the group size {self.size}")
        self.out_shape = (self.shape[0] // self.size, *self.shape[1:])

    def __call__(self, input: torch.Tensor, reduce_op: str = "", group_size: int = 0,
                 group_name: Any = None) -> torch.Tensor:  # noqa: A002
        """Start the reduce_scatter of ``input``; returns its output (ready after
        :meth:`wait`)."""
        input = self._check(input)  # noqa: A001
        out = torch.empty(self.out_shape, dtype=self.dtype)
        src = (input if input.is_contiguous() else input.contiguous()).view(self.size, -1)
        dst, op = out.view(-1), self.op
        return self._issue(lambda c: reductions.reduce_scatter(c, src, dst, op), out)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

