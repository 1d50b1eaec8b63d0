"""Stress of fcoll's CUDA IPC path: fresh jobs of compiled steps, growth, teardown, a killed peer.

Usage (on a GPU; without one it prints a SKIP line and writes a skipped JSON)::

    python benchmarks/cuda_stress.py                         # budget size (about a minute)
    python benchmarks/cuda_stress.py --jobs 20 --steps 50    # the size issue #29 asks for
    python benchmarks/cuda_stress.py --json stress.json --worlds 2 3 --kill-jobs 1

Per world size (``--worlds``, default 2 and 3 ranks on the machine's GPUs, ``cuda:{r % n}``):

* ``--jobs`` fresh jobs (new processes, new group) of ``--steps`` steps each. A step is a
  compiled function (``torch.compile(backend="fcoll", options={"compute": ...})``: a matmul and
  ``torch.ops.fcoll.all_reduce``) issued behind a GPU sleep, so its kernels are still queued
  when an eager async all_reduce of a size that cycles 4 KiB -> 64 MiB follows (buffer growth
  while the compiled step's reads of the old buffers are queued). Both results are checked
  exactly; every job ends in ``destroy_process_group`` (teardown inside).
* ``--kill-jobs`` jobs where the last rank, at step 2, queues a long GPU sleep and an async
  all_reduce and then SIGKILLs itself: every survivor must raise an error naming that rank.
* one job where the other ranks destroy their group while rank 1 waits in one more
  collective: rank 1 must raise naming a rank that destroyed it.

Every rank is a process of its own (exit codes are read directly, so a signal during teardown
or interpreter exit is counted too). Reported: jobs run, signals (exit by a signal other than
the deliberate SIGKILL), wrong results, survivors that did not name the dead rank, ranks killed
at ``--job-timeout-s`` before their result (``timeouts``: a hang) or after printing it
(``hung_at_exit``); ``ok`` when all are zero. ``--budget-s`` launches a job only while 1.3x the
longest job so far is left, so no job is cut short by the budget (the summary says how many
ran). The first device run (H100, 2026-11-27) cut the 3-rank kill job at 18 s, its share of
the budget, after both survivors had named the dead rank: a budget cut, counted as a hang.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROW_BYTES = [4 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]  # eager all_reduce sizes, cycled
GPU_SLEEP_CYCLES = 20_000_000  # about 10 ms on an H100: keeps the step's kernels queued
KILL_SLEEP_CYCLES = 2_000_000_000  # about 1 s of GPU work queued when the rank kills itself
D = 64


# ---- one rank --------------------------------------------------------------------------------
def worker(sc: dict[str, Any], rank: int, world: int, store: str) -> dict[str, Any]:
    """One rank of a job ``sc`` (keys: steps, compute, kill_rank, kill_step, extra_rank,
    device); returns its result record (``error``: what it raised, None if nothing)."""
    import torch
    import torch.distributed as dist

    import fcoll  # noqa: F401  registers the backend and torch.ops.fcoll

    cuda = sc.get("device", "cuda") == "cuda"  # "cpu": the same job on CPU tensors (its tests)
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    gpu_sleep = torch.cuda._sleep if cuda else (lambda cycles: None)
    dist.init_process_group("fcoll", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    group = dist.group.WORLD.group_name

    def step(w, x):
        g = torch.ops.fcoll.all_reduce(x @ w, "sum", group)
        return torch.ops.fcoll.wait_tensor(g)

    run = step if sc["compute"] == "none" else torch.compile(
        step, backend="fcoll", options={"compute": sc["compute"]})
    want = float(world * (world + 1) // 2)
    w = torch.eye(D, device=dev)
    res: dict[str, Any] = {"rank": rank, "steps": 0, "bad": 0, "error": None}
    steps = sc["steps"] + (1 if rank == sc.get("extra_rank", -1) else 0)
    try:
        for i in range(steps):
            if rank == sc.get("kill_rank", -1) and i == sc.get("kill_step", 2):
                gpu_sleep(KILL_SLEEP_CYCLES)
                dist.all_reduce(torch.ones(1 << 20, device=dev), async_op=True)
                os.kill(os.getpid(), signal.SIGKILL)
            gpu_sleep(GPU_SLEEP_CYCLES)
            g = run(w, torch.full((128, D), float(rank + 1), device=dev))
            big = torch.full((GROW_BYTES[i % len(GROW_BYTES)] // 4,), float(rank + 1),
                             device=dev)
            work = dist.all_reduce(big, async_op=True)
            work.wait()
            ok = bool((g == want).all()) and bool((big == want).all())
            res["bad"] += int(not ok)
            res["steps"] = i + 1
    except Exception as e:  # noqa: BLE001  the expected outcome of the kill and teardown jobs
        res["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        res["destroy_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return res


# ---- one job ---------------------------------------------------------------------------------
def run_job(sc: dict[str, Any], world: int, timeout_s: float) -> list[dict[str, Any]]:
    """Run job ``sc`` on ``world`` fresh processes; per rank ``{"rc", "result", "tail"}``
    (``rc`` None: killed at the timeout)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(prefix="fcoll-stress-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(sc),
             "--rank", str(r), "--world", str(world), "--store", store],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True) for r in range(world)]
        deadline = time.monotonic() + timeout_s
        out = []
        for p in procs:
            try:
                text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                rc = p.returncode
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                text, _ = p.communicate()
                rc = None
            text = text.decode(errors="replace")
            result = None
            for line in reversed(text.splitlines()):
                if line.startswith("{\"rank\""):
                    result = json.loads(line)
                    break
            out.append({"rc": rc, "result": result, "tail": text[-1500:]})
        return out


def judge(kind: str, sc: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Count a job's signals, wrong results and unnamed culprits (see the module doc)."""
    killed = sc.get("kill_rank", -1)
    signals = [r for r, x in enumerate(ranks)
               if x["rc"] is not None and x["rc"] < 0 and not (r == killed
                                                               and x["rc"] == -signal.SIGKILL)]
    # killed at the job's timeout: before its result (a hang) or after it (a hang at exit)
    timeouts = [r for r, x in enumerate(ranks) if x["rc"] is None and x["result"] is None]
    hung_at_exit = [r for r, x in enumerate(ranks) if x["rc"] is None and x["result"] is not None]
    bad = sum((x["result"] or {}).get("bad", 0) for x in ranks)
    unnamed, failed = [], []
    for r, x in enumerate(ranks):
        if r == killed:
            continue
        res = x["result"]
        if res is None:
            failed.append(r)
            continue
        err = res.get("error")
        if kind == "kill":
            if not err or f"rank {killed}" not in err:
                unnamed.append(r)
        elif kind == "teardown":
            others = [f"rank {q}" for q in range(len(ranks)) if q != sc["extra_rank"]]
            if r == sc["extra_rank"] and (not err or not any(o in err for o in others)):
                unnamed.append(r)
            elif r != sc["extra_rank"] and (err or res["steps"] != sc["steps"]):
                failed.append(r)
        elif err or res["steps"] != sc["steps"]:
            failed.append(r)
    return {"kind": kind, "signals": signals, "timeouts": timeouts, "hung_at_exit": hung_at_exit,
            "bad": bad, "unnamed": unnamed, "failed": failed,
            "ok": not (signals or timeouts or hung_at_exit or bad or unnamed or failed)}


def plan(worlds: list[int], jobs: int, steps: int, kill_jobs: int,
         compute: str) -> list[tuple[str, int, dict[str, Any]]]:
    """``(kind, world, scenario)`` of every job, interleaved so a budget cut keeps variety."""
    out = []
    for j in range(max(jobs, kill_jobs, 1)):
        for n in worlds:
            if j < jobs:
                out.append(("steps", n, {"steps": steps, "compute": compute}))
            if j < kill_jobs:
                out.append(("kill", n, {"steps": steps + 3, "compute": compute,
                                        "kill_rank": n - 1, "kill_step": 2}))
            if j == 0:
                out.append(("teardown", n, {"steps": 2, "compute": "none", "extra_rank": 1}))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=1, help="fresh step jobs per world size")
    p.add_argument("--steps", type=int, default=8, help="compiled steps per job")
    p.add_argument("--worlds", type=int, nargs="*", default=[2, 3])
    p.add_argument("--kill-jobs", type=int, default=1, help="killed-peer jobs per world size")
    p.add_argument("--compute", choices=("inductor", "eager", "none"), default="inductor",
                   help="the compiled step's compute (none: the step runs eagerly)")
    p.add_argument("--job-timeout-s", type=float, default=120.0)
    p.add_argument("--budget-s", type=float, default=1e9,
                   help="launch a job only while 1.3x the longest job so far is left, seconds")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker is not None:
        print(json.dumps(worker(json.loads(ns.worker), ns.rank, ns.world, ns.store)),
              flush=True)
        return 0
    import torch

    jobs = plan(ns.worlds, ns.jobs, ns.steps, ns.kill_jobs, ns.compute)
    out: dict[str, Any] = {"planned": len(jobs), "jobs": [], "args": vars(ns)}
    if not torch.cuda.is_available():
        out.update(ok=None, skipped="no GPU", summary="SKIP (no GPU)")
        print("SKIP: cuda_stress: no GPU")
    else:
        t0, longest = time.monotonic(), 0.0
        for kind, n, sc in jobs:
            left = ns.budget_s - (time.monotonic() - t0)
            if left < 1.3 * longest or left <= 0:  # a job is never cut short by the budget:
                break                               # its timeout is always --job-timeout-s
            t = time.monotonic()
            ranks = run_job(sc, n, ns.job_timeout_s)
            verdict = judge(kind, sc, ranks)
            verdict.update(world=n, seconds=round(time.monotonic() - t, 1),
                           errors=[(x["result"] or {}).get("error") for x in ranks],
                           tails=[x["tail"] for x in ranks] if not verdict["ok"] else None)
            longest = max(longest, verdict["seconds"])
            out["jobs"].append(verdict)
            print(f"{'PASS' if verdict['ok'] else 'FAIL'}: {kind} job, {n} ranks, "
                  f"{verdict['seconds']} s: signals {verdict['signals']}, bad {verdict['bad']}, "
                  f"unnamed {verdict['unnamed']}, failed {verdict['failed']}, "
                  f"timeouts {verdict['timeouts']}, hung at exit {verdict['hung_at_exit']}",
                  flush=True)
            _write(ns.json, out)  # after every job: a run cut short keeps what it had
        ran = out["jobs"]
        out["ok"] = bool(ran) and all(j["ok"] for j in ran)
        out["summary"] = (
            f"{len(ran)} of {len(jobs)} jobs ran; signals {sum(len(j['signals']) for j in ran)}, "
            f"wrong results {sum(j['bad'] for j in ran)}, survivors not naming the dead rank "
            f"{sum(len(j['unnamed']) for j in ran)}, failed ranks "
            f"{sum(len(j['failed']) + len(j['timeouts']) + len(j['hung_at_exit']) for j in ran)}")
        print(out["summary"])
    _write(ns.json, out)
    return 0 if out["ok"] is not False else 1


def _write(path: str | None, out: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
