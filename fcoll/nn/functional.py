"""Autograd collectives: ``torch.distributed.nn.functional`` on fcoll's functional ops.

Same names, arguments, results and gradient formulas as ``torch.distributed.nn.functional``
(torch 2.13), but every collective is an fcoll functional op, so ``torch.compile`` traces them
with no graph break (PyTorch's raise under compile), on any group and backend (fcoll, gloo,
nccl). Each function is a ``torch.autograd.Function`` whose forward waits for its collective
and whose backward runs the adjoint collective, as PyTorch's do (PyTorch's backward applies the
adjoint ``Function``, so it is differentiable again; fcoll's backward is not):

=====================  ===========================================  ==========================
function               forward (rank r of n, group ranks)           backward
=====================  ===========================================  ==========================
broadcast(t, src)      src's ``t``                                  reduce(sum) to src; zeros
                                                                    elsewhere
gather(t, dst)         n tensors: everyone's ``t`` on dst, zeros     scatter from dst
                       elsewhere
scatter(ts, src)       src's ``ts[r]``                              gather to src
reduce(t, dst, op)     the reduction on dst (every rank gets it:    broadcast from dst
                       PyTorch leaves the others unspecified)
reduce_scatter(o, ts)  ``sum_k ts_k[r]``                            all_gather
all_gather(t)          n tensors, rank k's ``t``                    reduce_scatter(sum)
all_to_all(os, is)     ``os[k] <- rank k's is[r]``                  all_to_all of the grads
all_to_all_single      ``all_to_all_single``                        the same, splits swapped
all_reduce(t, op)      the reduction                                all_reduce(grad, op)
=====================  ===========================================  ==========================

Ranks (``src``, ``dst``) are global ranks, as in ``torch.distributed``. ``group`` is a
``ProcessGroup`` (default: WORLD) or any form :func:`fcoll.ops.groups.resolve_group_name`
takes. Deliberate differences: nothing warns (PyTorch deprecates most of these), results are
new tensors (``reduce_scatter``, ``all_to_all`` and ``all_to_all_single`` do not write into
their ``output`` arguments, which only give shapes), and ``reduce`` gives every rank the
reduction.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd import Function

from fcoll.ops import functional as F
from fcoll.ops.async_tensor import AsyncCollectiveTensor
from fcoll.ops.groups import group_size, resolve_group_name
from fcoll.ops.remaps import group_rank_of, rank_in, reduce_op_name

__all__ = ["broadcast", "gather", "scatter", "reduce", "reduce_scatter", "all_gather",
           "all_to_all", "all_to_all_single", "all_reduce"]

ReduceOp = dist.ReduceOp


def _name(group) -> str:
    return resolve_group_name(dist.group.WORLD if group is None else group)


def _done(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _root(name: str, global_rank: int) -> int:
    return group_rank_of(name, global_rank)


# ---------------------------------------------------------------------------------------------
# Public functions

def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Every rank gets global rank ``src``'s ``tensor`` (``[*]``, any dtype).

    Gradient: the sum of every rank's gradient on ``src``, zeros elsewhere."""
    return _Broadcast.apply(src, _name(group), tensor)


def gather(tensor: torch.Tensor, dst: int = 0, group=None) -> tuple[torch.Tensor, ...]:
    """A tuple of ``n`` tensors of ``tensor``'s shape: on ``dst`` rank ``k``'s ``tensor`` at
    ``k`` (group ranks), zeros on the other ranks. Gradient: ``dst``'s gradient ``k`` goes to
    rank ``k``."""
    return _Gather.apply(dst, _name(group), tensor)


def scatter(tensors: list[torch.Tensor], src: int = 0, group=None) -> torch.Tensor:
    """Group rank ``r`` gets ``src``'s ``tensors[r]``; every rank passes ``n`` tensors of one
    shape (only ``src``'s values are read). Gradient: on ``src``, rank ``k``'s gradient for
    ``tensors[k]``; zeros elsewhere.

    Raises:
        ValueError: the tensors differ in shape, or there are not ``n`` of them.
    """
    return _Scatter.apply(src, _name(group), *tensors)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    """The reduction of every rank's ``tensor`` with ``op`` (a ``dist.ReduceOp``); fcoll gives
    it to every rank, where PyTorch defines it on ``dst`` only. Gradient: ``dst``'s gradient,
    broadcast (PyTorch's formula, whatever ``op``)."""
    return _Reduce.apply(dst, op, _name(group), tensor)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op=ReduceOp.SUM,
                   group=None) -> torch.Tensor:
    """Group rank ``r`` gets the reduction of every rank's ``input_list[r]`` (``n`` tensors of
    ``output``'s shape). Returns a new tensor; ``output`` gives the shape and is not written.
    Gradient: all_gather of the gradient."""
    return _ReduceScatter.apply(op, _name(group), output, *input_list)


def all_gather(tensor: torch.Tensor, group=None) -> tuple[torch.Tensor, ...]:
    """A tuple of ``n`` tensors, group rank ``k``'s ``tensor`` at ``k``. Gradient: the sum over
    ranks of their gradient ``r``, on rank ``r`` (reduce_scatter)."""
    return _AllGather.apply(_name(group), tensor)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group=None) -> tuple[torch.Tensor, ...]:
    """``result[k]`` (shaped like ``output_tensor_list[k]``) is rank ``k``'s
    ``input_tensor_list[r]``. One ``all_to_all_single`` of the flattened tensors. Gradient: the
    all_to_all of the gradients."""
    return _AllToAll.apply(_name(group), output_tensor_list, *input_tensor_list)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, group=None) -> torch.Tensor:
    """``input [sum(in_splits), *] -> [sum(out_splits), *]`` (``output``'s shape); a None or
    empty split list splits that tensor's dim 0 evenly. Gradient: the same exchange of the
    gradient with the splits swapped."""
    return _AllToAllSingle.apply(_name(group), output, output_split_sizes, input_split_sizes,
                                 input)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    """The reduction of every rank's ``tensor`` with ``op``. Gradient: all_reduce of the
    gradient with the same ``op`` (PyTorch's formula)."""
    return _AllReduce.apply(op, _name(group), tensor)


# ---------------------------------------------------------------------------------------------
# The collectives, waited (plain functions: a forward and the adjoint's backward both call them;
# Dynamo cannot trace an autograd.Function applied inside another's backward)

def _broadcast(src, name, tensor):
    return _done(F.broadcast(tensor, _root(name, src), name))


def _reduce(dst, op, name, tensor):
    return _done(F.all_reduce(tensor, reduce_op_name(op, "reduce"), name))


def _all_reduce(op, name, tensor):
    return _done(F.all_reduce(tensor, reduce_op_name(op, "all_reduce"), name))


def _all_gather(name, tensor):
    out = _done(F.all_gather_single(tensor.contiguous().unsqueeze(0), 0, name))
    return tuple(out[k] for k in range(group_size(name)))


def _reduce_scatter(op, name, shape, inputs):
    n = group_size(name)
    if len(inputs) != n:
        raise ValueError(f"fcoll.nn.functional.reduce_scatter: {len(inputs)} inputs for a "
                         f"group of {n} ranks")
    stacked = torch.stack([t.contiguous() for t in inputs])
    out = F.reduce_scatter_single(stacked, reduce_op_name(op, "reduce_scatter"), 0, name)
    return _done(out).reshape(shape)


def _gather(dst, name, tensor):
    out = _all_gather(name, tensor)
    if rank_in(name) != _root(name, dst):
        out = tuple(torch.zeros_like(t) for t in out)
    return out


def _scatter(src, name, tensors):
    n = group_size(name)
    if len(tensors) != n or any(t.shape != tensors[0].shape for t in tensors):
        raise ValueError(f"fcoll.nn.functional.scatter: expected {n} tensors of one shape, "
                         f"got shapes {[list(t.shape) for t in tensors]}")
    numel, root = tensors[0].numel(), _root(name, src)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if rank_in(name) == root:
        in_splits = [numel] * n
    else:
        flat, in_splits = flat[:0], [0] * n
    out_splits = [numel if k == root else 0 for k in range(n)]
    return _done(F.all_to_all_single(flat, out_splits, in_splits, name)).view(tensors[0].shape)


def _all_to_all(name, out_shapes, inputs):
    flat = torch.cat([t.reshape(-1) for t in inputs])
    numels = [math.prod(s) for s in out_shapes]
    out = _done(F.all_to_all_single(flat, numels, [t.numel() for t in inputs], name))
    return tuple(c.view(s) for c, s in zip(torch.split(out, numels), out_shapes))


def _all_to_all_single(name, out_shape, out_splits, in_splits, input):
    out = _done(F.all_to_all_single(input.contiguous(), out_splits, in_splits, name))
    return out.view(out_shape)


# ---------------------------------------------------------------------------------------------
# Autograd functions: forward and backward as PyTorch's (backward = the adjoint collective)

class _Broadcast(Function):
    @staticmethod
    def forward(ctx, src, name, tensor):
        ctx.src, ctx.name = src, name
        return _broadcast(src, name, tensor)

    @staticmethod
    def backward(ctx, grad):
        gx = _reduce(ctx.src, ReduceOp.SUM, ctx.name, grad)
        if rank_in(ctx.name) != _root(ctx.name, ctx.src):
            gx = torch.zeros_like(gx)
        return None, None, gx


class _Reduce(Function):
    @staticmethod
    def forward(ctx, dst, op, name, tensor):
        ctx.dst, ctx.name = dst, name
        return _reduce(dst, op, name, tensor)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, _broadcast(ctx.dst, ctx.name, grad)


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, op, name, tensor):
        ctx.op, ctx.name = op, name
        return _all_reduce(op, name, tensor)

    @staticmethod
    def backward(ctx, grad):
        return None, None, _all_reduce(ctx.op, ctx.name, grad)


class _AllGather(Function):
    @staticmethod
    def forward(ctx, name, tensor):
        ctx.name = name
        return _all_gather(name, tensor)

    @staticmethod
    def backward(ctx, *grads):
        return None, _reduce_scatter(ReduceOp.SUM, ctx.name, grads[0].shape, grads)


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, op, name, output, *inputs):
        ctx.name = name
        return _reduce_scatter(op, name, output.shape, inputs)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None) + _all_gather(ctx.name, grad)


class _Gather(Function):
    @staticmethod
    def forward(ctx, dst, name, tensor):
        ctx.dst, ctx.name = dst, name
        return _gather(dst, name, tensor)

    @staticmethod
    def backward(ctx, *grads):
        return None, None, _scatter(ctx.dst, ctx.name, grads)


class _Scatter(Function):
    @staticmethod
    def forward(ctx, src, name, *tensors):
        ctx.src, ctx.name = src, name
        return _scatter(src, name, tensors)

    @staticmethod
    def backward(ctx, grad):
        return (None, None) + _gather(ctx.src, ctx.name, grad)


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, name, outputs, *inputs):
        ctx.name = name
        ctx.input_shapes = [tuple(t.shape) for t in inputs]
        return _all_to_all(name, [tuple(o.shape) for o in outputs], inputs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + _all_to_all(ctx.name, ctx.input_shapes, grads)


def _even(splits, t: torch.Tensor, n: int) -> list:
    return list(splits) if splits else [t.shape[0] // n] * n


class _AllToAllSingle(Function):
    @staticmethod
    def forward(ctx, name, output, output_split_sizes, input_split_sizes, input):
        n = group_size(name)
        out_splits = _even(output_split_sizes, output, n)
        in_splits = _even(input_split_sizes, input, n)
        ctx.name, ctx.input_shape = name, tuple(input.shape)
        ctx.out_splits, ctx.in_splits = out_splits, in_splits
        return _all_to_all_single(name, tuple(output.shape), out_splits, in_splits, input)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, None,
                _all_to_all_single(ctx.name, ctx.input_shape, ctx.in_splits, ctx.out_splits,
                                   grad))
