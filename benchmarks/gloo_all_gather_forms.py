"""gloo's two all_gather entry points for one tensor: ``_allgather_base`` against
``allgather_into_tensor_coalesced`` (the call torch's ``_c10d_functional`` ops make).

fcoll's ops call the coalesced form on every backend but gloo (``fcoll.ops.library.
_gathers_one_by_one``); this measures why. Both forms alternate in one loop (a barrier before
each run), so machine load falls on both alike; the table gives medians (warm-up runs dropped)
and the ratio coalesced / base, and the load average before and after::

    python benchmarks/gloo_all_gather_forms.py --nproc 2 --runs 60 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from fcoll.testing import run_ranks

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)


def _time_forms(rank: int, world_size: int, runs: int, warmup: int) -> dict:
    pg = dist.group.WORLD
    options = torch._C._distributed_c10d.AllgatherOptions
    forms = {"base": lambda out, x: pg._allgather_base(out, x, options()),
             "coalesced": lambda out, x: pg.allgather_into_tensor_coalesced([out], [x],
                                                                            options())}
    medians = {}
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        out = torch.empty(world_size * x.numel())
        times = {name: [] for name in forms}
        for _ in range(runs):
            for name, start in forms.items():
                dist.barrier()
                t0 = time.perf_counter()
                start(out, x).wait()
                times[name].append((time.perf_counter() - t0) * 1e6)
        medians[nbytes] = {name: statistics.median(v[warmup:]) for name, v in times.items()}
    return medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json", help="write the medians here")
    args = ap.parse_args()
    load_before = os.getloadavg()
    medians = run_ranks(_time_forms, args.nproc, backend="gloo", args=(args.runs, args.warmup),
                        timeout_s=900)[0]
    load_after = os.getloadavg()
    print(f"gloo, {args.nproc} ranks, rank 0's medians of {args.runs - args.warmup} runs")
    print(f"{'bytes':>10} {'base us':>10} {'coalesced us':>13} {'coalesced/base':>15}")
    for nbytes, m in medians.items():
        print(f"{nbytes:>10} {m['base']:>10.0f} {m['coalesced']:>13.0f} "
              f"{m['coalesced'] / m['base']:>15.2f}")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nproc": args.nproc, "runs": args.runs, "warmup": args.warmup,
                       "load": [load_before, load_after],
                       "medians_us": {str(k): v for k, v in medians.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
