"""Canonical fcoll graphs for pass tests: DDP backward, FSDP forward/backward, MoE all_to_all,
and seeded random DAGs.

Every builder returns a ``torch.fx.GraphModule`` traced with ``make_fx`` under
``FakeTensorMode`` from ``torch.ops.fcoll`` / ``fcoll.*`` calls, so nodes carry ``meta["val"]``
(fake tensors) and no data is allocated. A process group must exist (any backend; the graphs only
record its name): single-process tests call :func:`ensure_fake_pg` first, which initialises
PyTorch's fake process group (rank 0 of 2). The graphs are pure functions of their arguments, so
rebuilding one on every rank of a real group gives the same graph, and a GraphModule holding fcoll
ops runs directly on real tensors (``gm(*example_inputs(gm, rank))``).

Shapes use ``n`` = group size (2 on the fake pg). Sizes are in elements; dtypes float32.

Other engineers import this module read-only; keep the builders' names and arguments stable.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fcoll

__all__ = [
    "ensure_fake_pg", "trace", "example_inputs", "ddp_backward", "fsdp_forward",
    "fsdp_backward", "moe_all_to_all", "random_dag", "mm_overlap",
]

_fc = torch.ops.fcoll


def ensure_fake_pg(world_size: int = 2) -> None:
    """Initialise PyTorch's fake process group (rank 0 of ``world_size``) unless one exists."""
    if dist.is_initialized():
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def _group(group: str | None) -> tuple[str, int]:
    """(group name, group size) of ``group`` (default: the world group)."""
    name = group if group is not None else dist.group.WORLD.group_name
    return name, fcoll.ops.groups.group_size(name)


def trace(fn: Callable[..., object], shapes: Sequence[Sequence[int]],
          dtype: torch.dtype = torch.float32) -> fx.GraphModule:
    """``make_fx(fn)`` on fake inputs of ``shapes`` under a fresh ``FakeTensorMode``."""
    with FakeTensorMode():
        args = [torch.empty(*s, dtype=dtype) for s in shapes]
        return make_fx(fn)(*args)


def example_inputs(gm: fx.GraphModule, seed: int = 0, scale: float = 0.1) -> list[torch.Tensor]:
    """Real inputs for ``gm``'s placeholders (shapes and dtypes from their ``meta["val"]``).

    Values are drawn from ``torch.Generator`` seeded with ``seed`` (pass ``seed + rank`` for
    different inputs per rank), times ``scale``.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta["val"]
            shape = [int(s) for s in v.shape]
            out.append((torch.randn(shape, generator=g) * scale).to(v.dtype))
    return out


def ddp_backward(n_layers: int = 4, batch: int = 256, hidden: int = 1024,
                 group: str | None = None) -> fx.GraphModule:
    """Backward of an ``n_layers`` MLP under DDP: each weight gradient is all_reduced (avg) as
    soon as it is produced, and waited right away (as tracing emits it).

    Inputs: ``grad_out [batch, hidden]``, then per layer ``i`` (0 = first) the saved activation
    ``x_i [batch, hidden]`` and the weight ``w_i [hidden, hidden]``.
    Outputs: ``n_layers`` reduced gradients ``[hidden, hidden]`` (last layer first) and
    ``grad_in [batch, hidden]``.

    Graph (per layer, last layer first)::

        mm(grad.T, x_i) -> all_reduce -> wait ; mm(grad, w_i) -> threshold_backward -> next layer
    """
    name, _ = _group(group)

    def step(grad, *saved):
        grads = []
        for i in reversed(range(n_layers)):
            x, w = saved[2 * i], saved[2 * i + 1]
            gw = torch.mm(grad.t(), x)
            grads.append(fcoll.all_reduce(gw, "avg", name))
            grad = torch.mm(grad, w)
            if i > 0:
                grad = torch.ops.aten.threshold_backward(grad, x, 0.0)
        return (*grads, grad)

    shapes = [(batch, hidden)] + [s for _ in range(n_layers)
                                  for s in ((batch, hidden), (hidden, hidden))]
    return trace(step, shapes)


def fsdp_forward(n_layers: int = 4, batch: int = 256, hidden: int = 1024,
                 group: str | None = None) -> fx.GraphModule:
    """Forward of an ``n_layers`` MLP under FSDP: each layer all_gathers its weight shard just
    before use, and waits right away.

    Inputs: ``x [batch, hidden]``, then per layer a shard ``[hidden // n, hidden]``.
    Output: ``[batch, hidden]``.

    Graph (per layer)::

        all_gather(shard_i) -> wait -> mm(x, w_i.T) -> relu
    """
    name, n = _group(group)

    def step(x, *shards):
        for s in shards:
            w = fcoll.all_gather_tensor(s, 0, name)
            x = torch.relu(torch.mm(x, w.t()))
        return x

    return trace(step, [(batch, hidden)] + [(hidden // n, hidden)] * n_layers)


def fsdp_backward(n_layers: int = 4, batch: int = 256, hidden: int = 1024,
                  group: str | None = None) -> fx.GraphModule:
    """Backward of an ``n_layers`` MLP under FSDP: per layer (last first) the weight is
    all_gathered again, the input gradient computed, and the weight gradient reduce_scattered
    (avg) to its shard.

    Inputs: ``grad_out [batch, hidden]``, then per layer the saved activation
    ``x_i [batch, hidden]`` and the shard ``[hidden // n, hidden]``.
    Outputs: ``n_layers`` gradient shards ``[hidden // n, hidden]`` (last layer first) and
    ``grad_in [batch, hidden]``.

    Graph (per layer)::

        all_gather(shard_i) -> wait -> mm(grad, w_i) ; mm(grad.T, x_i) -> reduce_scatter -> wait
    """
    name, n = _group(group)

    def step(grad, *saved):
        grads = []
        for i in reversed(range(n_layers)):
            x, shard = saved[2 * i], saved[2 * i + 1]
            w = fcoll.all_gather_tensor(shard, 0, name)
            gw = torch.mm(grad.t(), x)
            grads.append(fcoll.reduce_scatter_tensor(gw, "avg", 0, name))
            grad = torch.mm(grad, w)
            if i > 0:
                grad = torch.ops.aten.threshold_backward(grad, x, 0.0)
        return (*grads, grad)

    shapes = [(batch, hidden)] + [s for _ in range(n_layers)
                                  for s in ((batch, hidden), (hidden // n, hidden))]
    return trace(step, shapes)


def moe_all_to_all(n_blocks: int = 2, tokens: int = 512, hidden: int = 512,
                   ffn: int = 1024, group: str | None = None) -> fx.GraphModule:
    """``n_blocks`` MoE blocks with a dense shared expert: tokens are dispatched with
    all_to_all_single (even splits), run through this rank's expert MLP, combined with a second
    all_to_all_single, scaled by a gate and added to the shared expert's output.

    Inputs: ``x [tokens, hidden]``, then per block ``w_gate [hidden, 1]``,
    ``w_in [hidden, ffn]``, ``w_out [ffn, hidden]``, ``ws_in [hidden, ffn]``,
    ``ws_out [ffn, hidden]``. Output: ``[tokens, hidden]``.

    Graph (per block)::

        a2a(x) -> wait -> mm -> relu -> mm -> a2a -> wait -> mul(gate) -> add(shared(x))
        shared(x) = mm(relu(mm(x, ws_in)), ws_out)   (independent of both a2a)
    """
    name, _ = _group(group)

    def step(x, *ws):
        for b in range(n_blocks):
            w_gate, w_in, w_out, ws_in, ws_out = ws[5 * b:5 * b + 5]
            gate = torch.sigmoid(torch.mm(x, w_gate))
            routed = fcoll.all_to_all_single(x, None, None, name)
            h = torch.mm(torch.relu(torch.mm(routed, w_in)), w_out)
            back = fcoll.all_to_all_single(h, None, None, name)
            shared = torch.mm(torch.relu(torch.mm(x, ws_in)), ws_out)
            x = x + back * gate + shared
        return x

    shapes = [(tokens, hidden)] + [s for _ in range(n_blocks) for s in
                                   ((hidden, 1), (hidden, ffn), (ffn, hidden), (hidden, ffn),
                                    (ffn, hidden))]
    return trace(step, shapes)


def mm_overlap(size: int = 512, group: str | None = None) -> fx.GraphModule:
    """The smallest overlap opportunity: ``all_reduce(a) -> wait`` then an independent ``mm``.

    Inputs ``a, b, c [size, size]``; output ``relu(wait(all_reduce(a))) + mm(b, c)``.
    Graph: ``ar -> wait -> relu -> mm -> add``; overlapped: ``ar -> mm -> wait -> relu -> add``.
    """
    name, _ = _group(group)

    def step(a, b, c):
        r = torch.relu(fcoll.all_reduce(a, "sum", name))
        return r + torch.mm(b, c)

    return trace(step, [(size, size)] * 3)


def random_dag(seed: int, n_ops: int = 24, size: int = 32, p_collective: float = 0.3,
               n_inputs: int = 3, group: str | None = None) -> fx.GraphModule:
    """A random valid fcoll graph: compute, collectives and their waits, seeded.

    Every value is ``[size, size]`` float32 (``size`` divisible by the group size). Ops are
    drawn from mm (followed by tanh, to keep values bounded), add, mul, relu, and the
    collectives all_reduce (sum), all_gather (then the two halves added), reduce_scatter (then
    repeated back to ``size`` rows), all_to_all_single (even splits). A collective's wait is
    emitted at a random later step, always before its result is used; the outputs are every value
    no other node uses (so nothing is dead). Same ``seed`` and group -> the same graph.

    Inputs: ``n_inputs`` tensors ``[size, size]``.
    """
    name, n = _group(group)
    if size % n:
        raise ValueError(f"random_dag: size {size} must be divisible by the group size {n}")

    def step(*inputs):
        rng = random.Random(seed)
        ready = list(inputs)  # values any op may use
        used: set[int] = set()
        pending: list[tuple[torch.Tensor, str]] = []  # (collective output, kind)

        def pick():
            t = rng.choice(ready)
            used.add(id(t))
            return t

        def wait_one(i):
            out, kind = pending.pop(i)
            w = _fc.wait_tensor(out)
            if kind == "all_gather":
                w = w[:size] + w[size:2 * size] if n == 2 else w[:size]
            elif kind == "reduce_scatter":
                w = w.repeat(n, 1)
            ready.append(w)

        for _ in range(n_ops):
            if pending and rng.random() < 0.35:
                wait_one(rng.randrange(len(pending)))
                continue
            if rng.random() < p_collective:
                x, kind = pick(), rng.choice(["all_reduce", "all_gather", "reduce_scatter",
                                              "all_to_all"])
                if kind == "all_reduce":
                    out = _fc.all_reduce(x, "sum", name)
                elif kind == "all_gather":
                    out = _fc.all_gather_into_tensor(x, n, name)
                elif kind == "reduce_scatter":
                    out = _fc.reduce_scatter_tensor(x, "sum", n, name)
                else:
                    out = _fc.all_to_all_single(x, [size // n] * n, [size // n] * n, name)
                pending.append((out, kind))
                continue
            op = rng.choice(["mm", "add", "mul", "relu"])
            if op == "mm":
                y = torch.tanh(torch.mm(pick(), pick()))
            elif op == "add":
                y = pick() + pick()
            elif op == "mul":
                y = pick() * 0.5 + pick() * 0.5
            else:
                y = torch.relu(pick())
            ready.append(y)
        while pending:
            wait_one(0)
        return tuple(t for t in ready if id(t) not in used)

    return trace(step, [(size, size)] * n_inputs)
