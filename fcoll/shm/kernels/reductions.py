"""Reducing collectives over the shared-memory slots (protocol: :mod:`fcoll.shm.transport.phases`).

Algorithms (n ranks, this rank r, sizes per rank):

* all_reduce, small (<= ``small_bytes``) or at most 2 ranks: per chunk, copy in, one phase,
  every rank reduces all n rows (one synchronisation; every rank computes the same bits).
* all_reduce, large, 3 ranks or more: per chunk, copy in; phase A; rank r reduces slice r of the
  chunk over all n rows into its output and back into its own slot; phase B; copy the other
  slices out. Each rank reduces 1/n of the data (reduce-scatter then all-gather, as in NCCL's
  ring/tree-free intra-node algorithms), and every output element is computed by exactly one
  rank, so all ranks end bit-identical.
* coalesced all_reduce (a list of tensors of one dtype): the chunks and phases of all_reduce
  of their concatenation, without concatenating: pieces of the inputs are copied straight
  into the slot row, and reduced from the slot rows straight into their outputs.
* reduce_scatter: per chunk, copy the n pieces in, one phase, reduce piece r over n rows.

Every reduce op goes through :mod:`fcoll.ops.reduce` (``reduce_rows``, ``reduce_pair_inplace``),
so ``avg`` is the sum divided by n, truncated toward zero on integer dtypes, on every path.
"""

from __future__ import annotations

import torch

from fcoll.ops.reduce import reduce_pair_inplace, reduce_rows
from fcoll.shm.transport.headers import NO_SEQ, Header, dtype_name
from fcoll.shm.transport.phases import SLICE_ALIGN_ELEMS, Call, ceil_div, pipelined, slice_of

SMALL_ALLREDUCE_BYTES = 64 << 10  # at 3+ ranks, one-phase all_reduce up to this size


def all_reduce(c: Call, src: torch.Tensor, dst: torch.Tensor | None, op: str,
               small_bytes: int = SMALL_ALLREDUCE_BYTES) -> None:
    """Reduce flat ``src`` across ranks into flat ``dst``.

    Args:
        src: ``[M]``, contiguous CPU, any dtype ``op`` accepts (the caller checked it).
        dst: ``[M]`` of ``src``'s dtype; ``dst is src`` for all_reduce; None on the non-root
            ranks of a rooted reduce, which compute their share but write nothing.
        op: reduce op name (``"sum"``, ``"avg"``, ...).
        small_bytes: at 3+ ranks, messages up to this many bytes take the one-phase path.

    Large messages pipeline: right after publishing chunk i (phase B of it with 3+ ranks), a
    rank copies chunk i+1 into the next slot before waiting for its peers.
    """
    ch = c.ch
    n, r = ch.world, ch.rank
    seg = ch.seg
    e = src.element_size()
    M = src.numel()
    per = seg.layout.slot_bytes // e
    if M <= per:  # one chunk: cached views, no slicing
        slot = c.slot()
        rows, row_list = seg.prefix_views(slot, src.dtype, M)
        row_list[r].copy_(src)
        c.first_sync(slot)
        if dst is src and n == 2:
            reduce_pair_inplace(dst, row_list[1 - r], op, r == 0)
        elif dst is not None:
            reduce_rows(rows, op, dst, row_list)
    elif M * e <= small_bytes or n <= 2:
        _all_reduce_one_phase(c, src, dst, op, per)
    else:
        _all_reduce_two_phase(c, src, dst, op, per)


def _all_reduce_one_phase(c: Call, src: torch.Tensor, dst: torch.Tensor | None, op: str,
                          per: int) -> None:
    """One phase per chunk of ``per`` elements; every rank reduces the whole chunk over all n
    rows. At 2 ranks this moves less data than reduce-scatter + all-gather (write C, read 2C,
    write C vs about 5C) and halves the synchronisations; for small messages latency
    dominates."""
    ch = c.ch
    n, r = ch.world, ch.rank
    seg = ch.seg
    M = src.numel()

    def write(i: int, slot: int) -> None:
        c0 = i * per
        seg.rows(slot, src.dtype)[r, :min(per, M - c0)].copy_(src[c0:c0 + per])

    def read(i: int, slot: int) -> None:
        if dst is not None:
            c0 = i * per
            L = min(per, M - c0)
            if dst is src and n == 2:
                reduce_pair_inplace(dst[c0:c0 + L], seg.rows(slot, src.dtype)[1 - r, :L], op,
                                    r == 0)
            else:
                reduce_rows(seg.rows(slot, src.dtype)[:, :L], op, dst[c0:c0 + L])

    pipelined(c, ceil_div(M, per), write, read)


def _all_reduce_two_phase(c: Call, src: torch.Tensor, dst: torch.Tensor | None, op: str,
                          per: int) -> None:
    """3+ ranks, large: :func:`two_phase` over chunks of ``per`` elements; rank r reduces slice
    r into ``dst`` (or a scratch row when ``dst`` is None), then copies the other slices out."""
    ch = c.ch
    n, r = ch.world, ch.rank
    seg = ch.seg
    M = src.numel()
    starts = list(range(0, M, per))
    lengths = [min(per, M - c0) for c0 in starts]
    scratch = None if dst is not None else torch.empty(ceil_div(per, n) + SLICE_ALIGN_ELEMS,
                                                        dtype=src.dtype)

    def write(i: int, slot: int) -> None:
        c0 = starts[i]
        seg.rows(slot, src.dtype)[r, :lengths[i]].copy_(src[c0:c0 + lengths[i]])

    def own(i: int, rows: torch.Tensor, a: int, b: int) -> torch.Tensor:
        c0 = starts[i]
        tgt = dst[c0 + a:c0 + b] if dst is not None else scratch[:b - a]
        reduce_rows(rows[:, a:b], op, tgt)
        return tgt

    def gather(i: int, rows: torch.Tensor, L: int) -> None:
        if dst is not None:
            c0 = starts[i]
            for p, a, b in other_slices(L, n, r):
                dst[c0 + a:c0 + b].copy_(rows[p, a:b])

    two_phase(c, src.dtype, lengths, write, own, gather)


def other_slices(L: int, n: int, r: int):
    """``(p, a, b)`` for every rank ``p != r`` whose slice ``[a, b)`` of ``L`` is not empty."""
    for p in range(n):
        if p != r:
            a, b = slice_of(L, n, p)
            if b > a:
                yield p, a, b


def two_phase(c: Call, dtype: torch.dtype, lengths: list[int], write, own, gather) -> None:
    """The reduce-scatter + all-gather loop of a large all_reduce at 3+ ranks, chunk by chunk.

    Chunk ``u`` has ``lengths[u]`` elements of ``dtype``. ``write(u, slot)`` copies this rank's
    chunk into its row of ``slot``. Phase A: once every rank's chunk is in, rank r reduces its
    slice ``[a, b)`` over all rows (``own(u, rows, a, b)`` returns the reduced slice, which is
    copied back into this rank's row). Phase B: once every rank's reduced slice is in,
    ``gather(u, rows, L)`` copies the other slices out. Each output element is computed by
    exactly one rank, so every rank gets the same bits. The next chunk is written into the next
    slot between the two phases (safe: see :mod:`fcoll.shm.transport.phases`).
    """
    ch = c.ch
    n, r = ch.world, ch.rank
    seg = ch.seg
    slot = c.slot()
    write(0, slot)
    for u, L in enumerate(lengths):
        rows = seg.rows(slot, dtype)[:, :L]
        if u == 0:
            c.first_sync(slot)
        else:
            c.sync()
        a, b = slice_of(L, n, r)
        if b > a:
            rows[r, a:b].copy_(own(u, rows, a, b))
        ch.arrive()
        nslot = -1
        if u + 1 < len(lengths):
            nslot = c.slot()
            write(u + 1, nslot)
        ch.wait_all(c.what, c.start)
        gather(u, rows, L)
        slot = nslot


def chunk_pieces(srcs: list[torch.Tensor], dsts: list[torch.Tensor] | None,
                 per: int) -> list[tuple[list, list, list[int], list[int], int]]:
    """Cut flat tensors, laid end to end, into chunks of ``per`` elements.

    Returns, per chunk (at least one, even when every tensor is empty): the pieces of
    ``srcs`` in it, the same pieces of ``dsts`` (``srcs[i]`` and ``dsts[i]`` have one numel;
    ``dsts`` None: the ``srcs`` pieces again), each piece's offset in the chunk and length,
    and the chunk's fill, all in elements. A tensor that straddles a chunk boundary gives a
    piece (a view) on each side; a whole tensor is its own piece; an empty one gives none.
    """
    chunks = []
    ins: list = []
    outs: list = ins if dsts is None else []
    offs: list[int] = []
    lens: list[int] = []
    o = 0
    for i, x in enumerate(srcs):
        m = x.numel()
        a = 0
        while a < m:
            ln = min(m - a, per - o)
            if ln == m:
                ins.append(x)
                if dsts is not None:
                    outs.append(dsts[i])
            else:
                ins.append(x[a:a + ln])
                if dsts is not None:
                    outs.append(dsts[i][a:a + ln])
            offs.append(o)
            lens.append(ln)
            a += ln
            o += ln
            if o == per:
                chunks.append((ins, outs, offs, lens, o))
                ins, offs, lens, o = [], [], [], 0
                outs = ins if dsts is None else []
    if o or not chunks:
        chunks.append((ins, outs, offs, lens, o))
    return chunks


# 2 ranks, in place: one foreach call per chunk instead of a loop over its pieces (same
# kernels per tensor on the CPU, so the same bits as reduce_pair_inplace); not min/max,
# whose operands must come in rank order (signed zeros), nor avg, whose integer form divides
# with truncation (no foreach kernel does): those reduce piece by piece
_FOREACH_INPLACE = {"sum": torch._foreach_add_, "product": torch._foreach_mul_}


def all_reduce_by_dtype(c: Call, groups: dict, in_place: bool, op: str) -> None:
    """A coalesced all_reduce of mixed dtypes: :func:`all_reduce_many` of each dtype's tensors,
    in the order of ``groups``, one after the other in one collective.

    Args:
        groups: dtype -> ``(srcs, dsts)``, flat contiguous tensors (``dsts`` unused when
            ``in_place``); the first group's header is the call's, every later group's first
            phase carries a header of its own (``seq`` ``NO_SEQ``, its dtype and numel), so
            ranks that group differently still raise instead of mixing data.
        in_place: reduce every ``srcs[i]`` into itself.
        op: reduce op name.
    """
    first = True
    for dt, (srcs, dsts) in groups.items():
        if not first:
            c.payload = Header(NO_SEQ, c.name, dtype_name(dt),
                               (sum(x.numel() for x in srcs),), op).encode()
        all_reduce_many(c, srcs, srcs if in_place else dsts, op)
        first = False


def all_reduce_many(c: Call, srcs: list[torch.Tensor], dsts: list[torch.Tensor], op: str,
                    small_bytes: int = SMALL_ALLREDUCE_BYTES) -> None:
    """All-reduce flat tensors of one dtype as if they were one concatenated tensor, without
    concatenating them: ``dsts[i] = op over ranks of srcs[i]``.

    Args:
        srcs: flat (1-D), contiguous CPU tensors, all of one dtype (at least one tensor).
        dsts: flat, contiguous outputs, ``dsts[i]`` of ``srcs[i]``'s numel; ``dsts is srcs``
            reduces in place. An output must not overlap any other input.

    Same chunks, phases and slot contents as :func:`all_reduce` of the concatenation, so the
    data that crosses shared memory and the synchronisations are unchanged. Each chunk is
    filled with one ``torch.cat(pieces, out=row)`` of the pieces of the inputs that fall in
    it, straight into this rank's slot row. At 2 ranks, after the chunk's phase each piece
    is reduced straight into its output as ``op(input piece, peer's row piece)`` (``op`` is
    commutative elementwise, so both ranks compute the same bits, see
    :func:`reduce_pair_inplace`; in place, one foreach call per chunk). At 3+ ranks the chunk
    is reduced whole over the rows, in rank order, into a private scratch row, and its pieces
    are copied out with one foreach call: per-piece reductions over n rows cost more in
    per-op overhead than the copy (up to twice as slow for buckets of many small tensors).
    Above ``small_bytes`` in all they take :func:`all_reduce`'s two-phase path the same way
    (:func:`two_phase`), so each output element is still computed by exactly one rank.
    Compared with concatenating, this saves a copy of every byte in and one out, and a fresh
    buffer's page faults.
    """
    ch = c.ch
    n, r = ch.world, ch.rank
    seg = ch.seg
    dtype = srcs[0].dtype
    e = srcs[0].element_size()
    per = seg.layout.slot_bytes // e
    in_place = dsts is srcs
    # per chunk: its input pieces, output pieces, offsets in the chunk, lengths, and fill
    plan = chunk_pieces(srcs, None if in_place else dsts, per)
    M = sum(p[4] for p in plan)

    def write(u: int, slot: int) -> None:
        ins, _, _, _, L = plan[u]
        if ins:
            torch.cat(ins, out=seg.rows(slot, dtype)[r, :L])

    scratch = torch.empty(min(per, M), dtype=dtype) if n != 2 else None
    if M * e > small_bytes and n > 2:
        _all_reduce_many_two_phase(c, plan, write, dtype, op, scratch)
        return
    fused = _FOREACH_INPLACE.get(op) if in_place and dtype != torch.bool else None
    add = op == "sum" and dtype != torch.bool

    def read(u: int, slot: int) -> None:
        ins, outs, _, lens, L = plan[u]
        if not ins:
            return
        rows = seg.rows(slot, dtype)[:, :L]
        if n != 2:  # the pair kernels below read the one peer row of a 2-rank group
            reduce_rows(rows, op, scratch[:L])
            torch._foreach_copy_(outs, scratch[:L].split_with_sizes(lens))
            return
        peer = rows[1 - r].split_with_sizes(lens)
        if fused is not None:
            fused(outs, peer)
        elif in_place:
            for d, p in zip(outs, peer):
                reduce_pair_inplace(d, p, op, r == 0)
        elif add:
            for s, p, d in zip(ins, peer, outs):
                torch.add(s, p, out=d)
        else:
            for s, p, d in zip(ins, peer, outs):
                reduce_rows(None, op, d, [s, p] if r == 0 else [p, s])

    pipelined(c, len(plan), write, read)


def _all_reduce_many_two_phase(c: Call, plan: list, write, dtype: torch.dtype, op: str,
                               scratch: torch.Tensor) -> None:
    """:func:`two_phase` for :func:`all_reduce_many`: rank r reduces slice r of each chunk into
    ``scratch`` (a private row of ``slot_bytes``); after phase B it gathers the other slices
    into ``scratch`` and copies the chunk's pieces out with one foreach call."""
    n, r = c.ch.world, c.ch.rank

    def own(u: int, rows: torch.Tensor, a: int, b: int) -> torch.Tensor:
        reduce_rows(rows[:, a:b], op, scratch[a:b])
        return scratch[a:b]

    def gather(u: int, rows: torch.Tensor, L: int) -> None:
        for p, a, b in other_slices(L, n, r):
            scratch[a:b].copy_(rows[p, a:b])
        _, outs, _, lens, _ = plan[u]
        if outs:
            torch._foreach_copy_(outs, scratch[:L].split_with_sizes(lens))

    two_phase(c, dtype, [p[4] for p in plan], write, own, gather)


def reduce_scatter(c: Call, src: torch.Tensor, dst: torch.Tensor, op: str) -> None:
    """``src [n, M]`` (contiguous) on every rank -> ``dst [M]`` = ``op`` over ranks of
    ``src[r]``; one dtype, any that ``op`` accepts. Per chunk, the n pieces go in, one phase,
    piece r is reduced over the n rows."""
    ch = c.ch
    n, r = ch.world, ch.rank
    seg = ch.seg
    M = dst.numel()
    per = seg.layout.slot_bytes // (src.element_size() * n)

    def write(i: int, slot: int) -> None:
        c0 = i * per
        L = min(per, M - c0)
        seg.rows(slot, src.dtype)[r, :n * L].view(n, L).copy_(src[:, c0:c0 + L])

    def read(i: int, slot: int) -> None:
        c0 = i * per
        L = min(per, M - c0)
        reduce_rows(seg.rows(slot, src.dtype)[:, r * L:(r + 1) * L], op, dst[c0:c0 + L])

    pipelined(c, max(1, ceil_div(M, per)), write, read)
