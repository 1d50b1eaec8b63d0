"""Communication cost: time of one collective from its kind, group, link and bytes. Pure: this
module measures nothing (:mod:`fcoll.passes.analysis.calibration` measures) and never communicates.

The model is a **piecewise alpha-beta** (Hockney) curve per ``(backend, kind, group size,
link)``. A plain ``t = alpha + beta * bytes`` (R. W. Hockney, "The communication challenge for
MPP: Intel Paragon and Meiko CS-2", Parallel Computing 20(3), 1994) does not fit one backend
over 4 KiB .. 64 MiB: fcoll's shared-memory backend has a one-slot fast path, then slot-size
chunking, then leaves the caches for DRAM, and each regime has its own latency and bandwidth
(one line through two sizes misjudges the sizes between them by an order of magnitude). Like
LogGP's successors that measure the parameters as functions of the message size (PLogP: T.
Kielmann, H. Bal, K. Verstoep, "Fast measurement of LogP parameters for message passing
platforms", IPDPS 2000) and NCCL's tuner, which keeps one alpha-beta per protocol and picks by
size, each size range gets its own alpha-beta:

- the calibration measures the median time ``t_i`` at sizes ``s_0 < s_1 < ... < s_k``
  (:data:`fcoll.passes.analysis.calibration.SWEEP_BYTES`: 4 KiB .. 64 MiB, powers of 4 and 2 MiB);
- the times are made non-decreasing in size by their lower envelope from the right, ``t_i :=
  min(t_j for j >= i)``, so that noise never makes a larger message cheaper (the bucket planner
  compares ``t(a) + t(b)`` with ``t(a + b)``); the minimum, not a least-squares (isotonic)
  pooling, because on a shared machine interference only ever adds time: a size whose median
  caught a burst of load is lowered to what a larger message took, instead of raising its
  neighbours (pooling spreads one burst over every size around it);
- between ``s_i`` and ``s_{i+1}``: ``t = alpha_i + beta_i * bytes`` through the two points;
- below ``s_0``: the first segment's alpha-beta if its alpha is >= 0; else ``t_0`` flat (a
  message smaller than the smallest one measured costs at least the latency, not less: a noisy
  first segment would otherwise price a tiny collective near zero, and such near-free
  collectives tip bucket plans);
- above ``s_k``: the last segment's alpha-beta (bandwidth-bound extrapolation).

``bytes`` is :func:`fcoll.ops.facts.comm_bytes`' (nccl-tests') size of one collective: the
larger of its input and output on this rank.

Links: ``"intra"`` for a group whose ranks share one host, ``"inter"`` for a group that spans
hosts (its end-to-end time, whatever the algorithm), so that a hierarchical group's two levels
and a flat cross-host group are never mixed up with a one-host group of the same size.

Public API for other layers (the hierarchical groups' planner, ``fcoll.sim``):
:class:`CommTable` ``.time_us(backend, kind, group_size, nbytes, link)`` and
:func:`comm_time_us` (the same with defaults for missing entries), :class:`CommCurve`
``.time_us(nbytes)`` and ``.segment(nbytes)`` (the alpha-beta in force at a size).
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple, Sequence, Union

from fcoll.ops.facts import KINDS, busbw_factor

__all__ = ["LINKS", "CommKey", "CommParams", "CommCurve", "CommTable", "Comm",
           "default_comm", "comm_time_us", "lower_envelope", "fit_alpha_beta", "describe",
           "MIN_BETA_US_PER_BYTE"]

#: Link kinds: one host (shared memory, loopback), or a group spanning hosts.
LINKS = ("intra", "inter")


class CommKey(NamedTuple):
    """Key of one calibrated curve: backend name ("fcoll", "gloo", ...), collective kind
    (:data:`fcoll.ops.facts.KINDS`), ranks in the group, link (:data:`LINKS`)."""

    backend: str
    kind: str
    group_size: int
    link: str = "intra"


@dataclass(frozen=True)
class CommParams:
    """One alpha-beta segment: ``time_us(nbytes) = alpha_us + beta_us_per_byte * nbytes``.

    Attributes:
        alpha_us: latency, microseconds (>= 0 for fitted segments).
        beta_us_per_byte: inverse bandwidth, microseconds per byte (1 / algbw).
    """

    alpha_us: float
    beta_us_per_byte: float

    def time_us(self, nbytes: int) -> float:
        """Microseconds for a collective of ``nbytes`` bytes."""
        return self.alpha_us + self.beta_us_per_byte * nbytes


def lower_envelope(values: Sequence[float]) -> list[float]:
    """The largest non-decreasing sequence not above ``values``: ``out[i] = min(values[i:])``
    (times in order of size; the module docstring says why the minimum)."""
    out, low = [], math.inf
    for v in reversed(values):
        low = min(low, float(v))
        out.append(low)
    return out[::-1]


#: The smallest inverse bandwidth a nonnegative fit returns (1e-9 us/byte = 1 PB/s): a larger
#: message measured faster than a smaller one is noise, not a free byte.
MIN_BETA_US_PER_BYTE = 1e-9


def fit_alpha_beta(points: Sequence[tuple[float, float]], *,
                   nonnegative: bool = False) -> CommParams:
    """The alpha-beta (Hockney) line ``t = alpha + beta * x`` through ``points`` =
    ``[(x, t_us), ...]``: through both points for two, by least squares for more (absolute
    errors, so the large sizes, where most of the time is, set beta). ``x`` is the caller's
    size: bytes for a curve segment, the bytes a ring moves per link for a link fit.

    The one fitter of fcoll: :meth:`CommCurve.segment` (a segment through two neighbouring
    sizes of a curve, as fitted), :func:`fcoll.sim.linkprobe.fit_ring_link` and
    ``benchmarks/cost_model.py`` (``nonnegative=True``).

    Args:
        points: at least two distinct ``x``.
        nonnegative: a line usable as a cost: where the fitted alpha is negative (noise at
            small sizes), the least-squares line through the origin instead (alpha 0); beta at
            least :data:`MIN_BETA_US_PER_BYTE`.

    Raises:
        ValueError: fewer than two distinct ``x``.
    """
    if len(points) == 2:
        (x1, t1), (x2, t2) = points
        if x1 == x2:
            raise ValueError(f"fit_alpha_beta: need at least two distinct sizes, got {points}")
        beta = (t2 - t1) / (x2 - x1)
        alpha = t1 - beta * x1
    else:
        if len({x for x, _ in points}) < 2:
            raise ValueError(f"fit_alpha_beta: need at least two distinct sizes, got {points}")
        xs, ts = [x for x, _ in points], [t for _, t in points]
        mx, mt = statistics.fmean(xs), statistics.fmean(ts)
        beta = (sum((x - mx) * (t - mt) for x, t in zip(xs, ts))
                / sum((x - mx) ** 2 for x in xs))
        alpha = mt - beta * mx
    if nonnegative:
        if alpha < 0:
            alpha = 0.0
            beta = sum(x * t for x, t in points) / sum(x * x for x, _ in points)
        beta = max(beta, MIN_BETA_US_PER_BYTE)
    return CommParams(alpha, beta)


@dataclass(frozen=True)
class CommCurve:
    """Piecewise alpha-beta through measured points (the module docstring's formula).

    Attributes:
        sizes: message sizes in bytes, strictly increasing, at least two.
        times_us: fitted (non-decreasing) microseconds at each size.
        source: where the numbers come from, for logs ("calibration file PATH", "timed now
            ..."; set by :mod:`fcoll.passes.analysis.calibration`); not compared.

    Build one with :meth:`fit` from raw measurements.
    """

    sizes: tuple[int, ...]
    times_us: tuple[float, ...]
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if len(self.sizes) < 2 or len(self.sizes) != len(self.times_us):
            raise ValueError(f"CommCurve: needs at least two (size, time) points of equal count, "
                             f"got sizes={self.sizes} times_us={self.times_us}")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])) or self.sizes[0] <= 0:
            raise ValueError(f"CommCurve: sizes must be positive and strictly increasing, "
                             f"got {self.sizes}")
        if any(not math.isfinite(t) or t < 0 for t in self.times_us):
            raise ValueError(f"CommCurve: times must be finite and >= 0 us, got {self.times_us}")

    @classmethod
    def fit(cls, points: Iterable[tuple[int, float]]) -> "CommCurve":
        """The curve of measured ``(bytes, microseconds)`` points: sorted by size, times made
        non-decreasing (:func:`lower_envelope`). Two points give one alpha-beta line.

        Raises:
            ValueError: fewer than two distinct sizes, a size <= 0, a time < 0 or not finite.
        """
        pts = sorted((int(b), float(t)) for b, t in points)
        if len({b for b, _ in pts}) != len(pts):
            raise ValueError(f"CommCurve.fit: duplicate sizes in {pts}")
        return cls(tuple(b for b, _ in pts), tuple(lower_envelope([t for _, t in pts])))

    def segment(self, nbytes: int) -> CommParams:
        """The alpha-beta in force at ``nbytes``: the segment of the two measured sizes around
        it, the first below the smallest (the smallest size's time, flat, where the first
        segment's alpha is negative), the last above the largest; where that last segment is
        flat, the line from the smallest to the largest point instead.

        A flat segment is the lower envelope's doing (two medians of different sizes are never
        equal): a slow outlier lowered to the next size's time (a 256 KiB cell measured at 4 ms
        given 1 MiB's 1.9 ms). Extended as it is, it priced every larger message at the largest
        size's time (a 12 MiB bucket as 1 MiB); no link moves bytes for free above its measured
        range, so the curve's average time per byte continues it."""
        s, t = self.sizes, self.times_us
        i = min(max(bisect.bisect_right(s, nbytes) - 1, 0), len(s) - 2)
        line = fit_alpha_beta(((s[i], t[i]), (s[i + 1], t[i + 1])))
        if i == 0 and nbytes < s[0] and line.alpha_us < 0:
            return CommParams(t[0], 0.0)
        if nbytes > s[-1] and t[-1] == t[-2] and t[-1] > t[0]:
            overall = (t[-1] - t[0]) / (s[-1] - s[0])
            return CommParams(t[-1] - overall * s[-1], overall)
        return line

    def time_us(self, nbytes: int) -> float:
        """Microseconds for one collective of ``nbytes`` bytes (never negative)."""
        return max(self.segment(nbytes).time_us(nbytes), 0.0)

    @property
    def alpha_us(self) -> float:
        """Latency, the time of an empty message: the first segment's alpha, or the smallest
        size's time where that alpha is negative."""
        return self.segment(0).alpha_us

    @property
    def beta_us_per_byte(self) -> float:
        """Inverse bandwidth of the largest messages: the last segment's beta."""
        return self.segment(self.sizes[-1]).beta_us_per_byte

    def as_points(self) -> list[list[float]]:
        """``[[bytes, us], ...]`` (JSON-friendly)."""
        return [[b, t] for b, t in zip(self.sizes, self.times_us)]


def describe(comm_time: object, nbytes: int) -> str:
    """The alpha-beta in force at ``nbytes`` and where it comes from, for DEBUG logs:
    ``"alpha 14.2 us, beta 5.10 GB/s at 1048576 B (calibration file /tmp/...json)"``.

    Args:
        comm_time: a :class:`CommCurve` or :class:`CommParams`, or its bound ``time_us``
            (what the bucket planner holds); anything else is described as "a user curve".
        nbytes: message bytes.
    """
    curve = getattr(comm_time, "__self__", comm_time)
    if isinstance(curve, CommCurve):
        seg, source = curve.segment(nbytes), curve.source or "a fitted curve"
    elif isinstance(curve, CommParams):
        seg, source = curve, "defaults (default_comm: no calibration for this group)"
    else:
        return "a user curve"
    gbps = 1e-3 / seg.beta_us_per_byte if seg.beta_us_per_byte > 0 else math.inf
    return (f"alpha {seg.alpha_us:.1f} us, beta {gbps:.2f} GB/s at {nbytes} B "
            f"({source})")


#: What a table entry may be: a fitted curve, or one alpha-beta (defaults, hand-made models).
Comm = Union[CommCurve, CommParams]


def default_comm(kind: str, group_size: int) -> CommParams:
    """Deterministic defaults: 30 us latency, 1 GB/s bus bandwidth, with the nccl-tests bus
    factor (:func:`fcoll.ops.facts.busbw_factor`) of ``max(group_size, 2)`` ranks, so that an
    unknown or one-rank group still costs something.

    Raises:
        ValueError: ``kind`` is not one of :data:`fcoll.ops.facts.KINDS`.
    """
    return CommParams(alpha_us=30.0, beta_us_per_byte=busbw_factor(kind, max(group_size, 2)) / 1e3)


def _check(kind: str, link: str, nbytes: int, group_size: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"comm_time_us: unknown collective kind {kind!r}; known: {KINDS}")
    if link not in LINKS:
        raise ValueError(f"comm_time_us: link must be one of {LINKS}, got {link!r}")
    if nbytes < 0:
        raise ValueError(f"comm_time_us: nbytes must be >= 0, got {nbytes} ({kind})")
    if group_size < 1:
        raise ValueError(f"comm_time_us: group_size must be >= 1, got {group_size} ({kind})")


@dataclass(frozen=True)
class CommTable:
    """Calibrated communication curves, ``CommKey -> CommCurve | CommParams``.

    ``time_us(backend, kind, group_size, nbytes, link)`` looks up the exact key; a missing key
    raises ``KeyError`` naming it (use :func:`comm_time_us` for defaults instead).
    """

    entries: Mapping[CommKey, Comm]

    def get(self, backend: str, kind: str, group_size: int, link: str = "intra") -> Comm | None:
        return self.entries.get(CommKey(backend, kind, group_size, link))

    def time_us(self, backend: str, kind: str, group_size: int, nbytes: int,
                link: str = "intra") -> float:
        """Microseconds of one ``kind`` collective of ``nbytes`` bytes on a ``group_size``-rank
        group of ``backend`` over ``link``.

        Raises:
            KeyError: no calibrated curve for that key.
            ValueError: unknown kind or link, negative nbytes, group_size < 1.
        """
        _check(kind, link, nbytes, group_size)
        c = self.get(backend, kind, group_size, link)
        if c is None:
            raise KeyError(f"no calibrated {kind} for backend {backend!r}, {group_size} ranks, "
                           f"link {link!r}; calibrated: {sorted(self.entries)}")
        return c.time_us(nbytes)

    def __len__(self) -> int:
        return len(self.entries)


def comm_time_us(backend: str, kind: str, group_size: int, nbytes: int, link: str = "intra",
                 *, table: CommTable | Mapping[CommKey, Comm] | None = None) -> float:
    """Microseconds of one collective: the calibrated curve of ``table`` for ``(backend, kind,
    group_size, link)`` if it has one, else :func:`default_comm`. ``table`` may be a
    :class:`CommTable`, a plain mapping, or None (defaults only); the process's calibrated
    table is :func:`fcoll.passes.analysis.calibration.calibrated_table`.

    Raises:
        ValueError: unknown kind or link, negative nbytes, group_size < 1.
    """
    _check(kind, link, nbytes, group_size)
    entries = table.entries if isinstance(table, CommTable) else (table or {})
    c = entries.get(CommKey(backend, kind, group_size, link))
    return (c or default_comm(kind, group_size)).time_us(nbytes)
