"""fcoll's functional collective ops: ``torch.ops.fcoll.*`` and the Python API over them."""

from fcoll.ops import library  # noqa: F401  defines torch.ops.fcoll.*
from fcoll.ops.async_tensor import AsyncCollectiveTensor
from fcoll.ops.functional import (
    all_gather_into_tensor_coalesced,
    all_gather_tensor,
    all_gather_tensor_autograd,
    all_reduce,
    all_reduce_coalesced,
    all_to_all_single,
    all_to_all_single_autograd,
    broadcast,
    reduce_scatter_tensor,
    reduce_scatter_tensor_autograd,
    reduce_scatter_tensor_coalesced,
    wait_tensor,
)
from fcoll.ops.groups import resolve_group_name
from fcoll.ops import remaps as _remaps  # noqa: F401  installs Dynamo remaps

__all__ = [
    "AsyncCollectiveTensor", "all_gather_into_tensor_coalesced", "all_gather_tensor",
    "all_gather_tensor_autograd", "all_reduce", "all_reduce_coalesced", "all_to_all_single",
    "all_to_all_single_autograd", "broadcast", "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd", "reduce_scatter_tensor_coalesced", "resolve_group_name",
    "wait_tensor",
]
