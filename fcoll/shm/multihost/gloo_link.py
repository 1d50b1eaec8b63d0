"""gloo between hosts, for :mod:`fcoll.shm.multihost.hierarchical`: byte views, reductions gloo
lacks, the argument check across the link, and the pieces composed ops are pipelined in.

gloo takes only some dtypes (no int16, no complex products, ...) and checks nothing across
ranks (mismatched shapes abort the process: NOTES, "gloo under faults"). So data crosses hosts
as bytes (:func:`as_bytes`), a reduction gloo lacks is an all_to_all of bytes plus a local
reduction (:func:`gloo_reduce_scatter_rows`), and before data moves the ranks compare their
arguments in one small all_gather (:func:`agree`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from fcoll.ops.reduce import DIST_REDUCE_OPS, logical_op, reduce_rows_into

__all__ = [
    "MAX_CHUNKS",
    "MAX_MESSAGE_BYTES",
    "PIPELINE_CHUNK_BYTES",
    "REDUCE_CODES",
    "SIGNATURE",
    "agree",
    "as_bytes",
    "chunk_spans",
    "gloo_all_reduce",
    "gloo_all_reduce_start",
    "gloo_reduce_scatter_rows",
    "gloo_reduces",
    "make_opts",
]


def make_opts(cls, **fields):
    """An options object of c10d class ``cls`` with ``fields`` set."""
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


# dtypes gloo's all_reduce takes (complex only with sum); the others reduce locally
GLOO_REDUCE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                 torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool})


def gloo_reduces(op: str, dtype: torch.dtype) -> bool:
    return dtype in GLOO_REDUCE_DTYPES or (dtype.is_complex and op == "sum")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as flat bytes: gloo moves any dtype this way (int16, complex...)."""
    return t.view(-1).view(torch.uint8)


#: Bytes of a failing rank's message that :func:`agree` carries to the other side of a link.
MAX_MESSAGE_BYTES = 1024
_ARGUMENT_ERROR, _OTHER_ERROR = 1, 2


def agree(group: dist.ProcessGroup, name: str, rank: int, numbers: list[int],
          fields: tuple[str, ...], error: BaseException | None = None) -> None:
    """Check that every rank of a gloo ``group`` passes the same ``numbers`` before data moves.

    gloo does not check its peers' shapes: a mismatch aborts the process or returns garbage
    (docs: NOTES, "gloo under faults"). Each rank sends ``[failed, *numbers]`` (int64) in one
    all_gather. ``error``: this rank already failed the op (its arguments are invalid, or its
    host's intra-host step failed); it is re-raised after telling the peers. When any rank
    failed, every rank then sends its message (at most :data:`MAX_MESSAGE_BYTES` bytes, UTF-8)
    in a second all_gather, so the peers raise the failing rank's own words, as fcoll's
    shared-memory groups do with the message in a header. Every rank makes the same number of
    gloo calls either way (the first all_gather tells all of them whether a second follows).

    Raises:
        ValueError: a rank's arguments were invalid (``ValueError`` or ``TypeError`` there;
            the message is that rank's), or the ranks' numbers differ (message: op, this rank,
            each rank's fields).
        RuntimeError: a rank failed otherwise (its message follows "the op failed on the
            other side of the link").
        error: this rank's own ``error``, after the peers were told.
    """
    k = group.size()
    kind = 0 if error is None else (
        _ARGUMENT_ERROR if isinstance(error, (ValueError, TypeError)) else _OTHER_ERROR)
    mine = torch.tensor([kind, *numbers], dtype=torch.int64)
    rows = torch.empty((k, mine.numel()), dtype=torch.int64)
    group._allgather_base(rows.view(-1), mine).wait()
    failed = [p for p in range(k) if rows[p, 0]]
    if failed:
        text = str(error).encode("utf-8", "replace")[:MAX_MESSAGE_BYTES] if error else b""
        buf = torch.zeros(MAX_MESSAGE_BYTES, dtype=torch.uint8)
        if text:
            buf[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        said = torch.empty((k, MAX_MESSAGE_BYTES), dtype=torch.uint8)
        group._allgather_base(said.view(-1), buf).wait()
        if error is not None:
            raise error
        first = failed[0]
        words = bytes(said[first].tolist()).rstrip(b"\0").decode("utf-8", "replace")
        if int(rows[first, 0]) == _ARGUMENT_ERROR:
            raise ValueError(words)
        raise RuntimeError(f"fcoll {name}: rank {rank}: the op failed on the other side of "
                           f"the link (sub-group rank {first}): {words}")
    if not bool((rows[:, 1:] == rows[0, 1:]).all()):
        says = "; ".join(f"[{p}] " + ", ".join(f"{f}={int(v)}" for f, v in zip(fields, row[1:]))
                         for p, row in enumerate(rows.tolist()))
        raise ValueError(f"fcoll {name}: rank {rank}: ranks on different hosts passed "
                         f"different arguments (per sub-group rank: {says})")


SIGNATURE = ("op", "dtype", "numel", "extra")
REDUCE_CODES = {name: i for i, name in enumerate(
    ("sum", "avg", "product", "min", "max", "band", "bor", "bxor"))}


def gloo_reduce_scatter_rows(group: dist.ProcessGroup, rows: torch.Tensor,
                              op: str) -> torch.Tensor:
    """Row ``group.rank()`` of the elementwise ``op``-reduction of every rank's ``rows``.

    ``rows`` is ``[k, N]`` contiguous (k = group size); returns ``[N]``. An all_to_all of
    bytes and a local reduction: every dtype and reduce op (not avg), (k-1)/k * k * N elements
    sent per rank, the minimum (gloo's own reduce_scatter measured as slow as its all_reduce
    of the whole input).
    """
    got = torch.empty_like(rows)
    group.alltoall_base(as_bytes(got), as_bytes(rows), [], [], dist.AllToAllOptions()).wait()
    out = rows.new_empty(rows.shape[1:])
    reduce_rows_into(got, op, out)
    return out


def gloo_all_reduce(group: dist.ProcessGroup, x: torch.Tensor, op: str) -> None:
    """All-reduce ``x`` (1-D, contiguous) in place over a gloo ``group``; ``op`` is not avg.

    gloo's own all_reduce where it takes the dtype; otherwise (int16, complex products, ...)
    a reduce_scatter of bytes (:func:`_gloo_reduce_scatter_rows`) and an all_gather of bytes.
    """
    k = group.size()
    if k == 1:
        return
    op = logical_op(op, x.dtype)
    if gloo_reduces(op, x.dtype):
        group.allreduce([x], make_opts(dist.AllreduceOptions, reduceOp=DIST_REDUCE_OPS[op])).wait()
        return
    pad = (-x.numel()) % k
    buf = x if pad == 0 else torch.cat([x, x.new_zeros(pad)])
    mine = gloo_reduce_scatter_rows(group, buf.view(k, -1), op)
    group._allgather_base(as_bytes(buf), as_bytes(mine)).wait()
    if pad:
        x.copy_(buf[:x.numel()])


def gloo_all_reduce_start(group: dist.ProcessGroup, x: torch.Tensor,
                           op: str) -> Callable[[], None]:
    """:func:`_gloo_all_reduce`, started: returns the function that finishes it (gloo's own
    all_reduce runs asynchronously; the byte-wise fallback has already run)."""
    op = logical_op(op, x.dtype)
    if group.size() > 1 and gloo_reduces(op, x.dtype):
        return group.allreduce([x], make_opts(dist.AllreduceOptions,
                                          reduceOp=DIST_REDUCE_OPS[op])).wait
    gloo_all_reduce(group, x, op)
    return lambda: None


#: Composed ops move their data in pieces of about this many bytes, so that one piece's
#: intra-host step overlaps another's inter-host step (unpipelined, the intra-host steps add
#: to the link time); piece sizes of 1 to 8 MiB perform alike.
PIPELINE_CHUNK_BYTES = 4 << 20
MAX_CHUNKS = 16


def chunk_spans(numel: int, bytes_per_element: int, align: int = 1) -> list[tuple[int, int]]:
    """(offset, length) pieces of ``numel`` elements, each a multiple of ``align`` elements
    (``numel`` must be one), about :data:`PIPELINE_CHUNK_BYTES` of the op's largest buffer
    each (``bytes_per_element``: its bytes per element counted here; an all_gather's output
    holds group-size elements per input element), at most :data:`MAX_CHUNKS`; one piece when
    ``numel`` is 0."""
    units = numel // align
    per = max(1, PIPELINE_CHUNK_BYTES // max(1, bytes_per_element * align))
    count = max(1, min(MAX_CHUNKS, -(-units // per)))
    bounds = [units * i // count for i in range(count + 1)]
    return [(bounds[i] * align, (bounds[i + 1] - bounds[i]) * align) for i in range(count)]
