"""Collectives that move data without reducing it (protocol: :mod:`fcoll.shm.transport.phases`).

Algorithms (n ranks, this rank r, sizes per rank, all in bytes: tensors are viewed as uint8):

* all_gather: up to one slot, the parts are packed into the slot's ``n * slot_bytes`` region
  (one phase, one contiguous copy out); larger, per chunk: copy in, one phase, one strided copy
  of all n rows out.
* broadcast: the root fills the whole slot region of every rank (``n * slot_bytes``), one
  phase, copy out.
* all_to_all: each slot holds n sub-slots (one per destination); rounds until the longest
  (source, destination) segment is through; the number of rounds comes from the headers.
* barrier: one phase with the header and no data.
"""

from __future__ import annotations

import torch

from fcoll.shm.transport.phases import Call, ceil_div, pipelined

SUBSLOT_ALIGN_BYTES = 64  # all_to_all sub-slots start on cache lines


def subslot_bytes(slot_bytes: int, n: int) -> int:
    """Bytes of one all_to_all sub-slot: a slot holds one per destination rank."""
    return (slot_bytes // n) // SUBSLOT_ALIGN_BYTES * SUBSLOT_ALIGN_BYTES


def rounds_for(longest_bytes: int, sub: int) -> int:
    """all_to_all rounds that move a segment of ``longest_bytes`` through ``sub``-byte
    sub-slots (at least one: the first carries the headers)."""
    return max(1, ceil_div(longest_bytes, sub))


def longest_segment_bytes(heads: list, row_bytes: int) -> int:
    """The longest segment any rank sends to any rank, from every rank's all_to_all header
    (``extra[0]``: its input split sizes, in rows of ``row_bytes``)."""
    return max(max(h.extra[0]) if h.extra[0] else 0 for h in heads) * row_bytes


def all_gather(c: Call, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Bytes: ``src [B]`` uint8 on every rank -> ``dst [n, B]`` uint8 (row p from rank p).

    When ``B`` fits one slot (``B <= slot_bytes``) the parts are *packed*: rank p writes its B
    bytes at offset ``p * B`` of the slot's ``n * slot_bytes`` bytes (the slot index is the
    group's, so the whole region belongs to this collective, as for broadcast), and the copy
    out is one contiguous copy; :func:`fcoll.shm.kernels.one_slot.all_gather_small` uses the same
    layout. Larger messages go chunk by chunk through each rank's own row.
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

    pipelined(c, ceil_div(B, S), write, read)


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

    pipelined(c, max(1, ceil_div(B, cap)), write, read)


def all_to_all(c: Call, src: torch.Tensor, dst: torch.Tensor, send: list[tuple[int, int]],
               recv: list[tuple[int, int]], row_bytes: int) -> None:
    """Bytes: ``src[send[p][0]:+send[p][1]]`` goes to rank p, lands in its ``dst`` at ``recv``.

    ``send``/``recv`` are (offset, length) in bytes per peer; the rows counts are checked against
    every peer's header first, and the number of rounds comes from the largest segment.
    """
    ch = c.ch
    n, r = ch.world, ch.rank
    data = ch.seg.data
    sub = subslot_bytes(ch.seg.layout.slot_bytes, n)

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
    local = rounds_for(max((ln for _, ln in send), default=0), sub)
    slot = c.slot()
    copy_in(slot, 0)
    c.publish(slot, True)
    nslot = -1
    if local > 1:
        nslot = c.slot()
        copy_in(nslot, 1)
    heads = c.collect(slot, True)
    rounds = rounds_for(longest_segment_bytes(heads, row_bytes), sub)
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
    """One phase: every rank's header, no data."""
    c.first_sync(c.slot())
