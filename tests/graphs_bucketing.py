"""Graph builders for the bucketing tests: built node by node with ``torch.fx.Graph`` (no
``make_fx``, so hundreds of graphs cost well under a second), every node with a fake
``meta["val"]``.

Unlike ``tests/canonical.py`` the random graphs here mix dtypes (float32, float64, int32), shapes,
reduce ops, chains of dependent collectives, waits at random later points, and all_to_all with
uneven per-rank splits (so shapes differ between ranks, as in MoE routing).
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.node import map_arg

import fcoll  # noqa: F401  defines torch.ops.fcoll

__all__ = ["Builder", "random_graph", "real_inputs", "reachable"]

_fc = torch.ops.fcoll
aten = torch.ops.aten


class Builder:
    """Appends nodes to a fresh graph, each with a fake ``meta["val"]`` (computed on the meta
    device and wrapped: about 20x cheaper than FakeTensorMode dispatch)."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()
        self.meta: dict[fx.Node, torch.Tensor] = {}

    def _set(self, node: fx.Node, meta: Any) -> fx.Node:
        self.meta[node] = meta
        node.meta["val"] = FakeTensor(self.mode, meta, torch.device("cpu"))
        return node

    def input(self, name: str, shape: list[int], dtype: torch.dtype = torch.float32) -> fx.Node:
        return self._set(self.graph.placeholder(name), torch.empty(shape, dtype=dtype,
                                                                   device="meta"))

    def __call__(self, target: Any, *args: Any) -> fx.Node:
        node = self.graph.call_function(target, args)
        return self._set(node, target(*map_arg(args, self.meta.__getitem__)))

    def wait(self, coll: fx.Node) -> fx.Node:
        return self(_fc.wait_tensor.default, coll)

    def module(self, outputs: list[fx.Node]) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


_DTYPES = (torch.float32, torch.float32, torch.float64, torch.int32)


def random_graph(seed: int, group: str, rank: int, world_size: int = 2,
                 min_split: int = 0) -> fx.GraphModule:
    """A seeded random DAG of compute, collectives and waits (same structure on every rank).

    Every value is 2-D ``[rows, cols]`` with ``rows`` a multiple of ``world_size``. all_to_all
    inputs are fresh placeholders whose first dim follows a seeded split matrix ``S`` (rank ``r``
    sends ``S[r][d]`` rows to rank ``d``, at least ``min_split``), so their shapes depend on ``rank``; their results only
    feed compute (a collective of rank-dependent shapes would be an invalid program).
    """
    rng = random.Random(seed)
    n = world_size
    b = Builder()
    values: list[fx.Node] = []
    ragged: set[fx.Node] = set()   # shape differs between ranks (from all_to_all): compute only
    for i in range(rng.randint(2, 4)):
        values.append(b.input(f"x{i}", [n * rng.randint(1, 3), rng.randint(1, 5)],
                              rng.choice(_DTYPES)))
    pending: list[fx.Node] = []
    outputs: list[fx.Node] = []
    for step in range(rng.randint(6, 18)):
        r = rng.random()
        if pending and r < 0.3:
            coll = pending.pop(rng.randrange(len(pending)))
            w = b.wait(coll)
            if coll.target is _fc.all_to_all_single.default:
                ragged.add(w)
            values.append(w)
            outputs.append(w)
        elif r < 0.5:
            x = rng.choice(values)
            op = rng.choice(["add", "mul", "neg"])
            y = (b(aten.add.Tensor, x, 1) if op == "add" else
                 b(aten.mul.Tensor, x, 2) if op == "mul" else b(aten.neg.default, x))
            if x in ragged:
                ragged.add(y)
            values.append(y)
        else:
            uniform = [v for v in values if v not in ragged]
            pending.append(_random_collective(b, rng, uniform, group, rank, n, step, min_split))
    for c in pending:
        outputs.append(b.wait(c))
    outputs += [v for v in values if not v.users and v not in outputs]
    return b.module(outputs)


def _random_collective(b: Builder, rng: random.Random, values: list[fx.Node], group: str,
                       rank: int, n: int, step: int, min_split: int) -> fx.Node:
    x = rng.choice(values[-4:] if rng.random() < 0.5 else values)
    val = x.meta["val"]
    kind = rng.choice(["all_reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
    ops = ["sum", "max"] + (["avg"] if val.dtype.is_floating_point else [])
    if kind == "reduce_scatter" and val.dim() and val.shape[0] % n == 0:
        return b(_fc.reduce_scatter_tensor.default, x, rng.choice(ops), n, group)
    if kind in ("all_reduce", "reduce_scatter"):
        return b(_fc.all_reduce.default, x, rng.choice(ops), group)
    if kind == "all_gather":
        return b(_fc.all_gather_into_tensor.default, x, n, group)
    splits = [[rng.randint(min_split, 3) for _ in range(n)] for _ in range(n)]
    cols, dtype = rng.randint(1, 4), rng.choice(_DTYPES)
    src = b.input(f"a2a{step}", [sum(splits[rank])], dtype) if cols == 1 else \
        b.input(f"a2a{step}", [sum(splits[rank]), cols], dtype)
    return b(_fc.all_to_all_single.default, src, [splits[s][rank] for s in range(n)],
             splits[rank], group)


def real_inputs(gm: fx.GraphModule, rank: int, seed: int) -> list[torch.Tensor]:
    """Small integer-valued inputs (exact under sum/max/avg of 2 ranks) for ``gm``'s placeholders."""
    g = torch.Generator().manual_seed(seed * 131 + rank)
    out = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            v = node.meta["val"]
            out.append(torch.randint(-8, 8, tuple(v.shape), generator=g).to(v.dtype))
    return out


def reachable(src: fx.Node, dst: fx.Node) -> bool:
    """True if ``dst`` depends on ``src`` (brute force; for small test graphs)."""
    stack, seen = [src], set()
    while stack:
        n = stack.pop()
        if n is dst:
            return True
        for u in n.users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return False
