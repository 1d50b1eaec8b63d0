"""Where a mid-size collective's time goes on fcoll's shm backend, beside the copy ceiling.

Usage (one line): ``python benchmarks/shm_profile.py --nproc 2 --json profile.json``

Two ranks (``--nproc``) run, after a barrier and in lock step, for each size (``--sizes``,
default 256 KiB, 1 MiB, 4 MiB of float32 per rank):

* **ceilings** (every rank at once, single core each, as in a collective): ``copy`` = a
  ``torch.Tensor.copy_`` of the size from private memory into this rank's shared-memory slot;
  ``add`` = ``t.add_(peer_row)`` of the size, the peer's row read from shared memory (the
  reduction of a 2-rank all_reduce); ``ceiling`` = copy + add, the least data movement a
  2-rank all_reduce can do with its input copied in once (read C, write C; read 2C, write C).
* **all_reduce phases** of the one-slot kernel (:func:`fcoll.shm.kernels.one_slot.all_reduce_small`,
  the sizes up to one slot), timed step by step with the kernel's own pieces: ``copy_in``
  (``mine.copy_(t)``), ``exchange`` (header, ``arrive``, ``wait_all``, header check: includes
  waiting for the slower rank; the wait's spin allowance, ``Channel.transfer_s``, is the one
  ``Engine.run_now`` gives the kernel), ``reduce`` (``reduce_pair_inplace``). Sizes above a
  slot have no one-slot kernel and show the whole call only.
* **whole calls** through c10d (``dist.all_reduce``, ``all_gather_into_tensor``,
  ``reduce_scatter_tensor``), with per call the minor page faults (``getrusage``) and the
  channel's waits that spun, slept, or ran out of spin (:attr:`Channel.stats`).

Times are medians over ``--reps`` repetitions of ``--calls`` back-to-back calls (per call,
microseconds), slowest rank; GB/s = bytes / time (1 GB = 1e9 bytes); busbw uses nccl-tests'
factors (all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n). On a shared machine only
compare numbers from one run; the 1-minute load average is printed and stored (``loadavg``).
The JSON holds ``{"loadavg": [before, after], "nproc": n, "rows": [{"size", "what",
"us", "gbps", "faults_per_call", "spun_per_call", "slept_per_call"}]}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from collectives import _make_call, fmt_size, parse_size

from fcoll.ops.reduce import reduce_pair_inplace
from fcoll.shm.kernels import one_slot
from fcoll.shm.transport.segment import NSLOTS
from fcoll.shm.transport.sync import TRANSFER_BYTES_PER_S
from fcoll.testing import run_ranks

KiB, MiB = 1 << 10, 1 << 20
SIZES = [256 * KiB, 1 * MiB, 4 * MiB]
PROFILED_OPS = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _median_us(fn, calls: int, reps: int) -> tuple[float, float]:
    """(median us per call over reps, minor faults per call) of ``fn`` after a barrier."""
    times, faults = [], 0
    for _ in range(reps):
        dist.barrier()
        f0 = _faults()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        faults += _faults() - f0
    return statistics.median(times), faults / (calls * reps)


def _phases(pg, t: torch.Tensor, calls: int, reps: int) -> dict[str, float]:
    """Median us of copy_in, exchange and reduce of the one-slot all_reduce of ``t``."""
    eng = pg._engine
    ch = eng.ch
    plan = pg._fast._all_reduce_plan(t, dist.ReduceOp.SUM)
    acc = {"copy_in": [], "exchange": [], "reduce": []}
    clock = time.perf_counter
    for _ in range(reps):
        dist.barrier()
        sums = dict.fromkeys(acc, 0.0)
        for _ in range(calls):
            with eng._lock:
                eng._running = True
            try:
                seq = eng.seq
                eng.seq += 1
                ch.seq = seq
                ch.spin_iters = ch.spin_sync
                ch.transfer_s = t.nbytes / TRANSFER_BYTES_PER_S  # as Engine.run_now sets it
                slot = ch.use % NSLOTS
                ch.use += 1
                mine, peer, _, _ = plan.views[slot]
                t0 = clock()
                mine.copy_(t)
                t1 = clock()
                one_slot.exchange(ch, plan, slot, plan.tail.encode(seq), "profile",
                                  time.monotonic())
                t2 = clock()
                reduce_pair_inplace(t, peer, "sum", ch.rank == 0)
                t3 = clock()
            finally:
                with eng._lock:
                    eng._running = False
            sums["copy_in"] += t1 - t0
            sums["exchange"] += t2 - t1
            sums["reduce"] += t3 - t2
        for k, v in sums.items():
            acc[k].append(v / calls * 1e6)
    return {k: statistics.median(v) for k, v in acc.items()}


def _rank(rank: int, world: int, sizes: list[int], calls: int, reps: int) -> list[dict]:
    import warnings

    warnings.filterwarnings("ignore")
    from fcoll.shm.group.process_group import FcollProcessGroup

    pg = dist.group.WORLD
    if not isinstance(pg, FcollProcessGroup):
        raise TypeError(f"shm_profile needs fcoll's process group, got {type(pg).__name__}")
    ch = pg._engine.ch
    seg = pg._engine.seg
    rows = []

    def add(size: int, what: str, us: float, nbytes_moved: float, faults: float = 0.0,
            stats: tuple[float, float] = (0.0, 0.0)) -> None:
        rows.append({"size": size, "what": what, "us": us,
                     "gbps": nbytes_moved / (us * 1e-6) / 1e9 if us > 0 else 0.0,
                     "faults_per_call": faults, "spun_per_call": stats[0],
                     "slept_per_call": stats[1]})

    for size in sizes:
        numel = size // 4
        t = torch.ones(numel)
        fits = size <= seg.layout.slot_bytes
        if fits:
            slot_row = seg.rows(0, torch.float32)[rank, :numel]
            peer_row = seg.rows(1, torch.float32)[1 - rank, :numel]
            slot_row.copy_(t)
            peer_row.copy_(t)
            x = torch.zeros(numel)
            us, _ = _median_us(functools.partial(slot_row.copy_, t), calls, reps)
            add(size, "ceiling: copy_ into slot", us, size)
            cu = us
            us, _ = _median_us(functools.partial(x.add_, peer_row), calls, reps)
            add(size, "ceiling: add_ from peer row", us, size)
            add(size, "ceiling: copy + add (all_reduce)", cu + us, size)
            for k, v in _phases(pg, torch.ones(numel), calls, reps).items():
                add(size, f"all_reduce phase: {k}", v, size)
        factor = {"all_reduce": 2 * (world - 1) / world}
        for op in PROFILED_OPS:
            call = _make_call(op, size, world, None)
            call()
            s0 = dict(ch.stats)
            us, faults = _median_us(call, calls, reps)
            n = calls * reps
            stats = ((ch.stats["spun"] - s0["spun"]) / n, (ch.stats["slept"] - s0["slept"]) / n)
            add(size, f"{op} (c10d, busbw)", us, size * factor.get(op, (world - 1) / world),
                faults, stats)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sizes", nargs="*", type=parse_size, default=SIZES,
                   help="per-rank bytes (K / M suffixes)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    load0 = os.getloadavg()[0]
    per_rank = run_ranks(_rank, args.nproc, args=(args.sizes, args.calls, args.reps),
                         timeout_s=600)
    load1 = os.getloadavg()[0]
    rows = []
    for i, row in enumerate(per_rank[0]):  # slowest rank per row
        worst = max((r[i] for r in per_rank), key=lambda x: x["us"])
        rows.append({**row, "us": worst["us"], "gbps": worst["gbps"]})
    print(f"fcoll shm profile, {args.nproc} ranks, load average {load0:.2f} -> {load1:.2f}")
    print(f"{'size':>7} {'what':<40} {'us':>9} {'GB/s':>7} {'faults':>7} {'spun':>5} "
          f"{'slept':>5}")
    for r in rows:
        print(f"{fmt_size(r['size']):>7} {r['what']:<40} {r['us']:9.1f} {r['gbps']:7.2f} "
              f"{r['faults_per_call']:7.2f} {r['spun_per_call']:5.2f} "
              f"{r['slept_per_call']:5.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"loadavg": [load0, load1], "nproc": args.nproc, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
