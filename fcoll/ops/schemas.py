"""The ``torch.ops.fcoll`` op definitions: the library, every op's schema and tags, which ops
are side effects, and the output-shape rules the eager and fake kernels share.

Schemas mirror ``torch.ops._c10d_functional`` (same names, argument order, string ``group_name``),
so a graph pass can rewrite one namespace into the other by swapping the target alone. Where
torch's collectives take ``Any group_name`` (2.13: a name or a ``ProcessGroup``), fcoll's default
overloads keep ``str`` and an overload ``.group`` takes ``Any``: a call with a group object
resolves to it, and it calls the default overload with the group's name
(:mod:`fcoll.ops.library`), so graphs hold names as PyTorch's do. One ``Any`` argument in an
op's schema is what Inductor's C++ wrapper (``cpp_wrapper=True``) cannot pass to a custom op
("arg type Any is not yet supported by custom_op_wrapper"); PyTorch's own ops reach it through
C shims fcoll cannot add. The eager kernels are registered by :mod:`fcoll.ops.library`, the
fake kernels by :mod:`fcoll.ops.fakes`; importing :mod:`fcoll.ops.library` does all three.
"""

from __future__ import annotations

import torch

from fcoll import compat

lib = torch.library.Library("fcoll", "DEF")  # noqa: TOR901  (ops defined once, at import)

_PT2 = (torch.Tag.pt2_compliant_tag,)

SCHEMAS = {
    "all_reduce": "all_reduce(Tensor input, str reduce_op, str group_name) -> Tensor",
    "all_reduce_":
        "all_reduce_(Tensor(a!) input, str reduce_op, str group_name) -> Tensor(a!)",
    "all_reduce_coalesced":
        "all_reduce_coalesced(Tensor[] inputs, str reduce_op, str group_name) -> Tensor[]",
    "all_reduce_coalesced_":
        "all_reduce_coalesced_(Tensor[](a!) inputs, str reduce_op, str group_name) "
        "-> Tensor[](a!)",
    "all_gather_into_tensor":
        "all_gather_into_tensor(Tensor input, int group_size, str group_name) -> Tensor",
    "all_gather_into_tensor_out":
        "all_gather_into_tensor_out(Tensor input, int group_size, str group_name, *, "
        "Tensor(a!) out) -> Tensor(a!)",
    "all_gather_into_tensor_coalesced":
        "all_gather_into_tensor_coalesced(Tensor[] inputs, int group_size, str group_name) "
        "-> Tensor[]",
    "reduce_scatter_tensor":
        "reduce_scatter_tensor(Tensor input, str reduce_op, int group_size, str group_name) "
        "-> Tensor",
    "reduce_scatter_tensor_out":
        "reduce_scatter_tensor_out(Tensor input, str reduce_op, int group_size, "
        "str group_name, *, Tensor(a!) out) -> Tensor(a!)",
    "reduce_scatter_tensor_coalesced":
        "reduce_scatter_tensor_coalesced(Tensor[] inputs, str reduce_op, int group_size, "
        "str group_name) -> Tensor[]",
    "all_to_all_single":
        "all_to_all_single(Tensor input, SymInt[] output_split_sizes, "
        "SymInt[] input_split_sizes, str group_name) -> Tensor",
    "broadcast": "broadcast(Tensor input, int src, str group_name) -> Tensor",
    "broadcast_": "broadcast_(Tensor(a!) input, int src, str group_name) -> Tensor(a!)",
    "wait_tensor": "wait_tensor(Tensor tensor) -> Tensor",
    # Point-to-point, as torch 2.13's _c10d_functional has them (a str group name there too);
    # ``dst`` / ``src`` / ``peer_list`` are global ranks.
    "isend": "isend(Tensor tensor, int dst, int tag, str group_name) -> Tensor",
    "irecv": "irecv(Tensor tensor, int src, int tag, str group_name) -> Tensor",
    "batch_p2p_ops":
        "batch_p2p_ops(str[] op_list, int[] peer_list, int[] tag_list, Tensor[] tensors, "
        "str group_name) -> Tensor[]",
}

_EXTRA_TAGS = {
    # Tagging in-place and out= variants lets AOTAutograd functionalize them
    # (auto_functionalized_v2) instead of rejecting their aliased returns. torch 2.11 has neither
    # tag nor that support; there functionalize_as_twins stands in (a no-op on 2.13).
    "all_reduce_": compat.INPLACE_TAGS,
    "broadcast_": compat.INPLACE_TAGS,
    "all_gather_into_tensor_out": compat.OUT_TAGS,
    "reduce_scatter_tensor_out": compat.OUT_TAGS,
}

for _name, _schema in SCHEMAS.items():
    lib.define(_schema, tags=_PT2 + _EXTRA_TAGS.get(_name, ()))


#: The collectives whose ``group_name`` torch types ``Any`` (2.13), each with an overload
#: ``.group`` of torch's schema; empty where torch types it ``str``. Its kernel is registered by
#: :mod:`fcoll.ops.library` (CompositeImplicitAutograd: it decomposes into the default overload
#: before autograd, functionalization or a fake kernel see it).
GROUP_OVERLOADS: tuple[str, ...] = tuple(n for n in SCHEMAS if compat.takes_a_group_object(n))
for _name in GROUP_OVERLOADS:
    _head, _rest = SCHEMAS[_name].split("(", 1)
    lib.define(f"{_head}.group({_rest.replace('str group_name', 'Any group_name')}",
               tags=_PT2 + _EXTRA_TAGS.get(_name, ()))

compat.functionalize_as_twins(lib, {"all_reduce_": "all_reduce", "broadcast_": "broadcast",
                                     "all_gather_into_tensor_out": "all_gather_into_tensor",
                                     "reduce_scatter_tensor_out": "reduce_scatter_tensor"})
# A list of aliased returns (``Tensor[](a!)``, as torch's own op returns) is auto-functionalized
# by no torch version, and Tag.inplace needs a single first tensor: the twin kernel on every one.
compat.functionalize_as_twins(lib, {"all_reduce_coalesced_": "all_reduce_coalesced"},
                              always=True)

torch.fx.node.has_side_effect(torch.ops.fcoll.wait_tensor.default)

# wait_tensor's kernel returns a completed *copy* of its input, never the input itself. Custom ops
# may not return an alias of an input: AOTAutograd's first-call analysis raises on it under CI=1
# (torch._functorch.config.error_on_custom_op_aliasing) and warns otherwise, "to become an error";
# PyTorch exempts only its own _c10d_functional namespace (runtime_wrappers.py, pytorch#170986).
# The copy also keeps Inductor, which treats the op as a functional fallback kernel, from reusing
# the collective's buffer while the wait's output is alive. The copy-free paths are fcoll's own:
# the backend's executor and AsyncCollectiveTensor call fcoll.ops.pending.wait directly.
for _inplace in ("all_reduce_", "all_reduce_coalesced_", "all_gather_into_tensor_out",
                 "reduce_scatter_tensor_out", "broadcast_", "isend", "irecv", "batch_p2p_ops"):
    torch.fx.node.has_side_effect(getattr(torch.ops.fcoll, _inplace).default)

# ---------------------------------------------------------------------------------------------
# Output shapes (per rank; shared by the eager and fake kernels)

def gathered_shape(input: torch.Tensor, group_size: int) -> list:
    """all_gather's output shape: ``input [N, *] -> [group_size * N, *]`` (0-dim:
    ``[group_size]``)."""
    if input.dim() == 0:
        return [group_size]
    return [group_size * input.size(0), *input.shape[1:]]


def scattered_shape(input: torch.Tensor, group_size: int) -> list:
    """reduce_scatter's output shape: ``input [group_size * N, *] -> [N, *]``."""
    return [input.size(0) // group_size, *input.shape[1:]]


def p2p_output(op: str, t: torch.Tensor) -> torch.Tensor:
    """The output ``batch_p2p_ops`` returns for one operation on ``t``: an empty tensor for
    ``"isend"``, a fresh contiguous tensor like ``t`` for ``"irecv"``.

    Raises:
        ValueError: ``op`` is neither.
    """
    if op == "isend":
        return t.new_empty(0)
    if op == "irecv":
        return torch.empty_like(t, memory_format=torch.contiguous_format)
    raise ValueError(f"fcoll.batch_p2p_ops: op {op!r} is not 'isend' or 'irecv'")
