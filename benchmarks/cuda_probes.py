"""Probes of fcoll's CUDA path for ``benchmarks/gpu_check.py`` (issue #29), one per process.

``python benchmarks/cuda_probes.py NAME`` runs probe NAME and prints one JSON line
``{"probe", "ok", "detail", ...}`` (exit 0 whether or not it passed; exit 1 only on a bug of
the probe itself). Without a GPU every probe reports ``"ok": null`` (skipped).

Probes (:data:`PROBES`, with the timeout gpu_check gives each, seconds):

* ``zero_byte``: every collective with 0 bytes as a group's first CUDA collectives, IPC (2 and
  3 ranks) and staged, then a real all_reduce (``tests/test_cuda.py``'s function).
* ``growth``: eager jobs of :mod:`cuda_stress` (no compile): all_reduces that grow the IPC
  buffers 4 KiB -> 64 MiB while the previous collective's kernels are still queued, 2 and 3
  ranks, results exact.
* ``bf16_fp16``: all_reduce of 64 MiB in bfloat16 and float16 on both paths, exact small
  integers (every sum is representable), compared with a float64 reference.
* ``world1``: world size 1 on NCCL and on fcoll, a compiled step with
  ``torch.ops.fcoll.all_reduce`` under ``backend="fcoll", options={"compute": "inductor"}``,
  equal to eager.
* ``peer_death``: :mod:`cuda_stress`'s killed-peer job (the last rank SIGKILLs itself with a GPU
  sleep and a collective queued): no signal elsewhere, every survivor names it.
* ``teardown``: :mod:`cuda_stress`'s teardown job (peers destroy the group while rank 1 waits).
* ``three_ranks``: 3 ranks, all_reduce 4 KiB..64 MiB (one-shot, two-shot, growth) and an
  all_gather of 8 MiB per rank on the IPC path, exact.
* ``triton_fold``: :mod:`fcoll.shm.cuda.fold`'s kernel on CUDA tensors against the torch fold
  (every dtype and op, 2, 3 and 8 operands), and both timed on 3 x 64 MiB.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [p for p in (ROOT, HERE, os.path.join(ROOT, "tests")) if p not in sys.path]

PROBES = {"zero_byte": 60.0, "growth": 90.0, "bf16_fp16": 60.0, "world1": 120.0,
          "peer_death": 60.0, "teardown": 45.0, "three_ranks": 60.0, "triton_fold": 60.0}
MiB = 1 << 20


def _device(rank: int):
    import torch

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


# ---- rank functions (module level: run_ranks pickles them by name) ----------------------------
def _half_sums(rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist

    dev = _device(rank)
    fails = []
    n = 64 * MiB // 2
    for dt in (torch.bfloat16, torch.float16):
        base = torch.arange(n, device=dev) % 7
        x = (base + rank).to(dt)  # at most 6 + 2 per rank: sums stay exact integers
        dist.all_reduce(x)
        want = sum(base.double() + p for p in range(world))
        if not torch.equal(x.double(), want):
            fails.append(f"rank {rank}: {dt}: {(x.double() != want).sum().item()} of {n} wrong")
    torch.cuda.synchronize()
    return fails


def _world1(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import fcoll  # noqa: F401

    dev = _device(rank)
    group = dist.group.WORLD.group_name

    def step(w, x):
        y = torch.relu(x @ w)
        g = torch.ops.fcoll.wait_tensor(torch.ops.fcoll.all_reduce(y, "sum", group))
        return (g * 2).sum(0)

    w = torch.randn(32, 32, device=dev)
    x = torch.randn(16, 32, device=dev)
    eager = step(w, x)
    compiled = torch.compile(step, backend="fcoll", options={"compute": "inductor"})(w, x)
    return {"backend": dist.get_backend(), "equal": bool(torch.allclose(eager, compiled)),
            "device": compiled.device.type}


def _three(rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist

    dev = _device(rank)
    fails = []
    for size in (4 << 10, 1 * MiB, 4 * MiB + 64, 64 * MiB):
        n = size // 4
        x = torch.full((n,), float(rank + 1), device=dev)
        dist.all_reduce(x)
        if not bool((x == world * (world + 1) / 2).all()):
            fails.append(f"rank {rank}: all_reduce {size} B wrong")
    n = 2 * MiB
    out = torch.empty(world * n, device=dev)
    dist.all_gather_into_tensor(out, torch.full((n,), float(rank), device=dev))
    want = torch.arange(world, device=dev, dtype=torch.float32).repeat_interleave(n)
    if not torch.equal(out, want):
        fails.append(f"rank {rank}: all_gather 8 MiB wrong")
    torch.cuda.synchronize()
    return fails


# ---- the probes ---------------------------------------------------------------------------------
def probe_zero_byte() -> dict[str, Any]:
    from fcoll.testing import run_ranks
    from test_cuda import _zero_bytes_first

    got = {}
    for path, world in (("ipc", 2), ("ipc", 3), ("staged", 2)):
        res = run_ranks(_zero_bytes_first, world, timeout_s=50, env={"FCOLL_CUDA_PATH": path},
                        allow_failures=True)
        want = (path, [float(world * (world + 1) // 2)] * 5)
        got[f"{path}x{world}"] = all(r == want for r in res) or [str(r)[:300] for r in res]
    ok = all(v is True for v in got.values())
    return {"ok": ok, "detail": "every 0-byte collective completed" if ok else str(got),
            "runs": got}


def _stress_jobs(kind: str, worlds: tuple[int, ...], timeout_s: float) -> dict[str, Any]:
    import cuda_stress

    verdicts = []
    for n in worlds:
        sc = {"steps": 6, "compute": "none"}
        if kind == "kill":
            sc.update(steps=6, kill_rank=n - 1, kill_step=2)
        if kind == "teardown":
            sc.update(steps=2, extra_rank=1)
        ranks = cuda_stress.run_job(sc, n, timeout_s / len(worlds))
        v = cuda_stress.judge(kind, sc, ranks)
        v.update(world=n, errors=[(x["result"] or {}).get("error") for x in ranks])
        if not v["ok"]:
            v["tails"] = [x["tail"] for x in ranks]
        verdicts.append(v)
    ok = all(v["ok"] for v in verdicts)
    detail = "; ".join(f"{v['world']} ranks: signals {v['signals']}, bad {v['bad']}, unnamed "
                       f"{v['unnamed']}, failed {v['failed']}, timeouts {v['timeouts']}"
                       for v in verdicts)
    return {"ok": ok, "detail": detail, "jobs": verdicts}


def probe_growth() -> dict[str, Any]:
    return _stress_jobs("steps", (2, 3), PROBES["growth"] - 10)


def probe_peer_death() -> dict[str, Any]:
    return _stress_jobs("kill", (2, 3), PROBES["peer_death"] - 10)


def probe_teardown() -> dict[str, Any]:
    return _stress_jobs("teardown", (2,), PROBES["teardown"] - 10)


def probe_bf16_fp16() -> dict[str, Any]:
    from fcoll.testing import run_ranks

    fails = {}
    for path in ("ipc", "staged"):
        res = run_ranks(_half_sums, 2, timeout_s=25, env={"FCOLL_CUDA_PATH": path},
                        allow_failures=True)
        fails[path] = [f for r in res for f in (r if isinstance(r, list) else [str(r)[:300]])]
    ok = not any(fails.values())
    return {"ok": ok, "detail": "bf16 and fp16 64 MiB exact on ipc and staged" if ok
            else str(fails), "fails": fails}


def probe_world1() -> dict[str, Any]:
    from fcoll.testing import run_ranks

    got = {}
    # fcoll's cost model calibrates a group with CPU collectives, which nccl cannot run: the
    # nccl group has gloo for CPU tensors (as train_gpt.py --dist-backend nccl makes it)
    for backend in ("cpu:gloo,cuda:nccl", "fcoll"):
        res = run_ranks(_world1, 1, backend=backend, timeout_s=55, allow_failures=True)[0]
        got[backend] = res if isinstance(res, dict) else str(res)[:600]
    ok = all(isinstance(v, dict) and v["equal"] and v["device"] == "cuda" for v in got.values())
    return {"ok": ok, "detail": str(got)[:400], "runs": got}


def probe_three_ranks() -> dict[str, Any]:
    from fcoll.testing import run_ranks

    res = run_ranks(_three, 3, timeout_s=55, env={"FCOLL_CUDA_PATH": "ipc"},
                    allow_failures=True)
    fails = [f for r in res for f in (r if isinstance(r, list) else [str(r)[:300]])]
    return {"ok": not fails, "detail": "3 ranks exact" if not fails else str(fails)}


def probe_triton_fold() -> dict[str, Any]:
    """The one-kernel fold on CUDA tensors against the torch fold (every dtype it takes, every
    op, 2, 3 and 8 operands), and both timed on 3 operands of 64 MiB float32."""
    import torch

    from fcoll.ops.reduce import REDUCE_OPS, check_reduce_op, reduce_views_into
    from fcoll.shm.cuda import fold

    os.environ[fold.ENV] = "1"
    dev = _device(0)
    bad, runs = [], 0
    for n in (2, 3, 8):
        for dt in fold.DTYPES:
            for op in REDUCE_OPS:
                if check_reduce_op(op, dt) is not None:
                    continue
                g = torch.Generator().manual_seed(n)
                if dt == torch.bool:
                    vs = [torch.randint(0, 2, (1 << 16,), generator=g).bool() for _ in range(n)]
                elif dt.is_floating_point:
                    vs = [(torch.randn(1 << 16, generator=g) * 10).to(dt) for _ in range(n)]
                else:
                    info = torch.iinfo(dt)
                    vs = [torch.randint(info.min, info.max, (1 << 16,), generator=g,
                                        dtype=torch.int64).to(dt) for _ in range(n)]
                vs = [v.to(dev) for v in vs]
                want, got = torch.empty_like(vs[0]), torch.empty_like(vs[0])
                reduce_views_into(vs, op, want)
                why = fold.fold_supported(vs, op, got)
                if why is not None:
                    bad.append(f"{n} {dt} {op}: not used: {why}")
                    continue
                fold.fold_views_into(vs, op, got)
                runs += 1
                same = torch.equal(got, want) if not dt.is_floating_point else bool(
                    ((got == want) | (got.isnan() & want.isnan())).all())
                if not same:
                    bad.append(f"{n} {dt} {op}: {int((got != want).sum())} differ")

    def timed(f) -> float:
        for _ in range(3):
            f()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            f()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 20 * 1e3

    vs = [torch.randn(16 * MiB, device=dev) for _ in range(3)]
    out = torch.empty_like(vs[0])
    t_torch = timed(lambda: reduce_views_into(vs, "sum", out))
    t_fold = timed(lambda: fold.fold_views_into(vs, "sum", out))
    ok = not bad
    return {"ok": ok, "detail": f"{runs} cases {'match' if ok else 'differ: ' + str(bad[:5])}; "
            f"3 x 64 MiB f32 sum: torch fold {t_torch:.0f} us, one kernel {t_fold:.0f} us",
            "bad": bad, "torch_us": t_torch, "fold_us": t_fold}


RUNNERS: dict[str, Callable[[], dict[str, Any]]] = {
    "zero_byte": probe_zero_byte, "growth": probe_growth, "bf16_fp16": probe_bf16_fp16,
    "world1": probe_world1, "peer_death": probe_peer_death, "teardown": probe_teardown,
    "three_ranks": probe_three_ranks, "triton_fold": probe_triton_fold}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in RUNNERS:
        print(f"usage: cuda_probes.py {{{','.join(RUNNERS)}}}", file=sys.stderr)
        return 2
    import torch

    name = argv[0]
    if not torch.cuda.is_available():
        res: dict[str, Any] = {"ok": None, "detail": "skipped: no GPU"}
    else:
        res = RUNNERS[name]()
    print(json.dumps({"probe": name, **res}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
