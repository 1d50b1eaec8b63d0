"""``simulate(graphs, layouts, ...)``: step time, communication, exposed time and peak memory of
a compiled step on other world sizes.

For each layout: every program (graph) of the step is scaled (:mod:`fcoll.sim.scaling`), each
collective is timed by the fastest allowed algorithm on the layout's links
(:mod:`fcoll.sim.algorithms`, :mod:`fcoll.sim.links`), and the program is replayed with the
overlap its order allows (:mod:`fcoll.sim.replay`). The step is the programs back to back:
times add up, the peak memory is the largest program's.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from fcoll.sim import algorithms
from fcoll.sim.measured import measured_compute_us, outside_graphs_us, with_measured_compute
from fcoll.sim.links import LinkModel, MeasuredLink, parse_link
from fcoll.sim.program import Program, load_programs
from fcoll.sim.replay import Replay, replay
from fcoll.sim.scaling import ASSUMPTIONS, Layout, ScaledCollective, scaled_collective, \
    shard_names

__all__ = ["simulate", "Network", "collective_us", "GraphResult", "LayoutResult", "SimReport",
           "ALGORITHM_CHOICES", "COMPUTE_CHOICES"]

#: ``compute=``: "auto" is "trace" where the source has a trace (an ``fcoll.inspect`` directory
#: with ``traces/rank{R}.json``, or ``trace=``), else "predicted".
COMPUTE_CHOICES = ("auto", "predicted", "trace")

#: ``algorithm=``: "auto" picks the fastest per collective (as NCCL's tuner does), the others
#: force one; "hierarchical" falls back to the flat algorithms on one host.
ALGORITHM_CHOICES = ("auto", "ring", "tree", "hierarchical")


@dataclass(frozen=True)
class Network:
    """The links of a layout and the algorithm choice.

    Attributes:
        intra: between ranks of one host (``'shm'``: fcoll's measured shared memory).
        inter: between hosts (a :class:`~fcoll.sim.links.Link`).
        algorithm: one of :data:`ALGORITHM_CHOICES`.
    """

    intra: LinkModel
    inter: LinkModel
    algorithm: str = "auto"

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHM_CHOICES:
            raise ValueError(f"--algorithm: unknown algorithm {self.algorithm!r}; known: "
                             f"{ALGORITHM_CHOICES}")
        if isinstance(self.inter, MeasuredLink):
            raise ValueError("--inter: 'shm' is the shared memory of one host; give the "
                             "inter-host link as 'BANDWIDTH,LATENCY' (e.g. '100gbit,5us')")


def _candidates(c: ScaledCollective, per_host: int, net: Network) -> dict[str, float]:
    """Algorithm label -> time (us) of every algorithm ``net.algorithm`` allows for ``c``."""
    n, kind, s = c.ranks, c.kind, c.nbytes
    if n <= per_host:                                   # one host
        if isinstance(net.intra, MeasuredLink):
            return {"shm": net.intra.collective_us(kind, s, n, "ring")}
        allowed = algorithms.ALGORITHMS if net.algorithm in ("auto", "hierarchical") \
            else (net.algorithm,)
        return {a: net.intra.collective_us(kind, s, n, a) for a in allowed}
    out: dict[str, float] = {}
    if net.algorithm in ("auto", "ring", "tree"):
        for a in algorithms.ALGORITHMS if net.algorithm == "auto" else (net.algorithm,):
            out[a] = net.inter.collective_us(kind, s, n, a)
    if net.algorithm in ("auto", "hierarchical") and n % per_host == 0:
        for a in algorithms.ALGORITHMS:
            out[f"hier/{a}"] = algorithms.hierarchical_us(kind, s, n // per_host, per_host,
                                                          net.intra, net.inter, a)
    if not out:  # hierarchical asked, but the group does not fill whole hosts: flat ring
        out["ring"] = net.inter.collective_us(kind, s, n, "ring")
    return out


def collective_us(c: ScaledCollective, per_host: int, net: Network) -> tuple[float, str]:
    """(time in us, algorithm label) of collective ``c`` on hosts of ``per_host`` ranks: the
    fastest algorithm ``net.algorithm`` allows (ties: the first of ring, tree, hier/ring,
    hier/tree)."""
    if c.ranks <= 1:
        return 0.0, "local"
    times = _candidates(c, per_host, net)
    label = min(times, key=lambda k: times[k])
    return times[label], label


@dataclass(frozen=True)
class GraphResult:
    """One program on one layout: its :class:`~fcoll.sim.replay.Replay` and the algorithm
    chosen per collective kind (``{"all_reduce": {"hier/ring": 3}}``)."""

    name: str
    replay: Replay
    algorithms: dict[str, dict[str, int]]


@dataclass(frozen=True)
class LayoutResult:
    """The whole step on one layout (microseconds; bytes on one rank).

    Attributes:
        layout: the layout.
        step_us: the programs' replayed times plus ``outside_us``.
        compute_us, comm_us, exposed_comm_us: sums over the step's programs.
        peak_bytes: the largest program's peak (inputs included).
        graphs: per-program results.
        outside_us: the step's time outside its compiled graphs (measured on the recording,
            the same on every layout; 0 when not known).
    """

    layout: Layout
    step_us: float
    compute_us: float
    comm_us: float
    exposed_comm_us: float
    peak_bytes: float
    graphs: tuple[GraphResult, ...]
    outside_us: float = 0.0

    @property
    def overlap_ratio(self) -> float:
        """Hidden / total communication (1.0 when there is none)."""
        return 1.0 - self.exposed_comm_us / self.comm_us if self.comm_us > 0 else 1.0

    def algorithms(self) -> dict[str, dict[str, int]]:
        """Algorithm counts per kind over every program."""
        out: dict[str, Counter] = {}
        for g in self.graphs:
            for kind, counts in g.algorithms.items():
                out.setdefault(kind, Counter()).update(counts)
        return {k: dict(v) for k, v in out.items()}

    def as_dict(self) -> dict[str, Any]:
        return {"ranks": self.layout.ranks, "hosts": self.layout.hosts,
                "ranks_per_host": self.layout.per_host, "step_us": self.step_us,
                "graphs_us": self.step_us - self.outside_us, "outside_us": self.outside_us,
                "compute_us": self.compute_us, "comm_us": self.comm_us,
                "exposed_comm_us": self.exposed_comm_us, "overlap_ratio": self.overlap_ratio,
                "peak_bytes": self.peak_bytes, "algorithms": self.algorithms(),
                "graphs": {g.name: {"step_us": g.replay.step_us,
                                    "exposed_comm_us": g.replay.exposed_comm_us}
                           for g in self.graphs}}


@dataclass(frozen=True)
class SimReport:
    """Every layout's result, with the network and the assumptions behind them."""

    results: tuple[LayoutResult, ...]
    network: Network
    programs: tuple[str, ...]
    recorded_world_size: int
    compute_source: str = "predicted"
    outside_source: str = "not modelled (0)"
    assumptions: tuple[str, ...] = field(default=ASSUMPTIONS)

    def as_dict(self) -> dict[str, Any]:
        return {"graphs": list(self.programs), "recorded_world_size": self.recorded_world_size,
                "compute": self.compute_source, "outside_graphs": self.outside_source,
                "intra": self.network.intra.describe(), "inter": self.network.inter.describe(),
                "algorithm": self.network.algorithm, "assumptions": list(self.assumptions),
                "layouts": [r.as_dict() for r in self.results]}

    def __str__(self) -> str:
        from fcoll.sim.report import report_text

        return report_text(self)


def _simulate_program(p: Program, layout: Layout, net: Network) -> GraphResult:
    shards = shard_names(p)
    f = p.world_size / layout.ranks                     # how shards scale
    times: dict[str, float] = {}
    allocs: dict[str, float] = {}
    chosen: dict[str, Counter] = {}
    for n in p.nodes:
        if n.cls != "collective":
            continue
        sc = scaled_collective(n, p.world_size, layout, any(i in shards for i in n.inputs))
        times[n.name], label = collective_us(sc, layout.per_host, net)
        allocs[n.name] = n.alloc_bytes * (sc.out_bytes / n.out_bytes if n.out_bytes else 1.0)
        chosen.setdefault(n.kind, Counter())[label] += 1

    def duration(n) -> float:
        if n.cls == "collective":
            return times[n.name]
        if n.name not in shards:
            return n.us
        fixed = min(n.us, p.op_overhead_us)      # launching an op costs the same on a shard
        return fixed + (n.us - fixed) * f

    def alloc(n) -> float:
        if n.cls == "collective":
            return allocs[n.name]
        return n.alloc_bytes * f if n.name in shards else n.alloc_bytes

    return GraphResult(p.name, replay(p, duration, alloc),
                       {k: dict(v) for k, v in chosen.items()})


def simulate(graphs_or_records: Any, layouts: Sequence[Layout | int], *,
             intra: str | LinkModel = "shm", inter: str | LinkModel = "100gbit,5us",
             algorithm: str = "auto", ranks_per_host: int = 8, rank: int = 0,
             graphs: str | None = None, compute: str = "auto",
             trace: str | os.PathLike | dict | None = None,
             outside: str | float = "auto") -> SimReport:
    """Simulate a compiled step on each layout.

    Args:
        graphs_or_records: what :func:`fcoll.sim.program.load_programs` accepts: an
            ``fcoll.inspect`` output directory, schedule files or dicts, GraphModules (after
            fcoll's passes; compute times from this process's cost model), compile records, or
            a list of them: the step's graphs, run back to back.
        layouts: :class:`~fcoll.sim.scaling.Layout` objects, or rank counts (hosts of
            ``ranks_per_host`` ranks).
        intra / inter: link specs (:func:`fcoll.sim.links.parse_link`) or link objects.
        algorithm: one of :data:`ALGORITHM_CHOICES`.
        ranks_per_host: hosts' size for layouts given as rank counts.
        rank / graphs: which rank's files, and which graphs (regex), of a directory.
        compute: "predicted" (the times in the schedule: the cost model's), "trace" (measured
            per node in a run's trace: :mod:`fcoll.sim.measured`) or "auto" (trace where there
            is one, else predicted).
        trace: the trace for ``compute``/``outside``; default ``DIR/traces/rank{rank}.json``
            of a directory source.
        outside: the step's time outside its compiled graphs, added to every layout's step:
            "auto" (measured in the trace,
            :func:`fcoll.sim.measured.outside_graphs_us`, where there is one; else 0),
            "trace" (measured; an error without a trace), "none" (0), or microseconds.

    Returns:
        A :class:`SimReport`; ``str()`` of it is the table the CLI prints.

    Raises:
        ValueError: a bad link spec (naming ``--intra`` / ``--inter``), layout or algorithm,
            a source with no schedule, ``compute="trace"`` or ``outside="trace"`` without a
            trace, a trace without two consecutive steps of the graphs (``outside="trace"``),
            or a negative or unknown ``outside``.
    """
    net = Network(intra if not isinstance(intra, str) else parse_link(intra, "--intra"),
                  inter if not isinstance(inter, str) else parse_link(inter, "--inter"),
                  algorithm)
    lays = [x if isinstance(x, Layout) else Layout(int(x), ranks_per_host) for x in layouts]
    if not lays:
        raise ValueError("--ranks: no layouts to simulate")
    programs = load_programs(graphs_or_records, rank=rank, graphs=graphs)
    if isinstance(net.intra, MeasuredLink) and not net.intra.recorded:
        net = dataclasses.replace(net, intra=MeasuredLink(_recorded_shm(programs),
                                                          net.intra.spec))
    source = "predicted (cost model: " + \
        ", ".join(sorted({p.cost_source for p in programs})) + ")"
    if compute not in COMPUTE_CHOICES:
        raise ValueError(f"--compute: expected one of {COMPUTE_CHOICES}, got {compute!r}")
    trace = _trace_of(graphs_or_records, trace, rank)
    if compute == "trace" or (compute == "auto" and trace is not None):
        programs, source = _measured(programs, trace)
    outside_us, outside_source = _outside(outside, programs, trace)
    results = []
    for lay in lays:
        per = tuple(_simulate_program(p, lay, net) for p in programs)
        results.append(LayoutResult(
            lay, sum(g.replay.step_us for g in per) + outside_us,
            sum(g.replay.compute_us for g in per), sum(g.replay.comm_us for g in per),
            sum(g.replay.exposed_comm_us for g in per), max(g.replay.peak_bytes for g in per),
            per, outside_us))
    return SimReport(tuple(results), net, tuple(p.name for p in programs),
                     max(p.world_size for p in programs), source, outside_source)


def _recorded_shm(programs: list[Program]) -> dict[tuple[str, int], list]:
    """``(kind, ranks) -> points`` of fcoll's one-host curves the programs' run calibrated."""
    return {(c["kind"], int(c["group_size"])): c["points"] for p in programs
            for c in p.comm_curves if c.get("backend") == "fcoll" and c.get("link") == "intra"}


def _trace_of(src: Any, trace: Any, rank: int) -> Any:
    """The trace to measure from: ``trace`` if given (a path must exist), else
    ``DIR/traces/rank{rank}.json`` of an ``fcoll.inspect`` directory where it exists, else
    None."""
    if trace is not None:
        if isinstance(trace, (str, os.PathLike)) and not os.path.exists(trace):
            raise ValueError(f"--trace: no trace at {trace} (fcoll.inspect writes "
                             "DIR/traces/rank{R}.json)")
        return trace
    if isinstance(src, (str, os.PathLike)) and os.path.isdir(src):
        path = os.path.join(src, "traces", f"rank{rank}.json")
        return path if os.path.exists(path) else None
    return None


def _where(trace: Any) -> str:
    return os.fspath(trace) if isinstance(trace, (str, os.PathLike)) else "the given trace"


def _measured(programs: list[Program], trace: Any) -> tuple[list[Program], str]:
    """The programs with compute times from the trace, and a line saying so."""
    if trace is None:
        raise ValueError("--compute trace: give the trace (trace=...) when the graphs do not "
                         "come from an fcoll.inspect directory with DIR/traces/rank{R}.json")
    out, missing = [], 0
    for p in programs:
        q, m = with_measured_compute(p, measured_compute_us(trace, graph=p.name, programs=[p]))
        out.append(q)
        missing += m
    return out, (f"measured in {_where(trace)} (mean per node after the first step, with the "
                 f"executor's gap before it; {missing} compute node(s) not in the trace keep "
                 "predicted times)")


def _outside(outside: str | float, programs: list[Program], trace: Any) -> tuple[float, str]:
    """(microseconds, a line saying where they come from) of the step outside the graphs."""
    if isinstance(outside, (int, float)) and not isinstance(outside, bool):
        if outside < 0:
            raise ValueError(f"--outside: expected microseconds >= 0, got {outside}")
        return float(outside), f"{outside:g} us per step, as given (the same on every layout)"
    if outside == "none" or (outside == "auto" and trace is None):
        return 0.0, ("not modelled: the step is its compiled graphs only (no trace to measure "
                     "the rest in)")
    if outside not in ("auto", "trace"):
        raise ValueError(f"--outside: expected 'auto', 'trace', 'none' or microseconds, got "
                         f"{outside!r}")
    if trace is None:
        raise ValueError("--outside trace: give the trace (trace=...) when the graphs do not "
                         "come from an fcoll.inspect directory with DIR/traces/rank{R}.json")
    m = outside_graphs_us(trace, programs)
    if m.outside_us < 0:   # medians of noisy parts: the graphs' median span exceeded the rest
        return 0.0, (f"0 ms per step: measured {m.outside_us / 1e3:.3f} ms in {_where(trace)} "
                     f"(period {m.period_us / 1e3:.3f} ms, graph runs {m.graphs_us / 1e3:.3f} "
                     f"ms, tracer {m.tracer_us / 1e3:.3f} ms; medians over {m.steps} steps), "
                     "clipped to 0")
    return m.outside_us, (
        f"{m.outside_us / 1e3:.3f} ms per step, measured in {_where(trace)}: median over "
        f"{m.steps} steps of the period between steps ({m.period_us / 1e3:.3f} ms) minus the "
        f"graph runs' spans ({m.graphs_us / 1e3:.3f} ms) and the tracer's file writes "
        f"({m.tracer_us / 1e3:.3f} ms); assumed the same on every layout")
