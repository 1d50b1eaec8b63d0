"""Run one of PyTorch's own funcol test files against fcoll, with the module swapped.

PyTorch's test files are not installed with the wheel and are not part of this repository; give
the path of a copy (``test/distributed/test_functional_api.py`` or
``test_c10d_functional_native.py`` of the torch version installed), kept in a folder beside the
helpers it loads by path (``test_c10d_functional_native.py`` loads
``inductor/test_aot_inductor_utils.py``), as in PyTorch's ``test/`` tree::

    python benchmarks/torch_funcol_tests.py /path/to/test_functional_api.py
    python benchmarks/torch_funcol_tests.py /path/to/test_functional_api.py --torch  # baseline

The file is copied into a temporary directory with these rewrites, and run there with pytest:

* ``import torch.distributed._functional_collectives as X`` (and ``from
  torch.distributed import _functional_collectives as X``) import ``fcoll`` as ``X``, and
  ``from torch.distributed._functional_collectives import NAMES`` imports them from ``fcoll``;
* ``torch.ops._c10d_functional`` becomes ``torch.ops.fcoll`` (``--keep-ops`` leaves it);

``--torch`` runs the file unchanged (what passes with PyTorch's own funcol). Output: one line per
test (``PASSED`` / ``FAILED`` / ``SKIPPED`` / ``ERROR``, with the first line of the failure), then
the counts; ``--json PATH`` writes them too; arguments after ``--`` go to pytest
(``-- -k "not TestWithNCCL"``). ``--compare`` runs the file both ways, one after
the other, and prints one row per test: its outcome on torch and on fcoll, and a verdict, where
a test that passes on torch and not on fcoll is either an fcoll bug or one of the
:data:`EXCEPTIONS` (tests of funcol's private helpers or of registries inside c10d or Inductor,
with the reason); the exit status is 1 if any test is an fcoll bug. Nothing else in torch is
patched: DTensor, DeviceMesh and Dynamo keep using PyTorch's funcol, as they would in a user's
process.
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
    (re.compile(r"^(\s*)import torch\.distributed\._functional_collectives as (\w+)", re.MULTILINE),
     r"\1import fcoll as \2"),
    (re.compile(r"^(\s*)from torch\.distributed import _functional_collectives as (\w+)", re.MULTILINE),
     r"\1import fcoll as \2"),
    (re.compile(r"^(\s*)from torch\.distributed\._functional_collectives import\b", re.MULTILINE),
     r"\1from fcoll import"),
)
_OPS = (re.compile(r"torch\.ops\._c10d_functional\b"), "torch.ops.fcoll")


#: Tests that pass on PyTorch's funcol and may fail on fcoll, by design, with the reason.
EXCEPTIONS = {
    "CompileTestCPU.test_inductor_all_reduce_cpu":
        "asserts Inductor's code for _c10d_functional ops: its re-inplacing table "
        "(all_reduce -> all_reduce_) and AOTInductor's C shims "
        "(aoti_torch_cpu__c10d_functional_*), both keyed on PyTorch's op namespace",
}


def verdict(test: str, on_torch: str, on_fcoll: str) -> str:
    """``ok``, ``exception: <reason>`` or ``FCOLL BUG`` for one test's two outcomes."""
    if on_torch != "PASSED" or on_fcoll == "PASSED":
        return "ok"
    if test in EXCEPTIONS:
        return f"exception: {EXCEPTIONS[test]}"
    return "FCOLL BUG"


def swap(text: str, ops: bool = True) -> str:
    """``text`` with funcol's module imported as fcoll (and, if ``ops``, its op namespace)."""
    for pattern, repl in _IMPORTS:
        text = pattern.sub(repl, text)
    if ops:
        text = _OPS[0].sub(_OPS[1], text)
    return text


_ACCELERATOR_ONLY = (
    (re.compile(r'^DEVICE = "cuda"$', re.MULTILINE), 'DEVICE = "cpu"'),
    (re.compile(r"^BACKEND = dist\.Backend\.NCCL$", re.MULTILINE), "BACKEND = {backend!r}"),
)


def on_cpu_backend(text: str, backend: str) -> str:
    """``text`` with its accelerator-only classes on a real backend (``DistributedTestBase``,
    ``DEVICE``, ``BACKEND``, as ``test_functional_api.py`` has them) run on CPU with process
    group ``backend`` ("gloo" or "fcoll"): ``DEVICE`` becomes "cpu", ``BACKEND`` the backend,
    and ``DistributedTestBase.backend`` answers it for every device (fcoll imported first, so
    the backend is registered in each spawned rank; the funcol module stays what the rest of
    the rewrite makes it)."""
    for pattern, repl in _ACCELERATOR_ONLY:
        text = pattern.sub(repl.format(backend=backend), text)
    patch = ("import fcoll as _fcoll_registers_its_backend  # noqa: E402,F401\n"
             "from torch.testing._internal.common_distributed import DistributedTestBase\n"
             f"DistributedTestBase.backend = lambda self, device: {backend!r}\n\n\n")
    main = text.find('if __name__ == "__main__":')   # before run_tests() spawns anything
    return text + "\n\n" + patch if main < 0 else text[:main] + patch + text[main:]


def run(path: str, *, torch_baseline: bool, ops: bool, timeout_s: float,
        extra: list[str], log_path: str | None = None,
        cpu_backend: str | None = None) -> list[dict]:
    """Run the (rewritten) file with pytest (its output to ``log_path``, if given); one dict
    per test: name, outcome, message. ``cpu_backend``: see :func:`on_cpu_backend`."""
    with open(path) as f:
        text = f.read()
    if not torch_baseline:
        text = swap(text, ops)
    if cpu_backend:
        text = on_cpu_backend(text, cpu_backend)
    with tempfile.TemporaryDirectory(prefix="fcoll-torch-tests-") as tmp:
        target = _mirror_test_tree(path, tmp)
        with open(target, "w") as f:
            f.write(text)
        report = os.path.join(tmp, "report.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
               f"--junitxml={report}", target, *extra]
        with open(log_path or os.devnull, "w") as log:
            subprocess.run(cmd, cwd=tmp, timeout=timeout_s, check=False, stdout=log,
                           stderr=subprocess.STDOUT)
        return _parse(report)


def _mirror_test_tree(path: str, tmp: str) -> str:
    """Where to write the copy of ``path`` inside ``tmp``: ``tmp/<its folder's name>/<its name>``,
    with every sibling folder of its folder linked beside it, so that helpers the file loads
    from PyTorch's ``test/`` tree by path (``load_test_module("inductor.test_aot_inductor_utils")``
    looks in ``Path(__file__).parent.parent``) are found as in a checkout."""
    folder = os.path.dirname(os.path.abspath(path))
    tree = os.path.dirname(folder)
    os.mkdir(os.path.join(tmp, os.path.basename(folder)))
    for name in os.listdir(tree):
        source = os.path.join(tree, name)
        if (name != os.path.basename(folder) and os.path.isdir(source)
                and not os.path.samefile(source, tmp)):
            os.symlink(source, os.path.join(tmp, name))
    return os.path.join(tmp, os.path.basename(folder), os.path.basename(path))


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
    ap.add_argument("--cpu-backend", choices=("gloo", "fcoll"),
                    help="run the accelerator-only classes on CPU with this process group "
                         "backend (see on_cpu_backend)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--log", help="write pytest's output here (tracebacks)")
    ap.add_argument("--compare", action="store_true",
                    help="run on torch and on fcoll, one row per test with a verdict")
    args, pytest_args = ap.parse_known_args(argv)
    args.pytest_args = [a for a in pytest_args if a != "--"]
    if args.compare:
        return _compare(args)
    rows = run(args.path, torch_baseline=args.torch, ops=not args.keep_ops,
               timeout_s=args.timeout_s, extra=args.pytest_args, log_path=args.log,
               cpu_backend=args.cpu_backend)
    for r in rows:
        print(f"{r['outcome']:8} {r['test']}  {r['message']}")
    counts = _counts(rows)
    print(" ".join(f"{k.lower()}={v}" for k, v in counts.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"path": args.path, "torch": args.torch, "counts": counts,
                       "tests": rows}, f, indent=1)
    return 0


def _counts(rows: list[dict]) -> dict[str, int]:
    return {k: sum(r["outcome"] == k for r in rows)
            for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}


def _compare(args: argparse.Namespace) -> int:
    sides = {}
    for side in ("torch", "fcoll"):
        log = f"{args.log}.{side}" if args.log else None
        sides[side] = {r["test"]: r for r in run(
            args.path, torch_baseline=side == "torch", ops=not args.keep_ops,
            timeout_s=args.timeout_s, extra=args.pytest_args, log_path=log,
            cpu_backend=args.cpu_backend)}
    tests = list(dict.fromkeys([*sides["torch"], *sides["fcoll"]]))
    rows = []
    for test in tests:
        on = {s: sides[s].get(test, {"outcome": "MISSING", "message": ""}) for s in sides}
        rows.append({"test": test, "torch": on["torch"]["outcome"],
                     "fcoll": on["fcoll"]["outcome"], "fcoll_message": on["fcoll"]["message"],
                     "verdict": verdict(test, on["torch"]["outcome"], on["fcoll"]["outcome"])})
    width = max((len(t) for t in tests), default=4)
    print(f"{'test':{width}}  {'torch':8} {'fcoll':8} verdict")
    for r in rows:
        print(f"{r['test']:{width}}  {r['torch']:8} {r['fcoll']:8} {r['verdict']}"
              + (f"  ({r['fcoll_message']})" if r["verdict"] == "FCOLL BUG" else ""))
    counts = {s: _counts(list(sides[s].values())) for s in sides}
    for s, c in counts.items():
        print(f"{s:6} " + " ".join(f"{k.lower()}={v}" for k, v in c.items()))
    bugs = [r["test"] for r in rows if r["verdict"] == "FCOLL BUG"]
    exceptions = [r["test"] for r in rows if r["verdict"].startswith("exception")]
    print(f"fcoll bugs: {len(bugs)}, exceptions: {len(exceptions)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"path": args.path, "counts": counts, "bugs": bugs,
                       "exceptions": exceptions, "tests": rows}, f, indent=1)
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
