"""Every collective is fenced by its sequence number (issue #15, deliverable 1).

A rank that gives up a collective (timeout, a dead peer, an unexpected error, a destroyed
group) marks that collective dead in its control record. A peer that waits for it, or arrives
at it later, raises ``PeerError`` naming the rank, the op, the collective's number and why,
before it reads any data of that phase: no result is ever computed from abandoned data. The
group is then broken on every rank: every later call raises at once.

Scenarios (2 ranks, one ``run_ranks`` call, each on its own ``new_group``):

- late peer, fast path: rank 1 times out on a 4 KiB all_reduce (its own short timeout),
  rank 0 arrives afterwards: rank 0 raises naming rank 1, its tensor is untouched.
- late peer, general path: the same with a 3 MiB asynchronous all_reduce (3 chunks of 1 MiB).
- a group destroyed while a peer waits in a collective: the peer raises naming it, long
  before the group timeout (a hang is caught by the hard timeout of ``run_ranks``).
- a compiled step: rank 1 times out inside the compiled step's collective; rank 0's step
  raises; neither returns a result.

Rank 1's short timeout is set on its channel only (``ch.timeout_s``), so rank 0 keeps the
group's long one: it could not have timed out on its own.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from fcoll.testing import fcoll_segments, run_ranks

GROUP_TIMEOUT_S = 60.0  # no scenario may wait for this: the run's hard timeout is shorter
SHORT_TIMEOUT_S = 0.3  # rank 1's own timeout in the late-peer scenarios
RUN_TIMEOUT_S = 50.0


def _fcoll_pg(group):
    """The FcollProcessGroup of ``group`` (c10d returns the Python process group itself)."""
    return group if hasattr(group, "_engine") else group._get_backend(torch.device("cpu"))


def _late_peer(rank: int, store, key: str, t: torch.Tensor, call) -> dict:
    """Rank 1 times out in ``call(t)``; rank 0 calls it once rank 1 has given up."""
    from fcoll.shm.transport.fences import PeerError

    group = dist.new_group(backend="fcoll", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    pg = _fcoll_pg(group)
    call(t.clone(), group)  # one good collective first: the fence is on the next one
    before = t.clone()
    out = {}
    if rank == 1:
        pg._engine.ch.timeout_s = SHORT_TIMEOUT_S
        with pytest.raises(PeerError, match="timed out") as ei:
            call(t, group)
        store.set(key, "1")
    else:
        store.wait([key], datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        with pytest.raises(PeerError) as ei:
            call(t, group)
    out["error"] = str(ei.value)
    out["untouched"] = torch.equal(t, before)
    with pytest.raises(RuntimeError, match="unusable") as later:
        call(t, group)
    out["later"] = str(later.value)
    dist.destroy_process_group(group)
    return out


def _sync_all_reduce(t, group):
    dist.all_reduce(t, group=group)


def _async_all_reduce(t, group):
    dist.all_reduce(t, group=group, async_op=True).wait()


def _destroyed_while_waiting(rank: int, store) -> str | None:
    from fcoll.shm.transport.fences import PeerError

    group = dist.new_group(backend="fcoll", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    dist.all_reduce(torch.ones(4), group=group)
    if rank == 1:
        store.wait(["waiting"], datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        dist.destroy_process_group(group)
        return None
    store.set("waiting", "1")  # rank 0 is about to wait for rank 1, which never comes
    with pytest.raises(PeerError) as ei:
        dist.all_reduce(torch.ones(4), group=group)
    dist.destroy_process_group(group)
    return str(ei.value)


def _compiled_step(rank: int, store) -> str:
    from fcoll.shm.transport.fences import PeerError

    group = dist.new_group(backend="fcoll", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))

    def step(x):
        y = torch.ops.fcoll.all_reduce(x * 2, "sum", group.group_name)
        return torch.ops.fcoll.wait_tensor(y) + 1

    compiled = torch.compile(step, backend="fcoll", fullgraph=True)
    x = torch.ones(256)
    torch.testing.assert_close(compiled(x), torch.full((256,), 5.0))  # compiled, warmed up
    if rank == 1:
        _fcoll_pg(group)._engine.ch.timeout_s = SHORT_TIMEOUT_S
        with pytest.raises(PeerError, match="timed out") as ei:
            compiled(x)
        store.set("compiled_gave_up", "1")
    else:
        store.wait(["compiled_gave_up"], datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        with pytest.raises(PeerError) as ei:
            compiled(x)
    dist.destroy_process_group(group)
    return str(ei.value)


def _scenarios(rank: int, world: int) -> dict:
    store = dist.distributed_c10d._get_default_store()
    return {
        "fast": _late_peer(rank, store, "fast_gave_up", torch.arange(1024.0), _sync_all_reduce),
        "general": _late_peer(rank, store, "general_gave_up",
                              torch.arange(3 * 2 ** 18, dtype=torch.float32), _async_all_reduce),
        "destroyed": _destroyed_while_waiting(rank, store),
        "compiled": _compiled_step(rank, store),
    }


@pytest.fixture(scope="module")
def scenario_results():
    return run_ranks(_scenarios, 2, timeout_s=RUN_TIMEOUT_S, pg_timeout_s=GROUP_TIMEOUT_S)


@pytest.mark.parametrize("path", ["fast", "general"])
def test_late_peer_after_a_timeout_raises_naming_the_rank_that_gave_up(scenario_results, path):
    r0, r1 = scenario_results[0][path], scenario_results[1][path]
    assert "timed out after 0.3 s on rank 1" in r1["error"]
    assert "rank 1 gave up all_reduce (collective #" in r0["error"], r0["error"]
    assert "because it timed out waiting for rank 0 (this rank)" in r0["error"]
    assert "computed no result" in r0["error"]
    # no rank wrote a result built from the other's abandoned data
    assert r0["untouched"] and r1["untouched"]
    for r in (r0, r1):
        assert "unusable after an earlier error" in r["later"]


def test_destroying_a_group_makes_a_waiting_peer_raise_naming_it(scenario_results):
    msg = scenario_results[0]["destroyed"]
    assert "rank 1 gave up" in msg and "process group was destroyed" in msg, msg


def test_a_timeout_inside_a_compiled_step_fences_the_peers_step(scenario_results):
    assert "timed out" in scenario_results[1]["compiled"]
    assert "rank 1 gave up all_reduce" in scenario_results[0]["compiled"]


def test_fencing_leaves_no_segment(scenario_results):
    assert fcoll_segments() == []
