"""Point-to-point on fcoll's backend: ``send``, ``recv``, ``recv_anysource`` through inboxes.

Memory. Each rank owns one *inbox* per group, created at its first send or receive: a sealed
``memfd`` that peers map through ``/proc/<pid>/fd``, with one ring of ``NCHUNKS`` slots and
``ACKS`` ack records per source (:mod:`fcoll.shm.p2p.inbox`, which holds its layout). Nothing has a
name in /dev/shm, so nothing can leak.

Protocol. A message is one header (sequence number, tag, byte count, dtype, shape) and its
bytes, cut in chunks that go round robin through the ring's ``NCHUNKS`` slots: the sender
writes a chunk when ``head - tail < NCHUNKS``, then stores ``head`` (the store comes after the
data; x86-64 keeps stores in order, as :mod:`fcoll.shm.transport.sync` explains), the receiver
copies it out and stores ``tail``. The receiver matches the header to its posted receives (MPI's
non-overtaking rule: messages of one source and tag are received in the order sent, and a
message goes to the earliest posted receive that accepts it, ``recv_anysource`` included) and
writes an *ack* with its verdict: a send completes once its bytes are in the ring **and** the
receiver accepted it (a rendezvous, as NCCL's sends). A header that does not fit the receive
(other dtype or element count) makes the receiver fail its receive and discard the bytes, and
the ack makes the sender fail with the same ``ValueError``; the ranks stay usable. A message
whose tag no posted receive wants stays in the ring, unless it blocks a receive posted behind it
(another tag, or any source): then it is copied aside until a receive wants it.

Waiting. Whatever a rank waits for (space or an ack for a send, bytes for a receive) its peers
announce by ringing its doorbell: they store a value no writer stored just before (the writer's
rank and a counter), a full barrier, then ``FUTEX_WAKE`` if a sleeper is flagged; a waiter takes
the doorbell's value, makes what progress it can on every pending operation, and sleeps in
``FUTEX_WAIT`` on that value when there was none (Dekker's pattern, as in ``sync.Channel``). So
one thread waits for any number of peers. Progress is made by whoever holds the progress lock:
the thread in ``Work.wait()``, or the inbox's background thread while operations are pending and
nobody waits (an ``isend`` then completes during compute, as gloo's do). Every ``_TICK_S`` a
sleeper checks that the peers it waits for still run and the timeout: a dead peer fails every
pending operation with it within about 0.1-0.2 s, naming it; a timeout fails the operation; both
make that peer unusable for later operations (a message may be half transferred).

The operation records and the protocol's progress steps (rings, matching, acks) live in
:mod:`fcoll.shm.p2p.protocol`, which ``P2P`` takes as a mixin; this module keeps the state,
issuing, waiting and closing.
"""

from __future__ import annotations

import atexit
import collections
import math
import os
import threading
import time
import weakref
from typing import Callable

import torch

from fcoll.compat import run_eagerly_under_dynamo
from fcoll.shm.work import settle_future
from fcoll.shm.p2p.inbox import (MAX_DIMS, PREFIX, W_DOOR, W_SLEEPERS, Inbox, Layout, chunk_bytes,
                             create_inbox, open_inbox, segment_inode, show_message)
from fcoll.shm.p2p.protocol import RingProtocol, InMessage, PendingOp
from fcoll.shm.transport.segment import U32_BITS, W_PID, W_START_HI, W_START_LO, Segment, proc_alive
from fcoll.shm.transport.fences import PeerError
from fcoll.shm.transport.sync import futex_wait, futex_wake

SPIN_S = 20e-6  # poll the doorbell this long before sleeping (as sync.SPIN_US)
_TICK_S = 0.1  # longest sleep between liveness and timeout checks
_OPEN_RETRY_S = 0.002  # sleep while a peer's inbox does not exist yet
_inboxes: "weakref.WeakSet[P2P]" = weakref.WeakSet()


class P2P(RingProtocol):
    """Point-to-point state of one rank in one fcoll group (see module docstring).

    Args:
        seg: the group segment (for the inbox names and the peers' identities).
        rank, world: this rank and the group size.
        timeout_s: the group timeout, in seconds, for a wait on one operation.
        describe: group rank -> its name in messages (``"rank 1 (global rank 3)"``).
        owner: the process group; the inbox is closed when it is garbage collected.
        quit_why: group rank -> why that peer left the group while alive (it destroyed or
            aborted it: its inbox is closed and it sends and receives nothing more), or None;
            checked with liveness every tick (:meth:`_check_peers`).
    """

    def __init__(self, seg: Segment, rank: int, world: int, timeout_s: float, describe,
                 owner=None, quit_why: Callable[[int], str | None] | None = None):
        self.rank, self.world, self.timeout_s, self.describe = rank, world, timeout_s, describe
        self.quit_why = quit_why
        self.lay = Layout(world, chunk_bytes())
        lay, words = seg.layout, seg.words
        self.ident = [(words[lay.word(p, W_PID)],
                       words[lay.word(p, W_START_LO)] | (words[lay.word(p, W_START_HI)] << U32_BITS))
                      for p in range(world)]
        inode = segment_inode(seg)
        self.names = [f"{PREFIX}{inode}-{p}" for p in range(world)]
        self.fd = -1
        self.inboxes: dict[int, Inbox] = {rank: self._create()}
        self.me = self.inboxes[rank]
        self.sends: dict[int, collections.deque[PendingOp]] = {}  # dst -> ops not fully written
        self.unacked: dict[int, dict[int, PendingOp]] = {}  # dst -> seq -> op
        self.next_seq: dict[int, int] = {}  # dst -> sequence number of its next message
        self.head: dict[int, int] = {}  # dst -> chunks this rank published to it
        self.tail: dict[int, int] = {}  # src -> chunks this rank consumed from it
        self.expect: dict[int, int] = {}  # src -> next message number
        self.cur: dict[int, InMessage] = {}  # src -> message being copied
        self.posted: list[PendingOp] = []  # receives not matched yet, in post order
        self.unexpected: list[tuple[int, int, int, tuple, torch.Tensor]] = []
        self.broken: dict[int, BaseException] = {}  # peer -> error that ended its channel
        self.left: set[int] = set()  # peers whose channel ended because they left the group
        self.pending = 0  # operations issued and not done
        self.waiters = 0  # threads in wait()
        self.ring_count = 0  # doorbell values this rank wrote
        self.spin_s = SPIN_S if world <= (os.cpu_count() or 1) else 0.0
        self.progress = threading.RLock()  # re-entered when a step fails its peers
        self.fence = threading.Lock()
        self.sleep_lock = threading.Lock()
        self.cv = threading.Condition()
        self.closed = False
        self.thread: threading.Thread | None = None
        _inboxes.add(self)
        if owner is not None:
            weakref.finalize(owner, self.close)

    # ---- inboxes ---------------------------------------------------------------------------
    def _create(self) -> Inbox:
        self.fd, box = create_inbox(self.names[self.rank], self.lay)
        return box

    def _inbox(self, p: int) -> Inbox | None:
        """Peer ``p``'s inbox, mapped at first use; None while ``p`` has not created it.

        Raises:
            PeerError: ``p`` exited. RuntimeError: the file found fails
                :func:`~fcoll.shm.p2p.inbox.check_fd`.
        """
        box = self.inboxes.get(p)
        if box is None:
            pid, start = self.ident[p]
            try:
                box = open_inbox(pid, start, self.names[p], self.lay)
            except PeerError:
                raise PeerError(f"fcoll p2p: {self.describe(p)} exited (pid {pid} was reused)") \
                    from None
            if box is not None:
                self.inboxes[p] = box
        return box

    def _ring(self, p: int) -> None:
        """Ring ``p``'s doorbell (``p`` may be this rank, to wake its other threads)."""
        box = self._inbox(p)
        if box is None:
            return
        self.ring_count = (self.ring_count + 1) & 0xFFFFF
        words = box.words
        words[W_DOOR] = ((self.rank & 0xFFF) << 20 | self.ring_count) + 1
        self.fence.acquire()  # full barrier: the store above before the load below
        self.fence.release()
        if words[W_SLEEPERS]:
            futex_wake(box.door_addr)

    def _sleep(self, seen: int, timeout_s: float) -> None:
        words = self.me.words
        with self.sleep_lock:
            words[W_SLEEPERS] += 1
        try:
            futex_wait(self.me.door_addr, seen, timeout_s)
        finally:
            with self.sleep_lock:
                words[W_SLEEPERS] -= 1

    # ---- issue -----------------------------------------------------------------------------
    def issue(self, kind: str, tensors: list, peer: int | None, tag: int) -> "P2PWork":
        """Start a ``"send"`` or ``"recv"`` of ``tensors[0]`` with group rank ``peer`` (None:
        any source); returns its Work.

        Raises:
            ValueError: not exactly one tensor, a peer out of range, a sparse tensor.
        """
        what = f"fcoll {kind} ({self.describe(self.rank)}"
        if len(tensors) != 1:
            raise ValueError(f"{what}): expects 1 tensor, got {len(tensors)}")
        if peer is not None and not 0 <= peer < self.world:
            raise ValueError(f"{what}): peer {peer} is out of range for a group of size "
                             f"{self.world}")
        t = tensors[0]
        if t.layout != torch.strided or t.dim() > MAX_DIMS:
            raise ValueError(f"{what}): needs a dense tensor of at most {MAX_DIMS} dims")
        op = PendingOp(kind, peer, int(tag), t)
        if self.closed:
            op.finish(RuntimeError(f"{what}): the process group was destroyed"))
            return P2PWork(self, op)
        if peer is not None:
            bad = peer if peer in self.broken else None
        else:  # from any source: refused after an error with some peer (a message may be
            # half transferred), not because peers left the group, unless every peer did
            bad = next((p for p in self.broken if p not in self.left), None)
            if bad is None and len(self.broken) == self.world - 1:
                bad = next(iter(self.broken))
        if bad is not None:
            op.finish(RuntimeError(f"{what}): the channel with {self.describe(bad)} is unusable "
                                   f"after an earlier error: {self.broken[bad]}"))
            return P2PWork(self, op)
        with self.progress:
            self.pending += 1
            if kind == "send":
                op.nchunks = max(1, math.ceil(op.desc[2] / self.lay.chunk))
                self.sends.setdefault(peer, collections.deque()).append(op)
            else:
                self.posted.append(op)
            self._guarded_step()
        if not op.done:
            self._kick()
        return P2PWork(self, op)

    # ---- waiting ---------------------------------------------------------------------------
    def wait(self, op: PendingOp, timeout_s: float | None) -> None:
        """Drive progress until ``op`` is done; raise its error.

        Raises:
            ValueError: the send and the receive do not match (on both ranks).
            PeerError: the peer died, or ``timeout_s`` (default: the group's) passed.
        """
        limit = timeout_s or self.timeout_s
        start = checked = time.monotonic()
        with self.cv:
            self.waiters += 1
        try:
            while not op.done:
                seen = self.me.words[W_DOOR]
                with self.progress:
                    moved = self._guarded_step()
                if op.done:
                    break
                if moved:
                    continue
                now = time.monotonic()
                if now - checked >= _TICK_S:
                    checked = now
                    self._check_peers()
                if now - start > limit and not op.done:
                    self._timeout(op, limit)
                    break
                if self._spin(seen):
                    continue
                self._sleep(seen, min(_TICK_S, max(limit - (now - start), 1e-3),
                                      _OPEN_RETRY_S if self._missing_inbox() else _TICK_S))
        finally:
            with self.cv:
                self.waiters -= 1
                self.cv.notify()
        if op.error is not None:
            raise op.error

    def _spin(self, seen: int) -> bool:
        if self.spin_s <= 0.0:
            return False
        words, deadline = self.me.words, time.perf_counter() + self.spin_s
        while time.perf_counter() < deadline:
            if words[W_DOOR] != seen:
                return True
        return False

    def _guarded_step(self) -> bool:
        """:meth:`_step`; a protocol failure breaks the peers of every pending operation. Below
        autograd, as a C++ backend writes: a receive leaves its tensor's version counter alone."""
        try:
            before = self.pending
            with torch._C._AutoDispatchBelowADInplaceOrView():
                moved = self._step()
            if self.pending != before:
                self._ring(self.rank)  # another thread may wait on what just completed
            return moved
        except PeerError as e:
            self._fail_peers(set(range(self.world)), e)
            return True

    def _missing_inbox(self) -> bool:
        return any(d not in self.inboxes for d, q in self.sends.items() if q)

    def _ops_with(self, peers: set[int], any_source: bool = True) -> list[PendingOp]:
        ops = [o for d, q in self.sends.items() if d in peers for o in q]
        ops += [o for d, u in self.unacked.items() if d in peers for o in u.values()]
        ops += [o for o in self.posted if (o.peer is None and any_source) or o.peer in peers]
        ops += [m.op for s, m in self.cur.items() if s in peers and m.op is not None]
        return ops

    def _fail_peers(self, peers: set[int], error: BaseException,
                    any_source: bool = True) -> None:
        """Fail every pending operation with ``peers`` (receives from any source too, unless
        ``any_source`` is False); their channels stay broken."""
        with self.progress:
            for p in peers:
                self.broken.setdefault(p, error)
            for op in self._ops_with(peers, any_source):
                self._done(op, error)
            for p in peers:
                self.sends.pop(p, None)
                self.unacked.pop(p, None)
                self.cur.pop(p, None)
            self.posted = [o for o in self.posted if not o.done]
        if self.me is not None:
            self._ring(self.rank)

    def _check_peers(self) -> None:
        """Fail the operations with every peer process that no longer runs, and with every
        peer that left the group alive (``quit_why``: it destroyed or aborted it). A receive
        from any source fails on a death, but on a peer leaving only once every peer has
        left (another may still send). A message a leaving peer completed is already in this
        rank's inbox (a send completes only once accepted), so one more progress step takes
        what arrived before the operations with it fail."""
        peers = {p for p in range(self.world) if p != self.rank}
        dead = {p for p in peers if not proc_alive(*self.ident[p])}
        if dead:
            names = ", ".join(self.describe(p) for p in sorted(dead))
            self._fail_peers(dead, PeerError(
                f"fcoll p2p: {names} died (pid {', '.join(str(self.ident[p][0]) for p in sorted(dead))}) "
                f"while {self.describe(self.rank)} had a send or receive pending with it"))
        if self.quit_why is None or not self.pending:
            return
        left = {p: why for p in sorted(peers - dead) if p not in self.broken
                for why in [self.quit_why(p)] if why is not None}
        if not left:
            return
        with self.progress:
            self._guarded_step()
        self.left.update(p for p in left if p not in self.broken)
        every_peer_gone = set(self.broken) | set(left) | dead >= peers
        for p, why in left.items():
            self._fail_peers({p}, PeerError(
                f"fcoll p2p: {self.describe(p)} {why} while {self.describe(self.rank)} had a "
                f"send or receive pending with it; it sends and receives nothing more"),
                any_source=every_peer_gone)

    def _timeout(self, op: PendingOp, limit: float) -> None:
        peer = "any rank" if op.peer is None else self.describe(op.peer)
        verb = (f"send to {peer}" if op.kind == "send" else f"recv from {peer}")
        err = PeerError(f"fcoll p2p: {verb} (tag {op.tag}, {show_message(op.desc)}) timed out "
                        f"after "
                        f"{limit:.1f} s on {self.describe(self.rank)}; the channel with "
                        f"{peer} is no longer usable")
        self._fail_peers(set(range(self.world)) if op.peer is None else {op.peer}, err)

    # ---- background progress ---------------------------------------------------------------
    def _kick(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, daemon=True,
                                           name=f"fcoll-p2p-r{self.rank}")
            self.thread.start()
        with self.cv:
            self.cv.notify()

    def _loop(self) -> None:
        """Make progress while operations are pending and no thread waits on one."""
        checked = time.monotonic()
        while True:
            with self.cv:
                while not self.closed and (self.pending == 0 or self.waiters):
                    self.cv.wait()
                if self.closed:
                    return
            seen = self.me.words[W_DOOR]
            with self.progress:
                moved = self._guarded_step()
            if moved:
                continue
            if time.monotonic() - checked >= _TICK_S:
                checked = time.monotonic()
                self._check_peers()
            self._sleep(seen, _OPEN_RETRY_S if self._missing_inbox() else _TICK_S)

    def close(self) -> None:
        """Fail what is pending, stop the background thread, close and unmap the inboxes."""
        if self.closed:
            return
        self.closed = True
        if self.pending:
            self._fail_peers(set(range(self.world)),
                             RuntimeError("fcoll p2p: the process group was destroyed"))
        with self.cv:
            self.cv.notify_all()
        self._ring(self.rank)
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(1.0)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        for box in self.inboxes.values():
            box.close()
        self.inboxes = {}


@atexit.register
def _close_all() -> None:
    for p in list(_inboxes):
        p.close()


@run_eagerly_under_dynamo
class P2PWork(torch.distributed.Work):
    """The ``Work`` of one send or receive; ``wait()`` drives the progress (see :class:`P2P`)
    and re-raises its error. ``_source_rank()`` is the group rank a receive came from."""

    def __init__(self, p2p: P2P, op: PendingOp):
        super().__init__()
        self._p2p, self._op = p2p, op

    def wait(self, timeout=None) -> bool:
        secs = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        if not self._op.done:
            self._p2p.wait(self._op, secs or None)
        if self._op.error is not None:
            raise self._op.error
        return True

    def is_completed(self) -> bool:
        return self._op.done

    def is_success(self) -> bool:
        return self._op.done and self._op.error is None

    def exception(self):
        return self._op.error

    def result(self):
        self.wait()
        return [self._op.tensor]

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        op = self._op
        with op.lock:
            if op.fut is None:
                op.fut = torch.futures.Future()
                if op.done:
                    settle_future(op.fut, op.error, [op.tensor])
        return op.fut

    def _source_rank(self) -> int:
        self.wait()
        return self._op.source

    source_rank = _source_rank
