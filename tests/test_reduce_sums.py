"""``fold_all_reduce_sums`` (``fcoll.passes.rewrites.reduce_sums``): single-process graph tests
on PyTorch's fake process group (rank 0 of 2), graphs made with ``make_fx``, and one run on real
values (the folded graph's all_reduce replaced by the identity of a 1-rank group: the sum
rewrite must not change what is reduced)."""

from __future__ import annotations

import unittest

import torch

import canonical
import fcoll
from fcoll.passes.config import FcollConfig
from fcoll.passes.graph import arg_of, collective_kind, collectives, waits_of
from fcoll.passes.registry import run_pipeline

SHAPE = (64, 32)


def setUpModule() -> None:
    canonical.ensure_fake_pg()


def _fold(fn, n_inputs: int = 3, shapes=None):
    gm = canonical.trace(fn, shapes or [SHAPE] * n_inputs)
    return run_pipeline(gm, FcollConfig(), ("lower_c10d_functional", "fold_all_reduce_sums"))


def _qkv_grads(a, b, c):
    """The tensor-parallel attention input gradient: three partial gradients, each
    all-reduced, summed by autograd."""
    return (fcoll.all_reduce(a, "sum", "0") + fcoll.all_reduce(b, "sum", "0")
            + fcoll.all_reduce(c, "sum", "0"))


class TestFoldAllReduceSums(unittest.TestCase):
    def test_summed_all_reduces_become_one_all_reduce_of_the_sum(self):
        """``ar(a) + ar(b) + ar(c)`` -> ``ar((a + b) + c)``: one collective, no add after it."""
        gm = _fold(_qkv_grads)
        (ar,) = collectives(gm)
        self.assertEqual(collective_kind(ar), "all_reduce")
        total = ar.args[0]
        self.assertIs(total.target, torch.ops.aten.add.Tensor)
        self.assertIs(total.args[0].target, torch.ops.aten.add.Tensor)
        self.assertEqual([n.op for n in total.args[0].args], ["placeholder", "placeholder"])
        (w,) = waits_of(ar)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        self.assertIn(w, out.all_input_nodes)
        self.assertEqual(tuple(total.meta["val"].shape), SHAPE)

    def test_fold_keeps_the_values(self):
        """On a 1-rank view (every all_reduce the identity) the folded graph computes what the
        original does; the folded sum differs from eager only by rounding order."""
        gm = _fold(_qkv_grads)
        identity = {torch.ops.fcoll.all_reduce.default: lambda x, *a: x.clone(),
                    torch.ops.fcoll.wait_tensor.default: lambda x: x}
        for n in gm.graph.nodes:
            if n.target in identity:
                n.target = identity[n.target]
        gm.recompile()
        xs = [torch.randn(SHAPE) for _ in range(3)]
        torch.testing.assert_close(gm(*xs), xs[0] + xs[1] + xs[2])

    def test_not_folded_when_a_result_is_read_elsewhere_or_the_op_is_not_linear(self):
        """A wait read by another node, a max reduction and two groups stay as they are."""
        def read_twice(a, b):
            x = fcoll.all_reduce(a, "sum", "0")
            return x + fcoll.all_reduce(b, "sum", "0"), x * 2

        def maxes(a, b):
            return fcoll.all_reduce(a, "max", "0") + fcoll.all_reduce(b, "max", "0")

        def broadcast(a, b):   # [1, 32] + [64, 32]: not one shape
            return fcoll.all_reduce(a, "sum", "0") + fcoll.all_reduce(b, "sum", "0")

        for fn, shapes in ((read_twice, None), (maxes, None), (broadcast, [(1, 32), SHAPE])):
            gm = _fold(fn, 2, shapes)
            self.assertEqual(len(collectives(gm)), 2, fn.__name__)
            for ar in collectives(gm):
                self.assertEqual(arg_of(ar, "input").op, "placeholder")

    def test_integer_avg_is_not_folded_integer_sum_is(self):
        """An integer ``avg`` truncates, so it is not linear (``avg(1) + avg(1) = 0`` over 2
        ranks whose other inputs are 0, ``avg(2) = 1``): left as it is; an integer ``sum`` folds."""
        def avgs(a, b):
            return fcoll.all_reduce(a, "avg", "0") + fcoll.all_reduce(b, "avg", "0")

        def sums(a, b):
            return fcoll.all_reduce(a, "sum", "0") + fcoll.all_reduce(b, "sum", "0")

        gm = run_pipeline(canonical.trace(avgs, [SHAPE] * 2, dtype=torch.int64), FcollConfig(),
                          ("lower_c10d_functional", "fold_all_reduce_sums"))
        self.assertEqual(len(collectives(gm)), 2)
        gm = run_pipeline(canonical.trace(sums, [SHAPE] * 2, dtype=torch.int64), FcollConfig(),
                          ("lower_c10d_functional", "fold_all_reduce_sums"))
        self.assertEqual(len(collectives(gm)), 1)
        gm = run_pipeline(canonical.trace(avgs, [SHAPE] * 2), FcollConfig(),
                          ("lower_c10d_functional", "fold_all_reduce_sums"))
        self.assertEqual(len(collectives(gm)), 1)

    def test_in_place_all_reduce_is_not_folded(self):
        """``all_reduce_`` writes its input, which others may read: left as it is."""
        def in_place(a, b):
            x = torch.ops.fcoll.wait_tensor(torch.ops.fcoll.all_reduce_(a, "sum", "0"))
            y = torch.ops.fcoll.wait_tensor(torch.ops.fcoll.all_reduce_(b, "sum", "0"))
            return x + y

        gm = _fold(in_place, 2)
        self.assertEqual(len(collectives(gm)), 2)

    def test_in_the_default_pipeline_after_lowering(self):
        self.assertEqual(FcollConfig().pipeline[:2],
                         ("lower_c10d_functional", "fold_all_reduce_sums"))


if __name__ == "__main__":
    unittest.main()
