"""Reduce ops: their names, which dtypes each accepts, and the elementwise reducers.

One answer for every backend (fcoll's shared-memory backend, gloo, nccl through fcoll's ops),
and the only place that answers it: :data:`DATA_DTYPES` (what any collective moves) and
:data:`REDUCE_DTYPES` (what each reduce op reduces), checked by :func:`check_dtype` and
:func:`check_reduce_op` on the calling rank before any data moves.

============  ==========================================================================
reduce op     accepted dtypes and meaning
============  ==========================================================================
sum, product  bool, uint8, int8/16/32/64, float16, bfloat16, float32/64, complex64/128;
              bool: logical or (sum), logical and (product)
min, max      the same but complex; bool: and (min), or (max)
avg           the same as sum but bool: the sum divided by the group size; integers
              truncate toward zero, as C division and NCCL's integer ``ncclAvg``
band/bor/bxor bool and the integer dtypes, uint16/32/64 included (bitwise)
============  ==========================================================================

Everything else is rejected up front, naming the op and dtype: uint16/32/64 arithmetic, the
float8 dtypes, complex32, quantized and bits dtypes have no CPU kernels for the reducers in
PyTorch 2.13 (``add``, ``minimum``, ``sum`` raise "not implemented for 'UInt16'"), so
accepting them would fail after data moved. ``tests/test_validation.py`` checks this table
against the reducers, so a PyTorch that adds the kernels shows up there. Collectives that only
move bytes (all_gather, broadcast, all_to_all, ...) accept every dtype of
:data:`DATA_DTYPES`, float8 and uint16/32/64 included; quantized, bits and sub-byte dtypes
are refused by all (their bytes do not say their scale, or their element size is not whole).

The reducers here are what the shared-memory backend's algorithms and the gloo paths of
``fcoll.ops.library`` call, so both compute the same bits.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = [
    "REDUCE_OPS", "DIST_REDUCE_OPS", "DATA_DTYPES", "REDUCE_DTYPES", "reduce_op_name",
    "check_dtype", "check_reduce_op", "validate_reduce_op",
    "logical_op", "backend_reduce_op", "divide_for_avg", "BINARY_REDUCERS", "reduce_views_into",
    "reduce_rows", "reduce_rows_into", "reduce_pair_inplace", "pair_reducer",
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


def _dtypes(*names: str) -> frozenset:
    """The dtypes of these names that this PyTorch has (float8 variants came over releases)."""
    return frozenset(getattr(torch, n) for n in names if hasattr(torch, n))


_INTS = ("uint8", "int8", "int16", "int32", "int64")
_ARITHMETIC = _dtypes("bool", *_INTS, "float16", "bfloat16", "float32", "float64",
                      "complex64", "complex128")
_COMPLEX = _dtypes("complex32", "complex64", "complex128")
#: Every dtype any collective moves (as bytes).
DATA_DTYPES = _ARITHMETIC | _COMPLEX | _dtypes(
    "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "float8_e8m0fnu")
#: reduce op name -> the dtypes it reduces (the module table).
REDUCE_DTYPES = {
    "sum": _ARITHMETIC, "product": _ARITHMETIC, "avg": _ARITHMETIC - {torch.bool},
    "min": _ARITHMETIC - _COMPLEX, "max": _ARITHMETIC - _COMPLEX,
    **dict.fromkeys(("band", "bor", "bxor"),
                    _dtypes("bool", *_INTS, "uint16", "uint32", "uint64")),
}


def _dtype_list(dtypes) -> str:
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


@functools.lru_cache(maxsize=None)
def check_dtype(dtype) -> str | None:
    """Why no collective can move tensors of ``dtype`` (see :data:`DATA_DTYPES`), or None.

    The message names the dtype and starts with ``dtype``, for the caller to prefix with the
    argument's name."""
    if dtype in DATA_DTYPES:
        return None
    name = str(dtype).removeprefix("torch.")
    if getattr(dtype, "is_quantized", False) or name.startswith(("qint", "quint")):
        why = "a quantized tensor's bytes do not carry its scale; send int_repr() and the scale"
    else:
        why = "only numeric and bool dtypes are; bits, sub-byte and packed dtypes are not"
    return f"dtype {name} is not supported by fcoll's collectives ({why})"


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
    if dtype in REDUCE_DTYPES[op]:
        return None
    if op in _BITWISE_OPS and (dtype.is_floating_point or dtype.is_complex):
        return (f"reduce op {op.upper()} is not valid for dtype {name} (bitwise ops need an "
                "integer or bool tensor)")
    if op == "avg" and dtype == torch.bool:
        return f"reduce op AVG is not valid for dtype {name} (a mean of bools is not a bool)"
    if op in ("min", "max") and dtype.is_complex and dtype in REDUCE_DTYPES["sum"]:
        return f"reduce op {op.upper()} is not valid for complex dtype {name}"
    return (f"reduce op {op.upper()} is not supported for dtype {name} (PyTorch has no CPU "
            f"kernel for it; {op.upper()} supports {_dtype_list(REDUCE_DTYPES[op])})")


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


def backend_reduce_op(reduce_op: str, dtype: torch.dtype, native_avg: bool) -> tuple[str, bool]:
    """The reduce op a backend runs for ``reduce_op`` on ``dtype``, and whether ``avg`` is then
    finished by :func:`divide_for_avg` (the one mapping of every path that hands a reduction to
    a backend: :mod:`fcoll.ops.wire`, the shared-memory backend's direct path).

    On bool, sum/max/bor run as ``max`` and product/min/band as ``min`` (logical or / and, the
    ops every backend has on bool); ``avg`` where the backend does not average ``dtype`` itself
    (``native_avg`` False) runs as ``sum`` and is divided afterwards; anything else is itself.
    """
    if reduce_op == "avg" and not native_avg:
        return "sum", True
    if dtype == torch.bool and reduce_op in ("sum", "max", "bor"):
        return "max", False
    if dtype == torch.bool and reduce_op in ("product", "min", "band"):
        return "min", False
    return reduce_op, False


def divide_for_avg(t: torch.Tensor, n: int) -> None:
    """``t /= n`` in place, the second half of ``avg``: integers truncate toward zero."""
    if t.is_floating_point() or t.is_complex():
        t.div_(n)
    else:
        t.div_(n, rounding_mode="trunc")


_BITWISE = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}

#: reduce op -> the elementwise binary function (``f(a, b, out=out)``) that computes it, for every
#: op but ``avg`` (a ``sum`` then :func:`divide_for_avg`); on bool use :func:`logical_op` first.
BINARY_REDUCERS = {"sum": torch.add, "product": torch.mul, "min": torch.minimum,
                   "max": torch.maximum, **_BITWISE}


def reduce_views_into(views: list[torch.Tensor], op: str, out: torch.Tensor) -> None:
    """``out = op(views[0], ..., views[n-1])`` elementwise, folded in rank order (any device;
    the views need not lie in one tensor, e.g. peers' buffers mapped by CUDA IPC).

    ``out`` may not alias any view but ``views[0]``. bool sum/max are or, product/min and;
    ``avg`` sums then divides (integers truncate).
    """
    n = len(views)
    if n == 1:
        out.copy_(views[0])
        return
    op = logical_op(op, out.dtype)
    f = BINARY_REDUCERS["sum" if op == "avg" else op]
    f(views[0], views[1], out=out)
    for v in views[2:]:
        f(out, v, out=out)
    if op == "avg":
        divide_for_avg(out, n)


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


def pair_reducer(op: str, dtype: torch.dtype,
                 mine_first: bool = True) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """:func:`reduce_pair_inplace` for one (``op``, ``dtype``, rank order), chosen once:
    ``f(mine, other)`` computes the same bits (a one-slot plan keeps it, saving the op's
    look-ups on every call of a small collective)."""
    op = logical_op(op, dtype)
    if op in _PAIR_INPLACE:
        return _PAIR_INPLACE[op]
    return functools.partial(reduce_pair_inplace, op=op, mine_first=mine_first)


def reduce_pair_inplace(mine: torch.Tensor, other: torch.Tensor, op: str,
                        mine_first: bool = True) -> None:
    """``mine = op(mine, other)`` in place, for 2 ranks; ``mine_first``: this rank is rank 0.

    Each rank combines its own input with the peer's row; both ranks get the same bits because
    IEEE addition and multiplication and the bitwise ops are commutative elementwise (up to
    the payload of a NaN). min and max are not, on signed zeros: which of -0. and 0. they
    return depends on the operand order, and differently on torch's vectorized and scalar CPU
    kernels (torch 2.13: ``torch.maximum`` of ``-0.`` and ``0.`` is ``0.`` on 64 elements and
    ``-0.`` on one), so they take their operands in rank order: both ranks then run the same
    kernel on the same operands.
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
