"""``python -m fcoll.inspect SCRIPT --out DIR [--nproc N] -- ARGS``: inspect a training script.

Runs ``SCRIPT ARGS`` on ``N`` local ranks (``python -m fcoll.launch --nproc-per-node N``, or
``torch.distributed.run --standalone`` where fcoll.launch is not installed) through the per-rank
wrapper :mod:`fcoll.inspect.rank_main`, which captures every graph ``backend="fcoll"`` compiles.
``DIR`` then holds:

- ``rank{R}/{graph}.before.txt`` / ``.after.txt``: the graph before and after the passes
  (:func:`fcoll.inspect.format_graph`);
- ``rank{R}/{graph}.collectives_before.txt``, ``.collectives.txt`` / ``.json``: collectives tables;
- ``rank{R}/{graph}.overlap.txt`` / ``.json``: the overlap report, before against after;
- ``rank{R}/{graph}.timeline_before.svg`` / ``.timeline.svg``: predicted schedules;
- ``traces/rank{R}.json``: the runtime's Chrome/Perfetto trace (open in ui.perfetto.dev);
- ``rank{R}/{graph}.saved.txt`` / ``.json``: what the forward saves for the backward (each
  value's op, shape, dtype, bytes, whether it is a collective's result such as a gathered
  parameter) and the collectives the backward re-issues (:mod:`fcoll.inspect.saved`);
- ``rank{R}/{graph}.compare.txt`` / ``.json``: measured (trace) against predicted time per
  collective (its own time, from the last rank's start to its completion) and exposed time;
- ``rank{R}/summary.json`` and ``summary.txt``: the summary printed at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
from typing import Any, Sequence

from fcoll.inspect import rank_main
from fcoll.inspect.text import fmt_bytes, fmt_us, text_table

__all__ = ["main", "launch_command", "summary_text"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fcoll.inspect",
        description="Run a script on N local ranks and write fcoll's graphs, collectives "
                    "tables, overlap reports, timelines and traces for every compiled graph.",
        epilog="Arguments after '--' go to the script.")
    p.add_argument("script", help="the Python script to run (as __main__ on every rank)")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="kill every rank after this many seconds (default: no limit)")
    return p


def launch_command(script: str, out: str, nproc: int, args: Sequence[str]) -> list[str]:
    """The command line that starts the wrapper on ``nproc`` ranks."""
    wrapper = [os.path.abspath(rank_main.__file__), "--out", out, os.path.abspath(script),
               *args]
    if importlib.util.find_spec("fcoll.launch") is not None:
        return [sys.executable, "-m", "fcoll.launch", "--nproc-per-node", str(nproc), *wrapper]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), *wrapper]


def _load_summaries(out: str) -> list[dict[str, Any]]:
    found = []
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name, rank_main.SUMMARY)
        if name.startswith("rank") and os.path.exists(path):
            with open(path) as f:
                found.append(json.load(f))
    return sorted(found, key=lambda s: s["rank"])


def _model_cell(g: dict[str, Any]) -> str:
    """``"k/n (worst r), quiet k/n"``: collectives whose predicted time is within +-30 % of
    their measured own time (:mod:`fcoll.inspect.trace_compare`), the ratio farthest from 1,
    and the same count over those that ran with little compute beside them."""
    if not g.get("model_judged"):
        return "-"
    return (f"{g['model_within']}/{g['model_judged']} (worst {g['model_worst_ratio']:.2f}), "
            f"quiet {g.get('model_quiet_within', 0)}/{g.get('model_quiet_judged', 0)}")


def summary_text(out: str) -> str:
    """A short summary of an output directory: one line per graph and rank."""
    summaries = _load_summaries(out)
    rows = []
    for s in summaries:
        for g in s["graphs"]:
            b, a = g["before"], g["after"] or g["before"]
            rows.append((s["rank"], g["name"], f"{b['n_collectives']} -> {a['n_collectives']}",
                         f"{fmt_us(b['exposed_comm_us'])} -> {fmt_us(a['exposed_comm_us'])}",
                         f"{a['overlap_ratio']:.0%}", fmt_us(g["measured_exposed_us"]),
                         _model_cell(g), fmt_bytes(g.get("saved_bytes"))))
    lines = [text_table(("rank", "graph", "collectives", "pred exposed_us", "overlap",
                         "measured exposed_us", "model +-30%", "saved for bw"), rows,
                        (True, False, True, True, True, True, True, True))]
    n_files = sum(len(files) for _, _, files in os.walk(out))
    errors = [e for s in summaries for e in s["errors"]]
    lines.append(f"{len(rows)} graph(s) on {len(summaries)} rank(s); {n_files} files in {out}")
    if errors:
        lines.append(f"{len(errors)} error(s) while inspecting; see rank*/summary.json")
    return "\n".join(lines)


def _run(cmd: list[str], env: dict[str, str], timeout_s: float | None) -> int:
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
        proc.wait()
        print(f"fcoll.inspect: killed after {timeout_s} s", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (the launcher's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, script_args = argv[:i], argv[i + 1:]
    opts = _parser().parse_args(argv)
    if not os.path.isfile(opts.script):
        print(f"fcoll.inspect: no such script: {opts.script}", file=sys.stderr)
        return 2
    out = os.path.abspath(opts.out)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("FCOLL_TRACE_DIR", os.path.join(out, rank_main.TRACES))
    rc = _run(launch_command(opts.script, out, opts.nproc, script_args), env, opts.timeout_s)
    text = summary_text(out)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    if rc != 0:
        print(f"fcoll.inspect: the script exited with status {rc}", file=sys.stderr)
    return rc
