"""Whole-call argument checks of the c10d ``ProcessGroup`` methods, as error messages: the one
per-call check module of both fcoll process groups.

Each function returns why a call's arguments are invalid on this rank (a message naming the
argument, as ``"output_tensors[1] has 5 elements, input_tensors[0] has 4"``), or None. Nothing
here raises or communicates: the caller tells its peers before raising, so every rank fails
the same call (:class:`~fcoll.shm.group.process_group.FcollProcessGroup` in an invalid call's
header, :class:`~fcoll.shm.multihost.hierarchical.HierarchicalProcessGroup` through its
pre-flight step). The tensor-level checks are :mod:`fcoll.shm.group.validate`'s, so a call is
refused for the same reasons, in the same words, on a group of one host or of several. What
only one group can check (the CUDA device of a one-host group's tensors) is added by that
group after these.
"""

from __future__ import annotations

import torch

from fcoll.ops.reduce import check_reduce_op
from fcoll.shm.group.identity import DEVICE_TYPES
from fcoll.shm.group.validate import (
    Staging,
    check_no_overlap,
    check_reduce_scatter,
    check_tensor,
)

__all__ = [
    "all_gather_list_error",
    "all_reduce_error",
    "all_to_all_error",
    "all_to_all_single_error",
    "broadcast_error",
    "coalesced_all_reduce_error",
    "first",
    "gather_error",
    "inputs_like_error",
    "is_seq",
    "list_error",
    "pairs_error",
    "reduce_scatter_list_error",
    "reduce_scatter_tensor_error",
    "scatter_error",
    "tensor_or_none",
]


def is_seq(x) -> bool:
    return isinstance(x, (list, tuple))


def first(xs):
    """``xs[0]`` when ``xs`` is a non-empty list or tuple, else None (the tensor a call's
    header describes, whatever the user passed)."""
    return xs[0] if is_seq(xs) and xs else None


def list_error(arg: str, x, n: int) -> str | None:
    """Why ``x`` is not a list (or tuple) of ``n`` items, or None."""
    if not is_seq(x):
        return f"{arg} must be a list of {n} tensors, got {type(x).__name__}"
    if len(x) != n:
        return f"{arg} has {len(x)} entries, expected {n}"
    return None


def pairs_error(a: str, xs, b: str, ys) -> str | None:
    """Why ``xs`` and ``ys`` are not two lists of one length (a coalesced call), or None."""
    if not (is_seq(xs) and is_seq(ys)):
        return f"{a} and {b} must be lists, got {type(xs).__name__} and {type(ys).__name__}"
    if len(xs) != len(ys):
        return f"{a} has {len(xs)} entries but {b} has {len(ys)}"
    return None


def _root_error(root: int, n: int, what: str = "root") -> str | None:
    if not 0 <= root < n:
        return f"{what} {root} is out of range for a group of size {n}"
    return None


def all_reduce_error(tensors, op: str, n: int, root: int | None = None) -> str | None:
    """all_reduce / reduce: ``tensors`` is ``[t]``, ``t`` written in place; ``op`` defined
    for ``t.dtype``; ``root`` (reduce) a group rank."""
    if not is_seq(tensors) or len(tensors) != 1:
        got = len(tensors) if is_seq(tensors) else type(tensors).__name__
        return f"tensors: expects 1 tensor, got {got}"
    t = tensors[0]
    err = check_tensor(t, "tensor", True) or check_reduce_op(op, t.dtype)
    if err is None and root is not None:
        err = _root_error(root, n)
    return err


def coalesced_all_reduce_error(inputs, outputs, op: str) -> str | None:
    """all_reduce_coalesced: every ``inputs[i]`` (written in place when ``outputs`` is None)
    valid for ``op``; ``outputs[i]`` of ``inputs[i]``'s shape and dtype."""
    if outputs is not None:
        err = pairs_error("inputs", inputs, "outputs", outputs)
        if err:
            return err
    elif not is_seq(inputs):
        return f"tensors must be a list of tensors, got {type(inputs).__name__}"
    for i, x in enumerate(inputs):
        err = check_tensor(x, f"tensors[{i}]", outputs is None)
        if err is None:
            err = check_reduce_op(op, x.dtype)
            err = f"tensors[{i}]: {err}" if err else None
        if err is None and outputs is not None:
            y = outputs[i]
            err = check_tensor(y, f"outputs[{i}]", True)
            if err is None and (y.shape != x.shape or y.dtype != x.dtype):
                err = (f"outputs[{i}] {tuple(y.shape)} {y.dtype} does not match "
                       f"tensors[{i}] {tuple(x.shape)} {x.dtype}")
        if err:
            return err
    return None


def all_gather_list_error(output_tensors, input_tensors, n: int, rank: int) -> str | None:
    """all_gather (list form): ``input_tensors == [x]``; ``output_tensors == [[o_0 .. o_n-1]]``,
    each ``o_i`` of ``x``'s dtype and number of elements, none overlapping ``x`` but this
    rank's own."""
    err = list_error("input_tensors", input_tensors, 1) or list_error(
        "output_tensors", output_tensors, 1)
    if not err:
        err = (list_error("output_tensors", output_tensors[0], n)
               or check_tensor(input_tensors[0], "input_tensors[0]"))
    if err:
        return err
    inp = input_tensors[0]
    for i, o in enumerate(output_tensors[0]):
        arg = f"output_tensors[{i}]"
        err = (check_tensor(o, arg, True) or Staging.check_same_dtype(inp, o, arg)
               or (None if o.numel() == inp.numel() else
                   f"{arg} has {o.numel()} elements, input_tensors[0] has {inp.numel()}")
               or check_no_overlap(inp, o, o if i == rank else None))
        if err:
            return err
    return None


def reduce_scatter_tensor_error(output, input, op: str, n: int) -> str | None:  # noqa: A002
    """reduce_scatter_tensor: ``input [n * N, ...] -> output [N, ...]``, ``op`` defined for
    the dtype."""
    return check_reduce_scatter(input, output, n) or check_reduce_op(op, input.dtype)


def inputs_like_error(xs, out, arg: str = "input_tensors",
                      out_arg: str = "output_tensors[0]", same_shape: bool = False) -> str | None:
    """Why some ``xs[i]`` (argument ``arg[i]``, read) is not a tensor of ``out``'s dtype and
    number of elements (``same_shape``: and shape), or None (the list inputs of reduce_scatter
    and, shape included, scatter)."""
    for i, x in enumerate(xs):
        name = f"{arg}[{i}]"
        err = check_tensor(x, name) or Staging.check_same_dtype(x, out)
        if err is None and same_shape and x.shape != out.shape:
            err = f"{name} has shape {list(x.shape)}, {out_arg} has {list(out.shape)}"
        elif err is None and not same_shape and x.numel() != out.numel():
            err = f"{name} has {x.numel()} elements, {out_arg} has {out.numel()}"
        if err:
            return err
    return None


def reduce_scatter_list_error(output_tensors, input_lists, op: str, n: int) -> str | None:
    """reduce_scatter (list form): ``output_tensors == [out]``, ``input_lists == [[x_0 ..
    x_n-1]]``, each ``x_i`` of ``out``'s dtype and number of elements."""
    err = list_error("output_tensors", output_tensors, 1) or list_error(
        "input_tensors", input_lists, 1)
    err = err or list_error("input_tensors", input_lists[0], n) or check_tensor(
        output_tensors[0], "output_tensors[0]", True)
    if err:
        return err
    out = output_tensors[0]
    err = inputs_like_error(input_lists[0], out)
    for x in input_lists[0] if err is None else ():
        err = check_no_overlap(x, out)
        if err:
            break
    return err or check_reduce_op(op, out.dtype)


def all_to_all_single_error(output, input, output_split_sizes, input_split_sizes,  # noqa: A002
                            n: int) -> str | None:
    """all_to_all_single: splits (rows of dim 0 per rank; empty: even) that split ``input``
    and ``output``; one dtype; no overlap."""
    err = check_tensor(input, "input") or check_tensor(output, "output", True)
    if err is None:
        _, _, err = Staging.check_splits(input, output, list(input_split_sizes or []),
                                         list(output_split_sizes or []), n)
    return err or Staging.check_same_dtype(input, output) or check_no_overlap(input, output)


def all_to_all_error(output_tensors, input_tensors, n: int) -> str | None:
    """all_to_all (list form): ``n`` inputs and ``n`` outputs, one dtype."""
    err = list_error("input_tensors", input_tensors, n) or list_error(
        "output_tensors", output_tensors, n)
    if err:
        return err
    named = ([(f"input_tensors[{i}]", t, False) for i, t in enumerate(input_tensors)]
             + [(f"output_tensors[{i}]", t, True) for i, t in enumerate(output_tensors)])
    for arg, t, write in named:
        err = check_tensor(t, arg, write)
        if err:
            return err
    first = input_tensors[0].dtype
    for arg, t, _ in named:
        if t.dtype != first:
            return (f"{arg} has dtype {str(t.dtype)[6:]} but input_tensors[0] has "
                    f"{str(first)[6:]}; one dtype for every tensor")
    return None


def broadcast_error(tensors, root: int, n: int) -> str | None:
    """broadcast: ``tensors == [t]``, ``root`` a group rank."""
    if not is_seq(tensors) or len(tensors) != 1:
        got = len(tensors) if is_seq(tensors) else type(tensors).__name__
        return f"tensors: expects 1 tensor, got {got}"
    return _root_error(root, n, "root (src)") or check_tensor(tensors[0], "tensor", True)


def gather_error(output_lists, input_tensors, root: int, rank: int, n: int) -> str | None:
    """gather: ``input_tensors == [x]``; on the root, ``output_lists == [[o_0 .. o_n-1]]``
    of ``x``'s dtype and size."""
    err = list_error("input_tensors", input_tensors, 1)
    err = err or check_tensor(input_tensors[0], "input_tensors[0]")
    err = err or _root_error(root, n, "root (dst)")
    if err is None and rank == root:
        err = all_gather_list_error(output_lists, input_tensors, n, rank)
    return err


def scatter_error(output_tensors, input_lists, root: int, rank: int, n: int) -> str | None:
    """scatter: ``output_tensors == [out]``; on the root, ``input_lists == [[x_0 .. x_n-1]]``
    of ``out``'s dtype and shape."""
    err = list_error("output_tensors", output_tensors, 1)
    err = err or check_tensor(output_tensors[0], "output_tensors[0]", True)
    err = err or _root_error(root, n, "root (src)")
    if err is None and rank == root:
        err = (list_error("input_tensors", input_lists, 1)
               or list_error("input_tensors", input_lists[0], n)
               or inputs_like_error(input_lists[0], output_tensors[0], same_shape=True))
    return err


def tensor_or_none(x) -> torch.Tensor | None:
    """``x`` if it is a tensor with data (for a header's dtype and shape), else None."""
    return x if isinstance(x, torch.Tensor) and x.device.type in DEVICE_TYPES else None
