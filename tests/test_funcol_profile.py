"""torch.profiler shows every collective and every wait of a graph fcoll's executor runs.

2 ranks compile ``all_reduce -> mm -> wait`` (and an all_gather) with the fcoll backend and
profile one call: the profile holds one ``fcoll::all_reduce``, one
``fcoll::all_gather_into_tensor`` and one ``fcoll::wait_tensor`` range per wait, as it holds
``_c10d_functional::wait_tensor`` for PyTorch's own eager waits. On gloo the executor runs the
ops; on fcoll's backend it issues both collectives on the direct path
(``fcoll.compile.direct_calls``), which records the same ranges.
"""

from __future__ import annotations

import pytest

from fcoll.testing import run_ranks


def _profiled(rank, world_size):
    import torch
    import torch.distributed as dist

    import fcoll

    W = dist.group.WORLD

    def f(x, w):
        a = fcoll.all_reduce(x, "sum", W)
        g = fcoll.all_gather_tensor(x, 0, W)
        return (w @ w).sum() + a.sum() + g.sum()

    step = torch.compile(f, backend="fcoll", fullgraph=True)
    x, w = torch.ones(64, 64), torch.ones(64, 64)
    step(x, w)  # compile outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = step(x, w)
    names = [e.name for e in prof.events()]
    return float(out), {n: names.count(n) for n in set(names) if n.startswith("fcoll::")}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["gloo", "fcoll"])
def test_profile_names_every_collective_and_wait_of_a_compiled_graph(backend):
    for value, counts in run_ranks(_profiled, 2, backend=backend, timeout_s=180):
        assert value == 64 ** 3 + 2 * 64 * 64 + 2 * 64 * 64
        assert counts == {"fcoll::all_reduce": 1, "fcoll::all_gather_into_tensor": 1,
                          "fcoll::wait_tensor": 2}, counts
