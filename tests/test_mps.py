"""``fcoll.launch``'s MPS handling (:mod:`fcoll.mps`), with a fake ``nvidia-cuda-mps-control``:
a job whose ranks share a GPU gets a daemon of its own, its ranks reach it, and it stops at
exit whatever happened; without MPS the launcher says why small collectives will be slow."""

from __future__ import annotations

import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from fcoll import launch, mps

FAKE_CONTROL = """\
#!{python}
# A stand-in for nvidia-cuda-mps-control: "-d" opens the control socket in the pipe directory
# and records the pid; "quit" on standard input closes it. Every call is logged.
import os, socket, sys
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
log = open(os.environ["FAKE_MPS_LOG"], "a")
if sys.argv[1:] == ["-d"]:
    if os.environ.get("FAKE_MPS_FAIL"):
        print("cannot start", file=sys.stderr)
        sys.exit(3)
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(pipe, "control"))
    open(os.path.join(pipe, "nvidia-cuda-mps-control.pid"), "w").write(str(os.getpid()))
    log.write("start " + pipe + " " + os.environ["CUDA_MPS_LOG_DIRECTORY"] + "\\n")
else:
    if sys.stdin.read().strip() == "quit":
        os.unlink(os.path.join(pipe, "control"))
        log.write("quit " + pipe + "\\n")
"""


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / mps.CONTROL_BINARY
    control.write_text(FAKE_CONTROL.format(python=sys.executable))
    control.chmod(control.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "mps.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-daemon-here"))
    monkeypatch.setattr(mps, "visible_gpu_count", lambda: 1)   # one GPU, whatever this host has
    return log


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_ranks_sharing_a_gpu_get_a_daemon_of_their_own_stopped_at_exit(tmp_path, fake_mps, capfd):
    script = _script(tmp_path, """
        import os
        print("pipe", os.environ["CUDA_MPS_PIPE_DIRECTORY"], os.environ["CUDA_MPS_LOG_DIRECTORY"])
        """)
    assert launch.main(["--nproc-per-node", "2", script]) == 0
    out, err = capfd.readouterr()
    pipes = {line.split()[3] for line in out.splitlines() if " pipe " in line}
    assert len(pipes) == 1, out   # both ranks reach the one daemon
    pipe = pipes.pop()
    assert pipe != str(tmp_path / "no-daemon-here")
    assert f"started an MPS daemon for this job ({pipe})" in err
    assert fake_mps.read_text().splitlines() == [
        f"start {pipe} {Path(pipe).parent / 'log'}", f"quit {pipe}"]
    assert not Path(pipe).parent.exists()   # its directories are removed
    assert "no rank became a client of the MPS daemon" in err  # these ranks never used CUDA


def test_launch_is_quiet_about_clients_when_a_rank_reached_the_daemon(tmp_path, fake_mps, capfd):
    script = _script(tmp_path, """
        import os
        with open(os.path.join(os.environ["CUDA_MPS_LOG_DIRECTORY"], "server.log"), "a") as f:
            f.write("client\\n")   # what the first CUDA client's server writes
        """)
    assert launch.main(["--nproc-per-node", "2", script]) == 0
    assert "no rank became a client" not in capfd.readouterr().err


def test_the_daemon_stops_when_a_rank_fails(tmp_path, fake_mps, capfd):
    script = _script(tmp_path, "import sys; sys.exit(1)")
    assert launch.main(["--nproc-per-node", "2", script]) == 1
    lines = fake_mps.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["start", "quit"]


def test_a_daemon_that_cannot_start_stops_the_launch_with_its_message(tmp_path, fake_mps,
                                                                       monkeypatch, capfd):
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    script = _script(tmp_path, "print('ran')")
    assert launch.main(["--nproc-per-node", "2", script]) == 2
    out, err = capfd.readouterr()
    assert "ran" not in out
    assert "nvidia-cuda-mps-control -d exited with status 3: cannot start" in err


def test_off_or_no_binary_says_once_why_small_collectives_are_slow(tmp_path, fake_mps,
                                                                   monkeypatch, capfd):
    script = _script(tmp_path, "print('ran')")
    assert launch.main(["--nproc-per-node", "2", "--mps", "off", script]) == 0
    _, err = capfd.readouterr()
    assert err.count("2 ranks share 1 GPU(s) without MPS: the GPU time-slices") == 1
    assert not fake_mps.exists()   # never called
    monkeypatch.setenv("PATH", "/nonexistent")
    plan = mps.plan("auto", 2, 1)
    assert not plan.start and "nvidia-cuda-mps-control is not on PATH" in plan.message
    with pytest.raises(mps.MpsError, match="--mps on: nvidia-cuda-mps-control is not on PATH"):
        mps.plan("on", 2, 1)


def test_a_running_daemon_is_used_and_nothing_is_started(tmp_path, fake_mps, monkeypatch):
    import socket

    pipe = tmp_path / "running"
    pipe.mkdir()
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(pipe / "control"))
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
        plan = mps.plan("on", 2, 1)
    assert not plan.start and plan.message == f"2 ranks share 1 GPU(s): using the MPS daemon " \
                                              f"already running in {pipe}"


@pytest.mark.parametrize("nproc, gpus", [(1, 1), (2, 2), (4, 0)])
def test_no_shared_gpu_no_daemon_and_no_message(nproc, gpus, fake_mps):
    assert mps.plan("on", nproc, gpus) == mps.MpsPlan(False, None)


def test_visible_gpu_count_reads_the_driver_and_cuda_visible_devices(tmp_path):
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (gpus / bus).mkdir()
    assert mps.visible_gpu_count({}, str(gpus)) == 3
    assert mps.visible_gpu_count({"CUDA_VISIBLE_DEVICES": "1"}, str(gpus)) == 1
    assert mps.visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,2,-1,1"}, str(gpus)) == 2
    assert mps.visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}, str(gpus)) == 0
    assert mps.visible_gpu_count({}, str(tmp_path / "no-driver")) == 0


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="--mps: expected auto, on or off, got 'yes'"):
        mps.plan("yes", 2, 1)


def test_server_started_tells_whether_a_client_reached_the_daemon(fake_mps):
    with mps.MpsDaemon() as daemon:
        assert not daemon.server_started()  # no client yet: the fake writes no server.log
        log_dir = daemon.env["CUDA_MPS_LOG_DIRECTORY"]
        with open(os.path.join(log_dir, "server.log"), "w") as f:  # what a first client causes
            f.write("[server] started\n")
        assert daemon.server_started()
    assert not os.path.exists(log_dir) and not daemon.server_started()  # removed at exit
