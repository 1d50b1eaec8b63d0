"""Cost model: estimated time of each graph node, in microseconds. Pure: this module measures
nothing and never communicates; :mod:`fcoll.passes.calibrate` measures the parameters.

Communication follows the alpha-beta (Hockney) model per (backend, collective kind, group size):
``t = alpha_us + beta_us_per_byte * bytes``, where ``bytes`` is
:func:`fcoll.passes.graph.collective_bytes`, the larger of the collective's input and output on
this rank (the whole gathered output for all_gather, the whole input for reduce_scatter).

Compute follows a roofline: ``t = op_overhead_us + max(flops / flops_per_us,
bytes / bytes_per_us)`` for each aten node, with FLOPs from ``torch.utils.flop_counter``'s
formulas and bytes = inputs read + output written (view ops cost nothing).

Without measured parameters (the fake process group, no initialised process group, a group not
calibrated yet) deterministic defaults are used (:data:`DEFAULT_COMPUTE`, :func:`default_comm`),
so snapshot tests are stable. Symbolic sizes are evaluated with their hints
(``graph.size_hint``). A user's ``config.estimator(node) -> float | None`` takes precedence for
every node it answers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from fcoll.ops.facts import KINDS, busbw_factor
from fcoll.passes.graph import (
    arg_of, collective_bytes, collective_info, input_bytes, node_bytes, op_kind, per_op, size_hint,
)
from fcoll.passes.memory import COLLECTIVE, WAIT, op_class

__all__ = [
    "CommParams", "ComputeRates", "CostModel", "DEFAULT_COMPUTE", "KINDS", "default_comm",
    "assemble_model", "node_flops", "node_io_bytes", "is_free_op", "collective_bytes",
]

log = logging.getLogger(__name__)


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


def default_comm(kind: str, group_size: int) -> CommParams:
    """Deterministic defaults: 30 us latency, 1 GB/s bus bandwidth, with the nccl-tests bus
    factor (:func:`fcoll.ops.facts.busbw_factor`) of ``max(group_size, 2)`` ranks, so that an
    unknown or one-rank group still costs something."""
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
    #: run (see :func:`assemble_model`); an entry counts only while the node's args, kwargs and
    #: value are the very objects it was computed from.
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
        kind = op_kind(node.target)
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
    return node_bytes(node) + input_bytes(node)


def assemble_model(compute: ComputeRates | None, comm: Mapping[tuple[str, str, int], CommParams],
                   group_backends: Mapping[str, str],
                   estimator: Callable[[Any], float | None] | None = None,
                   estimates: dict | None = None) -> CostModel:
    """The :class:`CostModel` of given parameters.

    Args:
        compute: measured compute rates, or None for :data:`DEFAULT_COMPUTE`.
        comm: ``(backend, kind, group_size) -> CommParams`` of the calibrated groups.
        group_backends: group name -> backend name of the calibrated groups; the model's
            ``source`` is "calibrated" when there is any, else "default".
        estimator: the user's estimator ``node -> float | None`` (microseconds), asked first.
        estimates: a dict shared by the passes of one pipeline run (``FcollPass.estimates``):
            compute estimates are kept in it per compute rates, then per node, so that a later
            pass does not estimate a node again.
    """
    compute = compute or DEFAULT_COMPUTE
    return CostModel(compute=compute, comm=dict(comm), group_backends=dict(group_backends),
                     estimator=estimator, source="calibrated" if group_backends else "default",
                     by_node=estimates.setdefault(compute, {}) if estimates is not None else None)
