"""Data-parallel training of a character-level GPT, one compiled step, ``backend="fcoll"``.

Run on 2 local ranks (``torchrun`` works the same way)::

    python -m fcoll.launch --nproc-per-node 2 examples/train_gpt.py --steps 60
    python -m fcoll.launch --nproc-per-node 2 examples/train_gpt.py --parallel fsdp
    python -m fcoll.launch --nproc-per-node 2 examples/train_gpt.py --parallel simple-fsdp
    python -m fcoll.launch --nproc-per-node 2 examples/train_gpt.py --parallel tp
    python -m fcoll.launch --nproc-per-node 4 examples/train_gpt.py --parallel fsdp-tp --tp 2 \
        --sequence-parallel --activation-checkpointing
    python -m fcoll.launch --nproc-per-node 2 examples/train_gpt.py --backend-baseline
    python -m fcoll.launch --nproc-per-node 2 examples/train_gpt.py --device cuda --compute inductor

The whole step (forward, backward, gradient synchronisation with fcoll's functional collectives,
AdamW update) is one function compiled with ``torch.compile(backend="fcoll")``, with no graph
break: the backward is ``torch.autograd.grad`` inside the compiled function (traced by Dynamo with
``torch._dynamo.config.trace_autograd_ops``, patched only around the step's calls), and the
optimizer is a functional AdamW (new tensors out, no in-place state).

- ``--parallel ddp``: every rank holds all parameters; gradients are averaged with one
  ``all_reduce(avg)`` per parameter.
- ``--parallel fsdp``: every rank holds a 1/n flat shard of each parameter (padded to a multiple
  of n). The forward all-gathers each layer's parameters just before the layer; autograd turns
  each all_gather into a reduce_scatter of the gradient (fcoll's op autograd), so every rank gets
  the gradient of its own shard, and updates only that shard.
- ``--parallel simple-fsdp``: :class:`GPTModule` with ``fcoll.parallel.fully_shard`` on every
  block and on the root (SimpleFSDP on DTensor), the module compiled; see :class:`TorchModuleStep`.
- ``--parallel tp``: :class:`TPGPTModule` with PyTorch's ``parallelize_module``
  (``ColwiseParallel`` q/k/v and fc, ``RowwiseParallel`` proj and fc2); every rank trains on the
  same batches (one tensor-parallel group). ``--sequence-parallel``: the blocks' layer norms and
  residual stream split along the sequence as well (PyTorch's ``SequenceParallel``).
- ``--parallel fsdp-tp``: both, on a ``(dp, tp)`` mesh (``--tp`` ranks per tensor-parallel
  group): :class:`TPGPTModule` parallelized over ``mesh["tp"]``, then ``fully_shard`` over
  ``mesh["dp"]`` on every block and on the root (torchtitan's 2-D layout); the ranks of one
  tensor-parallel group train on the same batches.
- ``--activation-checkpointing`` (the ``nn.Module`` modes): every block in PyTorch's
  ``checkpoint_wrapper``, recomputed in the backward.
- ``--param-dtype bfloat16 --reduce-dtype float32`` (the FSDP modules: ``simple-fsdp``,
  ``fsdp-tp``, ``torch-fsdp2``): FSDP2's ``MixedPrecisionPolicy``, torchtitan's default
  (parameters gathered and computed in bfloat16, gradients reduced in float32, float32 shards
  and optimizer state).

``--device cuda``: parameters, optimizer state and batches live on ``cuda:{LOCAL_RANK %
device_count}``. On fcoll's group (and on gloo) several ranks may share one GPU; ``--dist-backend
nccl`` needs one GPU per rank and refuses to start otherwise, naming the ranks that would share
one (see ``docs/cuda.md``). The step time is measured between two ``torch.cuda.synchronize()``.

Data: the English text of ``pydoc_data.topics`` (shipped with CPython, about 465,000 characters).
The last 10 % is held out for the validation loss; the rest is split into one contiguous shard
per rank, from which each rank samples its batches.

The model and step builders are importable (``tests/test_train_gpt.py`` uses them).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

import fcoll  # registers torch.ops.fcoll and the "fcoll" process-group backend
from fcoll.passes.config import auto_compute
from fcoll.passes.graph import tensor_bytes

__all__ = ["GPTConfig", "load_text", "init_params", "gpt_loss", "GPTModule", "GPTBlock",
           "TPGPTModule", "torch_adamw", "TorchModuleStep", "FcollComm", "TorchComm",
           "shard_params", "unshard_params", "init_adamw", "make_train_step", "get_batch",
           "compile_step", "count_compiled_collectives", "main"]


# ---------------------------------------------------------------------------------------------
# Data

def load_text() -> str:
    """The documentation topics of ``pydoc_data.topics``, in key order (about 465,000 chars)."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))


class Corpus:
    """Character-level encoding of the text, split into train (90 %) and validation (10 %)."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        data = torch.tensor([index[c] for c in text], dtype=torch.long)
        cut = int(len(data) * 0.9)
        self.train, self.val = data[:cut], data[cut:]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)


def get_batch(data: torch.Tensor, batch_size: int, seq_len: int, *, seed: int, step: int,
              rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: ``batch_size`` windows of its shard of ``data``.

    The shard of rank ``r`` is the ``r``-th of ``world_size`` contiguous pieces of ``data``; the
    offsets depend only on (seed, step, rank, world_size), so one process can rebuild any rank's
    batch.

    Returns:
        ``x``, ``y``: int64 ``[batch_size, seq_len]``; ``y`` is ``x`` shifted by one character.
    """
    shard = len(data) // world_size
    lo = rank * shard
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank * 17 + world_size)
    offsets = torch.randint(lo, lo + shard - seq_len - 1, (batch_size,), generator=g)
    x = torch.stack([data[o:o + seq_len] for o in offsets.tolist()])
    y = torch.stack([data[o + 1:o + seq_len + 1] for o in offsets.tolist()])
    return x, y


# ---------------------------------------------------------------------------------------------
# Model (functional: parameters are a dict of tensors)

@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 103
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    dtype: torch.dtype = torch.float32


def _layer_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    d = cfg.d_model
    return {"ln1_w": (d,), "ln1_b": (d,), "qkv_w": (3 * d, d), "qkv_b": (3 * d,),
            "proj_w": (d, d), "proj_b": (d,), "ln2_w": (d,), "ln2_b": (d,),
            "fc_w": (4 * d, d), "fc_b": (4 * d,), "fc2_w": (d, 4 * d), "fc2_b": (d,)}


def param_groups(cfg: GPTConfig) -> dict[str, list[str]]:
    """Parameter names by layer, in forward order ("embed", "h0", ..., "final")."""
    groups = {"embed": ["wte", "wpe"]}
    for i in range(cfg.n_layer):
        groups[f"h{i}"] = [f"h{i}.{k}" for k in _layer_shapes(cfg)]
    groups["final"] = ["lnf_w", "lnf_b"]
    return groups


def init_params(cfg: GPTConfig, seed: int) -> dict[str, torch.Tensor]:
    """GPT-2 style initialisation (normal 0.02, residual projections / sqrt(2 L)), same on every rank."""
    g = torch.Generator().manual_seed(seed)
    d = cfg.d_model
    shapes = {"wte": (cfg.vocab_size, d), "wpe": (cfg.seq_len, d), "lnf_w": (d,), "lnf_b": (d,)}
    for i in range(cfg.n_layer):
        shapes.update({f"h{i}.{k}": s for k, s in _layer_shapes(cfg).items()})
    params = {}
    for name, shape in shapes.items():
        if name.endswith(("ln1_w", "ln2_w", "lnf_w")):
            t = torch.ones(shape)
        elif len(shape) == 1:
            t = torch.zeros(shape)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj_w", "fc2_w")) else 0.02
            t = torch.randn(shape, generator=g) * std
        params[name] = t.to(cfg.dtype)
    return params


def _block(p: Callable[[str], torch.Tensor], i: int | str, x: torch.Tensor, cfg: GPTConfig):
    B, T, d = x.shape
    h = F.layer_norm(x, (d,), p(f"h{i}.ln1_w"), p(f"h{i}.ln1_b"))
    q, k, v = F.linear(h, p(f"h{i}.qkv_w"), p(f"h{i}.qkv_b")).split(d, dim=2)
    heads = lambda t: t.view(B, T, cfg.n_head, d // cfg.n_head).transpose(1, 2)  # noqa: E731
    a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    x = x + F.linear(a.transpose(1, 2).reshape(B, T, d), p(f"h{i}.proj_w"), p(f"h{i}.proj_b"))
    h = F.layer_norm(x, (d,), p(f"h{i}.ln2_w"), p(f"h{i}.ln2_b"))
    h = F.linear(F.gelu(F.linear(h, p(f"h{i}.fc_w"), p(f"h{i}.fc_b"))), p(f"h{i}.fc2_w"),
                 p(f"h{i}.fc2_b"))
    return x + h


def gpt_loss(params: Callable[[str], torch.Tensor], idx: torch.Tensor, targets: torch.Tensor,
             cfg: GPTConfig, on_layer: Callable[[str], None] | None = None) -> torch.Tensor:
    """Mean next-character cross entropy (nats) of ``idx [B, T]`` against ``targets [B, T]``.

    Args:
        params: name -> parameter (a dict's ``__getitem__``, or a gathering lookup for FSDP).
        on_layer: called with each group name of :func:`param_groups` before the group is used
            (FSDP gathers the group's parameters there).
    """
    if on_layer is None:  # not ``on_layer or ...``: Dynamo 2.11 cannot branch on a closure
        on_layer = lambda name: None  # noqa: E731
    T = idx.shape[1]
    on_layer("embed")
    wte = params("wte")
    x = F.embedding(idx, wte) + params("wpe")[:T]
    for i in range(cfg.n_layer):
        on_layer(f"h{i}")
        x = _block(params, i, x, cfg)
    on_layer("final")
    x = F.layer_norm(x, (cfg.d_model,), params("lnf_w"), params("lnf_b"))
    logits = F.linear(x, wte)  # tied head
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------
# The same model as nn.Modules, for PyTorch's own DistributedDataParallel and fully_shard

class GPTBlock(nn.Module):
    """Layer ``i`` of :func:`gpt_loss` (its parameters named as in :func:`init_params`, without
    the ``h{i}.`` prefix); ``x [B, T, d] -> [B, T, d]``."""

    def __init__(self, cfg: GPTConfig, i: int, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        # the layer index kept as a string: with each block compiled on its own (torchtitan's
        # regional compile) under FSDP2, Dynamo traces the blocks unspecialized and turns an int
        # attribute that differs between them into a SymInt, which an f-string cannot format
        self.cfg, self.layer = cfg, str(i)
        self.p = nn.ParameterDict({k: nn.Parameter(params[f"h{i}.{k}"].clone())
                                   for k in _layer_shapes(cfg)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prefix = len(f"h{self.layer}.")
        return _block(lambda name: self.p[name[prefix:]], self.layer, x, self.cfg)


class GPTModule(nn.Module):
    """:func:`gpt_loss` as a module: ``forward(idx [B, T], targets [B, T])`` -> mean loss (nats).

    One :class:`GPTBlock` per layer, so ``fully_shard`` can shard (and all-gather) per block.
    Initialised from :func:`init_params`, so it starts from the functional model's parameters.
    """

    def __init__(self, cfg: GPTConfig, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg = cfg
        self.p = nn.ParameterDict({k: nn.Parameter(params[k].clone())
                                   for k in ("wte", "wpe", "lnf_w", "lnf_b")})
        self.blocks = nn.ModuleList(GPTBlock(cfg, i, params) for i in range(cfg.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        wte = self.p["wte"]
        x = F.embedding(idx, wte) + self.p["wpe"][:T]
        for block in self.blocks:
            x = block(x)
        x = F.layer_norm(x, (self.cfg.d_model,), self.p["lnf_w"], self.p["lnf_b"])
        logits = F.linear(x, wte)  # tied head
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class TPGPTBlock(nn.Module):
    """:func:`_block` with ``nn.Linear`` layers, so ``parallelize_module`` can shard them: the
    fused ``qkv`` is split into ``q``, ``k``, ``v`` (each column-parallel shards whole heads),
    and the heads are counted from the local width (``n_head / tp`` per rank)."""

    def __init__(self, cfg: GPTConfig, i: int, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        d, p = cfg.d_model, lambda k: params[f"h{i}.{k}"].clone()  # noqa: E731
        self.head_dim = d // cfg.n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        for ln, k in ((self.ln1, "ln1"), (self.ln2, "ln2")):
            ln.weight.data, ln.bias.data = p(f"{k}_w"), p(f"{k}_b")
        for j, name in enumerate("qkv"):
            setattr(self, name, nn.Linear(d, d))
            getattr(self, name).weight.data = p("qkv_w")[j * d:(j + 1) * d].clone()
            getattr(self, name).bias.data = p("qkv_b")[j * d:(j + 1) * d].clone()
        self.proj, self.fc, self.fc2 = nn.Linear(d, d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        for lin, k in ((self.proj, "proj"), (self.fc, "fc"), (self.fc2, "fc2")):
            lin.weight.data, lin.bias.data = p(f"{k}_w"), p(f"{k}_b")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # shapes come from q/k/v's outputs: with sequence parallel ``x`` holds a slice of the
        # sequence and the column-parallel layers' outputs all of it
        h = self.ln1(x)
        heads = lambda t: t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(heads(self.q(h)), heads(self.k(h)), heads(self.v(h)),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).flatten(2))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class TPGPTModule(GPTModule):
    """:class:`GPTModule` with :class:`TPGPTBlock` blocks; :meth:`parallelize` shards them."""

    def __init__(self, cfg: GPTConfig, params: dict[str, torch.Tensor]) -> None:
        super().__init__(cfg, params)
        self.blocks = nn.ModuleList(TPGPTBlock(cfg, i, params) for i in range(cfg.n_layer))

    def parallelize(self, mesh, sequence_parallel: bool = False) -> "TPGPTModule":
        """Megatron-style tensor parallelism over ``mesh`` (1-D): attention by heads, the MLP
        by its hidden width; embeddings, the final layer norm and the head stay replicated.

        ``sequence_parallel``: also the blocks' layer norms and residual stream, split along the
        sequence (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
        Models", 2022; PyTorch's ``SequenceParallel``): the first block's input is split, each
        column-parallel layer all_gathers its input along the sequence, each row-parallel layer
        reduce-scatters its output to it, and the last block's output is gathered again.
        ``seq_len`` must divide by the mesh size.

        Raises:
            ValueError: ``n_head`` does not divide by the mesh size (each rank computes whole
                heads), or with ``sequence_parallel`` ``seq_len`` does not."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, \
            PrepareModuleOutput, RowwiseParallel, SequenceParallel, parallelize_module

        if self.cfg.n_head % mesh.size():
            raise ValueError(f"tensor parallel: n_head {self.cfg.n_head} does not divide by the "
                             f"tensor-parallel size {mesh.size()} (each rank computes whole "
                             f"heads); pick --n-head or a world size (--tp) that divides it")
        if not sequence_parallel:
            plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                    "proj": RowwiseParallel(), "fc": ColwiseParallel(), "fc2": RowwiseParallel()}
        else:
            if self.cfg.seq_len % mesh.size():
                raise ValueError(f"sequence_parallel: seq_len {self.cfg.seq_len} does not divide "
                                 f"by the tensor-parallel size {mesh.size()}")
            seq = Shard(1)
            plan = {"ln1": SequenceParallel(), "ln2": SequenceParallel(),
                    **{k: ColwiseParallel(input_layouts=seq) for k in ("q", "k", "v", "fc")},
                    "proj": RowwiseParallel(output_layouts=seq),
                    "fc2": RowwiseParallel(output_layouts=seq)}
            parallelize_module(self.blocks[0], mesh, PrepareModuleInput(
                input_layouts=Replicate(), desired_input_layouts=seq, use_local_output=True))
            parallelize_module(self.blocks[-1], mesh, PrepareModuleOutput(
                output_layouts=seq, desired_output_layouts=Replicate(), use_local_output=True))
        for block in self.blocks:
            parallelize_module(block, mesh, plan)
        return self


def torch_adamw(module: nn.Module, opt: AdamW) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` with :func:`_adamw`'s rule for weight decay (matrices only)."""
    decay = [p for p in module.parameters() if p.dim() == 2]
    rest = [p for p in module.parameters() if p.dim() != 2]
    from torch.distributed.tensor import DTensor

    mixed = len({isinstance(p, DTensor) for p in module.parameters()}) > 1
    return torch.optim.AdamW([{"params": decay, "weight_decay": opt.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=opt.lr, betas=opt.betas, eps=opt.eps,
                             foreach=False if mixed else None)


# ---------------------------------------------------------------------------------------------
# Communication: fcoll's functional collectives, or PyTorch's (the baseline)

class FcollComm:
    """Gradient averaging and parameter gathering with ``torch.ops.fcoll``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.n, self.group, self.group_name = group.size(), group, group.group_name

    def all_reduce_avg(self, t: torch.Tensor) -> torch.Tensor:
        return fcoll.all_reduce(t, "avg", self.group)

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """``[k] -> [n * k]``, differentiable (backward: reduce_scatter sum)."""
        # The raw op with a Python-int group size: fcoll.all_gather_tensor looks the size up by
        # group name, which Dynamo cannot trace (a graph break).
        return fcoll.wait_tensor(torch.ops.fcoll.all_gather_into_tensor(shard, self.n,
                                                                          self.group_name))


class TorchComm:
    """The same with ``torch.distributed._functional_collectives`` (gloo has no avg)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.n, self.group = group.size(), group

    def all_reduce_avg(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(t, "sum", self.group) / self.n

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        return funcol.all_gather_tensor_autograd(shard, 0, self.group)


# ---------------------------------------------------------------------------------------------
# FSDP sharding

def shard_params(params: dict[str, torch.Tensor], rank: int, n: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s flat shard of each parameter: ``[numel] -> pad to n*k -> [k]``."""
    out = {}
    for name, t in params.items():
        k = -(-t.numel() // n)
        flat = torch.cat([t.reshape(-1), t.new_zeros(n * k - t.numel())])
        out[name] = flat[rank * k:(rank + 1) * k].clone()
    return out


def unshard_params(shards: list[dict[str, torch.Tensor]],
                   shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`shard_params` given every rank's shards, in rank order."""
    return {name: torch.cat([s[name] for s in shards])[:math.prod(shape)].view(shape)
            for name, shape in shapes.items()}


# ---------------------------------------------------------------------------------------------
# Optimizer (functional AdamW) and the step

@dataclass(frozen=True)
class AdamW:
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01


def init_adamw(params: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Zero moments and a step counter (a tensor, so the compiled step does not recompile), on
    the parameters' device."""
    device = next(iter(params.values())).device if params else torch.device("cpu")
    return {"m": {k: torch.zeros_like(v) for k, v in params.items()},
            "v": {k: torch.zeros_like(v) for k, v in params.items()},
            "t": torch.zeros((), dtype=torch.float32, device=device)}


def _adamw(opt: AdamW, params, grads, state):
    b1, b2 = opt.betas
    t = state["t"] + 1
    c1 = 1 - torch.pow(b1, t)
    c2 = 1 - torch.pow(b2, t)
    new_p, new_m, new_v = {}, {}, {}
    for k, p in params.items():
        g = grads[k]
        m = state["m"][k] * b1 + g * (1 - b1)
        v = state["v"][k] * b2 + g * g * (1 - b2)
        decay = opt.weight_decay if p.dim() == 2 or p.numel() > 4096 else 0.0
        update = (m / c1) / (torch.sqrt(v / c2) + opt.eps)
        new_p[k] = p * (1 - opt.lr * decay) - opt.lr * update
        new_m[k], new_v[k] = m, v
    return new_p, {"m": new_m, "v": new_v, "t": t}


def make_train_step(cfg: GPTConfig, comm, parallel: str = "ddp", opt: AdamW = AdamW(),
                    shapes: dict[str, torch.Size] | None = None):
    """The training step ``step(params, opt_state, x, y) -> (loss, grads, params, opt_state)``.

    Args:
        comm: :class:`FcollComm`, :class:`TorchComm`, or None (one process, no communication).
        parallel: "ddp" (``params`` are full tensors) or "fsdp" (``params`` are this rank's flat
            shards; ``shapes`` gives the full shapes).

    Returns:
        ``loss`` (this rank's mean loss, a float32 scalar), ``grads`` (averaged over ranks, of
        what ``params`` holds), and the updated ``params`` and ``opt_state``.
    """
    groups = param_groups(cfg)
    if parallel not in ("ddp", "fsdp"):
        raise ValueError(f"parallel: expected 'ddp' or 'fsdp', got {parallel!r}")
    if parallel == "fsdp" and (comm is None or shapes is None):
        raise ValueError("parallel='fsdp' needs comm and shapes")

    def grad_step(leaves, opt_state, x, y):
        # ``leaves``: ``params`` as leaves that require grad, made by ``step`` (or
        # :func:`compile_step`'s wrapper) outside any compiled code: Dynamo before torch 2.13
        # cannot trace ``requires_grad_()``.
        if parallel == "ddp":
            loss = gpt_loss(leaves.__getitem__, x, y, cfg)
        else:
            full: dict[str, torch.Tensor] = {}

            def gather(group: str) -> None:
                for k in groups[group]:
                    shape = shapes[k]
                    full[k] = comm.all_gather(leaves[k])[:math.prod(shape)].view(shape)
            loss = gpt_loss(full.__getitem__, x, y, cfg, on_layer=gather)
        names = list(leaves)
        grads = torch.autograd.grad(loss, [leaves[k] for k in names])
        if comm is None:
            synced = dict(zip(names, grads))
        elif parallel == "ddp":
            synced = {k: comm.all_reduce_avg(g) for k, g in zip(names, grads)}
        else:  # the all_gather's backward already reduce-scattered the sum
            synced = {k: g / comm.n for k, g in zip(names, grads)}
        with torch.no_grad():
            plain = {k: v.detach() for k, v in leaves.items()}
            new_params, new_state = _adamw(opt, plain, synced, opt_state)
        return loss.detach(), synced, new_params, new_state

    def step(params, opt_state, x, y):
        return grad_step(_grad_leaves(params), opt_state, x, y)
    step.grad_step = grad_step
    return step


def _grad_leaves(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` detached into fresh leaves that require grad."""
    return {k: v.detach().requires_grad_(True) for k, v in params.items()}


def compile_step(step, backend: str = "fcoll", options: dict[str, Any] | None = None):
    """``torch.compile`` the step; Dynamo traces ``torch.autograd.grad`` only inside its calls.

    For a step of :func:`make_train_step`, its ``grad_step`` is compiled and the leaves that
    require grad are made here, before each call, outside the compiled code.
    """
    grad_step = getattr(step, "grad_step", None)
    compiled = torch.compile(step if grad_step is None else grad_step, backend=backend,
                             options=options, fullgraph=True)

    def run(*args):
        if grad_step is not None:
            args = (_grad_leaves(args[0]), *args[1:])
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            return compiled(*args)
    run.compiled = compiled
    return run


#: ``--parallel`` modes that train :class:`GPTModule` (or :class:`TPGPTModule`) as nn.Modules.
MODULE_MODES = ("torch-ddp", "torch-fsdp2", "simple-fsdp", "tp", "fsdp-tp")
#: the modes that shard with ``fully_shard`` (fcoll's or PyTorch's), which take ``--param-dtype``
FSDP_MODES = ("simple-fsdp", "fsdp-tp", "torch-fsdp2")
#: the dtypes ``--param-dtype`` / ``--reduce-dtype`` name
DTYPES = ("float32", "bfloat16", "float16")


def mp_policy(param_dtype: str | None, reduce_dtype: str | None):
    """FSDP2's ``MixedPrecisionPolicy`` from ``--param-dtype`` / ``--reduce-dtype`` (names in
    :data:`DTYPES`); None when neither is given."""
    if not (param_dtype or reduce_dtype):
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=getattr(torch, param_dtype) if param_dtype else None,
        reduce_dtype=getattr(torch, reduce_dtype) if reduce_dtype else None)


def _checkpoint_blocks(module: GPTModule, enabled: bool) -> GPTModule:
    """``module`` with each block wrapped in ``checkpoint_wrapper`` (non-reentrant full
    activation checkpointing) when ``enabled``."""
    if enabled:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import \
            checkpoint_wrapper

        module.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in module.blocks)
    return module


class TorchModuleStep:
    """A training step of :class:`GPTModule` wrapped in PyTorch's own data-parallel module.

    - ``"torch-ddp"``: ``DistributedDataParallel`` with ``optimize_ddp = "python_reducer"`` and
      compiled autograd, as PyTorch documents for compiled DDP: the forward is compiled by
      ``torch.compile(ddp, backend=...)``, and the backward by compiled autograd with the same
      backend, so DDP's gradient all_reduces are functional collectives in the backward graph,
      which fcoll lowers, buckets and schedules (its buckets replace DDP's reducer buckets).
    - ``"torch-fsdp2"``: ``fully_shard`` on every block and on the root, the root compiled. On a
      torch that can trace FSDP2's hooks (``torch._dynamo.config.skip_fsdp_hooks`` exists: 2.11
      and 2.12) and on CUDA (those hooks use streams, which Dynamo traces only on CUDA), the
      backward runs under compiled autograd with PyTorch's traceable-FSDP2 settings, and the
      all_gathers and reduce_scatters are in the graphs. torch 2.13 removed traceable FSDP2 (its
      hooks are always ``torch._dynamo.disable``-d, and compiled autograd with FSDP2 gives wrong
      gradients even with ``aot_eager``): there FSDP2 communicates eagerly in its hooks and the
      compiled graphs hold only compute. :attr:`traced_comms` says which.
    - ``"simple-fsdp"``: ``fcoll.parallel.fully_shard`` (SimpleFSDP on DTensor) on every block
      and on the root, the module compiled: the all_gathers are in the forward graph (and,
      resharded after the forward, again in the backward), the reduce_scatters in AOTAutograd's
      backward graph; no compiled autograd.
    - ``"tp"``: :class:`TPGPTModule` parallelized over every rank, compiled the same way (its
      all_reduces in both graphs); every rank must be given the same batch.
    - ``"fsdp-tp"``: :class:`TPGPTModule` parallelized over ``mesh["tp"]`` of a
      ``(world / tp_size, tp_size)`` mesh named ``("dp", "tp")``, then ``fcoll.parallel.
      fully_shard`` over ``mesh["dp"]`` on every block and on the root; the ranks of one
      tensor-parallel group (``rank // tp_size`` equal) must be given the same batch.

    ``sequence_parallel`` (``"tp"``, ``"fsdp-tp"``): :meth:`TPGPTModule.parallelize`'s.
    ``activation_checkpointing``: every block wrapped in PyTorch's ``checkpoint_wrapper`` (full
    activation checkpointing: the backward recomputes the block's forward), after tensor
    parallel and before any ``fully_shard``, torchtitan's order.
    ``mp_policy`` (the FSDP modes): the ``MixedPrecisionPolicy`` given to every
    ``fully_shard`` call (fcoll's or PyTorch's); None: full precision. Refused (ValueError)
    for the other modes.
    ``mesh`` (``"simple-fsdp"`` only): the 1-D ``DeviceMesh`` to shard over instead of every
    rank; a mesh of one rank gives the same graphs with no collective in them (the step's
    compute alone: ``benchmarks/overlap.py``). Refused (ValueError) for the other modes.

    ``step(x, y)`` runs forward, backward and ``torch.optim.AdamW`` (decay as :func:`_adamw`)
    and returns the loss (a detached float32 scalar); ``eval_loss(x, y)`` runs the model eagerly.
    """

    def __init__(self, cfg: GPTConfig, params: dict[str, torch.Tensor], parallel: str,
                 opt: AdamW, device: torch.device, backend: str = "fcoll",
                 options: dict[str, Any] | None = None, tp_size: int = 2,
                 sequence_parallel: bool = False, activation_checkpointing: bool = False,
                 mp_policy: Any = None, mesh: Any = None) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if parallel not in MODULE_MODES:
            raise ValueError(f"parallel: expected one of {MODULE_MODES}, got {parallel!r}")
        world = dist.get_world_size()
        if parallel == "fsdp-tp" and (tp_size < 1 or world % tp_size):
            raise ValueError(f"tp_size: {tp_size} does not divide the world size {world}")
        if mp_policy is not None and parallel not in FSDP_MODES:
            raise ValueError(f"mp_policy: only the FSDP modes {FSDP_MODES} shard with a mixed "
                             f"precision policy, got parallel={parallel!r}")
        if mesh is not None and (parallel != "simple-fsdp" or mesh.ndim != 1):
            raise ValueError(f"mesh: a 1-D DeviceMesh for parallel='simple-fsdp', got {mesh!r} "
                             f"with parallel={parallel!r}")
        shard_kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
        self.parallel = parallel
        tensor_parallel = parallel in ("tp", "fsdp-tp")
        module = (TPGPTModule if tensor_parallel else GPTModule)(cfg, params).to(device)
        self._patches: dict[str, Any] = {}
        #: the backward runs under compiled autograd (DDP's python reducer, traced FSDP2)
        self.compiled_autograd = parallel.startswith("torch-")
        if parallel in ("simple-fsdp", "tp", "fsdp-tp"):
            from torch.distributed.device_mesh import init_device_mesh

            from fcoll.parallel import fully_shard

            if parallel == "fsdp-tp":
                mesh2d = init_device_mesh(device.type, (world // tp_size, tp_size),
                                          mesh_dim_names=("dp", "tp"))
                module.parallelize(mesh2d["tp"], sequence_parallel)
                mesh = mesh2d["dp"]
            elif mesh is None:
                mesh = init_device_mesh(device.type, (world,))
            if parallel == "tp":
                wrapped = _checkpoint_blocks(module.parallelize(mesh, sequence_parallel),
                                             activation_checkpointing)
            else:
                _checkpoint_blocks(module, activation_checkpointing)
                for block in module.blocks:
                    fully_shard(block, mesh=mesh, **shard_kwargs)
                wrapped = fully_shard(module, mesh=mesh, **shard_kwargs)
            self.traced_comms = True
        elif parallel == "torch-ddp":
            torch._dynamo.config.optimize_ddp = "python_reducer"  # read by DDP's constructor
            _checkpoint_blocks(module, activation_checkpointing)
            wrapped = DDP(module, device_ids=[device] if device.type == "cuda" else None)
            self.traced_comms = True
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
            _checkpoint_blocks(module, activation_checkpointing)
            for block in module.blocks:
                fully_shard(block, mesh=mesh, **shard_kwargs)
            fully_shard(module, mesh=mesh, **shard_kwargs)
            wrapped = module
            self.traced_comms = (device.type == "cuda"
                                 and "skip_fsdp_hooks" in torch._dynamo.config._config)
            if self.traced_comms:
                from torch.distributed.fsdp._fully_shard import _fsdp_param_group

                # FSDP2's hooks log with logger.debug, which Dynamo refuses unless told to
                # skip it (torch 2.11, checked on CPU up to the CPU-stream limit)
                self._patches = {"skip_fsdp_hooks": False, "inline_inbuilt_nn_modules": True,
                                 "compiled_autograd_kwargs_override": {"fullgraph": True},
                                 "ignore_logging_functions": {_fsdp_param_group.logger.debug}}
        self.module, self.wrapped = module, wrapped
        self.optimizer = torch_adamw(module, opt)
        self.forward = torch.compile(wrapped, backend=backend, options=options)
        # traced FSDP2 queues autograd callbacks, which compiled autograd accepts only from a
        # fullgraph compile; compiled_autograd_kwargs_override applies only to compilers made
        # while it is set, so the backward compiler asks for fullgraph itself
        self.backward_compiler = torch.compile(
            backend=backend, options=options,
            fullgraph=self.parallel == "torch-fsdp2" and self.traced_comms)
        self.steps = 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from torch._dynamo import compiled_autograd

        with torch._dynamo.config.patch(**self._patches):
            if self.parallel == "torch-fsdp2" and self.traced_comms and self.steps == 0:
                # FSDP2's lazy initialisation runs eagerly, as PyTorch's traceable-FSDP2 tests do
                with torch.compiler.set_stance("force_eager"):
                    loss = self.wrapped(x, y)
                    loss.backward()
            else:
                loss = self.forward(x, y)
                if self.traced_comms and self.compiled_autograd:
                    with compiled_autograd._enable(self.backward_compiler):
                        loss.backward()
                else:
                    loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return loss.detach()

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return float(self.module(x, y))


def count_compiled_collectives() -> tuple[dict[str, int], Callable[[], None]]:
    """Count the collectives in every graph that ``backend="fcoll"`` compiles from now on.

    Returns:
        ``counts`` (graph name -> collectives after fcoll's passes, filled as graphs compile)
        and a function that stops counting.
    """
    from fcoll.compile.backend import register_compile_listener
    from fcoll.passes.graph import is_collective

    counts: dict[str, int] = {}

    def listen(record) -> None:
        counts[record.name] = sum(1 for n in record.after.graph.nodes if is_collective(n))
    return counts, register_compile_listener(listen).remove


# ---------------------------------------------------------------------------------------------
# Command line

def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--parallel", choices=("ddp", "fsdp") + MODULE_MODES,
                   default="ddp", help="ddp/fsdp: the functional step; torch-ddp/torch-fsdp2: "
                   "the GPT as nn.Modules in PyTorch's DistributedDataParallel / fully_shard; "
                   "simple-fsdp: fcoll.parallel.fully_shard; tp: parallelize_module; "
                   "fsdp-tp: both, on a (dp, tp) mesh")
    p.add_argument("--tp", type=int, default=2,
                   help="--parallel fsdp-tp: ranks per tensor-parallel group (divides the "
                   "world size)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="--parallel tp / fsdp-tp: layer norms and the residual stream split "
                   "along the sequence (PyTorch's SequenceParallel)")
    p.add_argument("--compute", choices=("auto", "eager", "inductor"), default="auto",
                   help="fcoll's compute option; auto: inductor on CUDA and for graphs of "
                   "4 MiB of inputs or more on the CPU, eager for smaller ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--trace-dir", default=None, help="write fcoll run traces here")
    p.add_argument("--backend-baseline", action="store_true",
                   help="compile with backend='inductor' on gloo, sync with torch funcol")
    p.add_argument("--dist-backend", choices=("fcoll", "gloo", "nccl"), default="fcoll",
                   help="process group (nccl: --device cuda and one GPU per rank)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: rank r uses cuda:{LOCAL_RANK %% device_count}")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="the nn.Module modes: every block in checkpoint_wrapper (recomputed in "
                   "the backward)")
    p.add_argument("--param-dtype", choices=DTYPES, default=None,
                   help=f"{', '.join(FSDP_MODES)}: gather and compute the parameters in this "
                   "dtype (FSDP2's MixedPrecisionPolicy.param_dtype; torchtitan: bfloat16)")
    p.add_argument("--reduce-dtype", choices=DTYPES, default=None,
                   help="with --param-dtype: reduce the gradients in this dtype (default: "
                   "the param dtype, as FSDP2; torchtitan: float32)")
    args = p.parse_args(argv)
    if (args.param_dtype or args.reduce_dtype) and args.parallel not in FSDP_MODES:
        p.error(f"--param-dtype/--reduce-dtype need one of --parallel {', '.join(FSDP_MODES)}")
    if args.activation_checkpointing and args.parallel not in MODULE_MODES:
        p.error(f"--activation-checkpointing needs one of --parallel {', '.join(MODULE_MODES)}")
    if args.sequence_parallel and args.parallel not in ("tp", "fsdp-tp"):
        p.error("--sequence-parallel needs --parallel tp or fsdp-tp")
    if args.dist_backend == "nccl" and args.device != "cuda":
        p.error("--dist-backend nccl needs --device cuda (nccl has no CPU collectives)")
    return args


def nccl_device_conflict(local_world: int, device_count: int) -> str | None:
    """Why nccl cannot run ``local_world`` ranks on ``device_count`` GPUs (None: it can).

    Local rank ``r`` uses ``cuda:{r % device_count}``; NCCL refuses two ranks of one
    communicator on one GPU, so every GPU shared by two or more ranks is named.
    """
    if device_count < 1:
        return "--dist-backend nccl needs a GPU, and torch sees none"
    if local_world <= device_count:
        return None
    shared = {d: [r for r in range(local_world) if r % device_count == d]
              for d in range(device_count)}
    which = "; ".join(f"ranks {', '.join(map(str, rs))} on cuda:{d}"
                      for d, rs in shared.items() if len(rs) > 1)
    return (f"--dist-backend nccl needs one GPU per rank, but {local_world} local ranks would "
            f"share {device_count} GPU(s): {which}. NCCL refuses two ranks on one GPU; use "
            f"--dist-backend fcoll (ranks may share a GPU) or gloo, or at most {device_count} "
            "rank(s) per node")


def _compute_label(args: argparse.Namespace, state_bytes: int | None = None) -> str:
    """fcoll's ``compute`` option as the run used it (``auto`` with what it chose for a step
    whose parameters and optimizer state are ``state_bytes`` bytes; None: large)."""
    if args.compute != "auto":
        return args.compute
    return f"auto: {auto_compute(args.device, state_bytes)}"


def _setup_device(args: argparse.Namespace) -> torch.device:
    """The rank's device; for CUDA, ``cuda:{LOCAL_RANK % device_count}``, made current.

    Raises:
        SystemExit: CUDA asked for but unavailable, or nccl with ranks sharing a GPU (raised
            on every rank, before any process group exists).
    """
    if args.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("train_gpt: --device cuda, but torch.cuda.is_available() is False "
                         f"(torch {torch.__version__})")
    count = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.dist_backend == "nccl":
        why = nccl_device_conflict(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), count)
        if why is not None:
            raise SystemExit(f"train_gpt (rank {os.environ.get('RANK', 0)}): {why}")
    device = torch.device("cuda", local_rank % count)
    torch.cuda.set_device(device)
    return device


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (step timing); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cuda_path_of(group) -> str:
    """fcoll's CUDA path of ``group`` ("ipc" / "staged"), or "?" where fcoll cannot say."""
    try:
        import fcoll.shm as shm

        return getattr(shm, "cuda_path")(group) or "?"
    except Exception:  # noqa: BLE001  not landed yet, or not an fcoll group
        return "?"


def _init_dist(args: argparse.Namespace, device: torch.device) -> None:
    backend = args.dist_backend
    if args.backend_baseline and backend != "nccl":
        backend = "gloo"
    if backend == "fcoll" and "FCOLL" not in dist.Backend._plugins:
        print("fcoll process-group backend is not registered on this platform; using gloo",
              file=sys.stderr)
        backend = "gloo"
    if "RANK" not in os.environ:  # plain `python examples/train_gpt.py`: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    if backend == "nccl":
        # fcoll's cost model calibrates each group with CPU tensors, which nccl cannot run:
        # those go to gloo, the CUDA tensors of the step to nccl.
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        dist.init_process_group(backend)
    args.dist_backend = backend


def _val_batches(corpus: Corpus, args, device: torch.device):
    """The fixed held-out batches (the same on every rank), on ``device``."""
    for i in range(args.eval_batches):
        x, y = get_batch(corpus.val, args.batch_size, args.seq_len, seed=args.seed + 1, step=i,
                         rank=0, world_size=1)
        yield x.to(device), y.to(device)


def _eval(cfg, params, corpus, args, comm, shapes, device=torch.device("cpu")) -> float:
    """Validation loss (nats) over :func:`_val_batches`, the same on every rank."""
    with torch.no_grad():
        full = params
        if shapes is not None:
            full = {k: comm.all_gather(v)[:math.prod(shapes[k])].view(shapes[k])
                    for k, v in params.items()}
        losses = [float(gpt_loss(full.__getitem__, x, y, cfg))
                  for x, y in _val_batches(corpus, args, device)]
    return sum(losses) / len(losses)


def _describe_device(device: torch.device) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H100 80GB HBM3) of 1 GPU(s)`` (the GPUs this host's ranks
    use: local rank r is on ``cuda:{r % device_count}``)."""
    if device.type != "cuda":
        return "cpu"
    gpus = min(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count())
    return f"{device} ({torch.cuda.get_device_name(device)}) of {gpus} GPU(s)"


def _train_loop(args, corpus: Corpus, device: torch.device, rank: int, world: int,
                train_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                evaluate: Callable[[], float], say: Callable[..., None]) -> dict[str, Any]:
    """Run ``args.steps`` steps of ``train_step(x, y) -> loss`` on this rank's batches, logging
    every ``args.log_every`` steps; return the summary figures (losses in nats, ``step_ms``: the
    median step in ms, the first step, which compiles, left out)."""
    first_val = val = evaluate()
    say(f"step    0 | val loss {first_val:.4f}")
    times, loss = [], float("nan")
    for i in range(1, args.steps + 1):
        x, y = get_batch(corpus.train, args.batch_size, args.seq_len, seed=args.seed, step=i,
                         rank=rank, world_size=world)
        x, y = x.to(device), y.to(device)
        _sync(device)
        t0 = time.perf_counter()
        loss_t = train_step(x, y)
        _sync(device)  # CUDA: the step returns once the work is queued
        times.append(time.perf_counter() - t0)
        loss = float(loss_t)
        if i % args.log_every == 0 or i == args.steps:
            val = evaluate()
            ms = statistics.median(times[1:] or times) * 1e3
            tok = world * args.batch_size * args.seq_len / (ms / 1e3)
            say(f"step {i:4d} | train loss {loss:.4f} | val loss {val:.4f} | "
                f"{ms:7.1f} ms/step | {tok:8.0f} tok/s")
    from torch._dynamo.utils import counters

    ms = statistics.median(times[1:] or times) * 1e3
    return {"first_val_loss": first_val, "final_val_loss": val, "final_train_loss": loss,
            "step_ms": ms, "tokens_per_s": world * args.batch_size * args.seq_len / ms * 1e3,
            "compile_s": times[0], "graph_breaks": sum(counters["graph_break"].values()),
            "device": str(device), "dist_backend": args.dist_backend}


def _main_torch_module(args, cfg: GPTConfig, corpus: Corpus, device: torch.device, rank: int,
                       world: int) -> dict[str, Any]:
    """``main`` for ``--parallel torch-ddp`` / ``torch-fsdp2`` (see :class:`TorchModuleStep`)."""
    params = init_params(cfg, args.seed)
    backend = "inductor" if args.backend_baseline else "fcoll"
    options = None
    if not args.backend_baseline:
        options = {"compute": args.compute}
        if args.trace_dir:
            options["trace_dir"] = args.trace_dir
    counts, stop_counting = count_compiled_collectives()
    step = TorchModuleStep(cfg, params, args.parallel, AdamW(lr=args.lr), device, backend, options,
                           tp_size=args.tp, sequence_parallel=args.sequence_parallel,
                           activation_checkpointing=args.activation_checkpointing,
                           mp_policy=mp_policy(args.param_dtype, args.reduce_dtype))
    say = print if rank == 0 else (lambda *a, **k: None)
    title = {"simple-fsdp": "fcoll.parallel.fully_shard (SimpleFSDP)",
             "tp": "PyTorch tensor parallel",
             "fsdp-tp": f"fully_shard over dp x tensor parallel over tp={args.tp}"}.get(
                 args.parallel)
    title = title or f"PyTorch {args.parallel[len('torch-'):].upper()}"
    title += " with sequence parallel" if args.sequence_parallel else ""
    title += ", blocks activation-checkpointed" if args.activation_checkpointing else ""
    if args.param_dtype or args.reduce_dtype:
        title += (f", params in {args.param_dtype or 'float32'}, gradients reduced in "
                  f"{args.reduce_dtype or args.param_dtype}")
    name = f"{title}, backend={backend}" + (
        f" (compute={_compute_label(args)})" if options else "") + f" on {args.dist_backend}"

    def evaluate() -> float:
        losses = [step.eval_loss(x, y) for x, y in _val_batches(corpus, args, device)]
        return sum(losses) / len(losses)

    say(f"{args.parallel} on {world} rank(s), {_describe_device(device)}, {name}; "
        f"{sum(v.numel() for v in params.values())} parameters; vocab {cfg.vocab_size}; "
        f"communication {'in the compiled graphs' if step.traced_comms else 'in eager hooks'}")
    # tensor parallel: the ranks of one group train on the same batches
    data_rank, data_world = {"tp": (0, 1), "fsdp-tp": (rank // args.tp, world // args.tp)}.get(
        args.parallel, (rank, world))
    summary = _train_loop(args, corpus, device, data_rank, data_world, step, evaluate, say)
    stop_counting()
    collectives = sum(counts.values())
    summary.update(compiled_collectives=collectives, graphs=dict(counts))
    first_val, val, ms = summary["first_val_loss"], summary["final_val_loss"], summary["step_ms"]
    per_graph = ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "none"
    say(f"summary: {args.parallel}, {name}, {world} ranks, {args.steps} steps: val loss "
        f"{first_val:.4f} -> {val:.4f} ({100 * (1 - val / first_val):.1f} % lower); median step "
        f"{ms:.1f} ms; first step (compile) {summary['compile_s']:.1f} s; collectives in the "
        "compiled graphs: "
        f"{collectives if options else 'n/a (not fcoll)'} ({per_graph})")
    dist.destroy_process_group()
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
    device = _setup_device(args)
    _init_dist(args, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = Corpus(load_text())
    cfg = GPTConfig(vocab_size=corpus.vocab_size, seq_len=args.seq_len, n_layer=args.n_layer,
                    n_head=args.n_head, d_model=args.d_model)
    if args.parallel in MODULE_MODES:
        return _main_torch_module(args, cfg, corpus, device, rank, world)
    comm = (TorchComm if args.backend_baseline else FcollComm)(dist.group.WORLD)
    params = {k: v.to(device) for k, v in init_params(cfg, args.seed).items()}
    shapes = None
    if args.parallel == "fsdp":
        shapes = {k: v.shape for k, v in params.items()}
        params = shard_params(params, rank, world)
    state = init_adamw(params)
    step = make_train_step(cfg, comm, args.parallel, AdamW(lr=args.lr), shapes)
    if args.backend_baseline:
        run = compile_step(step, "inductor")
    else:
        options = {"compute": args.compute}
        if args.trace_dir:
            options["trace_dir"] = args.trace_dir
        run = compile_step(step, "fcoll", options)
    say = print if rank == 0 else (lambda *a, **k: None)
    name = f"inductor on {args.dist_backend} (baseline)" if args.backend_baseline else \
        f"fcoll (compute={_compute_label(args, tensor_bytes(tree_leaves((params, state))))}) on " \
        f"{args.dist_backend}"
    where = _describe_device(device)
    say(f"{args.parallel} on {world} rank(s), {where}, {name}; "
        f"{sum(v.numel() for v in params.values())} parameters per rank; vocab "
        f"{cfg.vocab_size}; {len(corpus.train)} train characters")
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nonlocal params, state
        loss_t, _, params, state = run(params, state, x, y)
        return loss_t

    summary = _train_loop(args, corpus, device, rank, world, train_step,
                          lambda: _eval(cfg, params, corpus, args, comm, shapes, device), say)
    first_val, val, ms = summary["first_val_loss"], summary["final_val_loss"], summary["step_ms"]
    breaks = summary["graph_breaks"]
    if device.type == "cuda" and args.dist_backend == "fcoll":
        summary["cuda_path"] = _cuda_path_of(dist.group.WORLD)
        where += f", fcoll CUDA path {summary['cuda_path']}"
    say(f"summary: {args.parallel}, {name}, {world} ranks, {where}, {args.steps} steps: val loss "
        f"{first_val:.4f} -> {val:.4f} ({100 * (1 - val / first_val):.1f} % lower); "
        f"median step {ms:.1f} ms, {summary['tokens_per_s']:.0f} tok/s; first step (compile) "
        f"{summary['compile_s']:.1f} s; graph breaks {breaks}")
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
