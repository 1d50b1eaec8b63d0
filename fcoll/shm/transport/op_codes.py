"""The one table of the shared-memory backend's collective names and their codes.

Every collective a process group issues has a header name (``Header.op``: ``"all_reduce"``,
``"all_gather_into_tensor"``, ...). Where a name travels as a number, it is its code here:
a fence (the op byte of :data:`~fcoll.shm.transport.segment.W_GAVE_UP_WHY`, read back by
:meth:`~fcoll.shm.transport.fences.Fences.gave_up`) and the cross-host pre-flight of
:class:`~fcoll.shm.multihost.hierarchical.HierarchicalProcessGroup`, which compares the *kind*
of each op (a coalesced all_reduce and an all_reduce are one kind: their ranks agree to run
the same composition). Codes are ``index + 1`` in :data:`OPS`; 0 means "not listed".
"""

from __future__ import annotations

__all__ = ["OPS", "KIND_OF", "op_code", "op_of_code", "kind_code"]

#: header name -> its kind (itself a header name of :data:`OPS`), in code order.
KIND_OF = {
    "all_reduce": "all_reduce", "reduce": "reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "all_to_all_single": "all_to_all", "all_to_all": "all_to_all", "broadcast": "broadcast",
    "scatter": "scatter", "gather": "gather", "barrier": "barrier",
}

#: Every collective's header name, in code order.
OPS = tuple(KIND_OF)
_CODES = {name: i + 1 for i, name in enumerate(OPS)}


def op_code(name: str) -> int:
    """The code of header name ``name`` (1 ..), or 0 for a name not in :data:`OPS`."""
    return _CODES.get(name, 0)


def op_of_code(code: int) -> str | None:
    """The header name of ``code``, or None for 0 or a code out of range."""
    return OPS[code - 1] if 0 < code <= len(OPS) else None


def kind_code(name: str) -> int:
    """The code of ``name``'s kind (``"all_reduce_coalesced"`` -> ``"all_reduce"``'s).

    Raises:
        KeyError: ``name`` is not in :data:`OPS`.
    """
    return _CODES[KIND_OF[name]]
