"""CUDA tensors on fcoll's backend: both paths, every op x dtype x reduce op, stream semantics,
allocator safety, device errors, a compiled step. Several ranks share one GPU (the IPC path
supports it; NCCL does not).

Skipped without CUDA. On a GPU machine::

    python -m pytest -q tests/test_cuda.py

Every rank computes the expected result of every collective on the CPU from the inputs of all
ranks (they are a function of the rank), with the reducers of :mod:`fcoll.ops.reduce`.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from fcoll.ops.reduce import check_reduce_op, reduce_rows_into
from fcoll.testing import fcoll_segments, run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64,
          torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool]
OPS = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor"]
DIST_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG,
            "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
            "bxor": dist.ReduceOp.BXOR}


def _device(rank: int) -> torch.device:
    d = rank % torch.cuda.device_count()
    torch.cuda.set_device(d)
    return torch.device("cuda", d)


def _value(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small exact values (products of 3 ranks stay exact in every float dtype)."""
    base = (torch.arange(numel) * 7 + rank * 3 + salt) % 5
    if dtype == torch.bool:
        return base % 2 == 0
    if dtype.is_complex:
        return (base + 1).to(dtype) + 1j * (base % 2).to(dtype)
    return (base + 1 + (rank % 2)).to(dtype)


def _reduced(world: int, numel: int, dtype: torch.dtype, op: str, salt: int = 0):
    rows = torch.stack([_value(p, numel, dtype, salt) for p in range(world)])
    out = torch.empty(numel, dtype=dtype)
    reduce_rows_into(rows, op, out)
    return out


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    got = got.cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype.is_floating_point or got.dtype.is_complex:
        return torch.allclose(got.to(torch.complex128), want.to(torch.complex128),
                              rtol=1e-2, atol=1e-2)
    return torch.equal(got, want)


def _matrix(rank, world):
    """Every op x dtype x reduce op; returns the failures (empty when all is well) and the
    path the group took."""
    dev = _device(rank)
    fails = []
    numel = 8 * world * 3  # divisible by the group size, a few hundred bytes

    def check(what, got, want):
        if not _same(got, want):
            fails.append(f"rank {rank}: {what}: got {got.cpu()[:6].tolist()} "
                         f"want {want[:6].tolist()}")

    for dt in DTYPES:
        for op in OPS:
            if check_reduce_op(op, dt) is not None or (dt.is_complex and op == "product"):
                continue  # c10d's own front end refuses PRODUCT on complex tensors
            x = _value(rank, numel, dt).to(dev)
            dist.all_reduce(x, op=DIST_OPS[op])
            check(f"all_reduce {dt} {op}", x, _reduced(world, numel, dt, op))
            x = _value(rank, numel, dt, 1).to(dev)
            w = dist.all_reduce(x, op=DIST_OPS[op], async_op=True)
            w.wait()
            check(f"all_reduce async {dt} {op}", x, _reduced(world, numel, dt, op, 1))
            out = torch.empty(numel // world, dtype=dt, device=dev)
            dist.reduce_scatter_tensor(out, _value(rank, numel, dt).to(dev), op=DIST_OPS[op])
            m = numel // world
            check(f"reduce_scatter {dt} {op}", out,
                  _reduced(world, numel, dt, op)[rank * m:(rank + 1) * m])
        # moves
        x = _value(rank, numel, dt).to(dev)
        out = torch.empty(world * numel, dtype=dt, device=dev)
        dist.all_gather_into_tensor(out, x)
        check(f"all_gather {dt}", out, torch.cat([_value(p, numel, dt) for p in range(world)]))
        x = _value(rank, numel, dt).to(dev)
        dist.broadcast(x, src=world - 1)
        check(f"broadcast {dt}", x, _value(world - 1, numel, dt))
        # all_to_all, uneven: rank p sends (q + 1) rows of 3 to rank q
        rows_in = [(q + 1) for q in range(world)]
        rows_out = [(rank + 1)] * world
        src = _value(rank, sum(rows_in) * 3, dt).view(-1, 3)
        out = torch.empty(sum(rows_out), 3, dtype=dt, device=dev)
        dist.all_to_all_single(out, src.to(dev), rows_out, rows_in)
        want = []
        for p in range(world):
            sp = _value(p, sum(rows_in) * 3, dt).view(-1, 3)
            a = sum(rows_in[:rank])
            want.append(sp[a:a + rank + 1])
        check(f"all_to_all_single {dt}", out, torch.cat(want))
    # a non-contiguous tensor, an out-of-place and a coalesced all_reduce, reduce to a root
    x = _value(rank, 64, torch.float32).view(8, 8).to(dev).t()
    dist.all_reduce(x)
    check("all_reduce non-contiguous", x.contiguous().view(-1),
          _reduced(world, 64, torch.float32, "sum").view(8, 8).t().contiguous().view(-1))
    pg = dist.distributed_c10d._get_default_group()
    ins = [_value(rank, 10, torch.float32).to(dev), _value(rank, 7, torch.int32).to(dev)]
    outs = [torch.empty_like(t) for t in ins]
    pg.allreduce_coalesced_out_of_place(ins, outs, dist.ReduceOp.MAX).wait()
    check("coalesced f32", outs[0], _reduced(world, 10, torch.float32, "max"))
    check("coalesced i32", outs[1], _reduced(world, 7, torch.int32, "max"))
    check("coalesced leaves inputs", ins[0], _value(rank, 10, torch.float32))
    x = _value(rank, 16, torch.float32).to(dev)
    dist.reduce(x, dst=1)
    check("reduce", x, _reduced(world, 16, torch.float32, "sum") if rank == 1
          else _value(rank, 16, torch.float32))
    # large: two-shot for 3+ ranks and buffer growth (8 MiB)
    big = 2 * 1024 * 1024 + 48
    x = _value(rank, big, torch.float32).to(dev)
    dist.all_reduce(x)
    check("all_reduce 8 MiB", x, _reduced(world, big, torch.float32, "sum"))
    out = torch.empty(world * big, device=dev)
    dist.all_gather_into_tensor(out, _value(rank, big, torch.float32).to(dev))
    check("all_gather 8 MiB", out, torch.cat([_value(p, big, torch.float32)
                                              for p in range(world)]))
    torch.cuda.synchronize()
    return fails, getattr(pg, "cuda_path", None)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("path", ["ipc", "staged"])
def test_every_op_dtype_and_reduce_op(path, world):
    res = run_ranks(_matrix, world, timeout_s=300, env={"FCOLL_CUDA_PATH": path})
    for fails, taken in res:
        assert fails == []
        assert taken == path
    assert fcoll_segments() == []


def _auto_path(rank, world):
    _device(rank)
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    pg = dist.distributed_c10d._get_default_group()
    return pg.cuda_path, x.cpu().tolist()


def test_auto_takes_ipc_when_ranks_share_a_gpu():
    res = run_ranks(_auto_path, 2, timeout_s=120)
    want = "ipc" if torch.cuda.device_count() >= 1 else "staged"
    assert res == [(want, [2.0] * 4)] * 2


def _zero_bytes_first(rank, world):
    """Every collective with 0 bytes as the group's first CUDA ones, then a real all_reduce."""
    dev = _device(rank)
    e = lambda *shape: torch.empty(*shape, device=dev)  # noqa: E731
    dist.all_reduce(e(0))
    dist.all_reduce(e(0), async_op=True).wait()
    dist.all_gather_into_tensor(e(0), e(0))
    dist.reduce_scatter_tensor(e(0), e(0))
    dist.broadcast(e(0), src=world - 1)
    dist.all_to_all_single(e(0, 3), e(0, 3), [0] * world, [0] * world)
    pg = dist.distributed_c10d._get_default_group()
    pg.allreduce_coalesced_out_of_place([e(0), e(0)], [e(0), e(0)], dist.ReduceOp.SUM).wait()
    x = torch.full((5,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    dist.all_reduce(e(0))  # and after the buffers exist
    torch.cuda.synchronize()
    return pg.cuda_path, x.cpu().tolist()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("path", ["ipc", "staged"])
def test_zero_byte_collectives_as_a_groups_first_complete(path, world):
    want = [float(world * (world + 1) // 2)] * 5
    res = run_ranks(_zero_bytes_first, world, timeout_s=180, env={"FCOLL_CUDA_PATH": path})
    assert res == [(path, want)] * world


def _streams(rank, world):
    """The result is right on the caller's stream without a host synchronize, and neither
    the issuing call nor (IPC) ``wait()`` waits for the GPU."""
    dev = _device(rank)
    cycles = 200_000_000  # ~0.1 s of GPU time, ahead of the collective on the stream
    x = torch.ones(1 << 20, device=dev)
    dist.all_reduce(x)  # set up the path before timing
    torch.cuda.synchronize()
    x.fill_(0)
    torch.cuda._sleep(cycles)
    x.add_(rank + 1)  # the input is only written after the sleep
    t0 = time.perf_counter()
    work = dist.all_reduce(x, async_op=True)
    issue_s = time.perf_counter() - t0
    pg = dist.distributed_c10d._get_default_group()
    waited_s = None
    gpu_busy_after_wait = None
    if pg.cuda_path == "ipc":
        t0 = time.perf_counter()
        work.wait()
        waited_s = time.perf_counter() - t0
        gpu_busy_after_wait = not torch.cuda.current_stream().query()
    else:
        work.wait()
    y = x * 2  # on the caller's stream, after the stream wait
    t = torch.cuda.Event(enable_timing=True)
    s = torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(cycles)
    t.record()
    torch.cuda.synchronize()
    sleep_s = s.elapsed_time(t) / 1e3
    want = float(sum(range(1, world + 1)))
    return dict(issue_s=issue_s, waited_s=waited_s, sleep_s=sleep_s,
                gpu_busy_after_wait=gpu_busy_after_wait,
                ok=bool((y == 2 * want).all().item()), path=pg.cuda_path)


@pytest.mark.parametrize("path", ["ipc", "staged"])
def test_stream_semantics_host_not_blocked(path):
    res = run_ranks(_streams, 2, timeout_s=180, env={"FCOLL_CUDA_PATH": path})
    for r in res:
        assert r["ok"], r
        assert r["path"] == path
        # the call returned while the GPU was still sleeping before the collective
        assert r["issue_s"] < r["sleep_s"] / 2, r
        if path == "ipc":
            assert r["gpu_busy_after_wait"], r
            assert r["waited_s"] < r["sleep_s"] / 2, r


def _allocator(rank, world):
    """Inputs freed right after the call; their memory reused and overwritten at once."""
    dev = _device(rank)
    n = 1 << 22
    out = torch.empty(world * n, device=dev)
    dist.all_gather_into_tensor(out, torch.zeros(n, device=dev))  # warm up, set up
    bad = 0
    for i in range(5):
        torch.cuda._sleep(50_000_000)  # keep the GPU busy so the collective runs late
        work = dist.all_gather_into_tensor(out, torch.full((n,), float(rank + i), device=dev),
                                           async_op=True)
        junk = torch.empty(n, device=dev)  # likely the freed input's block
        junk.fill_(-1.0)
        work.wait()
        want = torch.cat([torch.full((n,), float(p + i)) for p in range(world)])
        bad += int(not torch.equal(out.cpu(), want))
        del junk
    return bad


@pytest.mark.parametrize("path", ["ipc", "staged"])
def test_input_freed_right_after_the_call(path):
    assert run_ranks(_allocator, 2, timeout_s=180, env={"FCOLL_CUDA_PATH": path}) == [0, 0]


def _mixed_devices(rank, world):
    dev = _device(rank)
    errors = []
    try:
        dist.all_gather_into_tensor(torch.empty(2 * world), torch.ones(2, device=dev))
    except ValueError as e:
        errors.append(str(e))
    x = torch.ones(4, device=dev) if rank == 0 else torch.ones(4)
    try:
        dist.all_reduce(x)
    except ValueError as e:
        errors.append(str(e))
    y = torch.ones(4, device=dev)
    dist.all_reduce(y)  # the group is still usable
    errors.append(y.cpu().tolist())
    return errors


def test_device_errors_raise_on_every_rank():
    res = run_ranks(_mixed_devices, 2, timeout_s=120)
    for rank, errs in enumerate(res):
        assert len(errs) == 3, errs
        assert "mixes devices" in errs[0] and "input_tensor on cuda:0" in errs[0]
        assert "output_tensor on cpu" in errs[0]
        assert "float32 on cuda" in errs[1], errs[1]
        assert errs[2] == [2.0] * 4


def test_tensor_on_another_device_than_the_ranks():
    from fcoll.shm.cuda.paths import device_error

    t = torch.ones(2, device="cuda:0")
    msg = device_error([("tensor", t)], device=1)
    assert "tensor is on cuda:0 but this rank's device is cuda:1" in msg
    assert device_error([("tensor", t)], device=0) is None


def _compiled(rank, world):
    import fcoll  # noqa: F401  registers the backend and torch.ops.fcoll

    dev = _device(rank)
    group = dist.group.WORLD.group_name

    def step(w, x):
        y = torch.relu(x @ w)
        g = torch.ops.fcoll.all_reduce(y, "avg", group)
        g = torch.ops.fcoll.wait_tensor(g)
        return (g * 2).sum(0)

    w = torch.ones(16, 16, device=dev) / 16
    x = torch.arange(64.0, device=dev).view(4, 16) + rank
    eager = step(w, x)
    compiled = torch.compile(step, backend="fcoll")(w, x)
    return torch.allclose(eager, compiled), compiled.device.type


def test_compiled_step_on_cuda_ranks_sharing_a_gpu():
    assert run_ranks(_compiled, 2, timeout_s=300) == [(True, "cuda")] * 2
