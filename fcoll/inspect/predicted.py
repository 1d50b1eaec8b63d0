"""Predicted events and timings of a graph, for inspection: what tables, reports and timelines
are drawn from.

The events come from the overlap scheduler's simulator,
``fcoll.passes.rewrites.overlap.predict(gm)``, which replays the graph in its current order with the
cost model (so it works on any graph, before or after the passes). Each event is one scheduled node:
``node`` (name), ``kind`` ("compute", "collective" or "wait"), ``lane`` ("compute" or the process
group's name), ``start_us``, ``end_us`` and ``exposed_us`` (microseconds).

Every public inspection function takes ``events=`` (precomputed events) or ``predict=`` (another
simulator with the same contract) so callers can pin estimates, and tests can run without the
cost model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch.fx as fx

from fcoll.passes.graph import (
    META_ESTIMATED_US, META_EXPOSED_US, META_HIDING, collectives, is_wait, start_of, waits_of,
)
from fcoll.passes.rewrites.overlap import predict as overlap_predict
from fcoll.passes.analysis.lanes import PredictedEvent

__all__ = ["Event", "PredictFn", "predicted_events", "CollectiveTiming", "collective_timings",
           "wait_positions", "schedule_positions"]

log = logging.getLogger(__name__)

PredictFn = Callable[[fx.GraphModule], Sequence[Any]]


#: One scheduled node of a predicted (or measured) timeline: the simulator's own event type.
Event = PredictedEvent


def _as_event(e: Any) -> Event:
    if isinstance(e, Event):
        return e
    if isinstance(e, dict):
        get = e.get
    else:
        def get(key, default=None):
            return getattr(e, key, default)
    return Event(node=str(get("node")), kind=str(get("kind")), lane=str(get("lane")),
                 start_us=float(get("start_us")), end_us=float(get("end_us")),
                 exposed_us=float(get("exposed_us", 0.0) or 0.0))


def predicted_events(gm: fx.GraphModule, *, events: Iterable[Any] | None = None,
                     predict: PredictFn | None = None, required: bool = False,
                     ) -> list[Event] | None:
    """The predicted schedule of ``gm`` in its current node order.

    Args:
        gm: the graph.
        events: precomputed events (objects or dicts with the ``PredictedEvent`` fields); used
            as they are.
        predict: a simulator ``gm -> events``; default ``fcoll.passes.rewrites.overlap.predict``. A
            simulator that returns None declines (``node.meta`` estimates are used).
        required: raise instead of returning None when the simulator declines.

    Returns:
        The events sorted by start time (ties in graph order), or None when the simulator
        declines and ``required`` is False.

    Raises:
        RuntimeError: ``required`` and the simulator returned None.
    """
    if events is None:
        events = (predict if predict is not None else overlap_predict)(gm)
        if events is None:
            if required:
                raise RuntimeError("no predicted schedule: the predictor returned None")
            return None
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    out = [_as_event(e) for e in events]
    return sorted(out, key=lambda e: (e.start_us, order.get(e.node, len(order))))


@dataclass(frozen=True)
class CollectiveTiming:
    """Predicted timing of one collective: estimated and exposed time (µs), hiding compute."""

    estimated_us: float | None
    exposed_us: float | None
    hiding: tuple[str, ...]


def _overlap_us(a: Event, b: Event) -> float:
    return min(a.end_us, b.end_us) - max(a.start_us, b.start_us)


def collective_timings(gm: fx.GraphModule, events: list[Event] | None,
                       ) -> dict[fx.Node, CollectiveTiming]:
    """Per collective node: estimated time, exposed time and hiding compute nodes.

    From ``events`` when given: estimated = the collective event's duration; exposed = the larger
    of the collective event's ``exposed_us`` and the sum of its waits' ``exposed_us`` (simulators
    may charge exposure to either); hiding = compute events that overlap the collective in time
    by more than 0 µs, in start order. Without events, the scheduler's ``node.meta`` entries
    (``fcoll_estimated_us``, ``fcoll_exposed_us``, ``fcoll_hiding_nodes``) are used, and missing
    values are None.
    """
    out: dict[fx.Node, CollectiveTiming] = {}
    by_name = {e.node: e for e in events} if events is not None else {}
    compute = [e for e in events or () if e.kind == "compute"]
    for node in collectives(gm):
        ev = by_name.get(node.name)
        if events is None or ev is None:
            if events is not None:
                log.debug("collective %s has no predicted event; using node.meta", node.name)
            hiding = tuple(node.meta.get(META_HIDING, ()) or ())
            out[node] = CollectiveTiming(node.meta.get(META_ESTIMATED_US),
                                         node.meta.get(META_EXPOSED_US), hiding)
            continue
        wait_exposed = sum(by_name[w.name].exposed_us for w in waits_of(node)
                           if w.name in by_name)
        hiding = tuple(c.node for c in compute if _overlap_us(c, ev) > 0)
        out[node] = CollectiveTiming(ev.dur_us, max(ev.exposed_us, wait_exposed), hiding)
    return out


def wait_positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Position (see :func:`schedule_positions`) of each collective's first wait."""
    pos = schedule_positions(gm)
    out: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if is_wait(node):
            start = start_of(node)
            if start is not None and start not in out:
                out[start] = pos[node]
    return out


def schedule_positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Index of every executed node (not placeholders, get_attr or output) in graph order."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    return {n: i for i, n in enumerate(nodes)}
