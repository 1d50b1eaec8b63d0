"""NVIDIA's Multi-Process Service (MPS) for a job whose ranks share a GPU (used by
``python -m fcoll.launch``).

Processes that share a GPU without MPS are time-sliced: the GPU runs one process's context at a
time, and every collective needs each rank's kernels after its peers', so it costs at least a
couple of context switches whatever its size (``benchmarks/gpu_sharing_floor.py`` measures the
floor; ``docs/cuda.md``). Under MPS the ranks' kernels share the GPU without switching.

:func:`plan` decides, from the launcher's ``--mps`` mode, whether the job needs a daemon of its
own; :class:`MpsDaemon` starts one with its own pipe and log directories (so it never touches a
daemon another job runs) and stops it at exit, whatever happened. Standard library only: the
launcher imports no torch.

Reference: NVIDIA, *Multi-Process Service* (the ``nvidia-cuda-mps-control`` manual):
``nvidia-cuda-mps-control -d`` starts the control daemon, ``quit`` on its standard input stops
it, ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY`` choose its directories (clients
find the daemon through the same pipe directory).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time

__all__ = ["CONTROL_BINARY", "DEFAULT_PIPE_DIRECTORY", "MpsDaemon", "MpsPlan", "MpsError",
           "daemon_running", "plan", "visible_gpu_count"]

CONTROL_BINARY = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"   # where a daemon started without the variable listens
NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"   # one entry per GPU the driver manages
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


class MpsError(RuntimeError):
    """MPS was asked for (``--mps on``) and cannot be had, or the daemon did not start."""


def visible_gpu_count(env: dict[str, str] | None = None, gpus_dir: str = NVIDIA_GPUS_DIR) -> int:
    """GPUs a rank can see: the driver's GPUs (entries of ``gpus_dir``), narrowed by
    ``CUDA_VISIBLE_DEVICES`` when it is set (its comma-separated entries up to the first
    invalid one, as CUDA reads it). 0 without an NVIDIA driver."""
    env = os.environ if env is None else env
    try:
        installed = len(os.listdir(gpus_dir))
    except OSError:
        return 0
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return installed
    entries = [e.strip() for e in visible.split(",")]
    count = 0
    for e in entries:
        if not e or e.startswith("-"):
            break
        count += 1
    return min(count, installed)


def daemon_running(pipe_directory: str) -> bool:
    """Whether an MPS control daemon listens in ``pipe_directory`` (its ``control`` socket)."""
    try:
        return stat.S_ISSOCK(os.stat(os.path.join(pipe_directory, "control")).st_mode)
    except OSError:
        return False


@dataclasses.dataclass(frozen=True)
class MpsPlan:
    """What the launcher does about MPS for one job.

    Attributes:
        start: start a daemon of the job's own.
        message: one line for the launcher to print (why not, or which daemon), or None.
    """

    start: bool
    message: str | None


def plan(mode: str, nproc: int, gpus: int, env: dict[str, str] | None = None) -> MpsPlan:
    """Decide about MPS for ``nproc`` local ranks on ``gpus`` visible GPUs.

    Ranks share a GPU when ``nproc > gpus >= 1`` (rank ``r`` uses ``cuda:{r % gpus}``).
    ``mode`` ``"auto"``: start a daemon when ranks share a GPU, the control binary is on
    ``PATH`` and no daemon already listens (``CUDA_MPS_PIPE_DIRECTORY``, default
    ``/tmp/nvidia-mps``); ``"on"``: the same, but missing the binary is an error; ``"off"``:
    never. Sharing without MPS gets a message saying small collectives will be slow and why.

    Raises:
        MpsError: ``mode`` is ``"on"`` and ranks share a GPU but the control binary is missing.
        ValueError: ``mode`` is not ``"auto"``, ``"on"`` or ``"off"``.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--mps: expected auto, on or off, got {mode!r}")
    env = os.environ if env is None else env
    if not (nproc > gpus >= 1):
        return MpsPlan(False, None)
    shared = f"{nproc} ranks share {gpus} GPU(s)"
    slow = (f"{shared} without MPS: the GPU time-slices their processes, so every collective "
            "costs at least a couple of context switches (hundreds of microseconds) whatever "
            "its size; pass --mps on, or start nvidia-cuda-mps-control -d first (docs/cuda.md)")
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIRECTORY)
    if daemon_running(pipe):
        return MpsPlan(False, f"{shared}: using the MPS daemon already running in {pipe}")
    if mode == "off":
        return MpsPlan(False, slow)
    if shutil.which(CONTROL_BINARY, path=env.get("PATH")) is None:
        if mode == "on":
            raise MpsError(f"--mps on: {CONTROL_BINARY} is not on PATH")
        return MpsPlan(False, slow + f" ({CONTROL_BINARY} is not on PATH)")
    return MpsPlan(True, None)


class MpsDaemon:
    """An MPS control daemon for one job, in directories of its own under a fresh temporary
    directory; a context manager that stops it and removes the directories on exit.

    ``env`` holds the variables the job's ranks need to reach it (``CUDA_MPS_PIPE_DIRECTORY``,
    ``CUDA_MPS_LOG_DIRECTORY``).

    Raises (on entry):
        MpsError: the control binary failed, or its ``control`` socket did not appear within
            ``START_TIMEOUT_S`` seconds (the log directory's ``control.log`` is quoted).
    """

    def __init__(self, env: dict[str, str] | None = None):
        self._base_env = dict(os.environ if env is None else env)
        self.root: str | None = None
        self.env: dict[str, str] = {}

    def __enter__(self) -> MpsDaemon:
        self.root = tempfile.mkdtemp(prefix="fcoll-mps-")
        pipe, log = os.path.join(self.root, "pipe"), os.path.join(self.root, "log")
        os.mkdir(pipe, 0o700)
        os.mkdir(log, 0o700)
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log}
        try:
            done = subprocess.run([CONTROL_BINARY, "-d"], env={**self._base_env, **self.env},
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=START_TIMEOUT_S)
            if done.returncode != 0:
                raise MpsError(f"{CONTROL_BINARY} -d exited with status {done.returncode}: "
                               f"{(done.stderr or done.stdout).strip()[:500]}")
            deadline = time.monotonic() + START_TIMEOUT_S
            while not daemon_running(pipe):
                if time.monotonic() > deadline:
                    raise MpsError(f"the MPS daemon did not open {pipe}/control within "
                                   f"{START_TIMEOUT_S:g} s; its log: {self._log_tail()}")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def server_started(self) -> bool:
        """True once a client reached the daemon: the control daemon starts an MPS server for
        its first client, which writes ``server.log`` in the log directory. A job whose ranks
        set the pipe directory but never became clients (the daemon unreachable, MPS not
        supported on the machine) leaves it False."""
        log = self.env.get("CUDA_MPS_LOG_DIRECTORY")
        return bool(log) and os.path.exists(os.path.join(log, "server.log"))

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.env["CUDA_MPS_LOG_DIRECTORY"], "control.log")) as f:
                return f.read()[-500:].strip() or "(empty)"
        except OSError:
            return "(no control.log)"

    def stop(self) -> None:
        """Ask the daemon to quit; if it still listens after ``STOP_TIMEOUT_S``, signal the pid
        it recorded; remove the directories. Safe to call twice; never raises."""
        if self.root is None:
            return
        pipe = self.env.get("CUDA_MPS_PIPE_DIRECTORY", "")
        if pipe and daemon_running(pipe):
            try:
                subprocess.run([CONTROL_BINARY], input="quit\n", text=True,
                               env={**self._base_env, **self.env}, capture_output=True,
                               timeout=STOP_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError):
                pass
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while daemon_running(pipe) and time.monotonic() < deadline:
                time.sleep(0.05)
            if daemon_running(pipe):
                self._kill_recorded_pid(pipe)
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    @staticmethod
    def _kill_recorded_pid(pipe: str) -> None:
        try:
            with open(os.path.join(pipe, f"{CONTROL_BINARY}.pid")) as f:
                os.kill(int(f.read().strip()), signal.SIGKILL)
        except (OSError, ValueError):
            pass
