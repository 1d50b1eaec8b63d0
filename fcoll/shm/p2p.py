"""Point-to-point on fcoll's backend: ``send``, ``recv``, ``recv_anysource`` through inboxes.

Memory. Each rank owns one *inbox* per group, created at its first send or receive: a sealed
``memfd`` that peers map through ``/proc/<pid>/fd``, with one ring of ``NCHUNKS`` slots and
``ACKS`` ack records per source (:mod:`fcoll.shm.inbox`, which holds its layout). Nothing has a
name in /dev/shm, so nothing can leak.

Protocol. A message is one header (sequence number, tag, byte count, dtype, shape) and its
bytes, cut in chunks that go round robin through the ring's ``NCHUNKS`` slots: the sender
writes a chunk when ``head - tail < NCHUNKS``, then stores ``head`` (the store comes after the
data; x86-64 keeps stores in order, as :mod:`fcoll.shm.sync` explains), the receiver copies it
out and stores ``tail``. The receiver matches the header to its posted receives (MPI's
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
"""

from __future__ import annotations

import atexit
import collections
import math
import os
import struct
import threading
import time
import weakref

import torch

from fcoll.compat import run_eagerly_under_dynamo
from fcoll.shm.engine import settle_future
from fcoll.shm.inbox import (ACK_MISMATCH, ACK_OK, ACKS, MAX_DIMS, NCHUNKS, PREFIX, R_HEAD,
                             R_TAIL, RECORD_BYTES, W_DOOR, W_SLEEPERS, Inbox, Layout, ack_marker,
                             chunk_bytes, create_inbox, decode_record, encode_record, open_inbox,
                             segment_inode, show_message)
from fcoll.shm.segment import U32_BITS, U32_MASK, W_PID, W_START_HI, W_START_LO, Segment, proc_alive
from fcoll.shm.sync import PeerError, futex_wait, futex_wake

SPIN_S = 20e-6  # poll the doorbell this long before sleeping (as sync.SPIN_US)
_TICK_S = 0.1  # longest sleep between liveness and timeout checks
_OPEN_RETRY_S = 0.002  # sleep while a peer's inbox does not exist yet
_inboxes: "weakref.WeakSet[P2P]" = weakref.WeakSet()


class _Op:
    """One send or receive. ``bytes_`` is the flat uint8 view the ring reads or fills; a receive
    into a non-contiguous or CUDA tensor fills a contiguous CPU buffer copied out at the end."""

    def __init__(self, kind: str, peer: int | None, tag: int, tensor: torch.Tensor):
        self.kind, self.peer, self.tag, self.tensor = kind, peer, tag, tensor
        dense = tensor.detach()
        self.copy_back = kind == "recv" and (dense.is_cuda or not dense.is_contiguous())
        if kind == "send":
            dense = dense.cpu().contiguous()
        elif self.copy_back:
            dense = torch.empty(dense.shape, dtype=dense.dtype)
        self.dense = dense
        self.bytes_ = dense.reshape(-1).view(torch.uint8)
        self.desc = (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                     self.bytes_.numel())
        self.seq: int | None = None
        self.nchunks = 0
        self.written = 0  # send: chunks written
        self.acked = False
        self.source = -1  # recv: the group rank it received from
        self.done = False
        self.error: BaseException | None = None
        self.fut: torch.futures.Future | None = None
        self.lock = threading.Lock()

    def finish(self, error: BaseException | None = None) -> None:
        if error is None and self.copy_back:
            self.tensor.detach().copy_(self.dense)
        with self.lock:
            self.error, self.done = error, True
            fut = self.fut
        if fut is not None:
            settle_future(fut, error, [self.tensor])


class _InMsg:
    """The message a receive ring is copying: into ``dest`` (a receive's bytes or a buffer of
    an unexpected message), or nowhere (discarded after a mismatch)."""

    def __init__(self, seq: int, nchunks: int, tag: int, desc: tuple, op: _Op | None,
                 dest: torch.Tensor | None):
        self.seq, self.nchunks, self.tag, self.desc = seq, nchunks, tag, desc
        self.op, self.dest, self.got, self.left = op, dest, 0, nchunks


class P2P:
    """Point-to-point state of one rank in one fcoll group (see module docstring).

    Args:
        seg: the group segment (for the inbox names and the peers' identities).
        rank, world: this rank and the group size.
        timeout_s: the group timeout, in seconds, for a wait on one operation.
        describe: group rank -> its name in messages (``"rank 1 (global rank 3)"``).
        owner: the process group; the inbox is closed when it is garbage collected.
    """

    def __init__(self, seg: Segment, rank: int, world: int, timeout_s: float, describe,
                 owner=None):
        self.rank, self.world, self.timeout_s, self.describe = rank, world, timeout_s, describe
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
        self.sends: dict[int, collections.deque[_Op]] = {}  # dst -> ops not fully written
        self.unacked: dict[int, dict[int, _Op]] = {}  # dst -> seq -> op
        self.next_seq: dict[int, int] = {}  # dst -> sequence number of its next message
        self.head: dict[int, int] = {}  # dst -> chunks this rank published to it
        self.tail: dict[int, int] = {}  # src -> chunks this rank consumed from it
        self.expect: dict[int, int] = {}  # src -> next message number
        self.cur: dict[int, _InMsg] = {}  # src -> message being copied
        self.posted: list[_Op] = []  # receives not matched yet, in post order
        self.unexpected: list[tuple[int, int, int, tuple, torch.Tensor]] = []
        self.broken: dict[int, BaseException] = {}  # peer -> error that ended its channel
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
                :func:`~fcoll.shm.inbox.check_fd`.
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
        op = _Op(kind, peer, int(tag), t)
        if self.closed:
            op.finish(RuntimeError(f"{what}): the process group was destroyed"))
            return P2PWork(self, op)
        bad = next((p for p in ([peer] if peer is not None else list(self.broken))
                    if p in self.broken), None)
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

    # ---- progress --------------------------------------------------------------------------
    def _step(self) -> bool:
        """Move every pending operation as far as it goes without waiting (progress lock held);
        True if anything moved."""
        moved = False
        for dst in [d for d, q in self.sends.items() if q or self.unacked.get(d)]:
            moved |= self._push(dst)
        if self.unexpected and self.posted:
            moved |= self._match_unexpected()
        srcs = (range(self.world) if any(o.peer is None for o in self.posted)
                else {o.peer for o in self.posted} | set(self.cur))
        for src in srcs:
            if src not in self.broken:
                moved |= self._pull(src)
        return moved

    def _push(self, dst: int) -> bool:
        box = self._inbox(dst)
        if box is None:
            return False
        lay = self.lay
        base = lay.ring_off(self.rank)
        words, buf = box.words, box.buf
        q = self.sends.get(dst) or ()
        unacked = self.unacked.setdefault(dst, {})
        head = self.head.get(dst, 0)
        moved = False
        while q:
            op = q[0]
            if op.seq is None:
                seq = self.next_seq.get(dst, 0)
                if (seq - ACKS) & U32_MASK in unacked:
                    break  # its ack record is still in use
                op.seq = seq
                self.next_seq[dst] = (seq + 1) & U32_MASK
                unacked[seq] = op
            while op.written < op.nchunks and (head - words[base // 4 + R_TAIL]) & U32_MASK < NCHUNKS:
                slot = head % NCHUNKS
                meta = base + lay.metas + slot * RECORD_BYTES
                if op.written == 0:
                    rec = encode_record(op.seq, op.nchunks, op.tag, op.desc)
                    buf[meta:meta + len(rec)] = rec
                else:
                    struct.pack_into("<I", buf, meta, op.seq)
                lo = op.written * lay.chunk
                n = min(lay.chunk, op.desc[2] - lo)
                if n > 0:
                    off = base + lay.data + slot * lay.chunk
                    box.data[off:off + n].copy_(op.bytes_[lo:lo + n])
                op.written += 1
                head = (head + 1) & U32_MASK
                words[base // 4 + R_HEAD] = head  # after the data (x86-64 store order)
                moved = True
            if op.written < op.nchunks:
                break
            q.popleft()
            if op.acked:
                self._done(op)
        self.head[dst] = head
        if moved:
            self._ring(dst)
        for seq, op in list(unacked.items()):
            rec = base + lay.acks + (seq % ACKS) * RECORD_BYTES
            if words[rec // 4] != ack_marker(seq) or op.written == 0:
                continue
            del unacked[seq]
            moved = op.acked = True
            if words[rec // 4 + 1] == ACK_MISMATCH:
                theirs = decode_record(buf, rec)[3]
                op.error = ValueError(self._mismatch(self.rank, dst, op.tag, op.desc, theirs))
            if op.written == op.nchunks:
                self._done(op)
        return moved

    def _pull(self, src: int) -> bool:
        """Copy the chunks that ``src`` published to this rank, matching new messages."""
        lay = self.lay
        base = lay.ring_off(src)
        words, buf = self.me.words, self.me.buf
        tail = self.tail.get(src, 0)
        moved = False
        while (words[base // 4 + R_HEAD] - tail) & U32_MASK:
            slot = tail % NCHUNKS
            meta = base + lay.metas + slot * RECORD_BYTES
            msg = self.cur.get(src)
            if msg is None:
                msg = self._match(src, *decode_record(buf, meta))
                if msg is None:
                    break  # nobody wants it yet: it stays in the ring
            elif struct.unpack_from("<I", buf, meta)[0] != msg.seq:
                raise PeerError(f"fcoll p2p: corrupt ring from {self.describe(src)}")
            n = min(lay.chunk, msg.desc[2] - msg.got)
            if n > 0 and msg.dest is not None:
                off = base + lay.data + slot * lay.chunk
                msg.dest[msg.got:msg.got + n].copy_(self.me.data[off:off + n])
            msg.got += max(n, 0)
            msg.left -= 1
            tail = (tail + 1) & U32_MASK
            words[base // 4 + R_TAIL] = tail
            moved = True
            if msg.left == 0:
                del self.cur[src]
                if msg.op is not None:
                    self._done(msg.op)
                else:
                    self.unexpected.append((src, msg.seq, msg.tag, msg.desc, msg.dest))
        self.tail[src] = tail
        if moved:
            self._ring(src)
        return moved

    def _match(self, src: int, seq: int, nchunks: int, tag: int, desc: tuple) -> _InMsg | None:
        """The copy target of a new message from ``src``: the earliest posted receive that
        accepts it (acked), a buffer (it blocks a receive posted behind it), or None (wait)."""
        want = self.expect.get(src, 0)
        if seq != want:
            raise PeerError(f"fcoll p2p: message {seq} from {self.describe(src)}, expected {want}")
        op = next((o for o in self.posted if o.peer in (src, None) and o.tag == tag), None)
        if op is None and not any(o.peer in (src, None) for o in self.posted):
            return None
        self.expect[src] = (want + 1) & U32_MASK
        if op is None:
            msg = _InMsg(seq, nchunks, tag, desc, None, torch.empty(desc[2], dtype=torch.uint8))
        else:
            self.posted.remove(op)
            ok = self._accept(src, seq, tag, desc, op)
            msg = _InMsg(seq, nchunks, tag, desc, op, op.bytes_ if ok else None)
        self.cur[src] = msg
        return msg

    def _accept(self, src: int, seq: int, tag: int, desc: tuple, op: _Op) -> bool:
        """Check message ``seq`` (``desc``) against receive ``op``, ack the verdict to ``src``;
        a mismatch fails ``op`` (the sender fails with the same message)."""
        ok = desc[:1] == op.desc[:1] and desc[2] == op.desc[2]
        op.source = src
        rec = self.lay.ring_off(src) + self.lay.acks + (seq % ACKS) * RECORD_BYTES
        buf = self.me.buf
        payload = encode_record(0, ACK_OK if ok else ACK_MISMATCH, tag, op.desc)
        buf[rec + 4:rec + len(payload)] = payload[4:]
        self.me.words[rec // 4] = ack_marker(seq)  # the marker last
        if not ok:
            self._done(op, ValueError(self._mismatch(src, self.rank, tag, desc, op.desc)))
        return ok

    def _match_unexpected(self) -> bool:
        moved = False
        for op in list(self.posted):
            hit = next((m for m in self.unexpected
                        if op.peer in (m[0], None) and m[2] == op.tag), None)
            if hit is None:
                continue
            self.unexpected.remove(hit)
            self.posted.remove(op)
            src, seq, tag, desc, data = hit
            if self._accept(src, seq, tag, desc, op):
                op.bytes_.copy_(data)
                self._done(op)
            self._ring(src)
            moved = True
        return moved

    def _mismatch(self, src: int, dst: int, tag: int, sent: tuple, recv: tuple) -> str:
        return (f"fcoll p2p: {self.describe(src)} sent {show_message(sent)} with tag {tag} to "
                f"{self.describe(dst)}, whose receive is {show_message(recv)}: the dtype and "
                "element count must match")

    def _done(self, op: _Op, error: BaseException | None = None) -> None:
        if op.done:
            return
        op.finish(error if error is not None else op.error)
        self.pending -= 1

    # ---- waiting ---------------------------------------------------------------------------
    def wait(self, op: _Op, timeout_s: float | None) -> None:
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
        """:meth:`_step`; a protocol failure breaks the peers of every pending operation."""
        try:
            before = self.pending
            moved = self._step()
            if self.pending != before:
                self._ring(self.rank)  # another thread may wait on what just completed
            return moved
        except PeerError as e:
            self._fail_peers(set(range(self.world)), e)
            return True

    def _missing_inbox(self) -> bool:
        return any(d not in self.inboxes for d, q in self.sends.items() if q)

    def _ops_with(self, peers: set[int]) -> list[_Op]:
        ops = [o for d, q in self.sends.items() if d in peers for o in q]
        ops += [o for d, u in self.unacked.items() if d in peers for o in u.values()]
        ops += [o for o in self.posted if o.peer is None or o.peer in peers]
        ops += [m.op for s, m in self.cur.items() if s in peers and m.op is not None]
        return ops

    def _fail_peers(self, peers: set[int], error: BaseException) -> None:
        """Fail every pending operation with ``peers``; their channels stay broken."""
        with self.progress:
            for p in peers:
                self.broken.setdefault(p, error)
            for op in self._ops_with(peers):
                self._done(op, error)
            for p in peers:
                self.sends.pop(p, None)
                self.unacked.pop(p, None)
                self.cur.pop(p, None)
            self.posted = [o for o in self.posted if not o.done]
        if self.me is not None:
            self._ring(self.rank)

    def _check_peers(self) -> None:
        """Fail the operations with every peer process that no longer runs."""
        peers = {p for p in range(self.world) if p != self.rank}
        dead = {p for p in peers if not proc_alive(*self.ident[p])}
        if dead:
            names = ", ".join(self.describe(p) for p in sorted(dead))
            self._fail_peers(dead, PeerError(
                f"fcoll p2p: {names} died (pid {', '.join(str(self.ident[p][0]) for p in sorted(dead))}) "
                f"while {self.describe(self.rank)} had a send or receive pending with it"))

    def _timeout(self, op: _Op, limit: float) -> None:
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

    def __init__(self, p2p: P2P, op: _Op):
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
