"""Stress loop of compiled-vs-eager steps (issue 28, Deliver 7): how often a compiled step's
result differs from eager under load, slow collectives, warm compile caches and jobs at once.

Cases (2 ranks each, every rank compares its own results with eager):

- ``ckpt-inductor``: ``checkpoint(x @ w1 -> fcoll.all_reduce -> gelu -> @ w2)`` then
  ``checkpoint(tanh(. @ w3))``, ``torch.autograd.grad`` inside the compiled step and
  ``fcoll.all_reduce(avg)`` of the gradients, ``backend="inductor"`` (issue 28.1's program);
- ``ckpt-fcoll``: the same step, ``backend="fcoll"``;
- ``ddp-fcoll``: a DDP-style step, ``loss.backward()`` and ``fcoll.all_reduce(avg)`` of each
  gradient and an SGD update inside the compiled function, ``backend="fcoll"``; parameters after
  ``--steps`` steps against eager (gradients cleared between steps, outside the function).

Each run is a fresh 2-rank job (fresh processes: Dynamo and Inductor caches in memory are cold,
PyTorch's on-disk FX-graph and AOTAutograd caches are warm after the first run). Those caches
live in a directory of this invocation's own unless ``--shared-cache`` is given: they key
fcoll's ops by name only, so another checkout of fcoll compiling the same program into the
machine's shared directory would have its artifacts run here (docs/design.md); ``--concurrent``
jobs run at once; ``--busy`` processes spin on the CPU beside them; fcoll's engine worker
sleeps ``--delay-ms`` before every collective it runs (fcoll's group; gloo's threads are not
slowed). Prints one line per run and a JSON summary: runs, mismatches, the largest error, and
``completed`` (false when it was terminated, by ``timeout`` say, before the last run).

Usage::

    python benchmarks/compile_stress.py --case ckpt-inductor --runs 50 --busy 4 --delay-ms 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from fcoll.testing import run_ranks, slow_collectives  # noqa: E402
from test_compile_matrix import reported_step  # noqa: E402  issue 28.1's program

TOLERANCE = 1e-5


def _ckpt(rank: int, backend: str, steps: int) -> float:
    import fcoll

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    ws = [(torch.randn(16, 16, generator=gen) * 0.3).requires_grad_() for _ in range(3)]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank + 1))
    expected = [fcoll.wait_tensor(g) for g in reported_step(x, *ws, group)]
    step = torch.compile(reported_step, backend=backend)
    err = 0.0
    for _ in range(steps):
        got = step(x, *ws, group)
        err = max(err, *((a - b).abs().max().item() for a, b in zip(got, expected)))
    return err


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _ddp_step(model, x, group):
    import fcoll

    model(x).pow(2).sum().backward()
    for p in model.parameters():
        p.grad = fcoll.all_reduce(p.grad, "avg", group)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad


def _ddp(rank: int, steps: int) -> float:
    import fcoll

    group = dist.group.WORLD
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + i))
          for i in range(steps)]
    eager, compiled = _mlp(), _mlp()
    for x in xs:
        eager(x).pow(2).sum().backward()
        for p in eager.parameters():
            p.grad = fcoll.wait_tensor(fcoll.all_reduce(p.grad, "avg", group))
        with torch.no_grad():
            for p in eager.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    step = torch.compile(_ddp_step, backend="fcoll")
    for x in xs:
        step(compiled, x, group)
        # outside the compiled function: ``p.grad = None`` inside it makes even
        # backend="eager" differ from eager, with PyTorch's own funcol ops too (Dynamo)
        for p in compiled.parameters():
            p.grad = None
    return max((a - b).abs().max().item()
               for a, b in zip(eager.parameters(), compiled.parameters()))


def _job(rank: int, world: int, case: str, steps: int, delay_s: float) -> float:
    if delay_s > 0:
        slow_collectives(delay_s)
    if case == "ddp-fcoll":
        return _ddp(rank, steps)
    return _ckpt(rank, "inductor" if case == "ckpt-inductor" else "fcoll", steps)


def _one_run(args: argparse.Namespace) -> float:
    errors = run_ranks(_job, 2, backend=args.group, timeout_s=args.timeout_s,
                       args=(args.case, args.steps, args.delay_ms / 1e3))
    return max(errors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=("ckpt-inductor", "ckpt-fcoll", "ddp-fcoll"),
                    required=True)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--steps", type=int, default=3, help="compiled steps per run")
    ap.add_argument("--group", choices=("fcoll", "gloo"), default="fcoll")
    ap.add_argument("--busy", type=int, default=4, help="CPU-spinning processes beside")
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--concurrent", type=int, default=2, help="jobs at once")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--shared-cache", action="store_true",
                    help="use PyTorch's default compile cache directory (shared by every "
                         "checkout on the machine) instead of a fresh one")
    args = ap.parse_args()
    own_cache = None if args.shared_cache else tempfile.mkdtemp(prefix="fcoll-stress-cache-")
    if own_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = own_cache   # the spawned ranks inherit it
    # ``timeout`` or a kill ends the loop as an exception would: the busy processes and the
    # cache directory are removed and the summary says how far it got
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("compile_stress: terminated"))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    errors: list[float] = []
    failures: list[str] = []
    t0 = time.time()
    pool = ThreadPoolExecutor(args.concurrent)
    completed = False
    try:
        futures = [pool.submit(_one_run, args) for _ in range(args.runs)]
        for i, f in enumerate(futures):
            try:
                err = f.result()
            except Exception as e:  # noqa: BLE001  a failed run is reported, not fatal
                failures.append(f"{type(e).__name__}: {str(e)[:300]}")
                print(f"run {i}: FAILED {failures[-1]}", flush=True)
                continue
            errors.append(err)
            print(f"run {i}: max error {err:.3g}{'  MISMATCH' if err > TOLERANCE else ''}"
                  f"  load {os.getloadavg()[0]:.1f}", flush=True)
        completed = True
    finally:
        pool.shutdown(wait=completed, cancel_futures=True)   # runs under way finish on exit
        for p in busy:
            p.kill()
            p.wait()
        if own_cache:
            shutil.rmtree(own_cache, ignore_errors=True)
        print(json.dumps({"case": args.case, "group": args.group, "runs": len(errors),
                          "failed_runs": len(failures), "completed": completed,
                          "mismatches": sum(e > TOLERANCE for e in errors),
                          "max_error": max(errors, default=None), "busy": args.busy,
                          "delay_ms": args.delay_ms, "concurrent": args.concurrent,
                          "steps": args.steps, "shared_cache": args.shared_cache,
                          "seconds": round(time.time() - t0, 1)}), flush=True)

if __name__ == "__main__":
    main()
