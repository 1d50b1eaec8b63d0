"""First-call time of ``torch.compile(backend="fcoll")`` against ``backend="aot_eager"``, per phase.

Usage: ``python benchmarks/compile_time.py [--reps 3] [--nproc 2] [--json compile_time.json]
[--backends fcoll aot_eager]``

The step (DDP style): an MLP of 8 blocks (``Linear(64, 64)`` + ReLU) and a head
(``Linear(64, 1, bias=False)``): 17 parameters. The compiled function runs forward, loss and
``loss.backward()`` (a graph break: Dynamo compiles the forward + backward graph and, after the
break, a graph of the 17 gradient ``fcoll.all_reduce(g, "avg", group)`` calls written back with
``copy_``), on 2 ranks of fcoll's backend. Both backends compile the same Python function; only
the ``backend=`` argument differs.

Every measurement is a fresh pair of processes (``fcoll.testing.run_ranks``): nothing is cached
from an earlier compile in the same process (calibration, Dynamo's caches, lazy imports). Reps
alternate between backends (fcoll, aot_eager, fcoll, ...), so load drifts hit both alike.

Phases, per rank, in seconds (the table shows rank 0's, the median over reps):

- ``first call``: the whole first call of the compiled function (what a user waits for).
- ``backend``: time inside the backend callable (AOTAutograd and, for fcoll, what follows),
  summed over graphs.
- ``first runs``: time inside the first call of each callable the backend returned (the
  forward graphs with AOTAutograd's runtime wrappers; the backward graph runs inside the eager
  ``backward()``).
- ``dynamo+eager`` = first call - backend - first runs: Dynamo's tracing and guards, and the
  eager ``backward()`` between the graphs (with the backward graph's run, and its compile when
  AOTAutograd compiles it lazily).
- fcoll only, from what ``compile_graph`` records per graph (``gm.meta``): ``fcoll
  compile_graph`` (inside the backend; ``(lazy, in backward)`` when AOTAutograd compiled the
  backward at its first run); ``aot`` = backend - fcoll compile_graph inside it; each pass
  (``lower_c10d_functional``, ``bucket_collectives``, ``check_rank_consistency`` (the rank
  check), ``reorder_for_overlap``, ...); ``calibration`` (the cost model's
  ``calibrate_group``, timed by wrapping it; it runs inside whichever pass first needs the cost
  model, and that pass's row excludes it); ``executor`` (building the executor, direct calls
  included); ``listeners``.

Printed: the table, the ratio fcoll / aot_eager of the first call (target <= 1.3x, issue
#17.4), and the load average (1, 5, 15 min) before and after. JSON: every rep's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGET_RATIO = 1.3
N_BLOCKS, WIDTH = 8, 64


def _rank_fn(rank: int, world_size: int, backend: str) -> dict:
    """One fresh process: compile the step with ``backend`` and time its first call by phase."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.backends.registry import lookup_backend

    import fcoll
    import fcoll.compile.backend as fb
    import fcoll.passes.analysis.calibration as cal

    phases: dict[str, float] = {}

    def add(name: str, seconds: float) -> None:
        phases[name] = phases.get(name, 0.0) + seconds

    def timed_runs(fn):
        first = [True]

        def run(*args, **kwargs):
            if not first[0]:
                return fn(*args, **kwargs)
            first[0] = False
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                add("first runs", time.perf_counter() - t0)
        for k, v in getattr(fn, "__dict__", {}).items():
            setattr(run, k, v)
        return run

    from fcoll.passes.registry import FcollPass

    real_calibrate, real_pass_call = cal.calibrate_group, FcollPass.__call__
    running_pass: list[str] = []
    calibration_in: dict[str, float] = {}  # pass name -> calibration seconds inside it

    def pass_call(self, *args, **kwargs):
        running_pass.append(self.name)
        try:
            return real_pass_call(self, *args, **kwargs)
        finally:
            running_pass.pop()

    def calibrate_group(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real_calibrate(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - t0
            add("calibration", seconds)
            where = running_pass[-1] if running_pass else ""
            calibration_in[where] = calibration_in.get(where, 0.0) + seconds
    cal.calibrate_group = calibrate_group
    FcollPass.__call__ = pass_call

    real_compile_graph = fb.compile_graph
    in_backend = [False]

    def compile_graph(gm, example_inputs, config, name):
        t0 = time.perf_counter()
        executor = real_compile_graph(gm, example_inputs, config, name)
        where = "" if in_backend[0] else " (lazy, in backward)"
        add(f"fcoll compile_graph{where}", time.perf_counter() - t0)
        for record in gm.meta.get("fcoll_passes", []):
            add(f"pass {record['pass']}", record["seconds"])
        for phase, seconds in gm.meta.get(fb.META_COMPILE_SECONDS, {}).items():
            if phase != "pipeline":
                add(phase, seconds)
        return executor
    fb.compile_graph = compile_graph

    inner = lookup_backend(backend)

    def timed_backend(gm, example_inputs, **kwargs):
        t0 = time.perf_counter()
        in_backend[0] = True
        try:
            compiled = inner(gm, example_inputs, **kwargs)
        finally:
            in_backend[0] = False
        add("backend", time.perf_counter() - t0)
        return timed_runs(compiled)

    torch.manual_seed(0)
    blocks = []
    for _ in range(N_BLOCKS):
        blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(WIDTH, 1, bias=False))
    params = list(model.parameters())
    group = dist.group.WORLD

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        for p in params:
            p.grad.copy_(fcoll.all_reduce(p.grad, "avg", group))
        return loss

    compiled = torch.compile(step, backend=timed_backend, fullgraph=False)
    x = torch.randn(32, WIDTH) + rank
    dist.barrier()
    t0 = time.perf_counter()
    loss = compiled(x)
    first = time.perf_counter() - t0
    grads = [p.grad.clone() for p in params]
    # the result is right: the average of both ranks' gradients is the same on every rank
    gathered = [torch.empty_like(torch.cat([g.view(-1) for g in grads])) for _ in range(world_size)]
    dist.all_gather(gathered, torch.cat([g.view(-1) for g in grads]))
    if not all(torch.equal(gathered[0], g) for g in gathered[1:]):
        raise AssertionError(f"rank {rank}: reduced gradients differ across ranks")
    phases["first call"] = first
    backend_s = phases.get("backend", 0.0)
    phases["dynamo+eager"] = first - backend_s - phases.get("first runs", 0.0)
    if backend == "fcoll":
        phases["aot"] = backend_s - phases.get("fcoll compile_graph", 0.0)
        for name, seconds in calibration_in.items():
            if f"pass {name}" in phases:
                phases[f"pass {name}"] -= seconds
    phases["loss"] = float(loss.detach())
    return phases


def _order(names: set[str]) -> list[str]:
    head = ["first call", "dynamo+eager", "backend", "aot", "fcoll compile_graph",
            "fcoll compile_graph (lazy, in backward)"]
    tail = ["calibration", "executor", "listeners", "first runs"]
    passes = sorted(n for n in names if n.startswith("pass "))
    rest = sorted(names - set(head) - set(tail) - set(passes) - {"loss"})
    return [n for n in head + passes + tail + rest if n in names]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="fresh process pairs per backend")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--backends", nargs="+", default=["fcoll", "aot_eager"])
    ap.add_argument("--json", default="compile_time.json")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    args = ap.parse_args()

    from fcoll.testing import run_ranks

    load_before = os.getloadavg()
    runs: dict[str, list[list[dict]]] = {b: [] for b in args.backends}
    for rep in range(args.reps):
        for b in args.backends:
            per_rank = run_ranks(_rank_fn, args.nproc, backend="fcoll", args=(b,),
                                 timeout_s=args.timeout_s)
            runs[b].append(per_rank)
            print(f"rep {rep} {b:10s} first call rank 0: {per_rank[0]['first call']:.2f} s, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    load_after = os.getloadavg()

    med: dict[str, dict[str, float]] = {}
    for b, reps in runs.items():
        names = set().union(*(r[0].keys() for r in reps))
        med[b] = {n: statistics.median(r[0].get(n, 0.0) for r in reps) for n in names}
    names = _order(set().union(*(set(m) for m in med.values())))
    print(f"\nfirst call by phase, rank 0, median of {args.reps} fresh {args.nproc}-rank runs "
          f"(seconds)")
    print(f"{'phase':40s}" + "".join(f"{b:>12s}" for b in args.backends))
    for n in names:
        print(f"{n:40s}" + "".join(f"{med[b][n]:12.3f}" if n in med[b] else f"{'-':>12s}"
                                   for b in args.backends))
    ratio = None
    if "fcoll" in med and "aot_eager" in med:
        ratio = med["fcoll"]["first call"] / med["aot_eager"]["first call"]
        verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
        print(f"\nfcoll / aot_eager first call: {ratio:.2f}x (target <= {TARGET_RATIO}x): "
              f"{verdict}")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} "
          f"({os.cpu_count()} cores)")
    with open(args.json, "w") as f:
        json.dump({"reps": runs, "median_rank0": med, "ratio_first_call": ratio,
                   "target_ratio": TARGET_RATIO, "load_before": load_before,
                   "load_after": load_after, "nproc": args.nproc}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
