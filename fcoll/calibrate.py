"""``python -m fcoll.calibrate``: calibrate the cost model before a job, so its compiles do not.

Usage::

    python -m fcoll.calibrate --nproc 2 [--backends fcoll gloo] [--max-bytes 64M] [--refresh]
    torchrun --nproc-per-node 2 train.py    # its first compile reads the numbers (rank 0)

It spawns ``--nproc`` local ranks (:func:`fcoll.testing.run_ranks`), calibrates one group of
each backend with the sweep up to ``--max-bytes`` (default: all of
:data:`fcoll.passes.analysis.calibration.SWEEP_BYTES`) and leaves the numbers in the cache
file (:mod:`fcoll.passes.analysis.calibration_cache`: this machine's, or with ``FCOLL_JOB_ID`` set
that job's), keyed by backend, group size and host layout (one host here: a job spanning hosts
calibrates its cross-host groups itself). ``--refresh`` times every size again and rewrites the
file (as ``FCOLL_RECALIBRATE=1`` does inside a job). It prints the fitted curves (median
microseconds per kind and size) and where they were written.

Exit status 2 with ``FCOLL_CALIBRATION_CACHE=0``: the numbers would have nowhere to go.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main"]

_BACKENDS = ("fcoll", "gloo")


def _calibrate_rank(rank: int, world_size: int, backends: list[str], max_bytes: int | None):
    import torch.distributed as dist

    from fcoll.passes.analysis import calibration as cal
    from fcoll.passes.analysis import calibration_cache

    out = {}
    for backend in backends:
        pg = dist.group.WORLD if backend == "fcoll" else dist.new_group(backend=backend)
        t0 = time.perf_counter()
        _, comm = cal.calibrate_group(pg, max_bytes)
        rec = cal.group_calibration(pg)
        out[backend] = {"seconds": time.perf_counter() - t0, "layout": rec.layout,
                        "curves": {k.kind: c.as_points() for k, c in comm.items()},
                        "path": calibration_cache.cache_path(backend, world_size, rec.layout)}
    out["stats"] = cal.calibration_stats()
    return out


def _parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def main(argv: list[str] | None = None) -> int:
    from fcoll.passes.analysis import calibration_cache
    from fcoll.testing import run_ranks

    p = argparse.ArgumentParser(prog="python -m fcoll.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (the job's group size)")
    p.add_argument("--backends", nargs="+", default=list(_BACKENDS), choices=_BACKENDS)
    p.add_argument("--max-bytes", type=_parse_size, default=None,
                   help="largest size to time (4K, 16M, ...); default: the whole sweep")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--refresh", action="store_true",
                   help="time every size again and rewrite the cache file")
    args = p.parse_args(argv)
    job = calibration_cache.cache_identity()
    if job is None:
        print("python -m fcoll.calibrate: FCOLL_CALIBRATION_CACHE=0 turns the cache file off: "
              "the numbers would have nowhere to go", file=sys.stderr)
        return 2
    env = {"FCOLL_RECALIBRATE": "1"} if args.refresh else None
    r0 = run_ranks(_calibrate_rank, args.nproc, backend="fcoll", env=env,
                   args=(args.backends, args.max_bytes), timeout_s=args.timeout_s)[0]
    for backend in args.backends:
        res = r0[backend]
        print(f"{backend}, {args.nproc} ranks, hosts {res['layout']}: {res['seconds']:.2f} s "
              f"-> {res['path']}")
        for kind, pts in res["curves"].items():
            print(f"  {kind:15}" + " ".join(f"{b >> 10}K:{t:.0f}" for b, t in pts))
    print(f"({job}; {r0['stats']['timed_sizes']} sizes timed, "
          f"{r0['stats']['file_hits']} read from the cache file)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
