"""Autograd formulas for the differentiable ``fcoll`` ops.

Each backward issues the adjoint collective and waits for it at once (a compiled backward graph
gets the same ``op -> wait_tensor`` pair, and the passes then move the wait).

=====================================  ==============================================================
forward (rank r, n ranks)              backward
=====================================  ==============================================================
all_reduce sum: ``y = sum_k x_k``      ``dx = all_reduce(dy, sum)``
all_reduce avg: ``y = mean_k x_k``     ``dx = all_reduce(dy, avg)``
all_gather                             ``dx = reduce_scatter(dy, sum)``
reduce_scatter sum / avg               ``dx = all_gather(dy)`` (``/ n`` for avg)
all_to_all_single(out_s, in_s)         ``dx = all_to_all_single(dy, in_s, out_s)`` (splits swapped)
broadcast from src                     ``dx = all_reduce(dy, sum)`` on src, zeros elsewhere
wait_tensor                            identity
=====================================  ==============================================================

These are the adjoints of the linear maps the collectives compute; the same formulas are used by
``torch.distributed._functional_collectives`` (all_gather / reduce_scatter / all_to_all) and by
Megatron-LM's tensor-parallel mappings. Reductions other than sum and avg (min, max, product,
bitwise) are not differentiable here and raise in backward.
"""

from __future__ import annotations

import torch

from fcoll.ops.async_tensor import complete
from fcoll.ops.groups import group_from_name

__all__: list[str] = []

_ops = torch.ops.fcoll


def _differentiable_reduce(op: str, reduce_op: str) -> None:
    if reduce_op not in ("sum", "avg"):
        raise RuntimeError(f"fcoll.{op}: backward is defined for reduce_op 'sum' and 'avg', "
                           f"got {reduce_op!r}")


def _wait(t: torch.Tensor) -> torch.Tensor:
    return complete(t)


# all_reduce ----------------------------------------------------------------------------------

def _setup_reduce(ctx, inputs, output):
    ctx.reduce_op, ctx.group_name = inputs[1], inputs[2]


def _all_reduce_backward(ctx, grad):
    _differentiable_reduce("all_reduce", ctx.reduce_op)
    return _wait(_ops.all_reduce(grad.contiguous(), ctx.reduce_op, ctx.group_name)), None, None


def _all_reduce_coalesced_backward(ctx, grads):
    _differentiable_reduce("all_reduce_coalesced", ctx.reduce_op)
    outs = _ops.all_reduce_coalesced([g.contiguous() for g in grads], ctx.reduce_op,
                                     ctx.group_name)
    return [_wait(o) for o in outs], None, None


# all_gather ----------------------------------------------------------------------------------

def _setup_gather(ctx, inputs, output):
    ctx.group_size, ctx.group_name = inputs[1], inputs[2]
    ctx.scalar = [t.dim() == 0 for t in (inputs[0] if isinstance(inputs[0], (list, tuple))
                                         else [inputs[0]])]


def _all_gather_backward(ctx, grad):
    g = _ops.reduce_scatter_tensor(grad.contiguous(), "sum", ctx.group_size, ctx.group_name)
    g = _wait(g)
    return (g.reshape(()) if ctx.scalar[0] else g), None, None


def _all_gather_coalesced_backward(ctx, grads):
    outs = _ops.reduce_scatter_tensor_coalesced([g.contiguous() for g in grads], "sum",
                                                ctx.group_size, ctx.group_name)
    outs = [_wait(o) for o in outs]
    return [o.reshape(()) if s else o for o, s in zip(outs, ctx.scalar)], None, None


# reduce_scatter ------------------------------------------------------------------------------

def _setup_scatter(ctx, inputs, output):
    ctx.reduce_op, ctx.group_size, ctx.group_name = inputs[1], inputs[2], inputs[3]


def _scatter_grad(ctx, g: torch.Tensor) -> torch.Tensor:
    return g / ctx.group_size if ctx.reduce_op == "avg" else g


def _reduce_scatter_backward(ctx, grad):
    _differentiable_reduce("reduce_scatter_tensor", ctx.reduce_op)
    g = _wait(_ops.all_gather_into_tensor(grad.contiguous(), ctx.group_size, ctx.group_name))
    return _scatter_grad(ctx, g), None, None, None


def _reduce_scatter_coalesced_backward(ctx, grads):
    _differentiable_reduce("reduce_scatter_tensor_coalesced", ctx.reduce_op)
    outs = _ops.all_gather_into_tensor_coalesced([g.contiguous() for g in grads],
                                                 ctx.group_size, ctx.group_name)
    return [_scatter_grad(ctx, _wait(o)) for o in outs], None, None, None


# all_to_all_single ---------------------------------------------------------------------------

def _setup_all_to_all(ctx, inputs, output):
    ctx.output_split_sizes, ctx.input_split_sizes, ctx.group_name = inputs[1], inputs[2], inputs[3]


def _all_to_all_backward(ctx, grad):
    g = _ops.all_to_all_single(grad.contiguous(), ctx.input_split_sizes,
                               ctx.output_split_sizes, ctx.group_name)
    return _wait(g), None, None, None


# broadcast -----------------------------------------------------------------------------------

def _setup_broadcast(ctx, inputs, output):
    ctx.src, ctx.group_name = inputs[1], inputs[2]


def _broadcast_backward(ctx, grad):
    g = _wait(_ops.all_reduce(grad.contiguous(), "sum", ctx.group_name))
    if group_from_name(ctx.group_name).rank() != ctx.src:
        g = torch.zeros_like(g)
    return g, None, None


# wait_tensor ---------------------------------------------------------------------------------

def _wait_backward(ctx, grad):
    return grad


def _no_setup(ctx, inputs, output):
    return None


_REGISTRATIONS = {
    "all_reduce": (_all_reduce_backward, _setup_reduce),
    "all_reduce_coalesced": (_all_reduce_coalesced_backward, _setup_reduce),
    "all_gather_into_tensor": (_all_gather_backward, _setup_gather),
    "all_gather_into_tensor_coalesced": (_all_gather_coalesced_backward, _setup_gather),
    "reduce_scatter_tensor": (_reduce_scatter_backward, _setup_scatter),
    "reduce_scatter_tensor_coalesced": (_reduce_scatter_coalesced_backward, _setup_scatter),
    "all_to_all_single": (_all_to_all_backward, _setup_all_to_all),
    "broadcast": (_broadcast_backward, _setup_broadcast),
    "wait_tensor": (_wait_backward, _no_setup),
}

for _name, (_backward, _setup) in _REGISTRATIONS.items():
    torch.library.register_autograd(f"fcoll::{_name}", _backward, setup_context=_setup)
