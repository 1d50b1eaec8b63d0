"""Kill a whole fcoll job with SIGKILL in each phase of a group's life and count what it leaves.

Phases: ``init`` (inside ``init_process_group``: segment creation and attach), ``new_group``
(inside ``dist.new_group``: a second segment), ``steady`` (small all_reduces on both groups),
``destroy`` (inside ``destroy_process_group``). For each phase and iteration a job of
``--world`` ranks starts, every rank reports each phase as it enters it, and once rank 0 entered
the target phase every rank is SIGKILLed after a random delay of up to about the phase's length
(``JITTER_S``, seeded, so a run can be repeated); the report says where the kills landed.
Afterwards it counts fcoll names that appeared in /dev/shm (``sweep_dead_segments`` runs first,
as the next job's init would) and live mappings of the killed jobs' segments
(``memfd:fcoll-<pid>-...`` in any /proc/<pid>/maps); both must be 0.

Ranks are forked from a forkserver that imported torch and fcoll once, so a job starts in
about 0.1 s instead of 2-3 s.

    python benchmarks/kill_matrix.py --iterations 100          # the issue's 100 per phase
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import queue
import random
import signal
import sys
import tempfile
import time

PHASES = ("init", "new_group", "steady", "destroy")
# the longest random delay between rank 0 entering a phase and the kill, seconds: about the
# phase's length at 2 ranks on the 2-core machine, so most kills land inside it
JITTER_S = {"init": 0.15, "new_group": 0.01, "steady": 0.03, "destroy": 0.0015}
STEADY_CALLS = 500  # all_reduces per group in the steady phase
JOB_TIMEOUT_S = 60.0  # a job that does not reach its phase in this long is reported as hung


def _rank(rank: int, world: int, store_path: str, events) -> None:
    """One rank: report each phase as it starts, then run it (killed somewhere in it)."""
    import torch
    import torch.distributed as dist

    import fcoll  # noqa: F401  registers the backend

    torch.set_num_threads(1)
    try:
        events.put((rank, "init", os.getpid()))
        store = dist.FileStore(store_path, world)
        dist.init_process_group("fcoll", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        events.put((rank, "new_group", os.getpid()))
        g = dist.new_group(list(range(world)))
        events.put((rank, "steady", os.getpid()))
        t = torch.ones(16)
        for _ in range(STEADY_CALLS):
            dist.all_reduce(t)
            dist.all_reduce(t, group=g)
        events.put((rank, "destroy", os.getpid()))
        dist.destroy_process_group()
        events.put((rank, "done", os.getpid()))
    except Exception as e:  # noqa: BLE001  a peer killed a moment earlier: expected here
        events.put((rank, f"error: {type(e).__name__}", os.getpid()))


def _shm_names() -> set[str]:
    from fcoll.testing import fcoll_segments

    return set(fcoll_segments())


def _mapped_by_anyone(pids: list[int]) -> list[str]:
    """``memfd:fcoll-<pid>-`` mappings of any of ``pids`` still in some process's maps."""
    from fcoll.shm.transport.segment import proc_maps

    needles = [f"memfd:fcoll-{p}-".encode() for p in pids]
    found = []
    for d, maps in proc_maps():
        found += [f"{d}: {n.decode()}" for n in needles if n in maps]
    return found


def run_matrix(phases=PHASES, iterations: int = 5, world: int = 2, jitter_scale: float = 1.0,
               seed: int = 0) -> dict:
    """Run the matrix; returns per phase where the kills landed, plus what was left behind.

    Returns:
        ``{"landed": {phase: {last phase rank 0 reported: count}}, "hung": [...],
        "names_left": [...], "swept": [...], "mapped_left": [...], "seconds": float}``.
    """
    from fcoll.shm.transport.segment import sweep_dead_segments

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "fcoll"])
    rng = random.Random(seed)
    before = _shm_names()
    landed: dict = {p: {} for p in phases}
    hung, pids = [], []
    t0 = time.monotonic()
    for phase in phases:
        for it in range(iterations):
            events = ctx.Queue()
            with tempfile.TemporaryDirectory(prefix="fcoll-kill-") as tmp:
                procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "store"),
                                                          events), daemon=True)
                         for r in range(world)]
                for p in procs:
                    p.start()
                last = _wait_for(events, phase, time.monotonic() + JOB_TIMEOUT_S)
                if last is None:
                    hung.append((phase, it))
                else:
                    # the kill point (a random delay, not a wait for anything)
                    time.sleep(rng.uniform(0.0, JITTER_S[phase] * jitter_scale))
                for p in procs:
                    if p.pid is not None:
                        pids.append(p.pid)
                        try:
                            os.kill(p.pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                for p in procs:
                    p.join(timeout=10)
                reached = last
                while True:  # the last phase rank 0 reported before it died
                    try:
                        r, ph, _ = events.get_nowait()
                    except (queue.Empty, OSError, EOFError):
                        break
                    if r == 0 and not ph.startswith("error"):
                        reached = ph
                landed[phase][reached] = landed[phase].get(reached, 0) + 1
                events.close()
    swept = sweep_dead_segments()
    return {"landed": landed, "hung": hung, "names_left": sorted(_shm_names() - before),
            "swept": swept, "mapped_left": _mapped_by_anyone(pids),
            "seconds": time.monotonic() - t0}


def _wait_for(events, phase: str, deadline: float) -> str | None:
    """Block until rank 0 reports ``phase``; the phase it reported, or None at ``deadline``."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            r, ph, _ = events.get(timeout=left)
        except queue.Empty:
            return None
        if r == 0 and ph == phase:
            return ph


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=100, help="jobs killed per phase")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--jitter-scale", type=float, default=1.0,
                    help="multiplies every phase's longest delay before the kill")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    ns = ap.parse_args(argv)
    res = run_matrix(ns.phases, ns.iterations, ns.world, ns.jitter_scale, ns.seed)
    for phase, where in res["landed"].items():
        print(f"{phase:10s} kills landed in: {where}")
    print(f"hung jobs: {len(res['hung'])}; /dev/shm names left: {len(res['names_left'])}; "
          f"swept: {len(res['swept'])}; live mappings of killed jobs: {len(res['mapped_left'])}; "
          f"{res['seconds']:.1f} s")
    ok = not (res["hung"] or res["names_left"] or res["mapped_left"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
