"""A compiled graph's all_reduce through the direct path against the c10d path, side by side.

Usage: ``python benchmarks/executor_path.py --executor [--nproc 2] [--sizes 4K 64K 1M]
[--reps 15] [--json executor_path.json]``

Issue #17.2: the executor issues collectives on fcoll's groups straight into the shared-memory
engine (``fcoll/shm/group/direct.py``) instead of through the op, c10d and the in-flight registry.
Target: all_reduce of 4 KiB at most 25 us per call through the executor's direct path on a
quiet machine, with the c10d path's figure beside it.

Rows, per size (``size`` = bytes of the per-rank input, float32), each a time per call in us:

- ``eager dist.all_reduce``: ``dist.all_reduce(t)`` (synchronous, c10d, fcoll's one-slot fast
  path): the c10d path's floor.
- ``executor c10d path`` / ``executor direct path``: the graph fcoll compiled from
  ``lambda x: fcoll.all_reduce(x, "sum", group)`` (all_reduce, wait_tensor), its executor called
  directly with a boxed input list, built with ``direct_collectives`` False / True: what the
  graph itself costs.
- ``compiled fn c10d path`` / ``compiled fn direct path``: the same through the
  ``torch.compile``'d function (adds Dynamo's guards and AOTAutograd's runtime wrapper).

Method: every repetition runs each row's loop of K calls after a barrier, rows interleaved
(so noise hits all alike); the reported figure is the median over repetitions of the slowest
rank's time per call. Printed: the table, the c10d/direct ratio per size, PASS/FAIL for the
4 KiB target, and the load average (1, 5, 15 min) before and after. JSON: every repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KiB, MiB = 1 << 10, 1 << 20
TARGET_US_4K = 25.0
ROWS = ("eager dist.all_reduce", "executor c10d path", "executor direct path",
        "compiled fn c10d path", "compiled fn direct path")


def _parse_size(text: str) -> int:
    text = text.upper()
    mult = {"K": KiB, "M": MiB}.get(text[-1], 1)
    return int(text[:-1] if text[-1] in "KM" else text) * mult


def _calls_per_rep(size: int) -> int:
    return max(20, min(2000, (4 * MiB) // size))


def _rank_fn(rank: int, world_size: int, sizes: list[int], reps: int) -> dict:
    import torch
    import torch.distributed as dist

    import fcoll
    import fcoll.compile.backend as fb

    torch.set_num_threads(1)
    group = dist.group.WORLD
    executors: list = []
    real = fb.compile_graph

    def capture(gm, example_inputs, config, name):
        executor = real(gm, example_inputs, config, name)
        executors.append(executor)
        return executor
    fb.compile_graph = capture

    def step(x):
        return fcoll.all_reduce(x, "sum", group)

    out: dict = {}
    for size in sizes:
        x = torch.full((size // 4,), float(rank + 1))
        expected = torch.full_like(x, float(sum(range(1, world_size + 1))))
        loops = {}
        t = x.clone()
        loops["eager dist.all_reduce"] = lambda t=t: dist.all_reduce(t)
        for direct in (False, True):
            label = "direct" if direct else "c10d"
            torch._dynamo.reset()
            executors.clear()
            fn = torch.compile(step, backend="fcoll", dynamic=False,
                               options={"direct_collectives": direct})
            got = fn(x)
            if not torch.equal(got, expected):
                raise AssertionError(f"rank {rank}: {label} path gave a wrong result")
            (executor,) = executors
            if bool(executor.direct) != direct:
                raise AssertionError(f"rank {rank}: the {label} executor has direct calls "
                                     f"{list(executor.direct)}")
            res = executor([x])
            if not torch.equal(res[0] if isinstance(res, (list, tuple)) else res, expected):
                raise AssertionError(f"rank {rank}: {label} executor gave a wrong result")
            loops[f"executor {label} path"] = lambda e=executor, x=x: e([x])
            loops[f"compiled fn {label} path"] = lambda f=fn, x=x: f(x)
        k = _calls_per_rep(size)
        times: dict[str, list[float]] = {r: [] for r in ROWS}
        for loop in loops.values():  # warm up every loop
            for _ in range(20):
                loop()
        for _ in range(reps):
            for row in ROWS:
                loop = loops[row]
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    loop()
                times[row].append((time.perf_counter() - t0) / k * 1e6)
        out[size] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--executor", action="store_true",
                    help="the executor-path comparison (the only mode; kept for the issue's "
                         "command line)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sizes", nargs="+", default=["4K", "64K", "1M"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default="executor_path.json")
    args = ap.parse_args()
    sizes = [_parse_size(s) for s in args.sizes]

    from fcoll.testing import run_ranks

    load_before = os.getloadavg()
    per_rank = run_ranks(_rank_fn, args.nproc, backend="fcoll", args=(sizes, args.reps),
                         timeout_s=600)
    load_after = os.getloadavg()
    table: dict[int, dict[str, float]] = {}
    for size in sizes:
        table[size] = {}
        for row in ROWS:
            slowest = [max(r[size][row][i] for r in per_rank) for i in range(args.reps)]
            table[size][row] = statistics.median(slowest)
    head = f"{'us per call (median of ' + str(args.reps) + ' reps, slowest rank)':52s}"
    print(head + "".join(f"{_fmt(s):>10s}" for s in sizes))
    for row in ROWS:
        print(f"{row:52s}" + "".join(f"{table[s][row]:10.1f}" for s in sizes))
    for what in ("executor", "compiled fn"):
        print(f"{what + ': c10d / direct':52s}" + "".join(
            f"{table[s][what + ' c10d path'] / table[s][what + ' direct path']:9.2f}x"
            for s in sizes))
    verdict = None
    if 4 * KiB in table:
        us = table[4 * KiB]["executor direct path"]
        verdict = "PASS" if us <= TARGET_US_4K else "FAIL"
        print(f"\n4 KiB all_reduce through the executor's direct path: {us:.1f} us "
              f"(target <= {TARGET_US_4K:g} us on a quiet machine): {verdict}")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} "
          f"({os.cpu_count()} cores, {args.nproc} ranks)")
    with open(args.json, "w") as f:
        json.dump({"median_us": {str(s): v for s, v in table.items()},
                   "per_rank_us": [{str(s): v for s, v in r.items()} for r in per_rank],
                   "target_4k_us": TARGET_US_4K, "verdict_4k": verdict,
                   "load_before": load_before, "load_after": load_after,
                   "nproc": args.nproc, "reps": args.reps}, f, indent=1)
    print(f"wrote {args.json}")


def _fmt(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


if __name__ == "__main__":
    main()
