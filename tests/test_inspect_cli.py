"""End-to-end test of ``python -m fcoll.inspect``: the example training script on 2 ranks.

One CLI run (about 40 s on the 2-core CI machine, most of it compiling the step) is shared by every
check in this file, with a hard timeout that kills every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET

from fcoll.inspect.artifacts import RECORD_FILES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")
# compute by Inductor, as the default "auto" picks for real models: the trace then holds one
# event per compute segment, which fcoll.sim must read (test_sim_reads_the_directory)
TINY = ["--steps", "3", "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
        "--batch-size", "2", "--eval-batches", "1", "--log-every", "1", "--compute", "inductor"]
NPROC = 2
TIMEOUT_S = 400


@unittest.skipUnless(os.path.exists(EXAMPLE), "examples/train_gpt.py is not there")
class TestInspectCLI(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.out = os.path.join(cls.tmp.name, "out")
        env = {k: v for k, v in os.environ.items() if k != "FCOLL_TRACE_DIR"}
        cmd = [sys.executable, "-m", "fcoll.inspect", EXAMPLE, "--out", cls.out,
               "--nproc", str(NPROC), "--timeout-s", str(TIMEOUT_S - 20), "--", *TINY]
        cls.proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=TIMEOUT_S)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def summaries(self):
        out = []
        for r in range(NPROC):
            with open(os.path.join(self.out, f"rank{r}", "summary.json")) as f:
                out.append(json.load(f))
        return out

    def test_cli_exits_zero_and_prints_a_summary(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr[-4000:])
        self.assertIn("measured exposed_us", self.proc.stdout)
        self.assertIn("model +-30%", self.proc.stdout)
        self.assertIn(f"on {NPROC} rank(s)", self.proc.stdout)
        with open(os.path.join(self.out, "summary.txt")) as f:
            self.assertIn(f.read().strip(), self.proc.stdout)

    def test_sim_reads_the_directory(self):
        """README's flow: ``python -m fcoll.sim DIR`` on what the CLI wrote, compute and the
        time outside the graphs measured in its trace (Inductor segments split into nodes)."""
        sim = subprocess.run([sys.executable, "-m", "fcoll.sim", self.out, "--ranks", "2,16",
                              "--compute", "trace", "--outside", "trace"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(sim.returncode, 0, sim.stderr[-4000:])
        self.assertIn("compute: measured in", sim.stdout)
        self.assertIn("outside the graphs:", sim.stdout)

    def test_every_rank_writes_every_promised_file_for_every_graph(self):
        for r, s in enumerate(self.summaries()):
            self.assertEqual(s["errors"], [])
            self.assertGreaterEqual(len(s["graphs"]), 1)
            files = set(os.listdir(os.path.join(self.out, f"rank{r}")))
            for g in s["graphs"]:
                expected = {f.format(name=g["name"]) for f in RECORD_FILES}
                expected |= {f"{g['name']}.compare.txt", f"{g['name']}.compare.json"}
                self.assertLessEqual(expected, files, f"rank {r}, graph {g['name']}")

    def test_passes_show_in_the_files(self):
        s = self.summaries()[0]
        g = s["graphs"][0]
        rank_dir = os.path.join(self.out, "rank0")
        with open(os.path.join(rank_dir, f"{g['name']}.before.txt")) as f:
            before = f.read()
        with open(os.path.join(rank_dir, f"{g['name']}.after.txt")) as f:
            after = f.read()
        self.assertTrue(before.startswith("graph(") and after.startswith("graph("))
        self.assertIn("# all_reduce group=", after)
        # DDP averages one gradient per parameter; bucketing merges only gradients ready within
        # their communication time of each other (on fcoll's backend this example's gradients
        # are further apart, and the scheduler interleaves them with the backward instead)
        self.assertGreaterEqual(g["before"]["n_collectives"], g["after"]["n_collectives"])
        self.assertNotEqual(before, after)
        with open(os.path.join(rank_dir, f"{g['name']}.collectives.json")) as f:
            rows = json.load(f)
        self.assertEqual(len(rows), g["after"]["n_collectives"])

    def test_timelines_parse_and_have_one_rect_per_scheduled_node(self):
        ns = "{http://www.w3.org/2000/svg}"
        g = self.summaries()[0]["graphs"][0]
        path = os.path.join(self.out, "rank0", f"{g['name']}.after.txt")
        with open(path) as f:
            n_scheduled = sum(1 for line in f if line.startswith("  %"))
        root = ET.parse(os.path.join(self.out, "rank0", f"{g['name']}.timeline.svg")).getroot()
        self.assertEqual(len(root.findall(f".//{ns}rect")), n_scheduled)

    def test_traces_have_begin_and_end_for_every_collective_on_every_rank(self):
        for r, s in enumerate(self.summaries()):
            with open(os.path.join(self.out, "traces", f"rank{r}.json")) as f:
                events = json.load(f)["traceEvents"]
            self.assertTrue(all(e["pid"] == r for e in events))
            for g in s["graphs"]:
                with open(os.path.join(self.out, f"rank{r}",
                                       f"{g['name']}.collectives.json")) as f:
                    names = {row["node"] for row in json.load(f)}
                for ph in ("b", "e"):
                    seen = {e["name"] for e in events if e["ph"] == ph and e["cat"] == "comm"}
                    self.assertLessEqual(names, seen, f"rank {r} {ph}")
                self.assertGreater(g["trace_collectives"], 0)
                self.assertGreater(g["measured_exposed_us"], 0.0)
                # on fcoll's group every traced collective has its own time: all are judged
                self.assertEqual(g["model_judged"], g["trace_collectives"], g["name"])
                self.assertLessEqual(g["model_within"], g["model_judged"])


if __name__ == "__main__":
    unittest.main()
