"""The rest of ``torch.distributed._functional_collectives``' public API, on fcoll's ops.

- ``*_inplace``: a functional collective whose result is copied into the caller's tensor (the
  forms Dynamo's remaps trace ``dist.all_reduce`` and friends into), same signatures as 2.13.
- point-to-point: ``isend_inplace``, ``irecv_inplace``, ``batch_p2p_ops_inplace`` over
  ``torch.ops.fcoll.isend`` / ``irecv`` / ``batch_p2p_ops``.
- ``permute_tensor``, ``REDUCE_OP_TO_STR``, ``RANK_TYPES`` and
  ``allow_inflight_collective_as_graph_input_ctx``.

One deliberate difference: PyTorch's ``irecv`` op receives into its input tensor and returns
that tensor (an alias, allowed only in PyTorch's own namespace); fcoll's op returns a new tensor
of the input's shape and dtype. ``irecv_inplace`` and ``batch_p2p_ops_inplace`` hide this: they
copy what was received into the given tensors when it arrives (eagerly) or at the wait
(traced), so the caller sees the received values in its own tensors either way.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from fcoll.ops.async_tensor import complete, is_tracing, wrap_async
from fcoll.ops.functional import all_gather_single, all_reduce, all_to_all_single, \
    reduce_scatter_single
from fcoll.ops.groups import GroupLike, group_size, resolve_group_name
from fcoll.ops.remaps import rank_in
from fcoll.ops.reduce import DIST_REDUCE_OPS

__all__ = [
    "RANK_TYPES", "REDUCE_OP_TO_STR", "all_gather_inplace", "all_gather_tensor_inplace",
    "all_reduce_inplace", "all_to_all_inplace", "allow_inflight_collective_as_graph_input_ctx",
    "batch_p2p_ops_inplace", "irecv_inplace", "isend_inplace", "permute_tensor",
    "reduce_scatter_tensor_inplace",
]

_ops = torch.ops.fcoll

#: The group forms every function here accepts (PyTorch's ``RANK_TYPES``).
RANK_TYPES = GroupLike

#: ``dist.ReduceOp`` -> the reduce-op string the functional collectives take.
REDUCE_OP_TO_STR = {op: name for name, op in DIST_REDUCE_OPS.items()}


def _group(group: GroupLike | None) -> GroupLike:
    if group is None:
        group = dist.group.WORLD
    if group is None:
        raise ValueError("fcoll: no group given and the default process group is not "
                         "initialised")
    return group


def _sync_only(async_op: bool, call: str) -> None:
    if async_op:
        raise ValueError(f"fcoll.{call}: async_op=True is not supported here (the Dynamo "
                         f"remaps of torch.distributed handle it)")


def _reduce_op(op) -> str:
    return op if isinstance(op, str) else REDUCE_OP_TO_STR[op]


def all_gather_tensor_inplace(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                              group=None, async_op: bool = False, tag: str = "",
                              gather_dim: int = 0) -> torch.Tensor:
    """``output_tensor [.., n * N, ..] <- all_gather_single(input_tensor, gather_dim)``.

    Raises:
        ValueError: ``async_op=True``.
    """
    _sync_only(async_op, "all_gather_tensor_inplace")
    return output_tensor.copy_(all_gather_single(input_tensor, gather_dim, _group(group), tag))


def reduce_scatter_tensor_inplace(output: torch.Tensor, input: torch.Tensor, op="sum",
                                  group=None, async_op: bool = False, scatter_dim: int = 0,
                                  tag: str = "") -> torch.Tensor:
    """``output [N, *] <- reduce_scatter_single(input [n * N, *], op, scatter_dim)``; ``op`` is a
    string or a ``dist.ReduceOp``.

    Raises:
        ValueError: ``async_op=True``; ``input`` not divisible by the group size.
    """
    _sync_only(async_op, "reduce_scatter_tensor_inplace")
    return output.copy_(reduce_scatter_single(input, _reduce_op(op), scatter_dim,
                                              _group(group), tag))


def all_reduce_inplace(tensor: torch.Tensor, op="sum", group=None, async_op: bool = False,
                       tag: str = "") -> torch.Tensor:
    """``tensor [*] <- all_reduce(tensor, op)``; ``op`` is a string or a ``dist.ReduceOp``.

    Raises:
        ValueError: ``async_op=True``; a reduce op the dtype does not allow.
    """
    _sync_only(async_op, "all_reduce_inplace")
    return tensor.copy_(all_reduce(tensor, _reduce_op(op), _group(group), tag))


def all_to_all_inplace(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                       input_split_sizes=None, group=None, async_op=False,
                       tag: str = "") -> torch.Tensor:
    """``output [sum(out_splits), *] <- all_to_all_single(input [sum(in_splits), *])``.

    Raises:
        ValueError: ``async_op=True``; inconsistent splits.
    """
    _sync_only(async_op, "all_to_all_inplace")
    return output.copy_(all_to_all_single(input, output_split_sizes, input_split_sizes,
                                          _group(group), tag))


def all_gather_inplace(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None,
                       async_op=False, tag: str = "") -> list[torch.Tensor]:
    """``tensor_list[r] <- rank r's tensor`` (one all_gather, then one copy per rank).

    Raises:
        ValueError: ``async_op=True``; an entry of ``tensor_list`` with a dim 0 other than
            ``tensor``'s (variable-size all_gather).
    """
    _sync_only(async_op, "all_gather_inplace")
    if tensor.dim() != 0 and any(t.size(0) != tensor.size(0) for t in tensor_list):
        raise ValueError("fcoll.all_gather_inplace: every entry of tensor_list must have "
                         f"tensor's dim 0 ({tensor.size(0)}); variable sizes are not supported")
    output = all_gather_single(tensor, 0, _group(group), tag)
    offset = 0
    for t in tensor_list:
        rows = 1 if t.dim() == 0 else t.size(0)
        t.copy_(output[offset] if t.dim() == 0 else output[offset:offset + rows])
        offset += rows
    return tensor_list


def permute_tensor(self: torch.Tensor, src_dst: list[int], group: GroupLike,
                   tag: str = "") -> torch.Tensor:
    """Send ``self`` from group rank ``m`` to group rank ``src_dst[m]``; return what this rank
    receives (``self``'s shape and dtype), as one ``all_to_all_single``.

    Raises:
        ValueError: ``src_dst`` is not a permutation of the group's ranks.
    """
    name = resolve_group_name(group, tag)
    n, me = group_size(name), rank_in(name)   # both fold to constants under Dynamo
    if sorted(src_dst) != list(range(n)):
        raise ValueError(f"fcoll.permute_tensor: src_dst={list(src_dst)} is not a permutation "
                         f"of range({n})")
    in_splits, out_splits = [0] * n, [0] * n
    for src, dst in enumerate(src_dst):
        if src == me:
            in_splits[dst] = self.numel()
        if dst == me:
            out_splits[src] = self.numel()
    flat = all_to_all_single(self.reshape(-1), out_splits, in_splits, name)
    return flat.view(self.shape)


# ---------------------------------------------------------------------------------------------
# Point-to-point

def _global_peer(group, peer: int | None, group_peer: int, arg: str) -> int:
    if group_peer != -1:
        if peer is not None:
            raise ValueError(f"fcoll: give {arg} or group_{arg}, not both")
        return c10d.get_global_rank(group, group_peer)
    if peer is None:
        raise ValueError(f"fcoll: {arg} or group_{arg} is required")
    return peer


def _received_into(tensor: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """``received`` (a fresh irecv output) as the caller sees it: while tracing, waited and
    copied into ``tensor``; eagerly an ``AsyncCollectiveTensor`` whose wait also copies."""
    if is_tracing():
        return tensor.copy_(complete(received))
    from fcoll.ops import pending

    pending.register(received, None, lambda: tensor.copy_(received))
    return wrap_async(received)


def isend_inplace(tensor: torch.Tensor, dst: int, tag: int = 0, group=None,
                  group_dst: int = -1) -> torch.Tensor:
    """Start sending ``tensor`` to global rank ``dst`` (or group rank ``group_dst``); return a
    ``[0]`` tensor whose wait completes the send (an ``AsyncCollectiveTensor`` eagerly).

    Raises:
        ValueError: both or neither of ``dst`` and ``group_dst`` given.
    """
    group = _group(group)
    out = _ops.isend(tensor, _global_peer(group, dst, group_dst, "dst"), tag,
                     resolve_group_name(group))
    return out if is_tracing() else wrap_async(out)


def irecv_inplace(tensor: torch.Tensor, src: int, tag: int = 0, group=None,
                  group_src: int = -1) -> torch.Tensor:
    """Receive into ``tensor`` from global rank ``src`` (or group rank ``group_src``).

    Returns ``tensor`` (traced: after the wait) or an ``AsyncCollectiveTensor`` whose wait fills
    ``tensor`` too (eager). Raises ``ValueError`` as :func:`isend_inplace`.
    """
    group = _group(group)
    out = _ops.irecv(tensor, _global_peer(group, src, group_src, "src"), tag,
                     resolve_group_name(group))
    return _received_into(tensor, out)


def batch_p2p_ops_inplace(op_list: list[str], peer_list: list[int], tag_list: list[int],
                          tensors: list[torch.Tensor], group_name) -> list[torch.Tensor]:
    """Start every send and receive of the batch together (``dist.batch_isend_irecv``).

    ``op_list[i]`` is ``"isend"`` or ``"irecv"`` with global rank ``peer_list[i]``; received
    values land in ``tensors[i]``. Returns one tensor per op, as :func:`isend_inplace` /
    :func:`irecv_inplace` return them. ``group_name``: any group form, None or "" for WORLD.

    Raises:
        ValueError: torch.distributed is not initialised; an op that is neither isend nor irecv.
    """
    if not dist.is_initialized():
        raise ValueError("fcoll.batch_p2p_ops_inplace: torch.distributed is not initialised")
    group = _group(group_name or None)
    outs = _ops.batch_p2p_ops(list(op_list), list(peer_list), list(tag_list), list(tensors),
                              resolve_group_name(group))
    return [_received_into(t, o) if op == "irecv" else (o if is_tracing() else wrap_async(o))
            for op, t, o in zip(op_list, tensors, outs)]


@contextlib.contextmanager
def allow_inflight_collective_as_graph_input_ctx(value: bool = True) -> Iterator[None]:
    """Let a compiled region wait on a collective started eagerly with ``async_op=True``.

    Sets c10d's flag as PyTorch's context manager does: c10d then records the ``Work`` of such
    a collective by its output, and ``fcoll.wait_tensor`` (and ``_c10d_functional.wait_tensor``)
    on that output waits for it (fcoll's own registry falls back to c10d's).
    """
    c = torch._C._distributed_c10d
    previous = c._allow_inflight_collective_as_graph_input()
    try:
        c._set_allow_inflight_collective_as_graph_input(value)
        yield
    finally:
        c._set_allow_inflight_collective_as_graph_input(previous)
