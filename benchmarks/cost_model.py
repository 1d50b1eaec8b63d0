"""Does the cost model hold? Calibrate, then measure every collective and compare.

Usage: ``python benchmarks/cost_model.py [--nproc 2] [--json out.json] [--ops all_reduce ...]
[--sizes 4K 1M ...] [--tolerance 0.3]``.

Per backend (fcoll's shared-memory backend, and gloo), on ``--nproc`` ranks of this host:

1. calibrate the group from scratch with the whole sweep
   (:func:`fcoll.passes.analysis.calibration.calibrate_group`, the job cache file off), timing it;
2. measure each collective kind (all_reduce, all_gather, reduce_scatter, all_to_all,
   broadcast) at every size (default 4 KiB .. 64 MiB in powers of 2: the calibration's sizes
   and the ones halfway between them in log scale, where the curve interpolates) by this
   script's own loop (:func:`measure`), not the calibration's: per kind, three rounds over the
   sizes (largest first), in each round one untimed call of the cell then its timed calls back
   to back, as a step's buckets of one kind run (each timed call follows one of the same size,
   at every size); each rank's median per cell, and the slowest rank's median is the measured
   time (a step waits for its slowest rank; the root of a broadcast, for one, returns before
   its peers have copied the data out). The collectives are the calibration's calls
   (:func:`fcoll.passes.analysis.calibration.blocking_collective`: the blocking c10d call of each
   kind; on gloo, reduce_scatter is fcoll's all_to_all plus a local sum). Per kind, fcoll then gloo;
3. print per cell the predicted time (the calibrated curve), the measured time, the ratio
   predicted / measured and PASS when it is within ``1 +- tolerance`` (default 30 %), beside
   the previous two-point alpha-beta model (fitted through the same sweep's 16 KiB and 4 MiB
   medians) for comparison, and on fcoll each rank's waits in the cell's timed runs that
   spun / slept (a sleeping wait costs a wake-up: a cell measured in that mode is slower than
   one whose waits spun).

The curves are the same on every rank (checked). Sizes are
nccl-tests' (:func:`fcoll.ops.facts.comm_bytes`): the larger buffer of one rank. The 1-minute
load average is printed before and after, and per backend and kind while it ran; on a shared
machine a cell can fail for noise alone (compare the load), so the verdict is stated per cell
and as a count. The JSON has ``cells`` (one dict per backend, op, size), ``calibration_s``,
``summary`` and ``loadavg``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fcoll.ops.facts import KINDS  # noqa: E402
from fcoll.testing import run_ranks  # noqa: E402
from collectives import (  # noqa: E402  (this folder: the script's own)
    add_wait_increments, fmt_size, parse_size, wait_counts,
)

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB << i for i in range(15)]  # 4 KiB .. 64 MiB


ROUNDS = 3


def runs_per_round(size: int) -> int:
    """Timed calls per cell and round (after one untimed call): more for small, cheap, noisy
    sizes (15 / 9 / 6 in all)."""
    return 5 if size <= 256 * KiB else 3 if size <= 4 * MiB else 2


def measure(pg, kind: str, sizes: list[int]) -> tuple[dict[int, float], dict[int, dict]]:
    """This rank's median time (us) of a blocking ``kind`` collective at each size (the
    module docstring's loop), and on fcoll's backend how its timed runs' waits went (the
    increments of the channel's ``spun`` / ``slept`` / ``spin_failed`` counters: a cell whose
    waits slept pays a wake-up per wait, tens of microseconds, where a spinning one does not).
    A collective call: every rank calls it with the same arguments."""
    from fcoll.passes.analysis import calibration as cal

    ops = {size: cal.blocking_collective(kind, pg, cal.probe_buffers(pg, size))
           for size in sorted(sizes, reverse=True)}
    times: dict[int, list[float]] = {size: [] for size in sizes}
    waits: dict[int, dict] = {}
    for _ in range(ROUNDS):
        for size, op in ops.items():
            op()
            before = wait_counts(pg)
            for _ in range(runs_per_round(size)):
                t0 = time.perf_counter()
                op()
                times[size].append((time.perf_counter() - t0) * 1e6)
            if before is not None:
                add_wait_increments(waits.setdefault(size, {}), before, wait_counts(pg))
    return {size: statistics.median(ts) for size, ts in times.items()}, waits


def _rank(rank: int, world: int, ops: list[str], sizes: list[int]) -> dict:
    import torch.distributed as dist

    from fcoll.passes.analysis import calibration as cal

    groups = {"fcoll": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    out: dict = {"curves": {}, "calibration_s": {}, "measured": {}, "waits": {},
                 "loadavg": {}}
    for backend, pg in groups.items():
        t0 = time.perf_counter()
        _, comm = cal.calibrate_group(pg)   # the whole sweep
        out["calibration_s"][backend] = time.perf_counter() - t0
        out["curves"][backend] = {k.kind: c for k, c in comm.items()}
    for kind in ops:
        load0 = os.getloadavg()[0]
        for backend, pg in groups.items():
            medians, waits = measure(pg, kind, sizes)
            for size, us in medians.items():
                out["measured"][(backend, kind, size)] = us
                if size in waits:
                    out["waits"][(backend, kind, size)] = waits[size]
        out["loadavg"][kind] = (load0, os.getloadavg()[0])
    return out


def _two_point(curve, size: int) -> float:
    """The previous model: one alpha-beta through the sweep's 16 KiB and 4 MiB medians."""
    from fcoll.passes.analysis.comm_cost import fit_alpha_beta

    b1, b2 = 16 * KiB, 4 * MiB
    line = fit_alpha_beta([(b1, curve.time_us(b1)), (b2, curve.time_us(b2))],
                          nonnegative=True)
    return line.time_us(size)


def report(results: list[dict], ops: list[str], sizes: list[int], tol: float) -> dict:
    """The table and summary; ``results`` are every rank's (measured: the slowest rank's)."""
    r0 = results[0]
    if any(r["curves"] != r0["curves"] for r in results):
        print("WARNING: the ranks' calibrated curves differ (they must not)")
    cells, lines = [], []
    head = (f"{'backend':7} {'op':14} {'size':>7} {'pred_us':>10} {'meas_us':>10} "
            f"{'ratio':>6} {'':4}  {'2pt_us':>10} {'ratio':>6} {'':4}  waits spun/slept")
    for backend in ("fcoll", "gloo"):
        lines.append(head)
        for kind in ops:
            curve = r0["curves"][backend][kind]
            for size in sizes:
                per_rank = [r["measured"][(backend, kind, size)] for r in results]
                meas = max(per_rank)
                pred, old = curve.time_us(size), _two_point(curve, size)
                ok, old_ok = abs(pred / meas - 1) <= tol, abs(old / meas - 1) <= tol
                waits = [r["waits"].get((backend, kind, size)) for r in results]
                cells.append({"backend": backend, "op": kind, "bytes": size,
                              "predicted_us": pred, "measured_us": meas, "ratio": pred / meas,
                              "measured_us_per_rank": per_rank, "waits_per_rank": waits,
                              "pass": ok, "two_point_us": old, "two_point_pass": old_ok})
                spun_slept = " ".join(f"{w['spun']}/{w['slept']}" for w in waits if w)
                lines.append(f"{backend:7} {kind:14} {fmt_size(size):>7} {pred:10.1f} "
                             f"{meas:10.1f} {pred / meas:6.2f} {'PASS' if ok else 'FAIL':4}  "
                             f"{old:10.1f} {old / meas:6.2f} {'PASS' if old_ok else 'FAIL':4}"
                             f"  {spun_slept}")
            la = r0["loadavg"][kind]
            lines.append(f"  ({backend} {kind}: load average {la[0]:.2f} -> {la[1]:.2f})")
    print("\n".join(lines))
    summary = {}
    for backend in ("fcoll", "gloo"):
        mine = [c for c in cells if c["backend"] == backend]
        errs = sorted(abs(c["ratio"] - 1) for c in mine)
        from fcoll.passes.analysis.calibration import SWEEP_BYTES

        at = [c for c in mine if c["bytes"] in SWEEP_BYTES]
        summary[backend] = {
            "cells": len(mine), "pass": sum(c["pass"] for c in mine),
            "at_calibrated_sizes": [sum(c["pass"] for c in at), len(at)],
            "two_point_pass": sum(c["two_point_pass"] for c in mine),
            "median_abs_error": statistics.median(errs), "max_abs_error": errs[-1],
            "calibration_s": r0["calibration_s"][backend]}
    print(f"\nwithin +-{tol:.0%} of the slowest rank's measured median (piecewise curve | "
          f"previous two-point alpha-beta):")
    for backend, s in summary.items():
        print(f"  {backend:6} {s['pass']:3}/{s['cells']} | {s['two_point_pass']:3}/{s['cells']}"
              f"   median |pred/meas - 1| {s['median_abs_error']:.0%}, worst "
              f"{s['max_abs_error']:.0%}; full calibration sweep {s['calibration_s']:.2f} s")
        hit, n = s["at_calibrated_sizes"]
        print(f"         at the calibrated sizes (a re-test of the calibration: noise, not the "
              f"fit): {hit}/{n}; between them (interpolation): "
              f"{s['pass'] - hit}/{s['cells'] - n}")
    return {"cells": cells, "summary": summary}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--ops", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--sizes", nargs="+", type=parse_size, default=SIZES)
    p.add_argument("--tolerance", type=float, default=0.30)
    p.add_argument("--json", default=None)
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)
    os.environ["FCOLL_CALIBRATION_CACHE"] = "0"   # calibrate from scratch (ranks inherit it)
    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}"
          f" ({os.cpu_count()} cores), {args.nproc} ranks")
    results = run_ranks(_rank, args.nproc, backend="fcoll", args=(args.ops, args.sizes),
                        timeout_s=args.timeout_s)
    out = report(results, args.ops, args.sizes, args.tolerance)
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    out["loadavg"] = {"before": load_before, "after": load_after,
                      "per_op": results[0]["loadavg"]}
    out["calibration_s"] = results[0]["calibration_s"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
