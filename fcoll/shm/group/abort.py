"""``fcoll.fence_on_error``: abort process groups when an exception leaves a block.

A rank that raises between two compiled graphs (a Python ``raise`` after a graph break), or in
eager code while its peers wait in a collective it will not issue, strands them until the group
timeout: nothing on the raising rank tells "never will" from "not yet", and torch 2.13 gives a
compile backend no hook on the compiled frame (docs/design.md, "Failure model"). The block is
the user's statement that an exception leaving it ends the group: ``__exit__`` calls c10d's
``ProcessGroup.abort`` on each group, the call PyTorch offers for "this rank gives up the group"
(NCCL aborts its communicators; fcoll's group fences the collective its peers wait in, so they
raise at once naming this rank and the exception, see
:meth:`~fcoll.shm.group.process_group.FcollProcessGroup.abort`). Calling ``group.abort()`` (or
``torch.distributed.distributed_c10d._abort_process_group(group)``) in one's own ``except``
block does the same.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch.distributed as dist

from fcoll.shm.transport.headers import CollectiveMismatchError

__all__ = ["fence_on_error"]

log = logging.getLogger(__name__)


class fence_on_error(contextlib.ContextDecorator):  # noqa: N801  (contextlib's style)
    """Context manager and decorator: an exception leaving the block (or the decorated
    function) aborts ``groups`` on this rank before it propagates.

    Usage::

        for batch in loader:
            try:
                with fcoll.fence_on_error(group):
                    loss = compiled_step(batch)
            except ValueError:
                ...  # the group is aborted here and fenced on every rank: create it again

    Args:
        *groups: the process groups to abort (``dist.ProcessGroup``); none: the default group.

    On an exception, each group's ``abort()`` is called inside ``__exit__``, while the
    exception is being handled, so fcoll's groups write its type and first line in their fence
    and the peers raise ``PeerError`` within a wake-up naming this rank, "aborted its process
    group" and the exception (a group is then unusable on every rank until created again).
    Not aborted for:

    - no exception (the block's cost is a ``with``: no per-collective work);
    - :class:`~fcoll.shm.transport.headers.CollectiveMismatchError` (a ``ValueError`` of
      mismatched or invalid arguments), which every rank raises alike at the same collective,
      the group staying usable.

    Other backends get their own ``abort()``: NCCL aborts its communicators; gloo's does
    nothing (its peers still wait for the group timeout). An ``abort()`` that raises is logged
    and the block's exception propagates unchanged. Nothing is caught: the exception always
    propagates.
    """

    def __init__(self, *groups: Any) -> None:
        self.groups = groups

    def __enter__(self) -> "fence_on_error":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or isinstance(exc, CollectiveMismatchError):
            return False
        groups = self.groups or (dist.distributed_c10d._get_default_group(),)
        for group in groups:
            try:
                group.abort()  # sys.exc_info() is ``exc`` here: fcoll's abort quotes it
            except Exception:  # noqa: BLE001  the block's exception is the one to propagate
                log.warning("fcoll.fence_on_error: aborting %r failed", group, exc_info=True)
        return False
