"""What an fcoll op calls on its process group: the same method as PyTorch's twin op, on every
group size, and the returned ``Work`` is waited once and then released.

A recording ``ProcessGroup`` (a Python subclass of one rank, registered as a backend as a user
would register theirs) logs each method called and counts its works' waits and deletions. Each
test runs PyTorch's ``_c10d_functional`` op and fcoll's on it and compares the logs, so the
expectation is the installed torch's behaviour, not a list kept by hand. The one exception is
``all_gather_into_tensor_out``: PyTorch's looks up the group's *device* backend, which a Python
``ProcessGroup`` does not have ("No backend type associated with device type cpu"); fcoll's
makes the coalesced call of its functional twin.

A one-rank group of fcoll's own backend must run every op too (it is called now).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

import fcoll
from fcoll.testing import one_rank_group, run_ranks

_METHODS = ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
            "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
            "reduce_scatter_tensor_coalesced", "alltoall_base", "barrier")


class _CountedWork(dist.Work):
    def __init__(self, group: _RecordingGroup) -> None:
        super().__init__()
        self.group = group

    def wait(self, timeout=None) -> bool:
        self.group.waits += 1
        return True

    def __del__(self) -> None:
        self.group.dels += 1


class _RecordingGroup(dist.ProcessGroup):
    """One rank; records which method each collective calls; moves no data."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self._name = "recording"
        self.calls: list[str] = []
        self.waits = self.dels = 0

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def reset(self) -> None:
        gc.collect()
        self.calls, self.waits, self.dels = [], 0, 0


def _recorder(method: str):
    def record(self, *args, **kwargs):
        self.calls.append(method)
        return _CountedWork(self)
    record.__name__ = method
    return record


for _method in _METHODS:
    setattr(_RecordingGroup, _method, _recorder(_method))


@pytest.fixture(scope="module")
def recording():
    group = _RecordingGroup()
    with one_rank_group(group):
        yield group


def _op_calls(group: _RecordingGroup):
    """(name, call(ns)) for every collective op: ``call`` runs it in op namespace ``ns``."""
    g, x = group.group_name, torch.ones(4, 2)
    return [
        ("all_reduce", lambda ns: [ns.all_reduce(x, "sum", g)]),
        ("all_reduce_", lambda ns: [ns.all_reduce_(x.clone(), "sum", g)]),
        ("all_reduce_coalesced", lambda ns: ns.all_reduce_coalesced([x, x], "sum", g)),
        ("all_reduce_coalesced_", lambda ns: ns.all_reduce_coalesced_([x.clone()], "sum", g)),
        ("all_gather_into_tensor", lambda ns: [ns.all_gather_into_tensor(x, 1, g)]),
        ("all_gather_into_tensor_coalesced",
         lambda ns: ns.all_gather_into_tensor_coalesced([x, x], 1, g)),
        ("reduce_scatter_tensor", lambda ns: [ns.reduce_scatter_tensor(x, "sum", 1, g)]),
        ("reduce_scatter_tensor_out",
         lambda ns: [ns.reduce_scatter_tensor_out(x, "sum", 1, g, out=torch.empty(4, 2))]),
        ("reduce_scatter_tensor_coalesced",
         lambda ns: ns.reduce_scatter_tensor_coalesced([x, x], "sum", 1, g)),
        ("all_to_all_single", lambda ns: [ns.all_to_all_single(x, [4], [4], g)]),
        ("broadcast", lambda ns: [ns.broadcast(x, 0, g)]),
        ("broadcast_", lambda ns: [ns.broadcast_(x.clone(), 0, g)]),
    ]


def _run(group: _RecordingGroup, call, ns) -> list[str]:
    group.reset()
    outs = call(ns)
    calls = list(group.calls)
    for out in outs:
        ns.wait_tensor(out)
    return calls


def test_each_op_calls_the_group_method_pytorchs_op_calls_even_on_one_rank(recording):
    for name, call in _op_calls(recording):
        theirs = _run(recording, call, torch.ops._c10d_functional)
        ours = _run(recording, call, torch.ops.fcoll)
        # torch 2.13 calls all_gather_single_coalesced / reduce_scatter_single_coalesced, the
        # new names of the methods fcoll calls (both dispatch to a subclass's override of either)
        assert ours == theirs == [m for m in _METHODS if m in theirs], name


def test_all_gather_into_tensor_out_makes_the_coalesced_call(recording):
    recording.reset()
    out = torch.ops.fcoll.all_gather_into_tensor_out(torch.ones(3), 1, recording.group_name,
                                                     out=torch.empty(3))
    assert recording.calls == ["allgather_into_tensor_coalesced"]
    torch.ops.fcoll.wait_tensor(out)
    assert recording.waits == 1


@pytest.mark.parametrize("name", ["all_reduce", "broadcast", "all_gather_tensor",
                                  "reduce_scatter_tensor", "all_to_all_single"])
def test_async_tensor_waits_its_work_once_then_releases_it(recording, name):
    """The registry holds the ``Work`` until the result is waited for (gc cannot take it
    earlier), and drops it at the wait (no reference outlives it)."""
    g, x = recording.group_name, torch.ones(2, 2)
    start = {"all_reduce": lambda: fcoll.all_reduce(x, "sum", g),
             "broadcast": lambda: fcoll.broadcast(x, 0, g),
             "all_gather_tensor": lambda: fcoll.all_gather_tensor(x, 0, g),
             "reduce_scatter_tensor": lambda: fcoll.reduce_scatter_tensor(x, "sum", 0, g),
             "all_to_all_single": lambda: fcoll.all_to_all_single(x, None, None, g)}[name]
    recording.reset()
    y = start()
    assert isinstance(y, fcoll.AsyncCollectiveTensor)
    gc.collect()
    assert (recording.waits, recording.dels) == (0, 0)
    y.wait()
    assert (recording.waits, recording.dels) == (1, 1)


def _every_op_on_one_rank(rank: int, world_size: int) -> dict[str, bool]:
    g, ops = dist.group.WORLD.group_name, torch.ops.fcoll
    x = torch.arange(6.0).reshape(3, 2)
    pair = [x, x.int()]
    runs = {
        "all_reduce": lambda: [ops.all_reduce(x, "avg", g)],
        "all_reduce_coalesced": lambda: ops.all_reduce_coalesced(pair, "sum", g),
        "all_gather_into_tensor_coalesced":
            lambda: ops.all_gather_into_tensor_coalesced(pair, 1, g),
        "reduce_scatter_tensor_coalesced":
            lambda: ops.reduce_scatter_tensor_coalesced(pair, "sum", 1, g),
        "all_to_all_single": lambda: [ops.all_to_all_single(x, [3], [3], g)],
        "broadcast": lambda: [ops.broadcast(x, 0, g)],
    }
    result = {}
    for name, run in runs.items():
        outs = [ops.wait_tensor(t) for t in run()]
        result[name] = all(torch.equal(o, e) for o, e in zip(outs, pair))
    return result


@pytest.mark.parametrize("backend", ["fcoll", "gloo"])
def test_every_op_runs_on_a_one_rank_group_of_each_backend(backend):
    (result,) = run_ranks(_every_op_on_one_rank, 1, backend=backend, timeout_s=120)
    assert all(result.values()), result


def _coalesced_mixed_dtypes(rank: int, world_size: int) -> list[bool]:
    """One coalesced all_gather (one backend call) and one coalesced reduce_scatter (one call
    per dtype) over float32, int64, bool and int16 (gloo carries int16 and bool as wider
    dtypes), against values computed here."""
    g, ops = dist.group.WORLD.group_name, torch.ops.fcoll
    mine = [torch.full((2, 3), float(rank)), torch.full((4,), rank),
            torch.full((1,), rank % 2 == 0), torch.full((3,), rank, dtype=torch.int16)]
    gathered = [ops.wait_tensor(t)
                for t in ops.all_gather_into_tensor_coalesced(mine, world_size, g)]
    expected = [torch.cat([torch.full_like(x, r % 2 == 0 if x.dtype == torch.bool else r)
                           for r in range(world_size)]) for x in mine]
    rows = [torch.full((world_size * 2, 3), rank + 1.0), torch.full((world_size * 2,), rank + 1),
            torch.full((world_size * 2,), rank + 1, dtype=torch.int16)]
    scattered = [ops.wait_tensor(t)
                 for t in ops.reduce_scatter_tensor_coalesced(rows, "sum", world_size, g)]
    total = world_size * (world_size + 1) // 2
    return ([torch.equal(o, e) for o, e in zip(gathered, expected)]
            + [torch.equal(o, torch.full_like(o, total)) for o in scattered])


@pytest.mark.parametrize("backend", ["fcoll", "gloo"])
def test_coalesced_all_gather_and_reduce_scatter_of_mixed_dtypes(backend):
    for result in run_ranks(_coalesced_mixed_dtypes, 3, backend=backend, timeout_s=240):
        assert all(result), result
