"""A rank's point-to-point *inbox* on fcoll's backend: its memory, its name, and its records.

The protocol that moves messages through inboxes is :mod:`fcoll.shm.p2p.sendrecv`; this module is
the memory it runs on. Each rank owns one inbox per group: a sealed ``memfd`` (mode 0600, sealed
against shrinking and growing, as the group segment of :mod:`fcoll.shm.transport.segment`) named
``fcoll-p2p-<group segment inode>-<group rank>`` (:func:`segment_inode`), which the rank keeps
open while the group lives. A peer finds it without any store, among ``/proc/<owner pid>/fd``
(:func:`open_inbox`), and maps it only after :func:`check_fd`. Layout (4096-aligned)::

    control  [4096]             word 0: doorbell; word 1: the owner's threads asleep on it
    ring[s]  for every source s (messages s -> owner):
        control [4096]          head (chunks published, written by s), tail (chunks consumed,
                                written by the owner)
        acks    [ACKS][512]     the owner's verdict on message m at m % ACKS
        metas   [NCHUNKS][512]  per slot: the message header (first chunk) or its number
        data    [NCHUNKS][chunk_bytes]

A record (:func:`encode_record`, :func:`decode_record`) is a message header or an ack: sequence
number, chunk count or ack status, tag, byte count, dtype name and shape.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

import torch

from fcoll.shm.transport import segment
from fcoll.shm.transport.segment import Segment, proc_start_time
from fcoll.shm.transport.fences import PeerError

PREFIX = "fcoll-p2p-"
PAGE = 4096
NCHUNKS = 4  # slots per ring
CHUNK_BYTES = 256 << 10  # default bytes per slot; FCOLL_P2P_CHUNK_BYTES overrides it
ACKS = 32  # ack records per ring: a sender has at most this many messages unacknowledged
RECORD_BYTES = 512  # one ack record or one slot's meta
W_DOOR, W_SLEEPERS = 0, 1  # words of the inbox control page
R_HEAD, R_TAIL = 0, 16  # words of a ring's control page (own cache lines)
ACK_OK, ACK_MISMATCH = 1, 2
# header: seq, nchunks (or ack status), tag, nbytes, dtype name, ndim; then ndim int64 dims
_HDR = struct.Struct("<IIqQ32sI")
MAX_DIMS = (RECORD_BYTES - _HDR.size) // 8


def chunk_bytes() -> int:
    """Bytes of one ring slot: 256 KiB, or ``FCOLL_P2P_CHUNK_BYTES`` rounded down to pages (all
    ranks must agree: the inbox size is checked at open)."""
    env = os.environ.get("FCOLL_P2P_CHUNK_BYTES")
    return max(PAGE, int(env) // PAGE * PAGE) if env else CHUNK_BYTES


def _round_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class Layout:
    """Byte offsets inside an inbox of a ``world``-rank group with ``chunk`` bytes per slot."""

    def __init__(self, world: int, chunk: int):
        self.chunk = chunk
        self.acks = PAGE
        self.metas = PAGE + ACKS * RECORD_BYTES
        self.data = _round_up(self.metas + NCHUNKS * RECORD_BYTES)
        self.ring = self.data + NCHUNKS * chunk
        self.total = PAGE + world * self.ring

    def ring_off(self, src: int) -> int:
        return PAGE + src * self.ring


def segment_inode(seg: Segment) -> int:
    """Inode of the (unlinked) file behind the group segment ``seg``, from /proc/self/maps: the
    same on every rank, and unique while any rank maps it."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if int(fields[0].split("-")[0], 16) == seg.base:
                return int(fields[4])
    raise RuntimeError("fcoll p2p: the group segment is not in /proc/self/maps")


def find_fd(pid: int, target: str) -> str | None:
    """``/proc/<pid>/fd/<n>`` whose link reads ``target``, or None (not created yet)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for n in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{n}") == target:
                return f"/proc/{pid}/fd/{n}"
        except OSError:
            continue
    return None


def check_fd(fd: int, path: str, size: int) -> None:
    """:func:`fcoll.shm.transport.segment.check_fd` for an inbox of ``size`` bytes.

    Raises:
        RuntimeError: naming ``path`` and the check that failed.
    """
    segment.check_fd(fd, path, size, None, "p2p inbox",
                     "of this rank's inbox layout (FCOLL_P2P_CHUNK_BYTES differs between ranks?)")


class Inbox:
    """A mapped inbox: u32 ``words``, bytes ``buf`` and uint8 ``data`` over the whole file."""

    def __init__(self, fd: int, lay: Layout):
        self.mm = mmap.mmap(fd, lay.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = memoryview(self.mm)
        self.words = self.buf.cast("I")
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.door_addr = ctypes.addressof(self._anchor) + W_DOOR * 4

    def close(self) -> None:
        """Drop this inbox's views and its reference to the mapping; never unmap under a view.

        As :meth:`fcoll.shm.transport.segment.Segment.close`: ``torch.frombuffer`` views hold
        the ``mmap`` object without a buffer export, so ``mmap.close()`` would succeed under a
        live view (a received tensor's view of a slot) and leave it pointing at unmapped memory.
        The mapping goes with the ``mmap`` object's last reference instead.
        """
        self.data = None
        self._anchor = None
        for mv in (self.words, self.buf):
            try:
                mv.release()
            except (BufferError, ValueError, AttributeError):
                pass  # a slice of it is exported elsewhere: it keeps the mapping alive
        self.mm = None  # the last reference unmaps (mmap's finalizer), never before


def encode_record(seq: int, aux: int, tag: int, desc: tuple) -> bytes:
    dtype, shape, nbytes = desc
    return _HDR.pack(seq, aux, tag, nbytes, dtype.encode(), len(shape)) + struct.pack(
        f"<{len(shape)}q", *shape)


def decode_record(buf: memoryview, off: int) -> tuple[int, int, int, tuple]:
    """The record at ``buf[off:]``: ``(seq, aux, tag, (dtype name, shape, nbytes))``. Bounded
    whatever a peer wrote: at most ``MAX_DIMS`` dims are read, and a dtype name that is not
    UTF-8 decodes with replacement characters (it then matches no receive)."""
    seq, aux, tag, nbytes, dtype, ndim = _HDR.unpack_from(buf, off)
    shape = struct.unpack_from(f"<{min(ndim, MAX_DIMS)}q", buf, off + _HDR.size)
    return seq, aux, tag, (dtype.rstrip(b"\0").decode("utf-8", "replace"), tuple(shape), nbytes)


def ack_marker(seq: int) -> int:
    """The value an ack record's first word holds once message ``seq`` is acked (never 0)."""
    return (seq & 0x7FFFFFFF) + 1


def show_message(desc: tuple) -> str:
    dtype, shape, nbytes = desc
    return f"{dtype}{list(shape)} ({nbytes} bytes)"


def create_inbox(name: str, lay: Layout) -> tuple[int, Inbox]:
    """This rank's inbox: a sealed memfd ``name`` of ``lay.total`` bytes, mode 0600, mapped.

    Returns ``(fd, inbox)``; the caller keeps ``fd`` open while the group lives (peers open the
    file through ``/proc/<pid>/fd``).
    """
    fd = segment.create_sealed_memfd(name, lay.total, "p2p inbox")
    try:
        return fd, Inbox(fd, lay)
    except BaseException:
        os.close(fd)
        raise


def open_inbox(pid: int, start_time: int, name: str, lay: Layout) -> Inbox | None:
    """Map the inbox ``name`` of the process ``pid`` (started at ``start_time``); None while
    that process has not created it (or has just closed it: its liveness check reports that).

    Raises:
        PeerError: ``pid`` now belongs to another process (the peer exited).
        RuntimeError: the file found fails :func:`check_fd`.
    """
    path = find_fd(pid, f"/memfd:{name} (deleted)")
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDWR | segment.PEER_OPEN_FLAGS)  # a magic link: no O_NOFOLLOW
    except OSError:
        return None
    try:
        if proc_start_time(pid) != start_time:
            raise PeerError(f"fcoll p2p: pid {pid} was reused")
        check_fd(fd, path, lay.total)
        return Inbox(fd, lay)
    finally:
        os.close(fd)
