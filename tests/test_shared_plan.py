"""Tests of the shared bucket plan (fcoll/passes/rewrites/shared_plan.py, group_plan.py).

Each group's merges are planned by its lowest rank and applied by every rank, so ranks whose
graphs differ in compute still bucket alike. ``run_ranks`` calls (gloo and fcoll's
shared-memory backend) compile a step whose rank 0 does extra compute, and one where rank 1
cannot put one collective in its planned bucket (the fallback per collective); single-process
tests cover a plan that cannot be applied, the fallback's pieces, the store protocol's pieces,
and the fake process group.
"""

from __future__ import annotations

import json
import time
import unittest
from unittest import mock

import torch
import torch.fx as fx

import canonical  # noqa: E402
import fcoll  # noqa: E402
from fcoll.passes.rewrites import shared_plan  # noqa: E402
from fcoll.passes.rewrites.bucket_plan import plan_buckets  # noqa: E402
from fcoll.passes.rewrites.bucketing import BucketCollectives  # noqa: E402
from fcoll.passes.config import FcollConfig  # noqa: E402
from fcoll.passes.rewrites.bucket_plan import follow_plans  # noqa: E402
from fcoll.passes.rewrites.bucketing import apply_buckets  # noqa: E402
from fcoll.passes.rewrites.group_plan import (  # noqa: E402
    BucketPlanError, GroupPlan, group_plans, without)
from fcoll.passes.rewrites.shared_plan import META_BUCKET_PLAN, BucketPlanTimeoutError  # noqa: E402
from fcoll.testing import run_ranks  # noqa: E402

ROWS, HIDDEN, LAYERS = 256, 128, 6


def _step(rank: int, group):
    """``h = tanh(h @ w_i)`` per layer, rank 0 adding ``0 * tanh(h @ w_i)`` (compute the other
    rank lacks: its graph is longer, the values equal); layer ``i``'s ``h`` is all_reduced and
    the result added to ``h`` two layers later (the last two are outputs)."""
    def step(x, *ws):
        h, pending = x, []
        for w in ws:
            h = torch.tanh(h @ w)
            if rank == 0:
                h = h + 0.0 * torch.tanh(h @ w)
            if len(pending) >= 2:
                h = h + pending.pop(0)
            pending.append(fcoll.all_reduce(h, "sum", group))
        return [h] + pending
    return step


def _traced(rank: int, group: str) -> fx.GraphModule:
    return canonical.trace(_step(rank, group), [(ROWS, HIDDEN)] + [(HIDDEN, HIDDEN)] * LAYERS)


def _compile_on_ranks(rank: int, world_size: int) -> dict:
    """Compile the rank-dependent step with the default passes; return each rank's own plan
    (plan_buckets alone, as every rank decided before), the pass's plan and its origin, the
    bucketed collectives, and whether the results match eager. Communication costs are the
    uncalibrated defaults (calibration patched out) so the local plans are deterministic."""
    import torch.distributed as dist

    from fcoll.compile.backend import register_compile_listener
    from fcoll.passes.analysis import calibration as calibrate
    from fcoll.passes.graph import collective_info, collectives
    from fcoll.passes.registry import run_pipeline

    calibrate.calibrate_group = lambda pg, nbytes=None: None
    group = dist.group.WORLD
    records = []
    handle = register_compile_listener(records.append)
    torch.manual_seed(0)
    inputs = [torch.randn(ROWS, HIDDEN) * 0.1] + [torch.randn(HIDDEN, HIDDEN) * 0.1
                                                  for _ in range(LAYERS)]
    step = _step(rank, group)
    want = [t.wait() if hasattr(t, "wait") else t for t in step(*inputs)]
    options = {"check_timeout_s": 60.0}
    compiled = torch.compile(step, backend="fcoll", options=options)
    got = [compiled(*inputs)]
    if rank == 1:   # a recompile on rank 1 alone finds the stored plan, waits for nobody
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="fcoll", options=options)
    got.append(compiled(*inputs))
    handle.remove()
    out: dict = {"ok": [all(torch.allclose(w, g, atol=1e-5) for w, g in zip(want, run))
                        for run in got]}
    name = group.group_name
    for i, rec in enumerate(records):
        lowered = run_pipeline(rec.before, FcollConfig(), ["lower_c10d_functional"])
        own = group_plans(lowered, plan_buckets(lowered, FcollConfig(), include_moves=True))
        origin = rec.after.meta[META_BUCKET_PLAN][name]
        out[i] = {"own": own[name].buckets, "source": origin.source,
                  "planner": origin.planner, "applied": origin.buckets,
                  "collectives": [(collective_info(n).kind, collective_info(n).in_bytes)
                                  for n in collectives(rec.after)]}
    return out


class TestTwoRanks(unittest.TestCase):
    def _run(self, backend: str) -> None:
        r0, r1 = run_ranks(_compile_on_ranks, 2, backend=backend, timeout_s=240)
        self.assertEqual((r0["ok"], r1["ok"]), ([True, True], [True, True]))
        # Alone, the ranks plan differently: rank 0's extra compute hides the first
        # all_reduces, so it merges them in pairs; rank 1 issues each alone.
        self.assertEqual(r0[0]["own"], ((0, 1), (2, 3)))
        self.assertEqual(r1[0]["own"], ())
        # The pass applies rank 0's plan on both.
        self.assertEqual((r0[0]["source"], r0[0]["planner"]), ("published", 0))
        for rec in (r1[0], r1[1]):
            self.assertEqual((rec["source"], rec["planner"]), ("received", 0))
        for rec in (r0[0], r1[0], r1[1]):
            self.assertEqual(rec["applied"], ((0, 1), (2, 3)))
            self.assertEqual(rec["collectives"], r0[0]["collectives"])
        self.assertEqual(len(r0[0]["collectives"]), 4)      # 2 merged pairs + 2 alone

    def test_ranks_with_different_compute_apply_the_lowest_ranks_plan_gloo(self):
        """Before the shared plan the ranks bucketed differently (4 and 6 collectives): rank
        1's check passed at once (its unbucketed sequence was what rank 0 had published in the
        check before calibrating) and it ran the step, while rank 0 raised RankTimeoutError
        at check_timeout_s and rank 1 then failed in gloo (connection closed by peer)."""
        self._run("gloo")

    def test_ranks_with_different_compute_apply_the_lowest_ranks_plan_fcoll(self):
        """fcoll's shared-memory groups are lane-planned, so shared, too."""
        self._run("fcoll")


def _fallback_step(rank: int, group):
    """Three all_reduces and two all_gathers; on rank 1 the third all_reduce's input reads the
    first one's result (``z + a``: compute on one rank only that no hoisting can move, as it
    reads a collective's output)::

        rank 0: ar(a) ar(b) ar(c) ag(p) ag(q)          plan: [a b c] [p q]
        rank 1: ar(a) ar(b) (z + a) ar(c) ag(p) ag(q)  c cannot join [a b]

    becomes on both ranks ``[a b] c [p q]``."""
    def step(x, y, z, p, q):
        a = fcoll.all_reduce(torch.tanh(x), "sum", group)
        b = fcoll.all_reduce(torch.tanh(y), "sum", group)
        if rank == 1:
            z = z + a
        c = fcoll.all_reduce(torch.tanh(z), "sum", group)
        return (a, b, c, fcoll.all_gather_tensor(torch.tanh(p), 0, group),
                fcoll.all_gather_tensor(torch.tanh(q), 0, group))
    return step


def _fallback_on_ranks(rank: int, world_size: int) -> dict:
    """Compile :func:`_fallback_step` with the default passes (calibration patched out, as in
    :func:`_compile_on_ranks`); return rank 0's own plan, the applied plan, the bucketed
    collectives, the INFO log of ``shared_plan`` and whether values equal eager."""
    import logging

    import torch.distributed as dist

    from fcoll.compile.backend import register_compile_listener
    from fcoll.passes.analysis import calibration as calibrate
    from fcoll.passes.graph import collective_info, collectives
    from fcoll.passes.registry import run_pipeline

    calibrate.calibrate_group = lambda pg, nbytes=None: None
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: messages.append(r.getMessage())
    logger = logging.getLogger(shared_plan.__name__)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    group = dist.group.WORLD
    records = []
    handle = register_compile_listener(records.append)
    gen = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(32, 32, generator=gen) for _ in range(5)]
    step = _fallback_step(rank, group)
    want = [t.wait() if hasattr(t, "wait") else t for t in step(*inputs)]
    got = torch.compile(step, backend="fcoll", options={"check_timeout_s": 60.0})(*inputs)
    handle.remove()
    logger.removeHandler(handler)
    (rec,) = records
    lowered = run_pipeline(rec.before, FcollConfig(), ["lower_c10d_functional"])
    own = group_plans(lowered, plan_buckets(lowered, FcollConfig(), include_moves=True))
    origin = rec.after.meta[META_BUCKET_PLAN][group.group_name]
    return {"ok": all(torch.allclose(w, g, atol=1e-5) for w, g in zip(want, got)),
            "own": own[group.group_name].buckets, "applied": origin.buckets,
            "alone": origin.alone, "log": messages,
            "collectives": [(collective_info(n).kind, collective_info(n).in_bytes)
                            for n in collectives(rec.after)]}


class TestFallbackPerCollective(unittest.TestCase):
    def _run(self, backend: str) -> None:
        r0, r1 = run_ranks(_fallback_on_ranks, 2, backend=backend, timeout_s=240)
        self.assertEqual(r0["own"], ((0, 1, 2), (3, 4)))          # what rank 0 planned
        for r in (r0, r1):
            self.assertTrue(r["ok"])
            self.assertEqual(r["applied"], ((0, 1), (3, 4)))
            self.assertEqual([i for i, _ in r["alone"]], [2])
            self.assertRegex(r["alone"][0][1], r"^rank 1: all_reduce_2 cannot join "
                                               r"\['all_reduce', 'all_reduce_1'\]: dependency")
            (line,) = [m for m in r["log"] if "issued alone" in m]
            self.assertRegex(line, r"group '0': collective #2 \(all_reduce_2 here\) is issued "
                                   r"alone on every rank .*: rank 1: all_reduce_2 cannot join")
        self.assertEqual(r0["collectives"], r1["collectives"])
        self.assertEqual([k for k, _ in r0["collectives"]],
                         ["all_reduce", "all_reduce", "all_gather"])

    def test_a_collective_one_rank_cannot_bucket_is_issued_alone_and_other_buckets_stay(self):
        """Before: rank 1 raised ``BucketPlanError`` (``all_reduce_2 cannot join
        [all_reduce, all_reduce_1]: dependency``) and rank 0 waited in the rank check. Now
        both ranks agree to issue that one collective alone, the other buckets stay, every
        rank logs it with rank 1's reason, and values equal eager."""
        self._run("fcoll")

    def test_a_collective_one_rank_cannot_bucket_is_issued_alone_gloo(self):
        self._run("gloo")


class TestApply(unittest.TestCase):
    def setUp(self) -> None:
        canonical.ensure_fake_pg()
        import torch.distributed as dist

        self.g = dist.group.WORLD.group_name

    def _pairs(self, rank: int) -> fx.GraphModule:
        """Two all_reduces; on rank 1 the second one's input reads the first's result (as a
        ``dist.reduce`` copy on its destination would make it)."""
        g = self.g

        def step(x, y):
            a = fcoll.all_reduce(torch.tanh(x), "sum", g)
            if rank == 1:
                y = y + a
            return a, fcoll.all_reduce(torch.tanh(y), "sum", g)
        return canonical.trace(step, [(64, 64), (64, 64)])

    def test_a_plan_this_graph_cannot_follow_raises_naming_rank_group_and_collectives(self):
        plan = group_plans(self._pairs(0), plan_buckets(self._pairs(0), include_moves=True))
        self.assertEqual(plan[self.g].buckets, ((0, 1),))
        plan = {self.g: GroupPlan(self.g, plan[self.g].buckets, "the plan of rank 0")}
        with self.assertRaisesRegex(BucketPlanError, "rank 0, group '0': cannot apply the plan "
                                    "of rank 0: it merges collectives #0 all_reduce, "
                                    "#1 all_reduce_1, but here .*dependency"):
            plan_buckets(self._pairs(1), include_moves=True, forced=plan)

    def test_a_plan_naming_a_missing_collective_raises(self):
        with self.assertRaisesRegex(BucketPlanError, r"bucket \[0, 5\] is not a bucket of "
                                    "this group's 2 collectives"):
            plan_buckets(self._pairs(0), forced={self.g: GroupPlan(self.g, ((0, 5),))})

    def test_a_forced_plan_is_followed_where_timing_would_decide_otherwise(self):
        """Rank 1's graph, planned alone, merges nothing; given rank 0's plan it merges the
        same pairs, and times nothing (no cost model is asked)."""
        g0, g1 = _traced(0, self.g), _traced(1, self.g)
        plan = group_plans(g0, plan_buckets(g0, include_moves=True))
        self.assertEqual(plan[self.g].buckets, ((0, 1), (2, 3)))
        self.assertEqual(group_plans(g1, plan_buckets(g1, include_moves=True))[self.g].buckets,
                         ())
        from fcoll.passes.rewrites.bucket_plan import BucketCosts

        def untimed(*args):
            raise AssertionError("a forced group is not timed")

        forced = plan_buckets(g1, FcollConfig(), BucketCosts(untimed, untimed),
                              include_moves=True, forced=plan)
        self.assertEqual(group_plans(g1, forced)[self.g].buckets, ((0, 1), (2, 3)))


class TestFallbackPieces(unittest.TestCase):
    """The fallback per collective on one rank's graph (fake process group)."""

    def setUp(self) -> None:
        canonical.ensure_fake_pg()
        import torch.distributed as dist

        self.g = dist.group.WORLD.group_name

    def test_without_splits_a_bucket_at_a_collective_issued_alone(self):
        plan = GroupPlan(self.g, ((0, 1, 2, 3), (4, 5)), "p")
        self.assertEqual(without(plan, [2]), GroupPlan(self.g, ((0, 1), (4, 5)), "p", (2,)))
        self.assertEqual(without(plan, [1, 5]).buckets, ((2, 3),))
        self.assertEqual(without(without(plan, [1]), [4]).alone, (1, 4))

    def test_follow_plans_leaves_out_the_member_that_cannot_join_and_says_why(self):
        """``TestApply._pairs(1)``: the second all_reduce reads the first one's result, so
        rank 0's plan ``[0 1]`` raises strictly; leniently #1 is left out, nothing merges."""
        pairs = TestApply._pairs
        plan = group_plans(pairs(self, 0), plan_buckets(pairs(self, 0), include_moves=True))
        followed = follow_plans(pairs(self, 1), None, None, plan)
        (why,) = followed.dropped[self.g].values()
        self.assertEqual(list(followed.dropped[self.g]), [1])
        self.assertRegex(why, r"^all_reduce_1 cannot join \['all_reduce'\]: dependency")
        self.assertTrue(all(len(b.members) == 1 for b in followed.buckets))

    def _settle_as_rank_1(self, stored: dict[str, str]):
        """:func:`shared_plan._settle` of ``TestApply._pairs(1)`` under rank 0's plan
        ``[0 1]``, as rank 1 of ranks (0, 1), on a HashStore holding ``stored`` (report key
        suffix ``round/rank`` -> report)."""
        import torch.distributed as dist

        from fcoll.passes.rewrites.bucket_plan import model_costs

        s = shared_plan._Shared(self.g, 0, "k", "d" * 64, 2, dist.HashStore(), (0, 1))
        for suffix, report in stored.items():
            s.store.set(f"k/alone/{suffix}", report)
        gm = TestApply._pairs(self, 1)
        plan = GroupPlan(self.g, ((0, 1),), "the plan of rank 0")
        config = FcollConfig(check_timeout_s=5.0)
        return shared_plan._settle(gm, config, model_costs(gm, config), {self.g: s},
                                   {self.g: plan}, 1), s.store

    def test_settle_reports_what_this_rank_leaves_out_until_no_rank_leaves_anything(self):
        """Round 0: rank 1 reports #1 (rank 0 nothing); round 1, with #1 alone: nobody."""
        (buckets, alone), store = self._settle_as_rank_1({"0/0": "{}", "1/0": "{}"})
        self.assertEqual(list(alone[self.g]), [1])
        self.assertRegex(alone[self.g][1], r"^rank 1: all_reduce_1 cannot join")
        self.assertEqual(json.loads(store.get("k/alone/0/1")), {"1": alone[self.g][1]})
        self.assertEqual(json.loads(store.get("k/alone/1/1")), {})
        self.assertTrue(all(len(b.members) == 1 for b in buckets))

    def test_settle_raises_when_an_earlier_compiles_report_of_this_rank_applies(self):
        """Rank 1's first compile of these collectives reported nothing; this graph must
        leave #1 out, which the other ranks would not know: raise, do not diverge."""
        with self.assertRaisesRegex(BucketPlanError, r"rank 1: cannot apply the agreed bucket "
                                    r"plans: group '0', collective #1: all_reduce_1 cannot "
                                    r"join .*report stored by an earlier compile"):
            self._settle_as_rank_1({"0/0": "{}", "0/1": "{}"})

    def _four(self) -> fx.GraphModule:
        """Four all_reduces of ``tanh`` s; ``b``'s is computed just before it, the others' at
        the start: ``tx tz tw ar(a) ty ar(b) ar(c) ar(d)``."""
        g = self.g

        def step(x, y, z, w):
            tx, tz, tw = torch.tanh(x), torch.tanh(z), torch.tanh(w)
            a = fcoll.all_reduce(tx, "sum", g)
            b = fcoll.all_reduce(torch.tanh(y), "sum", g)
            return [a, b, fcoll.all_reduce(tz, "sum", g), fcoll.all_reduce(tw, "sum", g)]
        return canonical.trace(step, [(64, 64)] * 4)

    def _order(self, plan: GroupPlan) -> list[int]:
        from fcoll.passes.graph import collective_info, collectives

        gm = self._four()
        followed = follow_plans(gm, None, None, {self.g: plan})
        self.assertEqual(followed.dropped, {})
        apply_buckets(gm, followed.buckets)
        return [collective_info(n).in_bytes // (64 * 64 * 4) for n in collectives(gm)]

    def test_a_collective_issued_alone_stays_in_place_and_later_ones_follow_it(self):
        """:meth:`_four` with plan ``[a b c d]``, ``b`` issued alone: ``a`` and the bucket
        ``[c d]`` are moved to their inputs (``ar(a)`` after ``tx``), but never above ``b``:
        the order ``a b [c d]`` is the traced one, whatever the ranks' readiness. Without
        ``alone`` the bucket goes above ``b`` (after ``tw``): ``a [c d] b``."""
        alone = without(GroupPlan(self.g, ((0, 1, 2, 3),)), [1])
        self.assertEqual(alone.buckets, ((2, 3),))
        self.assertEqual(self._order(alone), [1, 1, 2])
        self.assertEqual(self._order(GroupPlan(self.g, ((2, 3),))), [1, 2, 1])


class TestStore(unittest.TestCase):
    """The exchange's pieces on a HashStore."""

    def _shared(self, store) -> "shared_plan._Shared":
        key = shared_plan.plan_key("g", "d" * 64, FcollConfig())
        return shared_plan._Shared("g", 0, key, "d" * 64, 4, store)

    def test_first_stored_plan_stays_for_every_later_compile(self):
        import torch.distributed as dist

        s = self._shared(dist.HashStore())
        first = shared_plan._publish(s, GroupPlan("g", ((0, 1),)))
        again = shared_plan._publish(s, GroupPlan("g", ((0, 1), (2, 3))))
        self.assertEqual(first.buckets, ((0, 1),))
        self.assertEqual(again.buckets, ((0, 1),))
        self.assertIn("stored", again.source)
        self.assertEqual(shared_plan._receive(s, 1, 5.0).buckets, ((0, 1),))

    def test_reports_are_the_union_of_every_ranks_first_report(self):
        import torch.distributed as dist

        s = self._shared(dist.HashStore())._replace(ranks=(0, 1))
        shared_plan._report(s, 0, 1, {2: "rank 1: why"})
        shared_plan._report(s, 0, 0, {})
        shared_plan._report(s, 0, 1, {3: "rank 1: another compile"})   # the first stays
        self.assertEqual(shared_plan._reports(s, 0, 0, 5.0), {2: "rank 1: why"})

    def test_missing_report_times_out_naming_the_ranks(self):
        import torch.distributed as dist

        s = self._shared(dist.HashStore())._replace(ranks=(0, 1, 2))
        shared_plan._report(s, 0, 0, {})
        t0 = time.monotonic()
        with self.assertRaisesRegex(BucketPlanTimeoutError, r"rank 0, group 'g': ranks \[1, 2\] "
                                    "did not report within 0.2 s"):
            shared_plan._reports(s, 0, 0, 0.2)
        self.assertLess(time.monotonic() - t0, 5.0)

    def test_key_names_group_sequence_and_planning_options(self):
        a = shared_plan.plan_key("g", "abc", FcollConfig())
        self.assertEqual(a, "fcoll/bucket_plan/v1/g/abc/cap=25.0/mode=auto/budget=1024.0")
        self.assertNotEqual(a, shared_plan.plan_key("g", "abc", FcollConfig(bucket_cap_mb=4)))

    def test_missing_plan_times_out_naming_rank_group_and_key(self):
        import torch.distributed as dist

        s = self._shared(dist.HashStore())
        t0 = time.monotonic()
        with self.assertRaisesRegex(BucketPlanTimeoutError, "rank 1, group 'g': no bucket plan "
                                    "from rank 0 .* within 0.2 s .*store key "):
            shared_plan._receive(s, 1, 0.2)
        self.assertLess(time.monotonic() - t0, 5.0)

    def test_malformed_plan_raises(self):
        import torch.distributed as dist

        s = self._shared(dist.HashStore())
        s.store.set(s.key, '{"not": "a plan"}')
        with self.assertRaisesRegex(BucketPlanError, "malformed bucket plan"):
            shared_plan._receive(s, 1, 1.0)


class TestFakeProcessGroup(unittest.TestCase):
    def setUp(self) -> None:
        canonical.ensure_fake_pg()

    def test_fake_pg_plans_alone_without_the_store_or_the_rank_check(self):
        import torch.distributed as dist

        g = dist.group.WORLD.group_name
        gm = _traced(0, g)
        want = group_plans(gm, plan_buckets(gm, include_moves=True))[g].buckets
        self.assertEqual(want, ((0, 1), (2, 3)))
        with mock.patch("torch.distributed.distributed_c10d._get_default_store") as store, \
                mock.patch("fcoll.passes.rewrites.consistency.compare_across_ranks") as compare:
            out = BucketCollectives(FcollConfig())(gm).graph_module
        store.assert_not_called()
        compare.assert_not_called()
        origin = out.meta[META_BUCKET_PLAN][g]
        self.assertEqual((origin.source, origin.detail, origin.planner),
                         ("local", "fake process group", None))
        self.assertEqual(origin.buckets, want)

    def test_without_process_group_plans_alone(self):
        import torch.distributed as dist

        gm = _traced(1, dist.group.WORLD.group_name)
        with mock.patch("torch.distributed.is_initialized", return_value=False):
            out = BucketCollectives(FcollConfig())(gm).graph_module
        (origin,) = out.meta[META_BUCKET_PLAN].values()
        self.assertEqual(origin.detail, "no process group is initialised")


if __name__ == "__main__":
    unittest.main()
