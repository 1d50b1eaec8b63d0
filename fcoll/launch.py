"""Start N local ranks of a script with torchrun's environment; stream and supervise them.

``python -m fcoll.launch --nproc-per-node N script.py ARGS`` (or ``-m module ARGS``) starts N
processes with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RUN_ID), so ``dist.init_process_group("fcoll")`` rendezvous through the env://
TCPStore. Several nodes: run one launcher per node with torchrun's static-rendezvous arguments,
``--nnodes M --node-rank I --master-addr ADDR --master-port PORT`` (the same meaning as
torchrun's: node I's ranks are I * N ... I * N + N - 1, and global rank 0, on node 0, serves the
store at ADDR:PORT). One node needs no port (a free one is picked). A script that reads only
these variables runs alike under ``torchrun`` and under this launcher. Every line a rank writes to stdout / stderr is re-emitted on the same
stream with a ``[rank N] `` prefix. When a rank fails, the others get SIGTERM, then SIGKILL
after ``--grace-s`` seconds; the exit status is the first failing rank's (128 + signal number
for a rank killed by a signal), or 0. Before starting the ranks and after they all ended, the
launcher removes the /dev/shm segment names that earlier fcoll versions left behind
(:func:`fcoll.shm.transport.segment.sweep_dead_segments`; this version's segments have no name
to leave).
When the ranks share a GPU, ``--mps`` (default ``auto``) starts an MPS control daemon for the
job and stops it at exit, or says once why small collectives will be slow without one
(:mod:`fcoll.mps`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import IO

from fcoll import mps

__all__ = ["free_port", "main", "parse_args", "rank_env"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fcoll.launch",
        description="Run N local ranks of a training script with torchrun's environment.")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                   help="number of ranks to start on this host (default 1)")
    p.add_argument("--nnodes", default="1",
                   help="number of nodes (hosts), each running one launcher (default 1; "
                        "torchrun's elastic MIN:MAX form is not supported)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0,
                   help="this node's index, 0 to nnodes - 1 (default 0)")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1",
                   help="address of node 0, where global rank 0 serves the rendezvous store")
    p.add_argument("--master-port", "--master_port", type=int, default=0,
                   help="rendezvous port (default: a free port; required with --nnodes > 1)")
    p.add_argument("--grace-s", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks")
    p.add_argument("--run-id", "--rdzv-id", "--rdzv_id", default=None)
    p.add_argument("--mps", choices=("auto", "on", "off"), default="auto",
                   help="NVIDIA MPS when ranks share a GPU (fcoll.mps): auto (default) starts "
                        "a daemon for the job where the control binary exists and none runs; "
                        "on: the same, an error without the binary; off: never")
    p.add_argument("-m", "--module", action="store_true",
                   help="treat the target as a module name (python -m)")
    p.add_argument("--no-python", "--no_python", action="store_true",
                   help="run the target as an executable, not with the Python interpreter")
    p.add_argument("target", help="script path, or module name with -m")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = p.parse_args(argv)
    if ns.nproc_per_node < 1:
        p.error("--nproc-per-node must be at least 1")
    try:
        ns.nnodes = int(ns.nnodes)
    except ValueError:
        p.error(f"--nnodes {ns.nnodes!r}: expected a number of nodes (elastic MIN:MAX ranges "
                "are torchrun's; use torchrun for elastic jobs)")
    if ns.nnodes < 1:
        p.error(f"--nnodes must be at least 1, got {ns.nnodes}")
    if not 0 <= ns.node_rank < ns.nnodes:
        p.error(f"--node-rank {ns.node_rank} is out of range for --nnodes {ns.nnodes} "
                f"(0 to {ns.nnodes - 1})")
    if ns.nnodes > 1 and ns.master_port == 0:
        p.error(f"--master-port is required with --nnodes {ns.nnodes}: every node must use "
                "the same port")
    if not 0 <= ns.master_port < 65536:
        p.error(f"--master-port {ns.master_port} is not a TCP port")
    return ns


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def rank_env(local_rank: int, nproc_per_node: int, addr: str, port: int, run_id: str,
             node_rank: int = 0, nnodes: int = 1) -> dict[str, str]:
    """The variables torchrun sets for local rank ``local_rank`` of node ``node_rank``.

    Ranks are numbered node by node, as torchrun's static rendezvous does with equal
    ``--nproc-per-node`` everywhere: ``RANK = node_rank * nproc_per_node + local_rank``.
    """
    rank = node_rank * nproc_per_node + local_rank
    world = nnodes * nproc_per_node
    return {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nnodes), "ROLE_RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nproc_per_node), "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default", "MASTER_ADDR": addr, "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "PYTHONUNBUFFERED": "1",
    }


def _pump(src: IO[bytes], dst: IO[bytes], prefix: bytes, lock: threading.Lock) -> None:
    for line in iter(src.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            dst.write(prefix + line)
            dst.flush()
    src.close()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def _describe_exit(code: int) -> str:
    """``'status 1'`` for an exit, ``'signal SIGSEGV (status 139)'`` for a death by signal."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"signal {name} (status {_status(code)})"
    return f"status {code}"


def _sweep(err: IO[bytes]) -> None:
    """Remove dead fcoll segment names; say which on ``err``. Never fails the launch."""
    try:
        from fcoll.shm.transport.segment import sweep_dead_segments

        removed = sweep_dead_segments()
    except Exception as e:  # noqa: BLE001  cleanup must not stop a job
        removed = []
        err.write(f"[fcoll.launch] could not sweep shared-memory segments: {e}\n".encode())
    if removed:
        err.write(f"[fcoll.launch] removed {len(removed)} shared-memory segment(s) of dead "
                  f"jobs: {', '.join(removed)}\n".encode())
        err.flush()


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    nproc = ns.nproc_per_node
    port = ns.master_port or free_port(ns.master_addr)
    # every node must agree on the run id: derive it from the rendezvous address when not given
    run_id = ns.run_id or (uuid.uuid4().hex[:12] if ns.nnodes == 1
                           else f"fcoll-{ns.master_addr}-{port}")
    if ns.no_python:
        cmd = [ns.target, *ns.args]
    elif ns.module:
        cmd = [sys.executable, "-u", "-m", ns.target, *ns.args]
    else:
        cmd = [sys.executable, "-u", ns.target, *ns.args]
    out = sys.stdout.buffer
    err = sys.stderr.buffer
    try:
        mps_plan = mps.plan(ns.mps, nproc, mps.visible_gpu_count())
        if mps_plan.message:
            err.write(f"[fcoll.launch] {mps_plan.message}\n".encode())
            err.flush()
        with mps.MpsDaemon() if mps_plan.start else contextlib.nullcontext() as daemon:
            mps_env = daemon.env if daemon is not None else {}
            if mps_env:
                err.write(f"[fcoll.launch] {nproc} ranks share a GPU: started an MPS daemon "
                          f"for this job ({mps_env['CUDA_MPS_PIPE_DIRECTORY']}); it stops at "
                          "exit\n".encode())
                err.flush()
            status = _run_ranks(ns, cmd, port, run_id, mps_env, out, err)
            if daemon is not None and not daemon.server_started():
                err.write(b"[fcoll.launch] no rank became a client of the MPS daemon (it started "
                          b"no server): either no rank used CUDA, or MPS does not work on this "
                          b"machine and the ranks were time-sliced\n")
                err.flush()
            return status
    except mps.MpsError as e:   # --mps on without the binary, or a daemon that did not start
        err.write(f"[fcoll.launch] {e}\n".encode())
        return 2


def _run_ranks(ns: argparse.Namespace, cmd: list[str], port: int, run_id: str,
               extra_env: dict[str, str], out: IO[bytes], err: IO[bytes]) -> int:
    """Start the node's ranks with ``extra_env`` added, supervise them, return the exit status."""
    nproc = ns.nproc_per_node
    _sweep(err)
    # as torchrun: several ranks of one host each default to one intra-op thread, not one per
    # core (2 ranks x 2 threads on 2 cores made fcoll's collectives 20-40x slower than gloo's)
    omp_default = "OMP_NUM_THREADS" not in os.environ and nproc > 1
    if omp_default:
        err.write(f"[fcoll.launch] OMP_NUM_THREADS=1 for each of the {nproc} ranks (as torchrun "
                  "does); set it to tune\n".encode())
        err.flush()
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    first_rank = ns.node_rank * nproc
    for local in range(nproc):
        r = first_rank + local
        env = dict(os.environ, **extra_env, **rank_env(local, nproc, ns.master_addr, port,
                                                       run_id, ns.node_rank, ns.nnodes))
        # a rank killed by SIGSEGV, SIGBUS, SIGFPE or SIGABRT prints every thread's Python
        # stack (faulthandler) before it dies, so a crash names where it happened
        env.setdefault("PYTHONFAULTHANDLER", "1")
        if omp_default:
            env["OMP_NUM_THREADS"] = "1"
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        procs.append(p)
        for src, dst in ((p.stdout, out), (p.stderr, err)):
            t = threading.Thread(target=_pump, args=(src, dst, f"[rank {r}] ".encode(), lock),
                                 daemon=True)
            t.start()
            pumps.append(t)

    stop = threading.Event()

    def on_signal(signum, _frame):
        stop.set()
        for p in procs:
            _signal_group(p, signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    first_failure: int | None = None
    kill_at: float | None = None
    try:
        while any(p.poll() is None for p in procs):
            if first_failure is None:
                for r, p in enumerate(procs, start=first_rank):
                    code = p.poll()
                    if code is not None and code != 0:
                        first_failure = _status(code)
                        with lock:
                            err.write(f"[fcoll.launch] rank {r} exited with "
                                      f"{_describe_exit(code)}; stopping the other ranks\n"
                                      .encode())
                            err.flush()
                        for q in procs:
                            if q.poll() is None:
                                _signal_group(q, signal.SIGTERM)
                        kill_at = time.monotonic() + ns.grace_s
                        break
            if stop.is_set() and kill_at is None:
                kill_at = time.monotonic() + ns.grace_s
            if kill_at is not None and time.monotonic() >= kill_at:
                for q in procs:
                    if q.poll() is None:
                        _signal_group(q, signal.SIGKILL)
            time.sleep(0.05)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for t in pumps:
            t.join(timeout=2.0)
        _sweep(err)
    if first_failure is None:
        first_failure = next((_status(p.returncode) for p in procs if p.returncode), 0)
    return first_failure


if __name__ == "__main__":
    sys.exit(main())
