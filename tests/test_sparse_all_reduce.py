"""Sparse COO all_reduce on fcoll's group (``fcoll.shm.group.sparse``): what gloo gives, for
the tensors ``DistributedDataParallel`` all-reduces for a sparse embedding, and a clear error on
every rank for what gloo refuses or what the ranks disagree on. 2 ranks (and 2 x 2 emulated
hosts in ``test_hierarchical.py``, which runs :func:`sparse_scenario` too)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from fcoll.testing import fcoll_segments, run_ranks


def _sparse(indices: list[int], values: torch.Tensor, size: tuple[int]) -> torch.Tensor:
    """A 1-D sparse COO tensor (``indices`` in the order given, duplicates kept)."""
    return torch.sparse_coo_tensor(torch.tensor(indices, dtype=torch.int64).view(1, -1), values,
                                   size, check_invariants=True)


def _cases(rank: int) -> dict:
    """Each rank's tensors: different nnz, duplicates within a rank (uncoalesced), indices
    shared across ranks, dense dims, two sparse dims, a rank with none, no rank with any,
    float64 and int64."""
    r = rank
    return {
        "1d": _sparse([r, 3, 3, 7 - r][:3 + r], torch.tensor([1.0, 2, 3, 4][:3 + r]) * (r + 1),
                      (8,)),
        "hybrid": torch.sparse_coo_tensor(torch.tensor([[r, 4]]), torch.arange(6.0).view(2, 3)
                                          + r, (6, 3), check_invariants=True),
        "2 sparse dims": torch.sparse_coo_tensor(torch.tensor([[r, 1], [2, r + 3]]),
                                                 torch.tensor([1.5, -2.0]), (4, 8),
                                                 check_invariants=True),
        "one rank empty": _sparse([2, 5] if r else [], torch.tensor([1.0, 2.0] if r else []),
                                  (6,)),
        "all empty": _sparse([], torch.tensor([]), (3,)),
        "float64": _sparse([r, 1], torch.tensor([0.1, 0.2], dtype=torch.float64), (4,)),
        "int64": _sparse([r, 1], torch.tensor([5, 7]), (4,)),
    }


def _all_reduced(group) -> dict:
    out = {}
    for name, t in _cases(dist.get_rank()).items():
        work = dist.all_reduce(t, group=group, async_op=True)
        work.wait()
        out[name] = (t.to_dense(), t.is_coalesced(), work.result()[0] is t)
    return out


def _refusals(rank: int) -> dict:
    errors = {}
    t = _sparse([rank], torch.tensor([1.0]), (4,))
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    except ValueError as e:
        errors["max"] = str(e)
    t = _sparse([0], torch.tensor([1.0]), (5 + rank,))
    try:
        dist.all_reduce(t)
    except ValueError as e:
        errors["size"] = str(e)
    t = _sparse([0], torch.tensor([1.0], dtype=torch.float64 if rank else torch.float32), (4,))
    try:
        dist.all_reduce(t)
    except ValueError as e:
        errors["dtype"] = str(e)
    after = torch.ones(3)
    dist.all_reduce(after)
    return {"errors": errors, "after": after.tolist()}


def _ddp_grads(group, compiled: bool) -> list[torch.Tensor]:
    """One step of DDP over ``group`` on a sparse EmbeddingBag + Linear; the gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(20, 4, mode="sum", sparse=True), nn.Linear(4, 2))
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=group)
    step = torch.compile(ddp, backend="fcoll") if compiled else ddp
    rank = dist.get_rank()
    step(torch.tensor([[rank, 3, 5 + rank], [7, 7, rank]])).pow(2).sum().backward()
    return [p.grad.to_dense() for p in ddp.parameters()]


def sparse_scenario(rank: int, world: int, gloo) -> dict:
    """Every case on the default (fcoll) group and on ``gloo``; the refusals; DDP."""
    return {"fcoll": _all_reduced(None), "gloo": _all_reduced(gloo), "refusals": _refusals(rank),
            "ddp": {"gloo": _ddp_grads(gloo, False), "fcoll": _ddp_grads(None, False),
                    "fcoll compiled": _ddp_grads(None, True)}}


def check_sparse_scenario(results: list[dict]) -> None:
    """The assertions on :func:`sparse_scenario`'s per-rank results."""
    world = len(results)
    for rank, res in enumerate(results):
        for name, (dense, coalesced, same) in res["gloo"].items():
            got = res["fcoll"][name]
            torch.testing.assert_close(got[0], dense, rtol=0, atol=0, msg=name)
            assert got[1:] == (coalesced, same) == (True, True), (name, got[1:])
        want = sum(_cases(r)["1d"].to_dense() for r in range(world))
        torch.testing.assert_close(res["fcoll"]["1d"][0], want)
        errors = res["refusals"]["errors"]
        assert "ReduceOp.SUM only" in errors["max"] and f"rank {rank}" in errors["max"], errors
        sizes = ", ".join(f"rank {r} ({5 + r},)" for r in range(world))
        assert f"disagree on size: {sizes}" in errors["size"], errors
        assert "disagree on dtype: rank 0 torch.float32, rank 1 torch.float64" in \
            errors["dtype"], errors
        assert res["refusals"]["after"] == [float(world)] * 3
        for kind in ("fcoll", "fcoll compiled"):
            for got, want in zip(res["ddp"][kind], res["ddp"]["gloo"]):
                torch.testing.assert_close(got, want, msg=kind)


def _two_ranks(rank: int, world: int) -> dict:
    return sparse_scenario(rank, world, dist.new_group(backend="gloo"))


def test_sparse_all_reduce_matches_gloo_and_refuses_what_it_cannot_do():
    check_sparse_scenario(run_ranks(_two_ranks, 2, timeout_s=180))
    assert fcoll_segments() == []
