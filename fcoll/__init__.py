"""fcoll: functional collectives for torch.compile graphs.

``import fcoll as funcol`` is a drop-in for ``torch.distributed._functional_collectives``; importing
fcoll also registers the ``"fcoll"`` shared-memory process-group backend, and imports
``fcoll.inspect``, which subscribes to the compile backend (tlparse artifacts under
``TORCH_TRACE``). The ``torch.compile`` entry point imports ``fcoll.compile.backend``, so all of
this happens without an ``import fcoll`` too.
"""

# torch first: with TORCH_LOGS naming fcoll ("+fcoll"), ``import torch`` walks fcoll's packages
# (torch._logging imports each one to register its loggers); done from inside fcoll's first
# submodule import, that walk met half-imported fcoll modules and left fcoll.passes broken
# ("cannot import name 'CheckRankConsistency' ... circular import").
import torch  # noqa: F401

from fcoll.ops import *  # noqa: F401,F403,E402  the funcol API (fcoll.ops.API)
from fcoll.ops import API as _API

__all__ = list(_API)

# funcol's private (tag, ranks, group_size) expansion of a group, which code written against
# funcol's legacy API (and PyTorch's own funcol tests) calls through the module: PyTorch's own
# function, since the expansion is c10d's (tags, the rank registry), not fcoll's.
from torch.distributed._functional_collectives import _expand_group  # noqa: E402,F401

from fcoll.shm import register_backend as _register_shm_backend
_register_shm_backend()

import fcoll.inspect  # noqa: E402,F401  subscribes fcoll.inspect to the compile backend's listeners

# the opt-in that aborts groups when an exception leaves a step (docs/design.md, "Failure model")
from fcoll.shm.group.abort import fence_on_error  # noqa: E402

__all__.append("fence_on_error")
