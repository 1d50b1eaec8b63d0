"""The one table of the shared-memory backend's collective names and dtypes as codes.

Every collective a process group issues has a header name (``Header.op``: ``"all_reduce"``,
``"all_gather_into_tensor"``, ...). Where a name travels as a number, it is its code here:
a fence (the op byte of :data:`~fcoll.shm.transport.segment.W_GAVE_UP_WHY`, read back by
:meth:`~fcoll.shm.transport.fences.Fences.gave_up`) and the cross-host pre-flight of
:class:`~fcoll.shm.multihost.hierarchical.HierarchicalProcessGroup`, which compares the *kind*
of each op (a coalesced all_reduce and an all_reduce are one kind: their ranks agree to run
the same composition). Codes are ``index + 1`` in :data:`OPS`; 0 means "not listed".

A dtype travels as :func:`dtype_code` (the cross-host pre-flight, the sparse all_reduce's
header) and reads back with :func:`dtype_of_code` for messages.
"""

from __future__ import annotations

import zlib

import torch

__all__ = ["OPS", "KIND_OF", "op_code", "op_of_code", "kind_code", "CODED_DTYPES",
           "dtype_code", "dtype_of_code"]

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


CODED_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                torch.complex128]


def dtype_code(dtype: torch.dtype) -> int:
    """A number naming ``dtype``, the same in every process (crc32: ``hash`` of a str is
    salted per process)."""
    if dtype in CODED_DTYPES:
        return CODED_DTYPES.index(dtype)
    return 100 + zlib.crc32(str(dtype).encode())


_DTYPE_OF_CODE = {dtype_code(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def dtype_of_code(code: int) -> torch.dtype | None:
    """The dtype :func:`dtype_code` gave ``code``, or None for a code no torch dtype has."""
    return _DTYPE_OF_CODE.get(code)
