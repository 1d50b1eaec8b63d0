"""The ``torch.ops.fcoll`` operator library: schemas, eager kernels and fake kernels.

Schemas mirror ``torch.ops._c10d_functional`` (same names, argument order, string ``group_name``),
so a graph pass can rewrite one namespace into the other by swapping the target alone.

Eager kernels validate their arguments, start the collective on the group's backend with
``async_op=True`` and return the output buffer at once; ``wait_tensor`` blocks until it is
filled (see :mod:`fcoll.ops.pending`) and returns a copy, since a custom op may not return an
alias of its input (fcoll's executor and ``AsyncCollectiveTensor`` wait without the copy). Any
``torch.distributed`` backend works: fcoll's shared-memory backend, gloo, nccl, a Python
``ProcessGroup`` subclass.

What an op calls on its group is what torch 2.13's ``_c10d_functional`` op calls (read off a
recording ``ProcessGroup``): ``allreduce``, ``allreduce_coalesced``, ``broadcast``,
``alltoall_base`` (``all_to_all_single``), and ``allgather_into_tensor_coalesced`` /
``reduce_scatter_tensor_coalesced`` for every all_gather and reduce_scatter form (one call per
op, the single-tensor forms with a list of one). A group of one rank is no exception: its
backend is called like any other (a backend may count, trace or discard its collectives).
Deliberate differences, all for speed on gloo: reduce_scatter moves its data with
``all_to_all_single`` and reduces locally (:func:`start_reduce_scatter`), all_gather calls
``_allgather_base`` per tensor (:func:`gathers_one_by_one`), and dtypes or reduce ops gloo
lacks are emulated;
``all_gather_into_tensor_out`` goes through the same coalesced call (PyTorch's calls the
device backend's ``_allgather_base``, which a Python ``ProcessGroup`` does not have).

Shapes (per rank, ``n`` = group size):

==============================  ==========================  ===============================
op                              input                       output
==============================  ==========================  ===============================
all_reduce(_)                   ``[*]``                     ``[*]``
all_gather_into_tensor(_out)    ``[N, *]``                  ``[n * N, *]``
reduce_scatter_tensor           ``[n * N, *]``              ``[N, *]``
all_to_all_single               ``[sum(input_split), *]``   ``[sum(output_split), *]``
broadcast(_)                    ``[*]``                     ``[*]`` (src's values)
wait_tensor                     ``[*]``                     ``[*]`` (a completed copy)
==============================  ==========================  ===============================

Where the parts live: the schemas, tags and output shapes in :mod:`fcoll.ops.schemas`, how each
backend takes the data (wire dtypes, reduce ops, the gloo forms) in :mod:`fcoll.ops.wire`, the
eager kernels here, the fake kernels in :mod:`fcoll.ops.fakes`. Importing this module defines
the ops and registers both kinds of kernel.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from fcoll.ops import pending
from fcoll.ops.groups import group_from_name, resolve_group_name
from fcoll.ops.reduce import REDUCE_OPS, validate_reduce_op
from fcoll.ops.schemas import GROUP_OVERLOADS, gathered_shape, lib, p2p_output, scattered_shape
from fcoll.ops.wire import (allgather_options, backend_name, chain, gathers_one_by_one,
                            reduce_args, reduce_scatter_options, reduces_scatter_by_all_to_all,
                            start_reduce_scatter, wire_input, wire_output)

__all__ = ["lib", "REDUCE_OPS", "validate_reduce_op", "borrowing_inputs", "COPYING_OPS"]

# ---------------------------------------------------------------------------------------------
# Validation (before any data moves)

def _where(group_name: str, t: torch.Tensor | None = None) -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    shape = f", input shape {list(t.shape)} {t.dtype}" if t is not None else ""
    return f"(rank {rank}, group {group_name!r}{shape})"


def _check_group_size(op: str, group_size: int, pg: dist.ProcessGroup, group_name: str) -> None:
    if group_size != pg.size():
        raise ValueError(f"fcoll.{op}: group_size={group_size} but group {group_name!r} has "
                         f"{pg.size()} ranks {_where(group_name)}")


def _check_splits(op: str, name: str, splits: Sequence[int], total: int, n: int,
                  group_name: str, t: torch.Tensor) -> None:
    if len(splits) != n:
        raise ValueError(f"fcoll.{op}: {name} has {len(splits)} entries, expected group size "
                         f"{n} {_where(group_name, t)}")
    if any(s < 0 for s in splits):
        raise ValueError(f"fcoll.{op}: {name}={list(splits)} has a negative entry "
                         f"{_where(group_name, t)}")
    if total >= 0 and sum(splits) != total:
        raise ValueError(f"fcoll.{op}: {name}={list(splits)} adds up to {sum(splits)}, but "
                         f"dim 0 has size {total} {_where(group_name, t)}")


_borrowing = threading.local()

#: the ops (overloads) whose kernels copy their inputs (:func:`_owned_input`) unless the caller
#: lends them (:func:`borrowing_inputs`)
COPYING_OPS = frozenset(getattr(torch.ops.fcoll, name).default for name in (
    "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out",
    "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_out",
    "all_to_all_single"))


def _owned_input(pg: dist.ProcessGroup, t: torch.Tensor) -> torch.Tensor:
    """``t`` as the backend reads it (:func:`fcoll.ops.wire.wire_input`), in a buffer of the
    op's own: never ``t`` itself, unless the caller lends it (:func:`borrowing_inputs`).

    A functional op's caller owns its inputs again once the op returns: it may write them, and
    a compiler reuses their buffers (Inductor's ``bufN = buf0  # reuse`` after a fallback
    kernel's last read). The backend reads the input after the op returns (fcoll's engine
    worker, gloo's thread), so it must read a copy: reading ``t`` itself let a later write
    change the result (with the collective slowed down, an input overwritten after the call was
    all-reduced in place of the original on every rank).
    """
    w = wire_input(pg, t)
    return w.clone() if w is t and not getattr(_borrowing, "on", False) else w


def borrowing_inputs(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a functional collective's kernel or op), called so that the all_gather,
    reduce_scatter and all_to_all it starts read their inputs in place instead of from a copy
    (:func:`_owned_input`; all_reduce's result is a copy in any case).

    For a caller that writes none of those inputs' storage until the collective's wait has
    returned: fcoll's executor, for a collective whose every result it waits in the same graph
    and whose inputs no node of that graph writes (:mod:`fcoll.compile.direct_calls`). A
    SimpleFSDP block's coalesced reduce_scatter of float32 gradients then holds no second copy
    of them while it is in flight. Any other caller keeps the copy.
    """
    def lent(*args: Any, **kwargs: Any) -> Any:
        _borrowing.on = True
        try:
            return fn(*args, **kwargs)
        finally:
            _borrowing.on = False
    lent.__name__ = getattr(fn, "__name__", "collective")
    return lent


# ---------------------------------------------------------------------------------------------
# Starting a collective on a torch.distributed group (how the group takes the data:
# fcoll.ops.wire)

def _all_reduce_into(out: torch.Tensor, reduce_op: str, group_name: str) -> None:
    """Start an all_reduce that reduces ``out`` in place across the group."""
    validate_reduce_op("all_reduce", reduce_op, out.dtype)
    pg = group_from_name(group_name)
    buf, copy_back = wire_output(pg, out, initialised=True)
    op, fin = reduce_args(reduce_op, pg, out.dtype, buf)
    work = dist.all_reduce(buf, op=op, group=pg, async_op=True)
    pending.register(out, work, chain(fin, copy_back))


# ---------------------------------------------------------------------------------------------
# Eager kernels (CPU and CUDA; CompositeExplicitAutograd so they run under every backend key)

def _impl(name: str):
    def deco(fn):
        lib.impl(name, fn, "CompositeExplicitAutograd")
        return fn
    return deco


@_impl("all_reduce")
def _all_reduce(input: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    # A copy the op owns, reduced in place (as torch's _c10d_functional.all_reduce does): the
    # caller owns ``input`` again when the op returns (see _owned_input).
    out = input.clone(memory_format=torch.contiguous_format)
    _all_reduce_into(out, reduce_op, group_name)
    return out


@_impl("all_reduce_")
def _all_reduce_(input: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    _all_reduce_into(input, reduce_op, group_name)
    return input


def _all_reduce_many_into(op_name: str, outs: list[torch.Tensor], reduce_op: str,
                          group_name: str) -> None:
    """Reduce every tensor of ``outs`` in place, as few backend calls as the backend allows.

    fcoll's backend packs tensors of every dtype into one coalesced collective; gloo coalesces
    tensors of one dtype, so there each dtype is one call, issued back to back.
    """
    for dt in dict.fromkeys(t.dtype for t in outs):
        validate_reduce_op(op_name, reduce_op, dt)
    pg = group_from_name(group_name)
    if not outs:
        return
    coalesce_dtypes = backend_name(pg) == "fcoll"
    # A bucket holds hundreds of tensors: the dist op and call key are worked out once per
    # dtype, and a finisher only for the dtypes that have one (avg emulated as sum).
    per_dtype: dict[torch.dtype, tuple] = {}
    per_call: dict[object, tuple[dist.ReduceOp, list, list, list]] = {}
    for t in outs:
        buf, copy_back = wire_output(pg, t, initialised=True)
        facts = per_dtype.get(t.dtype)
        if facts is None:
            op, fin = reduce_args(reduce_op, pg, t.dtype, buf)
            key = int(op) if coalesce_dtypes else (int(op), buf.dtype)
            facts = per_dtype[t.dtype] = (op, key, fin is not None)
        op, key, has_fin = facts
        fin = reduce_args(reduce_op, pg, t.dtype, buf)[1] if has_fin else None
        call = per_call.get(key)
        if call is None:
            call = per_call[key] = (op, [], [], [])
        call[1].append(t)
        call[2].append(buf)
        call[3].append(fin if copy_back is None else chain(fin, copy_back))
    for op, targets, bufs, finishers in per_call.values():
        opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = op
        opts.asyncOp = True
        work = pg.allreduce_coalesced(bufs, opts)
        for t, finish in zip(targets, finishers):
            pending.register(t, work, finish)


@_impl("all_reduce_coalesced")
def _all_reduce_coalesced(inputs: list[torch.Tensor], reduce_op: str,
                          group_name: str) -> list[torch.Tensor]:
    # copies the op owns, reduced in place (see _owned_input)
    outs = [t.clone(memory_format=torch.contiguous_format) for t in inputs]
    _all_reduce_many_into("all_reduce_coalesced", outs, reduce_op, group_name)
    return outs


@_impl("all_reduce_coalesced_")
def _all_reduce_coalesced_(inputs: list[torch.Tensor], reduce_op: str,
                           group_name: str) -> list[torch.Tensor]:
    _all_reduce_many_into("all_reduce_coalesced_", list(inputs), reduce_op, group_name)
    return list(inputs)


def _gather_into(op: str, inputs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                 group_size: int, group_name: str) -> None:
    """Start one all_gather of every ``inputs[i]`` (``[N_i, *]``) into ``outs[i]``
    (``[n * N_i, *]``): a single ``allgather_into_tensor_coalesced`` call on the group, as
    torch's ``_c10d_functional`` all_gather ops make. Each output is registered as pending.

    Raises:
        ValueError: ``group_size`` is not the group's size; an output of the wrong shape or dtype.
    """
    pg = group_from_name(group_name)
    _check_group_size(op, group_size, pg, group_name)
    for input, out in zip(inputs, outs):
        expected = gathered_shape(input, group_size)
        if list(out.shape) != expected or out.dtype != input.dtype:
            raise ValueError(f"fcoll.{op}: out has shape {list(out.shape)} {out.dtype}, "
                             f"expected {expected} {input.dtype} {_where(group_name, input)}")
    if not outs:
        return
    wired = [wire_output(pg, out, initialised=False) for out in outs]
    ins = [_owned_input(pg, t) for t in inputs]
    if gathers_one_by_one(pg):
        works = [pg._allgather_base(buf, x, allgather_options())
                 for (buf, _), x in zip(wired, ins)]
    else:
        works = [pg.allgather_into_tensor_coalesced([buf for buf, _ in wired], ins,
                                                    allgather_options())] * len(outs)
    for out, (_, copy_back), work in zip(outs, wired, works):
        pending.register(out, work, copy_back)


@_impl("all_gather_into_tensor")
def _all_gather_into_tensor(input: torch.Tensor, group_size: int,
                            group_name: str) -> torch.Tensor:
    out = input.new_empty(gathered_shape(input, group_size))
    _gather_into("all_gather_into_tensor", [input], [out], group_size, group_name)
    return out


@_impl("all_gather_into_tensor_out")
def _all_gather_into_tensor_out(input: torch.Tensor, group_size: int, group_name: str, *,
                                out: torch.Tensor) -> torch.Tensor:
    _gather_into("all_gather_into_tensor_out", [input], [out], group_size, group_name)
    return out


@_impl("all_gather_into_tensor_coalesced")
def _all_gather_into_tensor_coalesced(inputs: list[torch.Tensor], group_size: int,
                                      group_name: str) -> list[torch.Tensor]:
    outs = [t.new_empty(gathered_shape(t, group_size)) for t in inputs]
    _gather_into("all_gather_into_tensor_coalesced", inputs, outs, group_size, group_name)
    return outs


def _validate_reduce_scatter(op: str, input: torch.Tensor, reduce_op: str, group_size: int,
                             group_name: str) -> dist.ProcessGroup:
    validate_reduce_op(op, reduce_op, input.dtype)
    pg = group_from_name(group_name)
    _check_group_size(op, group_size, pg, group_name)
    if input.dim() == 0 or input.size(0) % group_size != 0:
        raise ValueError(f"fcoll.{op}: input dim 0 must be divisible by the group size "
                         f"{group_size} {_where(group_name, input)}")
    return pg


@_impl("reduce_scatter_tensor")
def _reduce_scatter_tensor(input: torch.Tensor, reduce_op: str, group_size: int,
                           group_name: str) -> torch.Tensor:
    pg = _validate_reduce_scatter("reduce_scatter_tensor", input, reduce_op, group_size,
                                  group_name)
    out = input.new_empty(scattered_shape(input, group_size))
    _reduce_scatter_into(pg, [input], [out], reduce_op)
    return out


def _reduce_scatter_into(pg: dist.ProcessGroup, inputs: Sequence[torch.Tensor],
                         outs: Sequence[torch.Tensor], reduce_op: str) -> None:
    """Start the reduce_scatter of every validated ``inputs[i]`` (``[n * N_i, *]``) into
    ``outs[i]`` (``[N_i, *]``), each registered as pending on its output: one
    ``reduce_scatter_tensor_coalesced`` call per dtype on the group (torch's ops make one call;
    a dtype's avg emulated as sum, or gloo's path, needs its own finisher), and on gloo one
    ``all_to_all_single`` per tensor (see :func:`start_reduce_scatter`)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(inputs):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, members in by_dtype.items():
        wired = [wire_output(pg, outs[i], initialised=False) for i in members]
        ins = [_owned_input(pg, inputs[i]) for i in members]
        if reduces_scatter_by_all_to_all(pg):
            started = [start_reduce_scatter(pg, buf, x, reduce_op, dtype)
                       for (buf, _), x in zip(wired, ins)]
        else:
            op, _ = reduce_args(reduce_op, pg, dtype, ins[0])
            work = pg.reduce_scatter_tensor_coalesced([buf for buf, _ in wired], ins,
                                                      reduce_scatter_options(op))
            started = [(work, reduce_args(reduce_op, pg, dtype, buf)[1]) for buf, _ in wired]
        for i, (_, copy_back), (work, fin) in zip(members, wired, started):
            pending.register(outs[i], work, chain(fin, copy_back))


@_impl("reduce_scatter_tensor_out")
def _reduce_scatter_tensor_out(input: torch.Tensor, reduce_op: str, group_size: int,
                               group_name: str, *, out: torch.Tensor) -> torch.Tensor:
    pg = _validate_reduce_scatter("reduce_scatter_tensor_out", input, reduce_op, group_size,
                                  group_name)
    expected = scattered_shape(input, group_size)
    if list(out.shape) != expected or out.dtype != input.dtype:
        raise ValueError(f"fcoll.reduce_scatter_tensor_out: out has shape {list(out.shape)} "
                         f"{out.dtype}, expected {expected} {input.dtype} "
                         f"{_where(group_name, input)}")
    _reduce_scatter_into(pg, [input], [out], reduce_op)
    return out


@_impl("reduce_scatter_tensor_coalesced")
def _reduce_scatter_tensor_coalesced(inputs: list[torch.Tensor], reduce_op: str,
                                     group_size: int, group_name: str) -> list[torch.Tensor]:
    pg = group_from_name(group_name)
    for t in inputs:
        _validate_reduce_scatter("reduce_scatter_tensor_coalesced", t, reduce_op, group_size,
                                 group_name)
    outs = [t.new_empty(scattered_shape(t, group_size)) for t in inputs]
    _reduce_scatter_into(pg, inputs, outs, reduce_op)
    return outs


@_impl("all_to_all_single")
def _all_to_all_single(input: torch.Tensor, output_split_sizes: list[int],
                       input_split_sizes: list[int], group_name: str) -> torch.Tensor:
    pg = group_from_name(group_name)
    n = pg.size()
    if input.dim() == 0:
        raise ValueError(f"fcoll.all_to_all_single: input must have at least one dimension "
                         f"{_where(group_name, input)}")
    _check_splits("all_to_all_single", "input_split_sizes", input_split_sizes, input.size(0), n,
                  group_name, input)
    _check_splits("all_to_all_single", "output_split_sizes", output_split_sizes, -1, n,
                  group_name, input)
    if n == 1 and output_split_sizes[0] != input_split_sizes[0]:
        raise ValueError(f"fcoll.all_to_all_single: output_split_sizes="
                         f"{list(output_split_sizes)} != input_split_sizes="
                         f"{list(input_split_sizes)} on a group of one rank "
                         f"{_where(group_name, input)}")
    out = input.new_empty([sum(output_split_sizes), *input.shape[1:]])
    buf, copy_back = wire_output(pg, out, initialised=False)
    work = dist.all_to_all_single(buf, _owned_input(pg, input), list(output_split_sizes),
                                  list(input_split_sizes), group=pg, async_op=True)
    pending.register(out, work, copy_back)
    return out


def _broadcast_into(op: str, out: torch.Tensor, src: int, group_name: str) -> None:
    pg = group_from_name(group_name)
    if not 0 <= src < pg.size():
        raise ValueError(f"fcoll.{op}: src={src} is out of range for a group of {pg.size()} "
                         f"ranks {_where(group_name, out)}")
    buf, copy_back = wire_output(pg, out, initialised=True)
    work = dist.broadcast(buf, group=pg, group_src=src, async_op=True)
    pending.register(out, work, copy_back)


@_impl("broadcast")
def _broadcast(input: torch.Tensor, src: int, group_name: str) -> torch.Tensor:
    out = input.clone(memory_format=torch.contiguous_format)
    _broadcast_into("broadcast", out, src, group_name)
    return out


@_impl("broadcast_")
def _broadcast_(input: torch.Tensor, src: int, group_name: str) -> torch.Tensor:
    _broadcast_into("broadcast_", input, src, group_name)
    return input


# ---------------------------------------------------------------------------------------------
# Point-to-point (peers are global ranks, as in torch.distributed.isend / irecv)

def _start_p2p(op: str, t: torch.Tensor, peer: int, tag: int, group_name: str) -> torch.Tensor:
    """Start one send or receive of ``t`` with global rank ``peer``; return the op's output:
    ``[0]`` for a send (a handle to wait on), a fresh ``t``-shaped tensor for a receive."""
    pg = group_from_name(group_name)
    out = p2p_output(op, t)
    if op == "isend":
        work = dist.isend(wire_input(pg, t), peer, group=pg, tag=tag)
        pending.register(out, work)
    else:
        buf, copy_back = wire_output(pg, out, initialised=False)
        work = dist.irecv(buf, peer, group=pg, tag=tag)
        pending.register(out, work, copy_back)
    return out


@_impl("isend")
def _isend(tensor: torch.Tensor, dst: int, tag: int, group_name: str) -> torch.Tensor:
    return _start_p2p("isend", tensor, dst, tag, group_name)


@_impl("irecv")
def _irecv(tensor: torch.Tensor, src: int, tag: int, group_name: str) -> torch.Tensor:
    return _start_p2p("irecv", tensor, src, tag, group_name)


@_impl("batch_p2p_ops")
def _batch_p2p_ops(op_list: list[str], peer_list: list[int], tag_list: list[int],
                   tensors: list[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    if not len(op_list) == len(peer_list) == len(tag_list) == len(tensors):
        raise ValueError(f"fcoll.batch_p2p_ops: op_list, peer_list, tag_list and tensors have "
                         f"{len(op_list)}, {len(peer_list)}, {len(tag_list)} and "
                         f"{len(tensors)} entries {_where(group_name)}")
    pg = group_from_name(group_name)
    outs = [p2p_output(op, t) for op, t in zip(op_list, tensors)]
    p2p, finishers = [], []
    for op, peer, tag, t, out in zip(op_list, peer_list, tag_list, tensors, outs):
        if op == "isend":
            p2p.append(dist.P2POp(dist.isend, wire_input(pg, t), peer, pg, tag))
            finishers.append(None)
        else:
            buf, copy_back = wire_output(pg, out, initialised=False)
            p2p.append(dist.P2POp(dist.irecv, buf, peer, pg, tag))
            finishers.append(copy_back)
    works = dist.batch_isend_irecv(p2p) if p2p else []
    # backends return one work for the batch (coalesced) or one per op
    for i, (out, fin) in enumerate(zip(outs, finishers)):
        for work in (works if len(works) != len(outs) else [works[i]]):
            pending.register(out, work)
        pending.register(out, None, fin)
    return outs


@_impl("wait_tensor")
def _wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return pending.wait(tensor).clone()


def _group_overload(name: str) -> Callable[..., Any]:
    """The kernel of ``fcoll::<name>.group`` (``Any group_name``: a ``ProcessGroup`` or any
    group form): the default overload, called with the group's name."""
    default = getattr(torch.ops.fcoll, name).default
    at = [a.name for a in default._schema.arguments].index("group_name")

    def kernel(*args, **kwargs):
        if "group_name" in kwargs:
            kwargs["group_name"] = resolve_group_name(kwargs["group_name"])
        else:
            args = (*args[:at], resolve_group_name(args[at]), *args[at + 1:])
        return default(*args, **kwargs)
    return kernel


for _name in GROUP_OVERLOADS:  # CompositeImplicitAutograd: graphs only ever hold the default
    lib.impl(f"{_name}.group", _group_overload(_name), "CompositeImplicitAutograd")


# Fake kernels last, as before the split: every op is defined by now (fcoll.ops.schemas).
from fcoll.ops import fakes  # noqa: F401  registers the fake kernels
