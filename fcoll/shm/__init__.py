"""fcoll's shared-memory collective backend (``dist.init_process_group("fcoll")``).

Folder map, bottom layer first (each sub-package is one concept; nothing imports upward in it):

- ``transport/``: what every collective runs on. ``segment`` (the sealed memfd segment and its
  layout), ``sync`` (arrival counters, futex waits, liveness, timeouts), ``fences`` (how a rank
  gives up a collective, how its peers read and word that; ``PeerError``), ``op_codes`` (the
  one table of collective names and dtypes as codes), ``headers`` (the per-collective header
  and its wire format), ``header_checks`` (the cross-rank check of headers), ``phases`` (the
  slot and phase protocol every algorithm runs on).
- ``kernels/``: the algorithms over slots. ``reductions`` (all_reduce, coalesced all_reduce,
  reduce_scatter), ``movement`` (all_gather, broadcast, all_to_all, barrier), ``one_slot``
  (one-phase kernels with cached views, for the fast paths and the direct path).
- ``engine``: the per-group executor and worker thread, and the one way to issue a collective
  (:meth:`~fcoll.shm.engine.Engine.job` takes the sequence number;
  :meth:`~fcoll.shm.engine.Engine.run_now` runs one on the caller's thread).
- ``work``: a collective after it is issued: the queued ``Job``, its future, and the c10d
  ``Work`` objects the group returns (``FcollWork``, ``DoneWork``).
- ``cuda/``: CUDA tensors. ``paths`` (the path choice, the IPC path, the device check; all
  stream-ordered), ``lifetime`` (when the IPC path may let go of memory and events peers use),
  ``records`` (the bounded records of the setup exchanges), ``fold`` and ``fold_kernel`` (the
  IPC reductions as one Triton kernel, opt-in), ``staging`` (the staged path), ``submission``
  (the process group's CUDA helpers, a mixin).
- ``p2p/``: point-to-point. ``inbox`` (per-rank sealed memfd inboxes), ``protocol`` (operation
  records, the ring and matching steps), ``sendrecv`` (the send/recv engine of a group).
- ``group/``: the c10d surface. ``process_group`` (``FcollProcessGroup``, the
  ``dist.ProcessGroup`` c10d calls: lifecycle, submission, data movement), ``reducing`` (its
  collectives that take a reduce op, a mixin), ``identity`` (the c10d identity both process
  groups share), ``arg_checks`` (the per-call argument checks of both process groups),
  ``validate`` (tensor-level checks, staging), ``fast_paths`` (when and how a synchronous
  small collective runs on the caller's thread), ``direct`` (compiled graphs' calls straight
  into the engine), ``abort`` (``fcoll.fence_on_error``: abort groups when an exception leaves
  a block), ``sparse`` (both groups' all_reduce of a sparse COO tensor, as gloo's, composed of
  dense all_gathers).
- ``multihost/``: groups across hosts. ``host_layout`` (host identity, which ranks share a
  host), ``gloo_link`` (gloo between hosts: byte views, reductions gloo lacks, the agreement
  across the link, pipeline pieces), ``ordered_queue`` (the ordered queue and its ``Work``s),
  ``compositions`` (the composed collectives as algorithms over the sub-groups),
  ``hierarchical`` (``HierarchicalProcessGroup``).
"""

from __future__ import annotations

import hashlib
import platform

import torch.distributed as dist

from fcoll.shm.group.identity import BACKEND_NAME, DEVICE_TYPES

__all__ = ["register_backend", "create_process_group", "members_prefix", "cuda_path",
           "BACKEND_NAME"]


def create_process_group(common_opts, backend_opts=None):
    """Backend creator for ``Backend.register_backend(..., extended_api=True)``.

    The group's ranks first exchange their host identity
    (:func:`fcoll.shm.multihost.host_layout.host_id`) through the group's store. Ranks all on one
    host get a plain :class:`~fcoll.shm.group.process_group.FcollProcessGroup` (shared memory, no
    overhead); ranks on several hosts get a
    :class:`~fcoll.shm.multihost.hierarchical.HierarchicalProcessGroup` (shared memory inside each
    host, gloo between hosts). A group of one rank skips the exchange. Every key the group puts
    in the store is under :func:`members_prefix` of its global ranks.
    """
    from fcoll.shm.multihost.host_layout import HostLayout, exchange_host_ids
    from fcoll.shm.group.process_group import FcollProcessGroup

    rank, size = common_opts.group_rank, common_opts.group_size
    global_ranks = list(common_opts.global_ranks_in_group or [])
    store = dist.PrefixStore(members_prefix(global_ranks, size), common_opts.store)
    if size > 1:
        ids = exchange_host_ids(dist.PrefixStore("fcoll-hosts/", store), rank, size,
                                common_opts.timeout)
        layout = HostLayout.from_host_ids(ids)
        if layout.num_hosts > 1:
            from fcoll.shm.multihost.hierarchical import HierarchicalProcessGroup

            return HierarchicalProcessGroup(store, rank, size, common_opts.timeout, layout,
                                            global_ranks=global_ranks)
    return FcollProcessGroup(store, rank, size, common_opts.timeout, global_ranks=global_ranks)


def members_prefix(global_ranks: list[int], size: int) -> str:
    """The store prefix of a group of ``size`` ranks whose global ranks are ``global_ranks``
    (empty: the default group): ``fcoll-<12 hex digits of SHA-256 of the ranks>/``.

    c10d names a group by a counter, so ranks that call ``new_group`` with different ranks
    lists (``new_group([0, 1])`` on ranks 0 and 1 while ranks 2 and 3 call ``new_group([2, 3])``,
    which PyTorch's docs forbid unless ``use_local_synchronization=True``) give two groups one
    name and one store prefix. Their group ranks 0 published two segments under one key, and
    ranks attached to the other group's (one rank's all_reduce returned another group's sum,
    the others failed; gloo hangs). Keyed by its members too, each group meets only its own
    ranks and computes what its members asked for.
    """
    members = ",".join(map(str, global_ranks)) if global_ranks else f"world of {size}"
    return f"fcoll-{hashlib.sha256(members.encode()).hexdigest()[:12]}/"


def register_backend() -> None:
    """Register the ``"fcoll"`` backend with torch.distributed; calling it again is a no-op.

    Only on Linux x86-64: the publication protocol relies on x86-64 store ordering and the
    futex syscall number.
    """
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                  devices=list(DEVICE_TYPES))


def cuda_path(group=None) -> str | None:
    """The CUDA path of an fcoll group: ``"ipc"`` or ``"staged"`` (see :mod:`fcoll.shm.cuda.paths`),
    None before its first CUDA collective or for a group of another backend.

    Args:
        group: a process group (default: the default group).
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return getattr(pg, "cuda_path", None)
