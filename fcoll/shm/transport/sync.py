"""Cross-process arrival counters on shared memory, with futex waits, liveness and timeouts.

Protocol. Each rank owns one u32 *arrive* counter in the segment. A collective is a sequence of
*phases*; in phase ``k`` a rank writes its data and header into its own slot, then stores
``arrive = k`` (the store comes after the data: x86-64 keeps stores in order, so a reader that
sees ``arrive >= k`` sees the data; this backend is only registered on x86-64), then wakes futex
waiters on its counter. Readers wait until every peer's counter reached ``k`` and only then read.
Every rank runs the same phases in the same order (headers checked at the first phase of every
collective), so counters agree.

Waiting (:meth:`Channel.wait_all`): poll the peer's counter for at most ``spin_s`` seconds of
wall time, then sleep in ``FUTEX_WAIT`` on it. Three rules keep a waiter from taking the core
its peer needs:

* **The spin is bounded in time, by about what a sleep costs**, not in iterations.
  ``spin_s`` defaults to :data:`SPIN_US` = 200 us (``FCOLL_SHM_SPIN_US`` overrides it; 0
  never spins). A sleep is a context switch out and back plus the wake-up latency, and a
  pipelined collective loses its cached slots at every sleep, so a small collective whose
  peer is polled in is several times faster than one whose every wait sleeps. Spinning
  longer than the sleep it avoids can only lose (the competitive bound of spin-then-block); a
  shorter bound sleeps where a spin would have won (the ranks' skew is often tens of
  microseconds; figures in docs/design.md, "Waiting").
* **Adaptive**: a spin that ran out (the peer was slow, descheduled, or on the same core: after
  a few futex wake-ups the scheduler often puts both ranks on one core, where a spin can never
  succeed) makes the next waits of this channel sleep at once: 1, then 3, 7, ... up to 63 waits
  after consecutive failures (exponential backoff); each successful spin halves the backoff,
  and so does a sleep of the backoff that ended within the spin bound while the peer ran on
  another CPU (:meth:`Channel._woke_fast`), which also ends the sleeping at once: a peer that
  is fast again costs one wake-up, not a chain of them.
  On an oversubscribed machine waits go to the futex at once (a probe of at most ``spin_s``
  every 64 waits), and the waker's ``FUTEX_WAKE`` lets the scheduler run the woken rank, as it
  does for gloo's blocking socket reads.
* **No ``sched_yield``** and **no spin on the background worker** (``spin_async`` is 0: when
  the worker runs a collective the caller's thread is computing and needs the core and the
  GIL), nor when the group has more ranks than this process has cores.

A yield hands the rest of the time slice (milliseconds) to a busy process, and a spin while the
peer is descheduled burns the time the peer needs (when the two share a core, the spinner holds
the very core its peer waits for): with busy background processes, yielding polls were slower
than gloo and slower than not spinning at all.

No lost wake-ups. A waiter raises its sleep flag in the counter owner's control record, then
calls ``FUTEX_WAIT(expected=value it read)``; the owner stores its counter, then a full memory
barrier (:meth:`Channel.arrive`), then reads the flags and issues ``FUTEX_WAKE`` only if one is
up (a wake costs a syscall, and most phases find the peer already there). This is Dekker's
pattern: the owner's barrier orders its counter store before its flag load, and the kernel's
``FUTEX_WAIT`` orders the waiter's flag store before the kernel's re-read of the counter (the
``smp_mb()`` "(A)" of ``kernel/futex/waitwake.c``); so either the owner sees the flag and wakes,
or the kernel sees the new counter and does not sleep. x86-64 does reorder a store with a later
load of another address (a store-buffering litmus test between two processes shows it without
the barrier). Python has no fence operator; a successful acquire of an uncontended
``threading.Lock`` is an atomic read-modify-write (a ``lock``-prefixed instruction on x86-64, a
full barrier).

Fencing (:mod:`fcoll.shm.transport.fences`): a rank that gives up a collective marks it in its
control record and wakes its sleepers; :meth:`Channel.wait_all` reads every peer's fence after
the peers arrived and a sleeper on every wake-up, and a fence on the current collective
(``Channel.seq``) or an earlier one raises :class:`~fcoll.shm.transport.fences.PeerError`
before any data of that phase is read.

Liveness: a sleeping waiter wakes at least every ``_TICK_S`` (100 ms) to check that every peer
process is still alive (``/proc/<pid>/stat``: state and start time; a zombie is dead), whether
the group is closing, and the group timeout, so a dead peer is reported within about 0.1-0.2 s
and a missing one at the timeout. A blocked futex costs no CPU, and ctypes releases the GIL
during the syscall.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time

from fcoll.shm.transport.fences import (GAVE_UP_DESTROYED, GAVE_UP_PEER_DIED,
                                        GAVE_UP_TIMEOUT, Fences, PeerError)
from fcoll.shm.transport.segment import (MAX_SLEEP_FLAGS, U32_BITS, U32_MASK, W_ARRIVE, W_CPU,
                                         W_PID, W_SLEEP, W_START_HI, W_START_LO, Segment,
                                         proc_alive)

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_INT_MAX = 0x7FFFFFFF
_TICK_S = 0.1  # longest futex sleep between liveness, closing and timeout checks
# Counters wrap at 2**32: a counter c has reached phase k when (c - k) mod 2**32 is below
# 2**31 (serial-number arithmetic, RFC 1982), so a wrap in the middle of a run is harmless.
_HALF_RANGE = 1 << (U32_BITS - 1)
SPIN_US = 200.0  # default spin bound in microseconds: about the measured cost of a sleep
_MAX_SKIP = 63  # at most this many waits sleep at once after a spin ran out (then one probes)
# A spinning wait spins longer by the time the peers need to write the phase's data at this
# rate (1 MiB: 262 us more), see Channel.transfer_s
TRANSFER_BYTES_PER_S = 4e9
SPREAD_INTERVAL_S = 0.05  # a channel moves its thread off a peer's CPU at most this often
# ... and only while the machine runs at most this many tasks per CPU (Channel._spread)
SPREAD_MAX_RUNNABLE_PER_CPU = 3
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_getcpu = _libc.sched_getcpu  # the CPU the calling thread runs on (vDSO, tens of ns)
_getcpu.restype = ctypes.c_int


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(addr: int, expected: int, timeout_s: float) -> int:
    """Sleep while the u32 at ``addr`` equals ``expected``, at most ``timeout_s`` seconds.

    Returns 0 when woken, else the errno: ``EAGAIN`` (the value differed at the call),
    ``ETIMEDOUT``, ``EINTR`` (a signal). Callers re-check their condition in every case."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    if _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected),
                ctypes.byref(ts), None, 0) == 0:
        return 0
    return ctypes.get_errno()


_TICK_TS = ctypes.byref(_Timespec(0, int(_TICK_S * 1e9)))  # built once: the usual timeout


def _sleep(addr: int, expected: int, timeout_s: float) -> int:
    """:func:`futex_wait` for :meth:`Channel._block`: a whole tick reuses one timespec."""
    if timeout_s < _TICK_S:
        return futex_wait(addr, expected, timeout_s)
    if _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected),
                _TICK_TS, None, 0) == 0:
        return 0
    return ctypes.get_errno()


def futex_wake(addr: int) -> None:
    """Wake every thread sleeping in :func:`futex_wait` on ``addr``, in any process."""
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, _INT_MAX, None, None, 0)


def runnable_tasks() -> int:
    """Tasks running or ready to run on the whole machine now (``/proc/loadavg``'s fourth
    field, ``running/total``: an instant count, unlike the load averages); about 10 us.

    Raises:
        OSError: /proc is not readable.
    """
    fd = os.open("/proc/loadavg", os.O_RDONLY)
    try:
        text = os.read(fd, 128)
    finally:
        os.close(fd)
    return int(text.split()[3].split(b"/")[0])


def spin_bound_s(world: int) -> float:
    """The spin bound of a group of ``world`` ranks in this process, in seconds.

    ``FCOLL_SHM_SPIN_US`` (microseconds) or :data:`SPIN_US`; 0 when the group has more ranks
    than this process may use cores (ranks then share cores, and a spinning rank always takes
    one from a peer).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if world > cores:
        return 0.0
    return max(0.0, float(os.environ.get("FCOLL_SHM_SPIN_US", SPIN_US))) * 1e-6


class Channel:
    """Phase counters of one group on one segment, seen from group rank ``rank``.

    Args:
        seg: the mapped segment.
        rank: this process's rank in the group.
        world: group size.
        timeout_s: the group timeout, in seconds, for any single wait.
        global_ranks: group rank -> global rank, for error messages.
        spin_s: the spin bound in seconds (default :func:`spin_bound_s`).

    Attributes:
        spin_sync, spin_async: the spin bound, in seconds, of a wait on the thread that issued
            the collective (which waits anyway) and on the group's background worker (0: the
            caller's thread is computing meanwhile).
        spin_iters: the bound of the thread now executing (the engine sets it to
            ``spin_sync`` or ``spin_async`` before each collective; the name is historical:
            it is seconds, not polls).
        transfer_s: seconds a peer may still be writing the current phase's data (its
            bytes at :data:`TRANSFER_BYTES_PER_S`; set by the engine and the pipelined
            algorithms, 0 for headers only): a wait that spins at all, with no recent
            run-out, spins this much longer, so a peer busy copying a large phase is polled
            in rather than slept on (see :meth:`wait_all`).
        closing: set by the owner to make blocked waits give up at the next tick.
    """

    def __init__(self, seg: Segment, rank: int, world: int, timeout_s: float,
                 global_ranks: list[int], spin_s: float | None = None):
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
        self.fences = Fences(seg, rank, world, self.describe,
                             lambda: futex_wake(self._addr[rank]))
        self._fence_idx = self.fences.peer_idx
        self._fence_one = self._fence_idx[0] if world == 2 else -1  # 2 ranks: one word
        self.seq = 0  # the collective being executed (the engine sets it): fences compare to it
        self._ident = [
            (words[lay.word(p, W_PID)],
             words[lay.word(p, W_START_LO)] | (words[lay.word(p, W_START_HI)] << U32_BITS))
            for p in range(world)
        ]
        self.spin_sync = spin_bound_s(world) if spin_s is None else spin_s
        self.spin_async = 0.0
        self.spin_iters = self.spin_sync
        self.transfer_s = 0.0
        self.backoff = 0  # waits to skip spinning after the next spin that runs out
        self.skip = 0  # waits left that sleep at once
        # the full barrier of arrive(): acquiring a threading.Lock ends in an atomic RMW,
        # contended or not (it is not: the engine executes one collective at a time)
        self._fence_lock = threading.Lock()
        self.words = words
        self.closing = False
        self._cpu_idx = lay.word(rank, W_CPU)
        self._peer_cpu_idx = [lay.word(p, W_CPU) for p in self._peers]
        self._spread_at = -SPREAD_INTERVAL_S  # time.monotonic() of this channel's last move
        # waits that did not find the peer there: "spun" (it came while polling), "slept";
        # "spin_failed": spins that ran out; "late": sleeps that ran to their timeout although
        # the peer had arrived (a lost wake-up, or an arrival at that very instant); "moved":
        # times this rank moved its thread off the CPU a peer waited on (:meth:`_spread`);
        # "woke_fast": sleeps of the backoff that ended within a spin (:meth:`_woke_fast`)
        self.stats = {"spun": 0, "slept": 0, "spin_failed": 0, "late": 0, "moved": 0,
                      "woke_fast": 0}

    def describe(self, p: int) -> str:
        g = self.global_ranks[p]
        return f"rank {p}" if g == p else f"rank {p} (global rank {g})"

    def arrive(self) -> int:
        """Publish that this rank finished writing the current phase; returns the phase number.

        Wakes the peers sleeping on this counter: the full barrier between the counter store
        and the flag load is what makes a skipped ``FUTEX_WAKE`` safe (module docstring).
        """
        self.phase += 1
        k = self.phase & U32_MASK
        words = self.words
        words[self._idx[self.rank]] = k
        lock = self._fence_lock
        lock.acquire()  # full barrier: the store above is visible before the loads below
        lock.release()
        if self._one_flag >= 0:  # 2 ranks: one flag to look at
            if words[self._one_flag]:
                self._wake_sleepers()
        elif not self._flags_on or any(words[self._my_flags]):
            self._wake_sleepers()
        return k

    def _wake_sleepers(self) -> None:
        """``FUTEX_WAKE`` on this rank's counter, after publishing the CPU it runs on (the
        woken rank's :meth:`_woke_fast` reads it; a wake-up is a syscall, the CPU look-up a
        tenth of one)."""
        self.words[self._cpu_idx] = _getcpu() + 1
        futex_wake(self._addr[self.rank])

    def peers_past(self) -> list[int]:
        """Peers that arrived at a phase past the last one this rank completed."""
        k = (self.phase + 1) & U32_MASK
        return [p for p in self._peers if self._arrived(p, k)]

    def _arrived(self, p: int, k: int) -> bool:
        return ((self.words[self._idx[p]] - k) & U32_MASK) < _HALF_RANGE

    def wait_all(self, what: str, start: float) -> None:
        """Block until every peer arrived at the current phase: poll for at most
        ``spin_iters + transfer_s`` seconds in all (none in the ``skip`` waits after a spin ran
        out, none when ``spin_iters`` is 0), then sleep.

        The ``transfer_s`` part: a rank may arrive a copy-in and a reduction after its peer,
        which at 1 MiB is close to the plain bound, so the plain bound ran out now and then,
        and every run-out put the next 1-63 waits to sleep (each a wake-up of the sleeper and
        cold caches for its next copy). It applies only while the
        channel's spins succeed (``backoff`` 0): after a run-out, as on an oversubscribed
        machine where the peer is often descheduled, the probes spin the plain bound.

        Args:
            what: the collective, for error messages (``"all_reduce #12"``).
            start: ``time.monotonic()`` when the collective started; the timeout counts from it.

        Raises:
            PeerError: a peer process died, or ``timeout_s`` passed first.
        """
        k = self.phase & U32_MASK
        words = self.words
        deadline = 0.0
        # the arrival test is _arrived written out, with its constants as literals: it is
        # the poll of the spin loop
        for p in self._peers:
            idx = self._idx[p]
            if ((words[idx] - k) & 0xFFFFFFFF) < 0x80000000:
                continue
            spin = self.spin_iters
            if self.skip:  # a recent spin ran out: sleep at once, a few waits more
                self.skip -= 1
                spin = 0.0
            if spin > 0.0:
                clock = time.perf_counter
                if deadline == 0.0:  # transfer_s only while spins succeed (no backoff)
                    deadline = clock() + spin + (0.0 if self.backoff else self.transfer_s)
                while clock() < deadline:
                    if ((words[idx] - k) & 0xFFFFFFFF) < 0x80000000:
                        break
                else:
                    spin = 0.0
                if spin:
                    self.backoff >>= 1
                    self.stats["spun"] += 1
                    continue
                self.backoff = min(2 * self.backoff + 1, _MAX_SKIP)
                self.skip = self.backoff
                self.stats["spin_failed"] += 1
                if self._spread():  # the peer shared this CPU: spinning can work again
                    self.backoff = self.skip = 0
            self.stats["slept"] += 1
            slept_at = time.perf_counter()
            self._block(p, k, what, start)
            if self.skip and time.perf_counter() - slept_at < self.spin_iters:
                self._woke_fast()
        # a peer that arrived may have given up since: never read its data then
        fence = self._fence_one
        if fence >= 0:
            if words[fence]:
                self.fences.check(self.seq, what)
        else:
            for i in self._fence_idx:
                if words[i]:
                    self.fences.check(self.seq, what)

    def _woke_fast(self) -> None:
        """A sleep of the backoff ended within the spin bound: the peer came as fast as a spin
        would have caught it, so this rank's next waits spin again (the backoff halves) rather
        than sleep at once up to 63 more times. A chain of sleeps feeds itself (each sleeper
        arrives late by its own wake-up, which makes its peer's next probe fail), so it ends
        here, after one wake-up. Not when the peer woke this rank from the CPU it now runs on
        (the waker publishes its CPU, :meth:`_wake_sleepers`): there the two take turns, a spin
        cannot succeed, and the sleep was short only because the CPU was handed over."""
        here = _getcpu() + 1
        if any(self.words[i] == here for i in self._peer_cpu_idx):
            return
        self.skip = 0
        self.backoff >>= 1
        self.stats["woke_fast"] += 1

    def _spread(self) -> bool:
        """After a spin ran out: if a peer last waited on the CPU this thread runs on, move
        this thread to another CPU it may use; returns whether it moved.

        Two ranks on one CPU can never meet by spinning, so every wait of both sleeps and
        every collective pays a wake-up and a context switch per rank; the scheduler keeps
        them there (a woken rank is placed where its waker ran, and with one of them always
        asleep no CPU looks overloaded to the load balancer): a small all_reduce then costs
        several times what it costs on two CPUs. The move sets this thread's affinity
        to the other allowed CPUs (the kernel migrates it at once) and then restores the
        mask it had, so the process's affinity is unchanged and the scheduler stays free to
        place it later.

        It moves only while the machine runs at most :data:`SPREAD_MAX_RUNNABLE_PER_CPU` tasks
        per CPU this thread may use (:func:`runnable_tasks`, the ranks included): with about
        one busy process per CPU a rank that moves shares a CPU with one of them and the two
        ranks meet by spinning whenever both run, but with several per CPU it gets a small
        share of its new CPU, and one CPU's direct hand-off between the sleeping ranks does
        better (figures: docs/design.md, "Waiting"). Each rank publishes its CPU (``W_CPU``,
        1 + cpu) whenever a spin ran out, it goes to sleep or it wakes a sleeper; a channel
        moves at most every
        :data:`SPREAD_INTERVAL_S`.
        """
        words = self.words
        cpu = _getcpu()
        words[self._cpu_idx] = cpu + 1
        if cpu < 0 or not any(words[i] == cpu + 1 for i in self._peer_cpu_idx):
            return False
        now = time.monotonic()
        if now - self._spread_at < SPREAD_INTERVAL_S:
            return False
        self._spread_at = now
        try:
            allowed = os.sched_getaffinity(0)
            if runnable_tasks() > SPREAD_MAX_RUNNABLE_PER_CPU * len(allowed):
                return False  # every CPU is crowded: sharing one with the peer does better
            taken = {words[i] - 1 for i in self._peer_cpu_idx}
            others = (allowed - taken) or (allowed - {cpu})
            if not others:
                return False
            os.sched_setaffinity(0, others)
            os.sched_setaffinity(0, allowed)
        except OSError:  # a mask we may not set (a cgroup's cpuset changed meanwhile)
            return False
        words[self._cpu_idx] = _getcpu() + 1
        self.stats["moved"] += 1
        return True

    def _block(self, p: int, k: int, what: str, start: float) -> None:
        """Sleep on peer ``p``'s counter until it reaches ``k``.

        Raises:
            PeerError: ``p`` or another peer died, the group is closing, or the timeout passed.
        """
        words = self.words
        idx = self._idx[p]
        addr = self._addr[p]
        flag = self._flag_idx[p]
        clock = time.monotonic
        checked = clock()
        words[self._cpu_idx] = _getcpu() + 1  # for a peer's _spread
        words[flag] = 1  # ordered before the kernel's re-read of the counter (FUTEX_WAIT)
        try:
            while True:
                cur = words[idx]
                if ((cur - k) & U32_MASK) < _HALF_RANGE:
                    return
                for i in self._fence_idx:  # a peer that gave up woke us: raise now
                    if words[i]:
                        self.fences.check(self.seq, what)
                now = clock()
                if now - checked >= _TICK_S:
                    checked = now
                    self.check_peers(what, k)
                    if self.closing:
                        raise PeerError(f"fcoll {what}: the process group was destroyed while "
                                        f"rank {self.rank} waited for {self.describe(p)}",
                                        GAVE_UP_DESTROYED)
                remaining = self.timeout_s - (now - start)
                if remaining <= 0:
                    self._fail_timeout(k, what)
                    return  # every peer arrived at the last moment
                if (_sleep(addr, cur, remaining) == errno.ETIMEDOUT
                        and ((words[idx] - k) & U32_MASK) < _HALF_RANGE):
                    self.stats["late"] += 1  # slept to the tick although the peer had come
        finally:
            words[flag] = 0

    def check_peers(self, what: str, k: int | None = None) -> None:
        """Raise :class:`PeerError` naming every peer process that is no longer running; with
        ``k``, only those that have not arrived at phase ``k``.

        A peer that arrived at the phase this rank waits for is not what it waits for, dead or
        alive: it may have completed the collective and exited meanwhile (this rank's thread
        read the counter, then was descheduled or stopped past the peer's exit), and if a later
        phase needs it, the wait there finds it missing. Raising for it would fail a collective
        whose data is complete.
        """
        dead = [p for p in self._peers if not proc_alive(*self._ident[p])]
        if k is not None:
            dead = [p for p in dead if not self._arrived(p, k)]
        if dead:
            names = ", ".join(self.describe(p) for p in dead)
            pids = ", ".join(str(self._ident[p][0]) for p in dead)
            raise PeerError(
                f"fcoll {what}: {names} died (pid {pids}) while rank {self.rank} waited for it; "
                "the process group is no longer usable", GAVE_UP_PEER_DIED, dead[0])

    def _fail_timeout(self, k: int, what: str) -> None:
        missing = [p for p in self._peers if not self._arrived(p, k)]
        if not missing:
            return
        names = ", ".join(self.describe(p) for p in missing)
        raise PeerError(
            f"fcoll {what}: timed out after {self.timeout_s:.1f} s on rank {self.rank}; "
            f"ranks not yet arrived: {names}", GAVE_UP_TIMEOUT, missing[0])
