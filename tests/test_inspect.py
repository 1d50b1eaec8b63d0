"""Tests of fcoll.inspect: stable graph text, collectives table, overlap report, timeline, traces.

Single process, PyTorch's fake process group (rank 0 of 2), graphs from tests/canonical.py.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from expecttest import TestCase

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


# --- a stand-in for fcoll.passes.rewrites.overlap.predict (same contract), so these tests pin the
# inspection logic independently of the cost model -------------------------------------------

from types import SimpleNamespace  # noqa: E402

from fcoll.passes.graph import (  # noqa: E402
    collective_info, is_collective, is_wait, start_of,
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
        before = collective_table(gm, predict=stand_in_predict)
        self.assertExpectedInline(str(before), """\
#  node        op          group  ranks  dtype  bytes  issue  wait  est_us  exposed_us  hidden by
-  ----------  ----------  -----  -----  -----  -----  -----  ----  ------  ----------  ---------
0  all_reduce  all_reduce  0          2  f32    256 B      0     1    24.0        24.0  -""")
        after = collective_table(overlapped(gm), predict=stand_in_predict)
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
        table = collective_table(gm, predict=stand_in_predict)
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
        row = collective_table(gm, predict=lambda g: None)[0]
        self.assertEqual((row.estimated_us, row.exposed_us, row.hiding), (12.5, 2.5, ("mm",)))
        self.assertIn("12.5", str(collective_table(gm, predict=lambda g: None)))


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
step_us            54.0   44.0     -10.0
peak_bytes          512    768      +256""")

    def test_one_graph_report_has_one_column(self):
        report = overlap_report(canonical.mm_overlap(size=8), predict=stand_in_predict)
        self.assertIsNone(report.after)
        self.assertEqual(str(report).splitlines()[0].split(), ["metric", "graph"])


from fcoll.inspect import collective_table, overlap_report  # noqa: E402


class TestTimeline(TestCase):
    def test_svg_parses_and_has_one_rect_per_scheduled_node(self):
        import tempfile
        import xml.etree.ElementTree as ET

        gm = canonical.moe_all_to_all(n_blocks=1, tokens=8, hidden=8, ffn=8)
        scheduled = [n for n in gm.graph.nodes
                     if n.op not in ("placeholder", "output", "get_attr")]
        with tempfile.TemporaryDirectory() as d:
            path = timeline(gm, os.path.join(d, "t.svg"), predict=stand_in_predict, title="moe")
            root = ET.parse(path).getroot()
        ns = "{http://www.w3.org/2000/svg}"
        rects = [r for r in root.iter(f"{ns}rect") if "node" in r.get("class", "").split()]
        self.assertEqual(len(rects), len(root.findall(f".//{ns}rect")))  # no other rects
        self.assertEqual(sorted(r.get("data-node") for r in rects),
                         sorted(n.name for n in scheduled))
        texts = [t.text for t in root.iter(f"{ns}text")]
        self.assertIn("compute", texts)
        self.assertIn("comm group 0", texts)  # one lane per process group
        self.assertTrue(any(t and t.startswith("time (us") for t in texts))
        # as traced, every a2a is waited right away: both are exposed, drawn in their own colour
        exposed = {r.get("data-node") for r in rects if "exposed" in r.get("class").split()}
        a2a = {n.name for n in scheduled if is_collective(n)}
        self.assertEqual(len(a2a), 2)
        self.assertLessEqual(a2a, exposed)
        fills = {r.get("data-node"): r.get("fill") for r in rects}
        self.assertEqual(len({fills[n] for n in exposed}), 1)
        self.assertNotIn(fills[min(exposed)], {fills[n] for n in fills if n not in exposed})

    def test_rect_geometry_follows_event_times(self):
        import xml.etree.ElementTree as ET

        events = [Event("a", "compute", "compute", 0.0, 50.0),
                  Event("c", "collective", "g1", 0.0, 100.0, 50.0),
                  Event("h", "collective", "g2", 0.0, 20.0, 0.0),
                  Event("w", "wait", "compute", 50.0, 100.0, 50.0)]
        root = ET.fromstring(timeline_svg(events))
        ns = "{http://www.w3.org/2000/svg}"
        rects = {r.get("data-node"): r for r in root.iter(f"{ns}rect")}
        wa, wc = float(rects["a"].get("width")), float(rects["c"].get("width"))
        self.assertAlmostEqual(wc, 2 * wa, places=1)
        self.assertAlmostEqual(float(rects["w"].get("x")),
                               float(rects["a"].get("x")) + wa, places=1)
        self.assertEqual(len({rects[n].get("y") for n in "ach"}), 3)  # one lane per group
        self.assertEqual(rects["w"].get("y"), rects["a"].get("y"))
        self.assertEqual(rects["c"].get("class"), "node collective exposed")
        self.assertEqual(rects["h"].get("class"), "node collective")
        self.assertNotEqual(rects["c"].get("fill"), rects["h"].get("fill"))

    def test_html_output_is_self_contained(self):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            path = timeline(canonical.mm_overlap(size=8), os.path.join(d, "t.html"),
                            predict=stand_in_predict)
            text = open(path).read()
        self.assertTrue(text.startswith("<!DOCTYPE html>"))
        self.assertIn("<svg", text)
        self.assertNotIn("<script src", text)

    def test_without_a_predictor_timeline_raises(self):
        with self.assertRaisesRegex(RuntimeError, "no predicted schedule"):
            timeline(canonical.mm_overlap(size=8), "/nonexistent/x.svg", predict=lambda g: None)


def synthetic_trace(pid=0):
    """A rank's trace of mm_overlap after the passes, run twice: ar issued at 0, mm 0-10,
    wait returns at 24 (exposed 14) in step one and at 12 (exposed 2) in step two."""
    evs = []
    for step, (t0, done) in enumerate([(0.0, 24.0), (100.0, 112.0)]):
        args = {"op": "all_reduce", "group": "0", "bytes": 256, "busbw_gbps": 0.5 + step,
                "wait_node": "wait_tensor"}
        evs += [{"ph": "b", "cat": "comm", "name": "all_reduce", "id": step, "ts": t0,
                 "pid": pid, "tid": 0, "args": args},
                {"ph": "X", "cat": "compute", "name": "mm", "ts": t0, "dur": 10.0, "pid": pid},
                {"ph": "e", "cat": "comm", "name": "all_reduce", "id": step, "ts": done,
                 "pid": pid, "tid": 0, "args": args},
                {"ph": "X", "cat": "compute", "name": "relu", "ts": done, "dur": 5.0,
                 "pid": pid},
                {"ph": "X", "cat": "compute", "name": "add", "ts": done + 5, "dur": 5.0,
                 "pid": pid}]
    evs.append({"ph": "b", "cat": "comm", "name": "other_graph_ar", "id": 9, "ts": 200.0,
                "pid": pid})
    evs.append({"ph": "e", "cat": "comm", "name": "other_graph_ar", "id": 9, "ts": 201.0,
                "pid": pid})
    return {"traceEvents": evs}


class TestCompare(TestCase):
    def test_measured_exposed_is_the_gap_before_the_wait_returns(self):
        import json
        import tempfile

        gm = overlapped(canonical.mm_overlap(size=8))
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rank0.json")
            with open(path, "w") as f:
                json.dump(synthetic_trace(), f)
            result = compare(path, gm, predict=stand_in_predict)
        (row,) = result.rows
        self.assertEqual(row.occurrences, 2)
        self.assertEqual(row.measured_exposed_us, (14.0 + 2.0) / 2)
        self.assertEqual(row.span_us, (24.0 + 12.0) / 2)
        # no execution times in this (older) trace: the own time is unknown, nothing judged
        self.assertIsNone(row.measured_us)
        self.assertIsNone(row.holds)
        self.assertEqual(row.predicted_exposed_us, 14.0)
        self.assertEqual(row.busbw_gbps, 1.0)
        self.assertEqual(result.unmatched, ["other_graph_ar"])
        self.assertExpectedInline(str(result), """\
node        op          bytes  n  pred_us  meas_us  pred/meas  late_us  computing  worker  span_us  pred_exposed_us  meas_exposed_us  busbw_GB/s
----------  ----------  -----  -  -------  -------  ---------  -------  ---------  ------  -------  ---------------  ---------------  ----------
all_reduce  all_reduce    256  2     24.0        -          -        -          -       -     18.0             14.0              8.0        1.00
total                                                                                                          14.0              8.0
in the trace but not in the graph: other_graph_ar""")

    def test_own_time_starts_when_the_last_rank_started(self):
        """Rank 0 issues at 0 and starts executing at 1; rank 1 starts at 5; rank 0 completes
        at 20 and its wait returns at 24. Rank 0's own time is 20 - 5 = 15 (not 19: the 4 us
        it waited for rank 1 is late_us), its span 24, its exposed time the recorded 3."""
        def run(pid, start, end):
            args = {"op": "all_reduce", "group": "0", "graph": "g_fw", "bytes": 256,
                    "busbw_gbps": 1.0, "wait_node": "wait_tensor", "seq": 7, "n_seq": 1,
                    "run_start_us": start, "run_end_us": end, "on_worker": pid == 0,
                    "exposed_us": 3.0}
            return {"traceEvents": [
                {"ph": "b", "cat": "comm", "name": "all_reduce", "id": pid, "ts": 0.0,
                 "pid": pid, "args": args},
                {"ph": "e", "cat": "comm", "name": "all_reduce", "id": pid, "ts": 24.0,
                 "pid": pid, "args": args}]}

        gm = overlapped(canonical.mm_overlap(size=8))
        mine, peer = run(0, 1.0, 20.0), run(1, 5.0, 21.0)
        # rank 0 computes 2..8 and 17..23: 3 + 3 us of its own time 5..20
        mine["traceEvents"] += [{"ph": "X", "cat": "compute", "name": n, "ts": t, "dur": 6.0,
                                 "pid": 0} for n, t in (("mm", 2.0), ("relu", 17.0))]
        row = compare(mine, gm, predict=stand_in_predict, peers=[peer]).rows[0]
        self.assertEqual((row.measured_us, row.late_us, row.span_us), (15.0, 4.0, 24.0))
        self.assertAlmostEqual(row.computing, 6.0 / 15.0)
        self.assertEqual(row.on_worker, 1.0)
        # a peer that computes 0..15 (10 of the 15 us): the largest share counts
        busy_peer = {"traceEvents": peer["traceEvents"] + [
            {"ph": "X", "cat": "compute", "name": "mm", "ts": 0.0, "dur": 15.0, "pid": 1}]}
        row = compare(mine, gm, predict=stand_in_predict, peers=[busy_peer]).rows[0]
        self.assertAlmostEqual(row.computing, 10.0 / 15.0)
        self.assertEqual(row.measured_exposed_us, 3.0)
        self.assertAlmostEqual(row.ratio, 24.0 / 15.0)  # stand-in predicts 24
        # one rank's file alone: the own time includes waiting for the peer
        alone = compare(mine, gm, predict=stand_in_predict).rows[0]
        self.assertEqual((alone.measured_us, alone.late_us), (19.0, 0.0))
        # the peer started first: its own time starts at its own start
        other = compare(peer, gm, predict=stand_in_predict, peers=[mine]).rows[0]
        self.assertEqual((other.measured_us, other.late_us, other.on_worker), (16.0, 0.0, 0.0))
        result = compare(mine, gm, predict=stand_in_predict, peers=[peer])
        self.assertEqual((len(result.judged), result.within), (1, 0))
        self.assertAlmostEqual(result.worst_ratio, 1.6)

    def test_events_of_another_graph_with_the_same_node_name_are_not_matched(self):
        """A backward graph has a node of the same name and op: with ``graph=`` only the
        forward's events count (SimpleFSDP's forward and backward both name their gathers
        all_gather_into_tensor_N)."""
        trace = synthetic_trace()
        for e in trace["traceEvents"]:
            if e["cat"] == "comm" and e.get("args"):
                e["args"] = {**e["args"], "graph": "g_fw"}
        bw_args = {"op": "all_reduce", "group": "0", "graph": "g_bw", "bytes": 256,
                   "busbw_gbps": 9.0, "wait_node": "wait_tensor", "exposed_us": 500.0}
        trace["traceEvents"] += [
            {"ph": "b", "cat": "comm", "name": "all_reduce", "id": 50, "ts": 300.0, "pid": 0,
             "args": bw_args},
            {"ph": "e", "cat": "comm", "name": "all_reduce", "id": 50, "ts": 900.0, "pid": 0,
             "args": bw_args}]
        gm = overlapped(canonical.mm_overlap(size=8))
        row = compare(trace, gm, predict=stand_in_predict, graph="g_fw").rows[0]
        self.assertEqual((row.occurrences, row.span_us), (2, 18.0))
        mixed = compare(trace, gm, predict=stand_in_predict).rows[0]
        self.assertEqual(mixed.occurrences, 3)

    def test_a_recorded_wait_event_is_its_exposed_time(self):
        trace = synthetic_trace()
        trace["traceEvents"].append({"ph": "X", "cat": "compute", "name": "wait_tensor",
                                     "ts": 15.0, "dur": 9.0, "pid": 0})
        gm = overlapped(canonical.mm_overlap(size=8))
        row = compare(trace, gm, predict=stand_in_predict).rows[0]
        self.assertEqual(row.measured_exposed_us, (9.0 + 2.0) / 2)

    def test_not_a_trace_raises(self):
        with self.assertRaisesRegex(ValueError, "not a Chrome trace"):
            compare({"events": []}, canonical.mm_overlap(size=8), predict=stand_in_predict)


class TestArtifacts(TestCase):
    def record(self):
        return SimpleNamespace(name="graph_0_forward", before=canonical.mm_overlap(size=8),
                               after=overlapped(canonical.mm_overlap(size=8)), config=None,
                               rank=0)

    def test_write_record_writes_every_promised_file(self):
        import tempfile

        from fcoll.inspect.artifacts import RECORD_FILES

        with tempfile.TemporaryDirectory() as d:
            paths = write_record(self.record(), d, predict=stand_in_predict)
            self.assertEqual(sorted(os.listdir(d)),
                             sorted(f.format(name="graph_0_forward") for f in RECORD_FILES))
            after = open(os.path.join(d, "graph_0_forward.after.txt")).read()
        self.assertEqual(len(paths), len(RECORD_FILES))
        self.assertEqual(after, format_graph(self.record().after) + "\n")

    def test_emit_artifacts_reaches_the_structured_trace_log(self):
        import logging

        from torch._logging._internal import trace_log

        captured = []

        class Capture(logging.Handler):
            def emit(self, rec):
                captured.append((rec.metadata, rec.payload))

        # only our handler: torch's LazyTraceHandler removes itself on the first record (no
        # TORCH_TRACE), and a handler removed mid-dispatch makes logging skip the next one
        old_handlers, old_level = list(trace_log.handlers), trace_log.level
        trace_log.handlers[:] = [Capture(level=logging.DEBUG)]
        trace_log.setLevel(logging.DEBUG)
        try:
            emit_artifacts(self.record(), predict=stand_in_predict)
        finally:
            trace_log.handlers[:] = old_handlers
            trace_log.setLevel(old_level)
        names = [m["artifact"]["name"] for m, _ in captured]
        self.assertEqual(names, ["fcoll_graph_0_forward_graph_before",
                                 "fcoll_graph_0_forward_graph_after",
                                 "fcoll_graph_0_forward_collectives",
                                 "fcoll_graph_0_forward_overlap_report"])
        self.assertTrue(all(m["artifact"]["encoding"] == "string" for m, _ in captured))
        self.assertEqual(captured[1][1], format_graph(self.record().after) + "\n")
        self.assertIn("exposed_comm_us", captured[3][1])

    def test_without_a_before_graph_the_report_has_one_column(self):
        record = SimpleNamespace(name="g", before=None, after=canonical.mm_overlap(size=8))
        files = record_files(record, predict=stand_in_predict)
        self.assertNotIn("g.before.txt", files)
        self.assertEqual(files["g.overlap.txt"].splitlines()[0].split(), ["metric", "graph"])


class TestLogging(TestCase):
    def test_torch_logs_plus_fcoll_enables_debug_logs_of_fcoll_modules(self):
        import subprocess

        code = ("import logging, torch, fcoll.inspect, fcoll.passes.registry\n"
                "print(logging.getLogger('fcoll.passes.registry').getEffectiveLevel())\n"
                "logging.getLogger('fcoll.inspect.timeline').debug('fcoll-debug-visible')\n")
        env = dict(os.environ, TORCH_LOGS="+fcoll")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), str(__import__("logging").DEBUG))
        self.assertIn("fcoll-debug-visible", out.stderr)


from fcoll.inspect import (  # noqa: E402
    Event, compare, emit_artifacts, record_files, timeline, timeline_svg, write_record,
)


class TestWithTheRealPredictor(TestCase):
    def test_table_report_and_timeline_agree_on_a_pipeline_result(self):
        """ddp_backward through the default pipeline, timed by
        fcoll.passes.rewrites.overlap.predict: the report's totals are the table's sums, and the
        passes do not add exposed time."""
        import copy
        import tempfile
        import xml.etree.ElementTree as ET

        from fcoll.passes.registry import run_pipeline
        from fcoll.passes.config import FcollConfig

        before = canonical.ddp_backward(n_layers=3, batch=16, hidden=64)
        after = run_pipeline(copy.deepcopy(before), FcollConfig(check_ranks=False),
                             ["lower_c10d_functional", "bucket_collectives",
                              "reorder_for_overlap"])
        table = collective_table(after)
        report = overlap_report(before, after)
        self.assertEqual(report.after.n_collectives, len(table))
        self.assertAlmostEqual(report.after.comm_us, sum(r.estimated_us for r in table))
        self.assertAlmostEqual(report.after.exposed_comm_us, sum(r.exposed_us for r in table))
        self.assertLessEqual(report.after.exposed_comm_us, report.before.exposed_comm_us + 1e-6)
        names = {n.name for n in after.graph.nodes}
        self.assertTrue(all(set(r.hiding) <= names for r in table))
        with tempfile.TemporaryDirectory() as d:
            root = ET.parse(timeline(after, os.path.join(d, "t.svg"))).getroot()
        n_scheduled = sum(1 for n in after.graph.nodes
                          if n.op not in ("placeholder", "output", "get_attr"))
        self.assertEqual(len(root.findall(".//{http://www.w3.org/2000/svg}rect")), n_scheduled)
