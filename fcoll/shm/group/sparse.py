"""All_reduce of sparse COO tensors on fcoll's process groups, as gloo does it.

``DistributedDataParallel`` all-reduces the gradient of an ``nn.Embedding(sparse=True)`` (or
``EmbeddingBag``) as a sparse COO tensor; gloo accepts it, so fcoll's groups do too. The
semantics are gloo's (PyTorch's ``ProcessGroupGloo`` sparse all_reduce): ``ReduceOp.SUM`` only;
the tensor is replaced in place by the coalesced sum of every rank's tensor (same size, sparse
and dense dims and dtype on every rank; its number of specified elements may differ), and the
``Work``'s result is ``[tensor]``.

Algorithm (gloo's: metadata, then indices and values gathered; here four all_gathers, each a
dense collective of the same group, so it is ordered with the group's other collectives and has
their checks and timeouts):

1. all_gather a header of int64 per rank: ``nnz`` (of the coalesced tensor), sparse dims, dense
   dims, number of dims, the dtype's code (:func:`~fcoll.shm.transport.op_codes.dtype_code`),
   and whether the reduce op is SUM.
   Every rank checks every header, so ranks whose tensors disagree all raise the same
   ``CollectiveMismatchError``, naming the ranks, instead of waiting on each other;
2. all_gather the sizes (``ndim`` int64 each), checked the same way;
3. all_gather the indices ``[sparse_dim, max_nnz]`` (int64) and the values ``[max_nnz, *dense
   sizes]``, each padded to the largest ``nnz``; then concatenate every rank's part in rank order
   and ``coalesce``, which sums duplicate indices. Every rank builds the result from the same
   bytes in the same order, so the ranks' results are bitwise equal.

Bytes moved per rank: ``n * max_nnz * (8 * sparse_dim + values' bytes per element row)``;
compute: one ``coalesce`` of ``sum(nnz)`` elements (a sort).

The whole call runs on the caller's thread and returns a completed ``Work`` (``async_op=True``
included: the sparse sum is needed to size the result). Errors (a rank's tensors disagreeing
with a peer's, another reduce op, a coalescing context) are raised by the ``Work``'s
``wait``, as fcoll's other collectives raise theirs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fcoll.shm.transport.headers import CollectiveMismatchError
from fcoll.shm.transport.op_codes import dtype_code, dtype_of_code
from fcoll.shm.work import DoneWork

__all__ = ["is_sparse_coo", "sparse_all_reduce"]

#: header fields, in order: nnz, sparse dims, dense dims, dims, dtype code, op is SUM
_FIELDS = ("nnz", "sparse dims", "dense dims", "dims", "dtype", "reduce op")


def is_sparse_coo(tensors) -> bool:
    """Whether a c10d tensor list is one sparse COO tensor (the form DDP all-reduces)."""
    return (isinstance(tensors, (list, tuple)) and len(tensors) == 1
            and isinstance(tensors[0], torch.Tensor) and tensors[0].layout is torch.sparse_coo)


def _gather(pg, t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t [k, *]`` stacked in rank order, ``[n * k, *]``, through ``pg``."""
    out = t.new_empty((pg.size() * t.shape[0], *t.shape[1:]))
    pg.all_gather_single(out, t.contiguous()).wait()
    return out


def _disagreement(rows: list[list[int]], names: tuple[str, ...]) -> str | None:
    """Which field the ranks' ``rows`` disagree on, naming each rank's value, or None."""
    for i, name in enumerate(names):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            return f"{name}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(values))
    return None


def _reduce(pg, t: torch.Tensor, op: str) -> torch.Tensor:
    """The coalesced sum of every rank's sparse ``t`` (module docstring)."""
    rank = pg.rank()
    local = t.coalesce()
    indices, values = local.indices(), local.values()
    header = torch.tensor([local._nnz(), t.sparse_dim(), t.dense_dim(), t.dim(),
                           dtype_code(t.dtype), int(op == "sum")],
                          dtype=torch.int64, device=t.device)
    headers = _gather(pg, header.view(1, -1)).tolist()
    if not all(h[5] for h in headers):
        refusing = [r for r, h in enumerate(headers) if not h[5]]
        raise CollectiveMismatchError(
            f"fcoll all_reduce: rank {rank}: sparse tensors are reduced with ReduceOp.SUM only "
            f"(as gloo); rank(s) {refusing} asked for another op")
    why = _disagreement([[*h[1:4], dtype_of_code(h[4])] for h in headers], _FIELDS[1:5])
    if why is None:
        sizes = _gather(pg, torch.tensor([list(t.shape)], dtype=torch.int64,
                                         device=t.device)).tolist()
        why = _disagreement([[tuple(s)] for s in sizes], ("size",))
    if why is not None:
        raise CollectiveMismatchError(
            f"fcoll all_reduce: rank {rank}: the ranks' sparse tensors disagree on {why}")
    nnz = [h[0] for h in headers]
    width = max(nnz)
    if width == 0:
        return local
    pad = width - nnz[rank]
    idx = torch.nn.functional.pad(indices, (0, pad))
    val = torch.cat([values, values.new_zeros((pad, *values.shape[1:]))]) if pad else values
    all_idx = _gather(pg, idx).view(pg.size(), t.sparse_dim(), width)
    all_val = _gather(pg, val).view(pg.size(), width, *values.shape[1:])
    total = torch.sparse_coo_tensor(
        torch.cat([all_idx[r, :, :k] for r, k in enumerate(nnz)], dim=1),
        torch.cat([all_val[r, :k] for r, k in enumerate(nnz)]), t.shape, dtype=t.dtype,
        device=t.device)
    return total.coalesce()


def sparse_all_reduce(pg, t: torch.Tensor, op: str, coalescing: bool = False) -> dist.Work:
    """All-reduce the sparse COO tensor ``t`` in place over ``pg`` (module docstring).

    Args:
        pg: an fcoll process group (its ``all_gather_single``, ``rank`` and ``size`` are used).
        t: a sparse COO tensor, any size, sparse and dense dims and dtype the dense path takes,
            the same on every rank but for the number of specified elements.
        op: the reduce op's name (``"sum"``, ...).
        coalescing: the call is inside c10d's coalescing manager (refused: the sparse all_reduce
            needs its collectives' results before the next one).

    Returns:
        A completed ``Work`` whose result is ``[t]``; its ``wait`` raises
        ``CollectiveMismatchError`` (a ``ValueError``) when a rank asked for another op than SUM
        or the ranks' tensors disagree (naming the ranks and values), or whatever the dense
        collectives raised (a peer died, a timeout).
    """
    if coalescing:
        return DoneWork(None, ValueError(
            f"fcoll all_reduce: rank {pg.rank()}: a sparse tensor cannot be all-reduced inside "
            "a coalescing context (its collectives depend on each other's results)"))
    try:
        total = _reduce(pg, t, op)
    except Exception as e:  # noqa: BLE001  raised by the Work's wait, as the group's others
        return DoneWork(None, e)
    with torch.no_grad():
        t.copy_(total)
    return DoneWork([t], None)
