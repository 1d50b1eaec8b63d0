"""Data movement of each collective through the per-rank slots of a segment.

Every function runs with flat, contiguous CPU tensors and moves data in *chunks* that fit one
slot (``slot_bytes`` per rank). Chunk ``u`` of the group uses slot ``u % 3``. A rank writes
chunk ``u + 1`` right after publishing chunk ``u`` and before waiting for its peers (its copy
overlaps theirs). That is safe: the slot's previous use is ``u - 2``; every peer finished
reading it before it arrived at a phase of use ``u - 1``, which this rank has waited for.

The first phase of every collective also carries the header; headers are checked on every rank
before anything is written to an output, so an invalid or mismatched call raises everywhere and
moves no data.

Algorithms (n ranks, this rank r, sizes per rank):

* all_reduce, small (<= ``small_bytes``) or at most 2 ranks: per chunk, copy in, one phase,
  every rank reduces all n rows (one synchronisation; every rank computes the same bits).
* all_reduce, large, 3 ranks or more: per chunk, copy in; phase A; rank r reduces slice r of the chunk over all n
  rows into its output and back into its own slot; phase B; copy the other slices out. Each rank
  reduces 1/n of the data (reduce-scatter then all-gather, as in NCCL's ring/tree-free
  intra-node algorithms), and every output element is computed by exactly one rank, so all ranks
  end bit-identical.
* coalesced all_reduce (a list of tensors of one dtype): the chunks and phases of all_reduce
  of their concatenation, without concatenating: pieces of the inputs are copied straight
  into the slot row, and reduced from the slot rows straight into their outputs.
* all_gather: per chunk, copy in, one phase, one strided copy of all n rows out.
* reduce_scatter: per chunk, copy the n pieces in, one phase, reduce piece r over n rows
  (at 2 ranks, one slot and pieces of ``SPLIT_BYTES`` or more: only the peer's piece is
  copied in, and this rank's own piece is read from the input).
* broadcast: the root fills the whole slot pair row set (n * slot_bytes), one phase, copy out.
* all_to_all: each slot holds n sub-slots (one per destination); rounds until the longest
  (source, destination) segment is through; the number of rounds comes from the headers.
"""

from __future__ import annotations

import torch

from fcoll.ops.reduce import reduce_pair_inplace, reduce_rows
from fcoll.shm import headers as hdr
from fcoll.shm.segment import NSLOTS
from fcoll.shm.sync import Channel



class Call:
    """One collective as the worker runs it: the channel, names for errors, start time, header."""

    __slots__ = ("ch", "name", "what", "start", "payload", "first_use")

    def __init__(self, ch: Channel, name: str, what: str, start: float, payload: bytes):
        self.ch, self.name, self.what, self.start, self.payload = ch, name, what, start, payload
        self.first_use = ch.use

    def slot(self) -> int:
        ch = self.ch
        s = ch.use % NSLOTS
        ch.use += 1
        return s

    def publish(self, slot: int, first: bool) -> None:
        """Arrive at the next phase (with this rank's header if it is the collective's first)."""
        ch = self.ch
        if first:
            hdr.write(ch.seg.buf, ch.seg.layout.header(slot, ch.rank), self.payload)
        ch.arrive()

    def collect(self, slot: int, first: bool) -> list[tuple]:
        """Wait for every peer at this phase; on the first phase, check every header.

        A failed check rewinds the slot counter to just after the first chunk, so ranks that
        had already claimed a slot for their next chunk agree again with the others.
        """
        ch = self.ch
        ch.wait_all(self.what, self.start)
        if not first:
            return []
        lay = ch.seg.layout
        heads = [hdr.read(ch.seg.buf, lay.header(slot, p)) for p in range(ch.world)]
        try:
            return hdr.check(heads, self.name, ch.describe, self.payload)
        except hdr.CollectiveMismatchError:
            ch.use = self.first_use + 1
            raise

    def first_sync(self, slot: int) -> list[tuple]:
        """Publish this rank's header and data of the first phase, wait, check all headers."""
        self.publish(slot, True)
        return self.collect(slot, True)

    def sync(self) -> None:
        self.ch.arrive()
        self.ch.wait_all(self.what, self.start)


def pipelined(c: Call, count: int, write, read) -> None:
    """Run ``count`` one-phase chunks: ``write(i, slot)`` fills this rank's slot, and after every
    rank published chunk i, ``read(i, slot)`` consumes it. Chunk i+1 is written before waiting on
    chunk i (see the module docstring for why that is safe)."""
    slot = c.slot()
    write(0, slot)
    for i in range(count):
        c.publish(slot, i == 0)
        nslot = -1
        if i + 1 < count:
            nslot = c.slot()
            write(i + 1, nslot)
        c.collect(slot, i == 0)
        read(i, slot)
        slot = nslot


def _slice(L: int, n: int, p: int) -> tuple[int, int]:
    q = -(-L // n)
    q = -(-q // 16) * 16  # 16-element aligned slices keep vector loads aligned
    a = min(p * q, L)
    return a, min(a + q, L)


def all_reduce(c: Call, src: torch.Tensor, dst: torch.Tensor | None, op: str,
               small_bytes: int) -> None:
    """Reduce flat ``src`` across ranks into flat ``dst`` (``dst is src`` for all_reduce; None on
    the non-root ranks of a rooted reduce, which compute their share but write nothing).

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
        return
    if M * e <= small_bytes or n <= 2:
        # One phase per chunk, every rank reduces the whole chunk over all n rows. At 2 ranks
        # this moves less data than reduce-scatter + all-gather (write C, read 2C, write C vs
        # about 5C) and halves the synchronisations; for small messages latency dominates.
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

        pipelined(c, -(-M // per), write, read)
        return
    per = seg.layout.slot_bytes // e
    starts = list(range(0, M, per))
    scratch = None if dst is not None else torch.empty(-(-per // n) + 16, dtype=src.dtype)
    slot = c.slot()
    seg.rows(slot, src.dtype)[r, :min(per, M)].copy_(src[:min(per, M)])
    for i, c0 in enumerate(starts):
        L = min(per, M - c0)
        rows = seg.rows(slot, src.dtype)[:, :L]
        if i == 0:
            c.first_sync(slot)
        else:
            c.sync()
        a, b = _slice(L, n, r)
        if b > a:
            tgt = dst[c0 + a:c0 + b] if dst is not None else scratch[:b - a]
            reduce_rows(rows[:, a:b], op, tgt)
            rows[r, a:b].copy_(tgt)
        ch.arrive()
        if i + 1 < len(starts):
            nxt = starts[i + 1]
            nslot = c.slot()
            nl = min(per, M - nxt)
            seg.rows(nslot, src.dtype)[r, :nl].copy_(src[nxt:nxt + nl])
        ch.wait_all(c.what, c.start)
        if dst is not None:
            for p in range(n):
                if p != r:
                    a, b = _slice(L, n, p)
                    if b > a:
                        dst[c0 + a:c0 + b].copy_(rows[p, a:b])
        if i + 1 < len(starts):
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
# whose operands must come in rank order (signed zeros)
_FOREACH_INPLACE = {"sum": torch._foreach_add_, "product": torch._foreach_mul_}


def all_reduce_many(c: Call, srcs: list[torch.Tensor], dsts: list[torch.Tensor], op: str,
                    small_bytes: int) -> None:
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
    per-op overhead than the copy (4 ranks, measured: 200 tensors of 54 KiB in all 2.5 ->
    1.7 ms, 0.87 MiB 4.8 -> 2.6 ms, 13.9 MiB 21.5 -> 21.0 ms). Above ``small_bytes`` in all
    they take :func:`all_reduce`'s two-phase path the same way, so each output element is
    still computed by exactly one rank. Compared with concatenating, this saves a copy of
    every byte in and one out, and a fresh buffer's page faults.
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

    scratch = torch.empty(min(per, M), dtype=dtype) if n > 2 else None
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
        if n > 2:
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
    """:func:`all_reduce`'s reduce-scatter + all-gather path (3+ ranks) for
    :func:`all_reduce_many`: rank r reduces slice r of each chunk into ``scratch`` (a private
    row of ``slot_bytes``) and back into its own slot row; after phase B it gathers the other
    slices into ``scratch`` and copies the chunk's pieces out with one foreach call."""
    ch = c.ch
    n, r = ch.world, ch.rank
    seg = ch.seg
    slot = c.slot()
    write(0, slot)
    for u, (_, outs, _, lens, L) in enumerate(plan):
        rows = seg.rows(slot, dtype)
        if u == 0:
            c.first_sync(slot)
        else:
            c.sync()
        a, b = _slice(L, n, r)
        if b > a:
            reduce_rows(rows[:, a:b], op, scratch[a:b])
            rows[r, a:b].copy_(scratch[a:b])
        ch.arrive()
        nslot = -1
        if u + 1 < len(plan):
            nslot = c.slot()
            write(u + 1, nslot)
        ch.wait_all(c.what, c.start)
        for p in range(n):
            if p != r:
                a, b = _slice(L, n, p)
                if b > a:
                    scratch[a:b].copy_(rows[p, a:b])
        if outs:
            torch._foreach_copy_(outs, scratch[:L].split_with_sizes(lens))
        slot = nslot


class SmallAllReducePlan:
    """Cached views and facts of a one-slot all_reduce of one (dtype, shape, op): per slot, this
    rank's row and every rank's rows shaped like the user's tensor, and the header offsets. A
    recurring small all_reduce then makes no tensor views and runs no Python loop over ranks."""

    __slots__ = ("op", "tail", "views", "hoffs", "peer_hoffs", "pair", "name", "work")

    def __init__(self, ch: Channel, dtype: torch.dtype, shape: tuple, op: str):
        seg, n, r = ch.seg, ch.world, ch.rank
        numel = 1
        for d in shape:
            numel *= d
        self.op = op
        self.name = "all_reduce"
        self.work = None  # the last Work returned for this plan (reused by the process group)
        self.tail = ("all_reduce", str(dtype)[6:], tuple(shape), op, -1, None, None)
        self.views = []
        for slot in range(NSLOTS):
            rows = seg.rows(slot, dtype)[:, :numel].view(n, *shape)
            row_list = list(rows.unbind(0))
            self.views.append((row_list[r], row_list[1 - r] if n == 2 else None, rows, row_list))
        lay = seg.layout
        self.hoffs = [[lay.header(s, p) for p in range(n)] for s in range(NSLOTS)]
        self.peer_hoffs = [[lay.header(s, p) for p in range(n) if p != r] for s in range(NSLOTS)]
        self.pair = n == 2


class OneSlotPlan:
    """Header offsets of every slot, for the one-phase fast paths below; ``name`` is the
    collective's name, ``tail`` its header without the sequence number, ``views`` per-slot
    tensor views prepared by the caller."""

    __slots__ = ("name", "tail", "views", "hoffs", "peer_hoffs", "op", "extra", "work")

    def __init__(self, ch: Channel, name: str, tail: tuple, views: list, op: str = "",
                 extra=None):
        n, r = ch.world, ch.rank
        lay = ch.seg.layout
        self.name, self.tail, self.views, self.op, self.extra = name, tail, views, op, extra
        self.work = None  # the last Work returned for this plan (reused by the process group)
        self.hoffs = [[lay.header(s, p) for p in range(n)] for s in range(NSLOTS)]
        self.peer_hoffs = [[lay.header(s, p) for p in range(n) if p != r] for s in range(NSLOTS)]


def exchange(ch: Channel, plan, slot: int, payload: bytes, what: str, start: float) -> None:
    """Publish this rank's header (its data is already in ``slot``), wait for every peer, check
    the headers: a bytes compare, decoded and checked field by field only if they differ."""
    buf = ch.seg.buf
    words = ch.words
    hdr.write(buf, plan.hoffs[slot][ch.rank], payload, words)
    ch.arrive()
    ch.wait_all(what, start)
    for off in plan.peer_hoffs[slot]:
        if not hdr.equals(buf, words, off, payload):
            hdr.check([hdr.read(buf, o) for o in plan.hoffs[slot]], plan.name, ch.describe,
                      payload)
            break


def all_gather_small(ch: Channel, plan: OneSlotPlan, src: torch.Tensor, dst: torch.Tensor,
                     payload: bytes, what: str, start: float) -> None:
    """One-slot all_gather in the packed layout of :func:`all_gather`: ``plan.views[slot] =
    (my part shaped like src, every rank's part together shaped like the output)``; ``dst``
    is the output itself, so the copy out is one contiguous copy and needs no new view."""
    slot = ch.use % NSLOTS
    ch.use += 1
    mine, packed = plan.views[slot]
    mine.copy_(src)
    exchange(ch, plan, slot, payload, what, start)
    dst.copy_(packed)


def reduce_scatter_small(ch: Channel, plan: OneSlotPlan, src: torch.Tensor, dst: torch.Tensor,
                         payload: bytes, what: str, start: float) -> None:
    """One-slot reduce_scatter: ``plan.views[slot] = (my row shaped like src, piece r of every
    rank shaped [n, *dst.shape], its rows, my row's piece for the peer or None)``.

    With 2 ranks and large pieces (``plan.extra`` is then ``(2, *dst.shape)``) only the piece
    the peer reduces goes through shared memory, and this rank's own piece is read straight
    from ``src``: half the copy-in. The slot layout is the same, and no rank ever reads its
    peer's copy of its own piece, so a peer on the general path interoperates."""
    slot = ch.use % NSLOTS
    ch.use += 1
    mine, pieces, piece_list, for_peer = plan.views[slot]
    if plan.extra is None:
        mine.copy_(src)
        exchange(ch, plan, slot, payload, what, start)
        reduce_rows(pieces, plan.op, dst, piece_list)
        return
    r = ch.rank
    src2 = src.view(plan.extra)
    for_peer.copy_(src2[1 - r])
    exchange(ch, plan, slot, payload, what, start)
    own = src2[r]
    reduce_rows(None, plan.op, dst, [own, piece_list[1]] if r == 0 else [piece_list[0], own])


def broadcast_small(ch: Channel, plan: OneSlotPlan, buf: torch.Tensor, root: int,
                    payload: bytes, what: str, start: float) -> None:
    """One-slot broadcast: ``plan.views[slot]`` is the slot's region shaped like ``buf`` (the
    same bytes the general :func:`broadcast` uses)."""
    slot = ch.use % NSLOTS
    ch.use += 1
    region = plan.views[slot]
    if ch.rank == root:
        region.copy_(buf)
    exchange(ch, plan, slot, payload, what, start)
    if ch.rank != root:
        buf.copy_(region)


def all_to_all_small(ch: Channel, plan: OneSlotPlan, src: torch.Tensor, dst: torch.Tensor,
                     payload: bytes, what: str, start: float) -> None:
    """One-slot all_to_all with even splits; ``src``/``dst`` viewed ``[n, m]``;
    ``plan.views[slot] = (my n sub-slots [n, m], sub-slot r of every rank [n, m])``, the layout
    of :func:`all_to_all`. If a peer's header differs (a general-path peer with other splits
    that still agree with ours), the rounds it needs are run too, with nothing to move here.
    With 2 ranks and large rows (``plan.op == "split"``) only the peer's row goes through
    shared memory and this rank's own row is copied straight from ``src`` to ``dst`` (no rank
    reads its own sub-slot of a peer, so the layout is unchanged)."""
    slot = ch.use % NSLOTS
    ch.use += 1
    send, recv = plan.views[slot]
    split = plan.op == "split"  # 2 ranks, large rows: this rank's own row skips the slot
    if split:
        p = 1 - ch.rank
        send[p].copy_(src[p])
    else:
        send.copy_(src)
    buf = ch.seg.buf
    hdr.write(buf, plan.hoffs[slot][ch.rank], payload, ch.words)
    ch.arrive()
    ch.wait_all(what, start)
    rounds = 1
    for off in plan.peer_hoffs[slot]:
        if not hdr.equals(buf, ch.words, off, payload):
            heads = hdr.check([hdr.read(buf, o) for o in plan.hoffs[slot]], plan.name,
                              ch.describe, payload)
            row_bytes, sub = plan.extra
            longest = max(max(h[6][0]) if h[6][0] else 0 for h in heads) * row_bytes
            rounds = max(1, -(-longest // sub))
            break
    if split:  # outputs are written only after the header check
        dst[ch.rank].copy_(src[ch.rank])
        dst[p].copy_(recv[p])
    else:
        dst.copy_(recv)
    for _ in range(1, rounds):
        ch.use += 1
        ch.arrive()
        ch.wait_all(what, start)


def all_reduce_small(ch: Channel, plan: SmallAllReducePlan, t: torch.Tensor, payload: bytes,
                     what: str, start: float) -> None:
    """All_reduce of ``t`` (contiguous CPU, fits one slot) in place, in one phase: copy in, publish
    header and data together, wait, check headers (bytes compare; decoded only if they differ),
    reduce straight from the slots into ``t``. Same protocol as :func:`all_reduce`'s one-chunk
    case, so a peer running the general path interoperates."""
    slot = ch.use % NSLOTS
    ch.use += 1
    mine, peer, rows, row_list = plan.views[slot]
    mine.copy_(t)
    exchange(ch, plan, slot, payload, what, start)
    if plan.pair:
        reduce_pair_inplace(t, peer, plan.op, ch.rank == 0)
    else:
        reduce_rows(rows, plan.op, t, row_list)


def all_gather(c: Call, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Bytes: ``src [B]`` uint8 on every rank -> ``dst [n, B]`` uint8 (row p from rank p).

    When ``B`` fits one slot (``B <= slot_bytes``) the parts are *packed*: rank p writes its B
    bytes at offset ``p * B`` of the slot's ``n * slot_bytes`` bytes (the slot index is the
    group's, so the whole region belongs to this collective, as for broadcast), and the copy
    out is one contiguous copy; :func:`all_gather_small` uses the same layout. Larger messages
    go chunk by chunk through each rank's own row.
    """
    ch = c.ch
    r = ch.rank
    data = ch.seg.data
    B = src.numel()
    S = ch.seg.layout.slot_bytes
    if B <= S:
        slot = c.slot()
        flat = data[slot].view(-1)
        flat[r * B:(r + 1) * B].copy_(src)
        c.first_sync(slot)
        dst.view(-1).copy_(flat[:ch.world * B])
        return

    def write(i: int, slot: int) -> None:
        data[slot][r, :min(S, B - i * S)].copy_(src[i * S:(i + 1) * S])

    def read(i: int, slot: int) -> None:
        c0 = i * S
        L = min(S, B - c0)
        dst[:, c0:c0 + L].copy_(data[slot][:, :L])

    pipelined(c, -(-B // S), write, read)


def reduce_scatter(c: Call, src: torch.Tensor, dst: torch.Tensor, op: str) -> None:
    """``src [n, M]`` (contiguous) on every rank -> ``dst [M]`` = op over ranks of ``src[r]``."""
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

    pipelined(c, max(1, -(-M // per)), write, read)


def broadcast(c: Call, buf: torch.Tensor, root: int) -> None:
    """Bytes: ``buf [B]`` uint8; the root's contents end up in every rank's ``buf``."""
    ch = c.ch
    data = ch.seg.data
    B = buf.numel()
    cap = ch.world * ch.seg.layout.slot_bytes
    is_root = ch.rank == root

    def write(i: int, slot: int) -> None:
        if is_root:
            c0 = i * cap
            data[slot].view(-1)[:min(cap, B - c0)].copy_(buf[c0:c0 + cap])

    def read(i: int, slot: int) -> None:
        if not is_root:
            c0 = i * cap
            L = min(cap, B - c0)
            buf[c0:c0 + L].copy_(data[slot].view(-1)[:L])

    pipelined(c, max(1, -(-B // cap)), write, read)


def all_to_all(c: Call, src: torch.Tensor, dst: torch.Tensor, send: list[tuple[int, int]],
               recv: list[tuple[int, int]], row_bytes: int) -> None:
    """Bytes: ``src[send[p][0]:+send[p][1]]`` goes to rank p, lands in its ``dst`` at ``recv``.

    ``send``/``recv`` are (offset, length) in bytes per peer; the rows counts are checked against
    every peer's header first, and the number of rounds comes from the largest segment.
    """
    ch = c.ch
    n, r = ch.world, ch.rank
    data = ch.seg.data
    sub = (ch.seg.layout.slot_bytes // n) // 64 * 64

    def copy_in(slot: int, t: int) -> None:
        row = data[slot][r]
        for p in range(n):
            if p != r:
                off, ln = send[p]
                a, b = min(t * sub, ln), min((t + 1) * sub, ln)
                if b > a:
                    row[p * sub:p * sub + b - a].copy_(src[off + a:off + b])

    def copy_out(slot: int, t: int) -> None:
        for p in range(n):
            if p != r:
                off, ln = recv[p]
                a, b = min(t * sub, ln), min((t + 1) * sub, ln)
                if b > a:
                    dst[off + a:off + b].copy_(data[slot][p, r * sub:r * sub + b - a])

    # Rounds this rank knows it needs (its own longest segment) never exceed the group's
    # (from every header), so round t+1 can be copied in before waiting on round t while
    # t+1 < local rounds: one slot claimed per round, in round order, on every rank.
    local = max(1, -(-max((ln for _, ln in send), default=0) // sub))
    slot = c.slot()
    copy_in(slot, 0)
    c.publish(slot, True)
    nslot = -1
    if local > 1:
        nslot = c.slot()
        copy_in(nslot, 1)
    heads = c.collect(slot, True)
    longest = max(max(h[6][0]) if h[6][0] else 0 for h in heads) * row_bytes
    rounds = max(1, -(-longest // sub))
    off_s, ln_s = send[r]
    off_r, _ = recv[r]
    dst[off_r:off_r + ln_s].copy_(src[off_s:off_s + ln_s])
    copy_out(slot, 0)
    for t in range(1, rounds):
        if nslot < 0:
            nslot = c.slot()
            copy_in(nslot, t)
        slot, nslot = nslot, -1
        ch.arrive()
        if t + 1 < min(local, rounds):
            nslot = c.slot()
            copy_in(nslot, t + 1)
        ch.wait_all(c.what, c.start)
        copy_out(slot, t)


def barrier(c: Call) -> None:
    c.first_sync(c.slot())
