"""One shared-memory segment per process group: creation, attachment, layout, cleanup.

Lifecycle (every rank of the group runs :func:`open_segment`):

1. Group rank 0 creates ``/dev/shm/fcoll-<32 random hex>`` with ``O_CREAT | O_EXCL``, mode 0600
   (an unpredictable name and exclusive creation refuse any file planted by someone else), sizes
   it, and publishes the name through the group's store.
2. Every rank maps it, publishes its pid and process start time in its control record, and
   counts itself in the store (``store.add``). The rank whose count completes the group unlinks
   the name, so from then on no rank, killed or not, can leak it: the memory lives exactly as long
   as some process maps it.
3. Every rank waits until the name is unlinked, which makes initialisation a barrier: all
   control records are filled before the first collective.

On any error before step 3 completes, the rank that knows the name unlinks it (ENOENT ignored),
and the creator also unlinks at interpreter exit if it is still linked. We never use
``multiprocessing.shared_memory``: its resource tracker unlinks segments in use (CPython gh-82300).

Layout (offsets in bytes, every region 4096-aligned)::

    control  [world][64]            per rank: arrive counter (u32), pid (u32), start time (u64),
                                    one sleep flag (u32) per waiting peer
    headers  [NSLOTS][world][HEADER] collective headers, one per slot
    data     [NSLOTS][world][slot_bytes] per-rank data slots, used round robin (NSLOTS = 3)
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import mmap
import os
import secrets
from dataclasses import dataclass

import torch

SHM_DIR = "/dev/shm"
PREFIX = "fcoll-"
NAME_RANDOM_BYTES = 16  # 32 hex digits in every segment name
CONTROL_BYTES = 64  # one cache line per rank, so counters of different ranks never share a line
HEADER_BYTES = 2048
NSLOTS = 3  # data slots per rank, used round robin (see phases.py for why 3)
PAGE = 4096
SLOT_BYTES = 1 << 20  # default bytes of one data slot, see default_slot_bytes

# Word indices (u32) inside a rank's control record.
W_ARRIVE = 0
W_PID = 1
W_START_LO = 2
W_START_HI = 3
W_SLEEP = 4  # W_SLEEP + q: rank q is (about to be) blocked in FUTEX_WAIT on this counter
WORD_BYTES = 4  # control words are u32
MAX_SLEEP_FLAGS = CONTROL_BYTES // WORD_BYTES - W_SLEEP
U32_BITS = 32
U32_MASK = (1 << U32_BITS) - 1

MAX_PREFIX_VIEWS = 512  # cached prefix views per segment before the cache starts over

_linked: set[str] = set()  # names this process created and has not unlinked yet


def _round_up(n: int, m: int = PAGE) -> int:
    return (n + m - 1) // m * m


def default_slot_bytes() -> int:
    """Bytes of one data slot (per rank, ``NSLOTS`` slots each): 1 MiB.

    Measured at 2 ranks on the 2-core machine (128 MiB all_reduce, same CPU time of about 43 ms
    per rank): 49 ms with 1 MiB slots against 86 ms with 2 or 8 MiB slots, because a peer's next
    chunk arrives within the bounded spin, so no rank sleeps, and the slots stay in cache;
    256-512 KiB slots add too many synchronisations. ``FCOLL_SHM_SLOT_BYTES`` overrides it,
    rounded down to whole pages, at least one (tests use small slots to exercise chunking).
    """
    if os.environ.get("FCOLL_SHM_SLOT_BYTES"):
        return max(PAGE, int(os.environ["FCOLL_SHM_SLOT_BYTES"]) // PAGE * PAGE)
    return SLOT_BYTES


def unlink_quietly(path: str) -> None:
    """Remove ``path`` from /dev/shm; a name already gone is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    _linked.discard(path)


@atexit.register
def _unlink_leftovers() -> None:
    for path in list(_linked):
        unlink_quietly(path)


def _proc_stat(pid: int) -> list[bytes] | None:
    """Fields of /proc/pid/stat after the command name (field 3, the state, first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()


def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/pid/stat), or None."""
    fields = _proc_stat(pid)
    return None if fields is None else int(fields[19])


def proc_alive(pid: int, start_time: int) -> bool:
    """Whether ``pid`` is the same, still running process; zombies and dead processes are not."""
    fields = _proc_stat(pid)
    if fields is None or fields[0] in (b"Z", b"X", b"x"):
        return False
    return int(fields[19]) == start_time


@dataclass
class Layout:
    """Byte offsets of the regions of a segment for ``world`` ranks and ``slot_bytes`` per slot."""

    world: int
    slot_bytes: int

    @property
    def control_off(self) -> int:
        return 0

    @property
    def header_off(self) -> int:
        return _round_up(self.world * CONTROL_BYTES)

    @property
    def data_off(self) -> int:
        return self.header_off + _round_up(NSLOTS * self.world * HEADER_BYTES)

    @property
    def total(self) -> int:
        return self.data_off + NSLOTS * self.world * self.slot_bytes

    def header(self, slot: int, rank: int) -> int:
        return self.header_off + (slot * self.world + rank) * HEADER_BYTES

    def word(self, rank: int, index: int) -> int:
        """Index of a u32 control word in the segment viewed as u32."""
        return (rank * CONTROL_BYTES) // WORD_BYTES + index


class Segment:
    """A mapped segment: a u32 memoryview of the control words, torch views of headers and data.

    Attributes:
        words: ``memoryview`` (format ``I``) over the whole mapping; control words are read and
            written through it (aligned 4-byte loads and stores).
        buf: ``memoryview`` (bytes) over the whole mapping, for headers.
        data: uint8 tensor ``[NSLOTS, world, slot_bytes]`` over the data slots.
        base: address of the mapping (for futex calls).
    """

    def __init__(self, mm: mmap.mmap, layout: Layout):
        self.layout = layout
        self._mm = mm
        self._anchor = ctypes.c_char.from_buffer(mm)
        self.base = ctypes.addressof(self._anchor)
        self.buf = memoryview(mm)
        self.words = self.buf.cast("I")
        whole = torch.frombuffer(mm, dtype=torch.uint8)
        self.data = whole[layout.data_off:layout.total].view(NSLOTS, layout.world, layout.slot_bytes)
        self._rows: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._prefix: dict = {}

    def rows(self, slot: int, dtype: torch.dtype) -> torch.Tensor:
        """Data slot ``slot`` of every rank as ``[world, slot_bytes / itemsize]`` of ``dtype``."""
        v = self._rows.get((slot, dtype))
        if v is None:
            v = self._rows[(slot, dtype)] = self.data[slot].view(dtype)
        return v

    def prefix_views(self, slot: int, dtype: torch.dtype, numel: int):
        """Cached ``(rows[:, :numel], [rows[p, :numel] for p])`` of slot ``slot`` as ``dtype``:
        small collectives of a recurring size then make no new tensor views."""
        key = (slot, dtype, numel)
        v = self._prefix.get(key)
        if v is None:
            if len(self._prefix) > MAX_PREFIX_VIEWS:
                self._prefix.clear()
            rows = self.rows(slot, dtype)[:, :numel]
            v = self._prefix[key] = (rows, list(rows.unbind(0)))
        return v

    def word_addr(self, rank: int, index: int) -> int:
        return self.base + self.layout.word(rank, index) * WORD_BYTES

    def close(self) -> None:
        """Drop every view and unmap; a view still held elsewhere leaves the mapping to the GC."""
        self.data = None
        self._rows = {}
        self._prefix = {}
        try:
            self.words.release()
            self.buf.release()
        except (BufferError, ValueError, AttributeError):
            pass
        self._anchor = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a torch view is still alive somewhere; unmapped when it dies


def _create(size: int) -> tuple[str, int]:
    for _ in range(8):
        path = os.path.join(SHM_DIR, PREFIX + secrets.token_hex(NAME_RANDOM_BYTES))
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            continue
        _linked.add(path)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            unlink_quietly(path)
            raise
        return path, fd
    raise RuntimeError("fcoll: could not create a unique shared-memory segment in /dev/shm")


def open_segment(store, rank: int, world: int, slot_bytes: int,
                 timeout: datetime.timedelta) -> Segment:
    """Create (rank 0) or attach (others) the group's segment and unlink its name; see module doc.

    Raises:
        RuntimeError: the segment cannot be created or mapped, or a rank did not attach within
            ``timeout``; the name is unlinked before raising.
    """
    layout = Layout(world, slot_bytes)
    path = None
    fd = -1
    try:
        if rank == 0:
            path, fd = _create(layout.total)
            store.set("fcoll/segment", path)
        else:
            store.wait(["fcoll/segment"], timeout)
            path = store.get("fcoll/segment").decode()
            if not os.path.basename(path).startswith(PREFIX) or os.path.dirname(path) != SHM_DIR:
                raise RuntimeError(f"fcoll: unexpected segment name {path!r} in the store")
            fd = os.open(path, os.O_RDWR)
            if os.fstat(fd).st_size != layout.total:
                raise RuntimeError(f"fcoll: segment {path} has the wrong size")
        mm = mmap.mmap(fd, layout.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        fd = -1
        seg = Segment(mm, layout)
        start = proc_start_time(os.getpid()) or 0
        seg.words[layout.word(rank, W_PID)] = os.getpid()
        seg.words[layout.word(rank, W_START_LO)] = start & U32_MASK
        seg.words[layout.word(rank, W_START_HI)] = start >> U32_BITS
        if store.add("fcoll/attached", 1) == world:
            unlink_quietly(path)
            store.set("fcoll/unlinked", "1")
        store.wait(["fcoll/unlinked"], timeout)
        _linked.discard(path)
        return seg
    except BaseException as e:
        if fd >= 0:
            os.close(fd)
        if path is not None:
            unlink_quietly(path)
        if isinstance(e, Exception) and not isinstance(e, RuntimeError):
            raise RuntimeError(f"fcoll: rank {rank} could not set up shared memory: {e}") from e
        raise
