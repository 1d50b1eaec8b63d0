"""Parallel modules on PyTorch's DTensor whose collectives reach compiled graphs.

:func:`fully_shard` (SimpleFSDP). This layer imports torch only; fcoll's passes find its
collectives in the graphs like any other ``_c10d_functional`` op.
"""

from fcoll.parallel.fully_shard import fully_shard, is_fully_sharded

__all__ = ["fully_shard", "is_fully_sharded"]
