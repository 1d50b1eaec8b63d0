"""PyTorch's own DistributedDataParallel trains on fcoll's backend exactly as on gloo: plain,
with PyTorch's communication hooks (fp16 compression; PowerSGD, whose callbacks issue
collectives and block on their futures), and with the options a training script sets
(gradient accumulation under ``no_sync``, ``find_unused_parameters``, ``static_graph``,
``gradient_as_bucket_view``, buffers broadcast from rank 0), eager and compiled."""

from __future__ import annotations

import contextlib

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


class _Net(torch.nn.Module):
    """Linear, ReLU, optionally BatchNorm, Linear; ``unused``: a head no loss reads."""

    def __init__(self, batch_norm: bool = False, unused: bool = False):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16) if batch_norm else None
        self.l2 = torch.nn.Linear(16, 4)
        self.unused = torch.nn.Linear(16, 4) if unused else None

    def forward(self, x):
        h = torch.relu(self.l1(x))
        return self.l2(self.bn(h) if self.bn is not None else h)


#: DDP options a training script sets, each a (model kwargs, DDP kwargs, micro-steps per step)
_OPTIONS = {
    "no_sync": ({}, {}, 2),  # gradient accumulation: the first micro-step under no_sync()
    "find_unused_parameters": ({"unused": True}, {"find_unused_parameters": True}, 1),
    "static_graph": ({}, {"static_graph": True}, 1),
    "gradient_as_bucket_view": ({}, {"gradient_as_bucket_view": True}, 1),
    "broadcast_buffers": ({"batch_norm": True}, {}, 1),  # rank 1's buffers differ at first
}


def _train_with(rank, group, option: str, compiled: bool):
    """4 steps of DDP with ``option`` (:data:`_OPTIONS`) on ``group``; the module's state."""
    model_kw, ddp_kw, micro_steps = _OPTIONS[option]
    torch.manual_seed(0)
    model = _Net(**model_kw)
    if rank == 1:
        with torch.no_grad():
            for b in model.buffers():
                if b.is_floating_point():
                    b.add_(5.0)
    # several buckets, eagerly; DDP's static graph and torch.compile's DDPOptimizer assert that
    # the first bucket (1 MiB) is no larger than the others, so those keep the default cap
    small = not compiled and option != "static_graph"
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.001 if small else None, **ddp_kw)
    forward = torch.compile(ddp, backend="fcoll") if compiled else ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        for micro in range(micro_steps):
            sync = micro == micro_steps - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                forward(torch.randn(6, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _options_fcoll_and_gloo(rank, world):
    gl = dist.new_group(backend="gloo")
    states = {}
    for option in _OPTIONS:
        want = _train_with(rank, gl, option, compiled=False)
        for compiled in (False, True) if option in ("no_sync", "find_unused_parameters") \
                else (False,):
            torch._dynamo.reset()
            got = _train_with(rank, None, option, compiled)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=0, atol=0,
                                           msg=f"{option}, compiled={compiled}: {k}")
        states[option] = got
    return states


def test_ddp_options_on_fcoll_match_gloo_eager_and_compiled():
    """Each option of :data:`_OPTIONS` gives the parameters and buffers DDP gives on gloo, bit
    for bit, eager and (``no_sync``, ``find_unused_parameters``) compiled by
    ``torch.compile(ddp, backend="fcoll")``; the replicas' parameters agree."""
    r0, r1 = run_ranks(_options_fcoll_and_gloo, 2, timeout_s=300, pg_timeout_s=30)
    for option in _OPTIONS:
        for k, v in r0[option].items():
            if "running" not in k and "num_batches" not in k:  # BatchNorm's stats are local
                torch.testing.assert_close(v, r1[option][k], rtol=0, atol=0, msg=option)
    assert fcoll_segments() == []


def test_ddp_on_fcoll_matches_ddp_on_gloo_after_5_steps():
    r0, r1 = run_ranks(_fcoll_and_gloo, 2, timeout_s=120, pg_timeout_s=20)
    for a, b in zip(r0, r1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # replicas stay identical
    assert fcoll_segments() == []
