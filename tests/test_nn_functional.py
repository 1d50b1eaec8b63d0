"""fcoll.nn.functional: the autograd collectives of torch.distributed.nn.functional.

On 2 ranks every function runs three ways from the same inputs: PyTorch's own
``torch.distributed.nn.functional`` (the reference, eager), fcoll's eager, and fcoll's under
``torch.compile(fullgraph=True)`` (no graph break: PyTorch's raise under compile). Values and
input gradients must match; ``reduce`` values are compared on ``dst`` only (PyTorch leaves the
other ranks unspecified).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fcoll.testing import run_ranks

CASES = ("broadcast", "gather", "scatter", "reduce", "reduce_scatter", "all_gather",
         "all_to_all", "all_to_all_single", "all_reduce")


def _program(M, case: str, xs: list[torch.Tensor], rank: int):
    """Call ``case`` of module ``M`` (torch's or fcoll's nn.functional) on leaves ``xs``;
    return (outputs, a scalar loss with rank-dependent weights)."""
    import torch.distributed as dist

    n, x = 2, xs[0]
    if case == "broadcast":
        outs = [M.broadcast(x, 1)]
    elif case == "gather":
        outs = list(M.gather(x, 1))
    elif case == "scatter":
        outs = [M.scatter(xs, 0)]
    elif case == "reduce":
        outs = [M.reduce(x, 0, dist.ReduceOp.SUM)]
    elif case == "reduce_scatter":
        outs = [M.reduce_scatter(torch.empty_like(x), xs)]
    elif case == "all_gather":
        outs = list(M.all_gather(x))
    elif case == "all_to_all":
        outs = list(M.all_to_all([torch.empty_like(t) for t in xs], xs))
    elif case == "all_to_all_single":
        splits_in, splits_out = ([1, 3], [1, 2]) if rank == 0 else ([2, 2], [3, 2])
        y = x.reshape(4, 3)
        outs = [M.all_to_all_single(y.new_empty(sum(splits_out), 3), y, splits_out, splits_in)]
    else:
        outs = [M.all_reduce(x, dist.ReduceOp.SUM)]
    loss = sum((o * (k + 1 + rank) * torch.arange(o.numel()).view(o.shape)).sum()
               for k, o in enumerate(outs))
    return outs, loss


def _run(M, case, rank, compile_backend=None):
    import torch._dynamo.testing

    xs = [torch.arange(12.0).reshape(2, 6) * (rank + 1) + j for j in range(2)]
    xs = [x.clone().requires_grad_() for x in xs]
    frames = None
    fn = _program
    if compile_backend is not None:
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend(compile_backend)
        fn = torch.compile(_program, backend=counter, fullgraph=True)
    outs, loss = fn(M, case, xs, rank)
    loss.backward()
    if compile_backend is not None:
        frames = counter.frame_count
    return ([o.detach() for o in outs],
            [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs], frames)


def _rank(rank, world_size, compile_backend, with_reference):
    import torch.distributed.nn.functional as ref

    import fcoll.nn.functional as ours

    out = {}
    for case in CASES:
        out[case] = {"eager": _run(ours, case, rank),
                     "compiled": _run(ours, case, rank, compile_backend)}
        if with_reference:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                try:
                    out[case]["torch"] = _run(ref, case, rank)
                except RuntimeError as e:  # a collective this torch's gloo lacks
                    out[case]["torch"] = repr(e)
    return out


def _compare(results, reference: str):
    for rank, res in enumerate(results):
        for case, runs in res.items():
            ref = runs[reference]
            if isinstance(ref, str):
                continue
            for name in ("eager", "compiled"):
                outs, grads, _ = runs[name]
                if not (case == "reduce" and rank != 0):
                    torch.testing.assert_close(outs, ref[0], msg=f"{case} {name} rank {rank}")
                torch.testing.assert_close(grads, ref[1], msg=f"{case} {name} grads rank {rank}")
            assert runs["compiled"][2] == 1, f"{case}: graph break"


@pytest.mark.timeout(300)
def test_values_and_gradients_match_torch_distributed_nn_on_gloo():
    results = run_ranks(_rank, 2, backend="gloo", args=("aot_eager", True), timeout_s=280)
    _compare(results, "torch")
    assert all(not isinstance(results[0][c]["torch"], str)
               for c in ("broadcast", "all_reduce", "all_gather", "all_to_all_single"))


@pytest.mark.timeout(300)
def test_compiled_on_the_fcoll_backend_matches_eager_with_no_graph_break():
    results = run_ranks(_rank, 2, backend="fcoll", args=("fcoll", False), timeout_s=280)
    _compare(results, "eager")
