"""``GroupIdentity``: the c10d identity surface both fcoll process groups share.

c10d reads a process group's rank, size, backend name and the name and description it assigns
(``setGroupName`` / ``setGroupDesc``, called once by ``new_group`` and
``init_process_group``). :class:`~fcoll.shm.group.process_group.FcollProcessGroup` (one host)
and :class:`~fcoll.shm.multihost.hierarchical.HierarchicalProcessGroup` (several hosts) answer
the same way: backend ``"fcoll"``, the rank and size they were made with. Each group's own
``__repr__`` says what else it holds.
"""

from __future__ import annotations

BACKEND_NAME = "fcoll"


class GroupIdentity:
    """Mixin: rank, size, backend name, group name and description of an fcoll group.

    The host class calls :meth:`_init_identity` in its ``__init__``; ``_global_ranks[r]`` is
    group rank r's global rank (for error messages).
    """

    def _init_identity(self, rank: int, size: int, global_ranks: list[int] | None) -> None:
        self._rank = rank
        self._size = size
        self._global_ranks = list(global_ranks) if global_ranks else list(range(size))
        self._group_name = ""
        self._group_desc = ""

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:  # noqa: N802  (PyTorch's name)
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc
