"""``{name}.schedule.json``: a compiled graph as plain data, enough to replay its schedule.

:func:`step_schedule` turns a graph (after the passes) into a JSON-able dict that
``fcoll.sim`` replays at other world sizes without the graph, torch or the process group:

.. code-block:: text

    {"format": "fcoll.schedule", "version": 1, "graph": "graph_0_backward",
     "world_size": 2,              # the largest group size of the graph's collectives
     "cost_source": "default",     # or "calibrated": where the "us" of compute came from
     "op_overhead_us": 5.0,        # the cost model's fixed cost per compute op (us)
     "comm_curves": [ {curve}, ... ],  # what this process calibrated (may be empty)
     "nodes": [ {node}, ... ]}     # every executed node, in graph (= execution) order

Each curve: ``backend``, ``kind``, ``group_size``, ``link`` ("intra" or "inter") and
``points`` (``[[bytes, us], ...]``), the piecewise alpha-beta curves of
:func:`fcoll.passes.analysis.calibration.calibrated_table`, so a simulation run later, in another
process, uses the communication times this run measured.

Each node: ``name``; ``cls`` ("placeholder", "compute", "collective" or "wait"); ``inputs``
(names of the nodes it reads); ``us`` (predicted duration in microseconds: compute from the
predicted schedule, a collective its estimate on this world size, 0 for placeholders and waits);
``out_bytes`` (bytes of its value on this rank); ``alloc_bytes`` (bytes it allocates, by the
storage model of :mod:`fcoll.passes.analysis.memory`: 0 for views, in-place ops and waits) and
``frees`` (names of the storages last used by this node, so freed after it; pinned storages,
placeholders and graph outputs, are never freed). A collective adds ``kind``, ``op``,
``group``, ``group_size``, ``in_bytes``, ``out_bytes`` (all its outputs), ``dtype`` and
``size_estimated``; a wait adds ``collective`` (the name of the collective it waits on).
Placeholders carry their value's bytes in ``out_bytes`` and ``alloc_bytes``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch.fx as fx

from fcoll.inspect.predicted import Event
from fcoll.passes.analysis.calibration import cached_model, calibrated_table
from fcoll.passes.analysis.cost import collective_size
from fcoll.passes.graph import collective_info, start_of
from fcoll.passes.analysis.memory import COLLECTIVE, WAIT, storage_model, value_bytes

__all__ = ["step_schedule", "comm_curves", "SCHEDULE_FORMAT", "SCHEDULE_VERSION"]

SCHEDULE_FORMAT = "fcoll.schedule"
SCHEDULE_VERSION = 1


def _frees(order: list[fx.Node], storage) -> dict[fx.Node, list[str]]:
    """Node -> names of the storage roots whose last toucher it is (never pinned ones)."""
    last: dict[fx.Node, fx.Node] = {}
    for node in order:
        for r in storage.touches.get(node, ()):
            last[r] = node
        if storage.root.get(node) is node:
            last.setdefault(node, node)   # a value nobody uses is freed where it is made
    out: dict[fx.Node, list[str]] = {}
    for root, node in last.items():
        if root not in storage.pinned and root.op not in ("placeholder", "get_attr"):
            out.setdefault(node, []).append(root.name)
    return out


def comm_curves() -> list[dict[str, Any]]:
    """The communication curves this process calibrated, as plain values sorted by key (the
    module docstring's ``comm_curves``); entries without measured points are left out."""
    out = []
    for key, curve in sorted(calibrated_table().entries.items()):
        if hasattr(curve, "as_points"):
            out.append({"backend": key.backend, "kind": key.kind, "group_size": key.group_size,
                        "link": key.link, "points": curve.as_points()})
    return out


def step_schedule(gm: fx.GraphModule, name: str, *,
                  events: Iterable[Event] | None = None) -> dict[str, Any]:
    """The machine-readable schedule of ``gm`` in its current order (module docstring format).

    Args:
        gm: a graph, normally after fcoll's passes.
        name: the graph's name (``record.name``).
        events: its predicted events (:func:`fcoll.inspect.predicted_events`); compute
            durations are taken from them. Without events the cost model of this process
            (:func:`fcoll.passes.analysis.calibration.cached_model`, never communicates) estimates
            them.

    Returns:
        A dict of plain values (``json.dumps`` works on it).
    """
    model = cached_model(gm)
    dur = {e.node: e.dur_us for e in events} if events is not None else {}
    order = [n for n in gm.graph.nodes if n.op != "output"]
    storage = storage_model(gm.graph)
    frees = _frees(order, storage)
    nodes, world = [], 1
    for node in order:
        cls = storage.cls.get(node)
        is_input = node.op in ("placeholder", "get_attr")
        entry: dict[str, Any] = {
            "name": node.name,
            "cls": "placeholder" if is_input else "collective" if cls == COLLECTIVE
            else "wait" if cls == WAIT else "compute",
            "inputs": [i.name for i in node.all_input_nodes],
            "out_bytes": value_bytes(node.meta.get("val")),
            "alloc_bytes": storage.alloc(node),
            "frees": frees.get(node, []),
        }
        if is_input:
            entry["us"] = 0.0
            entry["alloc_bytes"] = entry["out_bytes"]
        elif cls == COLLECTIVE:
            info = collective_info(node)
            size = collective_size(node)
            world = max(world, info.group_size or 1)
            entry.update(us=dur.get(node.name, model(node)), kind=info.kind, op=info.op,
                         group=info.group_name, group_size=info.group_size,
                         in_bytes=info.in_bytes, out_bytes=info.out_bytes,
                         dtype=str(info.dtypes[0]).replace("torch.", "") if info.dtypes
                         else None, size_estimated=size.estimated)
        elif cls == WAIT:
            start = start_of(node)
            entry.update(us=0.0, collective=start.name if start is not None else None)
        else:
            entry["us"] = float(dur[node.name]) if node.name in dur else float(model(node))
        nodes.append(entry)
    return {"format": SCHEDULE_FORMAT, "version": SCHEDULE_VERSION, "graph": str(name),
            "world_size": world, "cost_source": model.source,
            "op_overhead_us": model.compute.op_overhead_us, "comm_curves": comm_curves(),
            "nodes": nodes}
