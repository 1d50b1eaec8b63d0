"""Overlap passes: ``sink_waits``, ``raise_collectives``, ``reorder_for_overlap``, and ``predict``.

``ar -> wait -> relu -> mm -> add`` becomes ``ar -> mm (hides ar) -> wait -> relu -> add``.

- ``sink_waits``: every ``wait_tensor`` moves down to just before the first node that needs it
  (its first user, or the first node ordered after it by a mutation or barrier).
- ``raise_collectives``: every collective moves up to just after the last node it needs (its
  last input, the previous collective, a mutation or barrier, the last placeholder).
- ``reorder_for_overlap``: the cost-model list scheduler of
  :mod:`fcoll.passes.rewrites.list_scheduler`: each collective is issued as soon as its inputs are
  ready and waited just before its first use, independent compute between them (a collective whose
  input reads an earlier one's wait takes only the compute that covers its estimate, the rest
  hides the earlier one), with ``config.memory_budget_mb`` of extra peak memory and ``config.max_in_flight_mb`` of
  outstanding collective bytes; O((N + E) log N). It records per collective ``META_ESTIMATED_US``,
  ``META_HIDING`` (names of the compute nodes predicted to run while it is in flight) and
  ``META_EXPOSED_US`` in ``node.meta``.

Data-dependent sizes (an all_to_all whose splits come from ``tensor.tolist()``): the scheduler
never guards on them; the cost model sizes such a collective by its documented fallback
(:mod:`fcoll.passes.analysis.cost`: the known side of an all_to_all, else PyTorch's
``optimization_hint`` with :data:`~fcoll.passes.analysis.cost.UNBACKED_SIZE_FALLBACK` per unbacked
symbol), and ``reorder_for_overlap`` records that estimate in
``node.meta[META_SIZE_ESTIMATE]`` (bytes, rule, symbols); :func:`predict` marks the
collective's event ``size_estimated``. Only the plan depends on the guess: the relative order of
collectives is fixed, so every rank issues the same sequence whatever sizes the data gives.

All three keep the relative order of collectives (a different order on different ranks hangs),
are deterministic (ties broken by original position), keep ``node.meta`` (nodes are moved with
``Node.append``, never copied) and are checked by ``FcollPass.ensures``. Sources: Inductor's
``torch/_inductor/comms.py`` (``sink_waits``, ``raise_comms``, ``reorder_compute_for_overlap``)
and ``fx_passes/overlap_scheduling.py`` for the vocabulary; this is fcoll's own code, which needs
neither triton nor a GPU.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from fcoll.passes.analysis.calibration import cached_model, model_for
from fcoll.passes.analysis.cost import META_SIZE_ESTIMATE, CostModel, collective_size
from fcoll.passes.analysis.lanes import PredictedEvent, timeline_of
from fcoll.passes.analysis.memory import COLLECTIVE, op_class
from fcoll.passes.graph import (
    META_ESTIMATED_US, META_EXPOSED_US, META_HIDING, is_collective, is_wait,
)
from fcoll.passes.registry import FcollPass, gc_paused, register_pass
from fcoll.passes.rewrites.list_scheduler import KeyScheduler, list_schedule, ready_counts
from fcoll.passes.rewrites.ordering import apply_order, dependencies
from fcoll.passes.rewrites.shared_plan import sink_input_preparation

__all__ = ["SinkWaits", "RaiseCollectives", "ReorderForOverlap", "PredictedEvent", "predict",
           "sink_waits_order", "raise_collectives_order"]

log = logging.getLogger(__name__)

_MIB = 2 ** 20


def sink_waits_order(graph: fx.Graph) -> list[fx.Node]:
    """The order ``sink_waits`` makes: each wait just before the first node that needs it.

    Method: :class:`~fcoll.passes.rewrites.list_scheduler.KeyScheduler` backwards from the output
    (which stays last) with the priority key "a ready wait first, the one a placement just unblocked
    first, then the latest original position; otherwise the latest original position". Why that is
    sink_waits: backwards, a wait is ready exactly when its first user (in the new order) is
    placed, and is placed at once, so it lands just before that user; waits unblocked by one
    placement keep their original relative order, and a wait that another wait needs goes right
    before it (depth first). Every other node keeps its original relative order: when no wait
    is ready, the latest unplaced non-wait is ready (all its successors are later non-waits,
    already placed, or waits, drained first).
    """
    deps = dependencies(graph)
    pos = deps.pos

    def key(node: fx.Node, step: int) -> tuple:
        return (0, -step, -pos[node]) if is_wait(node) else (1, 0, -pos[node])

    nodes = [n for n in deps.order if n.op != "output"]
    releases, blockers = ready_counts(deps, nodes, backward=True)
    placed = KeyScheduler(releases, blockers, key).run()
    return placed[::-1] + [n for n in deps.order if n.op == "output"]


def raise_collectives_order(graph: fx.Graph) -> list[fx.Node]:
    """The order ``raise_collectives`` makes: each collective just after the last node it needs.

    Method: :class:`~fcoll.passes.rewrites.list_scheduler.KeyScheduler` forwards with the priority
    key "a ready collective first, the one a placement just unblocked first, then the earliest
    original position; otherwise the earliest original position", every collective also waiting for
    the last placeholder or attribute. Why that is raise_collectives: forwards, a collective is
    ready exactly when the last node it needs is placed, and is placed at once, right after it
    (the next collective, which needs it, right after it in turn); every other node keeps its
    original relative order (the mirror of :func:`sink_waits_order`'s argument).
    """
    deps = dependencies(graph)
    pos = deps.pos

    def key(node: fx.Node, step: int) -> tuple:
        return (0, -step, pos[node]) if is_collective(node) else (1, 0, pos[node])

    fixed = [n for n in deps.order if n.op in ("placeholder", "get_attr")]
    extra = {fixed[-1]: [n for n in deps.order if is_collective(n)]} if fixed else None
    releases, blockers = ready_counts(deps, deps.order, backward=False, extra=extra)
    return KeyScheduler(releases, blockers, key).run()


class _ReorderPass(FcollPass):
    """A pass whose whole rewrite is one new node order, planned by ``plan(graph)``."""

    plan: Callable[[fx.Graph], list[fx.Node]]

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        modified = apply_order(graph_module.graph, self.plan(graph_module.graph))
        graph_module.recompile()
        return PassResult(graph_module, modified)


@register_pass
class SinkWaits(_ReorderPass):
    """``sink_waits``: move each ``wait_tensor`` down to just before the first node needing it.

    Invariant: only waits move, and a wait never passes a node that needs its result, so values
    are unchanged; collectives do not move, so their order is unchanged.
    """

    name = "sink_waits"
    plan = staticmethod(sink_waits_order)


@register_pass
class RaiseCollectives(_ReorderPass):
    """``raise_collectives``: move each collective up to just after its last input is ready.

    Collectives are never moved above the previous collective, so their relative order is
    unchanged. No memory budget: every collective is issued as early as possible (use
    ``reorder_for_overlap`` for a budgeted schedule).
    """

    name = "raise_collectives"
    plan = staticmethod(raise_collectives_order)


@register_pass
class ReorderForOverlap(FcollPass):
    """``reorder_for_overlap``: cost-model list scheduling (see :func:`list_schedule`).

    The cost model is calibrated on each real process group of the graph on first use (a
    collective call, made on every rank at this point), with rank 0's numbers shared, so every
    rank computes the same order. ``config.estimator`` overrides node estimates.
    """

    name = "reorder_for_overlap"

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        if not any(op_class(n) == COLLECTIVE for n in graph_module.graph.nodes):
            return PassResult(graph_module, False)
        model = model_for(graph_module, self.config.estimator, self.estimates,
                          bucket_cap_bytes=int(self.config.bucket_cap_mb * _MIB))
        with gc_paused():
            plan = list_schedule(graph_module.graph, model,
                                 memory_budget_bytes=int(self.config.memory_budget_mb * _MIB),
                                 max_in_flight_bytes=int(self.config.max_in_flight_mb * _MIB))
            modified = apply_order(graph_module.graph, plan.order)
            # input preparation hoisted for the bucket plan (pads, mixed-precision casts):
            # computed just before use, now that the collectives are placed
            modified = sink_input_preparation(graph_module) or modified
            for node, ev in plan.timeline.by_node.items():
                node.meta[META_ESTIMATED_US] = \
                    ev.end_us - ev.start_us if ev.kind != "wait" else 0.0
            for node, size in plan.size_estimates.items():
                node.meta[META_SIZE_ESTIMATE] = {"bytes": size.nbytes, "rule": size.rule,
                                                 "symbols": list(size.symbols)}
                log.debug("reorder_for_overlap: %s has data-dependent sizes (%s): planned "
                          "as %d bytes (rule %r, fcoll.passes.analysis.cost)", node.name,
                          ", ".join(size.symbols), size.nbytes, size.rule)
            for node, rec in plan.records.items():
                node.meta[META_ESTIMATED_US] = rec.estimated_us
                node.meta[META_HIDING] = list(rec.hiding)
                node.meta[META_EXPOSED_US] = rec.exposed_us
                if rec.exposed_us > 0:
                    log.debug("%s: %.1f us of %.1f us exposed (hidden by %d compute nodes; "
                              "its inputs are ready only then, or there is no more "
                              "independent compute before its first use)", node.name,
                              rec.exposed_us, rec.estimated_us, len(rec.hiding))
        log.debug("reorder_for_overlap: makespan %.1f us (%s costs), peak +%d bytes over the "
                  "original order's %d", plan.makespan_us, model.source,
                  plan.peak_bytes - plan.baseline_peak_bytes, plan.baseline_peak_bytes)
        graph_module.recompile()
        return PassResult(graph_module, modified)


def predict(gm: fx.GraphModule, estimator=None) -> list[PredictedEvent]:
    """Simulate ``gm`` in its current order; one :class:`PredictedEvent` per executed node.

    Model: compute serial on one lane; each collective on its group's lane from its issue,
    serially per group; a wait blocks compute until its collective ends (exposed = blocked time).

    A collective whose size is data-dependent (``META_SIZE_ESTIMATE`` set by the scheduler, or
    unbacked sizes in its ``meta["val"]``) has its event marked ``size_estimated``.

    Args:
        gm: any graph with fcoll (or ``_c10d_functional``) collectives.
        estimator: ``node -> float`` in microseconds, or ``node -> None`` to fall back. Default:
            the node's ``META_ESTIMATED_US`` if the scheduler set it, else the cost model with the
            calibration already cached in this process (defaults otherwise). Never communicates.
    """
    model: CostModel = cached_model(gm)
    estimated_sizes = {n for n in gm.graph.nodes if op_class(n) == COLLECTIVE and
                       (META_SIZE_ESTIMATE in n.meta or collective_size(n).estimated)}

    def estimate(node: fx.Node) -> float:
        if estimator is not None:
            v = estimator(node)
            if v is not None:
                return float(v)
        v = node.meta.get(META_ESTIMATED_US)
        return float(v) if v is not None else model(node)

    return list(timeline_of(list(gm.graph.nodes), estimate,
                            size_estimated=estimated_sizes).events)
