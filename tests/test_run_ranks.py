"""``fcoll.testing.run_ranks``: what its ranks see at start-up."""

from __future__ import annotations

import os

from fcoll.testing import run_ranks


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
