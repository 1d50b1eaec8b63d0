"""``benchmarks/gpu_check.py`` and ``benchmarks/cuda_stress.py`` where there is no GPU.

The device check must run anywhere: without CUDA (or with ``--dry-run``) every stage reports
SKIP, and its argument parsing, JSON and table are exercised. The stress benchmark's job
machinery (fresh processes, exit codes, a SIGKILLed rank, a destroyed group) runs on CPU
tensors, and its judgement of a job is checked on made-up outcomes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import cuda_stress  # noqa: E402
import gpu_check  # noqa: E402


def _run_check(tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"),
                           "--out", str(tmp_path), *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)
    with open(tmp_path / "gpu_check.json") as f:
        return proc, json.load(f)


def _stage_names() -> list[str]:
    return [name for name, _, _ in gpu_check.plan()]


@pytest.mark.parametrize("args,why", [
    (("--dry-run",), "dry run"),
    pytest.param((), "no GPU", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="only where there is no GPU")),
])
def test_every_stage_reports_skip_without_a_gpu(tmp_path, args, why):
    proc, out = _run_check(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr
    names = _stage_names()
    assert [s["name"] for s in out["stages"]] == names
    assert len(names) >= 10 and "tests" in names and "stress" in names
    assert all(s["status"] == "SKIP" and s["detail"] == why for s in out["stages"])
    assert f"0 PASS, 0 FAIL, {len(names)} SKIP" in proc.stdout
    for name in names:
        assert f"SKIP: {name} " in proc.stdout
    assert (tmp_path / "gpu_check_logs.txt").exists()


def test_only_selects_stages_by_prefix_in_its_order(tmp_path):
    proc, out = _run_check(tmp_path, "--dry-run", "--only", "sweep:", "probe:", "tests")
    names = [s["name"] for s in out["stages"]]
    probes = [n for n in names if n.startswith("probe:")]
    assert names == ["sweep:mps", "sweep:triton", *probes, "tests"] and len(probes) > 1


def test_only_whole_stage_name_selects_that_stage_alone():
    plan = [(n, None, 1.0) for n in ("tests", "sweep", "stress", "sweep:mps", "sweep:triton")]
    assert [s[0] for s in gpu_check.ordered(plan, ["sweep", "tests"])] == ["sweep", "tests"]
    assert [s[0] for s in gpu_check.ordered(plan, ["sw"])] == ["sweep", "sweep:mps",
                                                               "sweep:triton"]
    assert gpu_check.ordered(plan, None) == plan


def test_table_counts_statuses():
    text = gpu_check.table([gpu_check.Stage("a", "PASS", 1.0, "x"),
                            gpu_check.Stage("long-name", "FAIL", 2.5, "y" * 500),
                            gpu_check.Stage("c", "SKIP")])
    assert text.splitlines()[-1] == "1 PASS, 1 FAIL, 1 SKIP"
    assert "long-name  FAIL        2.5  " + "y" * 160 in text


def _ranks(*outcomes):
    """Made-up job outcomes: ``(rc, error or None, steps, bad)`` per rank (rc -9: killed)."""
    return [{"rc": rc, "tail": "", "result": None if rc == -9 else
             {"rank": r, "steps": steps, "bad": bad, "error": err}}
            for r, (rc, err, steps, bad) in enumerate(outcomes)]


def test_judge_counts_signals_but_not_the_deliberate_kill():
    sc = {"steps": 5, "kill_rank": 2, "kill_step": 2}
    named = "PeerError: rank 2 died (pid 7)"
    assert cuda_stress.judge("kill", sc, _ranks((0, named, 2, 0), (0, named, 2, 0),
                                                 (-9, None, 0, 0)))["ok"]
    v = cuda_stress.judge("kill", sc, _ranks((-11, named, 2, 0), (0, "PeerError: timed out",
                                                                  2, 0), (-9, None, 0, 0)))
    assert v["signals"] == [0] and v["unnamed"] == [1] and not v["ok"]
    v = cuda_stress.judge("steps", {"steps": 3}, _ranks((0, None, 3, 1), (None, None, 1, 0)))
    assert v["bad"] == 1 and v["hung_at_exit"] == [1] and v["timeouts"] == [] and not v["ok"]
    silent = _ranks((0, None, 3, 0), (0, None, 3, 0))
    silent[1].update(rc=None, result=None)  # killed at the timeout before its result: a hang
    v = cuda_stress.judge("steps", {"steps": 3}, silent)
    assert v["timeouts"] == [1] and v["hung_at_exit"] == [] and not v["ok"]
    sc = {"steps": 2, "extra_rank": 1}
    assert cuda_stress.judge("teardown", sc, _ranks(
        (0, None, 2, 0), (0, "PeerError: rank 0 gave up: destroyed", 2, 0)))["ok"]


def test_stress_jobs_on_cpu_tensors_kill_and_teardown():
    """The job machinery itself: the last rank SIGKILLs itself at step 2 and the survivor
    names it; in the teardown job rank 0 destroys while rank 1 waits, and rank 1 names it."""
    kill = {"steps": 5, "compute": "none", "device": "cpu", "kill_rank": 1, "kill_step": 2}
    ranks = cuda_stress.run_job(kill, 2, timeout_s=100)
    assert ranks[1]["rc"] == -signal.SIGKILL
    v = cuda_stress.judge("kill", kill, ranks)
    assert v["ok"], (v, [r["tail"] for r in ranks])
    assert "rank 1" in ranks[0]["result"]["error"] and ranks[0]["result"]["steps"] == 2
    down = {"steps": 2, "compute": "none", "device": "cpu", "extra_rank": 1}
    ranks = cuda_stress.run_job(down, 2, timeout_s=100)
    v = cuda_stress.judge("teardown", down, ranks)
    assert v["ok"], (v, [r["tail"] for r in ranks])
    assert [r["rc"] for r in ranks] == [0, 0]


def test_stress_skips_cleanly_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("only where there is no GPU")
    assert cuda_stress.main(["--json", str(tmp_path / "s.json")]) == 0
    out = json.loads((tmp_path / "s.json").read_text())
    assert out["ok"] is None and out["skipped"] == "no GPU" and out["jobs"] == []
    assert out["planned"] == len(cuda_stress.plan([2, 3], 1, 8, 1, "inductor")) == 6
