"""How a process group takes the data: fcoll's adaptation of each collective to its backend.

Which backend a group runs (``_backend_name``), whether it averages natively, the dtype a tensor
travels in (gloo lacks int16 and bool reductions: ``_wire_dtype``, ``_wire_input``,
``_wire_output``), the ``torch.distributed`` reduce op and any finisher for a reduce op string
(``_reduce_args``), the c10d option objects, and the forms fcoll picks on gloo for speed
(``_gathers_one_by_one``, ``start_reduce_scatter``). The eager kernels of
:mod:`fcoll.ops.library` start every collective through these helpers.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from fcoll.ops.reduce import DIST_REDUCE_OPS, divide_for_avg, reduce_rows_into


def _backend_name(pg: dist.ProcessGroup) -> str:
    try:
        return pg._get_backend_name()
    except (AttributeError, RuntimeError):
        return "unknown"


def _native_avg(pg: dist.ProcessGroup, dtype: torch.dtype) -> bool:
    """Whether the backend averages ``dtype`` itself.

    gloo has no AVG, and backends define integer AVG differently (or not at all); there fcoll
    reduces with SUM and divides once the work is done (integers: truncating division, as C).
    """
    return _backend_name(pg) not in ("gloo", "unknown") and dtype.is_floating_point


# gloo rejects int16 ("Invalid scalar type") and has no bool reductions: such tensors travel as
# the wider dtype and are cast back when the work is done (wrap-around matches int16 arithmetic).
_GLOO_WIRE_DTYPES = {torch.int16: torch.int32, torch.bool: torch.uint8}


def _wire_dtype(pg: dist.ProcessGroup, dtype: torch.dtype) -> torch.dtype:
    if _backend_name(pg) == "gloo":
        return _GLOO_WIRE_DTYPES.get(dtype, dtype)
    return dtype


def _wire_input(pg: dist.ProcessGroup, t: torch.Tensor) -> torch.Tensor:
    """``t`` as the backend reads it: contiguous, in the wire dtype."""
    return t.contiguous().to(_wire_dtype(pg, t.dtype))


def _wire_output(pg: dist.ProcessGroup, t: torch.Tensor, *, initialised: bool):
    """A buffer the backend may write for ``t``, and a finisher that copies it back if needed.

    ``initialised``: the buffer must start with ``t``'s values (in-place reductions).
    """
    wire = _wire_dtype(pg, t.dtype)
    if wire == t.dtype and t.is_contiguous():
        return t, None
    if initialised:
        buf = t.contiguous().to(wire)
    else:
        buf = torch.empty(t.shape, dtype=wire, device=t.device)

    def finish() -> None:
        t.copy_(buf)
    return buf, finish


def _reduce_args(reduce_op: str, pg: dist.ProcessGroup, dtype: torch.dtype, buf: torch.Tensor):
    """Map a reduce op string to (dist op, finisher on ``buf``) for this group's backend.

    bool reductions are logical: sum/max/bor are OR (MAX), product/min/band are AND (MIN).
    """
    if reduce_op == "avg" and not _native_avg(pg, dtype):
        return dist.ReduceOp.SUM, functools.partial(divide_for_avg, buf, pg.size())
    if dtype == torch.bool and reduce_op in ("sum", "max", "bor"):
        return dist.ReduceOp.MAX, None
    if dtype == torch.bool and reduce_op in ("product", "min", "band"):
        return dist.ReduceOp.MIN, None
    return DIST_REDUCE_OPS[reduce_op], None


def _chain(*finishers):
    fs = [f for f in finishers if f is not None]
    if not fs:
        return None

    def finish() -> None:
        for f in fs:
            f()
    return finish


def _gathers_one_by_one(pg: dist.ProcessGroup) -> bool:
    """gloo's ``allgather_into_tensor_coalesced`` copies its tensors through one flat buffer
    and was never faster than ``_allgather_base`` of the same tensor
    (``benchmarks/gloo_all_gather_forms.py``, 2 ranks, 3 runs at load 4-7, ratio coalesced /
    base: 4 KiB 0.98-1.25, 64 KiB 1.01-1.40, 1 MiB 0.92-1.32, 16 MiB 1.00-1.05), so there
    each tensor is gathered on its own, as fcoll did before it mirrored torch's call."""
    return _backend_name(pg) == "gloo"


def _allgather_options():
    opts = torch._C._distributed_c10d.AllgatherOptions()  # not exported by torch.distributed
    opts.asyncOp = True
    return opts


def _reduce_scatter_options(op: dist.ReduceOp) -> dist.ReduceScatterOptions:
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = op
    opts.asyncOp = True
    return opts


def _reduces_scatter_by_all_to_all(pg: dist.ProcessGroup) -> bool:
    """gloo's reduce_scatter all-reduces the whole input (measured at 2 ranks, 3 MiB: 50 ms on a
    1 gbit link, the time of an all_reduce, against 13-25 ms for all_to_all_single plus a local
    sum; 4 ranks: 146 ms against 52-75 ms; plain loopback 11 ms against 5-7 ms)."""
    return _backend_name(pg) == "gloo"


def start_reduce_scatter(pg: dist.ProcessGroup, out: torch.Tensor, input: torch.Tensor,
                         reduce_op: str, dtype: torch.dtype):
    """Start reduce_scatter of ``input`` (``[n * N, *]``, contiguous, wire dtype) into ``out``
    (``[N, *]``) on ``pg``; return ``(work, finish)``, where ``finish`` (or None) must run after
    ``work.wait()`` to complete ``out``. ``dtype`` is the user's dtype (bool reduces logically).

    On gloo groups the data moves with ``all_to_all_single`` (each rank sends ``(n-1)/n`` of its
    input, the minimum) into a scratch buffer ``[n, N, *]`` (the input's size, held until the
    work is done), and ``finish`` reduces the ``n`` rows locally; elsewhere it is the backend's
    ``reduce_scatter_tensor_coalesced`` of one tensor, the call torch's op makes. Both paths
    give every reduce op of :data:`REDUCE_OPS`.
    """
    n = pg.size()
    if not _reduces_scatter_by_all_to_all(pg):
        op, fin = _reduce_args(reduce_op, pg, dtype, out)
        return pg.reduce_scatter_tensor_coalesced([out], [input], _reduce_scatter_options(op)), fin
    rows = torch.empty((n, *out.shape), dtype=input.dtype, device=input.device)
    work = dist.all_to_all_single(rows.view(input.shape), input, group=pg, async_op=True)

    def finish() -> None:
        reduce_rows_into(rows, reduce_op, out, dtype)
    return work, finish
