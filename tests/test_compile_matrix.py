"""Compiled gradients equal eager ones under every way people compile (issue 28).

One 2-rank job per process-group backend (fcoll's and gloo) runs every case and returns the
largest gradient difference of each, so the matrix costs two process starts:

- where the collective sits: inside an activation-checkpointed region, between two regions,
  in a region nested in another, or with no checkpointing;
- how the step is compiled: ``backend="fcoll"`` with ``compute="eager"`` and ``"inductor"``,
  PyTorch's ``aot_eager`` and ``inductor``.

The same job runs issue 28.1's program as reported (``torch.autograd.grad`` and the
gradients' ``all_reduce(avg)`` inside the compiled function) under three compilers, compiles
SimpleFSDP with an uneven shard (a vocabulary of 65 over 2 ranks) with the default options, and
checks that a collective never reads its input after the op returns (a defect found while
looking for 28.1's cause, not shown to be it: docs/design.md): with the collective slowed
down, each op's input is overwritten right after the call, as a caller or a compiler reusing
the buffer may, and the result must still be the collective of the original values.

PyTorch's on-disk compile caches key fcoll's ops by name only; ``fcoll.ops.cache_key`` tags
their keys in a process whose fcoll version is not the only one that compiled in the cache
directory, so another checkout's artifacts are never run here.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from fcoll.testing import run_ranks, slow_collectives

PLACEMENTS = ("inside", "between", "nested", "none")
COMPILERS = (("fcoll", "eager"), ("fcoll", "inductor"), ("aot_eager", None), ("inductor", None))
DELAY_S = 0.05
REPORTED_STEPS = 3


def _loss(placement: str, x, w1, w2, w3, group):
    import fcoll
    from torch.utils.checkpoint import checkpoint

    def ar(h):
        return fcoll.all_reduce(h, "sum", group)

    def first(x, reduce):
        h = x @ w1
        return torch.nn.functional.gelu(ar(h) if reduce else h) @ w2

    def second(h):
        return torch.tanh(h @ w3)

    if placement == "inside":
        h = checkpoint(first, x, True, use_reentrant=False)
        out = checkpoint(second, h, use_reentrant=False)
    elif placement == "between":
        h = checkpoint(first, x, False, use_reentrant=False)
        out = checkpoint(second, ar(h), use_reentrant=False)
    elif placement == "nested":
        def outer(x):
            return second(checkpoint(first, x, True, use_reentrant=False))
        out = checkpoint(outer, x, use_reentrant=False)
    else:
        out = second(first(x, True))
    return out.pow(2).sum()


def _grads(fn, placement, x, ws, group):
    ws = [w.detach().clone().requires_grad_() for w in ws]
    fn(placement, x, *ws, group).backward()
    return [w.grad for w in ws]


def _ownership(rank: int, world: int) -> dict[str, float]:
    """Each collective of an input overwritten right after the call: its error."""
    name = dist.group.WORLD.group_name
    ops = torch.ops.fcoll
    x = torch.arange(8, dtype=torch.float32) + 10 * rank
    cases = {
        "all_reduce": (lambda t: ops.all_reduce(t, "sum", name),
                       lambda: sum(torch.arange(8.0) + 10 * r for r in range(world))),
        "all_reduce_coalesced": (lambda t: ops.all_reduce_coalesced([t], "sum", name)[0],
                                 lambda: sum(torch.arange(8.0) + 10 * r for r in range(world))),
        "all_gather_into_tensor": (lambda t: ops.all_gather_into_tensor(t, world, name),
                                   lambda: torch.cat([torch.arange(8.0) + 10 * r
                                                      for r in range(world)])),
        "reduce_scatter_tensor": (lambda t: ops.reduce_scatter_tensor(t, "sum", world, name),
                                  lambda: sum(torch.arange(8.0) + 10 * r
                                              for r in range(world)).chunk(world)[rank]),
        "all_to_all_single": (lambda t: ops.all_to_all_single(t, [8 // world] * world,
                                                              [8 // world] * world, name),
                              lambda: torch.cat([(torch.arange(8.0) + 10 * r).chunk(world)[rank]
                                                 for r in range(world)])),
    }
    out = {}
    for op, (call, expected) in cases.items():
        t = x.clone()
        result = call(t)
        t.fill_(1000.0)   # the caller owns its input again
        out[op] = (ops.wait_tensor(result) - expected()).abs().max().item()
    return out


def _uneven_fsdp(rank: int, world: int) -> dict[str, float]:
    """SimpleFSDP (torchtitan's compiled FSDP): DTensor parameters ``Shard(0)`` with a
    vocabulary of 65 rows over 2 ranks (33 and 32: the short shard is padded before its
    all_gather on rank 1 only), each read as ``redistribute(Replicate()).to_local()``;
    ``backend="fcoll"`` with the default options. Returns each gradient's error against eager."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    vocab, dim = 65, 16
    params = {name: torch.nn.Parameter(distribute_tensor(
        torch.randn(rows, dim, generator=gen) * 0.1, mesh, [Shard(0)]))
        for name, rows in (("emb", vocab), ("w1", dim), ("w2", dim), ("out", vocab))}

    def gathered(p):
        return p.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial("sum")])

    def loss(tok):
        h = torch.nn.functional.embedding(tok, gathered(params["emb"]))
        h = torch.relu(h @ gathered(params["w1"]).t())
        h = torch.relu(h @ gathered(params["w2"]).t())
        logits = h @ gathered(params["out"]).t()
        return torch.nn.functional.cross_entropy(logits.view(-1, vocab), tok.view(-1))

    tok = torch.randint(0, vocab, (4, 8), generator=torch.Generator().manual_seed(rank))
    loss(tok).backward()
    expected = {k: p.grad.full_tensor() for k, p in params.items()}
    for p in params.values():
        p.grad = None
    torch._dynamo.reset()
    torch.compile(loss, backend="fcoll")(tok).backward()
    return {k: (p.grad.full_tensor() - expected[k]).abs().max().item()
            for k, p in params.items()}


def reported_step(x, w1, w2, w3, group):
    """Issue 28.1's program as reported: the whole step compiled, ``torch.autograd.grad``
    inside it (Dynamo breaks the graph there on 2.13: forward and backward compiled, then a
    graph of the gradients' all_reduces), then ``fcoll.all_reduce(avg)`` of each gradient.
    ``benchmarks/compile_stress.py`` loops it (its ``ckpt-*`` cases)."""
    import fcoll
    from torch.utils.checkpoint import checkpoint

    def first(x):
        return torch.nn.functional.gelu(fcoll.all_reduce(x @ w1, "sum", group)) @ w2

    def second(h):
        return torch.tanh(h @ w3)

    loss = checkpoint(second, checkpoint(first, x, use_reentrant=False),
                      use_reentrant=False).sum()
    grads = torch.autograd.grad(loss, [w1, w2, w3])
    return [fcoll.all_reduce(g, "avg", group) for g in grads]


def _reported(x, ws, group) -> dict[str, float]:
    """The largest gradient error of :func:`reported_step` against eager, per compiler, over
    ``REPORTED_STEPS`` calls of one compiled function (the first compiles, the rest reuse)."""
    import fcoll

    ws = [w.detach().clone().requires_grad_() for w in ws]
    expected = [fcoll.wait_tensor(g) for g in reported_step(x, *ws, group)]
    errors = {}
    for backend in ("inductor", "aot_eager", "fcoll"):
        torch._dynamo.reset()
        step = torch.compile(reported_step, backend=backend)
        errors[backend] = max((fcoll.wait_tensor(a) - b).abs().max().item()
                              for _ in range(REPORTED_STEPS)
                              for a, b in zip(step(x, *ws, group), expected))
    return errors


def _matrix(rank: int, world: int) -> dict:
    slow_collectives(DELAY_S)
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(16, 16, generator=gen) * 0.3 for _ in range(3)]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank + 1))
    errors = {}
    for placement in PLACEMENTS:
        expected = _grads(_loss, placement, x, ws, group)
        for backend, compute in COMPILERS:
            torch._dynamo.reset()
            kw = {"options": {"compute": compute}} if compute else {}
            fn = torch.compile(_loss, backend=backend, **kw)
            got = _grads(fn, placement, x, ws, group)
            errors[f"{placement}/{backend}/{compute}"] = max(
                (a - b).abs().max().item() for a, b in zip(got, expected))
    return {"errors": errors, "reported": _reported(x, ws, group),
            "ownership": _ownership(rank, world),
            "uneven_fsdp": _uneven_fsdp(rank, world)}


@pytest.fixture(scope="module", params=["fcoll", "gloo"])
def matrix(request):
    return run_ranks(_matrix, 2, backend=request.param, timeout_s=600)


def test_compiled_gradients_equal_eager_in_every_placement_and_compiler(matrix):
    for res in matrix:
        bad = {k: v for k, v in res["errors"].items() if not v <= 1e-5}
        assert not bad, bad
        assert len(res["errors"]) == len(PLACEMENTS) * len(COMPILERS)


def test_reported_checkpointed_step_with_grad_inside_equals_eager(matrix):
    """Issue 28.1's program (checkpointed regions, an all_reduce inside the first,
    ``torch.autograd.grad`` and ``all_reduce(avg)`` of the gradients inside the compiled
    function) under ``backend="inductor"``, ``"aot_eager"`` and ``"fcoll"``, collectives
    slowed down, several calls: gradients equal eager on every rank.

    This does not fail with the ownership fix reverted: in Inductor's code for this program
    every fcoll collective is followed at once by its ``wait_tensor``, and no kernel writes a
    collective's input in between (docs/design.md, "Compiled by anyone else"); the race that
    fix closed is pinned by the ownership test below."""
    for res in matrix:
        bad = {k: v for k, v in res["reported"].items() if not v <= 1e-5}
        assert not bad, bad
        assert sorted(res["reported"]) == ["aot_eager", "fcoll", "inductor"]


def test_collective_never_reads_its_input_after_the_op_returns(matrix):
    for res in matrix:
        bad = {k: v for k, v in res["ownership"].items() if not v == 0.0}
        assert not bad, bad
        assert all(not math.isnan(v) for v in res["ownership"].values())


def test_uneven_shards_compile_with_default_options(matrix):
    """Ranks whose graphs differ by an uneven shard's padding apply one bucket plan: the padding
    rank hoists its input preparation (``fcoll.passes.rewrites.shared_plan``) instead of raising
    ``BucketPlanError``; gradients equal eager."""
    for res in matrix:
        bad = {k: v for k, v in res["uneven_fsdp"].items() if not v <= 1e-5}
        assert not bad, bad
