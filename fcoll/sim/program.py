"""A step as the simulator sees it: graphs of plain nodes, loaded from files or from live graphs.

A *program* is one graph's :mod:`fcoll.inspect.schedule` dict (``{name}.schedule.json``, the
format is documented there). :func:`load_programs` accepts an ``fcoll.inspect`` output directory
(``DIR/rank{R}/*.schedule.json``), a directory of schedule files, a GraphModule, a compile record
(``record.after``, ``record.name``: what ``fcoll.compile.backend``'s listeners receive), a
schedule dict, or a list of these.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from fcoll.inspect.schedule import SCHEDULE_FORMAT, SCHEDULE_VERSION, step_schedule

__all__ = ["Node", "Program", "load_programs", "program_of"]

_CLASSES = ("placeholder", "compute", "collective", "wait")


@dataclass(frozen=True)
class Node:
    """One node of a program (fields of :mod:`fcoll.inspect.schedule`; bytes per rank, us)."""

    name: str
    cls: str
    inputs: tuple[str, ...]
    us: float
    out_bytes: int
    alloc_bytes: int
    frees: tuple[str, ...] = ()
    kind: str | None = None
    group: str | None = None
    group_size: int | None = None
    in_bytes: int = 0
    collective: str | None = None
    size_estimated: bool = False


@dataclass(frozen=True)
class Program:
    """One compiled graph: ``nodes`` in execution order; ``world_size`` = its largest group;
    ``op_overhead_us`` = the fixed part of each compute node's time (not scaled with shards);
    ``comm_curves`` = the communication curves the recording process calibrated."""

    name: str
    world_size: int
    nodes: tuple[Node, ...]
    cost_source: str = "default"
    op_overhead_us: float = 0.0
    comm_curves: tuple[dict[str, Any], ...] = ()
    by_name: dict[str, Node] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.by_name.update({n.name: n for n in self.nodes})


def program_of(schedule: dict[str, Any], where: str = "schedule") -> Program:
    """The :class:`Program` of one schedule dict.

    Raises:
        ValueError: naming ``where``: not an ``fcoll.schedule`` dict of a known version, a node
            of unknown class, a wait or input naming an unknown node.
    """
    if not isinstance(schedule, dict) or schedule.get("format") != SCHEDULE_FORMAT:
        raise ValueError(f"{where}: not an {SCHEDULE_FORMAT} file (written by fcoll.inspect)")
    if schedule.get("version") != SCHEDULE_VERSION:
        raise ValueError(f"{where}: schedule version {schedule.get('version')!r}, this fcoll "
                         f"reads version {SCHEDULE_VERSION}")
    nodes, seen = [], set()
    for d in schedule["nodes"]:
        if d["cls"] not in _CLASSES:
            raise ValueError(f"{where}: node {d['name']!r} has unknown class {d['cls']!r}")
        missing = [i for i in d["inputs"] if i not in seen]
        if missing:
            raise ValueError(f"{where}: node {d['name']!r} reads {missing}, which come later "
                             "or not at all (nodes must be in execution order)")
        if d["cls"] == "wait" and d.get("collective") not in seen:
            raise ValueError(f"{where}: wait {d['name']!r} waits on unknown collective "
                             f"{d.get('collective')!r}")
        seen.add(d["name"])
        nodes.append(Node(
            name=d["name"], cls=d["cls"], inputs=tuple(d["inputs"]), us=float(d["us"]),
            out_bytes=int(d["out_bytes"]), alloc_bytes=int(d["alloc_bytes"]),
            frees=tuple(d.get("frees", ())), kind=d.get("kind"), group=d.get("group"),
            group_size=d.get("group_size"), in_bytes=int(d.get("in_bytes", 0)),
            collective=d.get("collective"), size_estimated=bool(d.get("size_estimated"))))
    return Program(str(schedule.get("graph", where)), int(schedule.get("world_size", 1)),
                   tuple(nodes), str(schedule.get("cost_source", "default")),
                   float(schedule.get("op_overhead_us", 0.0)),
                   tuple(schedule.get("comm_curves", ())))


def _from_dir(path: str, rank: int, graphs: str | None) -> list[Program]:
    rank_dir = os.path.join(path, f"rank{rank}")
    where = rank_dir if os.path.isdir(rank_dir) else path
    files = sorted(glob.glob(os.path.join(where, "*.schedule.json")))
    if graphs is not None:
        files = [f for f in files if re.search(graphs, os.path.basename(f))]
    if not files:
        raise ValueError(f"{path}: no *.schedule.json files in {where}"
                         + (f" matching --graphs {graphs!r}" if graphs else "")
                         + " (write them with python -m fcoll.inspect SCRIPT --out DIR)")
    out = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            out.append(program_of(json.load(fh), where=f))
    return out


def load_programs(source: Any, *, rank: int = 0, graphs: str | None = None) -> list[Program]:
    """Programs of a step, in the order given (files: sorted by name).

    Args:
        source: an ``fcoll.inspect`` output directory (its ``rank{rank}`` folder is read) or a
            folder of ``*.schedule.json``; a GraphModule (named ``"graph"``); a compile record;
            a schedule dict; a :class:`Program`; or a list/tuple of these.
        rank: which rank's files to read from an ``fcoll.inspect`` directory.
        graphs: a regular expression; only schedule files whose name matches are read.

    Raises:
        ValueError: a directory without schedule files, a path that does not exist, or an
            object of another type (named in the message).
    """
    if isinstance(source, (list, tuple)):
        return [p for s in source for p in load_programs(s, rank=rank, graphs=graphs)]
    if isinstance(source, Program):
        return [source]
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            return _from_dir(path, rank, graphs)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                return [program_of(json.load(fh), where=path)]
        raise ValueError(f"{path}: no such file or directory")
    if isinstance(source, dict):
        return [program_of(source)]
    if isinstance(source, fx.GraphModule):
        return [program_of(step_schedule(source, "graph"))]
    after = getattr(source, "after", None)
    if isinstance(after, fx.GraphModule):
        name = str(getattr(source, "name", "graph"))
        return [program_of(step_schedule(after, name), where=name)]
    raise ValueError(f"cannot simulate a {type(source).__name__}: expected a directory, a "
                     "schedule file or dict, a GraphModule or a compile record")
