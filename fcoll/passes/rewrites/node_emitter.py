"""Emitting the nodes a graph rewrite adds, each with its fake value, from shapes alone.

:class:`NodeEmitter` creates ``call_function`` nodes at a graph's insert point and gives each
its ``meta["val"]`` from :class:`ShapeValues`: a table of output-shape rules for the few ops a
bucket rewrite emits (aten's view, reshape, cat and split semantics; fcoll's collectives through
the op-facts table), evaluated without dispatching, which would dominate a pass that emits
several nodes per merged member. :func:`flat_view` and :func:`view_as` are the two reshapes a
rewrite needs, emitting nothing when the node already has the shape.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.node import map_arg

from fcoll.ops.facts import OPS

__all__ = ["NodeEmitter", "ShapeValues", "flat_view", "view_as"]

aten = torch.ops.aten
_WAITS = (torch.ops.fcoll.wait_tensor.default, torch.ops._c10d_functional.wait_tensor.default)
#: fcoll collective -> first output dim from (input rows, args): the op-facts table's
#: ``output_rows`` (contiguous, the input's dtype); the rewrite emits these on 1-D buffers.
_OUTPUT_ROWS: dict[Any, Callable[[int, tuple], int]] = {
    getattr(torch.ops.fcoll, f.name).default: f.output_rows
    for f in OPS.values() if f.output_rows is not None}


def _infer(shape: list[int], numel: int) -> list[int]:
    shape = list(shape)
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        shape[shape.index(-1)] = numel // known if known else 0
    return shape


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return strides[::-1]


class ShapeValues:
    """Fake values of the few ops the rewrite emits, computed from shapes alone.

    A table of (op -> output shape rule), like a rewrite table: the rules are the ops' own
    (aten's view, reshape, cat, split semantics; collectives through the op-facts table's
    ``output_rows``, the shapes of fcoll's fake kernels), evaluated without dispatching, since
    the rewrite emits several nodes per member and a FakeTensorMode dispatch per node would
    dominate the pass. ``tests/test_bucketing.py`` checks the merged collectives' values against
    the fake kernels. Any other op falls back to running it under the graph's fake mode.
    """

    def __init__(self, fake_mode: FakeTensorMode):
        self.fake_mode = fake_mode
        # Values are only read (shape, dtype, strides), so nodes of equal metadata share one.
        self._cache: dict[tuple, torch.Tensor] = {}

    def like(self, ref: torch.Tensor, shape: list[int], dtype: torch.dtype | None = None,
             strides: list[int] | None = None) -> torch.Tensor:
        shape = list(shape)
        strides = strides or _contiguous_strides(shape)
        dtype = dtype or ref.dtype
        key = (tuple(shape), tuple(strides), dtype, ref.device)
        val = self._cache.get(key)
        if val is None:
            meta = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
            val = self._cache[key] = FakeTensor(self.fake_mode, meta, ref.device)
        return val

    def __call__(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target is operator.getitem:
            return args[0][args[1]]
        if target in (aten.reshape.default, aten.view.default):
            return self.like(args[0], _infer(args[1], args[0].numel()))
        if target is aten.view.dtype:
            x, dtype = args
            last = x.shape[-1] * x.element_size() // dtype.itemsize
            return self.like(x, [*x.shape[:-1], last], dtype)
        if target is aten.clone.default or target in _WAITS:
            return self.like(args[0], list(args[0].shape))
        if target is aten.cat.default:
            xs, dim = args[0], (args[1] if len(args) > 1 else 0)
            shape = list(xs[0].shape)
            shape[dim] = sum(x.shape[dim] for x in xs)
            return self.like(xs[0], shape)
        if target is aten.split_with_sizes.default:
            x, sizes, dim = args[0], args[1], (args[2] if len(args) > 2 else 0)
            return [self.like(x, [*x.shape[:dim], s, *x.shape[dim + 1:]], strides=list(x.stride()))
                    for s in sizes]
        if target in _OUTPUT_ROWS and args[0].dim():   # as fcoll's own fake kernels
            x = args[0]
            return self.like(x, [_OUTPUT_ROWS[target](x.shape[0], args), *x.shape[1:]])
        with self.fake_mode:
            return target(*args, **kwargs)


def _val_of(a: Any) -> Any:
    """``a`` with every node replaced by its ``meta["val"]`` (args are nodes, lists, scalars)."""
    return map_arg(a, _node_val)


def _node_val(node: fx.Node) -> Any:
    return node.meta["val"]


def flat_view(emit: "NodeEmitter", x: fx.Node, dense: bool = False) -> fx.Node:
    """``x`` as 1-D (no node when it already is); ``dense``: also with stride 1, as
    ``view.dtype`` needs (a copy only for a non-contiguous ``x``)."""
    val = x.meta["val"]
    if dense and not val.is_contiguous():
        x = emit(aten.clone.default, x, memory_format=torch.contiguous_format)
    return x if val.dim() == 1 else emit(aten.reshape.default, x, [-1])


def view_as(emit: "NodeEmitter", x: fx.Node, shape: Any) -> fx.Node:
    """``x`` (contiguous) viewed as ``shape`` (no node when the shape already matches)."""
    shape = list(shape)
    return x if list(x.meta["val"].shape) == shape else emit(aten.view.default, x, shape)


class NodeEmitter:
    """Creates call_function nodes at the graph's insert point, each with ``meta["val"]``."""

    def __init__(self, graph: fx.Graph, vals: ShapeValues, meta: dict[str, Any]):
        self.graph = graph
        self.vals = vals
        self.meta = meta

    def __call__(self, target: Callable, *args: Any, **kwargs: Any) -> fx.Node:
        val = self.vals(target, _val_of(args), _val_of(kwargs) if kwargs else kwargs)
        node = self.graph.create_node("call_function", target)
        # Arguments are attached after creation: create_node walks them with pytree looking for
        # raw SymInts (half its cost on a 200-member cat), and these are ints and nodes only.
        node.args = args
        if kwargs:
            node.kwargs = kwargs
        node.meta["val"] = val
        node.meta.update(self.meta)
        return node

    def getitems(self, node: fx.Node, count: int) -> list[fx.Node]:
        return [self(operator.getitem, node, i) for i in range(count)]
