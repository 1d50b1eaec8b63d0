"""One-phase, one-slot collectives with cached views: the kernels of the fast paths.

A recurring small collective of one (op, dtype, shape) gets a plan once
(:mod:`fcoll.shm.group.fast_paths`): its header without the sequence number, the header offsets of
every slot, and tensor views of every slot laid out as the general algorithm of the same
collective lays it out (:mod:`fcoll.shm.kernels.reductions`, :mod:`fcoll.shm.kernels.movement`).
Each call then copies in, publishes its header, waits, compares the headers as bytes (decoding them
only if they differ), and copies or reduces out, making no tensor views and running no Python loop
over ranks. Because the slot layout and phases are the general path's, a peer that takes the
general path for the same collective (a non-contiguous input, say) interoperates.

Every kernel has the signature ``fn(ch, plan, *tensors, payload, what, start)``: the channel,
the plan, the user's tensors, this call's encoded header (:attr:`OneSlotPlan.payload`), its
name for messages (:attr:`OneSlotPlan.what`) and its start time (``time.monotonic()``,
seconds).
"""

from __future__ import annotations

import torch

from fcoll.ops.reduce import pair_reducer, reduce_rows
from fcoll.shm.transport import header_checks
from fcoll.shm.transport import headers as hdr
from fcoll.shm.kernels.movement import longest_segment_bytes, rounds_for
from fcoll.shm.transport.segment import NSLOTS
from fcoll.shm.transport.sync import Channel


class OneSlotPlan:
    """What a fast path prepares once per (op, dtype, shape, ...).

    Attributes:
        name: the collective's name (the header's ``op``).
        tail: the header without its sequence number (:meth:`Header.tail`); set it with
            :meth:`use_tail`.
        what: the collective as error messages name it, ``all_reduce (collective #12)``,
            formatted only when a message is (the number is the channel's ``seq``).
        views: per slot, the tensor views the kernel uses (documented by each kernel).
        hoffs: per slot, every rank's header offset; ``peer_hoffs``: the peers' only.
        op: the reduce op's name, or ``""``.
        split: 2 ranks, large parts: this rank's own part skips the slot (reduce_scatter,
            all_to_all).
        extra: kernel-specific facts (reduce_scatter split: ``(2, *dst.shape)``; all_to_all:
            ``(row_bytes, subslot_bytes)``).
        work: the last ``Work`` returned for this plan (reused by ``Engine.run_fast``).
    """

    __slots__ = ("name", "tail", "what", "views", "hoffs", "peer_hoffs", "op", "split", "extra",
                 "work", "payload", "set_seq", "spots", "_rank")

    def __init__(self, ch: Channel, header: hdr.Header, views: list, op: str = "",
                 split: bool = False, extra=None):
        n, r = ch.world, ch.rank
        lay = ch.seg.layout
        self.name, self.views, self._rank = header.op, views, r
        self.what = _What(header.op, ch)
        self.op, self.split, self.extra = op, split, extra
        self.work = None
        self.hoffs = [[lay.header(s, p) for p in range(n)] for s in range(NSLOTS)]
        self.peer_hoffs = [[lay.header(s, p) for p in range(n) if p != r] for s in range(NSLOTS)]
        self.use_tail(header.tail())

    def use_tail(self, tail: hdr.Tail) -> None:
        """Encode this plan's calls with header ``tail`` (the direct path's carries a tag):
        ``payload`` is its encoding, numbered in place by ``set_seq(seq)`` before each call
        (one buffer every call reuses; one executor runs a group's collectives one at a time),
        and ``spots[slot]`` where :func:`exchange` writes it and reads the peers' (this rank's
        :func:`headers.spot`, then the peers')."""
        self.tail = tail
        self.payload = bytearray(tail.encode(0))
        self.set_seq = hdr.seq_setter(self.payload)
        n = len(self.payload)
        self.spots = [(hdr.spot(offs[self._rank], n), [hdr.spot(o, n) for o in peers])
                      for offs, peers in zip(self.hoffs, self.peer_hoffs)]


class _What:
    """``all_reduce (collective #12)``, formatted when a message needs it: a plan's calls are
    numbered by ``ch.seq``, which the engine sets before each one (an f-string per call cost
    ~0.1 us on every small collective)."""

    __slots__ = ("name", "ch")

    def __init__(self, name: str, ch: Channel):
        self.name, self.ch = name, ch

    def __str__(self) -> str:
        return f"{self.name} (collective #{self.ch.seq})"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class AllReducePlan(OneSlotPlan):
    """A one-slot all_reduce of ``dtype`` and ``shape`` with reduce op ``op``: per slot, this
    rank's row, the peer's row (2 ranks) or None, and every rank's rows (as one ``[n, *shape]``
    tensor and as a list) shaped like the user's tensor."""

    __slots__ = ("pair",)

    def __init__(self, ch: Channel, dtype: torch.dtype, shape: tuple, op: str):
        seg, n, r = ch.seg, ch.world, ch.rank
        numel = 1
        for d in shape:
            numel *= d
        views = []
        for slot in range(NSLOTS):
            rows = seg.rows(slot, dtype)[:, :numel].view(n, *shape)
            row_list = list(rows.unbind(0))
            views.append((row_list[r], row_list[1 - r] if n == 2 else None, rows, row_list))
        header = hdr.Header(0, "all_reduce", hdr.dtype_name(dtype), tuple(shape), op)
        super().__init__(ch, header, views, op=op)
        #: 2 ranks: ``pair(mine, peer_row)`` reduces in place (``reduce_pair_inplace``'s bits)
        self.pair = pair_reducer(op, dtype, r == 0) if n == 2 else None


def exchange(ch: Channel, plan: OneSlotPlan, slot: int, payload: bytes, what: str,
             start: float) -> None:
    """Publish this rank's header (its data is already in ``slot``), wait for every peer, check
    the headers: a bytes compare, decoded and checked field by field only if they differ.

    Raises:
        CollectiveMismatchError: the headers disagree.
        PeerError: a peer died or the group timed out.
    """
    buf = ch.seg.buf
    words = ch.words
    (w, a, b), peers = plan.spots[slot]
    n = b - a
    buf[a:b] = payload  # hdr.write and hdr.equals, at the plan's precomputed spots
    words[w] = n
    ch.arrive()
    ch.wait_all(what, start)
    for w, a, b in peers:
        if words[w] != n or buf[a:b] != payload:
            header_checks.check([hdr.read(buf, o) for o in plan.hoffs[slot]], plan.name,
                                ch.describe, bytes(payload))
            break


def all_reduce_small(ch: Channel, plan: AllReducePlan, t: torch.Tensor, payload: bytes,
                     what: str, start: float) -> None:
    """All_reduce of ``t`` (contiguous CPU, fits one slot) in place, in one phase: copy in,
    publish header and data together, wait, check headers, reduce straight from the slots into
    ``t`` (avg: truncated toward zero on integers, see :mod:`fcoll.ops.reduce`). Same protocol
    as the one-chunk case of :func:`fcoll.shm.kernels.reductions.all_reduce`."""
    slot = ch.use % NSLOTS
    ch.use += 1
    mine, peer, rows, row_list = plan.views[slot]
    mine.copy_(t)
    exchange(ch, plan, slot, payload, what, start)
    if plan.pair is not None:
        plan.pair(t, peer)
    else:
        reduce_rows(rows, plan.op, t, row_list)


def all_reduce_small_into(ch: Channel, plan: AllReducePlan, src: torch.Tensor, dst: torch.Tensor,
                          payload: bytes, what: str, start: float) -> None:
    """:func:`all_reduce_small` out of place: ``src`` (any strides) reduced into ``dst`` (same
    shape and dtype), every rank's row in rank order (``reduce_rows``, as the out-of-place
    one-chunk case of :func:`fcoll.shm.kernels.reductions.all_reduce`), so the result is the
    general path's, bit for bit. The direct path's synchronous all_reduce."""
    slot = ch.use % NSLOTS
    ch.use += 1
    mine, _, rows, row_list = plan.views[slot]
    mine.copy_(src)
    exchange(ch, plan, slot, payload, what, start)
    reduce_rows(rows, plan.op, dst, row_list)


def all_gather_small(ch: Channel, plan: OneSlotPlan, src: torch.Tensor, dst: torch.Tensor,
                     payload: bytes, what: str, start: float) -> None:
    """One-slot all_gather ``src [*] -> dst [n * N, ...]`` in the packed layout of
    :func:`fcoll.shm.kernels.movement.all_gather`: ``plan.views[slot] = (my part shaped like src,
    every rank's part together shaped like dst)``; the copy out is one contiguous copy."""
    slot = ch.use % NSLOTS
    ch.use += 1
    mine, packed = plan.views[slot]
    mine.copy_(src)
    exchange(ch, plan, slot, payload, what, start)
    dst.copy_(packed)


def reduce_scatter_small(ch: Channel, plan: OneSlotPlan, src: torch.Tensor, dst: torch.Tensor,
                         payload: bytes, what: str, start: float) -> None:
    """One-slot reduce_scatter ``src [n * N, ...] -> dst [N, ...]``: ``plan.views[slot] = (my
    row shaped like src, piece r of every rank shaped [n, *dst.shape], its rows, my row's piece
    for the peer or None)``.

    With 2 ranks and large pieces (``plan.split``; ``plan.extra`` is then ``(2, *dst.shape)``)
    only the piece the peer reduces goes through shared memory, and this rank's own piece is
    read straight from ``src``: half the copy-in. The slot layout is the same, and no rank ever
    reads its peer's copy of its own piece, so a peer on the general path interoperates."""
    slot = ch.use % NSLOTS
    ch.use += 1
    mine, pieces, piece_list, for_peer = plan.views[slot]
    if not plan.split:
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
    """One-slot broadcast of ``buf [*]`` from ``root``: ``plan.views[slot]`` is the slot's
    region shaped like ``buf`` (the bytes :func:`fcoll.shm.kernels.movement.broadcast` uses)."""
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
    of :func:`fcoll.shm.kernels.movement.all_to_all`. If a peer's header differs (a general-path
    peer with other splits that still agree with ours), the rounds it needs are run too, with
    nothing to move here. With 2 ranks and large rows (``plan.split``) only the peer's row goes
    through shared memory and this rank's own row is copied straight from ``src`` to ``dst``
    (no rank reads its own sub-slot of a peer, so the layout is unchanged)."""
    slot = ch.use % NSLOTS
    ch.use += 1
    send, recv = plan.views[slot]
    split = plan.split
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
            heads = header_checks.check([hdr.read(buf, o) for o in plan.hoffs[slot]],
                                        plan.name, ch.describe, bytes(payload))
            row_bytes, sub = plan.extra
            rounds = rounds_for(longest_segment_bytes(heads, row_bytes), sub)
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
