"""fcoll's process groups run their collectives eagerly under Dynamo, mixins included.

``fcoll.compat.run_eagerly_under_dynamo`` wraps every c10d entry point a group resolves along
its MRO to one of fcoll's classes (its mixins: ``ReducingCollectives``, ``CudaSubmission``,
``GroupIdentity``) in ``torch._dynamo.disable``, and leaves ``size`` / ``rank`` (traced for
real), internal helpers and the mixin classes themselves alone.
"""

from __future__ import annotations

import inspect

import fcoll  # noqa: F401  registers the backend
from fcoll.shm.group.identity import GroupIdentity
from fcoll.shm.group.process_group import FcollProcessGroup
from fcoll.shm.group.reducing import ReducingCollectives
from fcoll.shm.multihost.hierarchical import HierarchicalProcessGroup

#: The c10d entry points of both groups: the collectives and their aliases, coalescing,
#: lifecycle, the identity setters and getters and the backend look-up.
ENTRY_POINTS = {
    "_allgather_base", "_end_coalescing", "_get_backend", "_reduce_scatter_base",
    "_start_coalescing", "abort",
    "all_gather_single", "all_gather_single_coalesced", "all_to_all_single", "allgather",
    "allgather_coalesced", "allgather_into_tensor_coalesced", "allreduce", "allreduce_coalesced",
    "allreduce_coalesced_out_of_place", "allreduce_out_of_place", "alltoall", "alltoall_base",
    "barrier", "broadcast", "gather", "getBackendName", "getGroupDesc", "getGroupName", "name",
    "recv", "recv_anysource", "reduce", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "scatter", "send",
    "setGroupDesc", "setGroupName", "shutdown", "supports_tensor_alloc",
}


def _wrapped(cls: type) -> set[str]:
    return {name for name in dir(cls)
            if getattr(inspect.getattr_static(cls, name), "_torchdynamo_disable", False)}


def test_both_groups_wrap_exactly_their_c10d_entry_points():
    assert _wrapped(FcollProcessGroup) == ENTRY_POINTS
    assert _wrapped(HierarchicalProcessGroup) == ENTRY_POINTS


def test_size_and_rank_stay_traceable_and_mixins_stay_plain():
    for cls in (FcollProcessGroup, HierarchicalProcessGroup):
        assert not {"size", "rank"} & _wrapped(cls)
    assert not _wrapped(ReducingCollectives)
    assert not _wrapped(GroupIdentity)
    # the group's wrapper calls the mixin's own function
    wrapped = inspect.getattr_static(FcollProcessGroup, "allreduce")
    assert wrapped._torchdynamo_orig_callable is ReducingCollectives.allreduce
