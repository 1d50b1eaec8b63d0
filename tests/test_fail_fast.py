"""Fail fast and truthfully (issue #31).

- A collective that completed on every rank never raises, whatever a peer does right after it
  (destroy its group, exit): the fence check compares sequence numbers before anything else and
  checks no liveness once every peer arrived. Jobs of ``benchmarks/fail_fast.py``: the last rank
  is SIGSTOPped (0.5 s) inside the job's last all_reduce while the others complete it, destroy
  their group and exit; and the same without a signal. The issue's 50 runs of each are
  ``python benchmarks/fail_fast.py --scenario stopped --runs 50`` (and ``--scenario exit``).
- The culprit of a cascade is carried in every fence: with rank 3 of 4 stopped, every survivor
  names rank 3, whichever rank's fence it read.
- A rank that aborts its group (c10d's ``ProcessGroup.abort``, in its ``except`` block or through
  ``fcoll.fence_on_error``) after raising between two compiled graphs makes its peers raise at
  once, naming it and the exception; its own pending work fails saying the group was aborted.

The ``loaded`` variants run beside 2 busy processes (``collectives.BackgroundLoad``, started and
ended by the ``background_load`` fixture). Each job has a hard timeout
(``fail_fast.JOB_TIMEOUT_S``, ``run_ranks(timeout_s=...)``) and its ranks are killed after it.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import fail_fast  # noqa: E402
from collectives import BackgroundLoad  # noqa: E402

from fcoll.testing import fcoll_segments, run_ranks  # noqa: E402

# a group refusing collectives says to create it again ("create it again", "created again")
RECREATE = re.compile(r"creat(e|ed) (it )?again")


@pytest.fixture(params=["quiet", "loaded"])
def background_load(request):
    """Nothing ("quiet"), or 2 busy processes for the test's duration ("loaded": one core
    each; they also end by themselves after 10 minutes, or if this process dies)."""
    if request.param == "quiet":
        yield 0
        return
    with BackgroundLoad(2, max_s=600.0, settle_s=0.0):
        yield 2


@pytest.mark.parametrize("world,runs", [(2, 3), (4, 2)])
def test_a_completed_collective_never_raises_when_a_stopped_rank_resumes_after_peers_exited(
        world, runs, background_load):
    res = fail_fast.run("stopped", runs, world)
    assert res["false_failures"] == 0, res["messages"]
    assert res["ok"] == runs and res["hung"] == 0 and res["wrong"] == 0, res


def test_a_completed_collective_never_raises_when_peers_exit_right_after_it(background_load):
    res = fail_fast.run("exit", 8, 2)
    assert res["false_failures"] == 0, res["messages"]
    assert res["ok"] == 8 and res["hung"] == 0 and res["wrong"] == 0, res
    assert fcoll_segments() == []


def test_every_survivor_of_a_cascade_names_the_rank_that_started_it():
    """4 ranks, rank 3 stopped before the last all_reduce, a 2 s group timeout: ranks 0-2 give
    up one after another (a timeout, or another's fence); each message names rank 3."""
    res = fail_fast.run("cascade", 2, 4, timeout_s=2.0)
    assert res["not_named"] == [] and res["hung"] == 0, res
    assert res["ok"] == 2


# ---- an exception inside a compiled step fences its groups ------------------------------------
def _raise_in_compiled_step(rank: int, world: int) -> dict:
    """The step: all_reduce, an index with a tensor, all_reduce. Rank 1's index is out of range
    on the third call: an IndexError inside the compiled graph, between the two collectives,
    caught by the loop. The others wait in the second all_reduce, which rank 1 never issues."""
    import time

    import torch
    import torch.distributed as dist

    from fcoll.shm.transport.fences import PeerError

    group = dist.new_group(backend="fcoll")
    name = group.group_name

    def step(x, idx):
        y = torch.ops.fcoll.wait_tensor(torch.ops.fcoll.all_reduce(x, "sum", name))
        z = y[idx] * 2
        return torch.ops.fcoll.wait_tensor(torch.ops.fcoll.all_reduce(z, "sum", name))

    compiled = torch.compile(step, backend="fcoll", fullgraph=True)
    x = torch.ones(8)
    out: dict = {}
    for i in range(3):
        bad = i == 2 and rank == 1
        idx = torch.tensor([0, 99 if bad else 1])
        try:
            r = compiled(x, idx)
            out[i] = r.tolist()
        except Exception as e:  # noqa: BLE001  the user's loop catches
            out[i] = (type(e).__name__, str(e), time.monotonic())
    try:  # the group is unusable on every rank now, and says so
        compiled(x, torch.tensor([0, 1]))
        out["after"] = "no error"
    except RuntimeError as e:
        out["after"] = str(e)
    out["peer_error"] = isinstance(out[2], tuple) and out[2][0] == PeerError.__name__
    dist.destroy_process_group(group)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_an_exception_inside_a_compiled_step_fences_the_group_so_peers_raise_at_once(world):
    res = run_ranks(_raise_in_compiled_step, world, timeout_s=240, pg_timeout_s=60)
    for r in range(world):
        assert res[r][0] == res[r][1] == [2.0 * world * world] * 2, res[r]
    name, msg, raised_at = res[1][2]
    assert name == "IndexError", res[1]
    for r in [0] + list(range(2, world)):
        peer_name, peer_msg, peer_at = res[r][2]
        assert peer_name == "PeerError", peer_msg
        assert "rank 1" in peer_msg and "IndexError" in peer_msg, peer_msg
        assert 'rank 1 reported: "IndexError' in peer_msg, peer_msg
        # the group timeout is 60 s: a peer that raised this early was told by the fence
        # (the issue asks for 1 s; 5 s keeps the bound far from what load does to a wake-up)
        assert peer_at - raised_at < 5.0, (peer_at - raised_at, peer_msg)
    for r in range(world):
        assert "fenced" in res[r]["after"] or "no longer usable" in res[r]["after"] \
            or "unusable" in res[r]["after"], res[r]["after"]


# ---- a raise between two compiled graphs, then abort ------------------------------------------
def _raise_between_graphs(rank: int, world: int, modes: tuple) -> dict:
    """The step: all_reduce (graph 1), a data-dependent ``if flag.sum() > 0: raise`` (a graph
    break: the raise runs in Python, between the graphs), all_reduce (graph 2). On the third
    call rank 1's flag is set: it raises ValueError after graph 1, while the others wait in
    graph 2's all_reduce. Rank 1 then aborts the group, per mode:

    - ``fence_on_error``: the step runs inside ``with fcoll.fence_on_error(group)``;
    - ``except_abort``: the user's ``except`` block calls PyTorch's
      ``_abort_process_group(group)``.

    Each mode on a fresh group. Reports each call's result or ``(error type, message, time
    raised)``, rank 1's time of raising (before any abort) and the next call's error."""
    import time

    import torch
    import torch.distributed as dist

    import fcoll

    out: dict = {}
    for mode in modes:
        group = dist.new_group(backend="fcoll")
        name = group.group_name

        def step(x, flag):
            y = torch.ops.fcoll.wait_tensor(torch.ops.fcoll.all_reduce(x, "sum", name))
            if flag.sum() > 0:
                raise ValueError(f"bad batch on rank {rank}")
            return torch.ops.fcoll.wait_tensor(torch.ops.fcoll.all_reduce(y * 2, "sum", name))

        compiled = torch.compile(step, backend="fcoll")
        x = torch.ones(8)
        res: dict = {}

        def call(flag):
            try:
                return compiled(x, flag)
            except ValueError:
                res["raised_at"] = time.monotonic()  # the event: before any abort
                if mode == "except_abort":
                    dist.distributed_c10d._abort_process_group(group)
                raise

        for i in range(3):
            flag = torch.tensor([1.0 if i == 2 and rank == 1 else 0.0])
            try:
                if mode == "fence_on_error":
                    with fcoll.fence_on_error(group):
                        r = call(flag)
                else:
                    r = call(flag)
                res[i] = r.tolist()
            except Exception as e:  # noqa: BLE001  the user's loop catches
                res[i] = (type(e).__name__, str(e), time.monotonic())
        try:  # the group refuses collectives on every rank now, and says so
            compiled(x, torch.tensor([0.0]))
            res["after"] = "no error"
        except RuntimeError as e:
            res["after"] = str(e)
        if mode == "fence_on_error" or rank != 1:  # (_abort_process_group unregistered it)
            dist.destroy_process_group(group)
        out[mode] = res
    return out


def _check_raise_between_graphs(res: list, world: int, modes: tuple) -> None:
    for mode in modes:
        r1 = res[1][mode]
        assert r1[2][:2] == ("ValueError", "bad batch on rank 1"), (mode, r1)
        for r in range(world):
            got = res[r][mode]
            assert got[0] == got[1] == [2.0 * world * world] * 8, (mode, r, got)
            assert RECREATE.search(got["after"]), (mode, r, got["after"])
        assert "rank 1 aborted the process group (ValueError: bad batch" in r1["after"], r1
        for r in [0] + list(range(2, world)):
            kind, msg, raised_at = res[r][mode][2]
            assert kind == "PeerError", (mode, r, msg)
            assert "rank 1" in msg and "aborted its process group" in msg, (mode, r, msg)
            assert 'rank 1 reported: "ValueError: bad batch on rank 1"' in msg, (mode, r, msg)
            # from rank 1's raise to this rank's (the group timeout is 60 s): a wake-up and an
            # abort's few stores; measured 0.2-0.8 ms at load 12
            assert raised_at - r1["raised_at"] < 1.0, (mode, r, raised_at - r1["raised_at"])


def test_a_raise_between_compiled_graphs_then_abort_makes_peers_raise_at_once_naming_it(
        background_load):
    modes = ("fence_on_error", "except_abort")
    res = run_ranks(_raise_between_graphs, 2, args=(modes,), timeout_s=240, pg_timeout_s=60)
    _check_raise_between_graphs(res, 2, modes)
    assert fcoll_segments() == []


def test_every_peer_of_4_ranks_names_the_rank_that_aborted_after_a_raise_between_graphs():
    """Ranks 0, 2 and 3 all wait in graph 2's all_reduce; each raises on rank 1's fence, or on
    the fence of a rank that gave up because of it (the culprit carried), naming rank 1."""
    modes = ("fence_on_error",)
    res = run_ranks(_raise_between_graphs, 4, args=(modes,), timeout_s=240, pg_timeout_s=60)
    _check_raise_between_graphs(res, 4, modes)


def test_fence_on_error_aborts_on_an_exception_but_not_a_mismatch_and_never_swallows_it():
    """``__exit__`` calls each group's ``abort()`` while the exception is being handled (what
    fcoll's abort quotes to the peers), as a ``with`` block and as a decorator; a cross-rank
    mismatch (raised by every rank alike) aborts nothing; an ``abort()`` that fails leaves the
    block's exception to propagate."""
    from fcoll import fence_on_error
    from fcoll.shm.transport.headers import CollectiveMismatchError

    class Group:
        def __init__(self):
            self.handling = []

        def abort(self):
            self.handling.append(sys.exc_info()[1])

    class Failing:
        def abort(self):
            raise RuntimeError("abort failed")

    g = Group()
    with fence_on_error(g):
        pass
    with pytest.raises(CollectiveMismatchError):
        with fence_on_error(g):
            raise CollectiveMismatchError("fcoll all_reduce: rank 1 has input shape [3]")
    assert g.handling == []
    err = KeyError("k")
    with pytest.raises(KeyError):
        with fence_on_error(g):
            raise err
    assert g.handling == [err]

    @fence_on_error(Failing(), g)
    def step():
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        step()
    assert [type(e) for e in g.handling] == [KeyError, ValueError]


# ---- abort: this rank's own pending work -----------------------------------------------------
def _abort_with_pending_work(rank: int, world: int) -> dict:
    """Rank 1 issues collectives that rank 0 never joins (rank 0 waits on the store) and aborts:

    - ``async``: an un-waited ``all_reduce(async_op=True)`` running on the group's worker and a
      second one queued behind it; ``abort()`` from the main thread once the first runs;
    - ``sync``: a synchronous ``all_reduce`` blocked on the main thread while another thread
      aborts, with ``ABORT_TIMEOUT_S`` 0: the abort cannot wait for the collective, which then
      releases the segment itself when it ends.

    After each, rank 0 calls the collective: it raises at once on rank 1's fence."""
    import datetime
    import threading
    import time

    import torch
    import torch.distributed as dist

    from fcoll.shm.group import process_group

    store = dist.distributed_c10d._get_default_store()
    out: dict = {}
    for case in ("async", "sync"):
        group = dist.new_group(backend="fcoll")
        eng = group.engine
        if rank == 0:
            store.wait([f"aborted-{case}"], datetime.timedelta(seconds=60))
            t0 = time.monotonic()
            try:
                dist.all_reduce(torch.ones(4), group=group)
                out[case] = ("no error", "", 0.0)
            except RuntimeError as e:
                out[case] = (type(e).__name__, str(e), time.monotonic() - t0)
            dist.destroy_process_group(group)
            continue
        errors = []
        if case == "async":
            works = [dist.all_reduce(torch.ones(4), group=group, async_op=True)
                     for _ in range(2)]
            while not eng._running:  # the worker runs the first one (and waits for rank 0)
                time.sleep(0.001)
            group.abort()
            for w in works:
                try:
                    w.wait()
                    errors.append("no error")
                except RuntimeError as e:
                    errors.append(str(e))
            eng._thread.join(timeout=30)
            unmapped = eng.seg.data is None
        else:
            process_group.ABORT_TIMEOUT_S = 0.0

            def abort_once_blocked():
                while not eng._running:  # the main thread's all_reduce claimed the executor
                    time.sleep(0.001)
                group.abort()

            aborter = threading.Thread(target=abort_once_blocked)
            aborter.start()
            try:
                dist.all_reduce(torch.ones(4), group=group)
                errors.append("no error")
            except RuntimeError as e:
                errors.append(str(e))
            unmapped = eng.seg.data is None  # by this thread, as its collective ended
            aborter.join()
        store.set(f"aborted-{case}", "1")
        try:
            dist.all_reduce(torch.ones(4), group=group)
            after = "no error"
        except RuntimeError as e:
            after = str(e)
        eng._thread.join(timeout=30)
        out[case] = (errors, unmapped, eng._thread.is_alive(), after)
        dist.destroy_process_group(group)  # after abort: nothing left to do
    return out


def test_abort_fails_this_ranks_pending_work_releases_everything_and_fences_the_peers():
    res = run_ranks(_abort_with_pending_work, 2, timeout_s=180, pg_timeout_s=60)
    for case, n in (("async", 2), ("sync", 1)):
        errors, unmapped, worker_alive, after = res[1][case]
        assert len(errors) == n, errors
        # the running one (and the queued one)
        assert "while this collective was pending" in errors[0], (case, errors)
        for e in errors:
            assert "rank 1 aborted the process group" in e, (case, e)
            assert RECREATE.search(e), (case, e)
        assert unmapped and not worker_alive, res[1][case]
        assert RECREATE.search(after) and "aborted" in after, after
        kind, msg, waited = res[0][case]
        assert kind == "PeerError" and "rank 1" in msg and "aborted its process group" in msg, msg
        # rank 0 entered after the fence: it raises in its first wait (the timeout is 60 s)
        assert waited < 10.0, (case, waited, msg)
    assert fcoll_segments() == []


# ---- a peer's files and words -----------------------------------------------------------------
_NO_CTTY_CHILD = r"""
import datetime, errno, os, sys
import torch.distributed as dist
from fcoll.shm.transport.segment import Layout, PAGE, open_segment, proc_start_time
assert os.getsid(0) == os.getpid()  # a new session: no controlling terminal yet
master, slave = os.openpty()
me = os.getpid()
store = dist.HashStore()
store.set("fcoll/segment", f"memfd {me} {proc_start_time(me)} {slave} {os.fstat(slave).st_ino}")
store.add("fcoll/attached", 1)
try:
    open_segment(store, 1, 2, PAGE, datetime.timedelta(seconds=5))
    print("attached")
except RuntimeError as e:
    print("refused:", e)
try:
    os.close(os.open("/dev/tty", os.O_RDWR))
    print("ctty: yes")
except OSError as e:
    print("ctty: no", errno.errorcode.get(e.errno))
"""


def test_a_forged_segment_record_naming_a_terminal_does_not_become_the_controlling_tty():
    """A session leader without a controlling terminal that opens a tty without O_NOCTTY
    acquires it; the attach opens the peer's fd link with O_NOCTTY, then refuses the file."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _NO_CTTY_CHILD], capture_output=True, text=True,
                         timeout=120, start_new_session=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert "refused:" in out.stdout and "not a regular file" in out.stdout or \
        "refusing" in out.stdout, out.stdout + out.stderr
    assert "ctty: no" in out.stdout, out.stdout + out.stderr


def test_a_peers_error_text_is_quoted_as_the_peers():
    """Rank 1's invalid-argument message reaches rank 0 as ``rank 1 reported: "..."`` (JSON
    escapes: a peer's control characters never reach the message); rank 1 raises its own words;
    a fence's note is quoted the same way."""
    from fcoll.shm.transport.header_checks import check
    from fcoll.shm.transport.headers import CollectiveMismatchError, Header

    def describe(p):
        return f"rank {p}"

    mine = Header(3, "all_reduce", "float32", (4,), "sum", -1, None, None).encode()
    theirs = Header(3, "all_reduce", "float32", (4,), "sum", -1, None,
                    "fcoll all_reduce: rank 1: bad \x1b[31mred\n\"x\"").encode()
    with pytest.raises(CollectiveMismatchError) as ei:
        check([mine, theirs], "all_reduce", describe, mine)
    assert str(ei.value) == (r'fcoll all_reduce: rank 1 reported: "rank 1: bad \u001b[31mred\n'
                             r'\"x\""')
    with pytest.raises(CollectiveMismatchError) as own:
        check([mine, theirs], "all_reduce", describe, theirs)
    assert str(own.value) == "fcoll all_reduce: rank 1: bad \x1b[31mred\n\"x\""


# ---- ranks that run a step differently --------------------------------------------------------
def _divergent_steps(rank: int, world: int) -> dict:
    """Two divergences on fresh groups, each once:

    - ``eager``: rank 0 runs the step compiled, rank 1 runs it eagerly;
    - ``no_collective``: rank 0's compiled step holds an all_reduce, rank 1's compiled step none
      (a branch on the rank), and rank 1 then calls an eager all_reduce.

    Rank 0 waits in the compile-time rank check for rank 1 to compile the same collectives;
    rank 1 waits in a collective for rank 0. Each rank reports its error and when it raised."""
    import time

    import torch
    import torch.distributed as dist

    out: dict = {}
    for case in ("eager", "no_collective"):
        group = dist.new_group(backend="fcoll")
        name = group.group_name

        def step(x):
            if case == "eager" or rank == 0:
                return torch.ops.fcoll.wait_tensor(torch.ops.fcoll.all_reduce(x, "sum", name))
            return x * 2

        x = torch.ones(8)
        t0 = time.monotonic()
        try:
            if rank == 0 or case == "no_collective":
                torch.compile(step, backend="fcoll", fullgraph=True)(x)
            if rank == 1:
                step(x) if case == "eager" else dist.all_reduce(x, group=group)
            out[case] = ("no error", "", t0, time.monotonic())
        except Exception as e:  # noqa: BLE001  reported
            out[case] = (type(e).__name__, str(e), t0, time.monotonic())
        dist.destroy_process_group(group)
    return out


def test_ranks_running_a_step_eagerly_or_without_its_collective_raise_on_both_ranks_at_once():
    """Before issue #31: RankTimeoutError after check_timeout_s (60 s) on rank 0, PeerError at
    the group timeout on rank 1. Now rank 0's check sees rank 1 waiting in a collective it has
    not issued, raises and fences the group; rank 1 raises on the fence."""
    res = run_ranks(_divergent_steps, 2, timeout_s=240, pg_timeout_s=60)
    for case in ("eager", "no_collective"):
        n0, m0, _, at0 = res[0][case]
        n1, m1, _, at1 = res[1][case]
        # (Dynamo wraps a compile-time error in BackendCompilerFailed)
        assert "RankMismatchError" in m0 and "wait in a collective of this group" in m0, m0
        assert n1 == "PeerError" and "rank 0 gave up" in m1 and "RankMismatchError" in m1, m1
        # both far from the 60 s timeouts; rank 1 raises on rank 0's fence, a wake-up later
        assert abs(at1 - at0) < 2.0, (case, at1 - at0)
