"""Run one of PyTorch's own funcol test files against fcoll, with the module swapped.

PyTorch's test files are not installed with the wheel and are not part of this repository; give
the path of a copy (``test/distributed/test_functional_api.py`` or
``test_c10d_functional_native.py`` of the torch version installed)::

    python benchmarks/torch_funcol_tests.py /path/to/test_functional_api.py
    python benchmarks/torch_funcol_tests.py /path/to/test_functional_api.py --torch  # baseline

The file is copied into a temporary directory with these rewrites, and run there with pytest:

* ``import torch.distributed._functional_collectives as X`` (and ``from
  torch.distributed import _functional_collectives as X``) import ``fcoll`` as ``X``;
* ``torch.ops._c10d_functional`` becomes ``torch.ops.fcoll`` (``--keep-ops`` leaves it);

``--torch`` runs the file unchanged (what passes with PyTorch's own funcol). Output: one line per
test (``PASSED`` / ``FAILED`` / ``SKIPPED`` / ``ERROR``, with the first line of the failure), then
the counts; ``--json PATH`` writes them too. Nothing else in torch is patched: DTensor, DeviceMesh
and Dynamo keep using PyTorch's funcol, as they would in a user's process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

_IMPORTS = (
    (re.compile(r"^(\s*)import torch\.distributed\._functional_collectives as (\w+)", re.M),
     r"\1import fcoll as \2"),
    (re.compile(r"^(\s*)from torch\.distributed import _functional_collectives as (\w+)", re.M),
     r"\1import fcoll as \2"),
)
_OPS = (re.compile(r"torch\.ops\._c10d_functional\b"), "torch.ops.fcoll")


def swap(text: str, ops: bool = True) -> str:
    """``text`` with funcol's module imported as fcoll (and, if ``ops``, its op namespace)."""
    for pattern, repl in _IMPORTS:
        text = pattern.sub(repl, text)
    if ops:
        text = _OPS[0].sub(_OPS[1], text)
    return text


def run(path: str, *, torch_baseline: bool, ops: bool, timeout_s: float,
        extra: list[str], log_path: str | None = None) -> list[dict]:
    """Run the (rewritten) file with pytest (its output to ``log_path``, if given); one dict
    per test: name, outcome, message."""
    with open(path) as f:
        text = f.read()
    if not torch_baseline:
        text = swap(text, ops)
    with tempfile.TemporaryDirectory(prefix="fcoll-torch-tests-") as tmp:
        target = os.path.join(tmp, os.path.basename(path))
        with open(target, "w") as f:
            f.write(text)
        report = os.path.join(tmp, "report.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
               f"--junitxml={report}", target, *extra]
        with open(log_path or os.devnull, "w") as log:
            subprocess.run(cmd, cwd=tmp, timeout=timeout_s, check=False, stdout=log,
                           stderr=subprocess.STDOUT)
        return _parse(report)


def _parse(report: str) -> list[dict]:
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
        outcome, message = "PASSED", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "SKIPPED"}[child.tag]
                message = (child.get("message") or "").strip().splitlines()[:1]
                message = message[0][:200] if message else ""
                break
        rows.append({"test": name, "outcome": outcome, "message": message})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a copy of one of PyTorch's funcol test files")
    ap.add_argument("--torch", action="store_true", help="run it unchanged (baseline)")
    ap.add_argument("--keep-ops", action="store_true",
                    help="leave torch.ops._c10d_functional as it is")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--log", help="write pytest's output here (tracebacks)")
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = ap.parse_args(argv)
    rows = run(args.path, torch_baseline=args.torch, ops=not args.keep_ops,
               timeout_s=args.timeout_s, extra=args.pytest_args, log_path=args.log)
    for r in rows:
        print(f"{r['outcome']:8} {r['test']}  {r['message']}")
    counts = {k: sum(r["outcome"] == k for r in rows)
              for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    print(" ".join(f"{k.lower()}={v}" for k, v in counts.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"path": args.path, "torch": args.torch, "counts": counts,
                       "tests": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
