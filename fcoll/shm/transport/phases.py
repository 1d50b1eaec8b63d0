"""The slot and phase protocol that every shared-memory algorithm runs on.

Every algorithm runs with flat, contiguous CPU tensors and moves data in *chunks* that fit one
slot (``slot_bytes`` per rank). Chunk ``u`` of the group uses slot ``u % NSLOTS`` (``NSLOTS`` is
3). A rank writes chunk ``u + 1`` right after publishing chunk ``u`` and before waiting for its
peers (its copy overlaps theirs). That is safe: the slot's previous use is ``u - 2``; every peer
finished reading it before it arrived at a phase of use ``u - 1``, which this rank has waited
for.

The first phase of every collective also carries the header (:mod:`fcoll.shm.transport.headers`);
headers are checked on every rank before anything is written to an output, so an invalid or
mismatched call raises everywhere and moves no data.

The algorithms: :mod:`fcoll.shm.kernels.reductions` (all_reduce, coalesced all_reduce,
reduce_scatter), :mod:`fcoll.shm.kernels.movement` (all_gather, broadcast, all_to_all, barrier) and
:mod:`fcoll.shm.kernels.one_slot` (one-phase forms of those, with cached views, for the fast paths).
"""

from __future__ import annotations

from fcoll.shm.transport import header_checks
from fcoll.shm.transport import headers as hdr
from fcoll.shm.transport.segment import NSLOTS
from fcoll.shm.transport.sync import TRANSFER_BYTES_PER_S, Channel

SLICE_ALIGN_ELEMS = 16  # 16-element aligned slices keep vector loads aligned


class Call:
    """One collective as the worker runs it: the channel, names for errors, start time, header.

    Attributes:
        ch: the group's channel.
        name: the collective's name, for messages (``"all_reduce"``).
        what: the collective with its number, for messages (``"all_reduce (collective #3)"``).
        start: ``time.monotonic()`` at its start, in seconds; timeouts count from it.
        payload: this rank's encoded header for the next first phase.
        first_use: the channel's slot-use counter when the collective started.
    """

    __slots__ = ("ch", "name", "what", "start", "payload", "first_use")

    def __init__(self, ch: Channel, name: str, what: str, start: float, payload: bytes):
        self.ch, self.name, self.what, self.start, self.payload = ch, name, what, start, payload
        self.first_use = ch.use

    def slot(self) -> int:
        """Claim the group's next slot (round robin over ``NSLOTS``)."""
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

    def collect(self, slot: int, first: bool) -> list[hdr.Header]:
        """Wait for every peer at this phase; on the first phase, check every header.

        A failed check rewinds the slot counter to just after the first chunk, so ranks that
        had already claimed a slot for their next chunk agree again with the others.

        Raises:
            CollectiveMismatchError: on the first phase, the headers disagree.
            PeerError: a peer died or the group timed out.
        """
        ch = self.ch
        ch.wait_all(self.what, self.start)
        if not first:
            return []
        lay = ch.seg.layout
        heads = [hdr.read(ch.seg.buf, lay.header(slot, p)) for p in range(ch.world)]
        try:
            return header_checks.check(heads, self.name, ch.describe, self.payload)
        except hdr.CollectiveMismatchError:
            ch.use = self.first_use + 1
            raise

    def first_sync(self, slot: int) -> list[hdr.Header]:
        """Publish this rank's header and data of the first phase, wait, check all headers."""
        self.publish(slot, True)
        return self.collect(slot, True)

    def sync(self) -> None:
        """A later phase: arrive and wait for every peer."""
        self.ch.arrive()
        self.ch.wait_all(self.what, self.start)


def pipelined(c: Call, count: int, write, read) -> None:
    """Run ``count`` one-phase chunks: ``write(i, slot)`` fills this rank's slot, and after every
    rank published chunk i, ``read(i, slot)`` consumes it. Chunk i+1 is written before waiting on
    chunk i (see the module docstring for why that is safe). The waits of a spinning rank
    allow for a peer still writing a whole slot (:attr:`Channel.transfer_s`)."""
    c.ch.transfer_s = c.ch.seg.layout.slot_bytes / TRANSFER_BYTES_PER_S if count > 1 else 0.0
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


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def slice_of(length: int, n: int, p: int) -> tuple[int, int]:
    """``[a, b)``: rank ``p``'s slice of a chunk of ``length`` elements split over ``n`` ranks,
    ``SLICE_ALIGN_ELEMS``-aligned (the last slices may be short or empty)."""
    q = ceil_div(ceil_div(length, n), SLICE_ALIGN_ELEMS) * SLICE_ALIGN_ELEMS
    a = min(p * q, length)
    return a, min(a + q, length)
