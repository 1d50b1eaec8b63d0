"""Calibration: measure the cost model's parameters on this machine and on real process groups.

Everything here measures or looks up live process groups; the model itself
(:mod:`fcoll.passes.analysis.cost`, :mod:`fcoll.passes.analysis.comm_cost`) is pure. The calls that
are timed and the timing loops are in :mod:`fcoll.passes.analysis.calibration_probes`; here is the
protocol around them.

- Compute rates (:func:`measure_compute_rates`): a short microbenchmark, once per process: the
  median time of a transformer-sized matmul (FLOPs/us), the fastest large copy (bytes/us), and a
  tiny aten op called as the executor calls it (us per op).
- Communication (:func:`calibrate_group`): every collective kind timed on the real backend at
  the sizes of :data:`SWEEP_BYTES` (4 KiB .. 64 MiB: powers of 4 and 2 MiB), kind by kind, a
  fixed number of back-to-back runs per size (:func:`reps_for`, :func:`time_collectives`); per
  cell the slowest rank's median, fitted to a piecewise alpha-beta curve
  (:class:`~fcoll.passes.analysis.comm_cost.CommCurve`) per ``(backend, kind, group size, link)``.

Budget: a graph needs its collectives' sizes, so a group is timed only up to the first sweep
size at or above the largest collective the passes may issue for the first graph compiled on
it (its largest bucket: all its collectives of one kind, at most ``bucket_cap_mb``; at least
:data:`MIN_SWEEP_BYTES`, where timing is cheap; ``python -m fcoll.calibrate`` precomputes the
whole sweep for a job). Results are reused, without timing again:

1. for the same process group: never communicates again (a recompile may run on one rank
   alone), so a group is timed once, at its first compile, up to that graph's needs; larger
   sizes in later graphs are extrapolated by the last segment;
2. for another group of the same backend, size and host layout in this process: rank 0's
   numbers, one broadcast;
3. across processes (every run on this machine, or one job's): rank 0 reads the cache file
   (:mod:`fcoll.passes.analysis.calibration_cache`), one broadcast.

Determinism: whether to time and what to time is decided by the group's rank 0 alone and
broadcast; the numbers every rank uses are rank 0's where it knew them (broadcast in the same
message) and, where the group timed them, the slowest rank's medians (one all_reduce MAX,
identical on every rank), so every rank builds the same model and plans the same schedule;
the number of runs per size is
fixed by the size (never "until stable" on one rank's clock, which would make the ranks issue
different numbers of collectives and hang).

Calibration is a collective call: it must run on every rank of the group at the same point (the
``reorder_for_overlap`` pass does that, on every rank, for the groups of its graph, in the order
the groups were created). :func:`cached_model` never communicates.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import weakref
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._dispatch.python import no_python_dispatcher

from fcoll.passes.analysis import calibration_cache
from fcoll.passes.analysis.calibration_probes import (
    backend_of, blocking_collective, host_identity, host_layout, probe_buffers, time_compute_rates,
)
from fcoll.passes.analysis.comm_cost import CommCurve, CommKey, CommTable
from fcoll.passes.analysis.cost import (
    KINDS, ComputeRates, CostModel, assemble_model, collective_size,
)
from fcoll.passes.graph import arg_of, op_kind
from fcoll.passes.analysis.memory import COLLECTIVE, op_class

__all__ = [
    "SWEEP_BYTES", "MIN_SWEEP_BYTES", "ROUNDS", "reps_for", "sizes_for",
    "time_collective", "time_collectives",
    "measure_compute_rates", "calibrate_group",
    "GroupCalibration", "group_calibration", "calibrated_table",
    "calibration_stats",
    "host_identity", "model_for", "cached_model", "needs_calibration",
]

log = logging.getLogger(__name__)

#: Message sizes (bytes) of the calibration sweep: 4 KiB .. 64 MiB, powers of 4, and 2 MiB;
#: they span fcoll's shared-memory regimes (one-slot fast path, chunking through the slots,
#: caches, DRAM) and a token-bucket link's burst and sustained rate. 2 MiB because an
#: all_gather (or broadcast) of 2 ranks moves up to 2 x 1 MiB slots in one phase and chunks
#: above, so the line from 1 to 4 MiB overstates 2 MiB (``benchmarks/cost_model.py``).
SWEEP_BYTES = tuple(sorted({4096 * 4 ** i for i in range(8)} | {2 << 20}))

#: The sweep always covers sizes up to here (cheap: about 25 ms for all kinds on fcoll).
MIN_SWEEP_BYTES = 1 << 20


def reps_for(nbytes: int) -> int:
    """Timed runs per size (after one warm-up): 9 up to 256 KiB, 6 up to 4 MiB (three and two
    back to back in each of the :data:`ROUNDS` rounds), 3 above. A function of the size only,
    so every rank issues the same collectives.

    At least two per round at 1-4 MiB: the first runs after a change of size are slower on
    fcoll's backend (its waits adapt to their recent history), so fewer runs overstate what the
    same cells take in a longer back-to-back run; more than 6 gained nothing beyond the noise
    for half again the time at 4 MiB (``benchmarks/cost_model.py`` checks the result).
    """
    return 9 if nbytes <= 256 << 10 else 6 if nbytes <= 4 << 20 else 3


@dataclass(frozen=True)
class GroupCalibration:
    """Calibrated numbers of one group (the same on every rank).

    Attributes:
        backend: the group's backend name.
        group_size: ranks in the group.
        layout: host layout, the host index of each group rank in order of first appearance
            (``"0.0.1.1"``: ranks 0-1 on one host, 2-3 on another).
        link: "intra" (one host) or "inter" (the group spans hosts).
        rates: compute rates (rank 0's).
        points: kind -> {bytes: us}, the slowest rank's median as measured.
        comm: ``CommKey -> CommCurve`` fitted from ``points``.
        source: where the numbers come from ("file": rank 0 read them from the cache file;
            else a sentence, :func:`_source`); not compared.
    """

    backend: str
    group_size: int
    layout: str
    link: str
    rates: ComputeRates
    points: dict[str, dict[int, float]]
    comm: dict[CommKey, CommCurve]
    source: str = dataclasses.field(default="", compare=False)


class _Cache:
    """Per-process calibration results: compute rates; per live process group; per
    (backend, group size, layout) what this process measured or read as some group's rank 0."""

    def __init__(self) -> None:
        self.compute: ComputeRates | None = None
        self.groups: "weakref.WeakKeyDictionary[Any, GroupCalibration]" = (
            weakref.WeakKeyDictionary())
        self.by_key: dict[tuple[str, int, str], GroupCalibration] = {}
        self.stats = {"sweeps": 0, "timed_sizes": 0, "file_hits": 0, "key_hits": 0}


_CACHE = _Cache()  # the one process-level cache (calibration is a property of the process)


# ---------------------------------------------------------------------------------------------
# Compute rates (the microbenchmark itself: calibration_probes.time_compute_rates)

def measure_compute_rates(reps: int = 5) -> ComputeRates:
    """Microbenchmark this process's CPU: the median of a [1024, 256] @ [256, 768] matmul, the
    fastest 4 MiB copy, and a tiny aten op called as the executor calls it (an ``OpOverload``,
    which costs more per call than ``torch.add``).

    The matmul is timed by its median, not its fastest run: a small matmul's fastest run (warm
    caches, idle cores) overstates the rate the matmuls of a training step reach, and the
    scheduler would then count on compute that is not there to hide communication.

    Cached per process. Returns :class:`ComputeRates` (FLOPs/us, bytes/us, us per op).
    """
    if _CACHE.compute is not None:
        return _CACHE.compute
    rates = time_compute_rates(reps)
    _CACHE.compute = rates
    log.debug("measured compute rates: %s", rates)
    return rates


# ---------------------------------------------------------------------------------------------
# Communication

#: Timed runs of a cell are split into this many rounds (the cells interleaved round robin).
ROUNDS = 3

# Each round's runs of a cell follow one untimed run of the same cell: the ranks leave a
# collective at different times, and the next collective on the faster rank includes the wait
# for the slower one (after a large all_reduce, several times a small one's own time). The
# untimed run absorbs that exit skew, so the timed runs see what back-to-back collectives of one
# size see (a DDP step's buckets, an FSDP step's per-layer all_gathers). The largest cells keep
# it too: a broadcast's root returns before its peers have copied the data out, so the skew is
# not small even against 16 and 64 MiB.


def _runs_in_round(reps: int, r: int) -> int:
    """Timed runs of round ``r`` (of :data:`ROUNDS`) for a cell of ``reps`` runs in all."""
    return reps * (r + 1) // ROUNDS - reps * r // ROUNDS


def time_collectives(pg: Any, cells: list[tuple[str, int]],
                     reps: Callable[[int], int] | None = None) -> dict[tuple[str, int],
                                                                   list[float]]:
    """Times (us) of blocking collectives on ``pg``: ``reps(nbytes)`` runs (default
    :func:`reps_for`) of each ``(kind, nbytes)`` cell, after one warm-up run of each.

    The runs are split into :data:`ROUNDS` rounds, so that a burst of load on a shared machine
    lands on one round of many cells instead of every run of one cell, where it would move
    the median. In a round the kinds come in the order of their first cell, and each kind's
    sizes largest first: a cell's neighbours are collectives of its own kind, as a step's
    buckets are (a DDP step's all_reduces, an FSDP step's per-layer all_gathers). Within a round
    a cell's runs are back to back, after one untimed run of the cell, which absorbs the exit
    skew the previous cell left: without it a cell measures the skew of whatever ran before it.

    Why kind by kind: fcoll's waits adapt to their recent history (the spin backoff of
    :mod:`fcoll.shm.transport.sync`), so what ran before a cell matters; with the kinds interleaved at
    each size every cell followed another kind's, and small collectives measured above their
    back-to-back time in a run of their own kind, even after the untimed run.

    The order depends only on the arguments: every rank of ``pg`` issues the same collectives
    (a collective call; every rank must call it with the same arguments). One set of buffers
    per size is shared by the kinds.
    """
    reps = reps or reps_for
    bufs = {size: probe_buffers(pg, size) for size in sorted({size for _, size in cells})}
    kinds = list(dict.fromkeys(kind for kind, _ in cells))
    ordered = sorted(dict.fromkeys(cells), key=lambda cell: (kinds.index(cell[0]), -cell[1]))
    ops = {cell: blocking_collective(cell[0], pg, bufs[cell[1]]) for cell in ordered}
    for op in ops.values():
        op()
    times: dict[tuple[str, int], list[float]] = {cell: [] for cell in cells}
    for r in range(ROUNDS):
        for cell, op in ops.items():
            runs = _runs_in_round(reps(cell[1]), r)
            if runs:
                op()
            for _ in range(runs):
                t0 = time.perf_counter()
                op()
                times[cell].append((time.perf_counter() - t0) * 1e6)
    return times


def time_collective(kind: str, pg: Any, nbytes: int, reps: int) -> list[float]:
    """Times (us) of ``reps`` blocking ``kind`` collectives of ``nbytes`` on ``pg``, after one
    warm-up run (which also lines the ranks up). A collective call: every rank of ``pg`` must
    call it with the same arguments."""
    return time_collectives(pg, [(kind, nbytes)], lambda _: reps)[(kind, nbytes)]


# The message rank 0 broadcasts: [want mask (S), compute rates (3), times (K x S, NaN unknown)]
_S, _K = len(SWEEP_BYTES), len(KINDS)


def _encode(known: GroupCalibration | None, want: tuple[int, ...],
            rates: ComputeRates | None) -> torch.Tensor:
    v = torch.full((_S + 3 + _K * _S,), math.nan, dtype=torch.float64)
    have = known.points if known is not None else {}
    for j, size in enumerate(SWEEP_BYTES):
        v[j] = float(size in want and not all(size in have.get(k, {}) for k in KINDS))
    if rates is not None:
        v[_S:_S + 3] = torch.tensor([rates.flops_per_us, rates.bytes_per_us,
                                     rates.op_overhead_us], dtype=torch.float64)
    for i, kind in enumerate(KINDS):
        for j, size in enumerate(SWEEP_BYTES):
            if size in have.get(kind, {}):
                v[_S + 3 + i * _S + j] = have[kind][size]
    return v


def _decode(v: list[float], backend: str, n: int, layout: str) -> GroupCalibration:
    link = "intra" if set(layout.split(".")) == {"0"} else "inter"
    points = {kind: {size: v[_S + 3 + i * _S + j] for j, size in enumerate(SWEEP_BYTES)
                     if not math.isnan(v[_S + 3 + i * _S + j])} for i, kind in enumerate(KINDS)}
    comm = {CommKey(backend, kind, n, link): CommCurve.fit(points[kind].items())
            for kind in KINDS if len(points[kind]) >= 2}
    return GroupCalibration(backend, n, layout, link, ComputeRates(*v[_S:_S + 3]), points, comm)


def _known_on_rank_0(backend: str, n: int, layout: str) -> GroupCalibration | None:
    """What rank 0 already knows for this key: this process's numbers, else the job's file."""
    known = _CACHE.by_key.get((backend, n, layout))
    if known is not None:
        _CACHE.stats["key_hits"] += 1
        return known
    key = {"backend": backend, "group_size": n, "layout": layout}
    entry = calibration_cache.read_entry(calibration_cache.cache_path(backend, n, layout), key)
    if entry is None:
        return None
    _CACHE.stats["file_hits"] += 1
    points = {k: {int(b): float(t) for b, t in entry["points"].get(k, [])} for k in KINDS}
    link = "intra" if set(layout.split(".")) == {"0"} else "inter"
    return GroupCalibration(backend, n, layout, link, ComputeRates(*entry["compute"]), points, {},
                            source="file")


def _sweep(pg: Any, sizes: list[int], into: torch.Tensor) -> None:
    """Time every kind at ``sizes`` on every rank; the slowest rank's median of each cell goes
    into ``into`` on every rank (one all_reduce MAX of the medians).

    The slowest rank, not rank 0: a step waits for its slowest rank, and one rank's clock can
    miss most of a collective (the root of a broadcast returns once its peers arrived, before
    they copied the data out). The MAX is the same on every rank, so every rank builds the
    same model.
    """
    import torch.distributed as dist

    times = time_collectives(pg, [(kind, size) for kind in KINDS for size in sizes])
    cells = sorted(times, key=lambda cell: (KINDS.index(cell[0]), cell[1]))
    medians = torch.tensor([statistics.median(times[cell]) for cell in cells],
                           dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=pg)
    for (kind, size), us in zip(cells, medians.tolist()):
        into[_S + 3 + KINDS.index(kind) * _S + SWEEP_BYTES.index(size)] = us
    _CACHE.stats["sweeps"] += 1
    _CACHE.stats["timed_sizes"] += len(sizes)


def sizes_for(max_bytes: int | None) -> tuple[int, ...]:
    """Sweep sizes needed to predict collectives up to ``max_bytes`` by interpolation: every
    size up to the first at or above ``max(max_bytes, MIN_SWEEP_BYTES)``; all of them for
    None (and above 64 MiB, where the last segment extrapolates)."""
    if max_bytes is None:
        return SWEEP_BYTES
    cap = max(max_bytes, MIN_SWEEP_BYTES)
    last = next((i for i, s in enumerate(SWEEP_BYTES) if s >= cap), _S - 1)
    return SWEEP_BYTES[:last + 1]


def _source(rank: int, known: GroupCalibration | None, todo: list[int], backend: str, n: int,
            layout: str) -> str:
    """Where a group's curves come from, for DEBUG logs (:func:`comm_cost.describe`)."""
    if rank != 0:
        return "group rank 0's calibration, broadcast"
    path = calibration_cache.cache_path(backend, n, layout)
    old = ("calibration file " + path if known is not None and known.source == "file" and path
           else "this process's earlier calibration" if known is not None else "")
    if not todo:
        return old or "no sizes timed"
    now = f"timed now ({len(todo)} sizes" + (f", written to {path})" if path else ")")
    return f"{old} + {now}" if old else now


def _with_source(rec: GroupCalibration, source: str) -> GroupCalibration:
    return dataclasses.replace(rec, source=source, comm={
        k: dataclasses.replace(c, source=source) for k, c in rec.comm.items()})


def calibrate_group(pg: Any, max_bytes: int | None = None,
                    ) -> tuple[ComputeRates, dict[CommKey, CommCurve]]:
    """Calibrate ``pg``: every collective kind timed at the sweep sizes up to ``max_bytes``
    (:func:`sizes_for`; None: the whole sweep), fitted per kind, the same numbers on every
    rank (rank 0's known ones, the slowest rank's median for the ones timed now).

    The first call for ``pg`` is a collective call: every rank of ``pg`` must make it at the
    same point (the first compile of a graph on ``pg``, which every rank makes). Rank 0 decides
    from what it knows (another group's numbers of the same key in this process, or the job's
    cache file) which sizes of its ``max_bytes`` are still to be timed, and broadcasts that
    with its numbers, so ranks whose ``max_bytes`` differ (a backed symbolic size whose hint
    differs per rank) still issue the same collectives. Every later call returns the cached
    objects without communicating, whatever ``max_bytes`` is: a recompile may happen on one
    rank alone (Dynamo's guards are per rank), and a collective there would pair with another
    rank's next collective. Sizes beyond the calibrated ones are extrapolated by the curve's
    last segment (:class:`~fcoll.passes.analysis.comm_cost.CommCurve`).
    (``benchmarks/cost_model.py`` and ``benchmarks/passes_scaling.py --rank-costs`` print how long
    it takes.)

    Returns:
        (compute rates, ``{CommKey(backend, kind, group size, link): CommCurve}``).
    """
    import torch.distributed as dist

    cached = _CACHE.groups.get(pg)
    if cached is not None:   # never communicate again: a recompile may happen on one rank alone
        return cached.rates, cached.comm
    want = sizes_for(max_bytes)
    backend, n, t0 = backend_of(pg), pg.size(), time.perf_counter()
    # Inside torch.compile the Python dispatcher is on, and a c10d op then runs its kernel with
    # the GIL held (pybind released it, the Python dispatcher took it back). On gloo that
    # deadlocks: the enqueue waits for the worker's queue mutex, and the worker holds it while
    # destroying the previous Work, whose tensors need the GIL to drop their Python objects
    # (seen in native stacks of both ranks of tests/test_remaps.py's 2-rank program). Without
    # the Python dispatcher the GIL stays released in the kernel.
    with no_python_dispatcher():
        layout = host_layout(pg)   # its all_gather also lines the ranks up
        message = torch.zeros(_S + 3 + _K * _S, dtype=torch.float64)
        known = None
        if pg.rank() == 0:
            known = _known_on_rank_0(backend, n, layout)
            rates = known.rates if known is not None else measure_compute_rates()
            message = _encode(known, want, rates)
        dist.broadcast(message, group=pg, group_src=0)
        mask = message[:_S].tolist()
        todo = [s for j, s in enumerate(SWEEP_BYTES) if mask[j] == 1.0]
        if todo:
            _sweep(pg, todo, message)   # every rank then holds the same message
    result = _decode(message.tolist(), backend, n, layout)
    result = _with_source(result, _source(pg.rank(), known, todo, backend, n, layout))
    _CACHE.groups[pg] = result
    if pg.rank() == 0:
        _CACHE.by_key[(backend, n, layout)] = result
        if todo:
            calibration_cache.write_entry(
                calibration_cache.cache_path(backend, n, layout),
                {"backend": backend, "group_size": n, "layout": layout},
                message[_S:_S + 3].tolist(),
                {k: [[b, t] for b, t in sorted(p.items())] for k, p in result.points.items()})
    log.debug("calibrated group %s (%s, %d ranks, hosts %s) in %.0f ms, timed sizes %s: %s",
              getattr(pg, "group_name", "?"), backend, n, layout,
              (time.perf_counter() - t0) * 1e3, todo, result.comm)
    return result.rates, result.comm


def group_calibration(pg: Any) -> GroupCalibration | None:
    """What this process calibrated or read for ``pg`` (:func:`calibrate_group`), or None if
    ``pg`` is not calibrated yet; never communicates."""
    return _CACHE.groups.get(pg)


def calibrated_table() -> CommTable:
    """Every curve this process calibrated or read (as some group's rank 0), as a
    :class:`~fcoll.passes.analysis.comm_cost.CommTable`; never communicates."""
    entries: dict[CommKey, CommCurve] = {}
    for rec in [*_CACHE.by_key.values(), *_CACHE.groups.values()]:
        entries.update(rec.comm)
    return CommTable(entries)


def calibration_stats() -> dict[str, int]:
    """Counters of this process: ``sweeps`` (calibrations that timed collectives),
    ``timed_sizes`` (sizes timed, all kinds each), ``file_hits`` (job cache file read as rank
    0), ``key_hits`` (another group's numbers reused as rank 0)."""
    return dict(_CACHE.stats)


# ---------------------------------------------------------------------------------------------
# Real groups of a graph, and the model assembled from their parameters

def _real_group(name: str) -> Any | None:
    """The process group called ``name`` if it is a real (not fake) initialised group."""
    try:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if not dist.is_initialized():
            return None
        pg = c10d._resolve_process_group(name)
    except Exception:  # noqa: BLE001  unknown name, no c10d: no calibration possible
        return None
    return None if backend_of(pg) in ("fake", "unknown") else pg


def _group_names(gm: fx.GraphModule) -> list[str]:
    """Names of the groups ``gm``'s collectives use, in the order the groups were created.

    Calibration is a blocking collective per group, so every rank must calibrate its groups in
    one global order. Graph order is not one: rank-dependent code (a reduce's copy on the
    destination only, uneven all_to_all splits) can make two ranks meet their groups in a
    different order, and then they hang. Creation order is the same on every rank
    (``new_group`` is collective), so it is used instead.
    """
    import torch.distributed.distributed_c10d as c10d

    names: list[str] = []
    for node in gm.graph.nodes:
        if op_class(node) == COLLECTIVE:
            g = str(arg_of(node, "group_name"))
            if g not in names:
                names.append(g)
    created = {str(name): i for i, name in enumerate(c10d._world.pg_names.values())}
    return sorted(names, key=lambda g: (created.get(g, len(created)), g))


def _largest_collectives(gm: fx.GraphModule,
                         bucket_cap_bytes: int | None = None) -> dict[str, int]:
    """Group name -> bytes of the largest collective the passes may issue on it for ``gm``: its
    largest collective, or, with ``bucket_cap_bytes``, the largest bucket the planner could
    build, ``min(bytes of all its collectives of one kind, bucket_cap_bytes)``, where that is
    larger (data-dependent sizes by the cost model's estimate; the same on every rank).

    Timing only up to the largest collective *before* bucketing left the curve above it to
    extrapolation: a DDP step of 1 MiB gradients was calibrated to 1 MiB and its 4-25 MiB
    buckets were predicted by the last segment, which one slow 256 KiB cell had made flat
    (every bucket from 0.8 to 12 MiB predicted at one time, 9x under its measured wait).
    """
    largest: dict[str, int] = {}
    per_kind: dict[tuple[str, str], int] = {}
    for node in gm.graph.nodes:
        if op_class(node) == COLLECTIVE:
            g = str(arg_of(node, "group_name"))
            nbytes = collective_size(node).nbytes
            largest[g] = max(largest.get(g, 0), nbytes)
            key = (g, op_kind(node.target) or str(node.target))
            per_kind[key] = per_kind.get(key, 0) + nbytes
    if bucket_cap_bytes is not None:
        for (g, _), total in per_kind.items():
            largest[g] = max(largest[g], min(total, bucket_cap_bytes))
    return largest


def _assemble(gm: fx.GraphModule, estimator, calibrate: bool,
              estimates: dict | None = None, bucket_cap_bytes: int | None = None) -> CostModel:
    compute, comm, backends, links, rates = None, {}, {}, {}, {}
    largest = _largest_collectives(gm, bucket_cap_bytes) if calibrate else {}
    for name in _group_names(gm):
        pg = _real_group(name)
        if pg is None:
            continue
        if calibrate:
            calibrate_group(pg, largest.get(name))
        rec = _CACHE.groups.get(pg)
        if rec is None:
            log.debug("group %s is not calibrated yet: default costs", name)
            continue
        backends[name], links[name], rates[name] = rec.backend, rec.link, rec.rates
        comm.update(rec.comm)
        compute = compute or rec.rates
    return assemble_model(compute, comm, backends, estimator, estimates, links, rates)


def model_for(gm: fx.GraphModule, estimator: Callable[[Any], float | None] | None = None,
              estimates: dict | None = None, bucket_cap_bytes: int | None = None) -> CostModel:
    """The cost model for ``gm``, calibrating each real group of its collectives if needed.

    A collective call on real groups (see :func:`calibrate_group`); defaults on the fake pg.
    ``estimates``: see :func:`fcoll.passes.analysis.cost.assemble_model`.
    ``bucket_cap_bytes``: the planner's largest bucket (``bucket_cap_mb``); a group is then
    timed up to the largest bucket its collectives could form, not only its largest collective
    (:func:`_largest_collectives`).
    """
    return _assemble(gm, estimator, calibrate=True, estimates=estimates,
                     bucket_cap_bytes=bucket_cap_bytes)


def needs_calibration(gm: fx.GraphModule) -> bool:
    """Whether :func:`model_for` would communicate for ``gm``: some real group of its
    collectives is not calibrated yet in this process (each group's first calibration is a
    collective call; later ones are not). Decided per group, so a graph whose other groups were
    calibrated by earlier graphs still calibrates its new group where a graph with only new
    groups would (the same pass on every rank), instead of taking the defaults for it."""
    return any(pg is not None and pg not in _CACHE.groups
               for pg in map(_real_group, _group_names(gm)))


def cached_model(gm: fx.GraphModule, estimator: Callable[[Any], float | None] | None = None,
                 estimates: dict | None = None) -> CostModel:
    """Like :func:`model_for` but never communicates: uncalibrated groups use defaults."""
    return _assemble(gm, estimator, calibrate=False, estimates=estimates)
