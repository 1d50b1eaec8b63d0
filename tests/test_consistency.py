"""Tests of ``check_rank_consistency`` (fcoll/passes/rewrites/consistency.py).

One ``run_ranks`` call (fcoll backend; the check only uses the default store, the same FileStore
under gloo) covers agreement, mismatches, a rank that never compiles, and
a group of one rank; single-process tests cover the fingerprint and the no-op cases. The check's
cost per compile is printed by ``benchmarks/passes_scaling.py --rank-costs``.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import unittest
import zlib
from unittest import mock

import torch
import torch.fx as fx

import canonical  # noqa: E402
from graphs_bucketing import Builder  # noqa: E402
from fcoll.passes.rewrites import consistency  # noqa: E402
from fcoll.passes.analysis.fingerprints import Fingerprint, fingerprint  # noqa: E402
from fcoll.passes.rewrites.consistency import (  # noqa: E402
    CheckRankConsistency, RankMismatchError, RankTimeoutError,
)
from fcoll.passes.config import FcollConfig  # noqa: E402
from fcoll.testing import run_ranks  # noqa: E402

fc = torch.ops.fcoll


def _graph(group: str, dtypes=(torch.float32,) * 3, n_extra: int = 0, a2a_rows: int = 4
           ) -> fx.GraphModule:
    """``ar(x_i) -> wait`` per dtype, then ``n_extra`` all_reduces, then an all_to_all of
    ``a2a_rows`` rows (the first dim of all_to_all is rank-dependent and not compared)."""
    b = Builder()
    outs = [b.wait(b(fc.all_reduce.default, b.input(f"x{i}", [4, 2], d), "sum", group))
            for i, d in enumerate(dtypes)]
    outs += [b.wait(b(fc.all_reduce.default, b.input(f"e{i}", [8], torch.float32), "max",
                      group)) for i in range(n_extra)]
    x = b.input("t", [a2a_rows, 3])
    outs.append(b.wait(b(fc.all_to_all_single.default, x, [a2a_rows // 2] * 2,
                         [a2a_rows // 2] * 2, group)))
    return b.module(outs)


class TestFingerprint(unittest.TestCase):
    def setUp(self) -> None:
        canonical.ensure_fake_pg()

    def test_fingerprint_lists_op_dtype_shape_reduce_op_in_order(self):
        fp = fingerprint(_graph("0", (torch.float32, torch.float64)))["0"]
        self.assertEqual(fp.entries, (
            "all_reduce(float32[4,2], reduce_op=sum)",
            "all_reduce(float64[4,2], reduce_op=sum)",
            "all_to_all_single(float32[*,3])",
        ))
        self.assertEqual(len(fp.digest), 64)

    def test_all_to_all_rows_do_not_change_the_fingerprint(self):
        self.assertEqual(fingerprint(_graph("0", a2a_rows=4))["0"].digest,
                         fingerprint(_graph("0", a2a_rows=6))["0"].digest)

    def test_dtype_change_changes_the_digest(self):
        self.assertNotEqual(fingerprint(_graph("0"))["0"].digest,
                            fingerprint(_graph("0", (torch.float32, torch.int32,
                                                     torch.float32)))["0"].digest)

    def test_noop_on_fake_process_group(self):
        with mock.patch("fcoll.passes.rewrites.consistency.compare_across_ranks") as compare:
            result = CheckRankConsistency()(_graph("0"))
        self.assertFalse(result.modified)
        compare.assert_not_called()

    def test_noop_without_process_group(self):
        with mock.patch("torch.distributed.is_initialized", return_value=False), \
                mock.patch("fcoll.passes.rewrites.consistency.compare_across_ranks") as compare:
            CheckRankConsistency()(_graph("0"))
        compare.assert_not_called()


def _fp(group: str, text: str) -> Fingerprint:
    entries = (text,)
    return Fingerprint(group, entries, hashlib.sha256(text.encode()).hexdigest())


class _PeerActsBetweenLooks:
    """A store (``HashStore``) in which rank 1 runs some steps at one chosen moment: right after
    rank 0 looked for ``trigger`` and did not find it (a rank 0 preempted between two looks at
    the store, as on a loaded machine)."""

    def __init__(self, trigger: str, peer_steps: list[tuple]) -> None:
        import torch.distributed as dist

        self.store = dist.HashStore()
        self.trigger, self.peer_steps = trigger, peer_steps

    def check(self, keys: list[str]) -> bool:
        found = self.store.check(keys)
        if keys == [self.trigger] and not found and self.peer_steps:
            for key, value in self.peer_steps:
                self.store.set(key, value)
            self.peer_steps = []
        return found

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        return self.store.get(key)


def _publish(w: consistency._Wait, rank: int, entries: tuple[str, ...]) -> list[tuple]:
    """What ``compare_across_ranks`` writes when ``rank`` starts checking ``w``."""
    return [(consistency._seq_key(w), zlib.compress(json.dumps(entries).encode())),
            (consistency._has_key(w, rank), "1"), (consistency._waiting_key(rank), w.text())]


class TestDeadlockDetection(unittest.TestCase):
    """Rank 0 of 2 (fake process group) checks sequence A on the world group; rank 1 is played
    by the store."""

    def setUp(self) -> None:
        canonical.ensure_fake_pg()
        import torch.distributed as dist

        self.pg = dist.group.WORLD
        self.g = self.pg.group_name
        self.a, self.b = _fp(self.g, "all_reduce(A)"), _fp(self.g, "all_reduce(B)")
        self.wa = consistency._Wait(self.g, self.a.digest, "peer-a")
        self.wb = consistency._Wait(self.g, self.b.digest, "peer-b")

    def test_peer_that_publishes_and_moves_on_between_two_looks_is_no_mismatch(self):
        """Rank 0 finds no ``has`` of rank 1 for A; before rank 0 reads ``waiting/1``, rank 1
        publishes A, passes (rank 0's ``has`` is there), leaves and starts checking B. Rank 0
        then reads "rank 1 waits for B", which rank 0 has not published: a deadlock only if rank 1
        never published A. It did, so the check passes. Before the fix it raised
        ``RankMismatchError`` (on the 2-rank gloo test under load: "compiled collectives on a
        different group", the two groups of one graph checked back to back)."""
        steps = (_publish(self.wa, 1, self.a.entries) + [(consistency._waiting_key(1), "")]
                 + _publish(self.wb, 1, self.b.entries))
        store = _PeerActsBetweenLooks(consistency._has_key(self.wa, 1), steps)
        digest = consistency.compare_across_ranks(self.a, self.pg, 5.0, store=store)
        self.assertEqual(digest, self.a.digest)
        self.assertEqual(store.peer_steps, [])        # rank 1 did act between the looks

    def test_peer_waiting_for_another_sequence_without_publishing_this_one_is_a_mismatch(self):
        """The same looks, but rank 1 goes straight to B without ever publishing A: a real
        divergence, raised at once (not at the timeout)."""
        store = _PeerActsBetweenLooks(consistency._has_key(self.wa, 1),
                                      _publish(self.wb, 1, self.b.entries))
        t0 = time.monotonic()
        with self.assertRaisesRegex(RankMismatchError, re.escape(
                "collective #0: rank 0: all_reduce(A); rank 1: all_reduce(B)")):
            consistency.compare_across_ranks(self.a, self.pg, 30.0, store=store)
        self.assertLess(time.monotonic() - t0, 10.0)


def _check(gm: fx.GraphModule, timeout_s: float = 20.0) -> None:
    CheckRankConsistency(FcollConfig(check_timeout_s=timeout_s))(gm)


def _error(fn) -> str:
    try:
        fn()
    except (RankMismatchError, RankTimeoutError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _on_ranks(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    g = dist.group.WORLD.group_name
    out: dict = {}
    # 1. the same graph on both ranks agrees, compile after compile (50 collectives)
    same = _graph(g, n_extra=47)
    out["same"] = [_error(lambda: _check(same)) for _ in range(3)]
    # 2. rank 1 all_reduces float64 where rank 0 has float32 (collective #1)
    dtypes = (torch.float32, torch.float64 if rank else torch.float32, torch.float32)
    out["dtype"] = _error(lambda: _check(_graph(g, dtypes)))
    # 3. rank 1 has one collective more
    out["extra"] = _error(lambda: _check(_graph(g, n_extra=rank)))
    # 4. a group of one rank: a no-op (every rank creates every group)
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    out["solo"] = _error(lambda: _check(_graph(solo.group_name)))
    # 5. rank 1 never compiles: rank 0 errors at the timeout, naming rank 1
    store = c10d._get_default_store()
    if rank == 0:
        t0 = time.perf_counter()
        out["missing"] = _error(lambda: _check(_graph(g), timeout_s=1.0))
        out["missing_s"] = time.perf_counter() - t0
        store.set("test/done", "1")
    else:
        store.wait(["test/done"])
    return out


def _same_shape(group: str, calls: int) -> fx.GraphModule:
    """``calls`` all_reduces of one shape ([8] float32, sum), each waited."""
    b = Builder()
    x = b.input("x", [8], torch.float32)
    return b.module([b.wait(b(fc.all_reduce.default, x, "sum", group)) for _ in range(calls)])


def _by_content(rank: int, world_size: int) -> dict:
    """Ranks meet on the content of the sequence, not on a count of compiles."""
    import torch.distributed as dist

    import fcoll

    g = dist.group.WORLD.group_name
    out: dict = {}
    # 1. rank 1 recompiles a graph (twice) that rank 0 compiled once: no divergence, no wait
    #    (counting compiles, rank 1 would wait for rank 0's second compile until the timeout)
    first = _graph(g, n_extra=2)
    out["recompile"] = [_error(lambda: _check(first, timeout_s=5.0))]
    if rank == 1:
        out["recompile"] += [_error(lambda: _check(first, timeout_s=5.0)) for _ in range(2)]
    # ... and afterwards both ranks still agree on the next graph
    out["next"] = _error(lambda: _check(_graph(g, n_extra=3), timeout_s=5.0))
    # 2. rank 1 skips one call of a same-shape all_reduce: a mismatch on both ranks (not a
    #    timeout: check_timeout_s is longer than run_ranks' hard limit)
    out["skipped"] = _error(lambda: _check(_same_shape(g, 3 - rank), timeout_s=600.0))
    # 3. the same collectives on two different groups of the same ranks
    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    out["groups"] = _error(lambda: _check(_same_shape(groups[rank].group_name, 1),
                                          timeout_s=600.0))
    out["group_names"] = [grp.group_name for grp in groups]
    # 4. the ranks agree again after those errors
    out["after"] = _error(lambda: _check(_same_shape(g, 5), timeout_s=5.0))
    # 5. end to end (the scheduler off; with it, see _recompile_end_to_end): rank 1 recompiles
    #    a step (Dynamo's caches reset) that rank 0 compiled once
    out["e2e"] = _recompile_on_rank_1(rank, {"check_timeout_s": 5.0, "overlap": False})
    return out


def _recompile_on_rank_1(rank: int, options: dict) -> list:
    import torch.distributed as dist

    import fcoll

    step = torch.compile(lambda x: fcoll.all_reduce(x, "sum", dist.group.WORLD) * 2,
                         backend="fcoll", options=options)
    x = torch.ones(4) * (rank + 1)
    results = [step(x)]
    if rank == 1:
        torch._dynamo.reset()
    results.append(step(x))  # rank 1 compiles again; its check passes without rank 0
    return [r.tolist() for r in results]


def _recompile_end_to_end(rank: int, world_size: int) -> list:
    return _recompile_on_rank_1(rank, {"check_timeout_s": 5.0})


class TestByContent(unittest.TestCase):
    def test_recompile_is_no_divergence_skipped_call_and_other_group_raise_on_every_rank(self):
        r0, r1 = run_ranks(_by_content, 2, backend="fcoll", timeout_s=150)
        self.assertEqual(r0["recompile"], ["no error"])
        self.assertEqual(r1["recompile"], ["no error"] * 3)
        for r in (r0, r1):
            self.assertEqual(r["next"], "no error")
            self.assertIn("RankMismatchError", r["skipped"])
            self.assertIn("ranks [1]", r["skipped"])
            self.assertIn("collective #2: rank 0: all_reduce(float32[8], reduce_op=sum); "
                          "rank 1: <none: rank 1 has only 2 collectives>", r["skipped"])
            self.assertIn("RankMismatchError", r["groups"])
            a, b = r["group_names"]
            self.assertIn(f"rank 0: group {a!r}; rank 1: group {b!r}", r["groups"])
            self.assertEqual(r["after"], "no error")
            self.assertEqual(r["e2e"], [[6.0] * 4, [6.0] * 4])
        self.assertEqual(r0["skipped"].replace("rank 0, ", "rank 1, ", 1), r1["skipped"])

    def test_recompile_on_one_rank_with_the_default_passes(self):
        """A compile on one rank alone (this recompile) must not communicate: ``calibrate_group``
        communicates only at a group's first calibration (917babd broadcast once per compile,
        and this recompile's broadcast paired with rank 0's next collective)."""
        for r in run_ranks(_recompile_end_to_end, 2, backend="fcoll", timeout_s=120):
            self.assertEqual(r, [[6.0] * 4, [6.0] * 4])


class TestAcrossRanks(unittest.TestCase):
    def _run(self, backend: str) -> list[dict]:
        r0, r1 = run_ranks(_on_ranks, 2, backend=backend, timeout_s=90)
        for r in (r0, r1):
            self.assertEqual(r["same"], ["no error"] * 3)
            self.assertEqual(r["solo"], "no error")
        for r in (r0, r1):                   # both ranks raise the same named difference
            self.assertIn("RankMismatchError", r["dtype"])
            self.assertIn("ranks [1]", r["dtype"])
            self.assertIn("collective #1: rank 0: all_reduce(float32[4,2], reduce_op=sum); "
                          "rank 1: all_reduce(float64[4,2], reduce_op=sum)", r["dtype"])
            self.assertIn("collective #3: rank 0: all_to_all_single(float32[*,3]); "
                          "rank 1: all_reduce(float32[8], reduce_op=max)", r["extra"])
        self.assertEqual(r0["dtype"].replace("rank 0, ", "rank 1, ", 1), r1["dtype"])
        self.assertIn("RankTimeoutError", r0["missing"])
        self.assertIn("ranks [1] did not compile", r0["missing"])
        self.assertLess(r0["missing_s"], 1.0 + 29.0)  # the 1 s timeout, not a hang; load delays
        return [r0, r1]

    def test_mismatch_raises_on_every_rank_and_missing_rank_times_out_fcoll(self):
        self._run("fcoll")


if __name__ == "__main__":
    unittest.main()
