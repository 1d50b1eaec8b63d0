"""fcoll's functional collectives on 2 and 4 real ranks, on the fcoll and gloo backends.

Every rank builds deterministic inputs from (case, rank), so the test process can rebuild all
ranks' inputs and compute the expected outputs with the single-process reference semantics in
``collective_reference`` (no communication). Gradients are compared with central finite
differences of the reference (float64), i.e. a numerical reference independent of fcoll's
autograd formulas.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import collective_reference as ref
from fcoll.testing import fcoll_segments, run_ranks

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]
REDUCE_OPS = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor"]


def make_input(case: str, rank: int, shape=(4, 6), dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{case}/{rank}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    lo, hi = (0, 7) if dtype == torch.uint8 else (-5, 6)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def valid(op: str, dtype: torch.dtype) -> bool:
    if op in ("band", "bor", "bxor"):
        return not dtype.is_floating_point
    return not (op == "avg" and dtype == torch.bool)


def uneven_splits(n: int, rank: int) -> list[int]:
    """Rank ``rank`` sends ``rank + j + 1`` rows to rank ``j``."""
    return [rank + j + 1 for j in range(n)]


def _forward_cases(rank: int, n: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    import fcoll

    world = dist.group.WORLD
    out: dict[str, torch.Tensor] = {}
    for dtype in DTYPES:
        for op in REDUCE_OPS:
            if not valid(op, dtype):
                continue
            x = make_input(f"ar-{op}-{dtype}", rank, dtype=dtype)
            x0 = x.clone()
            y = fcoll.all_reduce(x, op, world)
            assert isinstance(y, fcoll.AsyncCollectiveTensor)
            out[f"ar-{op}-{dtype}"] = y.wait().clone()
            assert torch.equal(x, x0), "input was modified"
            x = make_input(f"rs-{op}-{dtype}", rank, shape=(n, 3), dtype=dtype)
            out[f"rs-{op}-{dtype}"] = fcoll.reduce_scatter_tensor(x, op, 0, world).wait().clone()
    x = make_input("ar-noncontig", rank, shape=(6, 4)).t()
    out["ar-noncontig"] = (fcoll.all_reduce(x, "sum", world) * 1).clone()
    xs = [make_input("arc-0", rank), make_input("arc-1", rank, dtype=torch.float64, shape=(3,))]
    out["arc-0"], out["arc-1"] = [t.wait() for t in fcoll.all_reduce_coalesced(xs, "max", world)]
    xs = [make_input("arca-0", rank), make_input("arca-1", rank, dtype=torch.int32)]
    out["arca-0"], out["arca-1"] = [t.wait() for t in fcoll.all_reduce_coalesced(xs, "avg", world)]
    for dim in (0, 1):
        x = make_input(f"ag-{dim}", rank, shape=(2, 3))
        out[f"ag-{dim}"] = fcoll.all_gather_tensor(x, dim, world) + 0
        x = make_input(f"rs-{dim}", rank, shape=(2 * n, 2 * n))
        out[f"rs-{dim}"] = fcoll.reduce_scatter_tensor(x, "sum", dim, world) + 0
    x = make_input("rs-avg", rank, shape=(n, 3))
    out["rs-avg"] = fcoll.reduce_scatter_tensor(x, "avg", 0, world) + 0
    xs = [make_input("agc-0", rank, shape=(1, 2)), make_input("agc-1", rank, shape=(2,))]
    out["agc-0"], out["agc-1"] = [t + 0 for t in fcoll.all_gather_into_tensor_coalesced(xs, world)]
    xs = [make_input("rsc-0", rank, shape=(n, 2)), make_input("rsc-1", rank, shape=(2, n))]
    out["rsc-0"], out["rsc-1"] = [
        t + 0 for t in fcoll.reduce_scatter_tensor_coalesced(xs, "sum", [0, 1], world)]
    x = make_input("a2a-even", rank, shape=(2 * n, 3))
    out["a2a-even"] = fcoll.all_to_all_single(x, None, None, world) + 0
    send = uneven_splits(n, rank)
    recv = [j + rank + 1 for j in range(n)]
    x = make_input("a2a-uneven", rank, shape=(sum(send), 2))
    out["a2a-uneven"] = fcoll.all_to_all_single(x, recv, send, world) + 0
    x = make_input("bc", rank)
    out["bc"] = fcoll.broadcast(x, n - 1, world) + 0
    # every group form names the same collective
    x = make_input("forms", rank)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (n,))
    forms = [world, world.group_name, mesh, (mesh, 0), list(range(n))]
    out["forms"] = torch.stack([fcoll.all_reduce(x, "sum", g).wait() for g in forms])
    # in-place op + wait_tensor, and raw ops
    x = make_input("inplace", rank)
    torch.ops.fcoll.all_reduce_(x, "sum", world.group_name)
    out["inplace"] = torch.ops.fcoll.wait_tensor(x).clone()
    return out


def _expected_forward(n: int) -> dict[str, torch.Tensor]:
    exp: dict[str, list[torch.Tensor]] = {}
    for dtype in DTYPES:
        for op in REDUCE_OPS:
            if valid(op, dtype):
                key = f"ar-{op}-{dtype}"
                exp[key] = ref.all_reduce([make_input(key, r, dtype=dtype) for r in range(n)], op)
                key = f"rs-{op}-{dtype}"
                exp[key] = ref.reduce_scatter(
                    [make_input(key, r, shape=(n, 3), dtype=dtype) for r in range(n)], op)
    exp["ar-noncontig"] = ref.all_reduce(
        [make_input("ar-noncontig", r, shape=(6, 4)).t() for r in range(n)])
    exp["arc-0"] = ref.all_reduce([make_input("arc-0", r) for r in range(n)], "max")
    exp["arc-1"] = ref.all_reduce(
        [make_input("arc-1", r, dtype=torch.float64, shape=(3,)) for r in range(n)], "max")
    exp["arca-0"] = ref.all_reduce([make_input("arca-0", r) for r in range(n)], "avg")
    exp["arca-1"] = ref.all_reduce([make_input("arca-1", r, dtype=torch.int32) for r in range(n)],
                                   "avg")
    for dim in (0, 1):
        exp[f"ag-{dim}"] = ref.all_gather(
            [make_input(f"ag-{dim}", r, shape=(2, 3)) for r in range(n)], dim)
        exp[f"rs-{dim}"] = ref.reduce_scatter(
            [make_input(f"rs-{dim}", r, shape=(2 * n, 2 * n)) for r in range(n)], "sum", dim)
    exp["rs-avg"] = ref.reduce_scatter([make_input("rs-avg", r, shape=(n, 3)) for r in range(n)],
                                       "avg")
    exp["agc-0"] = ref.all_gather([make_input("agc-0", r, shape=(1, 2)) for r in range(n)])
    exp["agc-1"] = ref.all_gather([make_input("agc-1", r, shape=(2,)) for r in range(n)])
    exp["rsc-0"] = ref.reduce_scatter([make_input("rsc-0", r, shape=(n, 2)) for r in range(n)])
    exp["rsc-1"] = ref.reduce_scatter([make_input("rsc-1", r, shape=(2, n)) for r in range(n)],
                                      "sum", 1)
    exp["a2a-even"] = ref.all_to_all(
        [make_input("a2a-even", r, shape=(2 * n, 3)) for r in range(n)], [[2] * n] * n)
    exp["a2a-uneven"] = ref.all_to_all(
        [make_input("a2a-uneven", r, shape=(sum(uneven_splits(n, r)), 2)) for r in range(n)],
        [uneven_splits(n, r) for r in range(n)])
    exp["bc"] = ref.broadcast([make_input("bc", r) for r in range(n)], n - 1)
    exp["forms"] = [torch.stack([t] * 5) for t in
                    ref.all_reduce([make_input("forms", r) for r in range(n)])]
    exp["inplace"] = ref.all_reduce([make_input("inplace", r) for r in range(n)])
    return exp


# ---- autograd --------------------------------------------------------------------------------

def _grad_case(name: str, rank: int, n: int):
    """(input, fn(x, group) -> output) for each differentiable case."""
    import fcoll

    shapes = {"ar-sum": (3, 2), "ar-avg": (3, 2), "ag-1": (2, 3), "rs-sum": (2 * n, 2),
              "rs-avg": (2 * n, 2), "a2a": (sum(uneven_splits(n, rank)), 2), "bc": (2, 2),
              "arc": (3,)}
    x = make_input(f"grad-{name}", rank, shape=shapes[name], dtype=torch.float64)
    recv = [j + rank + 1 for j in range(n)]
    fns = {
        "ar-sum": lambda x, g: fcoll.all_reduce(x, "sum", g),
        "ar-avg": lambda x, g: fcoll.all_reduce(x, "avg", g),
        "ag-1": lambda x, g: fcoll.all_gather_tensor(x, 1, g),
        "rs-sum": lambda x, g: fcoll.reduce_scatter_tensor(x, "sum", 0, g),
        "rs-avg": lambda x, g: fcoll.reduce_scatter_tensor(x, "avg", 0, g),
        "a2a": lambda x, g: fcoll.all_to_all_single(x, recv, uneven_splits(n, rank), g),
        "bc": lambda x, g: fcoll.broadcast(x, 0, g),
        "arc": lambda x, g: fcoll.all_reduce_coalesced([x, 2 * x], "sum", g)[1],
    }
    return x, fns[name]


GRAD_CASES = ["ar-sum", "ar-avg", "ag-1", "rs-sum", "rs-avg", "a2a", "bc", "arc"]


def _weights(name: str, rank: int, like: torch.Tensor) -> torch.Tensor:
    return make_input(f"w-{name}", rank, shape=tuple(like.shape), dtype=torch.float64)


def _backward_cases(rank: int, n: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    out = {}
    for name in GRAD_CASES:
        x, fn = _grad_case(name, rank, n)
        x.requires_grad_(True)
        y = fn(x, dist.group.WORLD)
        loss = (y * _weights(name, rank, y)).sum()
        loss.backward()
        out[name] = x.grad.clone()
    return out


def _reference_outputs(name: str, xs: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    if name in ("ar-sum", "ar-avg"):
        return ref.all_reduce(xs, name[3:])
    if name == "arc":
        return ref.all_reduce([2 * x for x in xs])
    if name == "ag-1":
        return ref.all_gather(xs, 1)
    if name in ("rs-sum", "rs-avg"):
        return ref.reduce_scatter(xs, name[3:])
    if name == "a2a":
        return ref.all_to_all(xs, [uneven_splits(n, r) for r in range(n)])
    return ref.broadcast(xs, 0)


def _numerical_grads(name: str, n: int, eps: float = 1e-6) -> list[torch.Tensor]:
    xs = [_grad_case(name, r, n)[0] for r in range(n)]

    def total_loss(xs_):
        outs = _reference_outputs(name, xs_, n)
        return sum((o * _weights(name, r, o)).sum() for r, o in enumerate(outs))

    grads = []
    for r in range(n):
        g = torch.zeros_like(xs[r])
        flat = g.view(-1)
        for i in range(flat.numel()):
            plus = [x.clone() for x in xs]
            minus = [x.clone() for x in xs]
            plus[r].view(-1)[i] += eps
            minus[r].view(-1)[i] -= eps
            flat[i] = (total_loss(plus) - total_loss(minus)) / (2 * eps)
        grads.append(g)
    return grads


def _worker(rank: int, n: int) -> dict:
    return {"forward": _forward_cases(rank, n), "backward": _backward_cases(rank, n)}


def _worker_gloo_subgroup(rank: int, n: int) -> dict:
    """The same cases on a gloo group made inside an fcoll world: ops follow the group."""
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    import fcoll

    x = make_input("sub", rank)
    return {"sub": fcoll.all_reduce(x, "sum", gloo).wait(),
            "backend": gloo._get_backend_name()}


@pytest.mark.parametrize("backend", ["fcoll", "gloo"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_match_reference(world_size: int, backend: str) -> None:
    results = run_ranks(_worker, world_size, backend=backend, timeout_s=240)
    expected = _expected_forward(world_size)
    for rank, res in enumerate(results):
        for key, want in expected.items():
            got = res["forward"][key]
            tol = {"atol": 1e-2, "rtol": 1e-2} if want[rank].dtype in (
                torch.float16, torch.bfloat16) else {}
            torch.testing.assert_close(got, want[rank], msg=lambda m: f"{key} rank {rank}: {m}",
                                       **tol)
        for name in GRAD_CASES:
            want = _numerical_grads(name, world_size)[rank]
            torch.testing.assert_close(res["backward"][name], want, atol=1e-6, rtol=1e-6,
                                       msg=lambda m: f"grad {name} rank {rank}: {m}")
    assert fcoll_segments() == []


def test_ops_run_on_the_group_they_are_given() -> None:
    results = run_ranks(_worker_gloo_subgroup, 2, backend="fcoll", timeout_s=120)
    want = ref.all_reduce([make_input("sub", r) for r in range(2)])
    for rank, res in enumerate(results):
        assert res["backend"] == "gloo"
        torch.testing.assert_close(res["sub"], want[rank])


def _async_tensor_worker(rank: int, n: int) -> dict:
    """Which uses of an AsyncCollectiveTensor wait (pending count drops) and which do not."""
    import torch.distributed as dist

    import fcoll
    from fcoll.ops import pending

    world = dist.group.WORLD
    seen = {}

    def fresh():
        return fcoll.all_reduce(torch.full((4, 4), float(rank + 1)), "sum", world)

    y = fresh()
    v = y[1:3].t()                      # views do not wait
    seen["view_is_async"] = isinstance(v, fcoll.AsyncCollectiveTensor)
    seen["view_pending"] = pending.num_pending()
    seen["view_values"] = v.tolist()    # tolist waits (on the view: same storage)
    seen["after_tolist_pending"] = pending.num_pending()
    uses = {
        "tolist": lambda t: t.tolist(),
        "numpy": lambda t: t.numpy().sum().item(),
        "repr": lambda t: repr(t),
        "cast": lambda t: t.to(torch.float64).sum().item(),
        "add": lambda t: (t + 1).sum().item(),
        "custom_op": lambda t: torch.ops.fcoll.wait_tensor(
            torch.ops.fcoll.all_reduce(t, "sum", world.group_name)).sum().item(),
    }
    for name, use in uses.items():
        y = fresh()
        seen[name] = (use(y), pending.num_pending())
    return seen


def test_async_collective_tensor_waits_on_first_real_use() -> None:
    results = run_ranks(_async_tensor_worker, 2, backend="gloo", timeout_s=120)
    total = 1.0 + 2.0
    for seen in results:
        assert seen["view_is_async"]
        assert seen["view_pending"] == 1
        assert seen["view_values"] == [[total] * 2] * 4
        assert seen["after_tolist_pending"] == 0
        assert seen["tolist"] == ([[total] * 4] * 4, 0)
        assert seen["numpy"] == (16 * total, 0)
        assert seen["repr"][0].startswith("AsyncCollectiveTensor(tensor([[3., 3.") and \
            seen["repr"][1] == 0
        assert seen["cast"] == (16 * total, 0)
        assert seen["add"] == (16 * (total + 1), 0)
        assert seen["custom_op"] == (16 * total * 2, 0)


def _mixed_wait_worker(rank: int, n: int) -> dict:
    """A raw fcoll collective waited with PyTorch's ``wait_tensor``, and the other way round.

    Rank 1 joins each collective only after rank 0 has read its result, or after 1 s: a wait
    that returns before the collective completed lets rank 0 read first and fail; a real wait
    blocks rank 0 until rank 1's store wait expires and it joins.
    """
    import datetime

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    name = dist.group.WORLD.group_name
    c10d = torch._C._distributed_c10d
    seen = {}
    for i, (op, wait) in enumerate([(torch.ops.fcoll.all_reduce, torch.ops._c10d_functional),
                                    (torch.ops._c10d_functional.all_reduce, torch.ops.fcoll)]):
        x = torch.full((4,), float(rank + 1))
        if rank == 1:
            try:
                store.wait([f"read-{i}"], datetime.timedelta(seconds=1))
            except Exception:  # noqa: BLE001  the store's timeout: rank 0 is (rightly) waiting
                pass
        out = op(x, "avg", name)
        seen[f"registered-{i}"] = c10d._get_work_registry_size()
        value = wait.wait_tensor(out).tolist()
        if rank == 0:
            store.set(f"read-{i}", "1")
        seen[f"value-{i}"] = value
        seen[f"left-{i}"] = c10d._get_work_registry_size()
    # fcoll's own wait takes its entry out of c10d's registry too (no leak, no exit warning)
    out = torch.ops.fcoll.all_reduce(torch.ones(4), "sum", name)
    torch.ops.fcoll.wait_tensor(out)
    seen["left-fcoll-wait"] = c10d._get_work_registry_size()
    return seen


@pytest.mark.parametrize("backend", ["fcoll", "gloo"])
def test_either_namespace_waits_for_the_other(backend: str) -> None:
    results = run_ranks(_mixed_wait_worker, 2, backend=backend, timeout_s=120)
    for rank, seen in enumerate(results):
        for i in range(2):
            assert seen[f"value-{i}"] == [1.5] * 4, (rank, i, seen)  # avg of 1 and 2
            assert seen[f"registered-{i}"] == 1, (rank, i, seen)
            assert seen[f"left-{i}"] == 0, (rank, i, seen)
        assert seen["left-fcoll-wait"] == 0, (rank, seen)
