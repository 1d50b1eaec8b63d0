"""examples/train_gpt.py's step on fcoll's backend and on gloo, quiet and under load, side by side.

Usage: ``python benchmarks/train_step_load.py [--loads 0 2] [--parallel ddp fsdp] [--steps 20]
[--rounds 2] [--json out.json]``.

For each ``--loads`` value N (issue #17: "train_gpt.py step time with --background-load 2 on
fcoll's backend and on gloo, side by side"), N busy processes run for the whole measurement
(:class:`collectives.BackgroundLoad`: one core each, ended by this script), and train_gpt's
compiled step runs on 2 local ranks (``python -m fcoll.launch``) with ``--dist-backend fcoll``
and ``--dist-backend gloo`` in turn, ``--rounds`` times each, the order alternating per round
(fcoll first, then gloo first, ...) so a drift of the machine's load lands on both. Both use the
same compiled step (``torch.compile(backend="fcoll")``, the same passes); only the process
group differs. Each run's number is train_gpt's median step (ms, the compiling first step
left out); the table gives the median over rounds per backend, gloo / fcoll (above 1: fcoll
faster), and the 1-minute load average at the start and end of each load's runs.

JSON (``--json``): ``{"rows": [{"load", "parallel", "fcoll_ms", "gloo_ms", "runs",
"gloo_over_fcoll", "loadavg"}], "cores", "steps"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from collectives import BackgroundLoad, _sigterm_raises  # noqa: E402  (this folder)
from sim_validation import EXAMPLE, _run, median_step_ms, script_args  # noqa: E402

BACKENDS = ("fcoll", "gloo")


def run_step(par: str, backend: str, steps: int, nproc: int, timeout_s: int) -> float:
    """train_gpt on ``nproc`` local ranks with ``--dist-backend backend``: its median step (ms).

    Raises:
        RuntimeError: the run failed or printed no median step.
    """
    text = _run([sys.executable, "-m", "fcoll.launch", "--nproc-per-node", str(nproc), EXAMPLE,
                 *script_args(par, steps, backend)], timeout_s)
    ms = median_step_ms(text)
    if ms is None:
        raise RuntimeError(f"train_gpt --parallel {par} --dist-backend {backend} printed no "
                           f"median step: {text[-1000:]}")
    return ms


def order(round_index: int) -> tuple[str, ...]:
    """The backends' order in round ``round_index``: fcoll first in even rounds."""
    return BACKENDS if round_index % 2 == 0 else BACKENDS[::-1]


def summarize(load: int, par: str, runs: dict[str, list[float]],
              loadavg: tuple[float, float]) -> dict:
    """One table row from each backend's median steps (ms) over the rounds."""
    med = {b: statistics.median(runs[b]) for b in BACKENDS}
    return {"load": load, "parallel": par, "fcoll_ms": med["fcoll"], "gloo_ms": med["gloo"],
            "runs": runs, "gloo_over_fcoll": med["gloo"] / med["fcoll"], "loadavg": loadavg}


def table(rows: list[dict]) -> str:
    lines = [f"{'busy procs':>10s} {'parallel':>8s} {'fcoll ms':>9s} {'gloo ms':>9s} "
             f"{'gloo/fcoll':>10s}  1-min load"]
    for r in rows:
        lines.append(f"{r['load']:10d} {r['parallel']:>8s} {r['fcoll_ms']:9.1f} "
                     f"{r['gloo_ms']:9.1f} {r['gloo_over_fcoll']:9.2f}x  "
                     f"{r['loadavg'][0]:.1f} -> {r['loadavg'][1]:.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loads", nargs="+", type=int, default=[0, 2],
                   help="busy background processes per measurement")
    p.add_argument("--parallel", nargs="+", default=["ddp"], choices=["ddp", "fsdp"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout-s", type=int, default=400, help="per train_gpt run")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    print(f"# train_gpt step, {args.nproc} ranks, {os.cpu_count()} cores, {args.steps} steps "
          f"per run, {args.rounds} rounds per backend; 1-min load "
          f"{os.getloadavg()[0]:.2f} before", flush=True)
    rows = []
    with _sigterm_raises():
        for load in args.loads:
            with BackgroundLoad(load):
                for par in args.parallel:
                    load0 = os.getloadavg()[0]
                    runs: dict[str, list[float]] = {b: [] for b in BACKENDS}
                    for r in range(args.rounds):
                        for backend in order(r):
                            ms = run_step(par, backend, args.steps, args.nproc, args.timeout_s)
                            runs[backend].append(ms)
                            print(f"[{load} busy, {par}] {backend}: median step {ms} ms",
                                  flush=True)
                    rows.append(summarize(load, par, runs, (load0, os.getloadavg()[0])))
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "cores": os.cpu_count(), "steps": args.steps}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
