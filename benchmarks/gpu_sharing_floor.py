"""The floor of any collective between processes that share one GPU: a GPU hand-off.

Ranks that share a GPU without MPS are time-sliced: the GPU runs one process's context at a
time. A collective needs each rank's kernels to run after the others' (its input copied, then
read by the peers), so its latency is at least one round of context switches. This measures:

* ``alone``: one process, ``{tiny kernel; cuda synchronize}`` per iteration;
* ``side by side``: k processes doing the same at once (no communication);
* ``ping-pong``: 2 processes take turns, ``{wait for the peer (host flag); tiny kernel;
  cuda synchronize; hand the turn over}``: the time of one hand-off of the GPU between
  processes and the host, which a one-shot all_reduce on the IPC path needs at least twice.

Usage: ``python benchmarks/gpu_sharing_floor.py [--iters 2000] [--json out.json]``. Prints a
table of median microseconds per iteration and writes JSON. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time


def _work(role: str, k: int, idx: int, iters: int, barrier, flags, out) -> None:
    import torch

    torch.cuda.set_device(0)
    x = torch.zeros(1, device="cuda")
    for _ in range(50):
        x.add_(1)
        torch.cuda.synchronize()
    barrier.wait()
    times = []
    if role == "pingpong":
        for i in range(iters):
            t0 = time.perf_counter()
            while flags[0] % 2 != idx:  # whose turn
                pass
            x.add_(1)
            torch.cuda.synchronize()
            flags[0] += 1
            times.append(time.perf_counter() - t0)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            x.add_(1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    out.put((idx, statistics.median(times) * 1e6))


def run(role: str, k: int, iters: int) -> float:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(k)
    flags = ctx.Array("q", [0], lock=False)
    out = ctx.Queue()
    procs = [ctx.Process(target=_work, args=(role, k, i, iters, barrier, flags, out))
             for i in range(k)]
    for p in procs:
        p.start()
    res = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return max(v for _, v in res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    print(f"# load average {os.getloadavg()}")
    rows = {
        "alone (1 process)": run("plain", 1, a.iters),
        "side by side (2 processes)": run("plain", 2, a.iters),
        "ping-pong (2 processes, per turn)": run("pingpong", 2, a.iters),
    }
    print(f"{'case':40s} {'median us / iteration':>22s}")
    for name, us in rows.items():
        print(f"{name:40s} {us:22.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
