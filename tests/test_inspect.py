"""Tests of fcoll.inspect: stable graph text, collectives table, overlap report, timeline, traces.

Single process, PyTorch's fake process group (rank 0 of 2), graphs from tests/canonical.py.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from expecttest import TestCase

sys.path.insert(0, os.path.dirname(__file__))
import canonical  # noqa: E402

import fcoll  # noqa: E402
from fcoll.inspect import format_graph  # noqa: E402


def setUpModule():
    canonical.ensure_fake_pg()


class TestFormatGraph(TestCase):
    def test_mm_overlap_snapshot(self):
        """ar -> wait -> relu -> mm -> add, as traced (wait right after the collective)."""
        gm = canonical.mm_overlap(size=8)
        self.assertExpectedInline(format_graph(gm), """\
graph(%arg0: f32[8, 8], %arg1: f32[8, 8], %arg2: f32[8, 8]):
  %ar0: f32[8, 8] = fcoll.all_reduce(%arg0, 'sum', '0')  # all_reduce group=0 ranks=2 op=sum
  %wait0: f32[8, 8] = fcoll.wait_tensor(%ar0)  # waits %ar0
  %relu0: f32[8, 8] = aten.relu(%wait0)
  %mm0: f32[8, 8] = aten.mm(%arg1, %arg2)
  %add0: f32[8, 8] = aten.add.Tensor(%relu0, %mm0)
  return %add0""")

    def test_ddp_backward_snapshot(self):
        gm = canonical.ddp_backward(n_layers=2, batch=4, hidden=8)
        self.assertExpectedInline(format_graph(gm), """\
graph(%arg0: f32[4, 8], %arg1: f32[4, 8], %arg2: f32[8, 8], %arg3: f32[4, 8], %arg4: f32[8, 8]):
  %t0: f32[8, 4] = aten.t(%arg0)
  %mm0: f32[8, 8] = aten.mm(%t0, %arg3)
  %ar0: f32[8, 8] = fcoll.all_reduce(%mm0, 'avg', '0')  # all_reduce group=0 ranks=2 op=avg
  %wait0: f32[8, 8] = fcoll.wait_tensor(%ar0)  # waits %ar0
  %mm1: f32[4, 8] = aten.mm(%arg0, %arg4)
  %threshold_backward0: f32[4, 8] = aten.threshold_backward(%mm1, %arg3, 0.0)
  %t1: f32[8, 4] = aten.t(%threshold_backward0)
  %mm2: f32[8, 8] = aten.mm(%t1, %arg1)
  %ar1: f32[8, 8] = fcoll.all_reduce(%mm2, 'avg', '0')  # all_reduce group=0 ranks=2 op=avg
  %wait1: f32[8, 8] = fcoll.wait_tensor(%ar1)  # waits %ar1
  %mm3: f32[4, 8] = aten.mm(%threshold_backward0, %arg2)
  return (%wait0, %wait1, %mm3)""")

    def test_coalesced_waits_name_their_output_index(self):
        def f(x, w):
            return fcoll.all_reduce_coalesced([x, w], "avg", dist.group.WORLD)

        gm = canonical.trace(f, [(4, 4), (2,)])
        self.assertExpectedInline(format_graph(gm), """\
graph(%arg0: f32[4, 4], %arg1: f32[2]):
  %ar_co0: [f32[4, 4], f32[2]] = fcoll.all_reduce_coalesced([%arg0, %arg1], 'avg', '0')  # all_reduce group=0 ranks=2 op=avg
  %getitem0: f32[4, 4] = getitem(%ar_co0, 0)
  %getitem1: f32[2] = getitem(%ar_co0, 1)
  %wait0: f32[4, 4] = fcoll.wait_tensor(%getitem0)  # waits %ar_co0[0]
  %wait1: f32[2] = fcoll.wait_tensor(%getitem1)  # waits %ar_co0[1]
  return [%wait0, %wait1]""")

    def test_same_program_traced_twice_gives_identical_text(self):
        """Node-name counters differ between traces in one process; the text must not."""
        a = format_graph(canonical.random_dag(seed=3, n_ops=16, size=8))
        b = format_graph(canonical.random_dag(seed=3, n_ops=16, size=8))
        self.assertEqual(a, b)
        self.assertNotIn(" at 0x", a)
        self.assertNotEqual(a, format_graph(canonical.random_dag(seed=4, n_ops=16, size=8)))

    def test_symbolic_sizes_print_as_renamed_sympy_expressions(self):
        from torch.fx.experimental.proxy_tensor import make_fx

        def f(x):
            return fcoll.all_gather_tensor(x, 0, dist.group.WORLD)

        gm = make_fx(f, tracing_mode="symbolic")(torch.randn(4, 3))
        self.assertExpectedInline(format_graph(gm), """\
graph(%arg0: f32[s0, s1]):
  %ag0: f32[2*s0, s1] = fcoll.all_gather_into_tensor(%arg0, 2, '0')  # all_gather group=0 ranks=2
  %wait0: f32[2*s0, s1] = fcoll.wait_tensor(%ag0)  # waits %ag0
  return %wait0""")

    def test_names_ignore_fx_counters(self):
        gm = canonical.mm_overlap(size=8)
        before = format_graph(gm)
        for i, n in enumerate(gm.graph.nodes):
            if n.op != "output":
                n.name = f"renamed_{100 - i}"
        self.assertEqual(format_graph(gm), before)
