"""Fences: how a rank gives up a collective in shared memory, and how its peers read and word it.

A rank that gives up a collective (timeout, dead peer, error, destroyed or aborted group, an
exception on it while it held collectives) stores the collective's sequence number, op, reason,
the first cause of the cascade and the rank to blame for it (carried forward from the fence it
saw, so every rank names the rank that started a cascade) and a short note in its own words in
its control record (:meth:`Fences.give_up`) and wakes its sleepers.
:meth:`~fcoll.shm.transport.sync.Channel.wait_all` reads every peer's fence word
(:attr:`Fences.peer_idx`) after the peers arrived (one load per peer: 2 ranks, one word) and a
sleeper on every wake-up; a fence on the current collective (``Channel.seq``, set by the engine)
or an earlier one raises :class:`PeerError` (:meth:`Fences.check`) before any data of that phase
is read. Sequence numbers are compared before anything else, and liveness is not checked once
every peer arrived: a collective that every rank completed never raises, whatever a peer does
after it (destroy its group, exit). Only loads and stores are used, so in the instant a rank
gives up a peer may already have read that phase (complete data, published before the rank gave
up) and finish that one collective; its next call raises.

:class:`PeerError` and the ``GAVE_UP_*`` reasons live here too: every error of a group's
waits (a dead peer, a timeout, a fence) is one a rank may write in its own fence.
"""

from __future__ import annotations

import threading
from typing import Callable

from fcoll.shm.transport.headers import quote_peer
from fcoll.shm.transport.op_codes import op_code, op_of_code
from fcoll.shm.transport.segment import (NOTE_BYTES, U32_BITS, U32_MASK, W_GAVE_UP,
                                         W_GAVE_UP_WHY, Segment)

# Sequence numbers wrap at 2**32: compared as serial numbers (RFC 1982)
_HALF_RANGE = 1 << (U32_BITS - 1)

# Why a rank gave up a collective (the low 4 bits of its W_GAVE_UP_WHY word; the next 4 bits
# hold the first cause of a cascade, see Fences.give_up).
GAVE_UP_ERROR = 1  # an unexpected error on that rank (its traceback is in its log)
GAVE_UP_TIMEOUT = 2
GAVE_UP_PEER_DIED = 3
GAVE_UP_PEER_GAVE_UP = 4  # it saw another rank's fence first
GAVE_UP_DESTROYED = 5  # its process group was destroyed (or the interpreter exited)
GAVE_UP_RAISED = 6  # an exception left a compiled step, or its rank check, on that rank
GAVE_UP_ABORTED = 7  # its process group was aborted (c10d's ProcessGroup.abort)
_WHY = {GAVE_UP_ERROR: "it failed with an unexpected error", GAVE_UP_TIMEOUT: "it timed out",
        GAVE_UP_PEER_DIED: "it saw a peer die", GAVE_UP_PEER_GAVE_UP: "a peer gave up first",
        GAVE_UP_DESTROYED: "its process group was destroyed",
        GAVE_UP_RAISED: "an exception was raised on it while it held collectives of the group",
        GAVE_UP_ABORTED: "it aborted its process group"}
_WHY_PEER = {GAVE_UP_TIMEOUT: "it timed out waiting for {}", GAVE_UP_PEER_DIED: "{} died",
             GAVE_UP_PEER_GAVE_UP: "{} gave up first"}
# The first cause of a cascade, said of its culprit (the rank to blame).
_ORIGIN = {GAVE_UP_ERROR: "{} failed with an unexpected error",
           GAVE_UP_TIMEOUT: "{} did not arrive in time (a rank timed out waiting for it)",
           GAVE_UP_PEER_DIED: "{} died", GAVE_UP_DESTROYED: "{} destroyed its process group",
           GAVE_UP_RAISED: "{} raised an exception while it held collectives of the group",
           GAVE_UP_ABORTED: "{} aborted its process group"}


class PeerError(RuntimeError):
    """A peer died, gave up, or the group timed out; the group cannot be used any more.

    Attributes:
        reason: what this rank writes in its fence when it gives up because of this error
            (``GAVE_UP_TIMEOUT``, ``GAVE_UP_PEER_DIED``, ...).
        peer: the group rank to blame (the one that died, did not arrive, or gave up
            first), or -1.
        origin, culprit: the first cause of the cascade this error is part of (a
            ``GAVE_UP_*`` other than ``GAVE_UP_PEER_GAVE_UP``) and the group rank it blames
            (-1: unknown); by default ``reason`` and ``peer``. A rank that gives up because
            of this error carries them forward in its fence, so every rank of a cascade
            names the rank that started it, however many ranks passed it on.
        note: the culprit's own words about the first cause (passed on with it), or "".
    """

    def __init__(self, message: str, reason: int = GAVE_UP_ERROR, peer: int = -1,
                 origin: int | None = None, culprit: int | None = None, note: str = ""):
        super().__init__(message)
        self.reason = reason
        self.peer = peer
        self.origin = reason if origin is None else origin
        self.culprit = peer if culprit is None else culprit
        self.note = note


class Fences:
    """The fence words of one group on one segment, seen from group rank ``rank``: this rank's
    own (written once, by :meth:`give_up`) and its peers' (read by :meth:`gave_up` and
    :meth:`check`). A :class:`~fcoll.shm.transport.sync.Channel` owns one.

    Args:
        seg: the mapped segment.
        rank: this process's rank in the group.
        world: group size.
        describe: group rank -> its name in messages (``"rank 1 (global rank 3)"``).
        wake: wakes every peer sleeping on this rank's arrival counter.

    Attributes:
        peers: the other group ranks, in order.
        peer_idx: the word index of each peer's fence (in ``peers`` order), for a poll that
            reads them before calling :meth:`check`.
    """

    def __init__(self, seg: Segment, rank: int, world: int, describe: Callable[[int], str],
                 wake: Callable[[], None]):
        self.seg = seg
        self.words = seg.words
        self.rank = rank
        self.world = world
        self.describe = describe
        self._wake = wake
        self.peers = [p for p in range(world) if p != rank]
        self.peer_idx = [seg.layout.word(p, W_GAVE_UP) for p in self.peers]
        # a full barrier after the mark: acquiring a threading.Lock ends in an atomic RMW
        self._lock = threading.Lock()

    def give_up(self, seq: int, op: str, reason: int, peer: int = -1,
                origin: int | None = None, culprit: int | None = None,
                note: str = "") -> None:
        """Mark collective ``seq`` (op ``op``) dead in this rank's control record, and wake
        every peer sleeping on this rank's counter so it sees the mark at once.

        Args:
            seq, op: the collective given up.
            reason: why (``GAVE_UP_*``).
            peer: the group rank this rank blames directly, or -1.
            origin, culprit: the first cause of the cascade and the rank it blames (default
                ``reason``, and ``peer``, or this rank for a reason about itself); a rank
                that gives up because another did passes that one's on.
            note: this rank's own words (an exception's type and message), at most
                :data:`~fcoll.shm.transport.segment.NOTE_BYTES` bytes of UTF-8 kept; peers quote it.

        The why word is ``reason | origin << 4 | op code << 8 | (culprit + 1) << 16``. A peer
        that waits at, or later arrives at, a phase of collective ``seq`` or a later one
        raises :class:`PeerError` naming this rank, the op, ``seq``, ``reason`` and the
        culprit, before it reads any data of that phase. The first mark stays: a rank gives
        up at most once (its engine is broken from then on). The note and the why word are
        stored before the sequence word, and x86-64 keeps stores in order, so a reader that
        sees the sequence sees them.
        """
        words = self.words
        lay = self.seg.layout
        mine = lay.word(self.rank, W_GAVE_UP)
        if words[mine]:
            return
        if origin is None or origin == GAVE_UP_PEER_GAVE_UP:
            origin = reason
        if culprit is None or culprit < 0:
            culprit = peer if origin in _WHY_PEER else self.rank
        raw = note.encode("utf-8", "replace")[:NOTE_BYTES]
        off = lay.note(self.rank)
        self.seg.buf[off:off + NOTE_BYTES] = raw.ljust(NOTE_BYTES, b"\0")
        words[lay.word(self.rank, W_GAVE_UP_WHY)] = (
            (reason & 0xF) | ((origin & 0xF) << 4) | (op_code(op) << 8)
            | (((culprit + 1) & 0xFFFF) << 16))
        words[mine] = ((seq + 1) & U32_MASK) or 1
        lock = self._lock
        lock.acquire()  # full barrier: the mark is visible before any later load
        lock.release()
        self._wake()

    def gave_up(self, p: int) -> tuple[int, str, int, int, int, str] | None:
        """``(seq mod 2**32, op, reason, culprit or -1, origin, note)`` of the collective
        group rank ``p`` gave up, or None (see :meth:`give_up`)."""
        lay = self.seg.layout
        mark = self.words[lay.word(p, W_GAVE_UP)]
        if not mark:
            return None
        why = self.words[lay.word(p, W_GAVE_UP_WHY)]
        code = (why >> 8) & 0xFF
        op = op_of_code(code) or "a collective"
        off = lay.note(p)
        note = bytes(self.seg.buf[off:off + NOTE_BYTES]).split(b"\0", 1)[0]
        return ((mark - 1) & U32_MASK, op, why & 0xF, (why >> 16) - 1, (why >> 4) & 0xF,
                note.decode("utf-8", "replace"))

    def left_group(self, p: int) -> str | None:
        """Why group rank ``p`` left the group by its own call ("destroyed its process group"
        or "aborted its process group"), or None while it has not (a rank that gave up a
        collective on an error or a timeout has not left: it still closes its group)."""
        mark = self.gave_up(p)
        if mark is None or mark[2] not in (GAVE_UP_DESTROYED, GAVE_UP_ABORTED):
            return None
        return "destroyed its process group" if mark[2] == GAVE_UP_DESTROYED else \
            "aborted its process group"

    def check(self, seq: int, what: str) -> None:
        """Raise :class:`PeerError` if a peer gave up collective ``seq`` (the one being
        executed, ``Channel.seq``) or an earlier one; ``what`` names it in the message.

        Sequence numbers are compared first, and liveness is not checked here at all: a
        fence on a later collective (a peer that destroyed its group, or exited, after its
        last collective) does not concern this one, which every peer completed, so it never
        raises, whether that peer is still alive or not (``Channel._block``'s ticks watch
        liveness while a peer has not arrived). The message names the rank that started the cascade
        (the fence's culprit), however many ranks passed it on.
        """
        for p in self.peers:
            mark = self.gave_up(p)
            if mark is None:
                continue
            given, op, reason, culprit, origin, note = mark
            if ((seq - given) & U32_MASK) >= _HALF_RANGE:
                continue  # a later collective than this one
            raise PeerError(
                f"fcoll {what}: {self.describe(p)} gave up {op} (collective #{given} of the "
                f"group) because {self._why(p, reason, culprit, origin, note)}; rank "
                f"{self.rank} computed no result from its data, and the process group is no "
                "longer usable on any rank until it is created again",
                GAVE_UP_PEER_GAVE_UP, p, origin, culprit if 0 <= culprit < self.world else p,
                note)

    def _why(self, p: int, reason: int, culprit: int, origin: int, note: str) -> str:
        """Why peer ``p`` gave up, from its fence, naming the culprit."""
        def name(q: int) -> str:
            return self.describe(q) + (" (this rank)" if q == self.rank else "")

        known = 0 <= culprit < self.world
        author = p  # whose words the note is: the culprit's, in a cascade
        if reason == GAVE_UP_PEER_GAVE_UP:
            why = "another rank gave up first"
            if known and origin in _ORIGIN:
                why += "; the first cause: " + _ORIGIN[origin].format(name(culprit))
                author = culprit
        elif reason in _WHY_PEER and known:
            why = _WHY_PEER[reason].format(name(culprit))
        else:
            why = _WHY.get(reason, "of an unknown reason")
        if note:
            why += f" ({quote_peer(self.describe(author), note)})"
        return why

