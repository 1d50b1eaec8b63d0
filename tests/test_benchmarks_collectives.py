"""benchmarks/collectives.py: the command line, the CUDA report's arithmetic and targets, and the
CUDA benchmark's code path run end to end on CPU tensors (the same ranks, groups, checks and
report; only the device differs). The real ``--device cuda`` run is skipped without a GPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import collectives as bench  # noqa: E402
import collectives_cuda as cc  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


def test_sizes_accept_bytes_and_binary_suffixes():
    args = bench.parse_args(["--sizes", "4096", "4K", "4KiB", "128M", "1G"])
    assert args.sizes == [4096, 4 * KiB, 4 * KiB, 128 * MiB, 1 << 30]
    with pytest.raises(SystemExit):
        bench.parse_args(["--sizes", "lots"])


def test_default_sizes_follow_device_and_quick():
    assert bench.parse_args([]).sizes == bench.SIZES
    cuda = bench.parse_args(["--device", "cuda"])
    assert cuda.sizes == cc.SIZES and cuda.sizes[0] == 4 * KiB and cuda.sizes[-1] == 256 * MiB
    assert cuda.configs == ["ipc", "staged", "gloo"] and cuda.reps == 7
    quick = bench.parse_args(["--device", "cuda", "--quick", "--repeat", "2"])
    assert quick.sizes == cc.QUICK_SIZES and 128 * MiB in quick.sizes and quick.reps == 6
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "tpu"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_run_without_cuda_exits_2():
    assert bench.main(["--device", "cuda", "--ops", "all_reduce", "--sizes", "4K"]) == 2


def test_pct_of_ceiling_counts_every_rank_reading_input_and_writing_output():
    # 2 ranks x 128 MiB in + out = 512 MiB through memory in 1 ms against 1000 GB/s
    assert cc.pct_of_ceiling(128 * MiB, 2, 1000.0, 1000.0) == pytest.approx(
        100 * 4 * 128 * MiB / 1e-3 / 1e12)


def _rank_result(us: dict[str, float], lat: bool) -> dict:
    return {"results": {("all_reduce", s): {c: {"us": t, "k": 1, **({"lat_us": t} if lat else {})}
                                            for c, t in us.items()}
                        for s in (4 * KiB, 128 * MiB)},
            "paths": {"ipc": "ipc", "staged": "staged", "gloo": "gloo"}, "errors": {},
            "ceiling": {"device": 0, "name": "gpu", "copy_gbps": 3000.0, "bytes": 256 * MiB},
            "torch_cuda": "13.0", "device_type": "cuda"}


def test_summary_takes_slowest_rank_and_targets_read_it():
    fast = _rank_result({"ipc": 20.0, "staged": 100.0, "gloo": 10000.0}, lat=True)
    slow = _rank_result({"ipc": 25.0, "staged": 200.0, "gloo": 10000.0}, lat=True)
    table = cc.summarize([fast, slow], ["all_reduce"], [4 * KiB, 128 * MiB], 2,
                         cc.ceiling_gbps([fast, slow]))
    row = table["all_reduce"][4 * KiB]
    assert row["ipc_us"] == 25.0 and row["ipc_vs_gloo"] == pytest.approx(400.0)
    assert row["ipc_busbw_gbps"] == pytest.approx(4 * KiB / 25e-6 / 1e9)  # factor 2(n-1)/n = 1
    verdicts = {name.split(":")[1].strip(): ok for name, _, ok in cc.targets(table)}
    assert verdicts == {"fcoll-ipc busbw >= 100x gloo": True,
                        "fcoll-ipc >= 40 % of ceiling": True,  # 512 MiB / 25 us >> 3000 GB/s
                        "fcoll-ipc time <= 30 us": True,
                        "fcoll-staged busbw >= 3x gloo": True}
    slow["results"][("all_reduce", 4 * KiB)]["ipc"]["us"] = 31.0
    del slow["results"][("all_reduce", 128 * MiB)]["staged"]
    table = cc.summarize([fast, slow], ["all_reduce"], [4 * KiB, 128 * MiB], 2, 3000.0)
    verdicts = {name.split(":")[1].strip(): ok for name, _, ok in cc.targets(table)}
    assert verdicts["fcoll-ipc time <= 30 us"] is False
    assert verdicts["fcoll-staged busbw >= 3x gloo"] is None  # not run: SKIP, not FAIL


def test_cuda_benchmark_code_path_on_cpu_tensors(capsys):
    """The CUDA benchmark's ranks (three groups, result checks, interleaved timing, latency,
    copy ceiling) on CPU tensors: every configuration reports, nothing fails."""
    ops, sizes = ["all_reduce", "all_gather_into_tensor"], [4 * KiB]
    per_rank = cc.run(2, ops, sizes, 2, list(cc.CONFIGS), device_type="cpu",
                      ceiling_bytes=1 * MiB)
    out = cc.report(per_rank, ops, sizes, 2)
    assert out["errors"] == {}
    for op in ops:
        row = out["results"][op][str(4 * KiB)]
        for cfg in cc.CONFIGS:
            assert row[f"{cfg}_us"] > 0 and row[f"{cfg}_lat_us"] > 0
    assert out["ceiling"]["copy_gbps"] > 0
    json.dumps(out)
    text = capsys.readouterr().out
    assert "SKIP: all_reduce 128 MiB" in text and "all_reduce 4 KiB: fcoll-ipc time" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_benchmark_runs_every_configuration(tmp_path):
    path = tmp_path / "cuda.json"
    assert bench.main(["--device", "cuda", "--nproc", "2", "--sizes", "4K", "1M", "--quick",
                       "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert out["errors"] == {}, out["errors"]
    assert out["ceiling"]["copy_gbps"] > 0
    for op in bench.OPS:
        for cfg in cc.CONFIGS:
            assert out["results"][op][str(4 * KiB)][f"{cfg}_us"] > 0, (op, cfg)


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (reaped, or a zombie waiting for its new parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X")


def _wait_gone(pids, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(60)
def test_background_load_is_ended_when_the_block_raises():
    load = bench.BackgroundLoad(2, max_s=60, settle_s=0.0)
    with pytest.raises(KeyboardInterrupt), load:
        pids = [p.pid for p in load.procs]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        raise KeyboardInterrupt  # a Ctrl-C in the middle of the measurement
    assert load.procs == [] and all(_gone(p) for p in pids)


@pytest.mark.timeout(60)
def test_background_load_ends_by_itself_after_max_s():
    load = bench.BackgroundLoad(1, max_s=0.5, settle_s=0.0).__enter__()
    try:
        assert _wait_gone([load.procs[0].pid], 10.0)
    finally:
        load.__exit__()


@pytest.mark.timeout(60)
def test_background_load_ends_when_the_benchmark_is_killed():
    """SIGKILL gives the benchmark no chance to clean up: the busy processes notice that
    their parent is gone and exit by themselves within a fraction of a second."""
    here = os.path.dirname(bench.__file__)
    code = (f"import sys, time; sys.path.insert(0, {here!r}); import collectives as b\n"
            "load = b.BackgroundLoad(2, max_s=60, settle_s=0.0).__enter__()\n"
            "print(' '.join(str(p.pid) for p in load.procs), flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
    assert _wait_gone(pids, 10.0)


def test_background_load_accepts_several_values():
    assert bench.parse_args([]).background_load == [0]
    assert bench.parse_args(["--background-load", "0", "2"]).background_load == [0, 2]
    with pytest.raises(SystemExit):
        bench.parse_args(["--background-load", "-1"])


def _run(load: int, speedups: dict) -> dict:
    return {"background_load": load, "loadavg": {"before": 1.0, "after": 2.0},
            "results": {"all_reduce": {str(size): {"fcoll_us": 10.0, "gloo_us": 10.0 * x,
                                                   "speedup": x}
                                       for size, x in speedups.items()}}}


def test_loaded_targets_need_10x_at_4_to_64_kib_and_1x_elsewhere():
    quiet = _run(0, {4 * KiB: 0.5})  # a quiet run has no targets here
    loaded = _run(2, {4 * KiB: 12.0, 64 * KiB: 9.0, 1 * MiB: 1.5, 128 * MiB: 0.9})
    rows = {name: ok for name, _, ok in bench.loaded_targets([quiet, loaded])}
    assert rows == {"load 2: all_reduce 4 KiB: fcoll >= 10x gloo": True,
                    "load 2: all_reduce 64 KiB: fcoll >= 10x gloo": False,
                    "load 2: all_reduce 1 MiB: fcoll >= 1x gloo": True,
                    "load 2: all_reduce 128 MiB: fcoll >= 1x gloo": False}


@pytest.mark.timeout(300)
def test_quiet_and_loaded_runs_side_by_side(tmp_path, capsys):
    path = tmp_path / "out.json"
    handler = signal.getsignal(signal.SIGTERM)
    assert bench.main(["--ops", "all_reduce", "--sizes", "4K", "--background-load", "0", "1",
                       "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert [r["background_load"] for r in out["runs"]] == [0, 1]
    assert out["results"] == out["runs"][0]["results"]  # top level: the first run
    for run in out["runs"]:
        row = run["results"]["all_reduce"][str(4 * KiB)]
        assert row["fcoll_us"] > 0 and row["gloo_us"] > 0
        assert run["op_loadavg"]["all_reduce"][0] >= 0
    assert [t["name"] for t in out["loaded_targets"]] == [
        "load 1: all_reduce 4 KiB: fcoll >= 10x gloo"]
    text = capsys.readouterr().out
    assert "# comparison" in text and "1-min load" in text
    # main's SIGTERM handler (which ends the background load) does not outlive the call
    assert signal.getsignal(signal.SIGTERM) is handler


@pytest.mark.timeout(60)
def test_background_load_runs_in_the_benchmarks_session_unless_asked_otherwise():
    """Busy processes share the ranks' session (as a job's data-loader workers do): with the
    kernel's autogroup, processes in sessions of their own each get the CPU share of the whole
    benchmark. ``own_session=True`` (``--background-own-session``) gives the old setup."""
    with bench.BackgroundLoad(1, max_s=30, settle_s=0) as load:
        assert os.getsid(load.procs[0].pid) == os.getsid(0)
    with bench.BackgroundLoad(1, max_s=30, settle_s=0, own_session=True) as load:
        assert os.getsid(load.procs[0].pid) == load.procs[0].pid
    assert all(p.poll() is not None for p in load.procs)   # ended on leaving the block


def test_deepspeed_targets_read_medians_and_best_repetitions():
    row = {"deepspeed_us": 30.0, "fcoll_us": 20.0, "deepspeed_over_fcoll": 1.5,
           "best_fcoll_over_deepspeed": 2.5}
    runs = [{"background_load": 0, "results": {"all_reduce": {"4096": row,
                                                               str(16 << 20): dict(row)}}}]
    got = {name: ok for name, _, ok in bench.deepspeed_targets(runs)}
    assert got == {"load 0: all_reduce 4 KiB: fcoll no slower than deepspeed by median": True,
                   "load 0: all_reduce 4 KiB: best fcoll within 2x of deepspeed": False,
                   "load 0: all_reduce 16 MiB: fcoll no slower than deepspeed by median": True}
    assert bench.deepspeed_targets([{"background_load": 0, "results": {
        "all_reduce": {"4096": {"fcoll_us": 1.0}}}}]) == []   # no column, no target


def test_deepspeed_column_is_left_out_cleanly_without_deepspeed(capsys):
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed: see the test below")
    assert bench.main(["--ops", "all_reduce", "--sizes", "4K"]) == 0
    out = capsys.readouterr().out
    assert "deepspeed: not run (deepspeed is not installed)" in out
    assert "deepspeed / fcoll" not in out
    assert bench.main(["--ops", "all_reduce", "--sizes", "4K", "--deepspeed", "on"]) == 2


@pytest.mark.timeout(600)
def test_deepspeed_column_times_its_own_kernel_and_leaves_no_file(tmp_path):
    """With deepspeed installed: the column is DeepSpeed's shared-memory op (never its silent
    fallback to dist.all_reduce), and its /dev/shm files are removed after the run."""
    pytest.importorskip("deepspeed")
    before = {n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_")}
    out = tmp_path / "out.json"
    assert bench.main(["--ops", "all_reduce", "--sizes", "4K", "--deepspeed", "on",
                       "--json", str(out)]) == 0
    row = json.loads(out.read_text())["results"]["all_reduce"]["4096"]
    assert row["deepspeed_us"] > 0 and row["deepspeed_best_us"] > 0
    assert {n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_")} == before
