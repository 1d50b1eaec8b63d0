"""Local argument checks and staging of tensors into contiguous host memory.

Checks return an error message (or None) instead of raising, so the caller can still send an
"invalid" header to its peers before raising: every rank then fails with the same message and
none waits for a collective that will never come. Every tensor argument of every op goes
through :func:`check_tensor` before anything reads it (its dtype, shape or data): a value that
is not a tensor, a meta, sparse or quantized tensor, a dtype outside
:data:`fcoll.ops.reduce.DATA_DTYPES`, or an output whose elements share memory. Outputs that
overlap an input are refused by :func:`check_no_overlap` where a chunked algorithm would read
what it already wrote.
"""

from __future__ import annotations

import torch

from fcoll.ops.reduce import check_dtype
from fcoll.shm.group.identity import DEVICE_TYPES

_STRIDED = torch.strided


def check_tensor(t, arg: str, write: bool = False) -> str | None:
    """Why ``t`` cannot be argument ``arg`` of a collective, or None.

    Args:
        t: the user's value.
        arg: its name in the call (``"output_tensors[1]"``), for the message.
        write: the collective writes ``t`` (an output, or an in-place tensor): it must also
            give every element its own memory (not an ``expand``-ed view).

    Returns a message naming ``arg`` for: not a ``torch.Tensor``; a layout other than strided
    (sparse); a device other than cpu or cuda (meta); a dtype :func:`check_dtype` refuses
    (quantized, bits); an output with internal overlap.
    """
    if not isinstance(t, torch.Tensor):
        return f"{arg} must be a torch.Tensor, got {type(t).__name__}"
    if t.layout is not _STRIDED:
        return f"{arg} has layout {t.layout}; only strided (dense) tensors are supported"
    if t.device.type not in DEVICE_TYPES:
        return (f"{arg} is on device {t.device}; fcoll supports cpu and cuda tensors "
                "(a meta tensor has no data to send or receive)")
    err = check_dtype(t.dtype)
    if err is not None:
        return f"{arg} has {err}"
    if write and not t.is_contiguous() and torch._debug_has_internal_overlap(t) == 1:
        return (f"{arg} has overlapping memory (an expanded or broadcast view, strides "
                f"{t.stride()}); pass a tensor where every element has its own storage")
    return None


def check_tensors(named: list[tuple[str, object, bool]]) -> str | None:
    """:func:`check_tensor` of every ``(arg, value, write)``; the first message, or None."""
    for arg, t, write in named:
        err = check_tensor(t, arg, write)
        if err is not None:
            return err
    return None


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` addresses ``t``'s elements can touch (its strided extent)."""
    if t.numel() == 0:
        return 0, 0
    lo = hi = 0
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    e = t.element_size()
    p = t.data_ptr()
    return p + lo * e, p + (hi + 1) * e


def check_no_overlap(inp: torch.Tensor, out: torch.Tensor, allowed: torch.Tensor | None = None
                     ) -> str | None:
    """Why ``out`` may not be written while ``inp`` is read (their memory overlaps), or None.

    Chunked algorithms read ``inp`` chunk by chunk while writing ``out``, so overlapping
    memory would feed results back in. ``allowed``: an overlap that is exactly this region of
    ``out`` is fine (all_gather's input as this rank's own part of its output, as FSDP passes
    it: the bytes written there are the bytes read).
    """
    if inp.device != out.device:
        return None
    a0, a1 = _byte_range(inp)
    b0, b1 = _byte_range(out)
    if a0 >= b1 or b0 >= a1:
        return None
    if (allowed is not None and inp.is_contiguous() and allowed.is_contiguous()
            and _byte_range(allowed) == (a0, a1)):
        return None
    return ("input and output overlap in memory (output would overwrite input still to be "
            "read); pass separate tensors")


class Staging:
    """Contiguous, detached CPU views of user tensors, plus the copies back at the end.

    A tensor that already is contiguous on the CPU is used in place (no copy). Others (CUDA,
    non-contiguous) get a contiguous host copy; ``finish()`` (run by the worker after the data
    moved) copies the results back into the user's tensors. ``on_cuda``: a CUDA subclass
    (its job records an event for the caller's stream).
    """

    on_cuda = False

    def __init__(self) -> None:
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []

    @staticmethod
    def _direct(t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.is_contiguous()

    def input(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t if self._direct(t) else t.to("cpu").contiguous()

    def output(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if self._direct(t):
            return t
        tmp = torch.empty(t.shape, dtype=t.dtype)
        self._back.append((t, tmp))
        return tmp

    def inout(self, t: torch.Tensor, read: bool = True) -> torch.Tensor:
        t = t.detach()
        if self._direct(t):
            return t
        tmp = t.to("cpu").contiguous() if read else torch.empty(t.shape, dtype=t.dtype)
        if tmp.data_ptr() == t.data_ptr():
            tmp = tmp.clone()
        self._back.append((t, tmp))
        return tmp

    @staticmethod
    def scatter_into(o: torch.Tensor, row: torch.Tensor) -> None:
        """Copy a contiguous uint8 ``row`` holding ``o``'s bytes into ``o`` (any layout)."""
        if o.numel():  # an empty row of an [n, 0] tensor may sit at any byte offset
            o.detach().copy_(row.view(o.dtype).view(o.shape))

    def needed(self) -> bool:
        return bool(self._back)

    def finish(self) -> None:
        for t, tmp in self._back:
            t.copy_(tmp)

    @staticmethod
    def check_same_dtype(inp: torch.Tensor, out: torch.Tensor, what: str = "output") -> str | None:
        if inp.dtype != out.dtype:
            return (f"input dtype {str(inp.dtype)[6:]} differs from {what} dtype "
                    f"{str(out.dtype)[6:]}")
        return None

    @staticmethod
    def check_splits(inp: torch.Tensor, out: torch.Tensor, in_splits: list[int],
                     out_splits: list[int], n: int) -> tuple[list[int], list[int], str | None]:
        """Resolve all_to_all split sizes (rows of dim 0 per rank); empty means even splits."""
        if inp.dim() == 0 or out.dim() == 0:
            return [], [], "input and output must have at least one dimension"
        if tuple(inp.shape[1:]) != tuple(out.shape[1:]):
            return [], [], f"input shape {list(inp.shape)} and output shape {list(out.shape)} " \
                           "differ beyond the first dimension"
        res = []
        for t, splits, arg, targ in ((inp, in_splits, "input_split_sizes", "input"),
                                     (out, out_splits, "output_split_sizes", "output")):
            rows = t.shape[0]
            if not splits:
                if rows % n:
                    return [], [], f"{targ}'s first dimension {rows} is not divisible by the " \
                                   f"group size {n} and no {arg} were given"
                res.append([rows // n] * n)
                continue
            if len(splits) != n:
                return [], [], f"{arg} has {len(splits)} entries, expected the group size {n}"
            if not all(hasattr(type(s), "__index__") for s in splits):
                return [], [], f"{arg} {splits!r:.200} must be ints"
            if any(s < 0 for s in splits):
                return [], [], f"{arg} {splits} has a negative entry"
            if sum(splits) != rows:
                return [], [], f"{arg} {splits} sum to {sum(splits)} but {targ} has {rows} " \
                               "rows in dim 0"
            res.append([int(s) for s in splits])
        return res[0], res[1], None


def check_all_gather(inp, out, n: int, rank: int = 0) -> str | None:
    """all_gather_into_tensor: ``inp [*] -> out`` of ``n * inp.numel()`` elements, one dtype;
    ``inp`` may be exactly this rank's part of ``out`` (no other overlap)."""
    err = (check_tensor(inp, "input_tensor") or check_tensor(out, "output_tensor", True)
           or Staging.check_same_dtype(inp, out))
    if not err and out.numel() != n * inp.numel():
        err = (f"output_tensor has {out.numel()} elements but the group size {n} times "
               f"input_tensor's {inp.numel()} is {n * inp.numel()}")
    if not err and out.is_contiguous():
        m = inp.numel()
        err = check_no_overlap(inp, out, out.view(-1)[rank * m:(rank + 1) * m])
    elif not err:
        err = check_no_overlap(inp, out)
    return err


def check_reduce_scatter(inp, out, n: int) -> str | None:
    """reduce_scatter_tensor: ``inp [n * N, ...] -> out [N, ...]`` (or any ``out`` of
    ``inp.numel() / n`` elements and another rank), one dtype, no overlap."""
    err = (check_tensor(inp, "input") or check_tensor(out, "output", True)
           or Staging.check_same_dtype(inp, out))
    if not err and inp.dim() > 0 and inp.shape[0] % n and out.dim() == inp.dim():
        err = f"input's first dimension {inp.shape[0]} is not divisible by the group size {n}"
    if not err and inp.numel() != n * out.numel():
        err = (f"output has {out.numel()} elements but input's {inp.numel()} elements "
               f"divided by the group size {n} is {inp.numel() / n:g}")
    return err or check_no_overlap(inp, out)
