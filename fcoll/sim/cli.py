"""``python -m fcoll.sim DIR --ranks 2,4,64,4096 --hosts-of 8 --intra shm --inter 100gbit,5us``.

Reads the ``*.schedule.json`` files ``python -m fcoll.inspect`` wrote (``DIR/rank0/``), prints
per layout the step time, communication, exposed communication and peak memory with the
assumptions, and optionally writes ``--json`` and ``--plot`` (SVG).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from fcoll.sim.report import plot_svg
from fcoll.sim.simulate import ALGORITHM_CHOICES, COMPUTE_CHOICES, simulate

__all__ = ["main", "parse_ranks"]


def parse_ranks(text: str) -> list[int]:
    """``'2,4,64'`` -> ``[2, 4, 64]``.

    Raises:
        ValueError: naming ``--ranks``: an entry that is not a positive integer.
    """
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--ranks: expected positive integers separated by commas, got "
                             f"{part!r} in {text!r}")
        out.append(int(part))
    return out


def _outside_arg(text: str) -> str | float:
    """``--outside``: a keyword, or microseconds (ValueError naming ``--outside``)."""
    if text in ("auto", "trace", "none"):
        return text
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--outside: expected auto, trace, none or microseconds, got "
                         f"{text!r}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fcoll.sim",
        description="Simulate a compiled step (graphs written by python -m fcoll.inspect) on "
                    "other world sizes: step time, communication, exposed communication, "
                    "peak memory.")
    p.add_argument("dir", help="fcoll.inspect output directory (or a folder / file of "
                               "*.schedule.json)")
    p.add_argument("--ranks", default="2,4,64,4096", help="world sizes, comma separated")
    p.add_argument("--hosts-of", type=int, default=8, help="ranks per host (default 8)")
    p.add_argument("--intra", default="shm",
                   help="intra-host link: 'shm' (fcoll's shared memory model) or "
                        "'BANDWIDTH,LATENCY' (default shm)")
    p.add_argument("--inter", default="100gbit,5us",
                   help="inter-host link per rank, 'BANDWIDTH,LATENCY': units gbit, mbit, "
                        "GB/s, MB/s and ns, us, ms (default 100gbit,5us)")
    p.add_argument("--algorithm", choices=ALGORITHM_CHOICES, default="auto",
                   help="collective algorithm (default auto: the fastest per collective)")
    p.add_argument("--rank", type=int, default=0, help="whose graphs to read (default 0)")
    p.add_argument("--graphs", default=None, help="regex: only these graphs' files")
    p.add_argument("--compute", choices=COMPUTE_CHOICES, default="auto",
                   help="compute times: the cost model's (predicted), measured per node in "
                        "DIR/traces/rank{R}.json (trace), or trace where there is one (auto, "
                        "the default)")
    p.add_argument("--outside", default="auto",
                   help="step time outside the compiled graphs: auto (measured in the trace "
                        "where there is one, else 0), trace, none, or microseconds")
    p.add_argument("--trace", default=None, help="the trace for --compute / --outside")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--plot", default=None, help="write an SVG of step and exposed time here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns 0, or 2 on bad arguments (the message names the argument)."""
    opts = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        report = simulate(opts.dir, parse_ranks(opts.ranks), intra=opts.intra,
                          inter=opts.inter, algorithm=opts.algorithm,
                          ranks_per_host=opts.hosts_of, rank=opts.rank, graphs=opts.graphs,
                          compute=opts.compute, trace=opts.trace,
                          outside=_outside_arg(opts.outside))
    except ValueError as e:
        print(f"fcoll.sim: {e}", file=sys.stderr)
        return 2
    print(report)
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump(report.as_dict(), f, indent=1)
    if opts.plot:
        with open(opts.plot, "w", encoding="utf-8") as f:
            f.write(plot_svg(report, f"fcoll.sim: {', '.join(report.programs)}"))
    return 0
