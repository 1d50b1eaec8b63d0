"""fcoll's functional collective ops: ``torch.ops.fcoll.*`` and the Python API over them."""

from fcoll.ops import library  # noqa: F401  defines torch.ops.fcoll.*
from fcoll.ops.cache_key import guard_compile_caches as _guard_compile_caches
_guard_compile_caches()  # PyTorch's compile caches never serve another fcoll's ops
from fcoll.ops.async_tensor import AsyncCollectiveTensor
from fcoll.ops.functional import (
    all_gather_into_tensor_coalesced,
    all_gather_single,
    all_gather_single_autograd,
    all_gather_single_coalesced,
    all_gather_tensor,
    all_gather_tensor_autograd,
    all_reduce,
    all_reduce_coalesced,
    all_to_all_single,
    all_to_all_single_autograd,
    broadcast,
    reduce_scatter_single,
    reduce_scatter_single_autograd,
    reduce_scatter_single_coalesced,
    reduce_scatter_tensor,
    reduce_scatter_tensor_autograd,
    reduce_scatter_tensor_coalesced,
    wait_tensor,
)
from fcoll.ops.groups import resolve_group_name
from fcoll.ops.inplace import (
    RANK_TYPES,
    REDUCE_OP_TO_STR,
    all_gather_inplace,
    all_gather_tensor_inplace,
    all_reduce_inplace,
    all_to_all_inplace,
    allow_inflight_collective_as_graph_input_ctx,
    batch_p2p_ops_inplace,
    irecv_inplace,
    isend_inplace,
    permute_tensor,
    reduce_scatter_tensor_inplace,
)
from fcoll.ops import remaps as _remaps  # noqa: F401  installs Dynamo remaps

#: The public API, a superset of ``torch.distributed._functional_collectives``' (torch 2.13).
API = [
    "AsyncCollectiveTensor", "RANK_TYPES", "REDUCE_OP_TO_STR", "all_gather_inplace",
    "all_gather_into_tensor_coalesced", "all_gather_single", "all_gather_single_autograd",
    "all_gather_single_coalesced", "all_gather_tensor", "all_gather_tensor_autograd",
    "all_gather_tensor_inplace", "all_reduce", "all_reduce_coalesced", "all_reduce_inplace",
    "all_to_all_inplace", "all_to_all_single", "all_to_all_single_autograd",
    "allow_inflight_collective_as_graph_input_ctx", "batch_p2p_ops_inplace", "broadcast",
    "irecv_inplace", "isend_inplace", "permute_tensor", "reduce_scatter_single",
    "reduce_scatter_single_autograd", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor", "reduce_scatter_tensor_autograd", "reduce_scatter_tensor_coalesced",
    "reduce_scatter_tensor_inplace", "wait_tensor",
]

__all__ = [*API, "resolve_group_name"]
