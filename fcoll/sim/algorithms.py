"""Collective algorithms under the alpha-beta model: time of one collective on n ranks.

Notation: ``n`` ranks, ``S`` bytes per rank by the nccl-tests convention
(:func:`fcoll.ops.facts.comm_bytes`: the larger of one rank's input and output; all_to_all its
input), ``alpha`` microseconds per message, ``B`` bytes per microsecond per rank (each rank
sends and receives at ``B`` at once). Computation (the reduction's arithmetic) is not counted.

Flat algorithms (every step on one link), ring | tree:

- all_reduce: ring ``2(n-1)/n * S/B + 2(n-1) alpha`` | recursive doubling ``L (alpha + S/B)``;
- all_gather: ring ``(n-1)/n * S/B + (n-1) alpha`` | recursive doubling
  ``(n-1)/n * S/B + L alpha``;
- reduce_scatter: ring ``(n-1)/n * S/B + (n-1) alpha`` | recursive halving
  ``(n-1)/n * S/B + L alpha``;
- all_to_all: pairwise exchange ``(n-1)/n * S/B + (n-1) alpha`` (both);
- broadcast: scatter + ring all_gather ``2(n-1)/n * S/B + (log2 n + n-1) alpha`` | binomial
  tree ``L (alpha + S/B)``;

with ``L = ceil(log2 n)``. Sources: R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 19(1), 2005 (their costs of recursive
doubling/halving, pairwise exchange, binomial trees and scatter + all_gather; a
non-power-of-two ``n`` is charged ``ceil(log2 n)`` steps here, a slight under-estimate of
their extra pre/post steps); P. Patarasuk, X. Yuan, "Bandwidth optimal all-reduce algorithms
for clusters of workstations", JPDC 69(2), 2009 (the ring all_reduce's ``2(n-1)/n * S/B`` is the
lower bound on bytes each rank must send). The ring's bandwidth terms are nccl-tests' bus
factors (``doc/PERFORMANCE.md`` of NVIDIA/nccl-tests): busbw = algbw * 2(n-1)/n for all_reduce,
(n-1)/n for all_gather / reduce_scatter / all_to_all.

Hierarchical (:func:`hierarchical_us`, ``g`` ranks per host, ``h`` hosts, ``n = g h``; each
rank talks to the ranks with its local rank on the other hosts: one NIC per rank):

- all_reduce: intra-host reduce_scatter (S) + inter-host all_reduce of a shard (S/g, h ranks)
  + intra-host all_gather (S);
- all_gather (S gathered): inter-host all_gather (S/g gathered, h ranks) + intra-host
  all_gather (S);
- reduce_scatter (S input): intra-host reduce_scatter (S) + inter-host reduce_scatter (S/g);
- all_to_all (S input): intra-host all_to_all that groups each rank's data by destination
  local rank (S) + inter-host all_to_all (S, h ranks);
- broadcast: inter-host broadcast among the root's peers (S, h ranks) + intra-host broadcast.
"""

from __future__ import annotations

import math
from typing import Any

from fcoll.ops.facts import KINDS

__all__ = ["ALGORITHMS", "flat_us", "hierarchical_us", "check_kind"]

#: Flat algorithm names; "hierarchical" composes them per host (:func:`hierarchical_us`).
ALGORITHMS = ("ring", "tree")


def check_kind(kind: str) -> None:
    """Raises:
        ValueError: ``kind`` is not one of :data:`fcoll.ops.facts.KINDS`."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; known: {KINDS}")


def _steps(n: int) -> int:
    return math.ceil(math.log2(n))


def flat_us(kind: str, nbytes: float, n: int, alpha_us: float, bytes_per_us: float,
            algorithm: str) -> float:
    """Time in microseconds of collective ``kind`` of ``nbytes`` (module docstring's ``S``) on
    ``n`` ranks joined by one link, by ``algorithm`` ("ring" or "tree"; table above).

    One rank (or fewer) moves nothing: 0.

    Raises:
        ValueError: unknown ``kind`` or ``algorithm``, negative ``nbytes``, or
            ``bytes_per_us <= 0``.
    """
    check_kind(kind)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {ALGORITHMS}")
    if nbytes < 0:
        raise ValueError(f"{kind}: nbytes must be >= 0, got {nbytes}")
    if bytes_per_us <= 0:
        raise ValueError(f"{kind}: bandwidth must be > 0 bytes/us, got {bytes_per_us}")
    if n <= 1:
        return 0.0
    a, t = alpha_us, nbytes / bytes_per_us
    frac = (n - 1) / n
    if kind == "all_reduce":
        return 2 * frac * t + 2 * (n - 1) * a if algorithm == "ring" else _steps(n) * (a + t)
    if kind in ("all_gather", "reduce_scatter"):
        return frac * t + ((n - 1) if algorithm == "ring" else _steps(n)) * a
    if kind == "all_to_all":
        return frac * t + (n - 1) * a
    # broadcast
    if algorithm == "ring":
        return 2 * frac * t + (math.log2(n) + n - 1) * a
    return _steps(n) * (a + t)


def hierarchical_us(kind: str, nbytes: float, hosts: int, per_host: int, intra: Any,
                    inter: Any, algorithm: str) -> float:
    """Time in microseconds of collective ``kind`` of ``nbytes`` on ``hosts * per_host`` ranks,
    composed per host (module docstring). ``intra`` and ``inter`` are links
    (:mod:`fcoll.sim.links`: ``collective_us(kind, nbytes, ranks, algorithm)``); ``algorithm``
    is the flat algorithm of every phase ("ring" or "tree"; a measured link picks its own).

    Raises:
        ValueError: unknown ``kind``, or ``hosts`` / ``per_host`` below 1.
    """
    check_kind(kind)
    if hosts < 1 or per_host < 1:
        raise ValueError(f"{kind}: hosts and per_host must be >= 1, got {hosts}, {per_host}")
    g, h = per_host, hosts

    def on_host(k: str, b: float) -> float:
        return intra.collective_us(k, b, g, algorithm)

    def across(k: str, b: float) -> float:
        return inter.collective_us(k, b, h, algorithm)

    if kind == "all_reduce":
        return on_host("reduce_scatter", nbytes) + across("all_reduce", nbytes / g) + \
            on_host("all_gather", nbytes)
    if kind == "all_gather":
        return across("all_gather", nbytes / g) + on_host("all_gather", nbytes)
    if kind == "reduce_scatter":
        return on_host("reduce_scatter", nbytes) + across("reduce_scatter", nbytes / g)
    if kind == "all_to_all":
        return on_host("all_to_all", nbytes) + across("all_to_all", nbytes)
    return across("broadcast", nbytes) + on_host("broadcast", nbytes)
