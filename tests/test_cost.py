"""Tests of the cost model (fcoll.passes.analysis.cost): formulas, defaults, symbolic sizes, user
estimators; and of calibration (fcoll.passes.analysis.calibration) on two real ranks (one batched run).
How long calibration takes is printed by ``benchmarks/passes_scaling.py --rank-costs``."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from expecttest import TestCase
from torch.fx.experimental.proxy_tensor import make_fx

import canonical  # noqa: E402

from fcoll.ops.facts import busbw_factor  # noqa: E402
from fcoll.passes.analysis import calibration as calibrate, comm_cost, cost  # noqa: E402
from fcoll.passes.graph import collectives, is_wait  # noqa: E402
from fcoll.testing import run_ranks  # noqa: E402


def setUpModule():
    canonical.ensure_fake_pg()


def node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


class TestFormulas(TestCase):
    def test_default_comm_uses_nccl_tests_bus_factor_of_at_least_two_ranks(self):
        for kind in cost.KINDS:
            self.assertAlmostEqual(cost.default_comm(kind, 4).beta_us_per_byte,
                                   busbw_factor(kind, 4) / 1e3)
            self.assertEqual(cost.default_comm(kind, 1), cost.default_comm(kind, 2))
        self.assertEqual(cost.default_comm("all_reduce", 4).beta_us_per_byte, 1.5e-3)

    def test_fit_recovers_alpha_and_beta(self):
        p = comm_cost.fit_alpha_beta([(1000, 50.0 + 1000 * 0.002),
                                      (100000, 50.0 + 100000 * 0.002)])
        self.assertAlmostEqual(p.alpha_us, 50.0)
        self.assertAlmostEqual(p.beta_us_per_byte, 0.002)
        noisy = comm_cost.fit_alpha_beta([(1000, 90.0), (100000, 80.0)], nonnegative=True)
        self.assertGreater(noisy.beta_us_per_byte, 0)
        self.assertGreaterEqual(noisy.alpha_us, 0)

    def test_collective_is_alpha_plus_beta_times_larger_buffer(self):
        gm = canonical.fsdp_forward(n_layers=1, hidden=256)  # gather [128, 256] -> [256, 256]
        ag = collectives(gm)[0]
        model = cost.CostModel()
        p = cost.default_comm("all_gather", 2)
        self.assertAlmostEqual(model(ag), p.alpha_us + p.beta_us_per_byte * 256 * 256 * 4)

    def test_compute_is_roofline_with_flop_counter_flops(self):
        gm = canonical.mm_overlap(size=64)
        mm = node(gm, "mm")
        with FlopCounterMode(display=False) as counter:
            torch.mm(torch.ones(64, 64), torch.ones(64, 64))
        self.assertEqual(cost.node_flops(mm), counter.get_total_flops())
        r = cost.DEFAULT_COMPUTE
        want = r.op_overhead_us + max(counter.get_total_flops() / r.flops_per_us,
                                      3 * 64 * 64 * 4 / r.bytes_per_us)
        self.assertAlmostEqual(cost.CostModel()(mm), want)
        relu = node(gm, "relu")  # no FLOP formula: memory bound
        self.assertAlmostEqual(cost.CostModel()(relu),
                               r.op_overhead_us + 2 * 64 * 64 * 4 / r.bytes_per_us)

    def test_views_waits_and_placeholders_cost_nothing(self):
        gm = canonical.fsdp_forward(n_layers=1)
        model = cost.CostModel()
        self.assertTrue(cost.is_free_op(node(gm, "t")))  # aten.t is a view
        self.assertFalse(cost.is_free_op(node(gm, "mm")))
        free = [n for n in gm.graph.nodes
                if n.op != "call_function" or is_wait(n) or cost.is_free_op(n)]
        self.assertEqual(len(free), 5)  # 2 placeholders, wait, t, output
        for n in free:
            self.assertEqual(model(n), 0.0, n.name)

    def test_symbolic_sizes_are_evaluated_with_hints(self):
        def f(a, b):
            import fcoll

            return fcoll.all_reduce(torch.mm(a, b), "sum", "0")

        static = make_fx(f, tracing_mode="fake")(torch.ones(48, 32), torch.ones(32, 16))
        symbolic = make_fx(f, tracing_mode="symbolic")(torch.ones(48, 32), torch.ones(32, 16))
        self.assertTrue(any(isinstance(s, torch.SymInt)
                            for n in symbolic.graph.nodes if n.op == "placeholder"
                            for s in n.meta["val"].shape))
        model = cost.CostModel()
        want = [model(n) for n in static.graph.nodes]
        self.assertEqual([model(n) for n in symbolic.graph.nodes], want)
        self.assertGreater(sum(want), 0)

    def test_user_estimator_first_none_falls_back(self):
        gm = canonical.mm_overlap(size=64)
        model = calibrate.cached_model(gm, estimator=lambda n: 7.0 if n.name == "mm" else None)
        self.assertEqual(model(node(gm, "mm")), 7.0)
        self.assertEqual(model(node(gm, "relu")), cost.CostModel()(node(gm, "relu")))


class TestDefaults(TestCase):
    def test_fake_pg_uses_deterministic_defaults_without_calibrating(self):
        saved = calibrate.calibrate_group

        def boom(*a, **k):
            raise AssertionError("calibration must not run on the fake process group")

        calibrate.calibrate_group = boom
        try:
            model = calibrate.model_for(canonical.ddp_backward(n_layers=1))
        finally:
            calibrate.calibrate_group = saved
        self.assertEqual(model.source, "default")
        self.assertEqual(model.compute, cost.DEFAULT_COMPUTE)
        self.assertEqual(model, calibrate.model_for(canonical.ddp_backward(n_layers=1)))


def _calibrate_on_two_ranks(rank, world_size):
    """Calibrate the fcoll world group and a gloo subgroup; plan a graph on each."""
    import torch.distributed as dist

    import canonical as c
    from fcoll.passes.analysis import calibration as cal
    from fcoll.passes.registry import get_pass

    gloo = dist.new_group(backend="gloo")
    out = {}
    for label, pg in (("fcoll", dist.group.WORLD), ("gloo", gloo)):
        rates, comm = cal.calibrate_group(pg, 256 << 10)   # sweep 4 KiB .. 1 MiB
        again = cal.calibrate_group(pg, 256 << 10)
        gm = c.ddp_backward(n_layers=3, batch=64, hidden=256, group=pg.group_name)
        model = cal.cached_model(gm)
        get_pass("reorder_for_overlap")(gm)
        out[label] = dict(cached=again[0] is rates and again[1] is comm,
                          rates=rates, comm=sorted(comm.items()), source=model.source,
                          order=[n.name for n in gm.graph.nodes],
                          estimates=[n.meta.get("fcoll_estimated_us") for n in gm.graph.nodes])
    return out


class TestCalibration(TestCase):
    def test_calibration_is_cached_and_shared_from_rank_0(self):
        r0, r1 = run_ranks(_calibrate_on_two_ranks, 2, backend="fcoll", timeout_s=150)
        for label in ("fcoll", "gloo"):
            a, b = r0[label], r1[label]
            self.assertEqual(a["rates"], b["rates"], label)  # rank 0's numbers on every rank
            self.assertEqual(a["comm"], b["comm"], label)
            self.assertEqual(a["order"], b["order"], label)  # hence the same schedule
            self.assertEqual(a["estimates"], b["estimates"], label)
            self.assertEqual(a["source"], "calibrated")
            self.assertEqual({k[0] for k, _ in a["comm"]}, {label})
            self.assertEqual({k[1] for k, _ in a["comm"]}, set(cost.KINDS))
            for _, p in a["comm"]:
                self.assertEqual(p.sizes, calibrate.sizes_for(256 << 10))
                self.assertEqual(list(p.times_us), sorted(p.times_us))
                self.assertGreater(p.times_us[0], 0)
                self.assertGreaterEqual(p.alpha_us, 0)
            self.assertGreater(a["rates"].flops_per_us, 0)
            for r in (a, b):   # a second call returns the cache, without measuring again
                self.assertTrue(r["cached"], label)


def _calibrate_gloo_under_python_dispatcher(rank, world_size, rounds):
    """Calibrate a gloo group ``rounds`` times with the Python dispatcher on, as inside
    torch.compile (where the overlap pass calibrates)."""
    import torch.distributed as dist
    from torch._dispatch.python import enable_python_dispatcher

    from fcoll.passes.analysis import calibration as cal

    with enable_python_dispatcher():
        for _ in range(rounds):
            cal._CACHE.groups.clear()
            cal._CACHE.by_key.clear()   # or rank 0 reuses its numbers and nothing is timed
            _, comm = cal.calibrate_group(dist.group.WORLD, 16 << 10)
    return sorted(comm)


class TestCalibrationInsideCompile(TestCase):
    def test_gloo_calibration_with_the_python_dispatcher_does_not_deadlock(self):
        """With the Python dispatcher on, a gloo op runs its kernel holding the GIL, and gloo's
        worker needs the GIL under its queue mutex: calibration deadlocked in 1 of 2-3
        compiles before it turned the dispatcher off (see ``calibrate._measure_on_rank_0``)."""
        r0, r1 = run_ranks(_calibrate_gloo_under_python_dispatcher, 2, backend="gloo",
                           args=(8,), timeout_s=100)
        self.assertEqual(r0, r1)
        self.assertEqual({k[1] for k in r0}, set(cost.KINDS))


def test_arg_of_reads_positional_and_keyword_arguments_by_schema_name():
    import torch.fx as fx

    from fcoll.passes.graph import arg_of

    g = fx.Graph()
    x = g.placeholder("x")
    pos = g.call_function(torch.ops.fcoll.all_gather_into_tensor.default, (x, 2, "g0"))
    kw = g.call_function(torch.ops.fcoll.all_gather_into_tensor.default, (x,),
                         {"group_size": 2, "group_name": "g1"})
    assert (arg_of(pos, "group_name"), arg_of(pos, "group_size")) == ("g0", 2)
    assert (arg_of(kw, "group_name"), arg_of(kw, "group_size")) == ("g1", 2)
    assert arg_of(pos, "reduce_op", None) is None
    with pytest.raises(KeyError, match="no argument 'reduce_op'"):
        arg_of(pos, "reduce_op")


HIDDEN = 256   # 4 gradients of 256 KiB: together within the DDP backward's 1 MiB first bucket


def _compute_core_groups(rank, world_size):
    import torch.distributed as dist

    import canonical as c
    from fcoll.passes.rewrites.bucket_plan import plan_buckets
    from fcoll.passes.config import FcollConfig

    gloo = dist.new_group(backend="gloo")
    out = {}
    for label, pg in (("fcoll", dist.group.WORLD), ("gloo", gloo)):
        gm = c.ddp_backward(n_layers=4, batch=512, hidden=HIDDEN, group=pg.group_name)
        out[label] = (dist.get_backend(pg), [len(b.members) for b in plan_buckets(gm, FcollConfig())])
    return out


def test_lane_plan_is_the_same_on_network_and_shared_memory_backends():
    """The bucket planner's lane plan (``fcoll.passes.rewrites.bucket_rules.lane_segments``)
    applies to every backend: 4 gradients of 256 KiB (together within the DDP backward's 1 MiB
    first-bucket cap) merge into one bucket on fcoll's backend and on gloo alike (uncalibrated:
    the default costs)."""
    r0, r1 = run_ranks(_compute_core_groups, 2, backend="fcoll", timeout_s=100)
    assert r0 == r1
    assert r0["fcoll"] == ("fcoll", [4])
    assert r0["gloo"] == ("gloo", [4])


def _trace_of(durations_us, nbytes=4096):
    """A rank's trace with one all_reduce occurrence per duration: issued at ts, executed by
    the engine from ts + 5 for the duration (its own time), its wait returning 5 us later."""
    evs = []
    for i, dur in enumerate(durations_us):
        t0 = 1000.0 * i
        args = {"op": "all_reduce", "group": "0", "bytes": nbytes, "busbw_gbps": 1.0,
                "wait_node": "wait_tensor", "seq": i, "n_seq": 1, "run_start_us": t0 + 5,
                "run_end_us": t0 + 5 + dur, "on_worker": True, "exposed_us": 0.0}
        evs += [{"ph": "b", "cat": "comm", "name": "all_reduce", "id": i, "ts": t0, "pid": 0,
                 "args": args},
                {"ph": "e", "cat": "comm", "name": "all_reduce", "id": i, "ts": t0 + dur + 10,
                 "pid": 0, "args": args}]
    return {"traceEvents": evs}


def _predicted(collective_us):
    from fcoll.passes.rewrites.list_scheduler import PredictedEvent

    return [PredictedEvent("all_reduce", "collective", "0", 0.0, collective_us, 0.0),
            PredictedEvent("wait_tensor", "wait", "compute", collective_us, collective_us, 0.0)]


def test_compare_report_sets_predicted_beside_measured_per_collective():
    """The compare report's row: the model's time, the measured mean own time (100 and
    120 us: 110; issue to wait return, 120, is only the span), their ratio, the bytes from the
    trace, and whether the prediction holds within 30 %."""
    from fcoll.inspect.trace_compare import TOLERANCE, compare

    gm = canonical.mm_overlap(size=8)
    close = compare(_trace_of([100.0, 120.0]), gm, events=_predicted(99.0))
    (row,) = close.rows
    assert (row.predicted_us, row.measured_us, row.bytes) == (99.0, 110.0, 4096)
    assert row.span_us == 120.0
    assert row.ratio == pytest.approx(0.9) and row.holds is True
    assert row.as_dict()["ratio"] == pytest.approx(0.9) and row.as_dict()["holds"] is True
    assert "predicted within +-30% of measured: 1 of 1 collectives" in str(close)
    far = compare(_trace_of([100.0, 120.0]), gm, events=_predicted(110.0 * (1 + TOLERANCE) + 1))
    assert far.rows[0].holds is False
    assert "0 of 1 collectives" in str(far)
    unmeasured = compare({"traceEvents": []}, gm, events=_predicted(50.0)).rows[0]
    assert (unmeasured.ratio, unmeasured.holds, unmeasured.measured_us) == (None, None, None)
    assert unmeasured.bytes == cost.collective_size(collectives(gm)[0]).nbytes  # from the graph
