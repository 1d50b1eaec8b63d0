"""The inter-host link as gloo sees it: effective bandwidth and latency to give ``--inter``.

A link's nominal rate is not what a collective gets from it: gloo's TCP transport on a shared
CPU, a tbf bucket, the kernel's copies all take their share, often most of it. This module
measures it: ``python -m fcoll.launch ... -m fcoll.sim.linkprobe --out FILE`` times gloo's
all_reduce of float32 tensors of several sizes on the world group (run it with one rank per
host, so every step crosses the link), and :func:`fit_ring_link` fits the ring model
:func:`fcoll.sim.algorithms.flat_us` uses,

    t(S) = 2 (n - 1) * alpha + 2 (n - 1) / n * S / bandwidth

(Patarasuk & Yuan 2009; the nccl-tests busbw convention: busbw = 2 (n - 1) / n * S / t), by
least squares over the sizes' medians (:func:`fcoll.passes.analysis.comm_cost.fit_alpha_beta`).
Rank 0 writes ``{"spec": "<GB/s>GB/s,<us>us", "alpha_us", "bandwidth_GBps", "points": [[bytes,
median_us], ...], "world_size"}``; ``spec`` is what ``--inter`` takes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence

from fcoll.passes.analysis.comm_cost import fit_alpha_beta

__all__ = ["PROBE_SIZES", "fit_ring_link", "link_spec", "main"]

#: Bytes per all_reduce: small enough for a 1 gbit link in seconds, large enough for its rate.
PROBE_SIZES = (64 << 10, 1 << 20, 4 << 20, 16 << 20)


def fit_ring_link(points: Sequence[tuple[float, float]], ranks: int) -> tuple[float, float]:
    """(alpha in us, bandwidth in bytes per us) of a ring all_reduce on ``ranks`` ranks whose
    time is ``points`` = ``[(bytes, us), ...]`` (module docstring): the alpha-beta line of
    ``t = 2 (n-1) alpha + x / bandwidth`` with ``x = 2 (n-1)/n * bytes``, fitted by
    :func:`fcoll.passes.analysis.comm_cost.fit_alpha_beta` (least squares of absolute errors:
    the large sizes, where a step's communication time is, set the bandwidth; relative errors
    would let one fast small-size point put the bandwidth above the line rate). A negative
    intercept (noise at small sizes) is clipped to alpha = 0 and the bandwidth refitted
    through the origin.

    Raises:
        ValueError: fewer than two distinct sizes, ``ranks`` < 2, or times that do not grow
            with size (no bandwidth to fit).
    """
    if ranks < 2:
        raise ValueError(f"fit_ring_link: ranks must be >= 2 (one rank moves nothing), got "
                         f"{ranks}")
    if len({s for s, _ in points}) < 2:
        raise ValueError(f"fit_ring_link: need at least two distinct sizes, got {points}")
    per_link = [(2 * (ranks - 1) / ranks * s, t) for s, t in points]
    if fit_alpha_beta(per_link).beta_us_per_byte <= 0:
        raise ValueError(f"fit_ring_link: times do not grow with size: {points}")
    line = fit_alpha_beta(per_link, nonnegative=True)
    return line.alpha_us / (2 * (ranks - 1)), 1.0 / line.beta_us_per_byte


def link_spec(alpha_us: float, bandwidth_bytes_per_us: float) -> str:
    """``--inter`` text for a fitted link: ``'0.1181GB/s,312.5us'`` (GB/s = 1e3 bytes/us)."""
    return f"{bandwidth_bytes_per_us / 1e3:.4g}GB/s,{alpha_us:.4g}us"


def _time_all_reduce(size: int, reps: int) -> float:
    """Median microseconds of ``reps`` gloo all_reduces of ``size`` bytes (float32), each
    behind a barrier, after one warm-up."""
    import torch
    import torch.distributed as dist

    x = torch.ones(size // 4)
    times = []
    for i in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if i:
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    """Run on every rank (under a launcher, ``init_process_group("gloo")`` from the
    environment); rank 0 writes ``--out``."""
    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m fcoll.sim.linkprobe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file rank 0 writes")
    p.add_argument("--sizes", nargs="+", type=int, default=list(PROBE_SIZES), help="bytes")
    p.add_argument("--reps", type=int, default=5,
                   help="timed all_reduces per size (4x this up to 1 MiB)")
    opts = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    # small sizes are cheap and the noisiest (a loaded host's scheduling): 4x the repetitions
    points = [(size, _time_all_reduce(size, opts.reps * (4 if size <= 1 << 20 else 1)))
              for size in sorted(opts.sizes)]
    if dist.get_rank() == 0:
        alpha, bw = fit_ring_link(points, n)
        with open(opts.out, "w", encoding="utf-8") as f:
            json.dump({"spec": link_spec(alpha, bw), "alpha_us": alpha,
                       "bandwidth_GBps": bw / 1e3, "points": points, "world_size": n}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
