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


# --- a stand-in for fcoll.passes.overlap.predict (same contract), so these tests pin the
# inspection logic independently of the cost model -------------------------------------------

from types import SimpleNamespace  # noqa: E402

from fcoll.passes.graph import (  # noqa: E402
    collective_info, is_collective, is_wait, node_bytes, start_of,
)

COMPUTE_US = 10.0


def stand_in_predict(gm):
    """Every compute node takes 10 µs; a collective 20 µs + 1 µs per 64 bytes on its group's
    lane (one at a time per lane); a wait blocks the compute lane until its collective ends."""
    now, lane_free, ends, events = 0.0, {}, {}, []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        if is_collective(n):
            info = collective_info(n)
            start = max(now, lane_free.get(info.group_name, 0.0))
            end = start + 20.0 + max(info.in_bytes, info.out_bytes) / 64
            lane_free[info.group_name] = ends[n] = end
            events.append(SimpleNamespace(node=n.name, kind="collective", lane=info.group_name,
                                          start_us=start, end_us=end, exposed_us=0.0))
        elif is_wait(n):
            end = max(now, ends[start_of(n)])
            events.append(SimpleNamespace(node=n.name, kind="wait", lane="compute",
                                          start_us=now, end_us=end, exposed_us=end - now))
            now = end
        else:
            dur = 0.0 if n.target is __import__("operator").getitem else COMPUTE_US
            events.append(SimpleNamespace(node=n.name, kind="compute", lane="compute",
                                          start_us=now, end_us=now + dur, exposed_us=0.0))
            now += dur
    return events


def overlapped(gm):
    """mm_overlap reordered as the overlap pass would: ``ar -> mm -> wait -> relu -> add``."""
    (ar,) = [n for n in gm.graph.nodes if is_collective(n)]
    (mm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    ar.append(mm)
    gm.graph.lint()
    gm.recompile()
    return gm


class TestCollectivesTable(TestCase):
    def test_mm_between_collective_and_wait_hides_it_in_the_table(self):
        """ar -> wait -> relu -> mm -> add: all 24 µs of ar exposed;
        ar -> mm (hides ar for 10 µs) -> wait -> relu -> add: 14 µs exposed."""
        gm = canonical.mm_overlap(size=8)
        before = collectives(gm, predict=stand_in_predict)
        self.assertExpectedInline(str(before), """\
#  node        op          group  ranks  dtype  bytes  issue  wait  est_us  exposed_us  hidden by
-  ----------  ----------  -----  -----  -----  -----  -----  ----  ------  ----------  ---------
0  all_reduce  all_reduce  0          2  f32    256 B      0     1    24.0        24.0  -""")
        after = collectives(overlapped(gm), predict=stand_in_predict)
        self.assertExpectedInline(str(after), """\
#  node        op          group  ranks  dtype  bytes  issue  wait  est_us  exposed_us  hidden by
-  ----------  ----------  -----  -----  -----  -----  -----  ----  ------  ----------  ---------
0  all_reduce  all_reduce  0          2  f32    256 B      0     2    24.0        14.0  mm""")
        row = after[0]
        self.assertEqual((row.op, row.group, row.group_size, row.dtype, row.bytes),
                         ("all_reduce", "0", 2, "f32", 8 * 8 * 4))
        self.assertEqual(row.hiding, ("mm",))
        self.assertEqual(row.estimated_us, 20.0 + 256 / 64)
        self.assertEqual(row.exposed_us, row.estimated_us - COMPUTE_US)
        self.assertLess(row.issue_pos, row.wait_pos)

    def test_rows_follow_graph_order_and_bytes_count_the_larger_buffer(self):
        gm = canonical.fsdp_backward(n_layers=2, batch=4, hidden=8)
        table = collectives(gm, predict=stand_in_predict)
        self.assertEqual([r.op for r in table], ["all_gather_into_tensor",
                                                 "reduce_scatter_tensor"] * 2)
        self.assertEqual([r.index for r in table], [0, 1, 2, 3])
        # all_gather: [4, 8] shard -> [8, 8]; reduce_scatter: [8, 8] -> [4, 8]; both 256 bytes
        self.assertEqual({r.bytes for r in table}, {256})
        positions = [r.issue_pos for r in table]
        self.assertEqual(positions, sorted(positions))
        self.assertEqual(len(str(table).splitlines()), 2 + len(table))

    def test_without_a_predictor_the_scheduler_meta_is_used(self):
        from fcoll.passes.graph import META_ESTIMATED_US, META_EXPOSED_US, META_HIDING

        gm = canonical.mm_overlap(size=8)
        (ar,) = [n for n in gm.graph.nodes if is_collective(n)]
        ar.meta.update({META_ESTIMATED_US: 12.5, META_EXPOSED_US: 2.5, META_HIDING: ["mm"]})
        row = collectives(gm, predict=lambda g: None)[0]
        self.assertEqual((row.estimated_us, row.exposed_us, row.hiding), (12.5, 2.5, ("mm",)))
        self.assertIn("12.5", str(collectives(gm, predict=lambda g: None)))


class TestOverlapReport(TestCase):
    def test_moving_mm_before_the_wait_hides_communication(self):
        before = canonical.mm_overlap(size=8)
        after = overlapped(canonical.mm_overlap(size=8))
        report = overlap_report(before, after, predict=stand_in_predict)
        self.assertEqual(report.before.exposed_comm_us, 24.0)
        self.assertEqual(report.after.exposed_comm_us, 14.0)
        self.assertEqual(report.after.hidden_comm_us, 10.0)
        self.assertAlmostEqual(report.after.overlap_ratio, 10 / 24)
        self.assertEqual(report.as_dict()["after"]["n_collectives"], 1)
        self.assertExpectedInline(str(report), """\
metric           before  after    change
---------------  ------  -----  --------
collectives           1      1        +0
comm_us            24.0   24.0      +0.0
hidden_comm_us      0.0   10.0     +10.0
exposed_comm_us    24.0   14.0     -10.0
overlap_ratio      0.0%  41.7%  +41.7 pt
step_us            54.0   44.0     -10.0""")

    def test_one_graph_report_has_one_column(self):
        report = overlap_report(canonical.mm_overlap(size=8), predict=stand_in_predict)
        self.assertIsNone(report.after)
        self.assertEqual(str(report).splitlines()[0].split(), ["metric", "graph"])


from fcoll.inspect import collectives, overlap_report  # noqa: E402
