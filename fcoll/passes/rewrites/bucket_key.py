"""The bucket key: collectives with equal keys may share a bucket.

The key is ``(kind, group name, group size, reduce op, root)`` and, unless ``multi_dtype``, the
input dtypes. Every field is read from the node's arguments (positional or keyword) and its
inputs' ``meta["val"]``, never from rank-local state, so every rank computes the same keys;
the group size of an op that does not carry one is the registered group's
(:func:`~fcoll.passes.graph.collective_info`), the same on every rank of the group.

This is the one implementation: :class:`BucketKeys` reads schema positions once per op and registered group sizes once per
group name, so a key costs a few argument reads (planning asks one per collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fcoll.ops.facts import OPS
from fcoll.passes.graph import collective_info, is_collective

__all__ = ["OpArgs", "BucketKeys", "bucket_key"]

_MISSING = object()


@dataclass(frozen=True)
class OpArgs:
    """Schema facts of one collective op, read once per op.

    Attributes:
        op: op name without namespace, e.g. ``"all_reduce"``.
        kind: its collective kind (:data:`fcoll.ops.facts.KINDS`).
        nargs: number of schema arguments.
        names: schema argument names, in order.
    """

    op: str
    kind: str
    nargs: int
    names: tuple[str, ...]

    def arg(self, node: fx.Node, name: str, default: Any = None) -> Any:
        """Argument ``name`` of ``node`` (positional or keyword), or ``default``."""
        try:
            i = self.names.index(name)
        except ValueError:
            return default
        if i < len(node.args):
            return node.args[i]
        return node.kwargs.get(name, default)


class BucketKeys:
    """Bucket keys of collective nodes (see the module docstring); caches per op and per
    group name live as long as the instance (one planning pass: group registrations may
    change between compiles)."""

    def __init__(self) -> None:
        self._ops: dict[int, tuple[Any, OpArgs | None]] = {}
        self._group_sizes: dict[str, int | None] = {}

    def op(self, node: fx.Node) -> OpArgs | None:
        """The :class:`OpArgs` of a ``call_function`` node's op, None if it is not a
        collective (one dict lookup once the op was seen)."""
        target = node.target
        hit = self._ops.get(id(target))
        if hit is not None and hit[0] is target:
            return hit[1]
        spec = None
        if is_collective(node):
            schema = target._schema
            name = schema.name.split("::", 1)[-1]
            names = tuple(a.name for a in schema.arguments)
            spec = OpArgs(op=name, kind=OPS[name].kind, nargs=len(names), names=names)
        self._ops[id(target)] = (target, spec)
        return spec

    def __call__(self, node: fx.Node, *, multi_dtype: bool = False) -> tuple:
        """The key of collective ``node``.

        Raises:
            ValueError: ``node`` is not a collective.
        """
        spec = self.op(node) if node.op == "call_function" else None
        if spec is None:
            raise ValueError(f"{node.name} ({node.target}) is not a collective")
        group_name = str(spec.arg(node, "group_name"))
        group_size = spec.arg(node, "group_size")
        if group_size is None:
            if group_name not in self._group_sizes:
                self._group_sizes[group_name] = collective_info(node).group_size
            group_size = self._group_sizes[group_name]
        key: tuple = (spec.kind, group_name, group_size, spec.arg(node, "reduce_op"),
                      spec.arg(node, "src"))
        if not multi_dtype:
            first = spec.arg(node, "input", _MISSING)
            items = spec.arg(node, "inputs") if first is _MISSING else first
            items = items if isinstance(items, (list, tuple)) else [items]
            vals = [i.meta.get("val") if isinstance(i, fx.Node) else i for i in items]
            key += (tuple(v.dtype for v in vals if isinstance(v, torch.Tensor)),)
        return key

    def merge_key(self, node: fx.Node) -> tuple:
        """The key the bucket planner merges ``node`` under: the multi-dtype bucket key plus
        the op's namespace (a merged collective and its wait must come from one op library).

        Raises:
            ValueError: ``node`` is not a collective.
        """
        return self(node, multi_dtype=True) + (node.target.namespace,)


def bucket_key(node: fx.Node, *, multi_dtype: bool = False) -> tuple:
    """The bucket key of collective ``node`` (see the module docstring).

    Raises:
        ValueError: ``node`` is not a collective.
    """
    return BucketKeys()(node, multi_dtype=multi_dtype)
