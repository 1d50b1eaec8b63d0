"""Reduce ops: their names, which dtypes each accepts, and the elementwise reducers.

One answer for every backend (fcoll's shared-memory backend, gloo, nccl through fcoll's ops):

============  ==========================================================================
reduce op     accepted dtypes and meaning
============  ==========================================================================
sum, product  every dtype; bool: logical or (sum), logical and (product)
min, max      every dtype but complex; bool: and (min), or (max)
avg           every dtype but bool: the sum divided by the group size; integers truncate
              toward zero, as C division and NCCL's integer ``ncclAvg`` (sum, then divide)
band/bor/bxor integer and bool dtypes only (bitwise; on bool 0/1 this is logical)
============  ==========================================================================

The reducers here are what the shared-memory backend's algorithms and the gloo paths of
``fcoll.ops.library`` call, so both compute the same bits.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

__all__ = [
    "REDUCE_OPS", "DIST_REDUCE_OPS", "reduce_op_name", "check_reduce_op", "validate_reduce_op",
    "logical_op", "divide_for_avg", "reduce_rows", "reduce_rows_into", "reduce_pair_inplace",
]

#: Every reduce op name, as the functional ops take it.
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")
_BITWISE_OPS = ("band", "bor", "bxor")

#: reduce op name -> ``dist.ReduceOp``.
DIST_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
}

_NAMES: dict = {}


def reduce_op_name(op) -> str:
    """``dist.ReduceOp`` / ``ReduceOp.RedOpType`` -> ``"sum"``, ``"band"``, ... (a str passes
    through unchanged)."""
    if isinstance(op, str):
        return op
    kind = getattr(op, "op", op)
    name = _NAMES.get(kind)
    if name is None:
        name = _NAMES[kind] = getattr(kind, "name", str(kind)).lower()
    return name


@functools.lru_cache(maxsize=None)
def check_reduce_op(op: str, dtype: torch.dtype) -> str | None:
    """The reason reduce op ``op`` is not defined for ``dtype`` (see the module table), or None.

    The message names the op in capitals, as ``dist.ReduceOp`` prints it, and the dtype.
    """
    name = str(dtype).replace("torch.", "")
    if op not in REDUCE_OPS:
        return (f"reduce op {op.upper()} is not supported (supported: "
                f"{', '.join(sorted(o.upper() for o in REDUCE_OPS))})")
    if op in _BITWISE_OPS and (dtype.is_floating_point or dtype.is_complex):
        return (f"reduce op {op.upper()} is not valid for dtype {name} (bitwise ops need an "
                "integer or bool tensor)")
    if op == "avg" and dtype == torch.bool:
        return f"reduce op AVG is not valid for dtype {name} (a mean of bools is not a bool)"
    if op in ("min", "max") and dtype.is_complex:
        return f"reduce op {op.upper()} is not valid for complex dtype {name}"
    return None


def validate_reduce_op(op: str, reduce_op: str, dtype: torch.dtype) -> None:
    """Raise unless ``reduce_op`` is defined for ``dtype`` (the functional ops' check).

    Args:
        op: the collective's name, for the message (e.g. ``"all_reduce"``).

    Raises:
        ValueError: an unknown ``reduce_op``, or one the module table rules out for ``dtype``.
    """
    err = check_reduce_op(reduce_op, dtype)
    if err is not None:
        raise ValueError(f"fcoll.{op}: {err}")


_LOGICAL = {"sum": "bor", "max": "bor", "product": "band", "min": "band"}


def logical_op(op: str, dtype: torch.dtype) -> str:
    """The op that computes ``op`` on ``dtype``: on bool, sum/max are bor and product/min
    band (0/1 arithmetic would overflow or leave bool); other dtypes keep ``op``."""
    return _LOGICAL.get(op, op) if dtype == torch.bool else op


def divide_for_avg(t: torch.Tensor, n: int) -> None:
    """``t /= n`` in place, the second half of ``avg``: integers truncate toward zero."""
    if t.is_floating_point() or t.is_complex():
        t.div_(n)
    else:
        t.div_(n, rounding_mode="trunc")


_BITWISE = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}


def reduce_rows_into(rows: torch.Tensor, reduce_op: str, out: torch.Tensor,
                     dtype: torch.dtype | None = None) -> None:
    """``out = reduce_op(rows[0], ..., rows[n-1])`` elementwise; ``rows`` is ``[n, *out.shape]``.

    ``dtype`` is the user's dtype when the rows travel in a wider one (bool as uint8).
    Sums and products accumulate in ``out``'s dtype, as a backend reducing in place does.
    """
    n = rows.shape[0]
    reduce_op = logical_op(reduce_op, dtype or out.dtype)
    if reduce_op in ("sum", "avg"):
        torch.sum(rows, 0, dtype=out.dtype, out=out)
        if reduce_op == "avg":
            divide_for_avg(out, n)
    elif reduce_op == "product":
        torch.prod(rows, 0, dtype=out.dtype, out=out)
    elif reduce_op == "min":
        torch.amin(rows, 0, out=out)
    elif reduce_op == "max":
        torch.amax(rows, 0, out=out)
    else:
        fold = _BITWISE[reduce_op]
        fold(rows[0], rows[1], out=out)
        for i in range(2, n):
            fold(out, rows[i], out=out)


def reduce_rows(rows: torch.Tensor | None, op: str, out: torch.Tensor,
                row_list: list[torch.Tensor] | None = None) -> None:
    """``out[i] = op(rows[0, i], ..., rows[n-1, i])``; rows ``[n, L]`` (strided), out ``[L]``.

    ``row_list`` (the rows as separate tensors, in rank order) may be given instead of, or as
    well as, ``rows``; with 1 or 2 rows only ``row_list`` is used when given (``rows`` may then
    be None), so the two operands need not lie in one strided tensor. Three rows or more:
    :func:`reduce_rows_into`. The operands are taken in rank order, so every rank computes the
    same bits (min/max of signed zeros depend on the order).
    """
    n = len(row_list) if row_list is not None else rows.shape[0]
    if n == 1:
        out.copy_(row_list[0] if row_list is not None else rows[0])
        return
    if n > 2:
        reduce_rows_into(rows, op, out)
        return
    a, b = row_list if row_list is not None else rows.unbind(0)
    op = logical_op(op, a.dtype)
    if op in ("sum", "avg"):
        torch.add(a, b, out=out)
        if op == "avg":
            divide_for_avg(out, 2)
    elif op == "product":
        torch.mul(a, b, out=out)
    elif op == "min":
        torch.minimum(a, b, out=out)
    elif op == "max":
        torch.maximum(a, b, out=out)
    else:
        _BITWISE[op](a, b, out=out)


_PAIR_INPLACE = {"sum": torch.Tensor.add_, "product": torch.Tensor.mul_,
                 "band": torch.Tensor.bitwise_and_, "bor": torch.Tensor.bitwise_or_,
                 "bxor": torch.Tensor.bitwise_xor_}


def reduce_pair_inplace(mine: torch.Tensor, other: torch.Tensor, op: str,
                        mine_first: bool = True) -> None:
    """``mine = op(mine, other)`` in place, for 2 ranks; ``mine_first``: this rank is rank 0.

    Each rank combines its own input with the peer's row; both ranks get the same bits because
    IEEE addition and multiplication and the bitwise ops are commutative elementwise (up to
    the payload of a NaN). min and max are not for signed zeros (``torch.maximum(-0., 0.)``
    is 0. but ``torch.maximum(0., -0.)`` is -0.), so they take their operands in rank order.
    In place is measured 2-2.5x faster than writing a third buffer (no separate write stream).
    """
    op = logical_op(op, mine.dtype)
    if op in _PAIR_INPLACE:
        _PAIR_INPLACE[op](mine, other)
    elif op == "avg":
        divide_for_avg(mine.add_(other), 2)
    else:
        f = torch.minimum if op == "min" else torch.maximum
        if mine_first:
            f(mine, other, out=mine)
        else:
            f(other, mine, out=mine)
