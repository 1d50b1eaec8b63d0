"""Fake kernels of ``torch.ops.fcoll`` (FakeTensorMode, symbolic shapes): each op's output
metadata, with no data moved.

Registered on :data:`fcoll.ops.schemas.lib` once the ops are defined; :mod:`fcoll.ops.library`
imports this module at its end, so importing the library registers them.
"""

from __future__ import annotations

import torch

from fcoll.ops.schemas import gathered_shape, p2p_output, scattered_shape, lib


def _fake(name: str):
    return torch.library.register_fake(f"fcoll::{name}", lib=lib)


@_fake("all_reduce")
def _(input, reduce_op, group_name):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@_fake("all_reduce_")
def _(input, reduce_op, group_name):
    return input


@_fake("all_reduce_coalesced")
def _(inputs, reduce_op, group_name):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]


@_fake("all_reduce_coalesced_")
def _(inputs, reduce_op, group_name):
    return list(inputs)


@_fake("all_gather_into_tensor")
def _(input, group_size, group_name):
    return input.new_empty(gathered_shape(input, group_size))


@_fake("all_gather_into_tensor_out")
def _(input, group_size, group_name, *, out):
    return out


@_fake("all_gather_into_tensor_coalesced")
def _(inputs, group_size, group_name):
    return [t.new_empty(gathered_shape(t, group_size)) for t in inputs]


@_fake("reduce_scatter_tensor")
def _(input, reduce_op, group_size, group_name):
    return input.new_empty(scattered_shape(input, group_size))


@_fake("reduce_scatter_tensor_out")
def _(input, reduce_op, group_size, group_name, *, out):
    return out


@_fake("reduce_scatter_tensor_coalesced")
def _(inputs, reduce_op, group_size, group_name):
    return [t.new_empty(scattered_shape(t, group_size)) for t in inputs]


@_fake("all_to_all_single")
def _(input, output_split_sizes, input_split_sizes, group_name):
    return input.new_empty([sum(output_split_sizes), *input.shape[1:]])


@_fake("broadcast")
def _(input, src, group_name):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@_fake("broadcast_")
def _(input, src, group_name):
    return input


@_fake("wait_tensor")
def _(tensor):
    # A fresh tensor, like the eager kernel's copy (and PyTorch's _c10d_functional meta kernel).
    return torch.empty_like(tensor)


@_fake("isend")
def _(tensor, dst, tag, group_name):
    return tensor.new_empty(0)


@_fake("irecv")
def _(tensor, src, tag, group_name):
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


@_fake("batch_p2p_ops")
def _(op_list, peer_list, tag_list, tensors, group_name):
    return [p2p_output(op, t) for op, t in zip(op_list, tensors)]
