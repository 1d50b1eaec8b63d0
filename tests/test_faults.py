"""Faults on fcoll's shared-memory backend raise descriptive errors instead of hanging.

Every run has a hard timeout (``run_ranks(timeout_s=...)``), and after every run no ``fcoll-``
segment is left in /dev/shm, whatever happened to the ranks.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from fcoll.testing import RankFailure, fcoll_segments, run_ranks


def _killed_peer(rank, world):
    dist.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"fcoll all_reduce.*rank {world - 1} died") as ei:
        dist.all_reduce(torch.ones(1000))
    elapsed = time.monotonic() - t0
    # the group is unusable from now on, and says why
    with pytest.raises(RuntimeError, match="unusable after an earlier error"):
        dist.all_reduce(torch.ones(10))
    return elapsed, str(ei.value)


def test_killed_rank_makes_every_survivor_raise_naming_it_long_before_the_timeout():
    """Liveness ticks name a dead peer within about 0.1-0.3 s on a quiet machine; the bound is
    a third of the 30 s group timeout, which a survivor that missed the death would reach (a
    loaded machine delays a wake-up, not by 10 s)."""
    res = run_ranks(_killed_peer, 3, timeout_s=90, pg_timeout_s=30, allow_failures=True)
    assert isinstance(res[2], RankFailure)
    for elapsed, msg in res[:2]:
        assert elapsed < 10.0, (elapsed, msg)
        assert "rank 2 died" in msg
    assert fcoll_segments() == []


def _mismatches(rank, world):
    msgs = {}
    cases = {
        "shape": lambda: dist.all_reduce(torch.ones(4, 4 if rank == 0 else 3)),
        "dtype": lambda: dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0
                                                    else torch.int32)),
        "reduce_op": lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.SUM if rank == 0
                                             else dist.ReduceOp.MAX),
        "root": lambda: dist.broadcast(torch.ones(4), src=rank),
        "op": lambda: (dist.all_reduce(torch.ones(4)) if rank == 0
                       else dist.broadcast(torch.ones(4), src=0)),
        # one rank needs two 1 MiB chunks, the other one: the slot counters must stay in step
        "chunks": lambda: dist.all_gather_into_tensor(
            torch.empty(2 * (300_000 if rank == 0 else 100)),
            torch.ones(300_000 if rank == 0 else 100)),
        "splits": lambda: dist.all_to_all_single(torch.empty(4), torch.ones(4), [2, 2],
                                                 [2, 2] if rank == 0 else [1, 2]),
        "splits_across_ranks": lambda: dist.all_to_all_single(
            torch.empty(4), torch.ones(4), [3, 1] if rank == 0 else [2, 2], [2, 2]),
    }
    for name, call in cases.items():
        out = None
        with pytest.raises(ValueError) as ei:
            out = call()
        assert out is None
        msgs[name] = str(ei.value)
    # an async collective's error surfaces from Work.wait() and from its future
    w = dist.all_reduce(torch.ones(2, 2 + rank), async_op=True)
    with pytest.raises(ValueError, match="has input shape"):
        w.wait()
    with pytest.raises(ValueError, match="has input shape"):
        w.get_future().wait()
    t = torch.ones(3)
    dist.all_reduce(t)  # still usable: everyone raised at the same point
    assert t.tolist() == [2.0] * 3
    return msgs


def test_mismatched_calls_raise_the_same_error_on_every_rank_and_async_wait():
    r0, r1 = run_ranks(_mismatches, 2, timeout_s=60)
    assert r0["shape"] == r1["shape"] == (
        "fcoll all_reduce: rank 1 has input shape [4, 3] float32 but rank 0 has [4, 4] float32")
    assert r0["dtype"] == r1["dtype"] and "int32" in r0["dtype"]
    assert r0["reduce_op"] == r1["reduce_op"] and "reduce op max" in r0["reduce_op"]
    assert r0["root"] == r1["root"] and "root 1" in r0["root"]
    assert r0["op"] == r1["op"] and "called broadcast" in r0["op"]
    # the rank with the bad split list raised locally; its peer quotes it as rank 1's
    assert r1["splits"] == (
        "fcoll all_to_all_single: rank 1: input_split_sizes [1, 2] sum to 3 but input has 4 "
        "rows in dim 0")
    assert r0["splits"] == (
        'fcoll all_to_all_single: rank 1 reported: "rank 1: input_split_sizes [1, 2] sum to 3 '
        'but input has 4 rows in dim 0"')
    assert r0["splits_across_ranks"] == r1["splits_across_ranks"]
    assert "rank 0 expects 3 rows from rank 0 (output_split_sizes) but rank 0 sends 2" in r0[
        "splits_across_ranks"]
    assert fcoll_segments() == []


def _never_joins(rank, world):
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # alive, but never calls the collective
        store.wait(["released"], datetime.timedelta(seconds=30))
        return None
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"fcoll all_reduce .*timed out after 2\.0 s.*"
                                               r"ranks not yet arrived: rank 1"):
            dist.all_reduce(torch.ones(10))
        return time.monotonic() - t0
    finally:
        store.set("released", "1")


def test_rank_that_never_joins_times_out_at_the_group_timeout():
    elapsed, _ = run_ranks(_never_joins, 2, timeout_s=90, pg_timeout_s=2.0)
    # at the timeout, not before; the upper bound only says "not a multiple of it": a loaded
    # machine delays the waiter's last wake-up, by far less than 10 s
    assert 1.9 <= elapsed < 2.0 + 10.0
    assert fcoll_segments() == []
