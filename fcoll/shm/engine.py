"""The per-group executor: collectives run one at a time, in issue order, off the caller's path.

Collectives are *issued* on the caller's thread (validated, staged, queued, returned as a
``Work`` at once) and *executed* by the group's background worker thread, so compute on the
caller's thread overlaps them: torch kernels and the futex syscalls release the GIL.

Whoever needs a result first runs it: ``Work.wait()`` on a job that nobody has started yet
runs the queue up to that job on the waiting thread itself, instead of waking the worker and
sleeping until it is done (two thread hand-offs, tens of microseconds, more on a loaded
machine). Order is kept because only one thread executes jobs at a time (``_running``) and
always the oldest job first. A ``wait()`` on a job already running blocks on the job's lock,
which costs no CPU. A synchronous call runs on the caller's thread at once when the executor is
idle: a queued ``Job`` through :meth:`Engine.run_inline`, a fast path's one-slot kernel through
:meth:`Engine.run_fast` (no ``Job`` at all). Jobs and the ``Work`` objects callers get back
live in :mod:`fcoll.shm.work`.

Threads: a collective executed on the caller's thread runs its torch kernels with at most
:func:`collective_threads` intra-op threads (the CPUs divided among the ranks), whatever
``torch.set_num_threads`` says, and gives the caller its count back afterwards: every rank
copies and reduces at once, and an OpenMP team that needs a core the peer holds stalls the
collective (by orders of magnitude on a machine with as many cores as ranks). The worker's
collectives keep the caller's count: the setting acts process-wide and would throttle the
compute they overlap.

Failure model: a header mismatch or invalid input raises on every rank at the same phase, so the
group stays usable. A dead peer, a timeout or an unexpected error leaves the ranks at different
phases: the group is marked broken and every later collective fails at once with that error, and
the collective is fenced in shared memory (:meth:`~fcoll.shm.transport.fences.Fences.give_up`): a
peer waiting for it, or arriving at it later, raises naming this rank instead of computing a result
from data this rank abandoned, and is broken in turn. Destroying the group fences the next
sequence number, so a peer still to call it raises at once instead of at the timeout. An
exception that leaves a compiled step holding collectives of the group fences the group too
(:meth:`Engine.abandon`, called by the executor), naming the exception's type. Aborting the group
(:meth:`Engine.abort`, c10d's ``ProcessGroup.abort``) fences the first collective this rank has
not completed and makes this rank's own pending collectives fail with an error that says so.

The mapping is unmapped only while no thread executes a collective on it (a torch view of an
unmapped page crashes the process): :meth:`Engine.close` waits for the executor a bounded time,
and if a thread still runs a collective (it raises within a wait's tick, the group closing) that
thread unmaps when it releases the executor.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable

import torch

from fcoll.shm.transport.phases import Call
from fcoll.shm.transport.headers import CollectiveMismatchError
from fcoll.shm.transport.segment import Segment
from fcoll.shm.transport.fences import (GAVE_UP_ABORTED, GAVE_UP_DESTROYED, GAVE_UP_ERROR,
                                        GAVE_UP_RAISED, PeerError)
from fcoll.shm.transport.sync import TRANSFER_BYTES_PER_S, Channel
from fcoll.shm.work import DoneWork, Job

log = logging.getLogger(__name__)
_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()
# A collective moving at least this many bytes runs its torch kernels with at most
# collective_threads() intra-op threads: ATen parallelises copies and elementwise ops above
# 32768 elements (at::internal::GRAIN_SIZE), 32 KiB at the smallest dtype.
THREAD_LIMIT_BYTES = 32 << 10
#: Collectives whose execution times an engine keeps once asked to (:meth:`Engine.keep_times`).
TIMES_KEPT = 1024


def collective_threads(world: int) -> int:
    """Intra-op threads a collective of ``world`` ranks on this host may use: the CPUs this
    process may run on divided among the ranks, at least 1.

    Every rank of a shared-memory collective copies and reduces at the same time, so more
    threads than that oversubscribe the cores, and an OpenMP team whose second thread waits
    for a core that the peer holds (spinning in its wait, or copying) stalls the whole
    collective for a scheduler time slice.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, world))


class _FewerThreads:
    """Context manager: torch's intra-op threads at most ``limit`` inside, as before after.

    ``torch.set_num_threads`` acts process-wide (a thread that sets it changes what
    ``torch.get_num_threads`` returns on every thread), so it is used only on the thread that
    issued the collective and waits for it (it computes nothing meanwhile), never on the
    background worker, whose collectives overlap the caller's compute. Costs one
    ``get_num_threads`` when the limit does not bite, two sets more when it does.
    """

    __slots__ = ("limit", "saved")

    def __init__(self, limit: int):
        self.limit = limit
        self.saved = 0

    def __enter__(self) -> None:
        n = torch.get_num_threads()
        self.saved = n if n > self.limit else 0
        if self.saved:
            torch.set_num_threads(self.limit)

    def __exit__(self, *exc) -> None:
        if self.saved:
            torch.set_num_threads(self.saved)


def exception_note(e: BaseException) -> str:
    """``"IndexError: index 9 is out of bounds ..."``: what a fence says of ``e``."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class Engine:
    """Owns the channel (segment + counters) of one group, its job queue and worker thread.

    Attributes:
        seg, ch: the group's segment and channel.
        seq: the sequence number of the next collective issued on this group, taken by
            :meth:`job` (a queued collective) or :meth:`run_now` (one run on the caller's
            thread), the only two ways to issue one.
        broken: the error that made the group unusable, or None.
        completed: every collective numbered below this one completed on this rank (one that
            raised a cross-rank mismatch counts: every rank raised it at the same phase).
        times: None, or (after :meth:`keep_times`) a ring of the last :data:`TIMES_KEPT`
            completed collectives' ``(seq, start_ns, end_ns, on_worker)`` (see
            :meth:`executed`).
    """

    def __init__(self, seg: Segment, ch: Channel, label: str):
        self.seg = seg
        self.ch = ch
        self.broken: BaseException | None = None
        self._lock = threading.Lock()
        self._pending: collections.deque[Job] = collections.deque()
        self._running = False
        self._wake = threading.Semaphore(0)
        self._closed = False
        self._closed_why = "the process group was destroyed"  # what a call after close() says
        self._aborted = ""  # "rank R aborted the process group (...)" once abort() was called
        self._unmap_deferred = False  # close() found a collective running: its thread unmaps
        self.seq = 0
        self.completed = 0  # every collective numbered below this one completed on this rank
        self.times: list[tuple[int, int, int, bool] | None] | None = None
        self._fewer_threads = _FewerThreads(collective_threads(ch.world))
        self._thread = threading.Thread(target=self._loop, name=f"fcoll-{label}", daemon=True)
        self._thread.start()
        _engines.add(self)

    def job(self, name: str, encode: Callable[[int], bytes], run: Callable[[Call], None],
            finish: Callable[[], None] | None = None, result: Any = None) -> Job:
        """The group's next collective as a :class:`Job`: take its sequence number and encode
        its header with it (``encode(seq)``). The caller queues it (:meth:`submit`) or runs it
        (:meth:`run_inline`); every rank issues its collectives in one order, so the numbers
        agree."""
        seq = self.seq
        self.seq = seq + 1
        return Job(name, seq, encode(seq), run, finish, result)

    def submit(self, job: Job, wake: bool = True) -> Job:
        """Queue ``job``; ``wake=False`` leaves it to the caller's ``wait()`` (or to the worker
        if it is already busy with earlier jobs)."""
        if self._closed:
            raise RuntimeError(f"fcoll {job.name}: {self._closed_why}")
        with self._lock:
            self._pending.append(job)
        if wake:
            self._wake.release()
        return job

    def run_inline(self, job: Job) -> bool:
        """Execute ``job`` right here if the queue is empty and nobody is executing; returns
        False (job not taken) otherwise. Saves the queue round trip of a synchronous call."""
        with self._lock:
            if self._running or self._pending or self._closed:
                return False
            self._running = True
        try:
            self._execute(job)
        finally:
            self._release()
        return True

    def run_now(self, plan, fn: Callable[..., None], args: tuple) -> BaseException | bool:
        """Run a one-slot kernel (:mod:`fcoll.shm.kernels.one_slot`) on the caller's thread, if
        nothing is queued or executing, and make no ``Work``: the direct path's form of
        :meth:`run_fast` (a ``Work`` and its checks behind Dynamo's eager wrapper cost about
        1 us a call).

        Args:
            plan: a :class:`~fcoll.shm.kernels.one_slot.OneSlotPlan`: its header
                (``set_seq``, ``payload``) and ``what`` (the name in messages) are used here.
            fn: the kernel, called ``fn(ch, plan, *args, payload, what, start)``.
            args: the user's tensors (and the root) for ``fn``; ``args[0]`` is what this rank
                copies in (its bytes set :attr:`Channel.transfer_s`).

        Returns:
            False: not run (the executor is busy, closed or broken; no sequence number taken);
            True: done; or the exception it failed with, handled as :meth:`_execute` handles
            failures (a mismatch leaves the group usable, anything else breaks it).

        The claim and release of the executor are written out here rather than shared with
        :meth:`run_inline`: each method call saved is measurable on a small collective.
        """
        lock = self._lock
        with lock:
            if self._running or self._pending or self._closed or self.broken is not None:
                return False
            self._running = True
        ch = self.ch
        ch.spin_iters = ch.spin_sync
        ch.transfer_s = args[0].nbytes / TRANSFER_BYTES_PER_S  # what a peer copies in first
        seq = self.seq
        self.seq = seq + 1
        ch.seq = seq
        times = self.times
        t0 = time.perf_counter_ns() if times is not None else 0
        try:
            plan.set_seq(seq)
            call = (ch, plan, *args, plan.payload, plan.what, time.monotonic())
            # Below autograd, as _execute runs a job and a C++ backend writes: a collective's
            # writes into the caller's tensors leave their version counters alone (a view of
            # an input taken before a broadcast would be refused by autograd otherwise).
            with torch._C._AutoDispatchBelowADInplaceOrView():
                if args[0].nbytes >= THREAD_LIMIT_BYTES:
                    with self._fewer_threads:
                        fn(*call)
                else:
                    fn(*call)
            if times is not None:
                times[seq % TIMES_KEPT] = (seq, t0, time.perf_counter_ns(), False)
            self.completed = seq + 1  # before the release: an unmap there fences the next one
        except BaseException as e:  # noqa: BLE001  carried to the caller
            return self._failed(plan.name, e, seq)
        finally:
            with lock:
                self._running = False
                more = bool(self._pending)
                unmap = self._unmap_deferred
            if more:
                self._wake.release()  # queued meanwhile by another thread: the worker runs it
            if unmap:
                self._unmap()
        return True

    def run_fast(self, plan, fn: Callable[..., None], args: tuple,
                 result: list) -> torch.distributed.Work | None:
        """:meth:`run_now` for the c10d path: a completed :class:`DoneWork` (failures in
        it), or None (nothing done, no sequence number taken).

        Args:
            plan, fn, args: as for :meth:`run_now`; ``plan.work`` (the plan's last ``Work``)
                is reused when nothing else refers to it.
            result: the ``Work``'s result (the output tensors).
        """
        done = self.run_now(plan, fn, args)
        if done is not True:
            return None if done is False else DoneWork(result, done)
        work = plan.work
        # Reuse the plan's last Work when nothing but the plan refers to it any more (c10d
        # drops a synchronous call's Work after wait()): making one costs about 1 us.
        if work is not None and sys.getrefcount(work) == 3:  # plan.work, ``work``, the argument
            work._reset(result)
            return work
        work = plan.work = DoneWork(result, None)
        return work

    def _release(self) -> None:
        """Give up the executor after an inline run; hand jobs queued meanwhile to the worker."""
        with self._lock:
            self._running = False
            more = bool(self._pending)
            unmap = self._unmap_deferred
        if more:
            self._wake.release()
        if unmap:
            self._unmap()

    def kick(self) -> None:
        """Make the worker run whatever is queued."""
        self._wake.release()

    def _take(self) -> Job | None:
        with self._lock:
            if self._running or not self._pending:
                return None
            self._running = True
            return self._pending.popleft()

    def _run_pending(self, until: Job | None = None) -> None:
        """Execute queued jobs in order while nobody else does (up to ``until`` if given)."""
        while True:
            job = self._take()
            if job is None:
                return
            try:
                self._execute(job)
            finally:
                with self._lock:
                    self._running = False
                    unmap = self._unmap_deferred
                if unmap:
                    self._unmap()
            if job is until:
                if self._pending:
                    self._wake.release()  # hand the rest to the worker
                return

    def _loop(self) -> None:
        while True:
            self._wake.acquire()
            self._run_pending()
            if self._closed:
                return

    def wait(self, job: Job, timeout_s: float | None = None) -> None:
        """Block until ``job`` completed (running it here if nobody started it); raise its error.

        Raises:
            RuntimeError: ``timeout_s`` passed first.
        """
        if not job.done and threading.current_thread() is not self._thread:
            self._run_pending(until=job)
        if not job.done:
            if not job.done_lock.acquire(timeout=timeout_s if timeout_s else -1):
                raise RuntimeError(f"fcoll {job.name}: Work.wait timed out after "
                                   f"{timeout_s:.1f} s")
            job.done_lock.release()
        if job.error is not None:
            raise job.error

    def _execute(self, job: Job) -> None:
        if self.broken is not None:
            job.complete(RuntimeError(
                f"fcoll {job.name}: the process group is unusable after an earlier error: "
                f"{self.broken}"))
            return
        # Spin long on the caller's thread (it waits anyway), briefly on the worker (the caller
        # is computing and needs the core).
        on_worker = threading.current_thread() is self._thread
        self.ch.spin_iters = self.ch.spin_async if on_worker else self.ch.spin_sync
        self.ch.seq = job.seq
        self.ch.transfer_s = 0.0  # the algorithms that move large phases set it
        times = self.times
        t0 = time.perf_counter_ns() if times is not None else 0
        call = Call(self.ch, job.name, f"{job.name} (collective #{job.seq})", time.monotonic(),
                    job.payload)
        try:
            # Below autograd, as a C++ backend writes its buffers: the output may be an
            # inference tensor (made under torch.inference_mode), which autograd forbids
            # updating from a thread outside that mode, the worker's (the op's own call
            # already bumped the version counters of what it mutates).
            with torch._C._AutoDispatchBelowADInplaceOrView():
                if on_worker:
                    job.run(call)
                else:  # the caller waits for it: its kernels get the collective's threads
                    with self._fewer_threads:
                        job.run(call)
                if job.finish is not None:
                    job.finish()
        except BaseException as e:  # noqa: BLE001  carried to wait()
            job.complete(self._failed(job.name, e, job.seq))
            return
        if times is not None:
            times[job.seq % TIMES_KEPT] = (job.seq, t0, time.perf_counter_ns(), on_worker)
        self.completed = job.seq + 1
        job.complete(None)

    def keep_times(self) -> None:
        """From now on, keep when this rank executed each collective (:meth:`executed`): two
        clock reads per collective more. The executor's tracer asks for it."""
        if self.times is None:
            self.times = [None] * TIMES_KEPT

    def executed(self, seq: int) -> tuple[float, float, bool] | None:
        """When and where this rank executed collective ``seq``: ``(start_us, end_us,
        on_worker)``, times on the host's monotonic clock (``time.perf_counter_ns``, the
        tracer's), from the moment its thread began the algorithm (header written, data copied
        in) to the moment it completed on this rank (outputs written back); ``on_worker``: the
        group's worker thread ran it (short spins, then sleeps: the caller computes meanwhile),
        not the calling or waiting thread (long spins). A rank that waits for a late peer
        inside it counts that wait too. None: not kept (:meth:`keep_times` not called, failed,
        not yet completed, or older than the last :data:`TIMES_KEPT`)."""
        times = self.times
        rec = times[seq % TIMES_KEPT] if times is not None else None
        if rec is None or rec[0] != seq:
            return None
        return rec[1] / 1e3, rec[2] / 1e3, rec[3]

    def _failed(self, name: str, e: BaseException, seq: int) -> BaseException:
        """The failure policy of every executed collective (``name``, number ``seq``);
        returns ``e``.

        A header mismatch or invalid input (:class:`CollectiveMismatchError`) is raised by
        every rank at the same phase, so the group stays usable. Anything else (a dead peer, a
        timeout, a peer that gave up, an unexpected error) leaves the ranks at different
        phases: the group is marked broken, and collective ``seq`` is fenced in shared memory
        (:meth:`~fcoll.shm.transport.fences.Fences.give_up`), so a peer waiting for it, or
        arriving at it later, raises naming this rank instead of computing a result from data
        this rank abandoned.
        Unexpected errors are logged with their traceback. After :meth:`abort` the error of a
        collective that was pending says so (the abort's fence is already there).
        """
        if isinstance(e, CollectiveMismatchError):
            self.completed = seq + 1  # every rank raised it at this phase: none waits in it
            return e
        if self._aborted:
            err = RuntimeError(f"fcoll {name} (collective #{seq}): {self._aborted} while this "
                               "collective was pending on it; the group was fenced on every "
                               "rank: create it again")
            err.__cause__ = e
            return err
        if not isinstance(e, PeerError):
            log.exception("fcoll %s failed", name)
        self.broken = e
        if isinstance(e, PeerError):
            self.ch.fences.give_up(seq, name, e.reason, e.peer, e.origin, e.culprit, e.note)
        else:
            self.ch.fences.give_up(seq, name, GAVE_UP_ERROR, note=exception_note(e))
        return e

    def abandon(self, e: BaseException, where: str) -> bool:
        """An exception ``e`` left ``where`` (a compiled step) on this rank while it held
        collectives of this group: break the group and fence the first collective this rank
        has not completed, so the peers waiting in it, or arriving at it later, raise at once
        naming this rank and ``e``'s type instead of waiting for the group timeout; returns
        whether it fenced.

        Not for a mismatch or an invalid argument
        (:class:`~fcoll.shm.headers.CollectiveMismatchError`: raised by every rank at the same
        phase, the group stays usable); a group broken already (by a :class:`PeerError` of its
        own, say) stays as it is, while a :class:`PeerError` of another group of the step
        fences this one too.
        """
        if isinstance(e, CollectiveMismatchError) or self.broken is not None:
            return False
        note = exception_note(e)
        self.broken = RuntimeError(
            f"rank {self.ch.rank} raised {note} in {where} while it held collectives of this "
            "group; the group was fenced on every rank: create it again")
        self.ch.fences.give_up(self.completed, "", GAVE_UP_RAISED, note=note)
        log.warning("fcoll: %s raised %s on rank %d; its group is fenced", where, note,
                    self.ch.rank)
        return True

    def abort(self, note: str = "") -> None:
        """This rank gives up the group (c10d's ``ProcessGroup.abort``; the process group
        calls it, then :meth:`close`): fence the first collective this rank has not
        completed, so the peers waiting in it, or arriving at it or any later one, raise at
        once naming this rank and "aborted its process group" (and ``note``); make this rank's
        own waits give up at their next tick (``Channel.closing``), pending collectives fail
        with an error saying the group was aborted, and every later call refuse, saying to
        create the group again. A second call, or one after :meth:`close`, does nothing.

        Args:
            note: this rank's words for the peers, such as the exception that made it abort
                (:func:`exception_note`), or "".
        """
        if self._closed or self._aborted:
            return
        rank = self.ch.rank
        if self.broken is not None:  # gave up already (and fenced): that error says why
            self._aborted = f"rank {rank} aborted the process group"
            self._closed_why = f"{self._aborted} after an earlier error: {self.broken}"
            note = ""
        else:
            said = f" ({note})" if note else ""
            self._aborted = f"rank {rank} aborted the process group{said}"
            self._closed_why = f"{self._aborted}; it refuses every collective: create it again"
            self.broken = RuntimeError(self._closed_why)
        # first, so that the peers raise however long this rank's own threads take to stop
        self.ch.fences.give_up(self.completed, "", GAVE_UP_ABORTED, note=note)
        self.ch.closing = True
        log.warning("fcoll: %s", self._aborted)

    def peers_ahead(self) -> list[int]:
        """Group ranks blocked in a collective this rank has not issued: they arrived at a
        phase past this rank's while every collective this rank issued has completed
        (nothing queued or running). A peer cannot pass a phase without this rank, so such
        a peer waits for this rank until the group timeout unless this rank issues it."""
        with self._lock:
            if self._running or self._pending or self._closed or self.completed != self.seq:
                return []
        return self.ch.peers_past()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the worker after the queued jobs (bounded by ``timeout_s``), then refuse every
        collective and unmap; a collective still running then (its waits give up at their
        next tick: the group is closing) unmaps when it ends, on its thread. Jobs still queued
        fail without touching the mapping."""
        if self._closed:
            return
        self._closed = True
        self.ch.closing = True
        self._wake.release()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        with self._lock:
            if self.broken is None:  # nothing may run on the mapping from now on
                self.broken = RuntimeError(self._closed_why)
            self._unmap_deferred = self._running
        if not self._unmap_deferred:
            self._unmap()

    def _unmap(self) -> None:
        """Fence and unmap, once, with no collective running (:meth:`close`)."""
        self._unmap_deferred = False
        if self.seg.data is None:
            return
        # a peer still to call a collective that this rank never will (the first one it has
        # not completed) raises at once, naming this rank, instead of waiting for the timeout;
        # after a failure or an abort the first fence stays
        self.ch.fences.give_up(self.completed, "", GAVE_UP_DESTROYED)
        self.seg.close()


@atexit.register
def _close_all() -> None:
    for eng in list(_engines):
        eng.broken = eng.broken or RuntimeError("interpreter exiting")
        eng.close(timeout_s=1.0)
