"""Fail fast and truthfully (issue #31): false failures after a completed collective, and the
culprit a cascade names.

Each job is ``--world`` ranks forked from a forkserver that imported torch and fcoll once (as in
``kill_matrix.py``), so a job starts in about 0.1 s instead of 2-3 s. The last rank is the
*stayer*, the others the *leavers*. Scenarios:

- ``stopped``: the stayer enters the job's last all_reduce first and is SIGSTOPped while it waits
  in it (``STOP_S`` = 0.5 s); meanwhile the leavers complete that all_reduce (the stayer's data
  is there), destroy their group and exit; the stayer is resumed only after they exited. It
  must return the right result: the collective completed on every rank, so no rank may raise.
  Before issue #31 the stayer raised "rank 0 died" in every such job.
- ``exit``: the same without a signal: the leavers exit right after the last all_reduce while
  the stayer (at nice 19), woken by their arrival, may not have run yet (the machine's load
  decides: on a busy machine it often has not).
- ``cascade``: the stayer is SIGSTOPped before the last all_reduce and never arrives (it is
  killed once the others are done); the
  leavers have a group timeout of ``--timeout`` seconds and give up one after the other; every
  leaver must name the stayer (the culprit), whichever rank's fence it read.

    python benchmarks/fail_fast.py --scenario stopped --runs 50
    python benchmarks/fail_fast.py --scenario exit --runs 50 --world 4
    python benchmarks/fail_fast.py --scenario cascade --runs 3 --world 4 --timeout 5
    python benchmarks/fail_fast.py --scenario stopped --runs 50 --background-load 2

``--background-load N`` runs the jobs beside N busy processes (``collectives.BackgroundLoad``:
pure-Python spin loops, one core each, ended with the benchmark): a loaded machine, where a
woken rank runs late.

Every job has a hard timeout (``JOB_TIMEOUT_S``); a job that exceeds it counts as hung and its
ranks are killed. Exit status 0 when every job went as required.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import queue
import re
import signal
import sys
import tempfile
import time

SCENARIOS = ("stopped", "exit", "cascade")
STOP_S = 0.5  # how long the stayer is stopped in the "stopped" scenario
SETTLE_S = 0.1  # after the stayer said it enters its last collective: it is waiting in it
JOB_TIMEOUT_S = 30.0
GROUP_TIMEOUT_S = 30.0  # the group timeout of the "stopped" and "exit" jobs: never reached
NUMEL = 16  # elements of each all_reduce (one phase: the one-slot path)


def _rank(rank: int, world: int, store_path: str, scenario: str, timeout_s: float,
          go, events) -> None:
    """One rank of a job; reports ``(rank, kind, value)`` tuples on ``events``."""
    import torch
    import torch.distributed as dist

    import fcoll  # noqa: F401  registers the backend

    torch.set_num_threads(1)
    stayer = rank == world - 1
    try:
        store = dist.FileStore(store_path, world)
        pg_timeout = timeout_s if scenario == "cascade" else GROUP_TIMEOUT_S
        dist.init_process_group("fcoll", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        t = torch.ones(NUMEL)
        for _ in range(3):
            dist.all_reduce(t)
        expected = float(world ** 4)  # 1 * world after each of the four all_reduces
        if stayer:
            if scenario == "exit":  # the lowest priority: it runs late after its wake-up
                os.nice(19)
            events.put((rank, "entering", os.getpid()))
            if scenario == "cascade":  # never arrives: the driver stops it here, then kills it
                time.sleep(JOB_TIMEOUT_S)
            dist.all_reduce(t)
            events.put((rank, "result", bool(torch.all(t == expected))))
            dist.destroy_process_group()
            return
        if not go.wait(JOB_TIMEOUT_S):
            raise TimeoutError("no go from the driver")
        t0 = time.monotonic()
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            events.put((rank, "error", (str(e), time.monotonic() - t0)))
            return
        events.put((rank, "result", bool(torch.all(t == expected))))
        dist.destroy_process_group()  # then the process exits at once
    except BaseException as e:  # noqa: BLE001  reported: the driver judges
        events.put((rank, "error", (f"{type(e).__name__}: {e}", -1.0)))


def run_job(ctx, scenario: str, world: int, timeout_s: float = 2.0) -> dict:
    """Run one job of ``scenario``; returns ``{rank: (kind, value)}`` of what each rank
    reported last (``"result"``: whether its output was right; ``"error"``: (message,
    seconds in the last collective)), plus ``"hung"``: True if it exceeded JOB_TIMEOUT_S."""
    events, go = ctx.Queue(), ctx.Event()
    out: dict = {"hung": False}
    stayer = world - 1
    with tempfile.TemporaryDirectory(prefix="fcoll-fail-fast-") as tmp:
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "store"), scenario,
                                                 timeout_s, go, events), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + JOB_TIMEOUT_S
        try:
            _drive(scenario, procs, go, events, out, deadline)
        except TimeoutError:
            out["hung"] = True
        finally:
            if procs[stayer].pid is not None:
                _signal(procs[stayer].pid, signal.SIGCONT)
            for p in procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
                if p.is_alive():
                    out["hung"] = True
                    p.kill()
                    p.join(timeout=5)
        while True:
            try:
                r, kind, value = events.get_nowait()
            except (queue.Empty, OSError, EOFError):
                break
            out[r] = (kind, value)
        events.close()
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _drive(scenario: str, procs, go, events, out: dict, deadline: float) -> None:
    """The driver's part of a job: signals and the go for the leavers."""
    stayer = len(procs) - 1
    while True:  # the stayer entering its last collective
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        try:
            r, kind, value = events.get(timeout=left)
        except queue.Empty:
            raise TimeoutError from None
        out[r] = (kind, value)
        if kind == "error":
            return
        if kind == "entering":
            break
    if scenario == "exit":
        go.set()
        return
    # (a rank stopped while its queue's feeder thread writes would hold the queue's lock)
    time.sleep(SETTLE_S)
    if scenario == "cascade":  # the stayer never arrives; the leavers time out
        _signal(procs[stayer].pid, signal.SIGSTOP)
        go.set()
        for p in procs[:stayer]:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        _signal(procs[stayer].pid, signal.SIGKILL)
        return
    stopped_at = time.monotonic()
    _signal(procs[stayer].pid, signal.SIGSTOP)
    go.set()
    for p in procs[:stayer]:  # the leavers complete, destroy their group and exit
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            raise TimeoutError
    time.sleep(max(0.0, stopped_at + STOP_S - time.monotonic()))
    _signal(procs[stayer].pid, signal.SIGCONT)
    procs[stayer].join(timeout=max(0.1, deadline - time.monotonic()))


def names_culprit(message: str, culprit: int) -> bool:
    """Whether a survivor's error ``message`` blames group rank ``culprit`` for the cascade."""
    r = f"rank {culprit}"
    return bool(re.search(rf"(not yet arrived: {r}\b|waiting for {r}\b|{r} did not arrive)",
                          message))


def run(scenario: str, runs: int, world: int, timeout_s: float = 2.0) -> dict:
    """``runs`` jobs of ``scenario``; returns counts and the failures' messages.

    Returns:
        ``{"runs", "ok", "false_failures", "wrong", "hung", "not_named", "messages",
        "seconds"}``: for ``stopped`` / ``exit`` a job is ok when every rank returned the right
        result (``false_failures``: jobs where a rank raised; ``wrong``: a wrong result); for
        ``cascade`` when every leaver raised naming the stayer (``not_named``: leavers' messages
        that did not), ``messages`` keeping a few of them.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "fcoll"])
    res = {"runs": runs, "ok": 0, "false_failures": 0, "wrong": 0, "hung": 0, "not_named": [],
           "messages": [], "seconds": 0.0}
    t0 = time.monotonic()
    for _ in range(runs):
        job = run_job(ctx, scenario, world, timeout_s)
        res["hung"] += job["hung"]
        ranks = [job.get(r, ("missing", None)) for r in range(world)]
        if scenario == "cascade":
            msgs = [v[0] if k == "error" else f"{k}: {v}" for k, v in ranks[:-1]]
            bad = [m for m in msgs if not names_culprit(m, world - 1)]
            res["not_named"] += bad
            res["messages"] += msgs[:world - 1] if len(res["messages"]) < 8 else []
            res["ok"] += not bad and not job["hung"]
            continue
        errors = [v[0] for k, v in ranks if k == "error"]
        if errors:
            res["false_failures"] += 1
            res["messages"] += errors[:2]
        res["wrong"] += any(k == "result" and not v for k, v in ranks)
        res["ok"] += all(k == "result" and v for k, v in ranks) and not job["hung"]
    res["seconds"] = time.monotonic() - t0
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=SCENARIOS, default="stopped")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=5.0,
                    help="group timeout of the cascade scenario, seconds")
    ap.add_argument("--background-load", type=int, default=0, metavar="N",
                    help="busy background processes during the runs (default 0)")
    ns = ap.parse_args(argv)
    from collectives import BackgroundLoad, _sigterm_raises  # this folder

    with _sigterm_raises(), BackgroundLoad(ns.background_load, max_s=3600.0, settle_s=0.0):
        res = run(ns.scenario, ns.runs, ns.world, ns.timeout)
        load = os.getloadavg()[0]
    print(f"{ns.scenario}, {ns.world} ranks, {ns.background_load} busy processes "
          f"(load average {load:.1f}): {res['ok']}/{res['runs']} ok, "
          f"false failures {res['false_failures']}, wrong results {res['wrong']}, "
          f"hung {res['hung']}, leavers not naming rank {ns.world - 1}: "
          f"{len(res['not_named'])}; {res['seconds']:.1f} s")
    for m in (res["not_named"] or res["messages"])[:8]:
        print("  ", m[:400])
    return 0 if res["ok"] == res["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
