"""The composed collectives of a group across hosts, as algorithms over its :class:`Subgroups`.

all_reduce, reduce, coalesced all_reduce, all_gather, reduce_scatter, broadcast and barrier: the
ops of the table in :mod:`fcoll.shm.multihost.hierarchical`, each run as intra-host steps (shared
memory) and inter-host steps (gloo), or on ``flat`` on an uneven layout. Each function runs after
its op's pre-flight, on the group's queue; the argument checks, the pre-flight and the queue are
:class:`~fcoll.shm.multihost.hierarchical.HierarchicalProcessGroup`'s, whose methods call these.

Shapes per rank are those of :class:`~fcoll.shm.group.process_group.FcollProcessGroup`.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from fcoll.ops.reduce import DIST_REDUCE_OPS, divide_for_avg, reduce_rows_into
from fcoll.shm.multihost.gloo_link import (
    REDUCE_CODES,
    as_bytes,
    chunk_spans,
    gloo_all_reduce,
    gloo_all_reduce_start,
    gloo_reduce_scatter_rows,
    make_opts,
)
from fcoll.shm.multihost.host_layout import HostLayout


@dataclasses.dataclass(frozen=True)
class Subgroups:
    """What the compositions read of a group across hosts: this rank's place in the layout and
    the three sub-groups (see :mod:`fcoll.shm.multihost.hierarchical`).

    ``intra`` is None on a host with one rank, ``inter`` on an uneven layout. On an even layout
    of H hosts of L ranks, ``gather_order[l * H + h]`` is the row of rank (host h, local rank l)
    in an all_gather's [L, H] arrival order, and ``scatter_order`` lists the ranks whose rows
    local rank l' reduces: (0, l'), ..., (H-1, l') for each l' in turn.
    """

    layout: HostLayout
    rank: int
    size: int
    local_rank: int
    intra: Any
    inter: dist.ProcessGroup | None
    flat: dist.ProcessGroup
    gather_order: torch.Tensor | None = None
    scatter_order: torch.Tensor | None = None


def all_reduce_flat(sub: Subgroups, flat: torch.Tensor, op: str) -> None:
    """The composed all_reduce of a 1-D contiguous tensor, in place (uneven layouts: on
    ``flat``); after the op's pre-flight."""
    step = "sum" if op == "avg" else op
    if not sub.layout.even:
        gloo_all_reduce(sub.flat, flat, step)
    elif sub.intra is None:
        gloo_all_reduce(sub.inter, flat, step)
    else:
        L = sub.intra.size()
        pad = (-flat.numel()) % L
        buf = flat if pad == 0 else torch.cat([flat, flat.new_zeros(pad)])
        pieces = [buf[o:o + k] for o, k in chunk_spans(buf.numel(), buf.element_size(), L)]
        shards = [p.new_empty(p.numel() // L) for p in pieces]
        # one piece: synchronous intra steps (fcoll's fast paths for small messages)
        queued = len(pieces) > 1
        rs = make_opts(dist.ReduceScatterOptions, reduceOp=DIST_REDUCE_OPS[step],
                       asyncOp=queued)
        # pipeline: every piece's intra reduce_scatter is queued at once; each inter
        # all_reduce starts when its piece is reduced, each intra all_gather when its
        # shard is all-reduced
        scattered = [sub.intra.reduce_scatter_single(sh, p, rs)
                     for sh, p in zip(shards, pieces)]
        finishes = []
        for work, shard in zip(scattered, shards):
            work.wait()
            finishes.append(gloo_all_reduce_start(sub.inter, shard, step))
        gathered = []
        for finish, shard, piece in zip(finishes, shards, pieces):
            finish()
            if op == "avg":
                divide_for_avg(shard, sub.size)
            gathered.append(sub.intra.all_gather_single(
                piece, shard, make_opts(AllgatherOptions, asyncOp=queued)))
        for work in gathered:
            work.wait()
        if pad:
            flat.copy_(buf[:flat.numel()])
        return
    if op == "avg":
        divide_for_avg(flat, sub.size)


def all_reduce_into(sub: Subgroups, t: torch.Tensor, op: str,
                    out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """All-reduce ``t`` in place, or into ``out`` (same shape and dtype) leaving ``t`` alone."""
    target = t if out is None else out
    flat = target.view(-1) if target.is_contiguous() else target.contiguous().view(-1)
    if out is not None:
        flat.copy_(t.reshape(-1))
    all_reduce_flat(sub, flat, op)
    if flat.data_ptr() != target.data_ptr():
        target.copy_(flat.view(target.shape))
    return [target]


def all_reduce_by_dtype(sub: Subgroups, tensors: list[torch.Tensor],
                        op: str) -> list[torch.Tensor]:
    """All-reduce every tensor in place: the tensors of each dtype concatenated, one
    :func:`all_reduce_flat` each."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        all_reduce_flat(sub, flat, op)
        off = 0
        for t in group:
            t.copy_(flat[off:off + t.numel()].view(t.shape))
            off += t.numel()
    return list(tensors)


def coalesced_code(tensors, op: str) -> int:
    """The pre-flight code of a coalesced call: the reduce op and a digest of every
    tensor's dtype and shape (crc32: the same in every process)."""
    sig = zlib.crc32(repr([(str(t.dtype), tuple(t.shape)) for t in tensors]).encode())
    return REDUCE_CODES.get(op, -1) * (1 << 32) + sig


def all_gather_into(sub: Subgroups, output: torch.Tensor,
                    input: torch.Tensor) -> list[torch.Tensor]:  # noqa: A002
    """``output [n * N]`` (any shape of that many elements) receives every rank's ``input [N]``
    in group-rank order: inter all_gather, intra all_gather, one reordering copy."""
    x = input.detach().reshape(-1).contiguous()
    N = x.numel()
    if not sub.layout.even:
        buf = output if output.is_contiguous() else x.new_empty(sub.size * N)
        sub.flat._allgather_base(as_bytes(buf), as_bytes(x)).wait()
        if buf is not output:
            output.copy_(buf.view(output.shape))
        return [output]
    H = sub.layout.num_hosts
    spans = chunk_spans(N, x.element_size() * sub.size)
    # pipeline: every piece's inter all_gather is queued at once; each intra all_gather
    # starts when its piece arrived; each reordering copy when that is done
    hosts_rows = [x.new_empty(H * k) for _, k in spans]
    inter = [sub.inter._allgather_base(as_bytes(g), as_bytes(x[o:o + k]))
             for g, (o, k) in zip(hosts_rows, spans)]
    all_rows, intra = [], []
    for work, g in zip(inter, hosts_rows):
        work.wait()
        if sub.intra is None:
            all_rows.append(g)
            continue
        a = x.new_empty(sub.intra.size() * g.numel())
        intra.append(sub.intra.all_gather_single(
            a, g, make_opts(AllgatherOptions, asyncOp=len(spans) > 1)))
        all_rows.append(a)
    out = output.view(sub.size, N) if output.is_contiguous() else x.new_empty(
        (sub.size, N))
    for c, (a, (o, k)) in enumerate(zip(all_rows, spans)):
        if intra:
            intra[c].wait()
        if k:
            out[:, o:o + k] = a.view(-1, k).index_select(0, sub.gather_order)
    if out.data_ptr() != output.data_ptr():
        output.copy_(out.view(output.shape))
    return [output]


def reduce_scatter_into(sub: Subgroups, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                        op: str) -> list[torch.Tensor]:
    """``output [N]`` receives the reduction over ranks of their rows ``input [n, N]``
    (row r: the rows of group rank r): rows reordered, intra reduce_scatter, inter all_to_all
    and a local reduction."""
    N = output.numel()
    H = sub.layout.num_hosts
    step = "sum" if op == "avg" else op
    if not sub.layout.even:
        res = gloo_reduce_scatter_rows(
            sub.flat, input.detach().reshape(sub.size, N).contiguous(), step)
        if op == "avg":
            divide_for_avg(res, sub.size)
        output.copy_(res.view(output.shape))
        return [output]
    rows = input.detach().reshape(sub.size, N)
    spans = chunk_spans(N, rows.element_size() * sub.size)
    # pipeline: every piece's intra reduce_scatter is queued at once; each inter
    # all_to_all starts when its piece is reduced on the host; each local reduction when
    # its all_to_all is done
    pieces = [rows[:, o:o + k].index_select(0, sub.scatter_order) for o, k in spans]
    if sub.intra is not None:
        rs = make_opts(dist.ReduceScatterOptions, reduceOp=DIST_REDUCE_OPS[step],
                       asyncOp=len(pieces) > 1)
        shards = [p.new_empty((H, p.shape[1])) for p in pieces]
        scattered = [sub.intra.reduce_scatter_single(sh, p.view(-1), rs)
                     for sh, p in zip(shards, pieces)]
    else:
        shards, scattered = pieces, []
    exchanged = []
    for c, shard in enumerate(shards):
        if scattered:
            scattered[c].wait()
        got = torch.empty_like(shard)
        exchanged.append((got, sub.inter.alltoall_base(
            as_bytes(got), as_bytes(shard), [], [], dist.AllToAllOptions())))
    res = rows.new_empty(N)
    for (got, work), (o, k) in zip(exchanged, spans):
        work.wait()
        reduce_rows_into(got, step, res[o:o + k])
    if op == "avg":
        divide_for_avg(res, sub.size)
    output.copy_(res.view(output.shape))
    return [output]


def reduce_into(sub: Subgroups, t: torch.Tensor, op: str, root: int) -> list[torch.Tensor]:
    """Reduce: an all_reduce into a scratch copy; only ``root`` writes ``t``."""
    scratch = t.detach().reshape(-1).clone()
    all_reduce_flat(sub, scratch, op)
    if sub.rank == root:
        t.copy_(scratch.view(t.shape))
    return [t]


def broadcast_into(sub: Subgroups, t: torch.Tensor, root: int) -> list[torch.Tensor]:
    """Broadcast ``t`` from group rank ``root``: inter among the root's local rank, then intra
    (uneven layouts: on ``flat``)."""
    root_host, root_local = sub.layout.host_of(root), sub.layout.local_rank_of(root)
    buf = t if t.is_contiguous() else t.contiguous()
    if not sub.layout.even:
        sub.flat.broadcast([as_bytes(buf)], make_opts(dist.BroadcastOptions,
                                                      rootRank=root)).wait()
    elif sub.local_rank == root_local:
        sub.inter.broadcast([as_bytes(buf)], make_opts(dist.BroadcastOptions,
                                                       rootRank=root_host)).wait()
    if sub.intra is not None and sub.layout.even:
        sub.intra.broadcast([buf], make_opts(dist.BroadcastOptions,
                                             rootRank=root_local)).wait()
    if buf is not t:
        t.copy_(buf)
    return [t]


def barrier(sub: Subgroups) -> list:
    """Intra barrier, then inter barrier (uneven layouts: ``flat``'s)."""
    if sub.layout.even:
        if sub.intra is not None:
            sub.intra.barrier().wait()
        sub.inter.barrier().wait()
    else:
        sub.flat.barrier().wait()
    return []
