"""The executor's direct path (fcoll.compile.direct_calls, fcoll.shm.group.direct) on 2 real ranks.

Every check compares the direct path with the c10d path (``direct_collectives=False``) and with
eager calls, bit for bit; and checks which nodes took the direct path (structure, not timing).
"""

from __future__ import annotations

import pytest
import torch

from fcoll.testing import fcoll_segments, run_ranks

pytestmark = pytest.mark.timeout(300)


def _compiled(fn, direct: bool):
    import torch._dynamo

    return torch.compile(fn, backend="fcoll", dynamic=False,
                         options={"direct_collectives": direct, "overlap": False})


def _direct_counts() -> list[int]:
    """Per executor built from now on: how many collective nodes it runs on the direct path."""
    import fcoll.compile.backend as fb
    from fcoll.compile.direct_calls import DIRECT_OPS

    counts: list[int] = []
    real = fb.compile_graph

    def capture(gm, example_inputs, config, name):
        executor = real(gm, example_inputs, config, name)
        counts.append(sum(1 for n in executor.direct if n.target in DIRECT_OPS))
        return executor
    fb.compile_graph = capture
    return counts


def _results(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import fcoll

    group = dist.group.WORLD
    counts = _direct_counts()
    out: dict = {}

    def sync_step(x):  # wait right after the collective
        return fcoll.all_reduce(x * 2, "sum", group) + 1

    def async_step(x, w):  # compute between the collective and its wait
        y = fcoll.all_reduce(x, "avg", group)
        z = torch.mm(w, w)
        return y * 3, z

    def int_step(x):
        return fcoll.all_reduce(x, "avg", group), fcoll.all_reduce(x > 2, "sum", group)

    def big_step(x):  # larger than one slot: the general algorithm, several chunks
        return fcoll.all_reduce(x, "max", group)

    def shard_step(x, xi):  # all_gather (sync), reduce_scatter float avg and int avg (async)
        full = fcoll.all_gather_tensor(x, 0, group) * 2
        part = fcoll.reduce_scatter_tensor(x.repeat(2, 1), "avg", 0, group)
        ipart = fcoll.reduce_scatter_tensor(xi.repeat(2, 1), "avg", 0, group)
        return full, part + 1, ipart

    x = torch.arange(1024, dtype=torch.float32) * (rank + 1) / 7
    xs = torch.arange(24, dtype=torch.float32).view(6, 4) * (rank + 1) / 3
    w = torch.randn(32, 32)
    xi = torch.arange(12, dtype=torch.int64).view(3, 4) * (rank + 2)
    xb = torch.randn(3 << 20) + rank
    for direct in (True, False):
        runs = []
        for _ in range(3):  # the first run, then the steady state
            counts.clear()
            runs.append((_compiled(sync_step, direct)(x),
                         _compiled(async_step, direct)(x, w),
                         _compiled(int_step, direct)(xi),
                         _compiled(big_step, direct)(xb),
                         _compiled(shard_step, direct)(xs, xi)))
            torch._dynamo.reset()
        out[direct] = runs
        out[("counts", direct)] = list(counts)
    eager = (sync_step(x), async_step(x, w), int_step(xi), big_step(xb), shard_step(xs, xi))
    out["eager"] = [fcoll.wait_tensor(t) for t in _flat(eager)]  # AsyncCollectiveTensors
    return out


def _flat(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for o in obj for t in _flat(o)]


def test_direct_path_results_equal_c10d_path_and_eager_bit_for_bit():
    res = run_ranks(_results, 2, timeout_s=240)
    for rank, r in enumerate(res):
        eager = _flat(r["eager"])
        for direct in (True, False):
            for run in r[direct]:
                got = _flat(run)
                assert len(got) == len(eager)
                for a, b in zip(got, eager):
                    torch.testing.assert_close(a, b, rtol=0, atol=0)
        # every collective took the direct path with direct_collectives on (one per graph,
        # 2 all_reduces in int_step's, all_gather + 2 reduce_scatters in shard_step's) and
        # none with it off
        assert r[("counts", True)] == [1, 1, 2, 1, 3], r[("counts", True)]
        assert r[("counts", False)] == [0] * 5
    assert _flat(res[0]["eager"])[0].equal(_flat(res[1]["eager"])[0])
    assert fcoll_segments() == []


def _mismatch(rank: int, world_size: int) -> list[str]:
    """Ranks run different compiled call sites of one shape at one sequence number."""
    import torch.distributed as dist

    import fcoll

    group = dist.group.WORLD

    def f(x):
        return fcoll.all_reduce(x, "sum", group)

    def g(x):
        return fcoll.all_reduce(fcoll.all_reduce(x, "sum", group) + 1, "sum", group)

    cf, cg = _compiled(f, True), _compiled(g, True)
    x = torch.ones(8)
    cf(x), cg(x)  # both compiled, the rank check agreed on each
    errors = []
    try:
        if rank == 0:
            cf(x)   # rank 0 runs f's call ...
        else:
            cg(x)   # ... where rank 1 runs g's first call: same op, shape, dtype
    except Exception as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {e}")
    # the group is still usable: a mismatch leaves no rank behind
    errors.append(str(cf(x).tolist()))
    return errors


def test_different_call_sites_of_one_shape_raise_on_every_rank_and_the_group_survives():
    res = run_ranks(_mismatch, 2, timeout_s=240)
    for rank, errs in enumerate(res):
        assert len(errs) == 2, errs
        assert "CollectiveMismatchError" in errs[0] and "site " in errs[0], errs[0]
        assert errs[1] == str([2.0] * 8)
    assert fcoll_segments() == []


def _peer_dies(rank: int, world_size: int) -> str:
    """Rank 1 exits after the first compiled call; rank 0's next call must name it."""
    import os

    import torch.distributed as dist

    import fcoll

    step = _compiled(lambda x: fcoll.all_reduce(x, "sum", dist.group.WORLD) + 1, True)
    x = torch.ones(16)
    step(x)
    if rank == 1:
        os._exit(0)  # dies without a word: no destroy, no give-up
    try:
        step(x)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_dead_peer_is_named_by_the_survivor_on_the_direct_path():
    res = run_ranks(_peer_dies, 2, timeout_s=120, pg_timeout_s=60, allow_failures=True)
    assert "rank 1" in res[0] and "no error" not in res[0], res[0]
    assert fcoll_segments() == []


def _inductor(rank: int, world_size: int) -> list:
    """compute="inductor": segments between the collectives, the collective direct."""
    import torch.distributed as dist

    import fcoll

    counts = _direct_counts()
    group = dist.group.WORLD

    def step(x, w):
        y = fcoll.all_reduce(torch.relu(x) * 2, "sum", group)
        return y + torch.mm(w, w).sum()

    x, w = torch.randn(64) + rank, torch.randn(8, 8)
    outs = []
    for direct in (True, False):
        torch._dynamo.reset()
        outs.append(torch.compile(step, backend="fcoll", options={
            "compute": "inductor", "direct_collectives": direct})(x, w))
    return [outs, counts]


def test_inductor_executor_takes_the_direct_path_with_the_same_result():
    for outs, counts in run_ranks(_inductor, 2, timeout_s=400):
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        assert counts == [1, 0]
    assert fcoll_segments() == []
