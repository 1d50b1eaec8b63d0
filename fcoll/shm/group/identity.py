"""``GroupIdentity``: the c10d identity surface both fcoll process groups share.

c10d reads a process group's rank, size, backend name and the name and description it assigns
(``setGroupName`` / ``setGroupDesc``, called once by ``new_group`` and
``init_process_group``), and asks it for the device types it serves (``_device_types``), its
backend on a device (``_get_backend``) and that backend's capabilities.
:class:`~fcoll.shm.group.process_group.FcollProcessGroup` (one host) and
:class:`~fcoll.shm.multihost.hierarchical.HierarchicalProcessGroup` (several hosts) answer the
same way: backend ``"fcoll"``, the rank and size they were made with, the group itself as its
backend on CPU and CUDA. Each group's own ``__repr__`` says what else it holds.
"""

from __future__ import annotations

import torch

BACKEND_NAME = "fcoll"

#: the device types whose tensors an fcoll group's collectives take (CUDA ones through IPC or
#: staging, ``docs/cuda.md``)
DEVICE_TYPES = ("cpu", "cuda")


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

    # c10d's Python code asks a group for the C++ ``Backend`` that serves a device and reads that
    # backend's capability flags: ``init_process_group(device_id=...)`` reads
    # ``supports_splitting`` to connect a communicator eagerly, ``new_group`` and DeviceMesh to
    # split one, Inductor's cost model ``supports_time_estimate``, FSDP2's
    # ``set_allocate_memory_from_process_group_for_comm`` ``supports_tensor_alloc`` (which
    # raised "No backend type associated with device type cpu" on fcoll's group). An fcoll group is
    # its own backend and has none of these: no communicator to connect or split (``new_group``
    # builds a new group), no time estimator, no allocator.
    supports_splitting = False
    supports_time_estimate = False

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        """False: buffers for this group's collectives come from ``torch.empty``."""
        return False

    @property
    def _device_types(self) -> list[torch.device]:
        """The device types whose tensors this group's collectives take: CPU, and CUDA where
        a CUDA device is present.

        c10d reads it to pick a device for a group's buffers. For a Python group pybind's own
        answer is empty, and ``set_model_state_dict(..., StateDictOptions(full_state_dict=True,
        broadcast_from_rank0=True))`` (``torch.distributed._state_dict_utils._broadcast_tensors``,
        loading a full checkpoint from rank 0 into an FSDP2 model) raised IndexError on it.
        """
        return [torch.device(kind) for kind in DEVICE_TYPES
                if kind == "cpu" or torch.cuda.is_available()]

    def _get_backend(self, device: torch.device | str) -> "GroupIdentity":
        """The backend that runs this group's collectives on ``device``: the group itself, for
        the device types of :data:`DEVICE_TYPES` (any index).

        Without it, c10d's ``pg._get_backend(device)`` finds no C++ backend registered on a
        Python group, and ``init_process_group("fcoll", device_id=torch.device("cuda", r))``
        raised ``RuntimeError: No backend type associated with device type cuda``.

        Raises:
            RuntimeError: ``device`` is of another type (c10d's own error for a device type
                without a backend, naming the device and the group's backend).
        """
        kind = torch.device(device).type
        if kind not in DEVICE_TYPES:
            raise RuntimeError(f"No backend type associated with device type {kind}: the "
                               f"{BACKEND_NAME} process group runs collectives on "
                               f"{' and '.join(DEVICE_TYPES)} tensors")
        return self
