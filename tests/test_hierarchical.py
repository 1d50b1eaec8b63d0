"""fcoll groups spanning emulated hosts (``FCOLL_HOST_ID`` per rank, no network namespace).

The checks of tests/test_backend.py (every op, dtype, reduce op, layout and form against gloo),
tests/test_sparse_all_reduce.py (sparse all_reduce and DDP's sparse gradients) and
tests/test_ops_multiprocess.py (fcoll's functional ops and their gradients against the
single-process reference) run unchanged on 4 ranks laid out as 2 hosts x 2 ranks, where
``init_process_group("fcoll")`` builds a :class:`fcoll.shm.multihost.hierarchical.HierarchicalProcessGroup`;
then on an interleaved layout (ranks 0, 2 on one host) and an uneven one (3 + 1: the flat gloo
fallback). Real network namespaces are in tests/test_multihost.py.
"""

from __future__ import annotations

import pytest
import test_backend as tb
import test_ops_multiprocess as tom
import test_sparse_all_reduce as tsp
import torch
import torch.distributed as dist

from fcoll.testing import fcoll_segments, run_ranks

TWO_BY_TWO = [0, 0, 1, 1]


def _describe_groups(rank, world):
    """Which class each group is: the world, a subgroup inside a host, one across hosts."""
    from fcoll.shm.multihost.hierarchical import HierarchicalProcessGroup
    from fcoll.shm.group.process_group import FcollProcessGroup

    within = dist.new_group([0, 1]), dist.new_group([2, 3])
    across = dist.new_group([0, 2]), dist.new_group([1, 3])
    kinds = {"world": type(dist.group.WORLD).__name__}
    kinds["within"] = type(within[rank // 2]).__name__
    kinds["across"] = type(across[rank % 2]).__name__
    assert isinstance(dist.group.WORLD, HierarchicalProcessGroup)
    assert isinstance(within[rank // 2], FcollProcessGroup)
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=across[rank % 2])
    assert t.tolist() == [float(2 * (rank % 2) + 2)] * 3
    return kinds


def _ddp_and_compiled(rank, world, gl):
    """DDP's reducer and a compiled step (backend='fcoll': funcol ops lowered to fcoll's) on a
    hierarchical group give gloo's results."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    ref.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp_gloo = torch.nn.parallel.DistributedDataParallel(ref, process_group=gl)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    ddp(x).sum().backward()
    ddp_gloo(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        tb._check([p.grad], [q.grad], "DDP gradient")

    import torch.distributed._functional_collectives as funcol

    def step(t):
        return funcol.all_reduce(t * 2, "sum", dist.group.WORLD) + 1

    compiled = torch.compile(step, backend="fcoll")
    y = torch.arange(6, dtype=torch.float32) + rank
    tb._check([compiled(y)], [step(y)], "compiled funcol all_reduce")


def _everything_2x2(rank, world):
    gl = dist.new_group(backend="gloo")
    for scenario in (tb._all_reduce_everything, tb._movement_everything,
                     tb._layouts_and_forms, tb._subgroups_and_mesh, _ddp_and_compiled,
                     tb._version_counters):
        scenario(rank, world, gl)
    return {"kinds": _describe_groups(rank, world), "ops": tom._worker(rank, world),
            "invalid": _invalid_calls(rank, world), "sparse": tsp.sparse_scenario(rank, world, gl)}


def test_every_op_dtype_and_form_matches_gloo_and_the_reference_on_2x2_hosts():
    results = run_ranks(_everything_2x2, 4, hosts=TWO_BY_TWO, timeout_s=300,
                        env={"FCOLL_SHM_SLOT_BYTES": str(64 << 10)})
    for rank, res in enumerate(results):
        assert res["kinds"] == {"world": "HierarchicalProcessGroup",
                                "within": "FcollProcessGroup",
                                "across": "HierarchicalProcessGroup"}
        errors, after = res["invalid"]
        assert "BAND" in errors["band"] and f"rank {rank}" in errors["band"]
        assert "all_gather_into_tensor" in errors["gather"] and "5 elements" in errors["gather"]
        assert "different arguments" in errors["hosts_differ"], errors
        assert "numel=6" in errors["hosts_differ"] and "numel=8" in errors["hosts_differ"]
        # host 0: fcoll's own header check; host 1: the same words, told across the link
        assert "ValueError" in errors["rank_differs"] or "MismatchError" in errors["rank_differs"]
        assert "rank 1 has input shape [16]" in errors["rank_differs"], errors
        assert after == [6.0] * 4  # the group is still usable
    tsp.check_sparse_scenario([res["sparse"] for res in results])
    expected = tom._expected_forward(4)
    for rank, res in enumerate(results):
        for key, want in expected.items():
            tol = {"atol": 1e-2, "rtol": 1e-2} if want[rank].dtype in (
                torch.float16, torch.bfloat16) else {}
            torch.testing.assert_close(res["ops"]["forward"][key], want[rank],
                                       msg=lambda m: f"{key} rank {rank}: {m}", **tol)
        for name in tom.GRAD_CASES:
            want = tom._numerical_grads(name, 4)[rank]
            torch.testing.assert_close(res["ops"]["backward"][name], want, atol=1e-6,
                                       rtol=1e-6, msg=lambda m: f"grad {name} rank {rank}: {m}")
    assert fcoll_segments() == []


def _layouts(rank, world):
    gl = dist.new_group(backend="gloo")
    tb._layouts_and_forms(rank, world, gl)
    for dt in (torch.float32, torch.int64, torch.bool):
        for name in ("sum", "max") + (("avg",) if dt != torch.bool else ()):
            x = tb._make((1001,), dt, rank, 5)
            a, b = tb._on_both(lambda g, op, t: dist.all_reduce(t, op=op, group=g), gl, x,
                               op=name)
            tb._check(a, b, f"all_reduce {name} {dt}")
            y = tb._make((world * 7, 2), dt, rank, 6)
            out = torch.empty((7, 2), dtype=dt)
            a, b = tb._on_both(lambda g, op, o, t: dist.reduce_scatter_tensor(o, t, op=op, group=g),
                               gl, out, y, op=name)
            tb._check(a[:1], b[:1], f"reduce_scatter {name} {dt}")
        for root in range(world):
            z = tb._make((333,), dt, rank, 7 + root)
            a, b = tb._on_both(lambda g, t: dist.broadcast(t, src=root, group=g), gl, z)
            tb._check(a, b, f"broadcast {dt} root {root}")
    return repr(dist.group.WORLD)


@pytest.mark.parametrize("hosts", [[0, 1, 0, 1], [0, 0, 0, 1]], ids=["interleaved", "uneven"])
def test_interleaved_and_uneven_host_layouts_match_gloo(hosts):
    """Interleaved: hosts hold ranks {0, 2} and {1, 3} (composition reorders rows);
    uneven: 3 + 1 ranks (every op on the flat gloo group)."""
    reprs = run_ranks(_layouts, 4, hosts=hosts, timeout_s=180)
    shape = "2x2" if hosts == [0, 1, 0, 1] else "3x1"
    assert all(f"hosts={shape}" in r for r in reprs), reprs
    assert fcoll_segments() == []


def _invalid_calls(rank, world):
    """Invalid arguments raise ValueError on the calling thread, naming op and rank."""
    errors = {}
    try:
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND)
    except ValueError as e:
        errors["band"] = str(e)
    try:
        dist.all_gather_into_tensor(torch.empty(5), torch.ones(2))
    except ValueError as e:
        errors["gather"] = str(e)
    # host 1 passes another size than host 0 (each host agrees with itself): every rank
    # raises before gloo moves a byte
    try:
        dist.all_reduce(torch.ones(6 if rank < 2 else 8))
    except ValueError as e:
        errors["hosts_differ"] = str(e)
    # rank 1 differs from rank 0 on host 0: fcoll's header check raises there, and host 1
    # hears of it (the same message) across the link
    try:
        dist.reduce_scatter_tensor(torch.empty(3 if rank != 1 else 4),
                                   torch.ones(12 if rank != 1 else 16))
    except (ValueError, RuntimeError) as e:
        errors["rank_differs"] = f"{type(e).__name__}: {e}"
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)  # the group is still usable
    return errors, t.tolist()




def _aborts_while_peers_wait(rank, world):
    """Rank 2 aborts the world group (keeping a reference to it, so nothing is destroyed by
    garbage collection) while the others wait for it in an all_reduce, and stays alive, in no
    op, until every peer has raised: they must not need its exit."""
    import datetime
    import time

    world_group = dist.group.WORLD
    store = dist.distributed_c10d._get_default_store()   # outlives the aborted group
    dist.barrier()
    if rank == 2:
        time.sleep(0.5)   # the peers are most likely inside the all_reduce (either way they raise)
        dist.distributed_c10d._abort_process_group()
        assert world_group is not None
        store.wait([f"raised/{r}" for r in (0, 1, 3)], datetime.timedelta(seconds=60))
        return None
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as ei:
        dist.all_reduce(torch.ones(1000))
    elapsed = time.monotonic() - t0
    with pytest.raises(RuntimeError, match="unusable"):
        world_group.allreduce([torch.ones(3)]).wait()
    store.set(f"raised/{rank}", "1")
    return elapsed, f"{type(ei.value).__name__}: {ei.value}"


def test_a_rank_that_aborts_makes_peers_on_every_host_raise_at_once():
    """Before: rank 0, rank 2's peer across the link, waited in gloo until rank 2's process
    exited or the group timed out (gloo's ``abort()`` closes nothing); now the aborting rank
    destroys its gloo groups, so the connection closes at once and rank 0 raises naming it."""
    res = run_ranks(_aborts_while_peers_wait, 4, hosts=TWO_BY_TWO, timeout_s=120,
                    pg_timeout_s=60)
    for rank in (0, 1, 3):
        elapsed, msg = res[rank]
        assert elapsed < 10.0, (rank, elapsed, msg)
    assert "another host closed its connection" in res[0][1], res[0]
    assert "aborted its process group" in res[3][1], res[3]
    assert fcoll_segments() == []
