"""Links of a simulated cluster: what one step of a collective costs on them.

Two kinds of link:

- :class:`Link`, a network link given by its bandwidth and latency (the Hockney alpha-beta
  model, ``t = alpha + bytes / bandwidth`` per message): the collective algorithms of
  :mod:`fcoll.sim.algorithms` are built from its messages. Written ``'100gbit,5us'``.
- :class:`MeasuredLink`, written ``'shm'``: fcoll's shared-memory backend between the ranks of
  one host. Its collectives are not built from messages; each collective kind on ``G`` ranks
  has its own measured time curve (:func:`shm_time_us`; :func:`_fcoll_curves` is the one
  place that reads fcoll's cost model).

Both answer :meth:`collective_us` ``(kind, nbytes, ranks, algorithm)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

from fcoll.ops.facts import KINDS, busbw_factor
from fcoll.sim import algorithms

__all__ = ["Link", "MeasuredLink", "LinkModel", "parse_link", "shm_time_us",
           "SHM_DEFAULT_ALPHA_US", "SHM_DEFAULT_BUSBW_GBPS"]

#: Bandwidth units accepted in link specs -> bytes per microsecond per unit (SI prefixes, as
#: network rates are quoted: 1 gbit = 1e9 bits/s; 1 GB/s = 1e9 bytes/s).
_BANDWIDTH_UNITS = {
    "gbit": 1e9 / 8 / 1e6, "mbit": 1e6 / 8 / 1e6, "tbit": 1e12 / 8 / 1e6,
    "gb/s": 1e9 / 1e6, "mb/s": 1e6 / 1e6, "tb/s": 1e12 / 1e6,
}
#: Latency units -> microseconds.
_LATENCY_UNITS = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"


@dataclass(frozen=True)
class Link:
    """A network link: ``alpha_us`` per message plus ``bytes / bandwidth_bytes_per_us``.

    Attributes:
        bandwidth_bytes_per_us: bytes per microsecond one rank can send (and receive at once;
            full duplex) = GB/s * 1e3.
        alpha_us: latency of one message, in microseconds (the model's alpha).
        spec: the text it was parsed from, for reports.
    """

    bandwidth_bytes_per_us: float
    alpha_us: float
    spec: str = ""

    def collective_us(self, kind: str, nbytes: float, ranks: int, algorithm: str) -> float:
        """Time of one collective on ``ranks`` ranks all joined by this link, in us
        (:func:`fcoll.sim.algorithms.flat_us`)."""
        return algorithms.flat_us(kind, nbytes, ranks, self.alpha_us,
                                  self.bandwidth_bytes_per_us, algorithm)

    def describe(self) -> str:
        gbps = self.bandwidth_bytes_per_us / 1e3
        return f"{self.spec or 'link'}: {gbps:g} GB/s per rank, alpha {self.alpha_us:g} us"


@dataclass(frozen=True)
class MeasuredLink:
    """The ranks of one host over fcoll's shared-memory backend (``'shm'``).

    Attributes:
        recorded: ``(kind, ranks) -> [[bytes, us], ...]``: curves a recorded run calibrated
            (``comm_curves`` of its schedule files; empty: none), used where this process has
            none of its own (:func:`shm_time_us`).
        spec: the text it was parsed from.
    """

    recorded: Mapping[tuple[str, int], Sequence[Sequence[float]]] = field(default_factory=dict)
    spec: str = "shm"

    def time_us(self, kind: str, nbytes: float, ranks: int) -> tuple[float, str]:
        """(microseconds, source) of ``kind`` of ``nbytes`` on ``ranks`` ranks of one host."""
        return shm_time_us(kind, nbytes, ranks, self.recorded)

    def collective_us(self, kind: str, nbytes: float, ranks: int, algorithm: str) -> float:
        """Time of ``kind`` of ``nbytes`` on ``ranks`` ranks of one host; the backend picks
        its own algorithm, so ``algorithm`` is ignored. 0 on one rank."""
        if ranks <= 1:
            return 0.0
        return self.time_us(kind, nbytes, ranks)[0]

    def describe(self) -> str:
        small, source = self.time_us("all_reduce", 4096, 2)
        big, _ = self.time_us("all_reduce", 64 * 2**20, 2)
        busbw = busbw_factor("all_reduce", 2) * 64 * 2**20 / big / 1e3 if big > 0 else 0.0
        return (f"{self.spec}: fcoll shared memory, {source}; e.g. all_reduce on 2 ranks "
                f"{small:.0f} us at 4 KiB, busbw {busbw:.3g} GB/s at 64 MiB")


LinkModel = Union[Link, MeasuredLink]

#: Defaults of the shared-memory model when nothing is calibrated: fcoll's all_reduce on 2
#: ranks measured on a quiet machine (docs: /work/shared/NOTES.md, "Measured 2026-11-23",
#: ``benchmarks/collectives.py --nproc 2``: 64 us at 4 KiB, 3.16 GB/s busbw at 128 MiB). Every
#: kind and group size uses the same alpha and bus bandwidth, with the nccl-tests bus factor
#: of its kind (:func:`fcoll.ops.facts.busbw_factor`).
SHM_DEFAULT_ALPHA_US = 64.0
SHM_DEFAULT_BUSBW_GBPS = 3.16


def _fcoll_curves(recorded: Mapping[tuple[str, int], Sequence[Sequence[float]]]
                  ) -> dict[tuple[str, int], Any]:
    """``(kind, ranks) -> curve`` (``.time_us(nbytes)``) of fcoll's backend on one host: the
    recorded points fitted by :class:`fcoll.passes.analysis.comm_cost.CommCurve`, overridden by what
    this process calibrated (:func:`fcoll.passes.analysis.calibration.calibrated_table`). The only
    code of the simulator that reads fcoll's cost model."""
    from fcoll.passes.analysis.calibration import calibrated_table
    from fcoll.passes.analysis.comm_cost import CommCurve

    curves: dict[tuple[str, int], Any] = {
        key: CommCurve.fit((int(b), float(t)) for b, t in pts) for key, pts in recorded.items()}
    for key, curve in calibrated_table().entries.items():
        if key.backend == "fcoll" and key.link == "intra":
            curves[(key.kind, key.group_size)] = curve
    return curves


def shm_time_us(kind: str, nbytes: float, ranks: int,
                recorded: Mapping[tuple[str, int], Sequence[Sequence[float]]] | None = None
                ) -> tuple[float, str]:
    """``(microseconds, source)`` of one collective ``kind`` of ``nbytes`` (nccl-tests bytes)
    on ``ranks`` ranks of fcoll's shared-memory backend on one host.

    From the calibrated curves (:func:`_fcoll_curves`: this process's, else ``recorded``):
    the curve of ``(kind, ranks)``; else the curve of ``kind`` on the nearest calibrated group
    size ``m``, read at the bytes that put the same traffic on the bus
    (``t(nbytes * busbw_factor(kind, ranks) / busbw_factor(kind, m))``, nccl-tests' bus
    factors: the bus bandwidth is assumed not to depend on the group size); else the documented
    defaults :data:`SHM_DEFAULT_ALPHA_US` + ``busbw_factor(kind, ranks) * nbytes`` /
    :data:`SHM_DEFAULT_BUSBW_GBPS`.

    Raises:
        ValueError: ``kind`` is not a collective kind.
    """
    if kind not in KINDS:
        raise ValueError(f"shm_time_us: unknown collective kind {kind!r}; known: {KINDS}")
    curves = _fcoll_curves(recorded or {})
    sizes = sorted((m for k, m in curves if k == kind), key=lambda m: (abs(m - ranks), m))
    if sizes:
        m = sizes[0]
        scaled = nbytes * busbw_factor(kind, max(ranks, 2)) / busbw_factor(kind, max(m, 2))
        how = "calibrated" if m == ranks else f"calibrated on {m} ranks, bus-scaled"
        return max(curves[(kind, m)].time_us(int(scaled)), 0.0), how
    beta = busbw_factor(kind, max(ranks, 2)) / (SHM_DEFAULT_BUSBW_GBPS * 1e3)
    return SHM_DEFAULT_ALPHA_US + beta * nbytes, "documented defaults (not calibrated)"


def parse_link(spec: str, argument: str = "link") -> LinkModel:
    """Parse a link spec: ``'shm'``, or ``'BANDWIDTH,LATENCY'`` such as ``'100gbit,5us'``.

    Bandwidth units: gbit, mbit, tbit (bits per second, SI), GB/s, MB/s, TB/s (bytes per
    second, SI); case is ignored. Latency units: ns, us, ms, s. Both parts are required.

    Args:
        spec: the text.
        argument: the option it came from (``'--inter'``), named in errors.

    Raises:
        ValueError: naming ``argument`` and ``spec``: not two parts, a number that is missing,
            negative or zero (bandwidth), or an unknown unit.
    """
    text = str(spec).strip().lower()
    if text == "shm":
        return MeasuredLink(spec="shm")
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2:
        raise ValueError(f"{argument}: expected 'shm' or 'BANDWIDTH,LATENCY' such as "
                         f"'100gbit,5us', got {spec!r}")
    bw = _quantity(parts[0], _BANDWIDTH_UNITS, "bandwidth", argument, spec)
    lat = _quantity(parts[1], _LATENCY_UNITS, "latency", argument, spec)
    if bw <= 0:
        raise ValueError(f"{argument}: bandwidth must be positive, got {parts[0]!r} in {spec!r}")
    return Link(bandwidth_bytes_per_us=bw, alpha_us=lat, spec=str(spec).strip())


def _quantity(text: str, units: dict[str, float], what: str, argument: str,
              spec: str) -> float:
    m = re.fullmatch(rf"({_NUMBER})\s*([a-z/]+)", text)
    if m is None:
        raise ValueError(f"{argument}: cannot read the {what} {text!r} in {spec!r}: expected "
                         f"a number and a unit ({', '.join(units)})")
    number, unit = float(m.group(1)), m.group(3)
    if unit not in units:
        raise ValueError(f"{argument}: unknown {what} unit {unit!r} in {spec!r}; known: "
                         f"{', '.join(units)}")
    return number * units[unit]
