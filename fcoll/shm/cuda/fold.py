"""One Triton kernel that reduces every rank's IPC buffer into the output in a single pass.

The IPC path's reductions (:mod:`fcoll.shm.cuda.paths`) fold the n ranks' buffers in rank order
with torch's binary ops (:func:`fcoll.ops.reduce.reduce_views_into`): n - 1 kernels, each reading
two operands and writing the output, so 3 ranks read 4S and write 2S, and ``avg`` adds a pass
to divide. :func:`fold_views_into` does the same fold in one kernel: it reads each buffer once
and writes the output once (n S read, S written). It computes what the torch fold computes:
the operands combined in rank order, float16 and bfloat16 combined in float32 and rounded back
to nearest even after every step (as torch's kernels do), integers wrapping, bool sum/max as or
and product/min as and, ``avg`` dividing the sum once as torch's ``div_`` does on the device
(CUDA multiplies by the rounded reciprocal; integers truncate toward zero), so sums,
products, averages and the bitwise ops give torch's bits. min and max propagate NaN and return
the earlier operand when neither is smaller; on ties of -0 and +0 and on NaN payloads torch's
kernels themselves disagree (vectorized and scalar paths), so only the values are the same.
Every rank runs the same kernel in the same order, so all ranks agree bit for bit.

When it is used (:func:`fold_supported`): ``FCOLL_CUDA_TRITON=1`` (off by default until the
device check has compared it with the torch fold), Triton importable, at most
:data:`MAX_OPERANDS` ranks, a dtype of :data:`DTYPES` (complex is not: Triton has no complex
type), and CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``, how the CPU tests run it).
Otherwise the torch fold runs, so every call still works.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from fcoll.ops.reduce import logical_op, reduce_views_into

ENV = "FCOLL_CUDA_TRITON"  #: "1": use the Triton fold where it applies
MAX_OPERANDS = 8
BLOCK = 1024
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)
#: Triton's interpreter patches ``triton.language`` while a kernel runs, so two threads that run
#: kernels at once break each other; on a GPU launches need no lock
_INTERPRETER_LOCK = threading.Lock()
_OP_CODES = {"sum": 0, "product": 1, "min": 2, "max": 3, "band": 4, "bor": 5, "bxor": 6}


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fold_supported(views: list[torch.Tensor], op: str, out: torch.Tensor) -> str | None:
    """Why :func:`fold_views_into` would not use the Triton kernel here, or None if it would.

    Args:
        views: the operands (one per rank, rank order), same dtype and numel as ``out``.
        op: a reduce op name of :data:`fcoll.ops.reduce.REDUCE_OPS`.
        out: the output.
    """
    if os.environ.get(ENV, "0") != "1":
        return f"{ENV} is not 1"
    if not 2 <= len(views) <= MAX_OPERANDS:
        return f"{len(views)} operands (the kernel takes 2 to {MAX_OPERANDS})"
    if out.dtype not in DTYPES:
        return f"dtype {out.dtype} (Triton has no such type)"
    on_cuda = out.is_cuda and all(v.is_cuda for v in views)
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return "CPU tensors outside TRITON_INTERPRET=1"
    if not (out.is_contiguous() and all(v.is_contiguous() for v in views)):
        return "a non-contiguous operand"
    if not _triton_available():
        return "triton is not importable"
    return None


def fold_views_into(views: list[torch.Tensor], op: str, out: torch.Tensor, *,
                    avg_by_reciprocal: bool | None = None) -> None:
    """``out = op(views[0], ..., views[n-1])`` elementwise in rank order, in one kernel when
    :func:`fold_supported` allows it, else by :func:`~fcoll.ops.reduce.reduce_views_into`
    (same contract: ``out`` may alias ``views[0]`` only; flat views of one dtype and numel).

    ``avg_by_reciprocal``: how a float ``avg`` divides by n. torch's ``div_`` by a Python
    number multiplies by ``1/n`` (rounded once, in float32 for float16/bfloat16) on CUDA and
    divides on the CPU, which differ in the last bit for n = 3; None (the default) does what
    torch does on ``out``'s device, so the kernel gives the torch fold's bits on both."""
    if fold_supported(views, op, out) is not None:
        reduce_views_into(views, op, out)
        return
    n, numel = len(views), out.numel()
    if numel == 0:
        return
    code_op = logical_op(op, out.dtype)
    avg = code_op == "avg"
    dt = out.dtype
    as_bytes = dt == torch.bool  # 0/1 bytes: or/and/xor give the logical ops
    ops = [v.view(torch.uint8) if as_bytes else v for v in views]
    dst = out.view(torch.uint8) if as_bytes else out
    ptrs = ops + [ops[0]] * (MAX_OPERANDS - n)  # unused slots: never read (N is constexpr)
    from fcoll.shm.cuda.fold_kernel import fold, triton

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    with _INTERPRETER_LOCK if interpreted else contextlib.nullcontext():
        fold[(triton.cdiv(numel, BLOCK),)](
            dst, *ptrs, numel, n, N=n, OP=_OP_CODES["sum" if avg else code_op],
            IS_FLOAT=dt.is_floating_point, WIDEN=dt in (torch.float16, torch.bfloat16),
            AVG=avg, RECIPROCAL=out.is_cuda if avg_by_reciprocal is None else avg_by_reciprocal,
            BLOCK=BLOCK)
