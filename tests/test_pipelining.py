"""PyTorch's pipeline parallelism (``torch.distributed.pipelining``, torchtitan's PP) on fcoll's
process group: the stages' activations and gradients travel by its point-to-point ops (batched
``isend`` / ``irecv``), and a 4-layer model split over 2 ranks gets, under GPipe and 1F1B with 4
microbatches, eager stages and stages compiled with ``backend="fcoll"``, the gradients of the
whole model run on one rank, and the loss per microbatch."""

from __future__ import annotations

import pytest
import torch

from fcoll.testing import fcoll_segments, run_ranks

MICROBATCHES = 4


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])


def _pipeline(rank, world, compiled: bool):
    """One step of each schedule on this rank's stage (layers ``2 rank``, ``2 rank + 1``);
    returns, per schedule, the largest difference of its gradients from the whole model's on
    one rank, and the losses the last stage reports."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    whole = _model()
    want_losses = []
    for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
        loss = _mse(whole(xm), ym)
        want_losses.append(loss.item())
        (loss / MICROBATCHES).backward()  # the schedules scale each microbatch's loss alike
    want = [p.grad for p in whole[2 * rank:2 * rank + 2].parameters()]
    out = {}
    for name, schedule in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        torch._dynamo.reset()
        module = _model()[2 * rank:2 * rank + 2]
        run = torch.compile(module, backend="fcoll") if compiled else module
        stage = PipelineStage(run, rank, world, torch.device("cpu"))
        step = schedule(stage, n_microbatches=MICROBATCHES, loss_fn=_mse)
        losses: list[torch.Tensor] = []
        if rank == 0:
            step.step(x)
        else:
            step.step(target=y, losses=losses)
        got = [p.grad for p in module.parameters()]
        out[name] = (max((a - b).abs().max().item() for a, b in zip(got, want)),
                     [t.item() for t in losses], want_losses)
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_pipeline_schedules_on_fcoll_match_the_whole_model(compiled):
    for rank, res in enumerate(run_ranks(_pipeline, 2, args=(compiled,), timeout_s=240)):
        for name, (grad_err, losses, want_losses) in res.items():
            assert grad_err < 1e-6, (rank, name, grad_err)
            if rank == 1:  # the last stage computes the loss
                assert losses == pytest.approx(want_losses, rel=1e-6, abs=1e-7), name
    assert fcoll_segments() == []
