"""One shared-memory segment per process group: creation, attachment, layout, cleanup.

The segment is a sealed ``memfd``, never a name in /dev/shm. Lifecycle (every rank of the group
runs :func:`open_segment`):

1. Group rank 0 creates a memfd (``memfd_create``, mode 0600), sizes it, and seals it against
   shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``), then publishes through
   the group's store its pid, process start time, fd number and inode.
2. Every other rank opens ``/proc/<creator pid>/fd/<fd>`` (the kernel checks that it may read
   the creator's fds: same uid), checks on the fd it got that it is the published inode, a
   regular file owned by its own uid with mode 0600, of the layout's size, and sealed, and
   refuses otherwise, naming the path; it checks the creator's start time before and after the
   open, so a reused pid is never followed. Then it maps the fd and closes it.
3. Every rank publishes its pid and process start time in its control record and counts itself
   in the store; every rank waits for the count (initialisation is a barrier: all control
   records are filled before the first collective), then the creator closes its fd.

Why a sealed memfd rather than a /dev/shm name (what earlier versions used):

- *Nothing can leak.* A memfd has no name: the memory lives exactly as long as some process
  maps it or holds its fd, so a job killed in any phase (even between create and attach) leaves
  nothing behind, and there is no create-to-attach window to shrink. :func:`sweep_dead_segments`
  only removes /dev/shm names that earlier fcoll versions left.
- *No SIGBUS.* A truncated shared file makes every access past its new end raise SIGBUS, which
  Python cannot turn into an exception (the faulting copy is inside torch or memcpy). Checking
  the size with ``fstat`` before each access would cost a syscall per collective and still race
  with a truncation in the middle of a copy. The seals make the size immutable, for every
  process including root (``ftruncate`` fails with EPERM), so the mapping can never lose a page.
  A memfd also is not bounded by the size of the /dev/shm mount (64 MiB in a default Docker
  container), another source of SIGBUS on first touch.
- *No path to redirect.* Attachers never open a path taken from the store: they build
  ``/proc/<pid>/fd/<n>`` from integers, so there is no directory another user can plant a
  symlink in (``O_NOFOLLOW`` does not apply to /proc's fd links; the fd checks above replace it).
  Every open of a peer's file (its fd link, its /proc files) passes ``O_NOCTTY``
  (:data:`PEER_OPEN_FLAGS`), so a forged record naming a terminal cannot make it this
  process's controlling terminal before the checks refuse it.

It needs every rank to see the creator in /proc and be allowed to read its fds (same uid, one
pid namespace); the liveness checks of :mod:`fcoll.shm.transport.sync` need the same.

We never use ``multiprocessing.shared_memory``: its resource tracker unlinks segments in use
(CPython gh-82300).

Layout (offsets in bytes, every region 4096-aligned)::

    control  [world][128]           per rank: arrive counter (u32), pid (u32), start time (u64),
                                    the fence: the collective it gave up (u32) and why (u32),
                                    one sleep flag (u32) per waiting peer, the CPU it
                                    last waited on (u32, last word)
    notes    [world][128]           per rank: why it gave up, in its own words (UTF-8, NUL
                                    padded; written before the fence, read only after it)
    headers  [NSLOTS][world][HEADER] collective headers, one per slot
    data     [NSLOTS][world][slot_bytes] per-rank data slots, used round robin (NSLOTS = 3)
"""

from __future__ import annotations

import ctypes
import datetime
import fcntl
import mmap
import os
import re
import stat
import time
from dataclasses import dataclass

import torch

SHM_DIR = "/dev/shm"
PREFIX = "fcoll-"  # of the memfd's name (shown in /proc/<pid>/maps) and of old /dev/shm names
CONTROL_BYTES = 128  # two cache lines per rank, so counters of different ranks never share a line
NOTE_BYTES = 128  # per rank: the text of its fence (see fcoll.shm.transport.fences.Fences.give_up)
HEADER_BYTES = 2048
NSLOTS = 3  # data slots per rank, used round robin (see phases.py for why 3)
PAGE = 4096
SLOT_BYTES = 1 << 20  # default bytes of one data slot, see default_slot_bytes
MODE = 0o600
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
SWEEP_MIN_AGE_S = 10.0  # a /dev/shm name younger than this may not be mapped yet by its creator
MAX_STORE_VALUE_BYTES = 128  # the published segment record is read from the store, bounded
_KEY = "fcoll/segment"
_RECORD = re.compile(rb"memfd ([0-9]{1,10}) ([0-9]{1,20}) ([0-9]{1,10}) ([0-9]{1,20})")

# Word indices (u32) inside a rank's control record.
W_ARRIVE = 0
W_PID = 1
W_START_LO = 2
W_START_HI = 3
W_GAVE_UP = 4  # 1 + the sequence number (mod 2**32) of the collective this rank gave up, or 0
W_GAVE_UP_WHY = 5  # why it gave up and on which op (see fcoll.shm.transport.fences.Fences.give_up)
W_SLEEP = 6  # W_SLEEP + q: rank q is (about to be) blocked in FUTEX_WAIT on this counter
WORD_BYTES = 4  # control words are u32
W_CPU = CONTROL_BYTES // WORD_BYTES - 1  # 1 + the CPU this rank last waited on, or 0
MAX_SLEEP_FLAGS = W_CPU - W_SLEEP
U32_BITS = 32
U32_MASK = (1 << U32_BITS) - 1

MAX_PREFIX_VIEWS = 512  # cached prefix views per segment before the cache starts over


def _round_up(n: int, m: int = PAGE) -> int:
    return (n + m - 1) // m * m


def default_slot_bytes() -> int:
    """Bytes of one data slot (per rank, ``NSLOTS`` slots each): 1 MiB.

    With 1 MiB slots a large all_reduce beats larger slots (a peer's next chunk arrives within
    the bounded spin, so no rank sleeps, and the slots stay in cache), and smaller slots add
    too many synchronisations. ``FCOLL_SHM_SLOT_BYTES`` overrides it,
    rounded down to whole pages, at least one (tests use small slots to exercise chunking).
    """
    if os.environ.get("FCOLL_SHM_SLOT_BYTES"):
        return max(PAGE, int(os.environ["FCOLL_SHM_SLOT_BYTES"]) // PAGE * PAGE)
    return SLOT_BYTES


#: flags of every open of a file another process controls (a peer's fd link, its /proc files):
#: never make it this process's controlling terminal (a forged store record could name a tty)
PEER_OPEN_FLAGS = os.O_CLOEXEC | os.O_NOCTTY


def read_proc_file(path: str, limit: int = 1 << 16) -> bytes:
    """The first ``limit`` bytes of a /proc file of a peer, opened with
    :data:`PEER_OPEN_FLAGS` and ``O_NOFOLLOW`` (a /proc/<pid>/stat or maps is no link).

    Raises:
        OSError: it cannot be opened or read (the process exited).
    """
    fd = os.open(path, os.O_RDONLY | PEER_OPEN_FLAGS | os.O_NOFOLLOW)
    try:
        chunks, n = [], 0
        while n < limit:
            b = os.read(fd, limit - n)
            if not b:
                break
            chunks.append(b)
            n += len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _proc_stat(pid: int) -> list[bytes] | None:
    """Fields of /proc/pid/stat after the command name (field 3, the state, first), or None."""
    try:
        raw = read_proc_file(f"/proc/{pid}/stat", 4096)
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2:].split()


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
    def note_off(self) -> int:
        return self.world * CONTROL_BYTES

    @property
    def header_off(self) -> int:
        return _round_up(self.world * (CONTROL_BYTES + NOTE_BYTES))

    @property
    def data_off(self) -> int:
        return self.header_off + _round_up(NSLOTS * self.world * HEADER_BYTES)

    @property
    def total(self) -> int:
        return self.data_off + NSLOTS * self.world * self.slot_bytes

    def header(self, slot: int, rank: int) -> int:
        return self.header_off + (slot * self.world + rank) * HEADER_BYTES

    def note(self, rank: int) -> int:
        """Byte offset of ``rank``'s note (:data:`NOTE_BYTES`)."""
        return self.note_off + rank * NOTE_BYTES

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
        control: int32 tensor ``[world, CONTROL_BYTES / 4]`` over the control records (u32
            words read as int32), for readers that may outlive :meth:`close` (a view keeps the
            mapping alive, see there).
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
        self.control = whole[:layout.world * CONTROL_BYTES].view(torch.int32).view(
            layout.world, CONTROL_BYTES // WORD_BYTES)
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
        """Drop this segment's views and its reference to the mapping; never unmap under a view.

        ``torch.frombuffer`` keeps a reference to the ``mmap`` object but no buffer export, so
        ``mmap.close()`` succeeds while a tensor view of the mapping lives, and that view then
        points at unmapped memory (a read or write is a SIGSEGV, or silently hits whatever is
        mapped there next). So close never calls ``mmap.close()``: it releases the memoryviews
        and the ctypes anchor (whose holders then get ``ValueError``, not a crash) and drops
        its own reference. The mapping is unmapped by the ``mmap`` object's finalizer the moment
        the last reference goes, right here when no tensor view is held elsewhere (the usual
        case: the group's caches are cleared first), or when the last such view is freed.
        """
        self.data = self.control = None
        self._rows = {}
        self._prefix = {}
        for mv in (self.words, self.buf):
            try:
                mv.release()
            except (BufferError, ValueError, AttributeError):
                pass  # a slice of it is exported elsewhere: it keeps the mapping alive
        self._anchor = None
        self._mm = None  # the last reference unmaps (mmap's finalizer), never before


def create_sealed_memfd(name: str, size: int, what: str = "shared-memory segment") -> int:
    """A memfd ``name`` of ``size`` bytes, mode 0600, sealed against shrinking and growing (no
    SIGBUS from a peer's truncate); returns its fd (close-on-exec). Used for the group segment
    and for p2p inboxes (:mod:`fcoll.shm.p2p.inbox`)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, MODE)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        check_fd(fd, f"/proc/{os.getpid()}/fd/{fd}", size, None, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create(size: int, start: int) -> int:
    """The group segment: a sealed memfd of ``size`` bytes named for this process."""
    return create_sealed_memfd(f"{PREFIX}{os.getpid()}-{start}", size)


def check_fd(fd: int, path: str, size: int, ino: int | None,
             what: str = "shared-memory segment", size_note: str = "of the group's layout") -> None:
    """Refuse ``fd`` (opened from ``path``) unless it is the expected ``what``: inode ``ino``
    (when given), a regular file of our uid, mode 0600, ``size`` bytes, sealed against resizing.

    Raises:
        RuntimeError: naming ``what``, ``path`` and the first check that failed.
    """
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file"
    elif ino is not None and st.st_ino != ino:
        why = f"is inode {st.st_ino}, not the published {ino}"
    elif st.st_uid != os.geteuid():
        why = f"is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
    elif stat.S_IMODE(st.st_mode) != MODE:
        why = f"has mode {stat.S_IMODE(st.st_mode):04o}, not {MODE:04o}"
    elif st.st_size != size:
        why = f"has {st.st_size} bytes, not the {size} {size_note}"
    else:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if seals & SEALS != SEALS:
            why = "is not sealed against shrinking and growing (it could be truncated: SIGBUS)"
    if why is not None:
        raise RuntimeError(f"fcoll: refusing to map the {what} {path}: it {why}")


def _attach(record: bytes, size: int) -> int:
    """Open the segment the creator published as ``record``; returns the fd.

    Raises:
        RuntimeError: the record is malformed, the creator is gone, or the fd fails
            :func:`check_fd`.
    """
    m = _RECORD.fullmatch(record[:MAX_STORE_VALUE_BYTES])
    if m is None or len(record) > MAX_STORE_VALUE_BYTES:
        raise RuntimeError(f"fcoll: unexpected segment record {record[:80]!r} in the store")
    pid, start, fdn, ino = (int(g) for g in m.groups())
    path = f"/proc/{pid}/fd/{fdn}"
    if proc_start_time(pid) != start:
        raise RuntimeError(f"fcoll: the creator of the group's segment (pid {pid}) exited "
                           f"before this rank could attach {path}")
    try:
        fd = os.open(path, os.O_RDWR | PEER_OPEN_FLAGS)  # a magic link: no O_NOFOLLOW
    except OSError as e:
        raise RuntimeError(f"fcoll: cannot open the group's segment {path} ({e.strerror}); "
                           "every rank must run as the same user, see the creator in /proc "
                           "and be allowed to read its fds") from None
    try:
        if proc_start_time(pid) != start:  # the pid was reused between the checks
            raise RuntimeError(f"fcoll: the creator of the group's segment (pid {pid}) exited "
                               f"while this rank attached {path}")
        check_fd(fd, path, size, ino)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_segment(store, rank: int, world: int, slot_bytes: int,
                 timeout: datetime.timedelta) -> Segment:
    """Create (rank 0) or attach (others) the group's segment; see the module doc.

    Rank 0 first removes the /dev/shm names earlier fcoll versions left
    (:func:`sweep_dead_segments`).

    Raises:
        RuntimeError: the segment cannot be created, opened or mapped, fails a check (named
            with its path), or a rank did not attach within ``timeout``.
    """
    layout = Layout(world, slot_bytes)
    fd = -1
    mm = None
    try:
        start = proc_start_time(os.getpid()) or 0
        if rank == 0:
            sweep_dead_segments()
            fd = _create(layout.total, start)
            ino = os.fstat(fd).st_ino
            store.set(_KEY, f"memfd {os.getpid()} {start} {fd} {ino}")
        else:
            store.wait([_KEY], timeout)
            fd = _attach(store.get(_KEY), layout.total)
        mm = mmap.mmap(fd, layout.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if rank != 0:
            os.close(fd)
            fd = -1
        seg = Segment(mm, layout)
        seg.words[layout.word(rank, W_PID)] = os.getpid()
        seg.words[layout.word(rank, W_START_LO)] = start & U32_MASK
        seg.words[layout.word(rank, W_START_HI)] = start >> U32_BITS
        if store.add("fcoll/attached", 1) == world:
            store.set("fcoll/all_attached", "1")
        store.wait(["fcoll/all_attached"], timeout)
        return seg
    except BaseException as e:
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass
        if isinstance(e, Exception) and not isinstance(e, RuntimeError):
            raise RuntimeError(f"fcoll: rank {rank} could not set up shared memory: {e}") from e
        raise
    finally:
        if fd >= 0:
            os.close(fd)  # the creator's, once every rank attached (or on failure)


# ---- /dev/shm names left by earlier fcoll versions ---------------------------------------------
def sweep_dead_segments(shm_dir: str = SHM_DIR,
                        min_age_s: float = SWEEP_MIN_AGE_S) -> list[str]:
    """Remove the fcoll segment names in ``shm_dir`` that no process uses; return their paths.

    This version never names a segment (see the module doc); earlier ones created
    ``/dev/shm/fcoll-<hex>`` and unlinked it once every rank had attached, so a job killed
    inside that window left the name, and its memory, behind. A name is removed when it is a
    regular file of our uid, older than ``min_age_s`` (its creator maps it within
    microseconds of creating it), and no process we can see maps it (``/proc/*/maps``;
    processes of other users cannot map a 0600 file of ours). The scan runs only when such an
    old name exists, so the usual cost is one ``listdir``. Called by :func:`open_segment` on
    rank 0 and by ``fcoll.launch`` at start and exit.
    """
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(PREFIX)]
    except OSError:
        return []
    now = time.time()
    old = {}
    for name in names:
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
                and now - st.st_ctime >= min_age_s):
            old[path] = (st.st_dev, st.st_ino)
    if not old:
        return []
    mapped = _mapped_inodes(shm_dir)
    removed = []
    for path, (dev, ino) in old.items():
        if ino in mapped:
            continue
        try:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == (dev, ino):  # still the file we judged
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
    return removed


def proc_maps():
    """``(pid, contents of /proc/<pid>/maps)`` of every process whose maps this one can read
    (a process that exits meanwhile is skipped)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            maps = read_proc_file(f"/proc/{pid}/maps", 1 << 26)
        except OSError:
            continue
        yield pid, maps


def _mapped_inodes(shm_dir: str) -> set[int]:
    """Inodes of the ``shm_dir`` fcoll files mapped by any process whose maps we can read."""
    needle = os.path.join(shm_dir, PREFIX).encode()
    inodes = set()
    for _, maps in proc_maps():
        if needle not in maps:
            continue
        for line in maps.splitlines():
            if needle in line:
                fields = line.split(None, 5)
                if len(fields) >= 5 and fields[4].isdigit():
                    inodes.add(int(fields[4]))
    return inodes
