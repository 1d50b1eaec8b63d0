"""Cost model: estimated time of each graph node, in microseconds.

Communication follows the alpha-beta (Hockney) model per (backend, collective kind, group size):
``t = alpha_us + beta_us_per_byte * bytes``, where ``bytes`` is the larger of the collective's
input and output on this rank (the whole gathered output for all_gather, the whole input for
reduce_scatter). The two parameters are fitted from two message sizes timed on the real backend,
once per process group per process (:func:`calibrate_group`), and rank 0's numbers are
broadcast through that group, so every rank plans the same schedule.

Compute follows a roofline: ``t = op_overhead_us + max(flops / flops_per_us,
bytes / bytes_per_us)`` for each aten node, with FLOPs from ``torch.utils.flop_counter``'s
formulas and bytes = inputs read + output written (view ops cost nothing). The three rates are
measured once per process by a short microbenchmark (:func:`measure_compute_rates`) and shared
from rank 0 together with the communication numbers.

On the fake process group, without an initialised process group, or before calibration,
deterministic defaults are used (:data:`DEFAULT_COMPUTE`, :func:`default_comm`), so snapshot
tests are stable. Symbolic sizes are evaluated with their hints (``graph.size_hint``). A user's
``config.estimator(node) -> float | None`` takes precedence for every node it answers.

Calibration is a collective call: it must run on every rank of the group at the same point (the
``reorder_for_overlap`` pass does that, on every rank, for the groups of its graph in graph order).
:func:`cached_model` never communicates.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch._dispatch.python import no_python_dispatcher

from fcoll.passes.graph import arg_of, collective_info, collective_kind, size_hint
from fcoll.passes.memory import COLLECTIVE, WAIT, _Probe, op_class, per_op, value_bytes

__all__ = [
    "CommParams", "ComputeRates", "CostModel", "DEFAULT_COMPUTE", "KINDS", "default_comm",
    "busbw_factor", "measure_compute_rates", "calibrate_group", "cached_model", "model_for",
    "node_flops", "node_io_bytes", "is_free_op", "collective_bytes", "moves_data_on_compute_cores",
]

log = logging.getLogger(__name__)

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
#: Message sizes (bytes) timed by the calibration: one latency-bound, one bandwidth-bound. The
#: large one must be well past any burst a link lets through at full speed: on a 1 gbit tbf link
#: with a 256 KiB burst, 1 MiB made a 3 MiB all_gather look 25 % faster than it ran.
CALIBRATION_BYTES = (16 * 1024, 4 * 1024 * 1024)


@dataclass(frozen=True)
class CommParams:
    """Alpha-beta parameters of one collective kind on one group: ``alpha_us + beta * bytes``."""

    alpha_us: float
    beta_us_per_byte: float

    def time_us(self, nbytes: int) -> float:
        return self.alpha_us + self.beta_us_per_byte * nbytes


@dataclass(frozen=True)
class ComputeRates:
    """Machine rates of the compute roofline.

    Attributes:
        flops_per_us: sustained matmul FLOPs per microsecond.
        bytes_per_us: memory bytes moved per microsecond (read + write) by elementwise ops.
        op_overhead_us: fixed cost of launching one op (eager dispatch), in microseconds.
    """

    flops_per_us: float
    bytes_per_us: float
    op_overhead_us: float


#: Deterministic compute defaults (50 GFLOP/s, 10 GB/s, 5 us per op): the fake pg and tests.
DEFAULT_COMPUTE = ComputeRates(flops_per_us=5.0e4, bytes_per_us=1.0e4, op_overhead_us=5.0)


def busbw_factor(kind: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor: all_reduce 2(n-1)/n; gather, scatter, a2a (n-1)/n; bcast 1."""
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind == "broadcast":
        return 1.0
    return (n - 1) / n


def default_comm(kind: str, group_size: int) -> CommParams:
    """Deterministic defaults: 30 us latency, 1 GB/s bus bandwidth (nccl-tests factors)."""
    return CommParams(alpha_us=30.0, beta_us_per_byte=busbw_factor(kind, max(group_size, 2)) / 1e3)


@dataclass(frozen=True)
class CostModel:
    """Estimated node times in microseconds.

    Attributes:
        compute: machine rates for compute nodes.
        comm: ``(backend, kind, group_size) -> CommParams``; missing entries use
            :func:`default_comm`.
        group_backends: group name -> backend name, for looking up ``comm``.
        estimator: a user estimator ``node -> float | None`` (microseconds), asked first.
        source: "default" or "calibrated" (for logs and reports).
    """

    compute: ComputeRates = DEFAULT_COMPUTE
    comm: Mapping[tuple[str, str, int], CommParams] = field(default_factory=dict)
    group_backends: Mapping[str, str] = field(default_factory=dict)
    estimator: Callable[[Any], float | None] | None = field(default=None, compare=False)
    source: str = "default"
    _memo: dict = field(default_factory=dict, compare=False, repr=False)
    #: node -> (args, kwargs, val, us): compute estimates shared by the passes of one pipeline
    #: run (see :func:`model_for`); an entry counts only while the node's args, kwargs and value
    #: are the very objects it was computed from.
    by_node: dict | None = field(default=None, compare=False, repr=False)

    def __call__(self, node: fx.Node) -> float:
        return self.estimate(node)

    def estimate(self, node: fx.Node) -> float:
        """Time of ``node`` in microseconds (0 for placeholders, outputs, views and waits)."""
        if self.estimator is not None:
            user = self.estimator(node)
            if user is not None:
                return float(user)
        if node.op != "call_function":
            return 0.0
        cls = op_class(node)
        if cls == COLLECTIVE:
            return self.collective_us(node)
        if cls == WAIT or is_free_op(node):
            return 0.0
        return self.compute_us(node)

    def collective_us(self, node: fx.Node) -> float:
        return self.comm_params(node).time_us(collective_bytes(node))

    def comm_params(self, node: fx.Node) -> CommParams:
        """The alpha-beta parameters of collective ``node`` (its kind, group and group size)."""
        name, n = str(arg_of(node, "group_name")), arg_of(node, "group_size", None)
        if n is None:  # ops without a group_size argument: the registered group's size
            n = collective_info(node).group_size
        n = n or 2
        kind = _collective_kind(node.target)
        backend = self.group_backends.get(name, "default")
        return self.comm.get((backend, kind, n)) or default_comm(kind, n)

    def compute_us(self, node: fx.Node) -> float:
        """``op_overhead_us + max(flops / flops_per_us, io_bytes / bytes_per_us)``, memoized
        per (op, argument shapes and dtypes, output shapes and dtypes): layers repeat, and the
        FLOP formulas (pytree-heavy) would otherwise dominate planning time on large graphs.
        Symbolic sizes are not memoized (a SymInt is unhashable)."""
        args, kwargs, val = node.args, node.kwargs, node.meta.get("val")
        by_node = self.by_node
        if by_node is not None:
            seen = by_node.get(node)
            if seen is not None and seen[0] is args and seen[1] is kwargs and seen[2] is val:
                return seen[3]
        key = (id(node.target), _signature(args), _signature(kwargs), _signature(val))
        try:
            hit = self._memo.get(key)
        except TypeError:
            return self._compute_us(node)
        if hit is None or hit[0] is not node.target:
            hit = self._memo[key] = (node.target, self._compute_us(node))
        if by_node is not None:
            by_node[node] = (args, kwargs, val, hit[1])
        return hit[1]

    def _compute_us(self, node: fx.Node) -> float:
        r = self.compute
        return r.op_overhead_us + max(node_flops(node) / r.flops_per_us,
                                      node_io_bytes(node) / r.bytes_per_us)


def _signature(x: Any) -> Any:
    """What a compute estimate depends on in ``x`` (an argument, kwargs or a value): tensors
    by (shape, dtype), nodes by their value's, containers element-wise, other values as they
    are (``repr`` if unhashable)."""
    if isinstance(x, fx.Node):
        x = x.meta.get("val")
        if not isinstance(x, torch.Tensor):
            return ("node", repr(x) if x is not None else None)
    if isinstance(x, torch.Tensor):
        return (x.shape, x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_signature(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _signature(v)) for k, v in x.items())
    if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return x
    return repr(x)


def is_free_op(node: fx.Node) -> bool:
    """True for nodes that move no data: views (aliasing returns), getitem, non-aten calls."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return _returns_views(target)


@per_op
def _returns_views(target: torch._ops.OpOverload) -> bool:
    """Schema fact, memoized per op: every return aliases an input without writing it."""
    returns = target._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                 for r in returns)


def _vals(x: Any) -> Any:
    """``x`` with every node replaced by its ``meta["val"]`` (lists and tuples too)."""
    if isinstance(x, fx.Node):
        return x.meta.get("val")
    if isinstance(x, (list, tuple)):
        return type(x)(_vals(v) for v in x)
    if isinstance(x, dict):
        return {k: _vals(v) for k, v in x.items()}
    return x


@per_op
def _collective_kind(target: Any) -> str:
    return collective_kind(_Probe(target))


def collective_bytes(node: fx.Node) -> int:
    """``max(in_bytes, out_bytes)`` of a collective on this rank (as :class:`CollectiveInfo`),
    without building the whole info: the larger of its output and its tensor inputs."""
    read = 0
    for i in node.all_input_nodes:
        read += value_bytes(i.meta.get("val"))
    return max(read, value_bytes(node.meta.get("val")))


@per_op
def _flop_formula(target: Any) -> Callable | None:
    from torch.utils.flop_counter import flop_registry

    packet = getattr(target, "overloadpacket", None)
    return flop_registry.get(packet) if packet is not None else None


def node_flops(node: fx.Node) -> int:
    """FLOPs of an aten node from ``torch.utils.flop_counter`` formulas (0 if it has none)."""
    formula = _flop_formula(node.target)
    if formula is None:
        return 0
    try:
        return size_hint(formula(*_vals(node.args), **_vals(node.kwargs),
                                 out_val=node.meta.get("val")))
    except Exception as e:  # noqa: BLE001  a formula that cannot handle these args: count 0
        log.debug("no FLOP count for %s (%s): %s", node.name, node.target, e)
        return 0


def node_io_bytes(node: fx.Node) -> int:
    """Bytes read (tensor inputs) plus written (output) by ``node``, sizes evaluated with hints."""
    total = value_bytes(node.meta.get("val"))
    for i in node.all_input_nodes:
        total += value_bytes(i.meta.get("val"))
    return total


# ---------------------------------------------------------------------------------------------
# Calibration (measured once per process / per process group, cached)

class _Cache:
    """Per-process calibration results: compute rates, and comm params per live process group."""

    def __init__(self) -> None:
        self.compute: ComputeRates | None = None
        self.groups: "weakref.WeakKeyDictionary[Any, tuple[str, ComputeRates, dict]]" = (
            weakref.WeakKeyDictionary())


_CACHE = _Cache()  # the one process-level cache (calibration is a property of the process)


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
    (a matmul that found the caches warm and the other core idle)."""
    return sorted(_times_us(fn, reps))[reps // 2]


def _per_call_us(fn: Callable[[], None], calls: int, reps: int) -> float:
    """Fastest of ``reps`` runs of ``calls`` back-to-back calls, in us per call."""
    return _min_us(lambda: [fn() for _ in range(calls)], reps) / calls


#: The calibration matmul: [1024, 256] @ [256, 768], a transformer layer's QKV projection for
#: 1024 tokens of width 256 (0.4 GFLOP), the scale of the matmuls the passes schedule.
_MM_SHAPE = (1024, 256, 768)


def measure_compute_rates(reps: int = 5) -> ComputeRates:
    """Microbenchmark this process's CPU (~50 ms): the median of a [1024, 256] @ [256, 768]
    matmul, the fastest 4 MiB copy, and a tiny aten op called as the executor calls it (an
    ``OpOverload``, 2-3 us, against 1.2 us for ``torch.add``).

    A 256^3 matmul timed by its fastest run said 161 GFLOP/s here, while the matmuls of a
    training step ran at 50-100 GFLOP/s (per-node trace, 2 ranks on 2 cores): the estimates of
    compute, and so the time the scheduler counts on to hide communication, were 1.6-3x short.

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


def _fit(b1: int, t1: float, b2: int, t2: float) -> CommParams:
    beta = max((t2 - t1) / (b2 - b1), 1e-9)
    return CommParams(alpha_us=max(t1 - beta * b1, 0.0), beta_us_per_byte=beta)


def calibrate_group(pg: Any, reps: int = 3) -> tuple[ComputeRates, dict[tuple[str, str, int],
                                                                         CommParams]]:
    """Time every collective kind at two sizes on ``pg``, fit alpha-beta, share rank 0's numbers.

    A collective call: every rank of ``pg`` must call it at the same point. Results are cached
    per process group (weakly); a second call returns the cache without communicating. The
    compute rates of rank 0 are broadcast in the same message. Takes ~0.1-0.3 s on gloo.

    Returns:
        (compute rates, ``{(backend, kind, group size): CommParams}``), rank 0's numbers.
    """
    import torch.distributed as dist

    if pg in _CACHE.groups:
        _, rates, comm = _CACHE.groups[pg]
        return rates, comm
    backend, n = _backend_name(pg), pg.size()
    t0 = time.perf_counter()
    # Inside torch.compile the Python dispatcher is on, and a c10d op then runs its kernel with
    # the GIL held (pybind released it, the Python dispatcher took it back). On gloo that
    # deadlocks: the enqueue waits for the worker's queue mutex, and the worker holds it while
    # destroying the previous Work, whose tensors need the GIL to drop their Python objects
    # (native stacks of both ranks taken with py-spy; 1 hang in 2-3 runs of
    # tests/test_remaps.py's 2-rank program). Without the Python dispatcher the GIL stays
    # released in the kernel.
    with no_python_dispatcher():
        local = measure_compute_rates()
        dist.barrier(group=pg)  # ranks may reach this seconds apart (compile times differ)
        values = [local.flops_per_us, local.bytes_per_us, local.op_overhead_us]
        for kind in KINDS:
            values += [_time_collective(kind, pg, b, reps) for b in CALIBRATION_BYTES]
        shared = torch.tensor(values, dtype=torch.float64)
        dist.broadcast(shared, group=pg, group_src=0)
    v = shared.tolist()
    rates = ComputeRates(*v[:3])
    comm = {}
    (b1, b2) = CALIBRATION_BYTES
    for i, kind in enumerate(KINDS):
        comm[(backend, kind, n)] = _fit(b1, v[3 + 2 * i], b2, v[4 + 2 * i])
    _CACHE.groups[pg] = (backend, rates, comm)
    log.debug("calibrated group %s (%s, %d ranks) in %.0f ms: %s", pg.group_name, backend, n,
              (time.perf_counter() - t0) * 1e3, comm)
    return rates, comm


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
    to such groups: on the DDP example at 2 ranks it made the step 5 % slower there (246 ->
    259 ms, 44 collectives instead of a few buckets), while on gloo over a rate-limited link it
    cut exposed communication by half."""
    pg = _real_group(group_name)
    return pg is not None and _backend_name(pg) == "fcoll"


def _group_names(gm: fx.GraphModule) -> list[str]:
    """Names of the groups ``gm``'s collectives use, in the order the groups were created.

    Calibration is a blocking collective per group, so every rank must calibrate its groups in
    one global order. Graph order is not one: rank-dependent code (a reduce's copy on the
    destination only, uneven all_to_all splits) can make two ranks meet their groups in a
    different order, which hung 2 of 3 runs here. Creation order is the same on every rank
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
    compute, comm, backends, source = None, {}, {}, "default"
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
        source = "calibrated"
    compute = compute or DEFAULT_COMPUTE
    return CostModel(compute=compute, comm=comm, group_backends=backends, estimator=estimator,
                     source=source,
                     by_node=estimates.setdefault(compute, {}) if estimates is not None else None)


def model_for(gm: fx.GraphModule, estimator: Callable[[Any], float | None] | None = None,
              estimates: dict | None = None) -> CostModel:
    """The cost model for ``gm``, calibrating each real group of its collectives if needed.

    A collective call on real groups (see :func:`calibrate_group`); defaults on the fake pg.
    ``estimates``: a dict shared by the passes of one pipeline run (``FcollPass.estimates``), in
    which compute estimates are kept per node, per compute rates, so that a later pass does
    not estimate a node again.
    """
    return _assemble(gm, estimator, calibrate=True, estimates=estimates)


def cached_model(gm: fx.GraphModule, estimator: Callable[[Any], float | None] | None = None,
                 estimates: dict | None = None) -> CostModel:
    """Like :func:`model_for` but never communicates: uncalibrated groups use defaults."""
    return _assemble(gm, estimator, calibrate=False, estimates=estimates)
