"""fcoll's hierarchical groups against flat gloo across 2 emulated hosts x 2 ranks.

``python benchmarks/multihost.py [--rates 1gbit 10gbit] [--json out.json]`` builds 2 hosts
(network namespaces, :class:`fcoll.testing.hosts.EmulatedHosts`) whose links are limited by
tc tbf to each rate, runs ``fcoll.launch --nnodes 2 --nproc-per-node 2`` on them, and in that
one 4-rank job times, side by side (alternating, each behind a barrier), every op and size on:

- ``fcoll``: the world group, ``init_process_group("fcoll")``: hierarchical (shared memory
  inside a host, gloo between hosts, composed per op);
- ``gloo``: ``new_group(backend="gloo")`` over the same ranks and links.

Reported per (rate, op, size): rank 0's median time, busbw with nccl-tests' factors
(:func:`fcoll.ops.facts.busbw_factor`; size = the larger of input and output, as nccl-tests)
and the ratio fcoll / gloo busbw; each algorithm's bytes on a host's link
(:func:`link_bytes_per_host`), the ratio they allow when both are link-bound, and the share
of the link's rate fcoll's median reached; the load average before and after each rate.
Target (issue 16): ratio >= 1.8 at 16 MiB and above. Needs root (network namespaces).

Bytes on the link per host and direction (S = size, 2 hosts x 2 ranks, ranks numbered host
by host): all_reduce: a flat ring 1.5 S, hierarchical S (the minimum, 2 (H-1)/H * S);
all_gather: a flat ring 0.75 S (3 of 4 blocks cross each crossing link), hierarchical 0.5 S. So
where both are link-bound the ratio is at most 1.5 for these two; reduce_scatter can gain more
because gloo's own reduce_scatter (measured here) takes as long as its all_reduce. At 10 gbit
the link is rarely the bound on 2 shared cores: the ratio there measures CPU cost.

``--train-step [--parallel ddp fsdp] [--steps 8] [--rounds 1]`` times examples/train_gpt.py's
functional DDP / FSDP step instead, on the same 2 x 2 layout and rates: fcoll's hierarchical
group against flat gloo (target: fcoll's step at least 1.3x faster), with fcoll.sim's predicted
step beside each measured one (:func:`_train_step`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPS = ("all_reduce", "all_gather", "reduce_scatter")
SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]


def _fmt_size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


# ---- the ranks' side --------------------------------------------------------------------------
def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import fcoll  # noqa: F401  registers the backend
    from fcoll.ops.facts import busbw_factor

    torch.set_num_threads(1)
    dist.init_process_group("fcoll")
    rank, n = dist.get_rank(), dist.get_world_size()
    groups = {"fcoll": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    kind = type(groups["fcoll"]).__name__
    rows = []
    for op in args.ops:
        for size in args.sizes:
            numel = size // 4
            if op == "all_reduce":
                bufs = {"x": torch.ones(numel)}
                def run(g, b=None):
                    dist.all_reduce(b["x"], group=g)
            elif op == "all_gather":
                bufs = {"x": torch.ones(numel // n), "y": torch.empty(numel)}
                def run(g, b=None):
                    dist.all_gather_into_tensor(b["y"], b["x"], group=g)
            else:
                bufs = {"x": torch.ones(numel), "y": torch.empty(numel // n)}
                def run(g, b=None):
                    dist.reduce_scatter_tensor(b["y"], b["x"], group=g)
            times: dict[str, list[float]] = {"fcoll": [], "gloo": []}
            reps = args.reps if size < (16 << 20) else max(3, args.reps // 2)
            for it in range(reps + 1):
                for name in (("fcoll", "gloo") if it % 2 == 0 else ("gloo", "fcoll")):
                    g = groups[name]
                    dist.barrier(group=g)
                    t0 = time.perf_counter()
                    run(g, bufs)
                    dt = time.perf_counter() - t0
                    if it > 0:  # the first round warms up
                        times[name].append(dt)
            row = {"op": op, "bytes": size, "world": n}
            for name, ts in times.items():
                med = statistics.median(ts)
                row[name] = {"median_s": med, "all_s": ts,
                             "busbw_GBps": size / med * busbw_factor(op, n) / 1e9}
            row["ratio"] = row["fcoll"]["busbw_GBps"] / row["gloo"]["busbw_GBps"]
            rows.append(row)
            if rank == 0:
                print(f"{op} {_fmt_size(size)}: fcoll {row['fcoll']['median_s'] * 1e3:.1f} ms, "
                      f"gloo {row['gloo']['median_s'] * 1e3:.1f} ms, ratio {row['ratio']:.2f}",
                      flush=True)
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"group": kind, "rows": rows}, f)
    dist.destroy_process_group()


# ---- the driver -------------------------------------------------------------------------------
def _run_rate(rate: str, args: argparse.Namespace) -> dict:
    from fcoll.testing.hosts import EmulatedHosts

    with tempfile.TemporaryDirectory(prefix="fcoll-multihost-") as tmp:
        out = os.path.join(tmp, "rows.json")
        target = [str(Path(__file__).resolve()), "--worker-out", out, "--reps", str(args.reps),
                  "--ops", *args.ops, "--sizes", *map(str, args.sizes)]
        load_before = os.getloadavg()
        with EmulatedHosts(2, rate=rate) as hosts:
            procs = hosts.launch(2, target, env={"PYTHONPATH": str(REPO)})
            deadline = time.monotonic() + args.timeout_s
            for p in procs:
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise SystemExit(f"multihost: the {rate} run exceeded {args.timeout_s} s")
            codes = [p.returncode for p in procs]
            if any(codes):
                raise SystemExit(f"multihost: the {rate} run failed: launcher exit codes {codes}")
        with open(out) as f:
            res = json.load(f)
    res.update(rate=rate, loadavg_before=load_before, loadavg_after=os.getloadavg())
    return res


def link_bytes_per_host(op: str, size: int, hosts: int, per_host: int) -> tuple[float, float]:
    """Bytes each host sends on its inter-host link for one ``op`` of ``size`` bytes
    (nccl-tests' size: the larger buffer), as (flat ring, hierarchical).

    Flat: gloo's ring over all n = hosts * per_host ranks numbered host by host crosses each
    host's link once, and a ring all_reduce sends 2 (n-1)/n * size over every ring link, a
    ring all_gather (n-1)/n * size (Patarasuk & Yuan 2009). Hierarchical
    (:mod:`fcoll.shm.multihost.hierarchical`): each of the per_host ranks all-reduces a 1/per_host
    shard among the hosts, 2 (H-1)/H * size in all (the minimum for all_reduce); all_gather
    and reduce_scatter send (H-1)/H * size. gloo's reduce_scatter is not a ring (measured as
    slow as its all_reduce): its flat figure is NaN.
    """
    n, h = hosts * per_host, hosts
    if op == "all_reduce":
        return 2 * (n - 1) / n * size, 2 * (h - 1) / h * size
    if op == "all_gather":
        return (n - 1) / n * size, (h - 1) / h * size
    return float("nan"), (h - 1) / h * size


def _table(results: list[dict]) -> str:
    """Measured medians and busbw side by side, with each algorithm's bytes on a host's link
    (:func:`link_bytes_per_host`), the ratio those bytes allow when both are link-bound
    (flat / hierarchical bytes), and the share of the link's rate fcoll's time reached."""
    from fcoll.testing.hosts import rate_bytes_per_s

    lines = [("| link | op | size | fcoll ms | gloo ms | fcoll busbw GB/s | gloo busbw GB/s "
              "| ratio | link MiB/host flat | hier | link-bound ratio | fcoll at % of link |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:
            flat_b, hier_b = link_bytes_per_host(r["op"], r["bytes"], 2, r["world"] // 2)
            link_s = hier_b / rate_bytes_per_s(res["rate"])
            lines.append(f"| {res['rate']} | {r['op']} | {_fmt_size(r['bytes'])} "
                         f"| {r['fcoll']['median_s'] * 1e3:.1f} "
                         f"| {r['gloo']['median_s'] * 1e3:.1f} "
                         f"| {r['fcoll']['busbw_GBps']:.3f} | {r['gloo']['busbw_GBps']:.3f} "
                         f"| {r['ratio']:.2f}x | {flat_b / 2**20:.2f} | {hier_b / 2**20:.2f} "
                         f"| {flat_b / hier_b:.2f}x "
                         f"| {100 * link_s / r['fcoll']['median_s']:.0f} % |")
    return "\n".join(lines)


# ---- the train_gpt step (issue 16: "and the train_gpt DDP and FSDP step") ---------------------
def _train_step(args: argparse.Namespace) -> list[dict]:
    """examples/train_gpt.py's functional DDP / FSDP step on 2 emulated hosts x 2 ranks per
    ``--rates``: fcoll's hierarchical world group (``--dist-backend fcoll``) against flat gloo
    (``--dist-backend gloo``: the same compiled step, fcoll's ops on a gloo group), runs
    alternating (``--rounds``), each train_gpt's median step. Beside each, fcoll.sim's
    prediction from one recording per mode (``fcoll.inspect`` on 4 local ranks: the same 4
    processes on the same cores; compute per node and the time outside the graphs from its
    trace) for ``Layout(4, 2)``: ``algorithm="hierarchical"`` for fcoll, ``"ring"`` (flat, every
    step on the inter-host link) for gloo, the inter-host link as gloo measured it on these
    hosts (:mod:`fcoll.sim.linkprobe`), fcoll's calibrated shm inside a host.

    Measured 2026-11-23 at load 9-15 (8 steps, 1 round): fcoll 0.60-0.93x of gloo's step; the
    simulator predicts 1.00x, because on 2 shared cores the 4 ranks' compute (~1.0-1.3 s) hides
    every collective (50-165 ms): the step is compute-bound, and what fcoll loses is CPU its
    shared-memory and hierarchical stages take from the compute, which the simulator does not
    model ('shm' collectives get a stream of their own)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import sim_validation as sv

    from fcoll.sim import Layout, simulate

    rows = []
    t_out = int(args.step_timeout_s)
    with tempfile.TemporaryDirectory(prefix="fcoll-multihost-step-") as tmp:
        for par in args.parallel:
            rec = os.path.join(tmp, f"{par}-rec")
            load0 = os.getloadavg()[0]
            rec_ms = sv.record(par, 4, args.steps, rec, t_out)
            print(f"[{par}] recording (fcoll.inspect, 1 host x 4 ranks): median step "
                  f"{rec_ms} ms; load {load0:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
            for rate in args.rates:
                link = sv.probe_link(rate, t_out)
                load0 = os.getloadavg()[0]
                steps: dict[str, list[float]] = {"fcoll": [], "gloo": []}
                for r in range(args.rounds):
                    for backend in (("fcoll", "gloo") if r % 2 == 0 else ("gloo", "fcoll")):
                        ms = sv.run_on_hosts(par, rate, 2, args.steps, t_out, backend)
                        steps[backend].append(ms)
                        print(f"[{par} {rate}] {backend}: median step {ms} ms", flush=True)
                sim = {name: simulate(rec, [Layout(4, 2)], inter=link["spec"],
                                      algorithm=algo).results[0].as_dict()
                       for name, algo in (("fcoll", "hierarchical"), ("gloo", "ring"))}
                meas = {k: statistics.median(v) for k, v in steps.items()}
                rows.append({"parallel": par, "rate": rate, "link": link,
                             "recording_step_ms": rec_ms, "measured_ms": meas,
                             "all_ms": steps, "sim": sim,
                             "speedup": meas["gloo"] / meas["fcoll"],
                             "loadavg": (load0, os.getloadavg()[0])})
    return rows


def _train_step_table(rows: list[dict]) -> str:
    def err(pred_us, meas_ms):
        return f"{(pred_us / 1e3 - meas_ms) / meas_ms:+.0%}"

    lines = [("| link (effective) | parallel | fcoll ms | sim fcoll ms | err | gloo ms "
              "| sim gloo ms | err | gloo / fcoll | sim gloo / fcoll | load |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, s = r["measured_ms"], r["sim"]
        lines.append(
            f"| {r['rate']} ({r['link']['spec']}) | {r['parallel']} | {m['fcoll']:.0f} "
            f"| {s['fcoll']['step_us'] / 1e3:.0f} | {err(s['fcoll']['step_us'], m['fcoll'])} "
            f"| {m['gloo']:.0f} | {s['gloo']['step_us'] / 1e3:.0f} "
            f"| {err(s['gloo']['step_us'], m['gloo'])} | {r['speedup']:.2f}x "
            f"| {s['gloo']['step_us'] / s['fcoll']['step_us']:.2f}x "
            f"| {r['loadavg'][0]:.1f} -> {r['loadavg'][1]:.1f} |")
    return "\n".join(lines)


def _report_train_step(rows: list[dict]) -> None:
    print(_train_step_table(rows))
    print("\nsim: fcoll.sim from one fcoll.inspect recording per mode (1 host x 4 ranks): "
          "compute and the time outside the graphs measured in its trace, Layout(4, 2), "
          "hierarchical (fcoll) / flat ring (gloo), the effective link in brackets")
    print("target: the train_gpt step on fcoll at least 1.3x faster than on flat gloo")
    for r in rows:
        verdict = "PASS" if r["speedup"] >= 1.3 else "FAIL"
        print(f"{verdict} {r['rate']} {r['parallel']}: {r['speedup']:.2f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--sizes", nargs="+", type=int, default=SIZES, help="bytes")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per op and backend "
                   "(halved, at least 3, from 16 MiB)")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--train-step", action="store_true",
                   help="time examples/train_gpt.py's step instead of the collectives")
    p.add_argument("--parallel", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"],
                   help="--train-step: train_gpt's --parallel modes")
    p.add_argument("--steps", type=int, default=8, help="--train-step: steps per run")
    p.add_argument("--rounds", type=int, default=1,
                   help="--train-step: runs per backend, alternating fcoll and gloo")
    p.add_argument("--step-timeout-s", type=float, default=400.0,
                   help="--train-step: limit per run")
    args = p.parse_args(argv)
    if args.worker_out:
        _worker(args)
        return 0
    if args.train_step:
        rows = _train_step(args)
        _report_train_step(rows)
        print(f"load average now: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"train_step": rows, "argv": sys.argv[1:]}, f, indent=2)
        return 0
    results = []
    for rate in args.rates:
        res = _run_rate(rate, args)
        print(f"[{rate}] group: {res['group']}; load average before "
              f"{res['loadavg_before'][0]:.2f}, after {res['loadavg_after'][0]:.2f}", flush=True)
        results.append(res)
    print(_table(results))
    print("\ntarget: fcoll busbw >= 1.8x gloo's at 16 MiB and above")
    for res in results:
        for r in res["rows"]:
            if r["bytes"] >= 16 << 20:
                verdict = "PASS" if r["ratio"] >= 1.8 else "FAIL"
                print(f"{verdict} {res['rate']} {r['op']} {_fmt_size(r['bytes'])}: "
                      f"{r['ratio']:.2f}x")
    print(f"load average now: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "argv": sys.argv[1:]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
