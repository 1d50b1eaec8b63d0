"""The IPC path's one-kernel fold (:mod:`fcoll.shm.cuda.fold`) on the CPU.

The kernel's math runs under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors) in a
fresh interpreter, against :func:`fcoll.ops.reduce.reduce_views_into` for every dtype the
kernel takes, every reduce op the CPU path accepts for it, and 2, 3, 5 and 8 operands, and
``avg`` the way torch computes it on CUDA (times the rounded reciprocal of n). Sums,
products, averages and the bitwise ops must give the same bits; min and max the same values
(ties between -0 and +0 and NaN payloads are unspecified: torch's own vectorized and scalar
CPU kernels disagree on them). Skipped where Triton is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fcoll.ops.reduce import reduce_views_into
from fcoll.shm.cuda.fold import ENV, MAX_OPERANDS, fold_supported, fold_views_into

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHECK = r"""
import json, os, torch
from fcoll.ops.reduce import REDUCE_OPS, check_reduce_op, reduce_views_into
from fcoll.shm.cuda.fold import DTYPES, fold_supported, fold_views_into

def operands(n, dt, g):
    if dt == torch.bool:
        return [torch.randint(0, 2, (2500,), generator=g).bool() for _ in range(n)]
    if dt.is_floating_point:
        vs = [(torch.randn(2500, generator=g) * 10).to(dt) for _ in range(n)]
        vs[0][:5] = torch.tensor([float("nan"), -0.0, 0.0, 1.0, 3e38 if dt != torch.float16 else 6e4])
        vs[1][:5] = torch.tensor([1.0, 0.0, -0.0, float("nan"), 3e38 if dt != torch.float16 else 6e4])
        return vs
    info = torch.iinfo(dt)  # the whole range: sums and products wrap
    return [torch.randint(info.min, info.max, (2500,), generator=g, dtype=torch.int64).to(dt)
            for _ in range(n)]

bad, runs = [], 0
for n in (2, 3, 5, 8):
    for dt in DTYPES:
        for op in REDUCE_OPS:
            if check_reduce_op(op, dt) is not None:
                continue
            vs = operands(n, dt, torch.Generator().manual_seed(n * 100 + len(bad)))
            want = torch.empty_like(vs[0])
            reduce_views_into(vs, op, want)
            got = torch.empty_like(vs[0])
            why = fold_supported(vs, op, got)
            if why is not None:
                bad.append(f"{n} {dt} {op}: not used: {why}")
                continue
            fold_views_into(vs, op, got)
            runs += 1
            if dt.is_floating_point and op in ("min", "max"):
                same = bool(((got == want) | (got.isnan() & want.isnan())).all())
            elif dt.is_floating_point:  # the same NaNs, and the same bits elsewhere
                nan = got.isnan()
                same = (torch.equal(nan, want.isnan()) and torch.equal(got[~nan], want[~nan])
                        and torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan])))
            else:
                same = torch.equal(got, want)
            if not same:
                bad.append(f"{n} {dt} {op}: {int((got != want).sum())} of {got.numel()} differ")

# CUDA's avg: torch multiplies the sum by 1/n rounded once in the compute type (float32 for
# float16/bfloat16); the kernel's reciprocal mode against that formula, written out here
for n in (2, 3, 5, 8):
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        vs = operands(n, dt, torch.Generator().manual_seed(n))
        total = torch.empty_like(vs[0])
        reduce_views_into(vs, "sum", total)
        compute = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
        inv = torch.ones((), dtype=compute) / torch.tensor(n, dtype=compute)
        want = (total.to(compute) * inv).to(dt)
        got = torch.empty_like(vs[0])
        fold_views_into(vs, "avg", got, avg_by_reciprocal=True)
        runs += 1
        nan = got.isnan()
        if not (torch.equal(nan, want.isnan()) and torch.equal(got[~nan], want[~nan])):
            bad.append(f"{n} {dt} avg by reciprocal: {int((got != want).sum())} differ")
print(json.dumps({"bad": bad, "runs": runs}))
"""


def test_kernel_matches_the_torch_fold_for_every_dtype_op_and_rank_count():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", **{ENV: "1"},
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["bad"] == []
    assert res["runs"] >= 4 * 60 + 16  # every (operand count, dtype, op) the CPU path accepts


def test_fold_is_used_only_where_it_applies(monkeypatch):
    """The capability check names why the kernel is not used; the torch fold then runs."""
    v = [torch.ones(8), torch.ones(8)]
    out = torch.empty(8)
    monkeypatch.delenv(ENV, raising=False)
    assert fold_supported(v, "sum", out) == f"{ENV} is not 1"
    monkeypatch.setenv(ENV, "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert fold_supported(v, "sum", out) == "CPU tensors outside TRITON_INTERPRET=1"
    assert "operands" in fold_supported([torch.ones(8)] * (MAX_OPERANDS + 1), "sum", out)
    c = [torch.ones(8, dtype=torch.complex64)] * 2
    assert "complex64" in fold_supported(c, "sum", torch.empty(8, dtype=torch.complex64))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    strided = [torch.ones(16)[::2], torch.ones(8)]
    assert fold_supported(strided, "sum", out) == "a non-contiguous operand"
    monkeypatch.delenv("TRITON_INTERPRET")
    fold_views_into([torch.arange(8.0), torch.ones(8), torch.full((8,), 2.0)], "avg", out)
    want = torch.empty(8)
    reduce_views_into([torch.arange(8.0), torch.ones(8), torch.full((8,), 2.0)], "avg", want)
    assert torch.equal(out, want)
