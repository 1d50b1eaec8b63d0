"""The queue of fcoll.shm.multihost.hierarchical's groups (``OrderedRunner``): jobs run one at a time,
in submission order, whether the worker thread or a waiting thread runs them. One process,
no collectives; the hierarchical groups themselves are tested in tests/test_hierarchical.py."""

from __future__ import annotations

import concurrent.futures as cf
import random
import threading

import pytest

from fcoll.shm.multihost.ordered_queue import HierarchicalWork, OrderedRunner


def test_jobs_run_in_submission_order_and_one_at_a_time_whoever_waits():
    runner = OrderedRunner("test-runner")
    ran: list[int] = []
    running = threading.Semaphore(1)

    def job(i: int):
        assert running.acquire(blocking=False), "two jobs ran at once"
        ran.append(i)
        running.release()
        return i

    works = [HierarchicalWork([runner.submit(lambda i=i: job(i))], runner) for i in range(300)]
    rng = random.Random(0)
    waiters = [threading.Thread(target=lambda ws=ws: [w.wait() for w in ws])
               for ws in (rng.sample(works, 100), rng.sample(works, 100))]
    for t in waiters:
        t.start()
    for w in works[::-1]:                 # the last first: runs the queue up to it here
        w.wait()
    for t in waiters:
        t.join(timeout=30)
    assert ran == list(range(300))
    assert [w.result() for w in works] == list(range(300))
    runner.shutdown()


def test_a_jobs_error_is_raised_by_its_wait_and_later_jobs_still_run():
    runner = OrderedRunner("test-runner")

    def boom():
        raise ValueError("fcoll all_reduce: rank 0: bad argument")

    bad = HierarchicalWork([runner.submit(boom)], runner)
    good = HierarchicalWork([runner.submit(lambda: [1])], runner)
    with pytest.raises(ValueError, match="bad argument"):
        bad.wait()
    assert good.result() == [1]
    runner.shutdown()


def test_abort_cancels_queued_jobs_and_refuses_new_ones():
    runner = OrderedRunner("test-runner")
    release = threading.Event()
    started = threading.Event()

    def blocker():
        started.set()
        assert release.wait(timeout=30)

    runner.submit(blocker)                # the worker runs it (nobody waits for it)
    assert started.wait(timeout=30)
    queued = runner.submit(lambda: "never")
    runner.shutdown(cancel=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        runner.submit(lambda: None)
    release.set()


def test_shutdown_runs_what_was_queued():
    runner = OrderedRunner("test-runner")
    futs = [runner.submit(lambda i=i: i) for i in range(20)]
    runner.shutdown()
    assert [f.result(timeout=0) for f in futs] == list(range(20))
    assert all(isinstance(f, cf.Future) for f in futs)


def test_a_done_callback_may_wait_for_a_later_op():
    """A future's done-callback runs off the thread that ran the op (the worker, under the run
    lock); if it waits for a later op of the same group, that op runs instead of
    deadlocking."""
    _callback_waits_for_a_later_op(lambda later: later.result())


def test_a_done_callback_may_block_on_a_later_ops_future():
    """As above, but the callback blocks on the later op's torch future (``Future.wait``
    runs no queued op, as PowerSGD's DDP hook waits): the worker that completed the first op
    used to run the callback itself, and then never ran the later op."""
    _callback_waits_for_a_later_op(lambda later: later.get_future().wait())


def _callback_waits_for_a_later_op(wait_for):
    """Two ops queued behind one that holds the worker; the first op's future gets a callback
    that returns ``wait_for(later op's Work)``, which must give the later op's result."""
    runner = OrderedRunner("test-runner")
    release = threading.Event()
    runner.submit(lambda: release.wait(timeout=30))   # holds the worker until callbacks are set
    first = HierarchicalWork([runner.submit(lambda: "first")], runner)
    later = HierarchicalWork([runner.submit(lambda: "later")], runner)
    seen: list[str] = []
    done = threading.Event()
    first.get_future().then(lambda _: (seen.append(wait_for(later)), done.set()))
    release.set()
    assert done.wait(timeout=30), "the callback's wait deadlocked"
    assert seen == ["later"]
    runner.shutdown()
