"""Tests of fcoll.sim: collective arithmetic, link specs, scaling, overlap replay, the CLI.

Single process. Programs are built by hand as ``fcoll.schedule`` dicts (the format
``fcoll.inspect`` writes, :mod:`fcoll.inspect.schedule`) so every time is known; the CLI test
writes a directory with ``fcoll.inspect.write_record`` from a graph that went through fcoll's
passes on PyTorch's fake process group.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET
from contextlib import redirect_stdout
from types import SimpleNamespace

import canonical

from fcoll.sim import (
    Layout, Link, flat_us, hierarchical_us, parse_link, shard_names, simulate,
)
from fcoll.sim.cli import main as sim_main, parse_ranks
from fcoll.sim.program import load_programs, program_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20
# 100 gbit/s = 12,500 bytes/us; 5 us per message
NET = Link(bandwidth_bytes_per_us=12_500.0, alpha_us=5.0, spec="100gbit,5us")
SLOW_HOST = Link(bandwidth_bytes_per_us=50_000.0, alpha_us=1.0, spec="50GB/s,1us")


def node(name, cls, inputs=(), us=0.0, out=0, alloc=None, frees=(), **kw):
    return {"name": name, "cls": cls, "inputs": list(inputs), "us": us, "out_bytes": out,
            "alloc_bytes": out if alloc is None else alloc, "frees": list(frees), **kw}


def coll(name, kind, inputs, in_bytes, out_bytes, group_size=2, group="0"):
    return node(name, "collective", inputs, out=out_bytes, kind=kind, op=kind, group=group,
                group_size=group_size, in_bytes=in_bytes, dtype="float32",
                size_estimated=False)


def schedule(nodes, world_size=2, name="g", op_overhead_us=0.0):
    return {"format": "fcoll.schedule", "version": 1, "graph": name, "world_size": world_size,
            "cost_source": "test", "op_overhead_us": op_overhead_us, "nodes": nodes}


def one_collective(kind, in_bytes, out_bytes):
    """x -> collective -> wait: nothing to hide it, so the step is the collective."""
    return schedule([node("x", "placeholder", out=in_bytes),
                     coll("c", kind, ["x"], in_bytes, out_bytes),
                     node("w", "wait", ["c"], collective="c")])


class TestCollectiveArithmetic(unittest.TestCase):
    def test_ring_all_reduce_is_2_n_minus_1_over_n_bytes_plus_2_n_minus_1_alphas(self):
        s = 64 * MiB
        for n in (2, 3, 8, 64, 4096):
            want = 2 * (n - 1) / n * s / 12_500.0 + 2 * (n - 1) * 5.0
            self.assertAlmostEqual(flat_us("all_reduce", s, n, 5.0, 12_500.0, "ring"), want)

    def test_ring_all_gather_and_reduce_scatter_are_n_minus_1_over_n(self):
        s = 8 * MiB
        for kind in ("all_gather", "reduce_scatter"):
            for n in (2, 16, 1000):
                want = (n - 1) / n * s / 12_500.0 + (n - 1) * 5.0
                self.assertAlmostEqual(flat_us(kind, s, n, 5.0, 12_500.0, "ring"), want)

    def test_tree_all_reduce_takes_ceil_log2_n_steps_of_alpha_plus_s_over_b(self):
        s = 4096
        for n, steps in ((2, 1), (8, 3), (9, 4), (4096, 12)):
            self.assertAlmostEqual(flat_us("all_reduce", s, n, 5.0, 12_500.0, "tree"),
                                   steps * (5.0 + s / 12_500.0))

    def test_tree_beats_ring_for_small_messages_and_loses_for_large_ones(self):
        n = 512
        self.assertLess(flat_us("all_reduce", 1024, n, 5.0, 12_500.0, "tree"),
                        flat_us("all_reduce", 1024, n, 5.0, 12_500.0, "ring"))
        self.assertGreater(flat_us("all_reduce", 1 << 30, n, 5.0, 12_500.0, "tree"),
                           flat_us("all_reduce", 1 << 30, n, 5.0, 12_500.0, "ring"))

    def test_one_rank_moves_nothing(self):
        self.assertEqual(flat_us("all_reduce", MiB, 1, 5.0, 1.0, "ring"), 0.0)

    def test_hierarchical_all_reduce_is_intra_rs_plus_inter_ar_of_a_shard_plus_intra_ag(self):
        s, g, h = 32 * MiB, 8, 16
        intra = (g - 1) / g * s / 50_000.0 + (g - 1) * 1.0           # one ring phase on a host
        inter = 2 * (h - 1) / h * (s / g) / 12_500.0 + 2 * (h - 1) * 5.0
        self.assertAlmostEqual(hierarchical_us("all_reduce", s, h, g, SLOW_HOST, NET, "ring"),
                               intra + inter + intra)

    def test_hierarchical_all_gather_and_reduce_scatter_cross_hosts_with_a_gth_of_the_bytes(self):
        s, g, h = 32 * MiB, 4, 8
        on_host = (g - 1) / g * s / 50_000.0 + (g - 1) * 1.0
        across = (h - 1) / h * (s / g) / 12_500.0 + (h - 1) * 5.0
        for kind in ("all_gather", "reduce_scatter"):
            self.assertAlmostEqual(hierarchical_us(kind, s, h, g, SLOW_HOST, NET, "ring"),
                                   on_host + across)

    def test_unknown_kind_or_algorithm_raises_naming_it(self):
        with self.assertRaisesRegex(ValueError, "'gather'"):
            flat_us("gather", 1, 2, 1.0, 1.0, "ring")
        with self.assertRaisesRegex(ValueError, "'butterfly'"):
            flat_us("all_reduce", 1, 2, 1.0, 1.0, "butterfly")


class TestLinkSpecs(unittest.TestCase):
    def test_units(self):
        for spec, bw, alpha in (("100gbit,5us", 12_500.0, 5.0), ("800Mbit, 2ms", 100.0, 2000.0),
                                ("25GB/s,500ns", 25_000.0, 0.5), ("1.5mb/s,0us", 1.5, 0.0)):
            link = parse_link(spec, "--inter")
            self.assertAlmostEqual(link.bandwidth_bytes_per_us, bw)
            self.assertAlmostEqual(link.alpha_us, alpha)

    def test_shm_without_calibration_uses_the_documented_defaults(self):
        from fcoll.sim.links import SHM_DEFAULT_ALPHA_US, SHM_DEFAULT_BUSBW_GBPS

        link, s = parse_link("shm", "--intra"), 8 * MiB
        busbw_bytes_per_us = SHM_DEFAULT_BUSBW_GBPS * 1e3
        self.assertAlmostEqual(link.collective_us("all_reduce", s, 4, "ring"),
                               SHM_DEFAULT_ALPHA_US + 2 * 3 / 4 * s / busbw_bytes_per_us)
        self.assertIn("documented defaults", link.describe())

    def test_shm_uses_the_curves_the_recorded_run_calibrated(self):
        """all_reduce calibrated on 2 ranks: 100 us at 4 KiB, 1,100 us at 1 MiB. On 2 ranks the
        curve itself; on 4 ranks the curve at 1.5x the bytes (bus factor 2*3/4 over 2*1/2)."""
        curves = [{"backend": "fcoll", "kind": "all_reduce", "group_size": 2, "link": "intra",
                   "points": [[4096, 100.0], [MiB, 1100.0]]},
                  {"backend": "gloo", "kind": "all_reduce", "group_size": 4, "link": "intra",
                   "points": [[4096, 1.0], [MiB, 2.0]]}]
        s = 512 * 1024
        beta = 1000.0 / (MiB - 4096)
        for ranks, nbytes in ((2, s), (4, 1.5 * s)):
            prog = one_collective("all_reduce", s, s)
            prog["comm_curves"] = curves
            r = simulate(prog, [Layout(ranks, 8)]).results[0]
            self.assertAlmostEqual(r.comm_us, 100.0 + beta * (int(nbytes) - 4096), places=6)
        self.assertIn("calibrated", simulate(prog, [2]).as_dict()["intra"])

    def test_shm_is_the_measured_model(self):
        link = parse_link("shm", "--intra")
        self.assertGreater(link.collective_us("all_reduce", MiB, 2, "ring"),
                           link.collective_us("all_reduce", 1024, 2, "ring"))
        self.assertEqual(link.collective_us("all_reduce", MiB, 1, "ring"), 0.0)

    def test_bad_specs_raise_value_error_naming_the_argument(self):
        for spec, what in (("100gbit", "BANDWIDTH,LATENCY"), ("fast,5us", "bandwidth"),
                           ("100gbps,5us", "unit 'gbps'"), ("100gbit,5 parsecs", "latency"),
                           ("0gbit,5us", "positive"), ("100gbit,5us,1", "BANDWIDTH,LATENCY")):
            with self.subTest(spec=spec):
                with self.assertRaisesRegex(ValueError, f"--inter: .*{what}"):
                    parse_link(spec, "--inter")

    def test_shm_between_hosts_is_refused(self):
        with self.assertRaisesRegex(ValueError, "--inter: 'shm'"):
            simulate(one_collective("all_reduce", MiB, MiB), [16], inter="shm")

    def test_bad_layouts_and_ranks_raise_naming_the_argument(self):
        with self.assertRaisesRegex(ValueError, "--ranks: 12 ranks do not fill hosts of 8"):
            Layout(12, 8)
        with self.assertRaisesRegex(ValueError, "--hosts-of"):
            Layout(4, 0)
        with self.assertRaisesRegex(ValueError, "--ranks: .*'x'"):
            parse_ranks("2,x")


class TestReplay(unittest.TestCase):
    def test_step_of_a_lone_all_reduce_is_the_ring_formula(self):
        """x -> ar -> wait on 64 ranks (8 hosts of 8), ring forced: nothing hides it."""
        s = 16 * MiB
        r = simulate(one_collective("all_reduce", s, s), [Layout(64, 8)], inter=NET,
                     algorithm="ring").results[0]
        want = 2 * 63 / 64 * s / 12_500.0 + 2 * 63 * 5.0
        self.assertAlmostEqual(r.step_us, want)
        self.assertAlmostEqual(r.comm_us, want)
        self.assertAlmostEqual(r.exposed_comm_us, want)

    def test_collective_hidden_behind_independent_compute_is_not_exposed(self):
        """ar(x) -> mm(y) 10 ms -> wait -> add: the all_reduce runs while mm computes."""
        s = MiB
        prog = schedule([node("x", "placeholder", out=s), node("y", "placeholder", out=s),
                         coll("ar", "all_reduce", ["x"], s, s),
                         node("mm", "compute", ["y"], us=10_000.0, out=s),
                         node("w", "wait", ["ar"], collective="ar"),
                         node("add", "compute", ["w", "mm"], us=10.0, out=s)])
        r = simulate(prog, [Layout(64, 8)], inter=NET).results[0]
        self.assertGreater(r.comm_us, 0.0)
        self.assertLess(r.comm_us, 10_000.0)
        self.assertEqual(r.exposed_comm_us, 0.0)
        self.assertAlmostEqual(r.step_us, 10_010.0)

    def test_collective_whose_wait_comes_before_the_compute_is_exposed(self):
        """ar(x) -> wait -> mm(wait): the compute needs the result, so it waits for all of it."""
        s = MiB
        prog = schedule([node("x", "placeholder", out=s),
                         coll("ar", "all_reduce", ["x"], s, s),
                         node("w", "wait", ["ar"], collective="ar"),
                         node("mm", "compute", ["w"], us=10_000.0, out=s)])
        r = simulate(prog, [Layout(64, 8)], inter=NET).results[0]
        self.assertAlmostEqual(r.exposed_comm_us, r.comm_us)
        self.assertAlmostEqual(r.step_us, 10_000.0 + r.comm_us)

    def test_collectives_of_one_group_run_one_at_a_time(self):
        s = MiB
        prog = schedule([node("x", "placeholder", out=s),
                         coll("a", "all_reduce", ["x"], s, s), coll("b", "all_reduce", ["x"], s, s),
                         node("wa", "wait", ["a"], collective="a"),
                         node("wb", "wait", ["b"], collective="b")])
        r = simulate(prog, [Layout(64, 8)], inter=NET, algorithm="ring").results[0]
        one = 2 * 63 / 64 * s / 12_500.0 + 2 * 63 * 5.0
        self.assertAlmostEqual(r.step_us, 2 * one)

    def test_peak_memory_counts_inputs_and_frees_after_last_use(self):
        prog = schedule([node("x", "placeholder", out=100),
                         node("a", "compute", ["x"], us=1.0, out=1000),
                         node("b", "compute", ["a"], us=1.0, out=10, frees=["a"]),
                         node("c", "compute", ["b"], us=1.0, out=500, frees=["b"])])
        r = simulate(prog, [Layout(2, 8)]).results[0]
        self.assertEqual(r.peak_bytes, 100 + 1000 + 10)

    def test_a_wait_before_its_collective_is_refused(self):
        bad = schedule([node("w", "wait", [], collective="c"),
                        coll("c", "all_reduce", [], 4, 4)])
        with self.assertRaisesRegex(ValueError, "wait 'w' waits on unknown collective 'c'"):
            program_of(bad)


def ddp_step(grad_bytes, compute_us):
    """backward compute -> all_reduce(grad) -> wait -> optimizer: DDP's step."""
    return schedule([node("p", "placeholder", out=grad_bytes),
                     node("bwd", "compute", ["p"], us=compute_us, out=grad_bytes),
                     coll("ar", "all_reduce", ["bwd"], grad_bytes, grad_bytes),
                     node("w", "wait", ["ar"], collective="ar"),
                     node("opt", "compute", ["p", "w"], us=compute_us, out=grad_bytes)])


def fsdp_step(param_bytes, n0, compute_us, opt_us, overhead_us=0.0):
    """all_gather(shard) -> fwd/bwd on the whole parameter -> reduce_scatter(grad) -> wait ->
    optimizer on the shard: FSDP's step, recorded on ``n0`` ranks."""
    shard = param_bytes // n0
    return schedule([node("shard", "placeholder", out=shard),
                     coll("ag", "all_gather", ["shard"], shard, param_bytes, group_size=n0),
                     node("wag", "wait", ["ag"], collective="ag"),
                     node("fwdbwd", "compute", ["wag"], us=compute_us, out=param_bytes,
                          frees=["ag"]),
                     coll("rs", "reduce_scatter", ["fwdbwd"], param_bytes, shard,
                          group_size=n0),
                     node("wrs", "wait", ["rs"], collective="rs", frees=["fwdbwd"]),
                     node("opt", "compute", ["shard", "wrs"], us=opt_us, out=shard,
                          frees=["rs"])],
                    world_size=n0, op_overhead_us=overhead_us)


class TestScaling(unittest.TestCase):
    def test_ddp_all_reduce_keeps_its_bytes_per_rank(self):
        s = 32 * MiB
        rep = simulate(ddp_step(s, 100.0), [Layout(n, 8) for n in (16, 64, 4096)],
                       inter=NET, algorithm="ring")
        for r in rep.results:
            n = r.layout.ranks
            self.assertAlmostEqual(r.comm_us, 2 * (n - 1) / n * s / 12_500.0 + 2 * (n - 1) * 5.0)
            self.assertAlmostEqual(r.compute_us, 200.0)   # weak scaling: compute stays

    def test_fsdp_gathered_size_stays_and_shards_shrink_as_one_over_n(self):
        p, n0 = 64 * MiB, 2
        rep = simulate(fsdp_step(p, n0, 1000.0, 400.0), [Layout(n, 8) for n in (16, 64)],
                       inter=NET, algorithm="ring")
        for r in rep.results:
            n = r.layout.ranks
            ring = (n - 1) / n * p / 12_500.0 + (n - 1) * 5.0   # all_gather = reduce_scatter
            self.assertAlmostEqual(r.comm_us, 2 * ring)
            self.assertAlmostEqual(r.compute_us, 1000.0 + 400.0 * n0 / n)
            # inputs: the shard p/n; peak when the gradient p is made while the gathered
            # parameter p is still live
            self.assertAlmostEqual(r.peak_bytes, p / n + 2 * p)

    def test_shards_are_found_from_the_graph_ops(self):
        prog = program_of(fsdp_step(64 * MiB, 2, 1000.0, 400.0))
        self.assertEqual(shard_names(prog), {"shard", "wrs", "opt"})

    def test_a_shards_fixed_op_overhead_does_not_shrink(self):
        rep = simulate(fsdp_step(MiB, 2, 1000.0, 400.0, overhead_us=100.0), [Layout(16, 8)],
                       inter=NET)
        self.assertAlmostEqual(rep.results[0].compute_us, 1000.0 + 100.0 + 300.0 * 2 / 16)

    def test_auto_picks_the_fastest_algorithm(self):
        small, big = 4096, 256 * MiB
        for s, want in ((small, "hier/tree"), (big, "hier/ring")):
            r = simulate(ddp_step(s, 1.0), [Layout(4096, 8)], intra=SLOW_HOST,
                         inter=NET).results[0]
            self.assertEqual(list(r.algorithms()["all_reduce"]), [want])
            forced = [simulate(ddp_step(s, 1.0), [Layout(4096, 8)], intra=SLOW_HOST, inter=NET,
                               algorithm=a).results[0].comm_us
                      for a in ("ring", "tree", "hierarchical")]
            self.assertAlmostEqual(r.comm_us, min(forced))

    def test_one_host_uses_the_intra_host_link_only(self):
        s = 8 * MiB
        r = simulate(ddp_step(s, 1.0), [Layout(8, 8)], intra=SLOW_HOST, inter=NET,
                     algorithm="ring").results[0]
        self.assertAlmostEqual(r.comm_us, 2 * 7 / 8 * s / 50_000.0 + 2 * 7 * 1.0)


class TestMeasuredCompute(unittest.TestCase):
    """Two steps of a -> b -> (wait returns) -> c in a runtime trace."""

    TRACE = {"traceEvents": [
        {"name": "a", "cat": "compute", "ph": "X", "ts": 0.0, "dur": 10.0, "pid": 0},
        {"name": "b", "cat": "compute", "ph": "X", "ts": 15.0, "dur": 20.0, "pid": 0},
        {"name": "ar", "cat": "comm", "ph": "e", "ts": 50.0, "pid": 0, "id": 1},
        {"name": "c", "cat": "compute", "ph": "X", "ts": 52.0, "dur": 3.0, "pid": 0},
        {"name": "a", "cat": "compute", "ph": "X", "ts": 1000.0, "dur": 12.0, "pid": 0},
        {"name": "b", "cat": "compute", "ph": "X", "ts": 1014.0, "dur": 20.0, "pid": 0},
        {"name": "ar", "cat": "comm", "ph": "e", "ts": 1040.0, "pid": 0, "id": 2},
        {"name": "c", "cat": "compute", "ph": "X", "ts": 1041.0, "dur": 3.0, "pid": 0},
    ]}

    def program(self):
        return schedule([node("x", "placeholder", out=4), node("a", "compute", ["x"], us=1.0),
                         node("b", "compute", ["a"], us=1.0),
                         node("c", "compute", ["b"], us=1.0), node("d", "compute", ["c"], us=7.0)])

    def test_duration_plus_the_gap_since_the_last_compute_or_wait_return(self):
        """The first step is left out (it compiles): step 2's durations and gaps count."""
        from fcoll.sim.measured import measured_compute_us, with_measured_compute

        m = measured_compute_us(self.TRACE)
        self.assertEqual(m["b"], (20.0, 2.0))      # gap 2 after a (step 1's 5 left out)
        self.assertEqual(m["c"], (3.0, 1.0))       # gap 1 after the wait returned
        prog, missing = with_measured_compute(program_of(self.program()), m)
        self.assertEqual([n.us for n in prog.nodes[1:]], [12.0, 22.0, 4.0, 7.0])  # a: no gap
        self.assertEqual(missing, 1)               # d is not in the trace: predicted 7 us
        self.assertEqual(prog.op_overhead_us, 1.0)

    def test_simulate_with_compute_from_the_trace(self):
        r = simulate(self.program(), [2], compute="trace", trace=self.TRACE)
        self.assertAlmostEqual(r.results[0].compute_us, 12.0 + 22.0 + 4.0 + 7.0)
        self.assertIn("1 compute node(s) not in the trace", r.compute_source)
        with self.assertRaisesRegex(ValueError, "--compute trace: give the trace"):
            simulate(self.program(), [2], compute="trace")


class TestOutsideTheGraphs(unittest.TestCase):
    """Three steps of one program ``all_gather (issued before any compute) -> a -> b -> wait``:
    each graph run spans from the all_gather's issue to the last wait's return; the rest of
    each period is outside the graph."""

    @staticmethod
    def graph_run(t0):
        """A run starting at ``t0``: issue at t0, a at t0+5 (10 us), b at t0+20 (10 us),
        wait returns at t0+40."""
        return [
            {"name": "ag", "cat": "comm", "ph": "b", "ts": t0, "pid": 0, "id": t0},
            {"name": "a", "cat": "compute", "ph": "X", "ts": t0 + 5, "dur": 10.0, "pid": 0},
            {"name": "b", "cat": "compute", "ph": "X", "ts": t0 + 20, "dur": 10.0, "pid": 0},
            {"name": "ag", "cat": "comm", "ph": "e", "ts": t0 + 40, "pid": 0, "id": t0},
        ]

    def program(self):
        return schedule([node("x", "placeholder", out=4 * MiB),
                         coll("ag", "all_gather", ["x"], 4 * MiB, 8 * MiB),
                         node("a", "compute", ["x"], us=1.0),
                         node("b", "compute", ["a"], us=1.0),
                         node("w", "wait", ["ag"], collective="ag")])

    def trace(self, starts):
        return {"traceEvents": [e for t0 in starts for e in self.graph_run(t0)]}

    def test_outside_is_the_period_minus_the_runs_span_from_first_issue_to_last_wait(self):
        """Periods 100, 130, 100 us; every run spans 40 us (issue at +0 to the wait at +40,
        not the compute's 5..30): outside 60, 90, 60 -> median 60 over 3 steps (the last run
        has no following step)."""
        from fcoll.sim.measured import outside_graphs_us

        m = outside_graphs_us(self.trace([0, 100, 230, 330]), load_programs(self.program()))
        self.assertEqual((m.outside_us, m.period_us, m.graphs_us, m.steps, m.tracer_us),
                         (60.0, 100.0, 40.0, 3, 0.0))

    def test_the_tracers_file_writes_are_not_the_steps(self):
        """Each run followed by a 25 us trace_write (at +45): outside 60 - 25 = 35 us."""
        trace = self.trace([0, 100, 200, 300])
        trace["traceEvents"] += [{"name": "trace_write", "cat": "trace", "ph": "X",
                                  "ts": t0 + 45, "dur": 25.0} for t0 in (0, 100, 200, 300)]
        from fcoll.sim.measured import outside_graphs_us

        m = outside_graphs_us(trace, load_programs(self.program()))
        self.assertEqual((m.outside_us, m.period_us, m.graphs_us, m.tracer_us),
                         (35.0, 100.0, 40.0, 25.0))

    def test_two_programs_per_step_each_count_their_own_span(self):
        """Forward f (compute f1, 10 us) then backward g (compute g1, 20 us) per step, steps
        every 100 us: f at +0, g at +30 -> graphs 30 us, outside 70 us (the 20 us between f
        and g is outside too: the autograd engine's)."""
        from fcoll.sim.measured import outside_graphs_us

        fwd = schedule([node("x", "placeholder", out=4), node("f1", "compute", ["x"], us=1.0)],
                       name="f")
        bwd = schedule([node("y", "placeholder", out=4), node("g1", "compute", ["y"], us=1.0)],
                       name="g")
        ev = []
        for t0 in (0.0, 100.0, 200.0):
            ev += [{"name": "f1", "cat": "compute", "ph": "X", "ts": t0, "dur": 10.0},
                   {"name": "g1", "cat": "compute", "ph": "X", "ts": t0 + 30, "dur": 20.0}]
        m = outside_graphs_us({"traceEvents": ev}, load_programs([fwd, bwd]))
        self.assertEqual((m.outside_us, m.graphs_us, m.steps), (70.0, 30.0, 2))

    def test_simulated_step_adds_the_measured_outside_time_to_every_layout(self):
        """compute from the trace: a 10 + b (10 + gap 5 after a) = 25 us; the all_gather of
        8 MiB on 2 hosts of 1 rank over 100gbit,5us: 1/2 * 8 MiB / 12,500 B/us + 5 us, waited
        after b: exposed all but the 25 us of compute behind it. Outside: 60 us."""
        trace = self.trace([0, 100, 230, 330])
        r = simulate(self.program(), [Layout(2, 1)], inter=NET, compute="trace", trace=trace,
                     algorithm="ring").results[0]
        ag_us = 0.5 * 8 * MiB / 12_500.0 + 5.0
        self.assertAlmostEqual(r.compute_us, 25.0)
        self.assertAlmostEqual(r.outside_us, 60.0)
        self.assertAlmostEqual(r.step_us, ag_us + 60.0)
        given = simulate(self.program(), [Layout(2, 1)], inter=NET, compute="trace",
                         trace=trace, algorithm="ring", outside=7.5).results[0]
        self.assertAlmostEqual(given.step_us, ag_us + 7.5)
        none = simulate(self.program(), [Layout(2, 1)], inter=NET, compute="trace",
                        trace=trace, algorithm="ring", outside="none").results[0]
        self.assertAlmostEqual(none.step_us, ag_us)

    def test_without_a_trace_auto_adds_nothing_and_says_so(self):
        rep = simulate(self.program(), [2])
        self.assertEqual(rep.results[0].outside_us, 0.0)
        self.assertIn("not modelled", rep.outside_source)
        self.assertIn("predicted", rep.compute_source)

    def test_bad_outside_and_too_short_traces_raise_naming_the_argument(self):
        from fcoll.sim.measured import outside_graphs_us

        with self.assertRaisesRegex(ValueError, "--outside trace: give the trace"):
            simulate(self.program(), [2], outside="trace")
        with self.assertRaisesRegex(ValueError, "--outside: expected microseconds >= 0"):
            simulate(self.program(), [2], outside=-1.0)
        with self.assertRaisesRegex(ValueError, "--outside: expected 'auto'"):
            simulate(self.program(), [2], outside="sometimes")
        with self.assertRaisesRegex(ValueError, "no two in a row; run more steps"):
            outside_graphs_us(self.trace([0]), load_programs(self.program()))
        with self.assertRaisesRegex(ValueError, "no compute events of"):
            outside_graphs_us({"traceEvents": []}, load_programs(self.program()))


class TestInductorSegments(unittest.TestCase):
    """Traces of graphs whose compute Inductor compiled (``compute="inductor"``): one event per
    segment (``segment_<i>``, target ``"inductor:<first>..<last>"``), the forward's and the
    backward's in files that sort backward first, a node name (``getitem_1``) in both graphs
    but traced as compute in the backward only."""

    @staticmethod
    def fwd():
        return schedule([node("x", "placeholder", out=4), node("getitem_1", "compute", ["x"]),
                         node("a", "compute", ["x"], us=3.0), node("b", "compute", ["a"], us=1.0),
                         node("c", "compute", ["b"], us=0.0)], name="graph_0_forward")

    @staticmethod
    def bwd():
        return schedule([node("y", "placeholder", out=4), node("getitem_1", "compute", ["y"]),
                         node("d", "compute", ["getitem_1"], us=0.0)], name="graph_0_backward")

    @staticmethod
    def step(t0):
        """forward segment a..c (40 us) at t0 + 10, backward segment getitem_1..d (20 us) at
        t0 + 60; steps every 100 us."""
        return [{"name": "segment_0", "cat": "compute", "ph": "X", "ts": t0 + 10, "dur": 40.0,
                 "pid": 0, "args": {"target": "inductor:a..c", "graph": "graph_0_forward"}},
                {"name": "segment_0", "cat": "compute", "ph": "X", "ts": t0 + 60, "dur": 20.0,
                 "pid": 0, "args": {"target": "inductor:getitem_1..d",
                                    "graph": "graph_0_backward"}}]

    def trace(self):
        return {"traceEvents": [e for t0 in (0.0, 100.0, 200.0, 300.0) for e in self.step(t0)]}

    def test_a_segment_splits_into_its_nodes_by_their_predicted_times(self):
        from fcoll.sim.measured import measured_compute_us, node_events

        progs = load_programs([self.bwd(), self.fwd()])
        split = node_events(self.trace()["traceEvents"][:1], progs)
        self.assertEqual([(e["name"], e["ts"], e["dur"]) for e in split],
                         [("a", 10.0, 30.0), ("b", 40.0, 10.0), ("c", 50.0, 0.0)])
        equal = node_events(self.trace()["traceEvents"][1:2], progs)   # predicted 0 and 0
        self.assertEqual([(e["name"], e["dur"]) for e in equal],
                         [("getitem_1", 10.0), ("d", 10.0)])
        other = dict(self.trace()["traceEvents"][0], args={"target": "inductor:a..c",
                                                            "graph": "graph_1_forward"})
        self.assertEqual(node_events([other], progs), [other])   # a graph not simulated
        m = measured_compute_us(self.trace(), graph="graph_0_forward", programs=progs)
        # a's gap: since the last forward's c ended (with_measured_compute drops it)
        self.assertEqual(m, {"a": (30.0, 60.0), "b": (10.0, 0.0), "c": (0.0, 0.0)})

    def test_simulate_reads_segments_and_pairs_forward_and_backward_as_they_ran(self):
        """Compute 40 + 20 us a step, from the trace; the forward's first traced node (a, not
        getitem_1, which the forward does not trace) gets no gap; outside: the 100 us period
        less the runs' 60 us."""
        from fcoll.sim.measured import outside_graphs_us

        progs = load_programs([self.bwd(), self.fwd()])   # file order: backward first
        m = outside_graphs_us(self.trace(), progs)
        self.assertEqual((m.outside_us, m.graphs_us, m.steps), (40.0, 60.0, 3))
        r = simulate([self.bwd(), self.fwd()], [2], compute="trace", trace=self.trace())
        self.assertAlmostEqual(r.results[0].compute_us, 60.0)
        self.assertAlmostEqual(r.results[0].outside_us, 40.0)
        self.assertIn("1 compute node(s) not in the trace", r.compute_source)


class TestLinkProbeFit(unittest.TestCase):
    def test_exact_ring_times_give_back_alpha_and_bandwidth(self):
        """4 ranks, alpha 50 us, 100 bytes/us: t = 6 * 50 + 1.5 * S / 100."""
        from fcoll.sim.linkprobe import fit_ring_link

        pts = [(s, 6 * 50.0 + 1.5 * s / 100.0) for s in (64 << 10, 1 << 20, 16 << 20)]
        alpha, bw = fit_ring_link(pts, 4)
        self.assertAlmostEqual(alpha, 50.0, places=6)
        self.assertAlmostEqual(bw, 100.0, places=6)

    def test_a_negative_intercept_is_clipped_and_the_bandwidth_refitted_through_zero(self):
        """2 ranks (x = S): (1000 B, 5 us), (2000 B, 15 us) fit t = 10 x / 1000 - 5; clipped:
        slope through 0 = (1000*5 + 2000*15) / (1000**2 + 2000**2) = 35000 / 5e6 us per byte
        -> 142.857 bytes/us."""
        from fcoll.sim.linkprobe import fit_ring_link, link_spec

        alpha, bw = fit_ring_link([(1000, 5.0), (2000, 15.0)], 2)
        self.assertEqual(alpha, 0.0)
        self.assertAlmostEqual(bw, 142.857142, places=4)
        self.assertEqual(link_spec(alpha, bw), "0.1429GB/s,0us")
        self.assertEqual(parse_link(link_spec(50.0, 125.0), "--inter"),
                         Link(125.0, 50.0, "0.125GB/s,50us"))

    def test_bad_points_raise_naming_the_problem(self):
        from fcoll.sim.linkprobe import fit_ring_link

        with self.assertRaisesRegex(ValueError, "two distinct sizes"):
            fit_ring_link([(1000, 5.0), (1000, 6.0)], 2)
        with self.assertRaisesRegex(ValueError, "ranks must be >= 2"):
            fit_ring_link([(1000, 5.0), (2000, 6.0)], 1)
        with self.assertRaisesRegex(ValueError, "do not grow with size"):
            fit_ring_link([(1000, 9.0), (2000, 5.0)], 2)


class TestFromGraphs(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import copy

        from fcoll.passes.config import FcollConfig
        from fcoll.passes.registry import run_pipeline

        canonical.ensure_fake_pg()
        cls.before = canonical.ddp_backward(n_layers=3, batch=16, hidden=64)
        cls.after = run_pipeline(copy.deepcopy(cls.before), FcollConfig(check_ranks=False),
                                 ["lower_c10d_functional", "bucket_collectives",
                                  "reorder_for_overlap"])

    def test_live_graph_at_its_own_size_matches_the_recorded_collectives(self):
        rep = simulate(self.after, [2], intra="shm")
        prog = load_programs(self.after)[0]
        n_coll = sum(1 for n in prog.nodes if n.cls == "collective")
        self.assertEqual(sum(rep.results[0].algorithms()["all_reduce"].values()), n_coll)
        self.assertAlmostEqual(rep.results[0].compute_us,
                               sum(n.us for n in prog.nodes if n.cls == "compute"))

    def test_cli_on_a_directory_fcoll_inspect_wrote(self):
        from fcoll.inspect import write_record

        record = SimpleNamespace(name="graph_0_backward", before=self.before, after=self.after,
                                 config=None, rank=0)
        with tempfile.TemporaryDirectory() as d:
            write_record(record, os.path.join(d, "rank0"))
            svg, out_json = os.path.join(d, "p.svg"), os.path.join(d, "r.json")
            buf = io.StringIO()
            with redirect_stdout(buf):
                rc = sim_main([d, "--ranks", "2,16,4096", "--hosts-of", "8", "--intra", "shm",
                               "--inter", "100gbit,5us", "--plot", svg, "--json", out_json])
            self.assertEqual(rc, 0)
            text = buf.getvalue()
            data = json.load(open(out_json))
            root = ET.parse(svg).getroot()
        self.assertIn("step_ms", text.splitlines()[0])
        self.assertIn("assumptions:", text)
        self.assertEqual([lay["ranks"] for lay in data["layouts"]], [2, 16, 4096])
        self.assertEqual(data["graphs"], ["graph_0_backward"])
        for lay in data["layouts"]:
            self.assertLessEqual(lay["exposed_comm_us"], lay["comm_us"] + 1e-9)
            self.assertGreaterEqual(lay["step_us"], lay["compute_us"])
            self.assertGreater(lay["peak_bytes"], 0)
        ns = "{http://www.w3.org/2000/svg}"
        self.assertEqual({p.get("class") for p in root.iter(f"{ns}polyline")},
                         {"step", "exposed"})
        self.assertEqual(len(root.findall(f".//{ns}circle")), 2 * 3)

    def test_cli_names_the_bad_argument_and_exits_2(self):
        with tempfile.TemporaryDirectory() as d:
            proc = subprocess.run([sys.executable, "-m", "fcoll.sim", d, "--inter", "fast"],
                                  cwd=ROOT, capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("--inter", proc.stderr)


if __name__ == "__main__":
    unittest.main()
