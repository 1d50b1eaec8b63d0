"""Collective-sequence fingerprints: what ranks compare before running a graph.

A graph's collectives are listed per process group (:func:`collectives_by_group`: groups sorted
by name, nodes in graph order) and each group's sequence is reduced to a :class:`Fingerprint`:
one readable entry per collective and the SHA-256 digest of the entries. Ranks that compiled
the same collectives for a group get the same digest; the rank check
(:mod:`fcoll.passes.rewrites.consistency`) meets on it, the shared bucket plan keys its plans by
it, and the executor's direct path tags each call with it.

The fingerprint entry of a collective is ``op(dtype[shape], ..., reduce_op=, src=, group=)``;
a dim of symbolic size (dynamic shapes) is ``~`` and the size it was traced at (``[~4, 16]``).
all_to_all inputs keep only their trailing dims: the first dim follows each rank's splits and
legitimately differs (MoE routing).

Data-dependent sizes (unbacked ``SymInt``: split sizes from ``counts.tolist()``, a dim that
follows them) have no value at compile time, so they cannot be compared and are never guarded
on (``int()`` of one raises ``GuardOnDataDependentSymNode``). In the entry such a dim is ``?``:
ranks must agree that it is data-dependent, not on its value. Each collective with
data-dependent sizes gets a note in :attr:`Fingerprint.data_dependent` naming them (``output
[u2 + u3, 4], output_split_sizes [u2, u3]``). Those sizes are compared at run time by fcoll's
backend: the first phase of every collective exchanges each rank's header (shape, split sizes)
and raises the same error on every rank if they disagree (``fcoll/shm/transport/headers.py``);
other backends (gloo) do not compare them.

Reads the graph only; never modifies it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from fcoll.passes.graph import arg_of, is_collective, op_kind, size_hint

__all__ = ["Fingerprint", "collectives_by_group", "fingerprint", "group_fingerprint",
           "sequence_digest"]


@dataclass(frozen=True)
class Fingerprint:
    """The ordered collectives of one group in one graph.

    Attributes:
        group_name: the process group's name.
        entries: one readable string per collective, in graph order (data-dependent dims
            are ``?``).
        digest: sha256 hex digest of the entries.
        data_dependent: ``(index, note)`` per collective with data-dependent sizes, the note
            naming them (``output [u2 + u3, 4], output_split_sizes [u2, u3]``); not part of the
            digest: their values are unknown until run time.
    """

    group_name: str
    entries: tuple[str, ...]
    digest: str
    data_dependent: tuple[tuple[int, str], ...] = ()


def _dim(s: Any, unbacked: list[str]) -> str:
    """One size as the entry shows it: an int, or ``?`` for a data-dependent size (whose
    expression is appended to ``unbacked``), or ``~n`` for a backed symbolic size traced at
    ``n`` (its hint: ranks that traced different sizes differ). A symbolic size and a static
    one of the same value differ: the graphs compiled for them differ in what the passes may
    do (a collective of symbolic size is never bucketed), so a shared bucket plan of one must
    not be taken for the other's."""
    if isinstance(s, int):
        return str(s)
    if isinstance(s, torch.SymInt) and free_unbacked_symbols(s):
        unbacked.append(str(s))
        return "?"
    if isinstance(s, torch.SymInt) and s.node.expr.free_symbols:
        return f"~{size_hint(s)}"
    return str(size_hint(s))


def _sizes_text(sizes: Any) -> tuple[str, bool]:
    """``[a, b]`` of a shape or split list (symbols as their expressions) and whether any
    element is data-dependent."""
    vals = [v.meta.get("val") if isinstance(v, fx.Node) else v for v in sizes]
    dd = any(isinstance(v, torch.SymInt) and free_unbacked_symbols(v) for v in vals)
    return f"[{', '.join(map(str, vals))}]", dd


def _inputs(node: fx.Node) -> list[Any]:
    first = arg_of(node, "input", None)
    if first is None:
        first = arg_of(node, "inputs", None)
    items = first if isinstance(first, (list, tuple)) else [first]
    return [i.meta.get("val") if isinstance(i, fx.Node) else i for i in items]


def _entry(node: fx.Node) -> tuple[str, str | None]:
    """The fingerprint entry of collective ``node`` and its data-dependent note (or None).

    Sizes are read from ``meta["val"]`` without evaluating a data-dependent one.
    """
    kind = op_kind(node.target)
    op = node.target._schema.name.split("::", 1)[-1]
    tensors, notes = [], []
    for t in (v for v in _inputs(node) if isinstance(v, torch.Tensor)):
        unbacked: list[str] = []
        dims = [_dim(s, unbacked) for s in t.shape]
        if kind == "all_to_all" and dims:
            dims[0] = "*"
        tensors.append(f"{str(t.dtype).removeprefix('torch.')}[{','.join(dims)}]")
        if unbacked:
            notes.append(f"input {_sizes_text(t.shape)[0]}")
    out = node.meta.get("val")
    for t in out if isinstance(out, (list, tuple)) else [out]:
        if isinstance(t, torch.Tensor):
            text, dd = _sizes_text(t.shape)
            if dd:
                notes.append(f"output {text}")
    for name in ("output_split_sizes", "input_split_sizes"):
        splits = arg_of(node, name, None)
        if isinstance(splits, (list, tuple)):
            text, dd = _sizes_text(splits)
            if dd:
                notes.append(f"{name} {text}")
    reduce_op, src = arg_of(node, "reduce_op", None), arg_of(node, "src", None)
    extra = [f"reduce_op={reduce_op}"] if reduce_op is not None else []
    extra += [f"src={src}"] if src is not None else []
    return f"{op}({', '.join(tensors + extra)})", ", ".join(notes) or None


def fingerprint(gm: fx.GraphModule) -> dict[str, Fingerprint]:
    """Fingerprint of the collectives of ``gm``, per group name (graph order within a group)."""
    return {g: group_fingerprint(g, nodes) for g, nodes in collectives_by_group(gm).items()}


def group_fingerprint(group_name: str, nodes: list[fx.Node]) -> Fingerprint:
    """The :class:`Fingerprint` of group ``group_name`` whose collectives are ``nodes`` (graph
    order, as :func:`collectives_by_group` lists them)."""
    made = [_entry(n) for n in nodes]
    entries = tuple(e for e, _ in made)
    notes = tuple((i, note) for i, (_, note) in enumerate(made) if note is not None)
    return Fingerprint(group_name, entries,
                       hashlib.sha256("\n".join(entries).encode()).hexdigest(), notes)


def collectives_by_group(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Collective nodes per group name, groups sorted by name, nodes in graph order.

    One walk; whether an op is a collective, and where its ``group_name`` argument is, is read
    once per op (a node that is not a collective costs one dict lookup).
    """
    group_arg: dict[Any, int | None] = {}    # op -> position of group_name; absent: not collective
    groups: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        t = node.target
        if t not in group_arg:
            if not is_collective(node):
                group_arg[t] = -1
                continue
            names = [a.name for a in t._schema.arguments]
            group_arg[t] = names.index("group_name") if "group_name" in names else None
        i = group_arg[t]
        if i == -1:
            continue
        if i is not None and not node.kwargs and i < len(node.args):
            g = str(node.args[i])
        else:
            g = str(arg_of(node, "group_name"))
        groups.setdefault(g, []).append(node)
    return dict(sorted(groups.items()))


def sequence_digest(group_name: str, nodes: list[fx.Node]) -> str:
    """SHA-256 (hex) of the collective sequence ``nodes`` of group ``group_name``: op, dtype,
    shape and reduce op of each, in order (the digest ranks meet on in
    :func:`~fcoll.passes.rewrites.consistency.compare_across_ranks`)."""
    return group_fingerprint(group_name, nodes).digest
