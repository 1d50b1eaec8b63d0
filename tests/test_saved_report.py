"""``fcoll.inspect.saved_report``: what a compiled step saves for its backward (issue #28, item 3).

A SimpleFSDP model (``fcoll.parallel.fully_shard``) compiled with ``backend="fcoll"`` on 2 ranks:
with ``reshard_after_forward=False`` the forward saves gathered parameters for the backward;
with ``True`` the gathers are tagged ``MUST_RECOMPUTE``, nothing gathered is saved, and the
backward re-issues its all_gathers. Single-process tests cover the record on a hand-made cut.
"""

from __future__ import annotations

import unittest

import torch
import torch.fx as fx

import canonical
import fcoll
from fcoll.compile.saved import META_SAVED, record_partition, saved_for_backward
from fcoll.inspect import record_files, saved_report
from fcoll.testing import run_ranks

DIM, HIDDEN, OUT = 16, 32, 8


def _compile_fsdp(rank: int, world_size: int) -> dict:
    """For each ``reshard_after_forward``: the forward's and the backward's saved reports (as
    dicts), the forward's report text and ``.saved.txt`` file, and the gradient error against
    the same model run eagerly."""
    from fcoll.compile.backend import register_compile_listener
    from fcoll.parallel import fully_shard

    out = {}
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
    for reshard in (True, False):
        grads = []
        for compiled in (False, True):
            torch._dynamo.reset()
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(),
                                    torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                                    torch.nn.Linear(HIDDEN, OUT))
            for layer in (m[0], m[2], m[4]):
                fully_shard(layer, reshard_after_forward=reshard)
            fully_shard(m, reshard_after_forward=reshard)
            records = []
            handle = register_compile_listener(records.append)
            f = torch.compile(m, backend="fcoll") if compiled else m
            f(x).square().sum().backward()
            handle.remove()
            grads.append([p.grad.full_tensor() for p in m.parameters()])
        fw = next(r for r in records if r.name.endswith("_forward"))
        bw = next(r for r in records if r.name.endswith("_backward"))
        report = saved_report(fw.after, fw.name)
        out[reshard] = {
            "forward": report.as_dict(), "backward": saved_report(bw.after).as_dict(),
            "text": str(report), "file": record_files(fw)[f"{fw.name}.saved.txt"],
            "error": max((a - b).abs().max().item() for a, b in zip(*grads))}
    return out


class TestSimpleFSDP(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.r0, cls.r1 = run_ranks(_compile_fsdp, 2, backend="fcoll", timeout_s=300)

    def test_gathered_parameters_are_saved_only_without_resharding(self):
        for res in (self.r0, self.r1):
            keep, reshard = res[False]["forward"], res[True]["forward"]
            kept = [v for v in keep["saved"] if v["collective"] == "all_gather"]
            self.assertGreaterEqual(len(kept), 2, keep)
            self.assertGreater(keep["saved_collective_bytes"], 0)
            # [HIDDEN, HIDDEN] and [OUT, HIDDEN] float32 weights, gathered, kept alive
            self.assertEqual(keep["saved_collective_bytes"], (HIDDEN + OUT) * HIDDEN * 4)
            self.assertEqual([v for v in reshard["saved"] if v["collective"]], [])
            self.assertEqual(reshard["saved_collective_bytes"], 0)
            self.assertLess(reshard["saved_bytes"], keep["saved_bytes"])

    def test_all_gathers_are_reissued_in_the_backward_only_with_resharding(self):
        for res in (self.r0, self.r1):
            keep, reshard = res[False]["forward"], res[True]["forward"]
            self.assertEqual(keep["recomputed_collectives"], [])
            # the weights of the 2nd and 3rd linear (the 1st one's input needs no gradient)
            self.assertEqual(len(reshard["recomputed_collectives"]), 2, reshard)
            self.assertTrue(all(n.startswith("all_gather") for n in
                                reshard["recomputed_collectives"]))
            for r in (True, False):          # one record, read from either graph
                self.assertEqual(res[r]["backward"], {**res[r]["forward"], "graph": ""})

    def test_report_text_and_file_show_the_section(self):
        for reshard in (True, False):
            res = self.r0[reshard]
            self.assertEqual(res["file"], res["text"] + "\n")
            self.assertRegex(res["text"], r"^saved for backward by graph_\d+_forward: \d+ values")
            self.assertIn("re-issued from the forward (recomputed, not saved)", res["text"])
        # a gathered weight, saved as its transpose (F.linear's t(weight)), a view of the wait
        self.assertRegex(self.r0[False]["text"],
                         r"\nt_\d+ +aten\.t\.default +\[32, 32\] +float32 +4096 +wait_tensor_\d+ "
                         r"+4\.0 KiB +all_gather\n")

    def test_gradients_equal_eager(self):
        for res in (self.r0, self.r1):
            for reshard in (True, False):
                self.assertLessEqual(res[reshard]["error"], 1e-5)


class _RootWithHead(torch.nn.Module):
    """Two blocks and a head owned by the root itself: ``[4, DIM] -> [4, OUT]``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(DIM, HIDDEN),
                                           torch.nn.Linear(HIDDEN, HIDDEN)])
        self.head = torch.nn.Linear(HIDDEN, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _compile_fsdp_default_reshard(rank: int, world_size: int) -> dict:
    """``reshard_after_forward=None`` (FSDP2's default) on the blocks, then on the root: the
    flags it resolves to, the forward's saved report and the gradient error against eager."""
    from fcoll.compile.backend import register_compile_listener
    from fcoll.parallel import fully_shard

    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
    out, grads = {}, []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = _RootWithHead()
        for block in m.blocks:
            fully_shard(block, reshard_after_forward=None)
        out["block before root"] = type(m.blocks[0])._fcoll_unit_gather.reshard_after_forward
        fully_shard(m, reshard_after_forward=None)
        out["flags"] = [type(u)._fcoll_unit_gather.reshard_after_forward
                        for u in (m.blocks[0], m.blocks[1], m)]
        records = []
        handle = register_compile_listener(records.append)
        (torch.compile(m, backend="fcoll") if compiled else m)(x).square().sum().backward()
        handle.remove()
        grads.append([p.grad.full_tensor() for p in m.parameters()])
    fw = next(r for r in records if r.name.endswith("_forward"))
    out["forward"] = saved_report(fw.after, fw.name).as_dict()
    out["error"] = max((a - b).abs().max().item() for a, b in zip(*grads))
    return out


class TestFSDP2DefaultReshard(unittest.TestCase):
    def test_none_reshards_the_blocks_and_keeps_the_roots_parameters(self):
        """FSDP2's ``reshard_after_forward=None``: True for the blocks (once ``fully_shard``
        is called on the root containing them), False for the root: the forward saves the
        root's gathered head weight and nothing of the blocks, whose all_gathers the backward
        re-issues. Before, None was refused."""
        for res in run_ranks(_compile_fsdp_default_reshard, 2, backend="fcoll", timeout_s=300):
            self.assertFalse(res["block before root"])      # a root until wrapped
            self.assertEqual(res["flags"], [True, True, False])
            saved = res["forward"]
            self.assertEqual(saved["saved_collective_bytes"], OUT * HIDDEN * 4, saved)
            # the 2nd block's weight (the 1st one's input needs no gradient)
            self.assertEqual(len(saved["recomputed_collectives"]), 1, saved)
            self.assertLessEqual(res["error"], 1e-5)

    def test_resharding_to_a_smaller_mesh_is_refused(self):
        from fcoll.parallel import fully_shard

        with self.assertRaisesRegex(ValueError, "bool or None .*smaller mesh.* got 2"):
            fully_shard(torch.nn.Linear(2, 2), reshard_after_forward=2)


class TestRecord(unittest.TestCase):
    """The record on a cut made by hand (fake process group, rank 0 of 2)."""

    def setUp(self) -> None:
        canonical.ensure_fake_pg()
        import torch.distributed as dist

        self.g = dist.group.WORLD.group_name

    def _cut(self) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Forward ``w -> ag -> wait -> t -> mm(x, .)``, saving ``t`` (a view of the gathered
        weight) and ``x`` (an input); backward ``ag`` of ``w`` again plus a reduce_scatter."""
        g = self.g

        def fw(x, w):
            wt = fcoll.all_gather_tensor(w, 0, g).t()
            return x @ wt, wt, x

        def bw(x, w, grad):
            full = fcoll.all_gather_tensor(w, 0, g)
            return fcoll.wait_tensor(fcoll.reduce_scatter_tensor(grad @ full, "sum", 0, g))

        f = canonical.trace(fw, [(4, 8), (4, 8)])
        b = canonical.trace(bw, [(4, 8), (4, 8), (4, 8)])
        return f, b

    def test_saved_values_their_bases_and_recomputed_collectives(self):
        f, b = self._cut()
        rec = saved_for_backward(f, b, 1)
        (t, x) = rec.saved
        self.assertEqual((t.shape, t.dtype, t.bytes), ((8, 8), "torch.float32", 256))
        self.assertEqual((t.collective, t.is_input, t.base_bytes), ("all_gather", False, 256))
        self.assertNotEqual(t.base, t.name)
        self.assertEqual((x.op, x.collective, x.is_input), ("placeholder", None, True))
        self.assertEqual((rec.saved_bytes, rec.saved_collective_bytes), (256, 256))
        gathers = [n.name for n in f.graph.nodes if n.name.startswith("all_gather")]
        self.assertEqual(rec.recomputed_collectives, tuple(gathers))
        self.assertEqual(rec.backward_collectives, 2)

    def test_record_survives_a_deep_copy_and_reads_from_meta(self):
        import copy

        f, b = self._cut()
        record_partition(f, b, 1)
        self.assertIs(f.meta[META_SAVED], b.meta[META_SAVED])
        self.assertEqual(saved_report(copy.deepcopy(f)).record, f.meta[META_SAVED])
        self.assertIsNone(saved_report(canonical.mm_overlap(size=8)))

    def test_tlparse_gets_the_saved_artifact_for_a_partitioned_graph_only(self):
        import logging
        from types import SimpleNamespace

        from torch._logging._internal import trace_log

        from fcoll.inspect import emit_artifacts

        f, b = self._cut()
        record_partition(f, b, 1)
        captured = []

        class Capture(logging.Handler):
            def emit(self, rec):
                captured.append((rec.metadata["artifact"]["name"], rec.payload))

        old_handlers, old_level = list(trace_log.handlers), trace_log.level
        trace_log.handlers[:] = [Capture(level=logging.DEBUG)]
        trace_log.setLevel(logging.DEBUG)
        try:
            for name, gm in (("fw", f), ("plain", canonical.mm_overlap(size=8))):
                emit_artifacts(SimpleNamespace(name=name, before=None, after=gm),
                               predict=lambda gm: None)
        finally:
            trace_log.handlers[:] = old_handlers
            trace_log.setLevel(old_level)
        saved = [(n, p) for n, p in captured if n.endswith("_saved")]
        self.assertEqual([n for n, _ in saved], ["fcoll_fw_saved"])
        self.assertIn("1 re-issued from the forward", saved[0][1])

    def test_more_user_outputs_than_outputs_raises(self):
        f, b = self._cut()
        with self.assertRaisesRegex(ValueError, "num_fwd_outputs=4 but the forward graph has "
                                                "3 outputs"):
            saved_for_backward(f, b, 4)

    def test_a_graph_without_partition_gets_the_no_partition_file(self):
        from types import SimpleNamespace

        from fcoll.inspect.artifacts import NO_PARTITION

        rec = SimpleNamespace(name="g", before=None, after=canonical.mm_overlap(size=8))
        files = record_files(rec)
        self.assertEqual(files["g.saved.txt"], NO_PARTITION + "\n")
        self.assertIn('"saved": null', files["g.saved.json"])


if __name__ == "__main__":
    unittest.main()
