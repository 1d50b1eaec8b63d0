"""PyTorch's own DistributedDataParallel trains on fcoll's backend exactly as on gloo: plain,
and with PyTorch's communication hooks (fp16 compression; PowerSGD, whose callbacks issue
collectives and block on their futures)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fcoll.testing import fcoll_segments, run_ranks


def _hook(name: str, group):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    # rank 2 approximations of the 32x16 and 4x32 weights (compressed from the third step on);
    # the biases go through the hook's uncompressed all_reduce
    return powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                       start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook


def _train(rank, world, group, hook: str | None = None, bucket_cap_mb: float = 0.001):
    torch.manual_seed(0)  # same initial parameters on every rank (DDP broadcasts them anyway)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if rank == 0:  # make rank 0 differ, so DDP's initial broadcast is exercised
        with torch.no_grad():
            model[0].bias.add_(1.0)
    ddp = DDP(model, process_group=group, bucket_cap_mb=bucket_cap_mb)  # several buckets
    if hook is not None:
        ddp.register_comm_hook(*_hook(hook, group))
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
    # PowerSGD's callbacks block on the futures of the all_reduces they issue: fcoll completed
    # futures on the thread that ran the collective, so that rank hung. A 0.002 MiB bucket
    # cap: at 0.001 MiB the gloo run itself times out in the hook.
    for hook, cap in (("fp16", 0.001), ("powersgd", 0.002)):
        hooked = _train(rank, world, None, hook, cap), _train(rank, world, gl, hook, cap)
        for a, b in zip(*hooked):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=hook)
    return on_fcoll


def test_ddp_on_fcoll_matches_ddp_on_gloo_after_5_steps():
    r0, r1 = run_ranks(_fcoll_and_gloo, 2, timeout_s=120, pg_timeout_s=20)
    for a, b in zip(r0, r1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # replicas stay identical
    assert fcoll_segments() == []
