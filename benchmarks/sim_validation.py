"""fcoll.sim against measured steps of ``examples/train_gpt.py`` (issue 16, deliverable 5).

For each ``--parallel`` mode, in one run:

1. ``1 host``: ``python -m fcoll.inspect`` runs train_gpt on 2 local ranks, writing the graphs'
   ``*.schedule.json`` and the runtime traces: the recording every prediction starts from.
2. ``2 hosts @ RATE`` for each ``--rates``: 2 emulated hosts (``fcoll.testing.hosts``, network
   namespaces joined by ``tc tbf`` links; skipped, with the reason, where the machine cannot make
   them), 1 rank each, the same script with ``--trace-dir``.

Per run it prints the measured step (train_gpt's median), the compiled graph's measured span
(median over the trace's steps after the first: what the simulator models; the rest of a step
is Python outside the graph) and two predictions from the 1-host recording: ``sim`` (the cost
model's compute and calibrated ``shm``; inter-host ``RATE,--alpha``) and ``sim+trace`` (compute
measured in that run's own trace, so only communication is predicted); with their errors. The
load average is printed before and after each run. Tracing slows a step, so the 1-host run is
also timed without it (``plain``).

    python benchmarks/sim_validation.py --parallel ddp fsdp --rates 1gbit 10gbit --json v.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fcoll.inspect.text import text_table  # noqa: E402
from fcoll.sim import Layout, simulate  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")
_STEP = re.compile(r"median step ([0-9.]+) ms")


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parallel", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    p.add_argument("--rates", nargs="*", default=["1gbit", "10gbit"])
    p.add_argument("--alpha", default="50us", help="inter-host latency given to the simulator")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timeout-s", type=int, default=550)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _script_args(opts, par: str) -> list[str]:
    return ["--steps", str(opts.steps), "--log-every", str(opts.steps), "--eval-batches", "1",
            "--parallel", par]


def _median_step_ms(text: str) -> float | None:
    found = _STEP.findall(text)
    return float(found[-1]) if found else None


def graph_span_ms(trace: str) -> float | None:
    """Median span (first compute event start to last compute event end) of the graph's
    occurrences after the first, from a runtime trace with one graph per step."""
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    comp = sorted((e for e in events if e.get("cat") == "compute"), key=lambda e: e["ts"])
    if not comp:
        return None
    starts = [i for i, e in enumerate(comp) if e["name"] == comp[0]["name"]]
    spans = [(comp[b - 1]["ts"] + comp[b - 1]["dur"] - comp[a]["ts"]) / 1e3
             for a, b in zip(starts, starts[1:] + [len(comp)])]
    return statistics.median(spans[1:] or spans)


def _run(cmd: list[str], timeout_s: int, env=None) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])}... exited {proc.returncode}: "
                           f"{proc.stderr[-2000:]}")
    return proc.stdout + proc.stderr


def _two_hosts(opts, par: str, rate: str, out: str) -> str:
    from fcoll.testing.hosts import EmulatedHosts

    with EmulatedHosts(2, rate=rate) as hosts:
        procs = hosts.launch(1, [EXAMPLE, *_script_args(opts, par), "--trace-dir",
                                 os.path.join(out, "traces")], env={"PYTHONPATH": ROOT},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        texts = [p.communicate(timeout=opts.timeout_s)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"2 hosts @ {rate}: exit codes {[p.returncode for p in procs]}: "
                               f"{texts[0][-2000:]}")
    return texts[0]


def _row(label, step, span, sim, sim_trace, load):
    def err(pred, meas):
        return f"{(pred - meas) / meas:+.0%}" if pred is not None and meas else "-"

    def ms(x):
        return "-" if x is None else f"{x:.0f}"

    return {"run": label, "measured_step_ms": step, "graph_span_ms": span, "sim_ms": sim,
            "sim_trace_ms": sim_trace, "loadavg": load,
            "cells": (label, ms(step), ms(span), ms(sim), err(sim, step), ms(sim_trace),
                      err(sim_trace, span), f"{load[0]:.1f} -> {load[1]:.1f}")}


def main(argv=None) -> int:
    opts = _parse(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fcoll-simval-") as tmp:
        for par in opts.parallel:
            rec = os.path.join(tmp, f"{par}-1host")
            load0 = os.getloadavg()[0]
            text = _run([sys.executable, "-m", "fcoll.inspect", EXAMPLE, "--out", rec,
                         "--nproc", "2", "--timeout-s", str(opts.timeout_s - 20), "--",
                         *_script_args(opts, par)], opts.timeout_s)
            trace = os.path.join(rec, "traces", "rank0.json")
            one = simulate(rec, [Layout(2, 2)]).results[0].step_us / 1e3
            one_t = simulate(rec, [Layout(2, 2)], compute="trace").results[0].step_us / 1e3
            rows.append(_row(f"{par} 1 host (traced)", _median_step_ms(text),
                             graph_span_ms(trace), one, one_t, (load0, os.getloadavg()[0])))
            load0 = os.getloadavg()[0]
            plain = _run([sys.executable, "-m", "fcoll.launch", "--nproc-per-node", "2", EXAMPLE,
                          *_script_args(opts, par)], opts.timeout_s)
            rows.append(_row(f"{par} 1 host (plain)", _median_step_ms(plain), None, one, None,
                             (load0, os.getloadavg()[0])))
            from fcoll.testing.hosts import netns_unavailable

            why = netns_unavailable() if opts.rates else None
            if why:
                print(f"2-host runs skipped: {why}")
                continue
            for rate in opts.rates:
                out = os.path.join(tmp, f"{par}-{rate}")
                load0 = os.getloadavg()[0]
                text = _two_hosts(opts, par, rate, out)
                trace2 = os.path.join(out, "traces", "rank0.json")
                inter = f"{rate},{opts.alpha}"
                lay = [Layout(2, 1)]
                sim = simulate(rec, lay, inter=inter).results[0].step_us / 1e3
                sim_t = simulate(rec, lay, inter=inter, compute="trace",
                                 trace=trace2).results[0].step_us / 1e3
                rows.append(_row(f"{par} 2 hosts @ {rate}", _median_step_ms(text),
                                 graph_span_ms(trace2), sim, sim_t,
                                 (load0, os.getloadavg()[0])))
    print(text_table(("run", "step_ms", "graph_span_ms", "sim_ms", "sim/step", "sim+trace_ms",
                      "sim+trace/span", "loadavg"), [r["cells"] for r in rows],
                     (False, True, True, True, True, True, True, False)))
    print("sim: cost-model compute, calibrated shm, inter-host RATE," + opts.alpha +
          "; sim+trace: compute measured in that run's trace; errors are (pred - meas) / meas")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "cells"} for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
