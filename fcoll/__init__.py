"""fcoll: functional collectives for torch.compile graphs.

``import fcoll as funcol`` is a drop-in for ``torch.distributed._functional_collectives``; importing
fcoll also registers the ``"fcoll"`` shared-memory process-group backend, and imports
``fcoll.inspect``, which subscribes to the compile backend (tlparse artifacts under
``TORCH_TRACE``). The ``torch.compile`` entry point imports ``fcoll.compile.backend``, so all of
this happens without an ``import fcoll`` too.
"""

from fcoll.ops import (  # noqa: E402
    AsyncCollectiveTensor,
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

__all__ = [
    "AsyncCollectiveTensor", "all_gather_into_tensor_coalesced", "all_gather_tensor",
    "all_gather_tensor_autograd", "all_reduce", "all_reduce_coalesced", "all_to_all_single",
    "all_to_all_single_autograd", "broadcast", "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd", "reduce_scatter_tensor_coalesced", "wait_tensor",
]

from fcoll.shm import register_backend as _register_shm_backend
_register_shm_backend()

import fcoll.inspect  # noqa: E402,F401  subscribes fcoll.inspect to the compile backend's listeners
