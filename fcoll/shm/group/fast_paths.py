"""Fast paths: synchronous small collectives run on the caller's thread through one slot.

When c10d calls a collective synchronously (``asyncOp`` False: it waits right away), nothing is
queued on the group, and the tensors are dense, contiguous CPU tensors outside autograd whose
data fits one slot, the collective runs right there as a one-phase kernel of
:mod:`fcoll.shm.kernels.one_slot` with views prepared once per (collective, dtype, shape, ...): no
``Job``, no ``Staging``, no thread hand-off. Anything else returns None and the process group
takes its general path, which computes the same result with the same slot layout (a rank on the
fast path and a peer on the general path interoperate).

The plans are cached per key; a key whose tensors do not qualify caches ``False`` so the check
is not repeated. all_reduce's key holds ``hash(rop)`` (the op's number, ~0.07 us) and its entry
the op kind, compared with ``rop == kind`` (~0.1 us): every c10d call brings a new ``ReduceOp``
object, and comparing two of them (pybind's overloaded ``__eq__``, as a key holding the
``ReduceOp`` made the dict do) cost ~0.6 us a call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fcoll.ops.reduce import check_dtype, check_reduce_op, reduce_op_name
from fcoll.shm.kernels import one_slot
from fcoll.shm.engine import Engine
from fcoll.shm.transport.headers import Header, dtype_name
from fcoll.shm.kernels.movement import subslot_bytes
from fcoll.shm.transport.segment import NSLOTS

MAX_PLANS = 256  # plans cached per group before the cache starts over
# At 2 ranks, reduce_scatter pieces and all_to_all rows of at least this many bytes skip
# the slot for this rank's own part (half the copy-in); below it the extra tensor views cost
# more than the copy they save.
SPLIT_BYTES = 256 << 10

_STRIDED = torch.strided


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous CPU tensors share bytes (the general path then checks, and
    refuses what a chunked algorithm would get wrong)."""
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + b.nbytes and pb < pa + a.nbytes


def plain(t) -> bool:
    """A dense, contiguous CPU tensor outside autograd: usable as is by the fast paths."""
    return (isinstance(t, torch.Tensor) and t.layout is _STRIDED and t.is_cpu
            and not t.requires_grad and t.is_contiguous())


class FastPaths:
    """The fast paths of one process group: plan caches and the five planners.

    Every method takes the arguments of the c10d call it serves and returns a completed
    ``Work`` (failures inside it, as the general path would report them), or None: not
    eligible now, take the general path. Shapes per rank (n = group size) are those of the
    process group's methods.

    Args:
        engine: the group's executor; its channel and segment are used for the views.
    """

    def __init__(self, engine: Engine):
        self._engine = engine
        self._ch = engine.ch
        self._rank = engine.ch.rank
        self._size = engine.ch.world
        self._slot_bytes = engine.seg.layout.slot_bytes
        self._plans: dict = {}

    def clear(self) -> None:
        """Drop every plan (they hold views of the mapping, which must go before unmapping)."""
        self._plans.clear()

    def _remember(self, key, plan):
        if len(self._plans) > MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _fits(self, t: torch.Tensor) -> bool:
        return 0 < t.numel() * t.element_size() <= self._slot_bytes

    def all_reduce(self, t: torch.Tensor, rop: dist.ReduceOp) -> dist.Work | None:
        """In-place all_reduce of ``t [*]`` (any dtype ``rop`` accepts)."""
        try:
            key = (t.dtype, t.shape, hash(rop))
        except AttributeError:  # not a tensor: the general path says so on every rank
            return None
        entry = self._plans.get(key)
        if entry is None or entry[1] is None:
            entry = self._remember(key, (getattr(rop, "op", rop), self._all_reduce_plan(t, rop)
                                         if plain(t) else None))
        kind, plan = entry
        # plain(t), written out: this is the hottest check of the backend; ``rop == kind``
        # fails only for another op of the same hash (never seen: then the general path)
        if not plan or not (t.layout is _STRIDED and t.is_cpu and t.is_contiguous()
                            and not t.requires_grad and rop == kind):
            return None
        return self._engine.run_fast(plan, one_slot.all_reduce_small, (t,), [t])

    def _all_reduce_plan(self, t: torch.Tensor, rop: dist.ReduceOp):
        op = reduce_op_name(rop)
        if check_reduce_op(op, t.dtype) or not self._fits(t):
            return False
        return one_slot.AllReducePlan(self._ch, t.dtype, tuple(t.shape), op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> dist.Work | None:  # noqa: A002
        """``input [*] -> output [n * N, ...]`` of one dtype."""
        if not (plain(input) and plain(output)):
            return None
        key = ("ag", input.dtype, input.shape, output.dtype, output.shape)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._remember(key, self._all_gather_plan(output, input))
        if plan is False:
            return None
        if _overlap(input, output) and (  # input as this rank's own part of output is fine
                input.data_ptr() != output.data_ptr() + self._rank * input.nbytes):
            return None
        return self._engine.run_fast(plan, one_slot.all_gather_small, (input, output), [output])

    def _all_gather_plan(self, output: torch.Tensor, input: torch.Tensor):  # noqa: A002
        n, numel = self._size, input.numel()
        if not (input.dtype == output.dtype and output.numel() == n * numel
                and self._fits(input)) or check_dtype(input.dtype):
            return False
        data, r = self._engine.seg.data, self._rank
        views = []
        for slot in range(NSLOTS):  # the packed layout of movement.all_gather
            flat = data[slot].view(-1).view(input.dtype)
            views.append((flat[r * numel:(r + 1) * numel].view(input.shape),
                          flat[:n * numel].view(output.shape)))
        header = Header(0, "all_gather_into_tensor", dtype_name(input.dtype), tuple(input.shape))
        return one_slot.OneSlotPlan(self._ch, header, views)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                       rop: dist.ReduceOp) -> dist.Work | None:
        """``input [n * N, ...] -> output [N, ...]`` of one dtype (any that ``rop`` accepts)."""
        if not (plain(input) and plain(output)):
            return None
        key = ("rs", input.dtype, input.shape, output.dtype, output.shape, rop)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._remember(key, self._reduce_scatter_plan(output, input, rop))
        if plan is False or _overlap(input, output):
            return None
        return self._engine.run_fast(plan, one_slot.reduce_scatter_small, (input, output),
                                     [output])

    def _reduce_scatter_plan(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                             rop: dist.ReduceOp):
        n, M = self._size, output.numel()
        op = reduce_op_name(rop)
        if not (not check_reduce_op(op, input.dtype) and input.dtype == output.dtype
                and input.numel() == n * M and self._fits(input)
                and (input.dim() == 0 or input.shape[0] % n == 0
                     or output.dim() != input.dim())):
            return False
        seg, r = self._engine.seg, self._rank
        split = n == 2 and M * input.element_size() >= SPLIT_BYTES
        views = []
        for slot in range(NSLOTS):
            rows = seg.rows(slot, input.dtype)
            pieces = rows[:, r * M:(r + 1) * M].view(n, *output.shape)
            mine = rows[r, :n * M]
            views.append((mine.view(input.shape), pieces, list(pieces.unbind(0)),
                          mine.view(n, *output.shape)[1 - r] if split else None))
        header = Header(0, "reduce_scatter_tensor", dtype_name(input.dtype), tuple(input.shape),
                        op)
        return one_slot.OneSlotPlan(self._ch, header, views, op=op, split=split,
                                    extra=(n, *output.shape) if split else None)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                   out_splits, in_splits) -> dist.Work | None:
        """``input [n * k, ...] -> output [n * k, ...]`` with even splits (given or empty)."""
        if not (plain(input) and plain(output)) or input.dim() == 0:
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
            plan = self._remember(key, self._all_to_all_plan(output, input, out_splits,
                                                             in_splits))
        if plan is False or _overlap(input, output):
            return None
        n2 = (n, input.numel() // n)
        return self._engine.run_fast(plan, one_slot.all_to_all_small,
                                     (input.view(n2), output.view(n2)), [output])

    def _all_to_all_plan(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                         out_splits, in_splits):
        n, r = self._size, self._rank
        rows = input.shape[0]
        k = rows // n
        e = input.element_size()
        sub = subslot_bytes(self._slot_bytes, n)
        m = input.numel() // n
        if not (input.dtype == output.dtype and rows % n == 0 and input.shape == output.shape
                and 0 < m * e <= sub and len(in_splits or [0] * n) == n
                and len(out_splits or [0] * n) == n) or check_dtype(input.dtype):
            return False
        seg = self._engine.seg
        se = sub // e
        views = []
        for slot in range(NSLOTS):  # the sub-slot layout of movement.all_to_all
            rws = seg.rows(slot, input.dtype)
            send = rws[r, :n * se].view(n, se)[:, :m]
            views.append((send, rws[:, r * se:r * se + m]))
        header = Header(0, "all_to_all_single", dtype_name(input.dtype), tuple(input.shape),
                        extra=([k] * n, [k] * n))
        return one_slot.OneSlotPlan(self._ch, header, views,
                                    split=n == 2 and m * e >= SPLIT_BYTES,
                                    extra=(input[0].numel() * e, sub))

    def broadcast(self, t: torch.Tensor, root: int) -> dist.Work | None:
        """In-place broadcast of ``t [*]`` from group rank ``root``."""
        if not plain(t):
            return None
        key = ("bc", t.dtype, t.shape, root)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._remember(key, self._broadcast_plan(t, root))
        if plan is False:
            return None
        return self._engine.run_fast(plan, one_slot.broadcast_small, (t, root), [t])

    def _broadcast_plan(self, t: torch.Tensor, root: int):
        if not (0 <= root < self._size and self._fits(t)) or check_dtype(t.dtype):
            return False
        seg = self._engine.seg
        views = [seg.rows(slot, t.dtype).view(-1)[:t.numel()].view(t.shape)
                 for slot in range(NSLOTS)]  # the bytes movement.broadcast uses
        header = Header(0, "broadcast", dtype_name(t.dtype), tuple(t.shape), root=root)
        return one_slot.OneSlotPlan(self._ch, header, views)
