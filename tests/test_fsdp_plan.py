"""FSDP-aware bucket plans (``fcoll.passes.rewrites.fsdp_plan``): single-process graph tests on PyTorch's
fake process group (rank 0 of 2), graphs made with ``make_fx`` as SimpleFSDP's are: every
parameter gathered where its block reads it, the gathers tagged with the block's module stack
(``SimpleFSDP<Name>``, as Dynamo records it for ``fcoll.parallel.fully_shard``'s units)."""

from __future__ import annotations

import unittest

import torch
import torch.fx as fx

import canonical
import fcoll
from fcoll.passes.rewrites.bucketing import META_BUCKET, BucketCollectives
from fcoll.passes.config import FcollConfig
from fcoll.passes.rewrites.fsdp_plan import META_NOT_BEFORE, META_WAIT_BY, block_of, plan_fsdp
from fcoll.passes.graph import collective_kind, collectives, is_collective, is_wait, waits_of
from fcoll.passes.analysis.memory import peak_bytes
from fcoll.passes.registry import run_pipeline

BLOCKS, HIDDEN, BATCH = 4, 256, 64


def setUpModule() -> None:
    canonical.ensure_fake_pg()


def _tag_blocks(gm: fx.GraphModule, per_block: int) -> fx.GraphModule:
    """Give the ``i``-th all_gather the module stack of block ``i // per_block`` (in graph
    order, forward or backward)."""
    gathers = [n for n in collectives(gm) if collective_kind(n) == "all_gather"]
    for i, g in enumerate(gathers):
        b = i // per_block
        g.meta["nn_module_stack"] = {f"blocks.{b}": (f"blocks.{b}", "SimpleFSDPBlock")}
    return gm


def _forward(blocks: int = BLOCKS, param_dtype: torch.dtype | None = None) -> fx.GraphModule:
    """``blocks`` blocks of two linear layers, each weight gathered at its use:
    ``ag(w1) -> wait -> mm -> relu -> ag(w2) -> wait -> mm`` per block; ``param_dtype``: each
    shard cast to it before its gather and the gathered weight back to float32 (mixed
    precision)."""
    name = "0"

    def gather(shard):
        if param_dtype is None:
            return fcoll.all_gather_tensor(shard, 0, name)
        return fcoll.all_gather_tensor(shard.to(param_dtype), 0, name).float()

    def step(x, *shards):
        for i in range(0, len(shards), 2):
            w1 = gather(shards[i])
            x = torch.relu(torch.mm(x, w1.t()))
            w2 = gather(shards[i + 1])
            x = torch.mm(x, w2.t())
        return x

    shard = (HIDDEN // 2, HIDDEN)
    return _tag_blocks(canonical.trace(step, [(BATCH, HIDDEN)] + [shard] * (2 * blocks)), 2)


def _backward(blocks: int = BLOCKS, weight_read_by_collective: bool = False) -> fx.GraphModule:
    """The backward of :func:`_forward` with resharding: per block (last first) both weights
    gathered again, the input gradient computed, each weight gradient reduce_scattered;
    ``weight_read_by_collective``: each block's second gathered weight is first read by a
    reduce_scatter of its own."""
    name = "0"

    def step(grad, *saved):
        outs = []
        for i in range(len(saved) - 4, -1, -4):
            x1, x2, s1, s2 = saved[i:i + 4]
            w2 = fcoll.all_gather_tensor(s2, 0, name)
            if weight_read_by_collective:
                outs.append(fcoll.reduce_scatter_tensor(w2, "sum", 0, name))  # first use
            outs.append(fcoll.reduce_scatter_tensor(torch.mm(grad.t(), x2), "sum", 0, name))
            grad = torch.relu(torch.mm(grad, w2))
            w1 = fcoll.all_gather_tensor(s1, 0, name)
            outs.append(fcoll.reduce_scatter_tensor(torch.mm(grad.t(), x1), "sum", 0, name))
            grad = torch.mm(grad, w1)
        return [fcoll.wait_tensor(o) for o in outs] + [grad]

    shard = (HIDDEN // 2, HIDDEN)
    act = (BATCH, HIDDEN)
    return _tag_blocks(canonical.trace(step, [act] + [act, act, shard, shard] * blocks), 2)


def _gradient_waits_at_end(gm: fx.GraphModule) -> fx.GraphModule:
    """Move every reduce_scatter's wait just before its first user (the end of the graph),
    where AOTAutograd's backward has the waits of gradients that only leave the graph (the
    trace puts each right after its collective)."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for rs in [n for n in collectives(gm) if collective_kind(n) == "reduce_scatter"]:
        for w in waits_of(rs):
            min(w.users, key=pos.__getitem__).prepend(w)
    gm.graph.lint()
    gm.recompile()
    return gm


def _lowered(gm: fx.GraphModule) -> fx.GraphModule:
    return run_pipeline(gm, FcollConfig(), ("lower_c10d_functional",))


def _block_of_bucket(node: fx.Node, by_name: dict[str, fx.Node]) -> set[str | None]:
    return {block_of(by_name[m]) for m in node.meta.get(META_BUCKET, [node.name])}


class TestFsdpPlan(unittest.TestCase):
    def test_blocks_read_from_module_stacks_in_order_of_first_use(self):
        plan = plan_fsdp(_lowered(_forward()).graph)
        self.assertEqual(plan.blocks, [f"blocks.{i}" for i in range(BLOCKS)])

    def test_no_plan_without_fully_shard_units(self):
        """A hand-written FSDP step (no module stack): the lane plan, as before."""
        self.assertIsNone(plan_fsdp(canonical.fsdp_forward().graph))

    def test_all_gathers_per_block_issued_one_block_ahead_and_peak_below_all_at_once(self):
        """``ag(w1) ag(w2)`` of block k become one bucket, issued after block k-1's first
        use (never all blocks at the start), waited before block k's first use; after the whole
        pipeline (the scheduler keeps the prefetch bound). Peak memory: the unbucketed graph's
        plus at most three blocks' gathered weights (the block in use, its copy-out buffer, the
        next block in flight), and below the plan without blocks (every weight at the start)."""
        before = _lowered(_forward())
        unbucketed_peak = peak_bytes(before.graph.nodes)
        originals = {n.name: n for n in before.graph.nodes}
        blocks = {n.name: block_of(n) for n in originals.values() if block_of(n) is not None}
        gm = run_pipeline(_forward(), FcollConfig(),
                          ("lower_c10d_functional", "bucket_collectives", "reorder_for_overlap"))
        nodes = list(gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        gathers = [n for n in collectives(gm) if collective_kind(n) == "all_gather"]
        self.assertEqual(len(gathers), BLOCKS)
        first_use = [min(pos[u] for w in waits_of(g) for u in w.users) for g in gathers]
        for k, g in enumerate(gathers):
            self.assertEqual({blocks[m] for m in g.meta[META_BUCKET]}, {f"blocks.{k}"})
            self.assertLess(pos[g], first_use[k], f"{g.name} issued after its first use")
            if k > 0:
                anchor = {n.name: n for n in nodes}[g.meta[META_NOT_BEFORE]]
                self.assertGreater(pos[g], pos[anchor])
                self.assertGreater(pos[g], first_use[k - 2] if k > 1 else -1,
                                   f"{g.name} issued more than one block ahead")
        block_bytes = 2 * HIDDEN * HIDDEN * 4
        peak = peak_bytes(gm.graph.nodes)
        self.assertLessEqual(peak, unbucketed_peak + 3 * block_bytes)
        untagged = _forward()
        for n in untagged.graph.nodes:
            n.meta.pop("nn_module_stack", None)
        all_at_once = run_pipeline(untagged, FcollConfig(),
                                   ("lower_c10d_functional", "bucket_collectives"))
        self.assertLess(peak, peak_bytes(all_at_once.graph.nodes))

    def test_reduce_scatters_per_block_waited_before_the_next_block(self):
        """Backward: each block's two gradient reduce_scatters are one bucket, issued once both
        are ready, waited (META_WAIT_BY) before the block after next starts; the regathers are
        per block like the forward's."""
        gm = BucketCollectives(FcollConfig())(_lowered(_backward())).graph_module
        kinds = [(collective_kind(n), len(n.meta.get(META_BUCKET, [1]))) for n in collectives(gm)]
        self.assertEqual(kinds.count(("all_gather", 2)), BLOCKS)
        self.assertEqual(kinds.count(("reduce_scatter", 2)), BLOCKS)
        waited_by = [n for n in gm.graph.nodes if META_WAIT_BY in n.meta]
        # waited before the block after next starts; the last two blocks': at the end. A
        # block's gradients are one coalesced reduce_scatter (bucket_mode "auto"): a wait each.
        self.assertEqual(len(waited_by), 2 * (BLOCKS - 2))
        self.assertEqual(len({n.meta[META_WAIT_BY] for n in waited_by}), BLOCKS - 2)

    def test_gradient_buckets_stay_waited_before_the_block_after_next_through_the_scheduler(self):
        """The whole pipeline on the backward: each block's gradient bucket
        ``rs(g2, g1) -> ... -> wait`` keeps its wait before the first use of the block after
        next's weights (``META_WAIT_BY`` names a node that survives bucketing, and
        ``reorder_for_overlap`` keeps the bound), so at most two buckets are in flight: peak
        memory within the unbucketed graph's plus three blocks' gradients (each bucket's
        concatenated input and its output, two buckets), where waiting every bucket at the end
        holds all of them."""
        before = _gradient_waits_at_end(_lowered(_backward()))
        unbucketed_peak = peak_bytes(before.graph.nodes)
        gm = run_pipeline(_gradient_waits_at_end(_lowered(_backward())), FcollConfig(),
                          ("bucket_collectives", "reorder_for_overlap"))
        nodes = list(gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        by_name = {n.name: n for n in nodes}
        scatters = [n for n in collectives(gm) if collective_kind(n) == "reduce_scatter"]
        self.assertEqual(len(scatters), BLOCKS)
        bounded = 0
        for rs in scatters:   # coalesced (the default "auto" mode for FSDP): a wait per output
            dues = {w.meta.get(META_WAIT_BY) for w in waits_of(rs)}
            self.assertEqual(len(dues), 1, rs.name)
            (due,) = dues
            if due is None:
                continue
            bounded += 1
            self.assertIn(due, by_name, f"{rs.name}'s bound {due} is not in the graph")
            for w in waits_of(rs):
                self.assertLess(pos[w], pos[by_name[due]])
            self.assertEqual(by_name[due].op, "call_function")
        self.assertEqual(bounded, BLOCKS - 2)
        grad_bytes = 2 * HIDDEN * HIDDEN * 4    # one block's two full-size weight gradients
        self.assertLessEqual(peak_bytes(gm.graph.nodes), unbucketed_peak + 3 * grad_bytes)


    def test_a_bound_never_names_a_collective_that_bucketing_replaces(self):
        """A block whose gathered weight is first read by a collective (its first use, the
        bound of the gradient bucket two blocks earlier, and of the next block's prefetch):
        each bound names the nearest compute node, which bucketing keeps (before, the
        collective itself: merged into a bucket, its name was gone and the bound dropped with
        a warning, 'fcoll_wait_by names reduce_scatter_tensor_24, which is not in the graph',
        seen on FSDP + TP with sequence parallel, activation checkpointing and bfloat16
        parameters)."""
        from fcoll.passes.rewrites.ordering import dependencies

        gm = _lowered(_backward(weight_read_by_collective=True))
        self.assertTrue(plan_fsdp(gm.graph).wait_by)
        bucketed = BucketCollectives(FcollConfig())(gm).graph_module
        by_name = {n.name: n for n in bucketed.graph.nodes}
        bounds = [n.meta[k] for n in bucketed.graph.nodes for k in (META_WAIT_BY, META_NOT_BEFORE)
                  if k in n.meta]
        self.assertTrue(bounds)
        for name in bounds:
            self.assertIn(name, by_name)
            self.assertFalse(is_collective(by_name[name]) or is_wait(by_name[name]), name)
        with self.assertNoLogs("fcoll.passes.rewrites.ordering", "WARNING"):
            dependencies(bucketed.graph)

    def test_mixed_precision_casts_run_just_before_their_gathers_after_the_passes(self):
        """Mixed precision casts each shard before its gather. Bucketing hoists those casts to
        the start (every rank issues the prefetch where the plan says); after the scheduler,
        each cast runs just before its block's gather again, so no bf16 copy of a later
        block's shards is live from the start (before, all of them were computed first): the
        modelled peak is one shard copy lower than the hoisted order's."""
        passes = ("lower_c10d_functional", "bucket_collectives")
        gm = run_pipeline(_forward(param_dtype=torch.bfloat16), FcollConfig(),
                          passes + ("reorder_for_overlap",))
        nodes = list(gm.graph.nodes)
        casts = [n for n in nodes if n.target in (torch.ops.prims.convert_element_type.default,
                                                  torch.ops.aten._to_copy.default)
                 and n.args[0].op == "placeholder"]
        self.assertEqual(len(casts), 2 * BLOCKS)
        for cast in casts:   # the next node that is not another cast is its gather
            later = nodes[nodes.index(cast) + 1:]
            follower = next(n for n in later if n not in casts)
            self.assertIn(follower, cast.users, cast.name)
        hoisted = run_pipeline(_forward(param_dtype=torch.bfloat16), FcollConfig(), passes)
        copy = (HIDDEN // 2) * HIDDEN * 2   # one bf16 shard
        self.assertLessEqual(peak_bytes(gm.graph.nodes), peak_bytes(hoisted.graph.nodes) - copy)

    def test_a_bound_naming_a_missing_node_is_dropped_with_a_warning(self):
        """A wait whose ``META_WAIT_BY`` names a node no longer in the graph loses that bound;
        the scheduler says so at WARNING instead of dropping it without a word."""
        from fcoll.passes.rewrites.ordering import dependencies

        gm = _lowered(_backward())
        wait = next(w for rs in collectives(gm) for w in waits_of(rs))
        wait.meta[META_WAIT_BY] = "no_such_node"
        with self.assertLogs("fcoll.passes.rewrites.ordering", "WARNING") as logs:
            dependencies(gm.graph)
        self.assertIn("'no_such_node', which is not in the graph", logs.output[0])
        self.assertIn(wait.name, logs.output[0])

if __name__ == "__main__":
    unittest.main()
