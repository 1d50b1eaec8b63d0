"""Host identity and the host layout of a process group.

Two ranks share memory (and so may share an
:class:`~fcoll.shm.group.process_group.FcollProcessGroup`) exactly when they run on the same host:
the same kernel (hostname) and the same network namespace (the inode of ``/proc/self/ns/net``).
Emulated hosts (``fcoll.testing.hosts``) are network namespaces of one machine, so the namespace is
part of the identity; a test can also give every rank a host of its choosing with the environment
variable ``FCOLL_HOST_ID`` (no namespace needed).

A group's :class:`HostLayout` is computed the same way on every rank, from every rank's host id
exchanged through the group's store, so every rank builds the same sub-groups.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch.distributed as dist

__all__ = ["HOST_ID_ENV", "HostLayout", "exchange_host_ids", "host_id"]

#: Environment variable that overrides :func:`host_id` (any non-empty text).
HOST_ID_ENV = "FCOLL_HOST_ID"

_MAX_HOST_ID_BYTES = 512


def host_id() -> str:
    """This process's host identity: ``$FCOLL_HOST_ID`` when set, else
    ``"<hostname>/netns:<inode of /proc/self/ns/net>"``."""
    override = os.environ.get(HOST_ID_ENV, "")
    if override:
        return override
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "?"
    return f"{socket.gethostname()}/netns:{netns}"


def exchange_host_ids(store: dist.Store, rank: int, size: int,
                      timeout: datetime.timedelta) -> list[str]:
    """Every group rank's :func:`host_id`, in group-rank order, through ``store``.

    Args:
        store: a store private to this exchange (a ``PrefixStore`` of the group's store).
        rank, size: this rank and the group size.
        timeout: how long to wait for the other ranks' ids.

    Raises:
        RuntimeError: a rank published an empty or oversized id (more than 512 bytes), or a
            rank did not publish within ``timeout`` (the store's own error, re-raised with the
            ranks still missing).
    """
    mine = host_id().encode()
    if not mine or len(mine) > _MAX_HOST_ID_BYTES:
        raise RuntimeError(f"fcoll: rank {rank}: host id of {len(mine)} bytes (must be 1 to "
                           f"{_MAX_HOST_ID_BYTES}; check ${HOST_ID_ENV})")
    store.set(f"host/{rank}", mine)
    keys = [f"host/{r}" for r in range(size)]
    try:
        store.wait(keys, timeout)
    except Exception as e:
        missing = [r for r in range(size) if not store.check([f"host/{r}"])]
        raise RuntimeError(f"fcoll: rank {rank}: group ranks {missing} did not publish their "
                           f"host id within {timeout.total_seconds():.0f} s: {e}") from e
    ids = [store.get(k).decode(errors="replace") for k in keys]
    for r, text in enumerate(ids):
        if not text or len(text) > _MAX_HOST_ID_BYTES:
            raise RuntimeError(f"fcoll: rank {rank}: group rank {r} published a host id of "
                               f"{len(text)} bytes")
    return ids


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """Which group ranks share a host.

    Hosts are numbered in order of their lowest group rank; ``ranks_of[h]`` lists host ``h``'s
    group ranks in increasing order, and a rank's *local rank* is its index there.

    Attributes:
        ranks_of: group ranks of each host.
    """

    ranks_of: tuple[tuple[int, ...], ...]

    @classmethod
    def from_host_ids(cls, ids: list[str]) -> HostLayout:
        """Group ranks by equal host id (``ids[r]`` is group rank r's)."""
        order: dict[str, list[int]] = {}
        for r, h in enumerate(ids):
            order.setdefault(h, []).append(r)
        return cls(tuple(tuple(rs) for rs in order.values()))

    @property
    def num_hosts(self) -> int:
        return len(self.ranks_of)

    @property
    def even(self) -> bool:
        """True when every host holds the same number of ranks."""
        return len({len(rs) for rs in self.ranks_of}) == 1

    def host_of(self, rank: int) -> int:
        return next(h for h, rs in enumerate(self.ranks_of) if rank in rs)

    def local_rank_of(self, rank: int) -> int:
        return self.ranks_of[self.host_of(rank)].index(rank)

    def rank_at(self, host: int, local_rank: int) -> int:
        """The group rank that is local rank ``local_rank`` of host ``host``."""
        return self.ranks_of[host][local_rank]
