"""The scheduler issues a collective before independent compute, whatever the timings say.

Single process on PyTorch's fake process group (rank 0 of 2), graphs from make_fx under
FakeTensorMode, the default pipeline (``FcollConfig().pipeline``).

The held-out case of issue #30: ``y = all_reduce(x); z = mm(a, b)`` (independent);
``use(wait(y), z)``. The old "just early enough" rule placed the all_reduce after the mm
whenever the compute between the mm and the use (a cheap op) already covered its estimate, so
a run whose calibration said "cheap" got no overlap at all.
"""

from __future__ import annotations

import torch
from expecttest import TestCase

import canonical

import fcoll
from fcoll.inspect import format_graph
from fcoll.passes.config import FcollConfig
from fcoll.passes.graph import collectives, is_wait
from fcoll.passes.registry import run_pipeline

KIB = 1024
#: all_reduce sizes, bytes of float32 (4 KiB .. 16 MiB)
SIZES = (4 * KIB, 64 * KIB, 1024 * KIB, 16 * 1024 * KIB)
#: sides of the independent mm (its cost grows with the cube)
MM_SIDES = (16, 256, 1024)


def setUpModule():
    canonical.ensure_fake_pg()


def held_out(nbytes: int, side: int, collective_first: bool, cheap_op: bool):
    """``ar(x)``, an independent ``mm(a, b)``, optionally a cheap op on the mm's result, then
    ``wait(ar) .sum() + mm .sum()``; the collective traced before or after the mm."""
    name = torch.distributed.group.WORLD.group_name
    n = nbytes // 4

    def step(x, a, b):
        if collective_first:
            y = fcoll.all_reduce(x, "sum", name)
            z = torch.mm(a, b)
        else:
            z = torch.mm(a, b)
            y = fcoll.all_reduce(x, "sum", name)
        if cheap_op:
            z = torch.relu(z)
        return y.sum() + z.sum()

    return canonical.trace(step, [(n,), (side, side), (side, side)])


def node_index(gm, pred):
    return next(i for i, n in enumerate(gm.graph.nodes) if pred(n))


class TestIssueOrder(TestCase):
    def test_collective_issued_before_independent_mm(self):
        """For every size and mm cost, traced in either order, with or without a cheap op
        between the mm and the use:

        before: mm -> ar -> wait -> [relu] -> use   (or ar -> wait -> mm -> ...)
        after:  ar -> mm (hides ar) -> [relu] -> wait -> use

        and the same graph on every compile."""
        for nbytes in SIZES:
            for side in MM_SIDES:
                for collective_first in (True, False):
                    for cheap_op in (True, False):
                        args = (nbytes, side, collective_first, cheap_op)
                        with self.subTest(args=args):
                            texts = set()
                            for _ in range(3):
                                gm = run_pipeline(held_out(*args), FcollConfig())
                                ar = node_index(gm, lambda n: n in collectives(gm))
                                mm = node_index(gm, lambda n: n.target is
                                                torch.ops.aten.mm.default)
                                wait = node_index(gm, is_wait)
                                self.assertLess(ar, mm, format_graph(gm))
                                self.assertLess(mm, wait, format_graph(gm))
                                texts.add(format_graph(gm))
                            self.assertEqual(len(texts), 1)

    def test_issue_order_does_not_read_the_estimates(self):
        """The collective's estimate from 0.1 us to 1 s and the compute's from 0.1 us to 1 s
        give one order: the issue point of a collective that no earlier collective competes
        with reads no timing."""
        texts = set()
        for comm_us in (0.1, 10.0, 1e6):
            for compute_us in (0.1, 10.0, 1e6):
                def estimator(node, comm_us=comm_us, compute_us=compute_us):
                    if node.op != "call_function":
                        return None
                    return comm_us if node in colls else compute_us
                gm = held_out(64 * KIB, 256, collective_first=False, cheap_op=True)
                colls = set(collectives(gm))
                gm = run_pipeline(gm, FcollConfig(estimator=estimator))
                texts.add(format_graph(gm))
        self.assertEqual(len(texts), 1, "\n\n".join(sorted(texts)))
