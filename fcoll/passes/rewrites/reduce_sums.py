"""``fold_all_reduce_sums``: the sum of two all_reduces is one all_reduce of the sum.

``add(wait(all_reduce(a, op)), wait(all_reduce(b, op)))`` becomes ``wait(all_reduce(add(a, b),
op))`` for ``op`` in sum and avg (both linear: ``sum_r a_r + sum_r b_r = sum_r (a_r + b_r)``;
avg on floating dtypes only, since an integer avg truncates), one group, one dtype and shape, when nothing else reads either result. The rewrite repeats until
no such ``add`` is left, so a chain of ``k`` summed all_reduces becomes one: ``k - 1``
collectives and their bytes fewer.

Where the pattern comes from: tensor parallel's backward (``parallelize_module``). Each
column-parallel layer reads a replicated input, and its input gradient is partial, all-reduced
by DTensor per layer; autograd then sums the gradients of the layers that read the same input.
Attention's ``q``, ``k``, ``v`` read one layer norm's output, so its gradient is three
all_reduces and two adds (the 2-block GPT of ``examples/train_gpt.py``: 8 all_reduces of 1 MiB
in the backward, 4 after the pass). Megatron's fused ``qkv`` layer does the same by hand.

Values: the same sum in another order (each element is ``(a_0 + b_0) + (a_1 + b_1)`` instead of
``(a_0 + a_1) + (b_0 + b_1)``, rank by rank), so results may differ from eager by rounding, as
Inductor's reordered reductions do. Every rank runs the pass on the same graph and folds the
same pairs (graph order), so ranks still issue the same collectives in the same order; the folded
collective is issued where the later of the two was.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from fcoll.passes.graph import arg_of, waits_of
from fcoll.passes.registry import FcollPass, register_pass

__all__ = ["FoldAllReduceSums", "foldable_pairs"]

log = logging.getLogger(__name__)

#: Reduce ops for which an all_reduce of a sum is the sum of the all_reduces.
LINEAR_OPS = ("sum", "avg")
_ADD = torch.ops.aten.add.Tensor
_ALL_REDUCE = torch.ops.fcoll.all_reduce.default


def _reduced(x: object) -> tuple[fx.Node, fx.Node] | None:
    """(all_reduce, wait) if ``x`` is the only use of a linear all_reduce's only wait."""
    if not isinstance(x, fx.Node) or len(x.users) != 1:
        return None
    start = x.args[0] if x.args else None
    # the functional op only: an in-place all_reduce_ also writes its input, which others read
    if not isinstance(start, fx.Node) or start.target is not _ALL_REDUCE \
            or waits_of(start) != [x] or len(start.users) != 1:
        return None
    if arg_of(start, "reduce_op", None) not in LINEAR_OPS:
        return None
    return start, x


def _same(a: fx.Node, b: fx.Node) -> bool:
    """Same op, reduce op, group, input dtype and shape (no broadcasting in the add), and a
    dtype for which the reduce op is linear: ``avg`` of an integer dtype truncates
    (``avg(1) + avg(1) = 0`` over 2 ranks whose other inputs are 0, ``avg(1 + 1) = 1``), so
    only ``sum`` folds there."""
    va, vb = a.args[0].meta.get("val"), b.args[0].meta.get("val")
    if not (a.target == b.target and a.args[1:] == b.args[1:] and a.kwargs == b.kwargs
            and isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.dtype == vb.dtype and va.shape == vb.shape):
        return False
    return arg_of(a, "reduce_op", None) == "sum" or va.dtype.is_floating_point \
        or va.dtype.is_complex


def foldable_pairs(graph: fx.Graph) -> list[tuple[fx.Node, tuple[fx.Node, fx.Node],
                                                  tuple[fx.Node, fx.Node]]]:
    """``(add, (all_reduce, wait), (all_reduce, wait))`` for each ``add`` the pass folds now,
    in graph order (the first operand's collective first)."""
    pairs = []
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not _ADD or len(n.args) != 2 or n.kwargs:
            continue
        x, y = (_reduced(a) for a in n.args)
        if x is None or y is None or x[0] is y[0] or not _same(x[0], y[0]):
            continue
        pairs.append((n, x, y))
    return pairs


def _fold(graph: fx.Graph, add: fx.Node, x: tuple[fx.Node, fx.Node],
          y: tuple[fx.Node, fx.Node]) -> None:
    pos = {n: i for i, n in enumerate(graph.nodes)}
    (first, first_wait), (later, later_wait) = sorted((x, y), key=lambda p: pos[p[0]])
    a, b = first.args[0], later.args[0]
    val = a.meta["val"]
    with graph.inserting_before(later):
        total = graph.call_function(_ADD, (a, b))
    total.meta = {k: v for k, v in add.meta.items() if k != "val"}
    with val.fake_mode if hasattr(val, "fake_mode") else torch._subclasses.FakeTensorMode():
        total.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype,
                                                device=val.device)
    later.prepend(first)    # issued where the later collective was, once both inputs exist
    first.args = (total, *first.args[1:])
    add.prepend(first_wait)
    add.replace_all_uses_with(first_wait)
    for dead in (add, later_wait, later):
        graph.erase_node(dead)


@register_pass
class FoldAllReduceSums(FcollPass):
    """Fold summed all_reduces into one (module docstring); runs after lowering."""

    name = "fold_all_reduce_sums"

    def call(self, gm: fx.GraphModule) -> PassResult:
        folded = 0
        while True:
            pairs = foldable_pairs(gm.graph)
            if not pairs:
                break
            add, x, y = pairs[0]   # one at a time: a fold may make its add's user foldable
            log.debug("fold_all_reduce_sums: %s = %s + %s -> one all_reduce", add.name,
                      x[0].name, y[0].name)
            _fold(gm.graph, add, x, y)
            folded += 1
        if folded:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, bool(folded))
