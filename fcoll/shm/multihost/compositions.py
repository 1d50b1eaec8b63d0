"""The composed collectives of :class:`~fcoll.shm.multihost.hierarchical.HierarchicalProcessGroup`.

all_reduce (in place and out of place), reduce, all_reduce_coalesced (in place and out of place),
all_gather and reduce_scatter (tensor, list and coalesced forms), broadcast and barrier: the ops
of the table in :mod:`fcoll.shm.multihost.hierarchical`, each run as intra-host steps (shared memory) and
inter-host steps (gloo), or on ``flat`` on an uneven layout. Each checks its arguments on this
rank and queues its body through the group's ``_op`` (the pre-flight, then the body); barrier
queues its steps through ``_submit`` (no pre-flight).

They live apart from ``hierarchical.py`` so that each file holds one idea: there, the group (its
sub-groups, identity, lifecycle, queue and pre-flight) and the ops that always run on ``flat``
(all_to_all, gather, scatter, point-to-point); here, the per-op compositions. They are
module-level functions taking the group, not a mixin: :func:`fcoll.compat.run_eagerly_under_dynamo`
wraps only the methods a class defines itself, so ``HierarchicalProcessGroup`` binds each public
one in its own body (``allreduce = hierarchical_compositions.allreduce``) and they stay eager
entry points under Dynamo, as before.

Shapes per rank are those of :class:`~fcoll.shm.group.process_group.FcollProcessGroup`.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from fcoll.ops.reduce import (
    DIST_REDUCE_OPS,
    divide_for_avg,
    reduce_op_name,
    reduce_rows_into,
)
from fcoll.shm.group import arg_checks as checks
from fcoll.shm.multihost.work import HierarchicalWork
from fcoll.shm.multihost.gloo_link import (
    REDUCE_CODES,
    as_bytes,
    chunk_spans,
    gloo_all_reduce,
    gloo_all_reduce_start,
    gloo_reduce_scatter_rows,
    make_opts,
)
from fcoll.shm.group.validate import check_all_gather

if TYPE_CHECKING:
    from fcoll.shm.multihost.hierarchical import HierarchicalProcessGroup


# ---- all_reduce -----------------------------------------------------------------------
def _all_reduce_flat(pg: HierarchicalProcessGroup, flat: torch.Tensor, op: str) -> None:
    """The composed all_reduce of a 1-D contiguous tensor, in place (uneven layouts: on
    ``flat``); after the op's pre-flight."""
    step = "sum" if op == "avg" else op
    if not pg.layout.even:
        gloo_all_reduce(pg._flat, flat, step)
    elif pg._intra is None:
        gloo_all_reduce(pg._inter, flat, step)
    else:
        L = pg._intra.size()
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
        scattered = [pg._intra.reduce_scatter_single(sh, p, rs)
                     for sh, p in zip(shards, pieces)]
        finishes = []
        for work, shard in zip(scattered, shards):
            work.wait()
            finishes.append(gloo_all_reduce_start(pg._inter, shard, step))
        gathered = []
        for finish, shard, piece in zip(finishes, shards, pieces):
            finish()
            if op == "avg":
                divide_for_avg(shard, pg._size)
            gathered.append(pg._intra.all_gather_single(
                piece, shard, make_opts(AllgatherOptions, asyncOp=queued)))
        for work in gathered:
            work.wait()
        if pad:
            flat.copy_(buf[:flat.numel()])
        return
    if op == "avg":
        divide_for_avg(flat, pg._size)


def _all_reduce_into(pg: HierarchicalProcessGroup, t: torch.Tensor, op: str,
                     out: torch.Tensor | None = None):
    target = t if out is None else out
    flat = target.view(-1) if target.is_contiguous() else target.contiguous().view(-1)
    if out is not None:
        flat.copy_(t.reshape(-1))
    _all_reduce_flat(pg, flat, op)
    if flat.data_ptr() != target.data_ptr():
        target.copy_(flat.view(target.shape))
    return [target]


def allreduce(pg: HierarchicalProcessGroup, tensors, opts=None) -> dist.Work:
    op = reduce_op_name((opts or dist.AllreduceOptions()).reduceOp)
    err = checks.all_reduce_error(tensors, op, pg._size)
    t = checks.first(tensors)
    return pg._op("all_reduce", t, err, lambda: _all_reduce_into(pg, t, op),
                  REDUCE_CODES.get(op, -1), op)


def allreduce_out_of_place(pg: HierarchicalProcessGroup, input: torch.Tensor,
                           output: torch.Tensor, op: dist.ReduceOp) -> dist.Work:
    """All-reduce ``input`` into ``output`` (same shape and dtype), input untouched."""
    name = reduce_op_name(op)
    err = checks.coalesced_all_reduce_error([input], [output], name)
    return pg._op("all_reduce", input, err,
                  lambda: _all_reduce_into(pg, input, name, output),
                  REDUCE_CODES.get(name, -1), name)


def reduce(pg: HierarchicalProcessGroup, tensors, opts=None) -> dist.Work:
    opts = opts if opts is not None else dist.ReduceOptions()
    op, root = reduce_op_name(opts.reduceOp), opts.rootRank
    err = checks.all_reduce_error(tensors, op, pg._size, root)
    t = checks.first(tensors)

    def run():
        scratch = t.detach().reshape(-1).clone()
        _all_reduce_flat(pg, scratch, op)
        if pg._rank == root:
            t.copy_(scratch.view(t.shape))
        return [t]
    code = REDUCE_CODES.get(op, -1) * (1 << 32) + (root if not err else 0)
    return pg._op("reduce", t, err, run, code, op)


def _coalesced_run(pg: HierarchicalProcessGroup, tensors: list[torch.Tensor],
                   op: str) -> list[torch.Tensor]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        _all_reduce_flat(pg, flat, op)
        off = 0
        for t in group:
            t.copy_(flat[off:off + t.numel()].view(t.shape))
            off += t.numel()
    return list(tensors)


def _coalesced_code(tensors, op: str) -> int:
    """The pre-flight code of a coalesced call: the reduce op and a digest of every
    tensor's dtype and shape (crc32: the same in every process)."""
    sig = zlib.crc32(repr([(str(t.dtype), tuple(t.shape)) for t in tensors]).encode())
    return REDUCE_CODES.get(op, -1) * (1 << 32) + sig


def allreduce_coalesced(pg: HierarchicalProcessGroup, tensors, opts=None) -> dist.Work:
    """All-reduce every tensor in place in one op (dtypes may mix: one composed
    all_reduce per dtype, over the tensors of that dtype concatenated)."""
    op = reduce_op_name((opts or dist.AllreduceCoalescedOptions()).reduceOp)
    err = checks.coalesced_all_reduce_error(tensors, None, op)
    code = 0 if err else _coalesced_code(tensors, op)
    return pg._op("all_reduce_coalesced", None, err,
                  lambda: _coalesced_run(pg, list(tensors), op), code, op)


def allreduce_coalesced_out_of_place(pg: HierarchicalProcessGroup, inputs, outputs,
                                     op) -> dist.Work:
    """``outputs[i] = all_reduce(inputs[i])`` for every i, in one op; inputs untouched."""
    name = reduce_op_name(op)
    err = checks.coalesced_all_reduce_error(inputs, outputs, name)
    code = 0 if err else _coalesced_code(inputs, name)

    def run():
        for a, b in zip(inputs, outputs):
            b.copy_(a)
        return _coalesced_run(pg, list(outputs), name)
    return pg._op("all_reduce_coalesced", None, err, run, code, name)


# ---- all_gather -----------------------------------------------------------------------
def _all_gather_run(pg: HierarchicalProcessGroup, output: torch.Tensor, input: torch.Tensor):
    x = input.detach().reshape(-1).contiguous()
    N = x.numel()
    if not pg.layout.even:
        buf = output if output.is_contiguous() else x.new_empty(pg._size * N)
        pg._flat._allgather_base(as_bytes(buf), as_bytes(x)).wait()
        if buf is not output:
            output.copy_(buf.view(output.shape))
        return [output]
    H = pg.layout.num_hosts
    spans = chunk_spans(N, x.element_size() * pg._size)
    # pipeline: every piece's inter all_gather is queued at once; each intra all_gather
    # starts when its piece arrived; each reordering copy when that is done
    hosts_rows = [x.new_empty(H * k) for _, k in spans]
    inter = [pg._inter._allgather_base(as_bytes(g), as_bytes(x[o:o + k]))
             for g, (o, k) in zip(hosts_rows, spans)]
    all_rows, intra = [], []
    for work, g in zip(inter, hosts_rows):
        work.wait()
        if pg._intra is None:
            all_rows.append(g)
            continue
        a = x.new_empty(pg._intra.size() * g.numel())
        intra.append(pg._intra.all_gather_single(
            a, g, make_opts(AllgatherOptions, asyncOp=len(spans) > 1)))
        all_rows.append(a)
    out = output.view(pg._size, N) if output.is_contiguous() else x.new_empty(
        (pg._size, N))
    for c, (a, (o, k)) in enumerate(zip(all_rows, spans)):
        if intra:
            intra[c].wait()
        if k:
            out[:, o:o + k] = a.view(-1, k).index_select(0, pg._gather_order)
    if out.data_ptr() != output.data_ptr():
        output.copy_(out.view(output.shape))
    return [output]


def all_gather_single(pg: HierarchicalProcessGroup, output, input, opts=None) -> dist.Work:
    err = check_all_gather(input, output, pg._size, pg._rank)
    return pg._op("all_gather_into_tensor", input, err,
                  lambda: _all_gather_run(pg, output, input))


def allgather(pg: HierarchicalProcessGroup, output_tensors, input_tensors,
              opts=None) -> dist.Work:
    """List form: ``output_tensors[0][r]`` receives rank r's ``input_tensors[0]``."""
    err = checks.all_gather_list_error(output_tensors, input_tensors, pg._size, pg._rank)
    inp = checks.first(input_tensors)
    if err:
        return pg._op("all_gather", inp, err, list)
    outs = list(output_tensors[0])
    stacked = inp.new_empty((pg._size, *inp.shape))

    def run():
        _all_gather_run(pg, stacked, inp)
        for o, s in zip(outs, stacked.unbind(0)):
            o.copy_(s)
        return [outs]
    return pg._op("all_gather", inp, None, run)


def allgather_coalesced(pg: HierarchicalProcessGroup, output_lists, input_list,
                        opts=None) -> dist.Work:
    err = checks.pairs_error("output_lists", output_lists, "input_list", input_list)
    if err:
        return pg._op("all_gather", None, err, list)
    works = [pg.allgather([o], [i]) for o, i in zip(output_lists, input_list)]
    return HierarchicalWork([f for w in works for f in w._futures], pg._runner)


def all_gather_single_coalesced(pg: HierarchicalProcessGroup, outputs, inputs,
                                opts=None) -> dist.Work:
    err = checks.pairs_error("outputs", outputs, "inputs", inputs)
    if err:
        return pg._op("all_gather_into_tensor", None, err, list)
    works = [pg.all_gather_single(o, i) for o, i in zip(outputs, inputs)]
    return HierarchicalWork([f for w in works for f in w._futures], pg._runner)


# ---- reduce_scatter -------------------------------------------------------------------
def _reduce_scatter_run(pg: HierarchicalProcessGroup, output: torch.Tensor, input: torch.Tensor,
                        op: str):
    N = output.numel()
    H = pg.layout.num_hosts
    step = "sum" if op == "avg" else op
    if not pg.layout.even:
        res = gloo_reduce_scatter_rows(
            pg._flat, input.detach().reshape(pg._size, N).contiguous(), step)
        if op == "avg":
            divide_for_avg(res, pg._size)
        output.copy_(res.view(output.shape))
        return [output]
    rows = input.detach().reshape(pg._size, N)
    spans = chunk_spans(N, rows.element_size() * pg._size)
    # pipeline: every piece's intra reduce_scatter is queued at once; each inter
    # all_to_all starts when its piece is reduced on the host; each local reduction when
    # its all_to_all is done
    pieces = [rows[:, o:o + k].index_select(0, pg._scatter_order) for o, k in spans]
    if pg._intra is not None:
        rs = make_opts(dist.ReduceScatterOptions, reduceOp=DIST_REDUCE_OPS[step],
                       asyncOp=len(pieces) > 1)
        shards = [p.new_empty((H, p.shape[1])) for p in pieces]
        scattered = [pg._intra.reduce_scatter_single(sh, p.view(-1), rs)
                     for sh, p in zip(shards, pieces)]
    else:
        shards, scattered = pieces, []
    exchanged = []
    for c, shard in enumerate(shards):
        if scattered:
            scattered[c].wait()
        got = torch.empty_like(shard)
        exchanged.append((got, pg._inter.alltoall_base(
            as_bytes(got), as_bytes(shard), [], [], dist.AllToAllOptions())))
    res = rows.new_empty(N)
    for (got, work), (o, k) in zip(exchanged, spans):
        work.wait()
        reduce_rows_into(got, step, res[o:o + k])
    if op == "avg":
        divide_for_avg(res, pg._size)
    output.copy_(res.view(output.shape))
    return [output]


def reduce_scatter_single(pg: HierarchicalProcessGroup, output, input, opts=None) -> dist.Work:
    opts = opts if opts is not None else dist.ReduceScatterOptions()
    op = reduce_op_name(opts.reduceOp)
    err = checks.reduce_scatter_tensor_error(output, input, op, pg._size)
    return pg._op("reduce_scatter_tensor", input, err,
                  lambda: _reduce_scatter_run(pg, output, input, op),
                  REDUCE_CODES.get(op, -1), op)


def reduce_scatter(pg: HierarchicalProcessGroup, output_tensors, input_lists,
                   opts=None) -> dist.Work:
    """List form: ``output_tensors[0]`` = reduction of every rank's ``input_lists[0][me]``."""
    opts = opts if opts is not None else dist.ReduceScatterOptions()
    op = reduce_op_name(opts.reduceOp)
    err = checks.reduce_scatter_list_error(output_tensors, input_lists, op, pg._size)
    out = checks.first(output_tensors)
    if err:
        return pg._op("reduce_scatter", out, err, list)
    stacked = torch.stack([i.detach().reshape(-1) for i in input_lists[0]]).view(-1)
    return pg._op("reduce_scatter", out, None,
                  lambda: _reduce_scatter_run(pg, out, stacked, op),
                  REDUCE_CODES.get(op, -1), op)


def reduce_scatter_single_coalesced(pg: HierarchicalProcessGroup, outputs, inputs,
                                    opts=None) -> dist.Work:
    err = checks.pairs_error("outputs", outputs, "inputs", inputs)
    if err:
        return pg._op("reduce_scatter_tensor", None, err, list)
    works = [pg.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
    return HierarchicalWork([f for w in works for f in w._futures], pg._runner)


# ---- broadcast, barrier ------------------------------------------------------------------
def broadcast(pg: HierarchicalProcessGroup, tensors, opts=None) -> dist.Work:
    root = (opts or dist.BroadcastOptions()).rootRank
    err = checks.broadcast_error(tensors, root, pg._size)
    t = checks.first(tensors)
    if err:
        return pg._op("broadcast", t, err, list)
    root_host, root_local = pg.layout.host_of(root), pg.layout.local_rank_of(root)

    def run():
        buf = t if t.is_contiguous() else t.contiguous()
        if not pg.layout.even:
            pg._flat.broadcast([as_bytes(buf)], make_opts(dist.BroadcastOptions,
                                                        rootRank=root)).wait()
        elif pg.local_rank == root_local:
            pg._inter.broadcast([as_bytes(buf)], make_opts(dist.BroadcastOptions,
                                                         rootRank=root_host)).wait()
        if pg._intra is not None and pg.layout.even:
            pg._intra.broadcast([buf], make_opts(dist.BroadcastOptions,
                                                 rootRank=root_local)).wait()
        if buf is not t:
            t.copy_(buf)
        return [t]
    return pg._op("broadcast", t, None, run, root)


def barrier(pg: HierarchicalProcessGroup, opts=None) -> dist.Work:
    def run():
        if pg.layout.even:
            if pg._intra is not None:
                pg._intra.barrier().wait()
            pg._inter.barrier().wait()
        else:
            pg._flat.barrier().wait()
        return []
    return pg._submit(run)
