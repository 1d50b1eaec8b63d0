"""Cross-process arrival counters on shared memory, with futex waits, liveness and timeouts.

Protocol. Each rank owns one u32 *arrive* counter in the segment. A collective is a sequence of
*phases*; in phase ``k`` a rank writes its data and header into its own slot, then stores
``arrive = k`` (the store comes after the data: x86-64 keeps stores in order, so a reader that
sees ``arrive >= k`` sees the data; this backend is only registered on x86-64), then wakes futex
waiters on its counter. Readers wait until every peer's counter reached ``k`` and only then read.
Every rank runs the same phases in the same order (headers checked at the first phase of every
collective), so counters agree.

Waiting: a bounded spin (only when there are at least as many cores as ranks; up to 2000
polls with a ``sched_yield`` every 8 when the caller's thread runs the collective, a tenth of
that on the background worker, whose process is busy computing), then ``FUTEX_WAIT`` on the peer's counter (the kernel re-checks the value, so a wake between our read
and the syscall is never lost) with a ~100 ms tick. A waiter raises its sleep flag in the
counter owner's control record first, and the owner only issues ``FUTEX_WAKE`` when a flag is
up: a wake costs a syscall and, on a busy machine, often a context switch (measured: 250 us per
wake under load), and most phases find the peer already there. x86-64 may reorder the owner's
counter store after its flag load (and the waiter's likewise), so a wake can be missed in a
nanoseconds-wide window; the first futex wait therefore times out after 2 ms, bounding the cost
of that rare case. Each tick checks that every peer process is
still alive (``/proc/<pid>/stat``: state and start time; a zombie is dead) and the group timeout,
so a dead peer is reported within about 0.1-0.2 s and a missing one at the timeout. A blocked
futex costs no CPU, and ctypes releases the GIL during the syscall.
"""

from __future__ import annotations

import ctypes
import os
import time

from fcoll.shm.segment import (MAX_SLEEP_FLAGS, U32_BITS, U32_MASK, W_ARRIVE, W_PID, W_SLEEP,
                                W_START_HI, W_START_LO, Segment, proc_alive)

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_INT_MAX = 0x7FFFFFFF
_TICK_S = 0.1
_FIRST_TICK_S = 0.002
# Counters wrap at 2**32: a counter c has reached phase k when (c - k) mod 2**32 is below
# 2**31 (serial-number arithmetic, RFC 1982), so a wrap in the middle of a run is harmless.
_HALF_RANGE = 1 << (U32_BITS - 1)
_SPIN_POLLS = 2000  # default FCOLL_SHM_SPIN
_ASYNC_SPIN_DIVISOR = 10  # the worker thread spins this many times less than the caller
_YIELD_EVERY = 8  # polls between sched_yield calls while spinning (a power of 2)
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_sched_yield = os.sched_yield


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class PeerError(RuntimeError):
    """A peer died or the group timed out; the group cannot be used any more."""


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected),
             ctypes.byref(ts), None, 0)


def futex_wake(addr: int) -> None:
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, _INT_MAX, None, None, 0)


class Channel:
    """Phase counters of one group on one segment, seen from group rank ``rank``.

    Args:
        seg: the mapped segment.
        rank: this process's rank in the group.
        world: group size.
        timeout_s: the group timeout, in seconds, for any single wait.
        global_ranks: group rank -> global rank, for error messages.
        spin_iters: polls of a peer counter before blocking in the kernel.
    """

    def __init__(self, seg: Segment, rank: int, world: int, timeout_s: float,
                 global_ranks: list[int], spin_iters: int | None = None):
        self.seg = seg
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self.global_ranks = global_ranks
        self.phase = 0  # phases completed by this rank
        self.use = 0  # data-slot uses (slot = use % NSLOTS)
        words = seg.words
        lay = seg.layout
        self._idx = [lay.word(p, W_ARRIVE) for p in range(world)]
        self._flags_on = world <= MAX_SLEEP_FLAGS
        self._my_flags = slice(lay.word(rank, W_SLEEP), lay.word(rank, W_SLEEP) + world)
        self._flag_idx = [lay.word(p, W_SLEEP + rank) for p in range(world)]
        self._one_flag = (lay.word(rank, W_SLEEP + 1 - rank)
                          if world == 2 and self._flags_on else -1)
        self._addr = [seg.word_addr(p, W_ARRIVE) for p in range(world)]
        self._peers = [p for p in range(world) if p != rank]
        self._ident = [
            (words[lay.word(p, W_PID)],
             words[lay.word(p, W_START_LO)] | (words[lay.word(p, W_START_HI)] << U32_BITS))
            for p in range(world)
        ]
        if spin_iters is None:
            spin_iters = int(os.environ.get("FCOLL_SHM_SPIN", str(_SPIN_POLLS)))
        # More ranks than cores: block at once. Measured at 4 ranks on 2 cores, 4 KiB
        # all_reduce: 295 us without spinning, 370-435 us polling with a sched_yield each time.
        oversubscribed = world > (os.cpu_count() or 1)
        if oversubscribed:
            spin_iters = int(os.environ.get("FCOLL_SHM_SPIN_OVERSUBSCRIBED", "0"))
        self._yield_mask = 0 if oversubscribed else _YIELD_EVERY - 1
        self.spin_iters = spin_iters
        self.spin_sync = spin_iters
        self.spin_async = spin_iters // _ASYNC_SPIN_DIVISOR
        self.spin_yield = os.environ.get("FCOLL_SHM_YIELD", "1") == "1"
        self.words = words
        self.closing = False  # set by the owner to make blocked waits give up at the next tick

    def describe(self, p: int) -> str:
        g = self.global_ranks[p]
        return f"rank {p}" if g == p else f"rank {p} (global rank {g})"

    def arrive(self) -> int:
        """Publish that this rank finished writing the current phase; returns the phase number."""
        self.phase += 1
        k = self.phase & U32_MASK
        words = self.words
        words[self._idx[self.rank]] = k
        if self._one_flag >= 0:  # 2 ranks: one flag to look at
            if words[self._one_flag]:
                futex_wake(self._addr[self.rank])
        elif not self._flags_on or any(words[self._my_flags]):
            futex_wake(self._addr[self.rank])
        return k

    def _arrived(self, p: int, k: int) -> bool:
        return ((self.words[self._idx[p]] - k) & U32_MASK) < _HALF_RANGE

    def wait_all(self, what: str, start: float) -> None:
        """Block until every peer arrived at the current phase.

        Args:
            what: the collective, for error messages (``"all_reduce #12"``).
            start: ``time.monotonic()`` when the collective started; the timeout counts from it.

        Raises:
            PeerError: a peer process died, or ``timeout_s`` passed first.
        """
        k = self.phase & U32_MASK
        words = self.words
        # _arrived written out, with its constants as literals: this loop polls up to
        # _SPIN_POLLS times per wait
        for p in self._peers:
            idx = self._idx[p]
            if ((words[idx] - k) & 0xFFFFFFFF) < 0x80000000:
                continue
            for i in range(self.spin_iters):
                if ((words[idx] - k) & 0xFFFFFFFF) < 0x80000000:
                    break
                if self.spin_yield and i & self._yield_mask == self._yield_mask:
                    _sched_yield()
            else:
                self._block(p, k, what, start)

    def _block(self, p: int, k: int, what: str, start: float) -> None:
        words = self.words
        idx = self._idx[p]
        addr = self._addr[p]
        flag = self._flag_idx[p]
        tick = _FIRST_TICK_S
        words[flag] = 1
        try:
            while True:
                cur = words[idx]
                if ((cur - k) & U32_MASK) < _HALF_RANGE:
                    return
                t0 = time.monotonic()
                remaining = self.timeout_s - (t0 - start)
                if remaining <= 0:
                    self._fail_timeout(k, what)
                futex_wait(addr, cur, min(tick, remaining))
                if time.monotonic() - t0 >= _TICK_S * 0.9:
                    self.check_peers(what)
                    if self.closing:
                        raise PeerError(f"fcoll {what}: the process group was destroyed while "
                                        f"rank {self.rank} waited for {self.describe(p)}")
                tick = _TICK_S
        finally:
            words[flag] = 0

    def check_peers(self, what: str) -> None:
        """Raise :class:`PeerError` naming every peer process that is no longer running."""
        dead = [p for p in self._peers if not proc_alive(*self._ident[p])]
        if dead:
            names = ", ".join(self.describe(p) for p in dead)
            pids = ", ".join(str(self._ident[p][0]) for p in dead)
            raise PeerError(
                f"fcoll {what}: {names} died (pid {pids}) while rank {self.rank} waited for it; "
                "the process group is no longer usable")

    def _fail_timeout(self, k: int, what: str) -> None:
        missing = [p for p in self._peers if not self._arrived(p, k)]
        names = ", ".join(self.describe(p) for p in missing)
        raise PeerError(
            f"fcoll {what}: timed out after {self.timeout_s:.1f} s on rank {self.rank}; "
            f"ranks not yet arrived: {names}")
