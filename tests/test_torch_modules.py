"""The steps people compile reach fcoll: PyTorch's DDP and FSDP2 modules, compiled autograd, and
fcoll's process group inside Dynamo. Every case runs on 2 ranks, on fcoll's process
group and on gloo, and compares with the same module run eagerly."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fcoll.testing import fcoll_segments, run_ranks

BACKENDS = ["fcoll", "gloo"]


def _collectives_by_graph() -> tuple[dict[str, int], object]:
    """Count the collectives (any namespace) in every graph fcoll compiles from now on, and
    whether they were lowered to ``torch.ops.fcoll``."""
    from fcoll.compile.backend import register_compile_listener
    from fcoll.passes.graph import is_collective

    counts: dict[str, int] = {}

    def listen(record) -> None:
        nodes = [n for n in record.after.graph.nodes if is_collective(n)]
        counts[record.name] = len(nodes)
        counts[record.name + ":fcoll"] = sum(n.target.namespace == "fcoll" for n in nodes)
    return counts, register_compile_listener(listen)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


# ---- the process group inside Dynamo ----------------------------------------------------------

def _scatter_and_group_attributes(rank: int, world: int) -> list[float]:
    group = dist.group.WORLD

    @torch.compile(backend="fcoll", fullgraph=False)
    def f(x):
        out = torch.empty(2)
        # fcoll does not remap scatter: Dynamo must graph-break and run it eagerly
        dist.scatter(out, [torch.full((2,), 10.0 * i) for i in range(world)] if rank == 0
                     else None, src=0)
        # read at trace time, like gloo's group
        return out + x * group.size() + group.rank() + len(group.group_name)

    sub = dist.new_group([0, 1])

    @torch.compile(backend="fcoll", fullgraph=True)
    def g(x):
        # c10d's helpers on a group: constant-folded at trace time, no graph break
        return x * dist.get_world_size(sub) + dist.get_rank(sub)

    return f(torch.ones(2)).tolist() + g(torch.ones(1)).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_unremapped_collective_graph_breaks_and_group_attributes_trace(backend):
    results = run_ranks(_scatter_and_group_attributes, 2, backend=backend, timeout_s=180)
    # group name "0" (one character) on both backends
    assert results == [[0.0 + 2 + 0 + 1] * 2 + [2.0], [10.0 + 2 + 1 + 1] * 2 + [3.0]]
    assert fcoll_segments() == []


# ---- compiled autograd and PyTorch DDP ---------------------------------------------------------

def _compiled_autograd_and_ddp(rank: int, world: int) -> dict:
    from torch._dynamo import compiled_autograd
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    out: dict = {}

    # compiled autograd's backward graph with backend="fcoll" (no collectives)
    model = _mlp()
    model(x).pow(2).sum().backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    counts, handle = _collectives_by_graph()
    loss = torch.compile(model, backend="fcoll")(x).pow(2).sum()
    with compiled_autograd._enable(torch.compile(backend="fcoll")):
        loss.backward()
    handle.remove()
    out["compiled_autograd_equal"] = all(
        torch.allclose(a, b, atol=1e-6) for a, b in zip(expected, _grads(model)))
    out["compiled_autograd_graphs"] = sorted(k for k in counts if "compiled_autograd" in k)

    # the reference: eager DDP
    ref = DDP(_mlp())
    ref(x).pow(2).sum().backward()
    expected = _grads(ref)

    # DDP compiled with the default optimize_ddp (graph split per bucket)
    ddp = DDP(_mlp())
    compiled = torch.compile(ddp, backend="fcoll")
    for _ in range(2):
        ddp.zero_grad(set_to_none=True)
        compiled(x).pow(2).sum().backward()
    out["ddp_default_equal"] = all(
        torch.allclose(a, b, atol=1e-6) for a, b in zip(expected, _grads(ddp)))

    # DDP with the python reducer and compiled autograd: the gradient all_reduces are in the
    # backward graph. The mode is read when DDP is constructed.
    torch._dynamo.config.optimize_ddp = "python_reducer"
    ddp = DDP(_mlp())
    compiled = torch.compile(ddp, backend="fcoll")
    counts, handle = _collectives_by_graph()
    for _ in range(2):
        ddp.zero_grad(set_to_none=True)
        loss = compiled(x).pow(2).sum()
        with compiled_autograd._enable(torch.compile(backend="fcoll")):
            loss.backward()
    handle.remove()
    out["ddp_python_reducer_equal"] = all(
        torch.allclose(a, b, atol=1e-6) for a, b in zip(expected, _grads(ddp)))
    out["ddp_python_reducer_counts"] = counts
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_autograd_and_ddp_reach_the_passes(backend):
    for res in run_ranks(_compiled_autograd_and_ddp, 2, backend=backend, timeout_s=300):
        assert res["compiled_autograd_equal"]
        assert res["compiled_autograd_graphs"], "compiled autograd's graph did not reach fcoll"
        assert res["ddp_default_equal"]
        assert res["ddp_python_reducer_equal"]
        counts = res["ddp_python_reducer_counts"]
        backward = {k: v for k, v in counts.items()
                    if "compiled_autograd" in k and not k.endswith(":fcoll")}
        assert backward and sum(backward.values()) > 0, counts
        # lowered from _c10d_functional to fcoll's ops by the passes
        assert sum(counts[k + ":fcoll"] for k in backward) == sum(backward.values()), counts
    assert fcoll_segments() == []


# ---- PyTorch DDP's gradients in fcoll's buckets, overlapping the backward ---------------------

def _ddp_buckets_overlap_backward(rank: int, world: int) -> dict:
    """``examples/train_gpt.py``'s GPT in PyTorch's DDP (python reducer, compiled autograd),
    3 steps compiled with ``backend="fcoll"`` and 3 steps eagerly from the same start; the
    compiled backward graph after fcoll's passes, summarised."""
    import train_gpt as tg
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fcoll.compile.backend import register_compile_listener
    from fcoll.passes.rewrites.bucketing import META_BUCKET
    from fcoll.passes.graph import is_collective
    from fcoll.passes.analysis.memory import OTHER, op_class

    corpus = tg.Corpus(tg.load_text())
    # Large enough that a block's backward (tens of ms of estimated compute) outweighs a
    # collective's latency on any backend: with a tiny model, the lane plan rightly merges
    # every gradient into one bucket when gloo's calibrated latency exceeds the compute between
    # gradients.
    cfg = tg.GPTConfig(vocab_size=corpus.vocab_size, seq_len=128, n_layer=2, n_head=4,
                       d_model=256)
    params = tg.init_params(cfg, seed=0)
    batches = [tg.get_batch(corpus.train, 8, cfg.seq_len, seed=0, step=i, rank=rank,
                            world_size=world) for i in range(3)]

    module = tg.GPTModule(cfg, params)       # the reference: eager DDP, same start and data
    ddp, opt = DDP(module), tg.torch_adamw(module, tg.AdamW())
    eager = []
    for x, y in batches:
        loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        eager.append(loss.item())

    backward: list = []
    handle = register_compile_listener(
        lambda rec: backward.append(rec.after) if "compiled_autograd" in rec.name else None)
    step = tg.TorchModuleStep(cfg, params, "torch-ddp", tg.AdamW(), torch.device("cpu"))
    compiled = [step(x, y).item() for x, y in batches]
    handle.remove()

    (gm,) = backward
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    colls = [n for n in nodes if is_collective(n)]
    # the gradients: what each bucket's concatenated input is made of (or a lone input)
    grads = [g for c in colls for g in (c.args[0].all_input_nodes
                                        if c.args[0].target is torch.ops.aten.cat.default
                                        else [c.args[0]])]
    return {"eager": eager, "compiled": compiled,
            "members": [len(c.meta.get(META_BUCKET, [c.name])) for c in colls],
            "first_issue": min(pos[c] for c in colls),
            "last_gradient": max(pos[g] for g in grads),
            # the backward's compute nodes, in order: its midpoint is the middle one
            "compute": [pos[n] for n in nodes if n.op == "call_function" and
                        op_class(n) == OTHER]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_ddp_gradients_go_out_in_buckets_during_the_backward(backend):
    """Compiled autograd's backward of PyTorch's DDP (python reducer): fcoll's passes replace the
    reducer's per-parameter all_reduces with more than one bucket, and the first bucket is
    issued before the last gradient is computed (it overlaps the rest of the backward), with
    the loss of eager DDP."""
    results = run_ranks(_ddp_buckets_overlap_backward, 2, backend=backend, timeout_s=300)
    assert results[0]["members"] == results[1]["members"]      # the same buckets on both ranks
    for r in results:
        torch.testing.assert_close(r["compiled"], r["eager"], rtol=1e-4, atol=1e-5)
        assert len(r["members"]) > 1, r
        assert sum(r["members"]) == 2 * 12 + 4, r               # every parameter's gradient
        assert r["first_issue"] < r["last_gradient"], r
        # the bucket plan's cap on the early buckets (bucket_rules.early_cap): the first bucket
        # goes out before half of the backward's compute has run, however exact the cost model
        midpoint = r["compute"][len(r["compute"]) // 2]
        assert r["first_issue"] < midpoint, (r["first_issue"], midpoint, r["members"])
    assert fcoll_segments() == []
