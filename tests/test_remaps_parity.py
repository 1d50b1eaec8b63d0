"""``import fcoll`` leaves every other backend's graphs as PyTorch makes them (issue 28.5).

The same program runs in two fresh interpreters, one that never imports fcoll and one that does
(fcoll's import installs its Dynamo remaps and cannot be undone in-process), and each reports
the code of every graph Dynamo hands a backend, and of every forward graph AOTAutograd hands
one, for legacy ``torch.distributed`` calls and funcol calls: the ones PyTorch remaps, the ones
it graph-breaks on (``async_op=True``, broadcast, reduce, barrier) and the one it fails to trace
(an ``[n, N, *]`` output). The reports must be equal: the same graphs, split at the same calls,
with the same nodes, targets (op packets, not overloads), names and errors.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROGRAM = r'''
import json, sys, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._dynamo.backends.common import aot_autograd
from torch.testing._internal.distributed.fake_pg import FakeStore
if sys.argv[1] == "fcoll":
    import fcoll  # noqa: F401
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
g = dist.new_group([0, 1])
RO = dist.ReduceOp
calls = {
    "all_reduce": lambda x: dist.all_reduce(x, RO.MAX, g),
    "all_gather_into_tensor": lambda x: dist.all_gather_into_tensor(x.new_empty(8, 3), x),
    "all_gather_into_tensor_3d": lambda x: dist.all_gather_into_tensor(x.new_empty(2, 4, 3), x),
    "all_gather": lambda x: dist.all_gather([x.new_empty(4, 3), x.new_empty(4, 3)], x),
    "reduce_scatter_tensor": lambda x: dist.reduce_scatter_tensor(x.new_empty(2, 3), x),
    "all_to_all_single": lambda x: dist.all_to_all_single(x.new_empty(5, 3), x, [2, 3], [1, 3]),
    "all_reduce_async": lambda x: dist.all_reduce(x, async_op=True).wait(),
    "reduce_scatter_tensor_async": lambda x: dist.reduce_scatter_tensor(
        x.new_empty(2, 3), x, async_op=True).wait(),
    "broadcast": lambda x: dist.broadcast(x, 1, g),
    "reduce": lambda x: dist.reduce(x, 0),
    "barrier": lambda x: dist.barrier(),
    "funcol_all_reduce": lambda x: funcol.all_reduce(x, "sum", g),
    "funcol_all_gather_dim1_noncontig": lambda x: funcol.all_gather_tensor(x.t(), 1, g),
    "funcol_reduce_scatter_dim1": lambda x: funcol.reduce_scatter_tensor(
        x.new_ones(3, 4), "sum", 1, g),
}
out = {}
for name, call in calls.items():
    for backend in ("eager", "aot_eager"):
        graphs = []

        def keep(gm, example_inputs):
            graphs.append(gm.code)
            return gm

        def f(x):
            y = x + 1
            call(x)
            return y * 2

        torch._dynamo.reset()
        try:
            torch.compile(f, backend=keep if backend == "eager" else aot_autograd(
                fw_compiler=keep))(torch.randn(4, 3))
            error = None
        except Exception as e:  # noqa: BLE001  the error is part of the report
            error = type(e).__name__
        out[f"{name}/{backend}"] = {"graphs": graphs, "error": error}
print(json.dumps(out))
'''


def _report(mode: str) -> dict:
    run = subprocess.run([sys.executable, "-c", _PROGRAM, mode], check=True, timeout=240,
                         capture_output=True, text=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_other_backends_see_pytorchs_graphs_with_fcoll_imported():
    """``f(x) = (x + 1; <call>; y * 2)`` under ``eager`` and ``aot_eager``: each call's report
    (graphs and error) is the same in a process that imported fcoll as in one that did not;
    without the gate in ``fcoll/ops/remaps.py`` the async, broadcast, reduce, barrier and
    ``[n, N, *]`` rows compile to one graph with fcoll imported and two (or an error) without."""
    torch_report, fcoll_report = _report("torch"), _report("fcoll")
    assert sorted(fcoll_report) == sorted(torch_report)
    differ = [key for key in torch_report if fcoll_report[key] != torch_report[key]]
    assert not differ, {key: (torch_report[key], fcoll_report[key]) for key in differ}
    # The program does reach both kinds of rows: graph breaks and single graphs.
    assert len(torch_report["broadcast/eager"]["graphs"]) == 2
    assert len(torch_report["all_reduce/eager"]["graphs"]) == 1
