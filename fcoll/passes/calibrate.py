"""Calibration: measure the cost model's parameters on this machine and on real process groups.

Everything here measures or looks up live process groups; the model itself
(:mod:`fcoll.passes.cost`) is pure.

- Compute rates (:func:`measure_compute_rates`): a short microbenchmark, once per process: the
  median time of a transformer-sized matmul (FLOPs/us), the fastest large copy (bytes/us), and a
  tiny aten op called as the executor calls it (us per op).
- Communication (:func:`calibrate_group`): every collective kind timed at two message sizes on
  the real backend, fitted to ``alpha_us + beta_us_per_byte * bytes``, once per process group
  per process. Rank 0's numbers (compute rates included) are broadcast through the group, so
  every rank plans the same schedule.

Calibration is a collective call: it must run on every rank of the group at the same point (the
``reorder_for_overlap`` pass does that, on every rank, for the groups of its graph, in the order
the groups were created). :func:`cached_model` never communicates.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._dispatch.python import no_python_dispatcher

from fcoll.passes.cost import KINDS, CommParams, ComputeRates, CostModel, assemble_model
from fcoll.passes.graph import arg_of
from fcoll.passes.memory import COLLECTIVE, op_class

__all__ = [
    "CALIBRATION_BYTES", "measure_compute_rates", "calibrate_group", "fit_alpha_beta",
    "model_for", "cached_model", "moves_data_on_compute_cores",
]

log = logging.getLogger(__name__)

#: Message sizes (bytes) timed by the calibration: one latency-bound, one bandwidth-bound. The
#: large one must be well past any burst a link lets through at full speed (a token-bucket
#: shaped link passes its burst at line rate, and a message inside it looks faster than the
#: link is).
CALIBRATION_BYTES = (16 * 1024, 4 * 1024 * 1024)


class _Cache:
    """Per-process calibration results: compute rates, and comm params per live process group."""

    def __init__(self) -> None:
        self.compute: ComputeRates | None = None
        self.groups: "weakref.WeakKeyDictionary[Any, tuple[str, ComputeRates, dict]]" = (
            weakref.WeakKeyDictionary())


_CACHE = _Cache()  # the one process-level cache (calibration is a property of the process)


# ---------------------------------------------------------------------------------------------
# Timing loops

def _times_us(fn: Callable[[], None], reps: int) -> list[float]:
    """The time of each of ``reps`` runs of ``fn``, in us."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def _min_us(fn: Callable[[], None], reps: int) -> float:
    """Fastest of ``reps`` runs, in us (on a shared machine the minimum is the least noisy)."""
    return min(_times_us(fn, reps))


def _median_us(fn: Callable[[], None], reps: int) -> float:
    """Median of ``reps`` runs, in us: for kernels long enough that the minimum is a lucky run
    (a matmul that found the caches warm and the other cores idle)."""
    return sorted(_times_us(fn, reps))[reps // 2]


def _per_call_us(fn: Callable[[], None], calls: int, reps: int) -> float:
    """Fastest of ``reps`` runs of ``calls`` back-to-back calls, in us per call."""
    return _min_us(lambda: [fn() for _ in range(calls)], reps) / calls


# ---------------------------------------------------------------------------------------------
# Compute rates

#: The calibration matmul: [1024, 256] @ [256, 768], a transformer layer's QKV projection for
#: 1024 tokens of width 256, the scale of the matmuls the passes schedule.
_MM_SHAPE = (1024, 256, 768)


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
    m, k, n = _MM_SHAPE
    a, b = torch.randn(m, k), torch.randn(k, n)
    src, dst = torch.randn(1 << 20), torch.empty(1 << 20)
    x = torch.ones(4)
    add = torch.ops.aten.add.Tensor
    torch.mm(a, b)
    torch.mm(a, b)
    dst.copy_(src)
    op_us = _per_call_us(lambda: add(x, x), 50, reps)
    mm_us = _median_us(lambda: torch.mm(a, b), reps)
    copy_us = _min_us(lambda: dst.copy_(src), reps)
    rates = ComputeRates(flops_per_us=2 * m * k * n / max(mm_us - op_us, 1.0),
                         bytes_per_us=2 * src.numel() * 4 / max(copy_us - op_us, 1.0),
                         op_overhead_us=max(op_us, 0.5))
    _CACHE.compute = rates
    log.debug("measured compute rates: %s", rates)
    return rates


# ---------------------------------------------------------------------------------------------
# Communication

def _backend_name(pg: Any) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(pg))
    except Exception:  # noqa: BLE001  groups made outside c10d's registry
        return "unknown"


def _quiet(fn, *args, **kwargs):
    """Call a c10d function with its ``FutureWarning`` (a deprecation notice) silenced."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return fn(*args, **kwargs)


def _reduce_scatter_as_fcoll_does(pg: Any, out: torch.Tensor, input: torch.Tensor) -> None:
    """One blocking reduce_scatter by the algorithm ``fcoll.reduce_scatter_tensor`` picks for
    ``pg``'s backend (on gloo: all_to_all_single and a local sum)."""
    from fcoll.ops.library import start_reduce_scatter

    work, finish = start_reduce_scatter(pg, out, input, "sum", input.dtype)
    work.wait()
    if finish is not None:
        finish()


def _time_collective(kind: str, pg: Any, nbytes: int, reps: int) -> float:
    """Fastest time of one blocking collective of ``nbytes`` (the larger buffer), in us."""
    import torch.distributed as dist

    n = pg.size()
    numel = max(n, nbytes // 4 // n * n)
    big, out = torch.zeros(numel), torch.zeros(numel)
    small = torch.zeros(numel // n)
    ops = {
        "all_reduce": lambda: dist.all_reduce(big, group=pg),
        "all_gather": lambda: _quiet(dist.all_gather_into_tensor, big, small, group=pg),
        "reduce_scatter": lambda: _reduce_scatter_as_fcoll_does(pg, small, big),
        "all_to_all": lambda: dist.all_to_all_single(out, big, group=pg),
        "broadcast": lambda: dist.broadcast(big, group=pg, group_src=0),
    }
    op = ops[kind]
    op()  # warm-up, and lines the ranks up
    return _min_us(op, reps)


def fit_alpha_beta(b1: int, t1: float, b2: int, t2: float) -> CommParams:
    """Alpha-beta through two timed sizes (``b1 < b2`` bytes, ``t1``/``t2`` us). A larger
    message measured faster (noise) gives a tiny positive beta; alpha is never negative."""
    beta = max((t2 - t1) / (b2 - b1), 1e-9)
    return CommParams(alpha_us=max(t1 - beta * b1, 0.0), beta_us_per_byte=beta)


def _measure_on_rank_0(pg: Any, reps: int) -> list[float]:
    """Rank 0's compute rates and collective times (two sizes per kind), on every rank."""
    import torch.distributed as dist

    # Inside torch.compile the Python dispatcher is on, and a c10d op then runs its kernel with
    # the GIL held (pybind released it, the Python dispatcher took it back). On gloo that
    # deadlocks: the enqueue waits for the worker's queue mutex, and the worker holds it while
    # destroying the previous Work, whose tensors need the GIL to drop their Python objects
    # (seen in native stacks of both ranks of tests/test_remaps.py's 2-rank program). Without
    # the Python dispatcher the GIL stays released in the kernel.
    with no_python_dispatcher():
        local = measure_compute_rates()
        dist.barrier(group=pg)  # ranks may reach this seconds apart (compile times differ)
        values = [local.flops_per_us, local.bytes_per_us, local.op_overhead_us]
        for kind in KINDS:
            values += [_time_collective(kind, pg, b, reps) for b in CALIBRATION_BYTES]
        shared = torch.tensor(values, dtype=torch.float64)
        dist.broadcast(shared, group=pg, group_src=0)
    return shared.tolist()


def calibrate_group(pg: Any, reps: int = 3) -> tuple[ComputeRates, dict[tuple[str, str, int],
                                                                         CommParams]]:
    """Time every collective kind at two sizes on ``pg``, fit alpha-beta, share rank 0's numbers.

    A collective call: every rank of ``pg`` must call it at the same point. Results are cached
    per process group (weakly); a second call returns the cached objects without communicating.
    The compute rates of rank 0 are broadcast in the same message.
    (``benchmarks/passes_scaling.py --rank-costs`` prints how long it takes.)

    Returns:
        (compute rates, ``{(backend, kind, group size): CommParams}``), rank 0's numbers.
    """
    if pg in _CACHE.groups:
        _, rates, comm = _CACHE.groups[pg]
        return rates, comm
    backend, n = _backend_name(pg), pg.size()
    t0 = time.perf_counter()
    v = _measure_on_rank_0(pg, reps)
    rates = ComputeRates(*v[:3])
    b1, b2 = CALIBRATION_BYTES
    comm = {(backend, kind, n): fit_alpha_beta(b1, v[3 + 2 * i], b2, v[4 + 2 * i])
            for i, kind in enumerate(KINDS)}
    _CACHE.groups[pg] = (backend, rates, comm)
    log.debug("calibrated group %s (%s, %d ranks) in %.0f ms: %s", pg.group_name, backend, n,
              (time.perf_counter() - t0) * 1e3, comm)
    return rates, comm


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
    return None if _backend_name(pg) in ("fake", "unknown") else pg


def moves_data_on_compute_cores(group_name: str) -> bool:
    """True when the group's backend is fcoll's shared-memory one: its collectives are copies
    and reductions run by the same CPU cores (and processes) as the compute, so "hiding" one
    behind compute mostly shares those cores. The bucket planner's timing rule does not apply
    to such groups: keeping collectives apart to hide them gains little when the cores are
    shared and costs a fixed overhead per collective, so few large buckets win there, while on
    a network backend hiding communication behind compute is what the rule buys."""
    pg = _real_group(group_name)
    return pg is not None and _backend_name(pg) == "fcoll"


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


def _assemble(gm: fx.GraphModule, estimator, calibrate: bool,
              estimates: dict | None = None) -> CostModel:
    compute, comm, backends = None, {}, {}
    for name in _group_names(gm):
        pg = _real_group(name)
        if pg is None:
            continue
        if calibrate:
            rates, params = calibrate_group(pg)
        elif pg in _CACHE.groups:
            _, rates, params = _CACHE.groups[pg]
        else:
            log.debug("group %s is not calibrated yet: default costs", name)
            continue
        backends[name] = _backend_name(pg)
        comm.update(params)
        compute = compute or rates
    return assemble_model(compute, comm, backends, estimator, estimates)


def model_for(gm: fx.GraphModule, estimator: Callable[[Any], float | None] | None = None,
              estimates: dict | None = None) -> CostModel:
    """The cost model for ``gm``, calibrating each real group of its collectives if needed.

    A collective call on real groups (see :func:`calibrate_group`); defaults on the fake pg.
    ``estimates``: see :func:`fcoll.passes.cost.assemble_model`.
    """
    return _assemble(gm, estimator, calibrate=True, estimates=estimates)


def cached_model(gm: fx.GraphModule, estimator: Callable[[Any], float | None] | None = None,
                 estimates: dict | None = None) -> CostModel:
    """Like :func:`model_for` but never communicates: uncalibrated groups use defaults."""
    return _assemble(gm, estimator, calibrate=False, estimates=estimates)
