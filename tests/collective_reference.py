"""Single-process reference semantics of each collective, for checking multi-rank results.

Each function takes every rank's input (``xs[r]``) and returns every rank's output, computed with
plain torch ops and no communication, so tests can derive expected values and (through autograd
or finite differences on these functions) expected gradients.
"""

from __future__ import annotations

import torch


def _reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = xs[0].clone()
    for x in xs[1:]:
        if op in ("sum", "avg"):
            acc = acc + x if acc.dtype != torch.bool else acc | x
        elif op == "product":
            acc = acc * x if acc.dtype != torch.bool else acc & x
        elif op == "min":
            acc = torch.minimum(acc, x)
        elif op == "max":
            acc = torch.maximum(acc, x)
        elif op == "band":
            acc = acc & x
        elif op == "bor":
            acc = acc | x
        elif op == "bxor":
            acc = acc ^ x
        else:
            raise ValueError(op)
    if op == "avg":
        n = len(xs)
        acc = acc / n if acc.is_floating_point() else torch.div(acc, n, rounding_mode="trunc")
    return acc.to(xs[0].dtype)


def all_reduce(xs, op="sum"):
    out = _reduce(xs, op)
    return [out.clone() for _ in xs]


def all_gather(xs, gather_dim=0):
    return [torch.cat(xs, dim=gather_dim) for _ in xs]


def reduce_scatter(xs, op="sum", scatter_dim=0):
    return list(torch.chunk(_reduce(xs, op), len(xs), dim=scatter_dim))


def all_to_all(xs, input_splits):
    """``input_splits[k]`` is rank k's input_split_sizes."""
    n = len(xs)
    pieces = [torch.split(x, list(s)) for x, s in zip(xs, input_splits)]
    return [torch.cat([pieces[k][r] for k in range(n)]) for r in range(n)]


def broadcast(xs, src):
    return [xs[src].clone() for _ in xs]
