"""Group resolution: every group form a user may pass, to the group name the ops carry.

The ops take a string ``group_name`` (as ``torch.ops._c10d_functional`` does); the Python API takes
any of the forms ``torch.distributed._functional_collectives`` accepts:

- a ``ProcessGroup`` (its ``group_name``),
- a group name (``str``),
- a 1-D ``DeviceMesh``, or ``(DeviceMesh, dim)`` for one dimension of an N-D mesh,
- a list of global ranks (the group made by ``dist.new_group`` over those ranks; all ranks must
  call with the same list, as with ``new_group``).

Resolution of meshes and rank lists is delegated to PyTorch's own resolver, so fcoll accepts
exactly what PyTorch accepts and names groups the same way.
"""

from __future__ import annotations

from typing import Any, Union

import torch.distributed as dist
import torch.distributed._functional_collectives as _funcol
import torch.distributed.distributed_c10d as c10d

__all__ = ["GroupLike", "resolve_group_name", "group_from_name", "group_size", "group_rank"]

GroupLike = Union[str, "dist.ProcessGroup", Any, tuple, list]


def resolve_group_name(group: GroupLike, tag: str = "") -> str:
    """Return the group name of ``group`` (any form listed in the module docstring).

    Raises:
        ValueError: ``group`` is None or of a form that names no process group (a rank list
            before ``dist.init_process_group``, say).
    """
    if group is None:
        raise ValueError("group: expected a ProcessGroup, group name, DeviceMesh, "
                         "(DeviceMesh, dim) or list of ranks, got None")
    if isinstance(group, str):
        return group
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    try:
        resolved = _resolve(group, tag)
    except (ValueError, AssertionError, TypeError) as e:
        why = str(e) or type(e).__name__  # torch's bare ``assert`` on a rank list has no text
        if not dist.is_initialized():
            why = "no default process group: call dist.init_process_group first"
        raise ValueError(f"group: cannot resolve {group!r} to a process group: {why}") from e
    return resolved if isinstance(resolved, str) else resolved.group_name


# torch 2.13's funcol resolves a group form to a group or a name in ``_resolve_group``; its
# ``_resolve_group_name`` then wraps a name in ``c10d.GroupName(...)``, a NewType call Dynamo
# cannot trace (a rank list or DeviceMesh given to fcoll inside torch.compile graph-broke).
# torch 2.11 has ``_resolve_group_name`` alone, which returns the name as it is.
_resolve = getattr(_funcol, "_resolve_group", _funcol._resolve_group_name)


def group_from_name(group_name: "str | dist.ProcessGroup") -> "dist.ProcessGroup":
    """Return the ``ProcessGroup`` registered under ``group_name`` (a ``ProcessGroup`` is
    returned as it is: torch 2.13's ops take either, in an ``Any group_name`` argument, and
    so do fcoll's ``.group`` overloads there).

    Raises:
        ValueError: no process group of that name exists in this process.
    """
    if isinstance(group_name, dist.ProcessGroup):
        return group_name
    try:
        return c10d._resolve_process_group(group_name)
    except (ValueError, RuntimeError, KeyError) as e:
        raise ValueError(f"group_name: no process group named {group_name!r} on this rank "
                         f"(is the process group initialised?): {e}") from e


def group_size(group_name: str) -> int:
    """Number of ranks in the group named ``group_name``.

    Uses ``c10d._get_group_size_by_name``, which Dynamo folds to a constant at trace time (as it
    does for PyTorch's own functional collectives), so calling this never breaks a graph.
    """
    return c10d._get_group_size_by_name(group_name)


def group_rank(group_name: str) -> int:
    """This process's rank inside the group named ``group_name``."""
    return group_from_name(group_name).rank()
