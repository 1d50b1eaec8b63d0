"""Fail fast and truthfully (issue #31).

- A collective that completed on every rank never raises, whatever a peer does right after it
  (destroy its group, exit): the fence check compares sequence numbers before anything else and
  checks no liveness once every peer arrived. Jobs of ``benchmarks/fail_fast.py``: the last rank
  is SIGSTOPped (0.5 s) inside the job's last all_reduce while the others complete it, destroy
  their group and exit; and the same without a signal. The issue's 50 runs of each are
  ``python benchmarks/fail_fast.py --scenario stopped --runs 50`` (and ``--scenario exit``).
- The culprit of a cascade is carried in every fence: with rank 3 of 4 stopped, every survivor
  names rank 3, whichever rank's fence it read.

Each job has a hard timeout (``fail_fast.JOB_TIMEOUT_S``) and its ranks are killed after it.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import fail_fast  # noqa: E402

from fcoll.testing import fcoll_segments, run_ranks  # noqa: E402


@pytest.mark.parametrize("world,runs", [(2, 3), (4, 2)])
def test_a_completed_collective_never_raises_when_a_stopped_rank_resumes_after_peers_exited(
        world, runs):
    res = fail_fast.run("stopped", runs, world)
    assert res["false_failures"] == 0, res["messages"]
    assert res["ok"] == runs and res["hung"] == 0 and res["wrong"] == 0, res


def test_a_completed_collective_never_raises_when_peers_exit_right_after_it():
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
