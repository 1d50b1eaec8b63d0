"""PyTorch's own DistributedDataParallel trains on fcoll's backend exactly as on gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fcoll.testing import fcoll_segments, run_ranks


def _train(rank, world, group):
    torch.manual_seed(0)  # same initial parameters on every rank (DDP broadcasts them anyway)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if rank == 0:  # make rank 0 differ, so DDP's initial broadcast is exercised
        with torch.no_grad():
            model[0].bias.add_(1.0)
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.001)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    for _ in range(5):
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _fcoll_and_gloo(rank, world):
    gl = dist.new_group(backend="gloo")
    on_fcoll = _train(rank, world, None)
    on_gloo = _train(rank, world, gl)
    for a, b in zip(on_fcoll, on_gloo):
        torch.testing.assert_close(a, b)
    return on_fcoll


def test_ddp_on_fcoll_matches_ddp_on_gloo_after_5_steps():
    r0, r1 = run_ranks(_fcoll_and_gloo, 2, timeout_s=120)
    for a, b in zip(r0, r1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # replicas stay identical
    assert fcoll_segments() == []
