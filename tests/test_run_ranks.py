"""``fcoll.testing.run_ranks``: what its ranks see at start-up, and how a failed rank ends the
run."""

from __future__ import annotations

import os
import threading
import time

import pytest

from fcoll.testing import RankFailure, run_ranks


def _start_environ(rank: int, world: int) -> str | None:
    # /proc/self/environ is the environment the interpreter started with, not os.environ now
    with open("/proc/self/environ", "rb") as f:
        start = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    value = start.get(b"FCOLL_RUN_RANKS_MARK")
    return value.decode() if value is not None else None


def test_env_is_in_place_when_each_rank_starts_and_not_left_in_the_parent():
    assert "FCOLL_RUN_RANKS_MARK" not in os.environ
    got = run_ranks(_start_environ, 2, backend=None, timeout_s=60,
                    env={"FCOLL_RUN_RANKS_MARK": "at-start"})
    assert got == ["at-start", "at-start"]
    assert "FCOLL_RUN_RANKS_MARK" not in os.environ


def _one_rank_fails_the_other_blocks(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 gives up")
    threading.Event().wait()        # a rank stuck for good (say, on the one that failed)


def test_a_failed_rank_stops_the_run_without_waiting_for_the_timeout():
    """A rank blocked on a failed peer is killed PEER_GRACE_S after the failure, and the
    failure names both, instead of the run waiting for timeout_s (here 120 s)."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        run_ranks(_one_rank_fails_the_other_blocks, 2, backend=None, timeout_s=120)
    assert time.monotonic() - start < 60
    assert "rank 1 gives up" in str(err.value)
    assert "after rank 1 failed; killed" in str(err.value)
