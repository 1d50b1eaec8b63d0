"""The Triton kernel of :mod:`fcoll.shm.cuda.fold` (imported only when it runs: importing this
module imports Triton). ``fold`` combines ``N`` operands in rank order into ``out``; see
:func:`fcoll.shm.cuda.fold.fold_views_into` for the contract and the op codes."""

import triton
import triton.language as tl


@triton.jit
def combine(a, b, OP: tl.constexpr, IS_FLOAT: tl.constexpr):
    if OP == 0:
        r = a + b
    elif OP == 1:
        r = a * b
    elif OP == 2:
        r = tl.where(b < a, b, a)
    elif OP == 3:
        r = tl.where(b > a, b, a)
    elif OP == 4:
        r = a & b
    elif OP == 5:
        r = a | b
    else:
        r = a ^ b
    if IS_FLOAT and (OP == 2 or OP == 3):
        r = tl.where((a != a) | (b != b), a + b, r)  # NaN if either is NaN
    return r

@triton.jit
def to_bf16(x):
    """float32 -> bfloat16 rounded to nearest even, NaN to the quiet NaN 0x7FC0: torch's own
    rounding, written out with integer ops so that the result does not depend on the cast's
    rounding mode (Triton's interpreter truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def narrow(x, like):
    """``x`` (float32) back to ``like``'s float16 or bfloat16."""
    if like.dtype == tl.bfloat16:
        return to_bf16(x)
    return x.to(like.dtype)


@triton.jit
def exact_div(a, b):
    """``a / b`` rounded to nearest (IEEE): Triton's ``/`` on float32 is the approximate
    ``div.full.f32`` on NVIDIA GPUs, ``div_rn`` is float32-only, and float64's ``/`` is exact."""
    if a.dtype == tl.float32:
        return tl.math.div_rn(a, b)
    return a / b


@triton.jit
def step(acc, ptr, offs, mask, OP: tl.constexpr, IS_FLOAT: tl.constexpr,
         WIDEN: tl.constexpr):
    v = tl.load(ptr + offs, mask=mask)
    if WIDEN:  # float16/bfloat16: combine in float32, round back, as torch does
        return narrow(combine(acc.to(tl.float32), v.to(tl.float32), OP, IS_FLOAT), v)
    return combine(acc, v, OP, IS_FLOAT)

@triton.jit
def fold(out, p0, p1, p2, p3, p4, p5, p6, p7, numel, divisor,
         N: tl.constexpr, OP: tl.constexpr, IS_FLOAT: tl.constexpr, WIDEN: tl.constexpr,
         AVG: tl.constexpr, RECIPROCAL: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(p0 + offs, mask=mask)
    acc = step(acc, p1, offs, mask, OP, IS_FLOAT, WIDEN)
    if N > 2:
        acc = step(acc, p2, offs, mask, OP, IS_FLOAT, WIDEN)
    if N > 3:
        acc = step(acc, p3, offs, mask, OP, IS_FLOAT, WIDEN)
    if N > 4:
        acc = step(acc, p4, offs, mask, OP, IS_FLOAT, WIDEN)
    if N > 5:
        acc = step(acc, p5, offs, mask, OP, IS_FLOAT, WIDEN)
    if N > 6:
        acc = step(acc, p6, offs, mask, OP, IS_FLOAT, WIDEN)
    if N > 7:
        acc = step(acc, p7, offs, mask, OP, IS_FLOAT, WIDEN)
    if AVG:
        if IS_FLOAT:
            # torch's CUDA kernel multiplies by 1/n rounded once in the compute type (float32 for
            # float16/bfloat16, BinaryDivTrueKernel.cu); its CPU kernel divides
            wide = acc.to(tl.float32) if WIDEN else acc
            d = divisor.to(wide.dtype)
            if RECIPROCAL:
                wide = wide * exact_div(tl.full([], 1.0, wide.dtype), d)
            else:
                wide = exact_div(wide, d)
            acc = narrow(wide, acc) if WIDEN else wide
        else:  # C division truncates toward zero, as divide_for_avg's "trunc"
            acc = acc // divisor.to(acc.dtype)
    tl.store(out + offs, acc, mask=mask)
