"""PyTorch's ``DistributedDataParallel`` run eagerly on fcoll's process group and on gloo.

Usage: ``python benchmarks/ddp_eager.py [--steps 200] [--rounds 3] [--layers 8] [--width 256]
[--bucket-cap-mb 0.5] [--background-load N] [--json ddp_eager.json]``

The step: ``DDP(nn.Sequential(Linear(width, width) x layers), bucket_cap_mb=...)`` on a batch
of 32, ``model(x).sum().backward()``, 2 ranks. With the defaults (8 layers of 256 x 256
float32, 0.25 MiB each with its bias) DDP makes 4 buckets of about 0.5 MiB: DDP's reducer
issues each bucket's all_reduce from the backward, asks for its future (and, with a
communication hook, chains ``then`` callbacks on it) and waits for every future at the end of
the backward. This is the path where a backend's futures cost most: one completion per bucket
per step, on the step's critical path.

Variants, each a DDP step on one of the two process groups of the same ranks (fcoll's default
group and a gloo group made with ``new_group(backend="gloo")``), in alternating rounds so the
machine's drift hits every variant alike:

- ``allreduce``: DDP's default (the reducer's built-in all_reduce, one future per bucket);
- ``fp16``: ``fp16_compress_hook`` (a ``then`` callback per bucket decompresses);
- ``blocking``: a hook that all_reduces the bucket with a blocking ``dist.all_reduce`` inside
  the hook (on the backward's thread, no overlap) and returns it done: what the asynchronous
  hand-off to the backend's threads gains or costs;
- ``nocomm``: DDP with a hook that returns the bucket unreduced in a completed future: the
  reducer's own cost (bucket copies, autograd hooks) without communication, the same on both
  groups (run on fcoll's);
- ``local``: the same model without DDP: the compute floor.

Prints per variant the median step (ms, the slower rank's median of ``--steps`` steps after
10 warm-up steps, then the median over rounds), the ratio gloo/fcoll and fcoll's step over
the local floor; writes ``{"variants": {name: {"fcoll_ms", "gloo_ms", ...}}, "nocomm_ms",
"local_ms", "loadavg"}`` to JSON.

Measured 2026-11-28 (2 ranks, 2 vCPUs, quiet, 2 rounds, this script run on the tree before
and after commit d04a67b, alternating): completing futures on threads of fcoll's own costs
nothing that the step shows: ``allreduce`` 3.89-4.05 ms after against 3.89-3.92 before with 1
thread per rank, 6.37-6.44 against 6.01-6.54 with 2; gloo 6.6-7.8 and 8.8-9.9 ms.

Where fcoll's eager DDP step goes (same day, 1 thread per rank): ``blocking`` beats DDP's own
asynchronous all_reduce on fcoll's group, 3.1-3.6 ms against 4.3-6.1 in the same runs (load
1-3), and 7.0-7.4 against 8.3-8.6 with ``--background-load 2``; with 25 MiB buckets (``--width 1024
--bucket-cap-mb 25``) the two are even. With one core per rank there is no core for the
group's worker: its collective runs beside the backward on the backward's core, and each of its
phases that sleeps waits for the scheduler to preempt the backward (gloo, whose threads do the
same, is 2x slower still). fcoll does not run asynchronous collectives on the issuing thread
to save that: a program may issue asynchronous collectives on two groups in different orders on
different ranks (gloo and NCCL progress each group on its own), which would then deadlock.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from collectives import BackgroundLoad  # noqa: E402  (benchmarks/ is not a package)
from fcoll.testing import run_ranks  # noqa: E402

HOOKS = ("allreduce", "fp16", "blocking")


def _steps_ms(model, x, steps: int, barrier) -> float:
    """This rank's median step, ms, after 10 warm-up steps (ranks start each batch together)."""
    for _ in range(10):
        model(x).sum().backward()
    barrier()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model(x).sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _no_communication(state, bucket):
    """A DDP communication hook that communicates nothing: the bucket as it is, done."""
    import torch
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _blocking_all_reduce(pg, bucket):
    """A DDP communication hook: the bucket's average by a blocking all_reduce, done."""
    import torch
    import torch.distributed as dist
    buf = bucket.buffer()
    dist.all_reduce(buf, group=pg)
    buf.div_(dist.get_world_size(pg))
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _rank(rank: int, world: int, a: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(a["threads"])
    groups = {"fcoll": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    x = torch.randn(32, a["width"], generator=torch.Generator().manual_seed(rank))

    def module():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(a["width"], a["width"]) for _ in range(a["layers"])])

    out: dict[str, list[float]] = {}
    for _ in range(a["rounds"]):
        for hook in HOOKS:
            for name, pg in groups.items():
                m = DDP(module(), process_group=pg, bucket_cap_mb=a["bucket_cap_mb"])
                if hook == "fp16":
                    m.register_comm_hook(pg, default_hooks.fp16_compress_hook)
                elif hook == "blocking":
                    m.register_comm_hook(pg, _blocking_all_reduce)
                out.setdefault(f"{hook}/{name}", []).append(
                    _steps_ms(m, x, a["steps"], lambda: dist.barrier(group=pg)))
                del m
        m = DDP(module(), bucket_cap_mb=a["bucket_cap_mb"])
        m.register_comm_hook(None, _no_communication)
        out.setdefault("nocomm", []).append(_steps_ms(m, x, a["steps"], lambda: dist.barrier()))
        out.setdefault("local", []).append(
            _steps_ms(module(), x, a["steps"], lambda: dist.barrier()))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads per rank (torchrun's OMP_NUM_THREADS default: 1)")
    p.add_argument("--bucket-cap-mb", type=float, default=0.5)
    p.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="busy processes beside the ranks while measuring")
    p.add_argument("--json", default="ddp_eager.json")
    a = p.parse_args(argv)
    for opt in ("steps", "rounds", "layers", "width", "threads"):
        if getattr(a, opt) < 1:
            p.error(f"--{opt} must be at least 1, got {getattr(a, opt)}")
    if not (a.bucket_cap_mb > 0 and math.isfinite(a.bucket_cap_mb)):
        p.error(f"--bucket-cap-mb must be a positive number of MiB, got {a.bucket_cap_mb}")
    load0 = os.getloadavg()[0]
    with BackgroundLoad(a.background_load):
        per_rank = run_ranks(_rank, 2, args=(vars(a),), timeout_s=1800)
    load1 = os.getloadavg()[0]

    def step_ms(key: str) -> float:  # the slower rank per round, then the median of rounds
        return statistics.median(max(r[key][i] for r in per_rank) for i in range(a.rounds))

    local, nocomm = step_ms("local"), step_ms("nocomm")
    print(f"eager DDP, 2 ranks, {a.layers} x Linear({a.width}, {a.width}), bucket cap "
          f"{a.bucket_cap_mb} MiB, {a.threads} thread(s) per rank, {a.steps} steps x "
          f"{a.rounds} rounds, background load {a.background_load}, loadavg {load0:.2f} -> "
          f"{load1:.2f}")
    print(f"{'variant':>10} | {'fcoll ms':>9} {'gloo ms':>9} {'gloo/fcoll':>10} "
          f"{'fcoll/local':>11}")
    variants = {}
    for hook in HOOKS:
        f, g = step_ms(f"{hook}/fcoll"), step_ms(f"{hook}/gloo")
        variants[hook] = {"fcoll_ms": f, "gloo_ms": g, "gloo_over_fcoll": g / f,
                          "fcoll_over_local": f / local,
                          "fcoll_rounds_ms": [max(r[f"{hook}/fcoll"][i] for r in per_rank)
                                              for i in range(a.rounds)]}
        print(f"{hook:>10} | {f:9.3f} {g:9.3f} {g / f:9.2f}x {f / local:10.2f}x")
    print(f"{'nocomm':>10} | {nocomm:9.3f}   (DDP whose hook communicates nothing)")
    print(f"{'local':>10} | {local:9.3f}   (the same model without DDP)")
    with open(a.json, "w") as fh:
        json.dump({"args": vars(a), "variants": variants, "nocomm_ms": nocomm, "local_ms": local,
                   "loadavg": [load0, load1]}, fh, indent=2)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
