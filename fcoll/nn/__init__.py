"""``fcoll.nn``: autograd collectives (``fcoll.nn.functional``), as ``torch.distributed.nn``."""

from fcoll.nn import functional  # noqa: F401

__all__ = ["functional"]
