"""The transfer half of :mod:`fcoll.shm.p2p.sendrecv`: operation records, the rings and the
matching.

It holds ``PendingOp`` (one send or receive), ``InMessage`` (the message a receive ring is copying)
and ``RingProtocol``, the mixin of :class:`~fcoll.shm.p2p.sendrecv.P2P`'s progress steps: ``_step``
moves every pending operation as far as it goes without waiting, ``_push`` writes a send's chunks
into the peer's ring and reads its acks, ``_pull`` copies what a peer published, ``_match`` /
``_match_unexpected`` apply MPI's non-overtaking rule, and ``_accept`` writes the ack with the
verdict (the protocol of :mod:`fcoll.shm.p2p.sendrecv`'s module docstring, over the layout of
:mod:`fcoll.shm.p2p.inbox`).

It is separate from ``sendrecv.py`` so that each file holds one idea: here, what moves through the
rings and in what order, none of which ever waits; there, the per-rank state, issuing, waiting
(doorbell, futex sleeps, liveness and timeout checks, the background thread) and closing. The
host class provides ``rank``, ``world``, ``lay``, ``me``, ``describe``, the per-peer
bookkeeping (``sends``, ``unacked``, ``next_seq``, ``head``, ``tail``, ``expect``, ``cur``,
``posted``, ``unexpected``, ``broken``, ``pending``), ``_inbox`` and ``_ring``.
"""

from __future__ import annotations

import struct
import threading

import torch

from fcoll.shm.work import settle_future_later
from fcoll.shm.p2p.inbox import (ACK_MISMATCH, ACK_OK, ACKS, NCHUNKS, R_HEAD, R_TAIL, RECORD_BYTES,
                             ack_marker, decode_record, encode_record, show_message)
from fcoll.shm.transport.segment import U32_MASK
from fcoll.shm.transport.fences import PeerError


class PendingOp:
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
        if fut is not None:  # finished inside a protocol step: callbacks run elsewhere
            settle_future_later(fut, error, [self.tensor])


class InMessage:
    """The message a receive ring is copying: into ``dest`` (a receive's bytes or a buffer of
    an unexpected message), or nowhere (discarded after a mismatch)."""

    def __init__(self, seq: int, nchunks: int, tag: int, desc: tuple, op: PendingOp | None,
                 dest: torch.Tensor | None):
        self.seq, self.nchunks, self.tag, self.desc = seq, nchunks, tag, desc
        self.op, self.dest, self.got, self.left = op, dest, 0, nchunks


class RingProtocol:
    """Mixin: :class:`~fcoll.shm.p2p.sendrecv.P2P`'s progress steps over the rings (see module
    docstring); called with the progress lock held, they never wait."""

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

    def _match(self, src: int, seq: int, nchunks: int, tag: int, desc: tuple) -> InMessage | None:
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
            msg = InMessage(seq, nchunks, tag, desc, None, torch.empty(desc[2], dtype=torch.uint8))
        else:
            self.posted.remove(op)
            ok = self._accept(src, seq, tag, desc, op)
            msg = InMessage(seq, nchunks, tag, desc, op, op.bytes_ if ok else None)
        self.cur[src] = msg
        return msg

    def _accept(self, src: int, seq: int, tag: int, desc: tuple, op: PendingOp) -> bool:
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

    def _done(self, op: PendingOp, error: BaseException | None = None) -> None:
        if op.done:
            return
        op.finish(error if error is not None else op.error)
        self.pending -= 1
