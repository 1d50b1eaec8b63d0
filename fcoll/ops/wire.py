"""How a process group takes the data: fcoll's adaptation of each collective to its backend.

Which backend a group runs (``backend_name``), whether it averages natively, the dtype a tensor
travels in (gloo lacks int16 and bool reductions: ``wire_dtype``, ``wire_input``,
``wire_output``), the ``torch.distributed`` reduce op and any finisher for a reduce op string
(``reduce_args``), the c10d option objects, and the forms fcoll picks on gloo for speed
(``gathers_one_by_one``, ``start_reduce_scatter``). The eager kernels of
:mod:`fcoll.ops.library` start every collective through these helpers.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from fcoll.ops.reduce import (DIST_REDUCE_OPS, backend_reduce_op, divide_for_avg, logical_op,
                             reduce_rows, reduce_rows_into)

__all__ = ["backend_name", "native_avg", "wire_dtype", "wire_input", "wire_output", "reduce_args",
           "chain", "gathers_one_by_one", "allgather_options", "reduce_scatter_options",
           "reduces_scatter_by_all_to_all", "start_reduce_scatter"]


def backend_name(pg: dist.ProcessGroup) -> str:
    """The group's backend name (``"gloo"``, ``"nccl"``, ``"fcoll"``, ...), ``"unknown"`` when
    the group cannot say (a fake or a Python group without ``_get_backend_name``)."""
    try:
        return pg._get_backend_name()
    except (AttributeError, RuntimeError):
        return "unknown"


def native_avg(pg: dist.ProcessGroup, dtype: torch.dtype) -> bool:
    """Whether the backend averages ``dtype`` itself.

    gloo has no AVG, and backends define integer AVG differently (or not at all); there fcoll
    reduces with SUM and divides once the work is done (integers: truncating division, as C).
    """
    return backend_name(pg) not in ("gloo", "unknown") and dtype.is_floating_point


# gloo rejects int16 ("Invalid scalar type") and has no bool reductions: such tensors travel as
# the wider dtype and are cast back when the work is done (wrap-around matches int16 arithmetic).
_GLOO_WIRE_DTYPES = {torch.int16: torch.int32, torch.bool: torch.uint8}


def wire_dtype(pg: dist.ProcessGroup, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels in on ``pg`` (gloo: int16 as int32, bool as
    uint8; elsewhere ``dtype`` itself)."""
    if backend_name(pg) == "gloo":
        return _GLOO_WIRE_DTYPES.get(dtype, dtype)
    return dtype


def wire_input(pg: dist.ProcessGroup, t: torch.Tensor) -> torch.Tensor:
    """``t`` as the backend reads it: contiguous, in the wire dtype."""
    return t.contiguous().to(wire_dtype(pg, t.dtype))


def wire_output(pg: dist.ProcessGroup, t: torch.Tensor, *, initialised: bool):
    """A buffer the backend may write for ``t``, and a finisher that copies it back if needed.

    ``initialised``: the buffer must start with ``t``'s values (in-place reductions).
    """
    wire = wire_dtype(pg, t.dtype)
    if wire == t.dtype and t.is_contiguous():
        return t, None
    if initialised:
        buf = t.contiguous().to(wire)
    else:
        buf = torch.empty(t.shape, dtype=wire, device=t.device)

    def finish() -> None:
        t.copy_(buf)
    return buf, finish


def reduce_args(reduce_op: str, pg: dist.ProcessGroup, dtype: torch.dtype, buf: torch.Tensor):
    """Map a reduce op string to (dist op, finisher on ``buf``) for this group's backend, by
    :func:`fcoll.ops.reduce.backend_reduce_op` (bool reductions are logical; ``avg`` the
    backend lacks is a sum divided afterwards, the finisher)."""
    op, divide = backend_reduce_op(reduce_op, dtype, native_avg(pg, dtype))
    if divide:
        return DIST_REDUCE_OPS[op], functools.partial(divide_for_avg, buf, pg.size())
    return DIST_REDUCE_OPS[op], None


def chain(*finishers):
    """One finisher that runs the given ones (None skipped) in order; None if there are none."""
    fs = [f for f in finishers if f is not None]
    if not fs:
        return None

    def finish() -> None:
        for f in fs:
            f()
    return finish


def gathers_one_by_one(pg: dist.ProcessGroup) -> bool:
    """Whether a coalesced all_gather on ``pg`` gathers each tensor on its own: on gloo, whose
    ``allgather_into_tensor_coalesced`` copies its tensors through one flat buffer and was never
    faster than ``_allgather_base`` of the same tensor (``benchmarks/gloo_all_gather_forms.py``)."""
    return backend_name(pg) == "gloo"


def allgather_options():
    """c10d ``AllgatherOptions`` of an asynchronous call."""
    opts = torch._C._distributed_c10d.AllgatherOptions()  # not exported by torch.distributed
    opts.asyncOp = True
    return opts


def reduce_scatter_options(op: dist.ReduceOp) -> dist.ReduceScatterOptions:
    """c10d ``ReduceScatterOptions`` of an asynchronous call reducing with ``op``."""
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = op
    opts.asyncOp = True
    return opts


def reduces_scatter_by_all_to_all(pg: dist.ProcessGroup) -> bool:
    """Whether fcoll reduce-scatters on ``pg`` by an all_to_all_single plus a local reduction:
    on gloo, whose reduce_scatter all-reduces the whole input (measured as slow as its
    all_reduce, and 2-3x the all_to_all form)."""
    return backend_name(pg) == "gloo"


def _reduce_scatter_pair(pg: dist.ProcessGroup, out: torch.Tensor, input: torch.Tensor,
                         reduce_op: str, dtype: torch.dtype):
    """:func:`start_reduce_scatter` on a gloo group of 2 ranks: the peer's chunk of ``input``
    goes to the peer and the peer's chunk of this rank's shard comes back into a scratch of
    ``[N, *]`` (half the input; the full-input scratch held a float32 gradient bucket's size
    again while in flight), and ``finish`` reduces this rank's own chunk, read from ``input``,
    with it in rank order (:func:`fcoll.ops.reduce.reduce_rows`). ``input`` must stay unwritten
    until ``finish`` has run (the op's own copy, or an input lent by fcoll's executor)."""
    me = pg.rank()
    peer = 1 - me
    chunks = input.view(2, *out.shape)
    theirs = torch.empty(out.shape, dtype=input.dtype, device=input.device)
    splits = [0, 0]
    splits[peer] = out.shape[0]
    work = dist.all_to_all_single(theirs, chunks[peer], output_split_sizes=splits,
                                  input_split_sizes=splits, group=pg, async_op=True)
    mine = chunks[me]
    op = logical_op(reduce_op, dtype)

    def finish() -> None:
        reduce_rows(None, op, out, row_list=[mine, theirs] if me == 0 else [theirs, mine])
    return work, finish


def start_reduce_scatter(pg: dist.ProcessGroup, out: torch.Tensor, input: torch.Tensor,
                         reduce_op: str, dtype: torch.dtype):
    """Start reduce_scatter of ``input`` (``[n * N, *]``, contiguous, wire dtype) into ``out``
    (``[N, *]``) on ``pg``; return ``(work, finish)``, where ``finish`` (or None) must run after
    ``work.wait()`` to complete ``out``. ``dtype`` is the user's dtype (bool reduces logically).

    On gloo groups the data moves with ``all_to_all_single`` (each rank sends ``(n-1)/n`` of its
    input, the minimum) into a scratch buffer ``[n, N, *]`` (the input's size, held until the
    work is done), and ``finish`` reduces the ``n`` rows locally (2 ranks: only the peer's
    chunk travels and is held, :func:`_reduce_scatter_pair`); elsewhere it is the backend's
    ``reduce_scatter_tensor_coalesced`` of one tensor, the call torch's op makes. Both paths
    give every reduce op of :data:`REDUCE_OPS`.
    """
    n = pg.size()
    if not reduces_scatter_by_all_to_all(pg):
        op, fin = reduce_args(reduce_op, pg, dtype, out)
        return pg.reduce_scatter_tensor_coalesced([out], [input], reduce_scatter_options(op)), fin
    if n == 2:
        return _reduce_scatter_pair(pg, out, input, reduce_op, dtype)
    rows = torch.empty((n, *out.shape), dtype=input.dtype, device=input.device)
    work = dist.all_to_all_single(rows.view(input.shape), input, group=pg, async_op=True)

    def finish() -> None:
        reduce_rows_into(rows, reduce_op, out, dtype)
    return work, finish
