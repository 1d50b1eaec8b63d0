"""Functional collectives: the Python API, a drop-in for ``torch.distributed._functional_collectives``.

Every function has the name, argument order and semantics of its PyTorch counterpart. ``group``
is any form :func:`fcoll.ops.groups.resolve_group_name` accepts. Inputs are never modified. In
eager mode results are :class:`fcoll.AsyncCollectiveTensor`\\ s that wait on first real use; while
tracing (Dynamo, ``make_fx``, fake mode) ``fcoll.wait_tensor`` is emitted right after each
collective and the graph passes move it.

Shapes are per rank; ``n`` is the group size.

Under PyTorch's ``LocalTensorMode`` (every rank simulated in one process) each function runs
PyTorch's twin op instead of fcoll's (:func:`_op`): the mode recognises collectives by their
``_c10d_functional`` namespace and simulates them across the
ranks; an op of another namespace would run once per rank on the fake process group and return
each rank's own data. The results are then complete (the mode computes them synchronously).
"""

from __future__ import annotations

import math

import torch

from fcoll.ops import autograd as _autograd  # noqa: F401  registers backward formulas
from fcoll.ops.async_tensor import AsyncCollectiveTensor, TorchACT, complete, is_tracing, \
    wrap_async
from fcoll.ops.groups import GroupLike, group_rank, group_size, resolve_group_name

__all__ = [
    "all_reduce", "all_reduce_coalesced", "all_gather_single", "all_gather_single_autograd",
    "all_gather_single_coalesced", "all_gather_tensor", "all_gather_tensor_autograd",
    "all_gather_into_tensor_coalesced", "reduce_scatter_single", "reduce_scatter_single_autograd",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
    "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all_single_autograd",
    "broadcast", "wait_tensor",
]

_ops = torch.ops.fcoll

try:
    from torch.distributed._local_tensor import local_tensor_mode as _local_tensor_mode
except ImportError:  # a torch without LocalTensorMode
    def _local_tensor_mode() -> None:
        return None

def _op(name: str):
    """The op that runs collective ``name``: ``torch.ops.fcoll.<name>``, or under
    ``LocalTensorMode`` its ``_c10d_functional`` twin (same schema), which the mode simulates
    across ranks and which has PyTorch's own backward formula."""
    if _local_tensor_mode() is None:
        return getattr(_ops, name)
    return getattr(torch.ops._c10d_functional, name)


def _finish(t: torch.Tensor) -> torch.Tensor:
    if is_tracing():
        return _ops.wait_tensor(t)
    if _local_tensor_mode() is not None:  # computed already; retire c10d's registered work
        return t if t.requires_grad else torch.ops._c10d_functional.wait_tensor(t)
    return wrap_async(t)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """Wait for ``t`` if it is an ``AsyncCollectiveTensor`` (fcoll's or PyTorch's); a
    collective needs real values."""
    return t.trigger_wait() if isinstance(t, TorchACT) else t


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Wait for the collective that produces ``tensor`` and return its values.

    Works on an ``AsyncCollectiveTensor`` (fcoll's, or PyTorch's), or on the raw output of a
    ``torch.ops.fcoll`` (or ``_c10d_functional``) op.
    """
    if isinstance(tensor, TorchACT):
        return tensor.trigger_wait()
    return complete(tensor)


def all_reduce(self: torch.Tensor, reduceOp: str, group: GroupLike, tag: str = "") -> torch.Tensor:
    """Reduce ``self`` across the group; every rank gets the result.

    Args:
        self: ``[*]`` tensor of any supported dtype.
        reduceOp: "sum", "avg", "product", "min", "max", or "band"/"bor"/"bxor" (integer and
            bool dtypes only). Case-insensitive, as in PyTorch.
        group: the process group (any accepted form).

    Returns:
        ``[*]``, same dtype.

    Raises:
        ValueError: unknown reduce op, or a bitwise op on a floating dtype.
    """
    name = resolve_group_name(group, tag)
    return _finish(_op("all_reduce")(_plain(self), reduceOp.lower(), name))


def all_reduce_coalesced(self: list[torch.Tensor], reduceOp: str, group: GroupLike,
                         tag: str = "") -> list[torch.Tensor]:
    """``all_reduce`` of each tensor of ``self`` as one coalesced collective."""
    name = resolve_group_name(group, tag)
    outs = _op("all_reduce_coalesced")([_plain(t) for t in self], reduceOp.lower(), name)
    return [_finish(o) for o in outs]


def _dim_index(dim: int, t: torch.Tensor, arg: str, op: str, group_name: str) -> int:
    """``dim`` as an index ``0 <= d < t.dim()`` (a 0-dim ``t`` counts as 1-dim, as its
    gathered result ``[n]`` is), checked before the collective is issued.

    Raises:
        IndexError: ``dim`` outside ``[-t.dim(), t.dim())``; names the op, the argument, the
            rank and the shape.
    """
    ndim = max(t.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"fcoll.{op}: rank {group_rank(group_name)}: {arg}={dim} is out of "
                         f"range for an input of shape {list(t.shape)} (expected "
                         f"{-ndim} <= {arg} < {ndim})")
    return dim % ndim


def _chunks_to_gather_dim(out: torch.Tensor, n: int, gather_dim: int) -> torch.Tensor:
    """``cat(chunk(out, n, 0), gather_dim)`` of a gathered ``out [n * N, *]``; ``gather_dim``
    non-negative (:func:`_dim_index`).

    A view (so an ``AsyncCollectiveTensor`` stays in flight) when every dim the chunks move
    across has size 1, i.e. ``N == 1`` and dims ``1 .. gather_dim - 1`` are 1, which is
    PyTorch's rule (``torch._utils._maybe_view_chunk_cat``); otherwise the data must move, so
    an async ``out`` is waited for first, as PyTorch does.
    """
    if gather_dim == 0 or out.dim() == 0:
        return out
    shape = list(out.shape)
    if shape[0] == n and math.prod(shape[1:gather_dim]) == 1:
        return out.view(1, *shape[1:gather_dim], n * shape[gather_dim],
                        *shape[gather_dim + 1:])
    if isinstance(out, AsyncCollectiveTensor):
        out = out.wait()
    return torch.cat(torch.chunk(out, n, dim=0), dim=gather_dim)


def all_gather_single(self: torch.Tensor, gather_dim: int, group: GroupLike,
                      tag: str = "") -> torch.Tensor:
    """Concatenate every rank's ``self`` along ``gather_dim``, in rank order.

    Shapes: ``self [*, N, *]`` -> ``[*, n * N, *]`` with ``N`` at ``gather_dim``; a 0-dim
    ``self`` gives ``[n]``. Same dtype. With ``gather_dim != 0`` the result is still an
    ``AsyncCollectiveTensor`` when the rearrangement is a view (see ``_chunks_to_gather_dim``).
    A negative ``gather_dim`` counts from the end, also where the result is a view (PyTorch
    2.13's funcol raises a reshape error there, e.g. ``[1, 3]`` with ``gather_dim=-1``).

    Raises:
        IndexError: ``gather_dim`` out of range for ``self``, before anything is issued.
    """
    name = resolve_group_name(group, tag)
    n = group_size(name)
    t = _plain(self)
    gather_dim = _dim_index(gather_dim, t, "gather_dim", "all_gather_tensor", name)
    if not t.is_contiguous():  # a node only where needed: PyTorch's graph has none
        t = t.contiguous()
    out = _finish(_op("all_gather_into_tensor")(t, n, name))
    return _chunks_to_gather_dim(out, n, gather_dim)


def all_gather_single_autograd(self: torch.Tensor, gather_dim: int, group: GroupLike,
                               tag: str = "") -> torch.Tensor:
    """Same as :func:`all_gather_single` (which already supports autograd)."""
    return all_gather_single(self, gather_dim, group, tag)


def all_gather_tensor(self: torch.Tensor, gather_dim: int, group: GroupLike,
                      tag: str = "") -> torch.Tensor:
    """:func:`all_gather_single` under its pre-2.13 name (kept, without 2.13's warning)."""
    return all_gather_single(self, gather_dim, group, tag)


def all_gather_tensor_autograd(self: torch.Tensor, gather_dim: int, group: GroupLike,
                               tag: str = "") -> torch.Tensor:
    """Same as :func:`all_gather_single` (which already supports autograd)."""
    return all_gather_single(self, gather_dim, group, tag)


def all_gather_single_coalesced(self: list[torch.Tensor], group: GroupLike,
                                tag: str = "") -> list[torch.Tensor]:
    """``all_gather_single(t, 0, group)`` for each ``t`` of ``self``, as one collective:
    ``[N_i, *] -> [n * N_i, *]``."""
    name = resolve_group_name(group, tag)
    outs = _op("all_gather_into_tensor_coalesced")([_plain(t) for t in self], group_size(name),
                                                 name)
    return [_finish(o) for o in outs]


def all_gather_into_tensor_coalesced(self: list[torch.Tensor], group: GroupLike,
                                     tag: str = "") -> list[torch.Tensor]:
    """:func:`all_gather_single_coalesced` under its pre-2.13 name."""
    return all_gather_single_coalesced(self, group, tag)


def _scatter_dim_first(t: torch.Tensor, scatter_dim: int, n: int, op: str,
                       group_name: str) -> torch.Tensor:
    t = _plain(t)
    if t.dim() > 0:
        scatter_dim = _dim_index(scatter_dim, t, "scatter_dim", op, group_name)
    if t.dim() == 0 or t.size(scatter_dim) % n != 0:
        raise ValueError(f"fcoll.{op}: input dim {scatter_dim} of shape {list(t.shape)} must be "
                         f"divisible by the group size {n}")
    if scatter_dim != 0:
        t = torch.cat(torch.chunk(t, n, dim=scatter_dim))
    return t


def reduce_scatter_single(self: torch.Tensor, reduceOp: str, scatter_dim: int,
                          group: GroupLike, tag: str = "") -> torch.Tensor:
    """Reduce ``self`` across the group and give rank ``r`` the ``r``-th chunk along ``scatter_dim``.

    Shapes: ``self [*, n * N, *]`` -> ``[*, N, *]`` with ``n * N`` at ``scatter_dim``.

    Raises:
        ValueError: ``self.size(scatter_dim)`` is not divisible by the group size; bad reduce op.
        IndexError: ``scatter_dim`` out of range for ``self``.
    """
    name = resolve_group_name(group, tag)
    n = group_size(name)
    t = _scatter_dim_first(self, scatter_dim, n, "reduce_scatter_tensor", name)
    # With scatter_dim != 0 the chunks were stacked along dim 0, so rank r's output is the r-th
    # chunk along scatter_dim exactly, with no reshuffle afterwards (as PyTorch does it).
    return _finish(_op("reduce_scatter_tensor")(t, reduceOp.lower(), n, name))


def reduce_scatter_single_autograd(self: torch.Tensor, reduceOp: str, scatter_dim: int,
                                   group: GroupLike, tag: str = "") -> torch.Tensor:
    """Same as :func:`reduce_scatter_single` (which already supports autograd)."""
    return reduce_scatter_single(self, reduceOp, scatter_dim, group, tag)


def reduce_scatter_tensor(self: torch.Tensor, reduceOp: str, scatter_dim: int,
                          group: GroupLike, tag: str = "") -> torch.Tensor:
    """:func:`reduce_scatter_single` under its pre-2.13 name (kept, without 2.13's warning)."""
    return reduce_scatter_single(self, reduceOp, scatter_dim, group, tag)


def reduce_scatter_tensor_autograd(self: torch.Tensor, reduceOp: str, scatter_dim: int,
                                   group: GroupLike, tag: str = "") -> torch.Tensor:
    """Same as :func:`reduce_scatter_single` (which already supports autograd)."""
    return reduce_scatter_single(self, reduceOp, scatter_dim, group, tag)


def reduce_scatter_tensor_coalesced(inputs: list[torch.Tensor], reduceOp: str,
                                    scatter_dim: list[int], group: GroupLike,
                                    tag: str = "") -> list[torch.Tensor]:
    """:func:`reduce_scatter_single_coalesced` under its pre-2.13 name."""
    return reduce_scatter_single_coalesced(inputs, reduceOp, scatter_dim, group, tag)


def reduce_scatter_single_coalesced(inputs: list[torch.Tensor], reduceOp: str,
                                    scatter_dim: list[int], group: GroupLike,
                                    tag: str = "") -> list[torch.Tensor]:
    """``reduce_scatter_tensor`` of each input along its ``scatter_dim``, as one collective."""
    name = resolve_group_name(group, tag)
    n = group_size(name)
    if len(scatter_dim) != len(inputs):
        raise ValueError(f"fcoll.reduce_scatter_tensor_coalesced: scatter_dim has "
                         f"{len(scatter_dim)} entries for {len(inputs)} inputs")
    ts = [_scatter_dim_first(t, d, n, "reduce_scatter_tensor_coalesced", name)
          for t, d in zip(inputs, scatter_dim)]
    outs = _op("reduce_scatter_tensor_coalesced")(ts, reduceOp.lower(), n, name)
    return [_finish(o) for o in outs]


def all_to_all_single(self: torch.Tensor, output_split_sizes: list[int] | None,
                      input_split_sizes: list[int] | None, group: GroupLike,
                      tag: str = "") -> torch.Tensor:
    """Send ``self``'s ``i``-th dim-0 slice to rank ``i``; receive rank ``i``'s slice into slot ``i``.

    Shapes: ``self [sum(input_split_sizes), *]`` -> ``[sum(output_split_sizes), *]``. With both
    split lists None, dim 0 is split evenly (``[N * n, *] -> [N * n, *]``), as in PyTorch.

    Raises:
        ValueError: exactly one split list is None; a list does not have ``n`` entries or does
            not add up to dim 0; dim 0 not divisible by ``n`` with None splits.
    """
    name = resolve_group_name(group, tag)
    n = group_size(name)
    if output_split_sizes is None or input_split_sizes is None:
        if not (output_split_sizes is None and input_split_sizes is None):
            raise ValueError("fcoll.all_to_all_single: output_split_sizes and input_split_sizes "
                             "must both be None or both be given")
        if self.dim() == 0 or self.size(0) % n != 0:
            raise ValueError(f"fcoll.all_to_all_single: input shape {list(self.shape)}: dim 0 "
                             f"must be divisible by the group size {n} when splits are None")
        output_split_sizes = input_split_sizes = [self.size(0) // n] * n
    out = _op("all_to_all_single")(_plain(self), list(output_split_sizes),
                                 list(input_split_sizes), name)
    return _finish(out)


def all_to_all_single_autograd(self: torch.Tensor, output_split_sizes: list[int] | None,
                               input_split_sizes: list[int] | None, group: GroupLike,
                               tag: str = "") -> torch.Tensor:
    """Same as :func:`all_to_all_single` (which already supports autograd)."""
    return all_to_all_single(self, output_split_sizes, input_split_sizes, group, tag)


def broadcast(self: torch.Tensor, src: int, group: GroupLike, tag: str = "") -> torch.Tensor:
    """Every rank gets the group rank ``src``'s ``self``.

    ``src`` is a rank inside ``group`` (as ``torch.ops._c10d_functional.broadcast`` takes it).

    Raises:
        ValueError: ``src`` is outside ``[0, n)``.
    """
    name = resolve_group_name(group, tag)
    return _finish(_op("broadcast")(_plain(self), src, name))
