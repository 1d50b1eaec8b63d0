"""Cost model: estimated time of each graph node, in microseconds. Pure: this module measures
nothing and never communicates; :mod:`fcoll.passes.analysis.calibration` measures the parameters.

Communication follows a piecewise alpha-beta (Hockney) model per (backend, collective kind,
group size, link), fitted from a calibration sweep over message sizes (formula and sources:
:mod:`fcoll.passes.analysis.comm_cost`); ``bytes`` is :func:`fcoll.passes.graph.collective_bytes`,
the larger of the collective's input and output on this rank (the whole gathered output for
all_gather, the whole input for reduce_scatter).

Compute follows a roofline: ``t = op_overhead_us + max(flops / flops_per_us,
bytes / bytes_per_us)`` for each aten node, with FLOPs from ``torch.utils.flop_counter``'s
formulas and bytes = inputs read + output written (view ops cost nothing).

Without measured parameters (the fake process group, no initialised process group, a group not
calibrated yet) deterministic defaults are used (:data:`DEFAULT_COMPUTE`, :func:`default_comm`),
so snapshot tests are stable. A user's ``config.estimator(node) -> float | None`` takes
precedence for every node it answers.

Symbolic sizes (:func:`value_size`, :func:`collective_size`, :func:`estimate_int`): a backed
size (``s0``) uses its hint. A *data-dependent* (unbacked, ``u0``) size, e.g. an all_to_all's
``output_split_sizes = counts.tolist()``, has no hint; it is never guarded on (``int()`` of it
would raise ``GuardOnDataDependentSymNode``) and is estimated instead, by this fallback, first
rule that applies:

1. a collective of kind all_to_all whose input or output has only known sizes is sized by that
   side (rule ``"other side"``): over the group, the bytes sent equal the bytes received, so the
   known side is what a rank moves under balanced routing;
2. otherwise each data-dependent expression is evaluated by PyTorch's
   ``torch.fx.experimental.symbolic_shapes.optimization_hint`` with ``fallback =
   UNBACKED_SIZE_FALLBACK`` (rule ``"fallback"``): a user hint of the symbol if one was given,
   else equalities the shape environment knows, else :data:`UNBACKED_SIZE_FALLBACK` for each
   unbacked symbol, clamped to the symbol's value range (so ``torch._check(u0 <= cap)`` makes
   the estimate at most ``cap``).

Every estimate made so is marked: :class:`SizeEstimate` ``.estimated`` and ``.symbols``, which the
scheduler copies into ``node.meta[META_SIZE_ESTIMATE]`` and the predicted timeline into
``PredictedEvent.size_estimated``. A data-dependent estimate is a guess for planning only: the
executed graph moves the real sizes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from fcoll.compat import optimization_hint
from fcoll.ops.facts import KINDS
from fcoll.passes.analysis.comm_cost import (
    LINKS, Comm, CommCurve, CommKey, CommParams, CommTable, comm_time_us, default_comm,
)
from fcoll.passes.graph import (
    arg_of, collective_bytes, input_bytes, node_bytes, op_kind, per_op, size_hint,
)
from fcoll.passes.analysis.memory import COLLECTIVE, WAIT, op_class

__all__ = [
    "CommParams", "CommCurve", "CommKey", "CommTable", "LINKS", "comm_time_us", "ComputeRates",
    "CostModel", "DEFAULT_COMPUTE", "KINDS", "default_comm",
    "assemble_model", "node_flops", "node_io_bytes", "is_free_op", "collective_bytes",
    "UNBACKED_SIZE_FALLBACK", "META_SIZE_ESTIMATE", "SizeEstimate", "estimate_int",
    "value_size", "collective_size",
]

log = logging.getLogger(__name__)

#: Value assumed for one data-dependent (unbacked) symbol that has neither a user hint nor a
#: tighter value range, in the symbol's own unit (rows, for split sizes). 8192 is Inductor's
#: default ``torch._inductor.config.unbacked_symint_fallback``, so fcoll's plans and
#: Inductor's kernels assume the same sizes; it is passed explicitly (no global config is read).
UNBACKED_SIZE_FALLBACK = 8192

#: node.meta key on a collective whose size the scheduler estimated (data-dependent sizes): a
#: dict ``{"bytes": int, "rule": "other side" | "fallback", "symbols": [str, ...]}``.
META_SIZE_ESTIMATE = "fcoll_size_estimate"


@dataclass(frozen=True)
class SizeEstimate:
    """Bytes of a value (or of a collective's message), and how they were obtained.

    Attributes:
        nbytes: bytes on this rank; an estimate when ``symbols`` is not empty.
        symbols: names of the data-dependent (unbacked) symbols the size depends on, sorted;
            empty when every size is known (static, or backed and evaluated with its hint).
        rule: "exact" (no data-dependent size), "other side" or "fallback" (the module
            docstring's rules 1 and 2).
    """

    nbytes: int
    symbols: tuple[str, ...] = ()
    rule: str = "exact"

    @property
    def estimated(self) -> bool:
        """True when ``nbytes`` assumes data-dependent sizes (see the module docstring)."""
        return bool(self.symbols)


def estimate_int(x: Any, fallback: int = UNBACKED_SIZE_FALLBACK) -> int:
    """An int for an int, a ``SymInt`` or a sympy expression, never guarding: backed symbols
    use their hints, data-dependent ones the module docstring's rule 2 (``fallback`` per
    unbacked symbol, clamped to its value range)."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        if not free_unbacked_symbols(x):
            return size_hint(x)
        return optimization_hint(x, fallback=fallback)
    return size_hint(x)


def _unbacked_names(x: Any) -> set[str]:
    return {str(s) for s in free_unbacked_symbols(x)} if isinstance(x, torch.SymInt) else set()


def value_size(val: Any, fallback: int = UNBACKED_SIZE_FALLBACK) -> SizeEstimate:
    """Bytes of a (fake) tensor, or of every tensor in a list/tuple (0 for anything else).

    Static shapes are exact; backed symbolic sizes use their hints; data-dependent sizes are
    estimated by :func:`estimate_int` (rule "fallback") and named in ``symbols``.
    """
    if isinstance(val, torch.Tensor):
        if not val._has_symbolic_sizes_strides:
            return SizeEstimate(val.numel() * val.element_size())
        names: set[str] = set()
        numel = 1
        for s in val.shape:
            names |= _unbacked_names(s)
            numel *= estimate_int(s, fallback)
        syms = tuple(sorted(names))
        return SizeEstimate(numel * val.element_size(), syms, "fallback" if syms else "exact")
    if isinstance(val, (list, tuple)):
        parts = [value_size(v, fallback) for v in val]
        syms = tuple(sorted({s for p in parts for s in p.symbols}))
        return SizeEstimate(sum(p.nbytes for p in parts), syms, "fallback" if syms else "exact")
    return SizeEstimate(0)


def _sum_sizes(parts: list[SizeEstimate]) -> SizeEstimate:
    syms = tuple(sorted({s for p in parts for s in p.symbols}))
    return SizeEstimate(sum(p.nbytes for p in parts), syms, "fallback" if syms else "exact")


def _inputs_size(node: fx.Node, fallback: int) -> SizeEstimate:
    """Bytes of the values of ``node``'s input nodes, each counted once (SymInt-valued nodes,
    such as split sizes, count 0)."""
    return _sum_sizes([value_size(i.meta.get("val"), fallback) for i in node.all_input_nodes])


def collective_size(node: fx.Node, fallback: int = UNBACKED_SIZE_FALLBACK) -> SizeEstimate:
    """Message size of collective ``node`` on this rank: the larger of its inputs' and its
    output's bytes (:func:`fcoll.passes.graph.collective_bytes`), with data-dependent sizes
    estimated by the module docstring's rules (an all_to_all with one known side: that side).

    Shapes: all_to_all_single ``input [sum(input_split_sizes), *] -> output
    [sum(output_split_sizes), *]``, either sum possibly data-dependent.
    """
    if not _has_symbolic(node):
        return SizeEstimate(collective_bytes(node))
    inp = _inputs_size(node, fallback)
    out = value_size(node.meta.get("val"), fallback)
    if not inp.estimated and not out.estimated:
        return SizeEstimate(max(inp.nbytes, out.nbytes))
    syms = tuple(sorted({*inp.symbols, *out.symbols}))
    if op_kind(node.target) == "all_to_all" and inp.estimated != out.estimated:
        known = out if inp.estimated else inp
        return SizeEstimate(known.nbytes, syms, "other side")
    return SizeEstimate(max(inp.nbytes, out.nbytes), syms, "fallback")


def _has_symbolic(node: fx.Node) -> bool:
    """Whether ``node``'s value or any input's value has a symbolic size (the slow path)."""
    def symbolic(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            return v._has_symbolic_sizes_strides
        return isinstance(v, (list, tuple)) and any(symbolic(x) for x in v)

    return symbolic(node.meta.get("val")) or \
        any(symbolic(i.meta.get("val")) for i in node.all_input_nodes)


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


@dataclass(frozen=True)
class CostModel:
    """Estimated node times in microseconds.

    Attributes:
        compute: machine rates for compute nodes: the rates of the graph's first calibrated
            group (creation order). Each group's rates are its rank 0's measurement, so two
            ranks whose first groups differ (a DP and a TP group: rank 1's DP group is not
            rank 0's) may hold different ``compute``; a decision every rank of a group must
            share reads :meth:`for_group` instead.
        comm: ``CommKey(backend, kind, group_size, link) -> CommCurve | CommParams``;
            missing entries use :func:`default_comm`.
        group_backends: group name -> backend name, for looking up ``comm``.
        group_links: group name -> link ("intra" or "inter"); missing names are "intra".
        group_compute: group name -> the compute rates that group's calibration carries (the
            same on every rank of the group); missing names use ``compute``.
        estimator: a user estimator ``node -> float | None`` (microseconds), asked first.
        source: "default" or "calibrated" (for logs and reports).
    """

    compute: ComputeRates = DEFAULT_COMPUTE
    comm: Mapping[CommKey, Comm] = field(default_factory=dict)
    group_backends: Mapping[str, str] = field(default_factory=dict)
    group_links: Mapping[str, str] = field(default_factory=dict)
    group_compute: Mapping[str, ComputeRates] = field(default_factory=dict)
    estimator: Callable[[Any], float | None] | None = field(default=None, compare=False)
    source: str = "default"
    _memo: dict = field(default_factory=dict, compare=False, repr=False)
    #: node -> (args, kwargs, val, us): compute estimates shared by the passes of one pipeline
    #: run (see :func:`assemble_model`); an entry counts only while the node's args, kwargs and
    #: value are the very objects it was computed from.
    by_node: dict | None = field(default=None, compare=False, repr=False)
    #: the ``estimates`` dict of :func:`assemble_model` (for :meth:`for_group`'s models).
    _estimates: dict | None = field(default=None, compare=False, repr=False)
    #: group name -> its :meth:`for_group` model, built on first use.
    _by_group: dict = field(default_factory=dict, compare=False, repr=False)

    def for_group(self, group_name: str) -> "CostModel":
        """This model with ``compute`` set to the rates of group ``group_name``
        (``group_compute``; ``compute`` for a group without its own), itself when they are
        equal. Every rank of the group gets the same rates, whatever its other groups are."""
        rates = self.group_compute.get(group_name, self.compute)
        if rates == self.compute:
            return self
        model = self._by_group.get(group_name)
        if model is None:
            model = self._by_group[group_name] = assemble_model(
                rates, self.comm, self.group_backends, self.estimator, self._estimates,
                self.group_links, self.group_compute)
        return model

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
        """The calibrated curve's time of collective ``node`` (:func:`comm_params`), bytes
        from :func:`collective_size` (data-dependent sizes estimated: module docstring)."""
        size = collective_size(node)
        if size.estimated:
            log.debug("%s: data-dependent size (%s): costed as %d bytes (rule %r)", node.name,
                      ", ".join(size.symbols), size.nbytes, size.rule)
        return self.comm_params(node).time_us(size.nbytes)

    def comm_params(self, node: fx.Node) -> Comm:
        """The communication curve of collective ``node`` (its kind, group, group size and
        link); anything with ``time_us(nbytes)``."""
        name, n = str(arg_of(node, "group_name")), arg_of(node, "group_size", None)
        if n is None:  # ops without a group_size argument: the registered group's size
            n = _registered_group_size(name)
        n = n or 2
        kind = op_kind(node.target)
        key = CommKey(self.group_backends.get(name, "default"), kind, n,
                      self.group_links.get(name, "intra"))
        return self.comm.get(key) or default_comm(kind, n)

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


def _registered_group_size(group_name: str) -> int | None:
    """Ranks in the group registered as ``group_name``, None if none is (not initialised, an
    unknown name). Read without :func:`~fcoll.passes.graph.collective_info`, which also
    evaluates every size of the node."""
    try:
        from fcoll.ops.groups import group_size

        return group_size(group_name)
    except Exception:  # noqa: BLE001  not initialised, unknown name: the size is unknown
        return None


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
        return estimate_int(formula(*_vals(node.args), **_vals(node.kwargs),
                                    out_val=node.meta.get("val")))
    except Exception as e:  # noqa: BLE001  a formula that cannot handle these args: count 0
        log.debug("no FLOP count for %s (%s): %s", node.name, node.target, e)
        return 0


def node_io_bytes(node: fx.Node) -> int:
    """Bytes read (tensor inputs) plus written (output) by ``node``: backed sizes evaluated
    with their hints, data-dependent ones by the module docstring's rule 2."""
    if not _has_symbolic(node):
        return node_bytes(node) + input_bytes(node)
    return value_size(node.meta.get("val")).nbytes + \
        _inputs_size(node, UNBACKED_SIZE_FALLBACK).nbytes


def assemble_model(compute: ComputeRates | None, comm: Mapping[CommKey, Comm],
                   group_backends: Mapping[str, str],
                   estimator: Callable[[Any], float | None] | None = None,
                   estimates: dict | None = None,
                   group_links: Mapping[str, str] | None = None,
                   group_compute: Mapping[str, ComputeRates] | None = None) -> CostModel:
    """The :class:`CostModel` of given parameters.

    Args:
        compute: measured compute rates, or None for :data:`DEFAULT_COMPUTE`.
        comm: ``CommKey -> CommCurve | CommParams`` of the calibrated groups.
        group_backends: group name -> backend name of the calibrated groups; the model's
            ``source`` is "calibrated" when there is any, else "default".
        estimator: the user's estimator ``node -> float | None`` (microseconds), asked first.
        estimates: a dict shared by the passes of one pipeline run (``FcollPass.estimates``):
            compute estimates are kept in it per compute rates, then per node, so that a later
            pass does not estimate a node again.
        group_links: group name -> "intra" | "inter" of the calibrated groups.
        group_compute: group name -> compute rates of the calibrated groups
            (:meth:`CostModel.for_group`).
    """
    compute = compute or DEFAULT_COMPUTE
    return CostModel(compute=compute, comm=dict(comm), group_backends=dict(group_backends),
                     group_links=dict(group_links or {}),
                     group_compute=dict(group_compute or {}),
                     estimator=estimator, source="calibrated" if group_backends else "default",
                     by_node=estimates.setdefault(compute, {}) if estimates is not None else None,
                     _estimates=estimates)
