"""Collective headers: what every rank says it is doing, exchanged in the first phase of every
collective and checked on every rank before any output is written.

A header is a :class:`Header` record, ``marshal``-encoded as a plain tuple (no code execution on
load, unlike pickle)::

    (seq, op, dtype, shape, reduce_op, root, extra, error)

``error`` is a message when the rank found its own arguments invalid; every rank then raises it.
All ranks see the same headers and run the same checks, so they raise the same message: a
mismatch never hangs and never returns wrong data (gloo aborts or silently mixes in these cases,
see NOTES.md).
"""

from __future__ import annotations

import hashlib
import marshal
import struct
from typing import Any, NamedTuple

import torch

from fcoll.shm.segment import HEADER_BYTES

LEN_BYTES = 4  # the u32 length stored before every encoded header
MAX_PAYLOAD_BYTES = HEADER_BYTES - LEN_BYTES
NO_ROOT = -1  # ``root`` of a collective that has none
NO_SEQ = -1  # ``seq`` of a later part of a collective whose first header carried the number
ALL_TO_ALL = "all_to_all_single"  # the one op whose shapes and ``extra`` may differ by rank
DIGEST_BYTES = 16
MAX_ERROR_CHARS = HEADER_BYTES // 4  # an error message too long for the header is cut to this
_ALL_TO_ALL_BYTES = ALL_TO_ALL.encode()


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with arguments that disagree, or one rank's were invalid."""


class Header(NamedTuple):
    """One rank's description of one collective.

    Attributes:
        seq: the collective's number in the group (issue order), or ``NO_SEQ``.
        op: the collective's name (``"all_reduce"``).
        dtype: the dtype's name without ``torch.`` (``"float32"``), or ``""``.
        shape: the input's shape, or ``()``.
        reduce_op: the reduce op's name (``"sum"``), or ``""``.
        root: the source or destination group rank, or ``NO_ROOT``.
        extra: what else must agree: all_to_all's ``(input_split_sizes, output_split_sizes)``
            lists (in rows), a coalesced call's per-tensor ``(dtype, shape)`` signature, or
            ``("digest", hex)`` for a signature too long for the header.
        error: why this rank's arguments are invalid, or None.
    """

    seq: int
    op: str
    dtype: str = ""
    shape: tuple = ()
    reduce_op: str = ""
    root: int = NO_ROOT
    extra: Any = None
    error: str | None = None

    def tail(self) -> tuple:
        """Every field but ``seq``, as a plain tuple: a fast path that reuses one header keeps
        this and encodes ``marshal.dumps((seq,) + tail)`` per call, the bytes :meth:`encode`
        gives for a header that fits."""
        return tuple(self)[1:]

    def encode(self) -> bytes:
        """The bytes of this header, at most ``MAX_PAYLOAD_BYTES``.

        A per-tensor signature too long for the header (a coalesced call of hundreds of tensors,
        a long split list) is replaced by a 16-byte digest of ``(shape, extra)``, which ranks
        still compare exactly; all_to_all's split lists are never digested (every rank reads
        its peers' lists). Only a huge error message is then cut short.
        """
        if type(self.shape) is not tuple:  # torch.Size does not marshal
            self = self._replace(shape=tuple(self.shape))
        payload = marshal.dumps(tuple(self))
        if len(payload) > MAX_PAYLOAD_BYTES and self.error is None and self.op != ALL_TO_ALL:
            digest = hashlib.blake2b(marshal.dumps((tuple(self.shape), self.extra)),
                                     digest_size=DIGEST_BYTES).hexdigest()
            payload = marshal.dumps(tuple(self._replace(shape=(), extra=("digest", digest))))
        if len(payload) > MAX_PAYLOAD_BYTES:
            error = (self.error or "header too large")[:MAX_ERROR_CHARS]
            payload = marshal.dumps(tuple(self._replace(shape=(), extra=None, error=error)))
        return payload

    @classmethod
    def decode(cls, payload: bytes) -> "Header":
        return cls._make(marshal.loads(payload))


_DTYPE_NAMES: dict = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``, cached: a coalesced header lists hundreds."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def write(buf: memoryview, offset: int, payload: bytes, words: memoryview | None = None) -> None:
    """Store ``payload`` and its length at ``offset`` (4-byte aligned); ``words`` is ``buf``
    as u32, when the caller has it (one aligned store instead of packing the length)."""
    n = len(payload)
    buf[offset + LEN_BYTES:offset + LEN_BYTES + n] = payload
    if words is not None:
        words[offset >> 2] = n
    else:
        buf[offset:offset + LEN_BYTES] = struct.pack("<I", n)


def equals(buf: memoryview, words: memoryview, offset: int, payload: bytes) -> bool:
    """Whether the header at ``offset`` (4-byte aligned; ``words`` is ``buf`` as u32) is
    ``payload``, without copying it out."""
    n = len(payload)
    return words[offset >> 2] == n and buf[offset + LEN_BYTES:offset + LEN_BYTES + n] == payload


def read(buf: memoryview, offset: int) -> bytes:
    (n,) = struct.unpack_from("<I", buf, offset)
    return bytes(buf[offset + LEN_BYTES:offset + LEN_BYTES + min(n, MAX_PAYLOAD_BYTES)])


def _fmt(h: Header) -> str:
    return f"{list(h.shape)} {h.dtype}"


def check(headers: list[bytes], name: str, describe, own: bytes | None = None) -> list[Header]:
    """Check the headers of every rank; return them decoded.

    Args:
        headers: encoded header of every group rank.
        name: the collective's name for messages (``"all_reduce"``).
        describe: group rank -> ``"rank 1"`` / ``"rank 1 (global rank 3)"``.
        own: this rank's header, known to be valid: when every header equals it (the common
            case) nothing is decoded and ``[]`` is returned, unless the op is all_to_all.

    Raises:
        CollectiveMismatchError: a rank flagged its input invalid, or ranks disagree on the
            sequence number, op, dtype, shape, reduce op or root.
    """
    h0b = headers[0]
    if all(h == h0b for h in headers):
        if (own is not None and h0b == own and own[-1:] == b"N"  # error field is None
                and _ALL_TO_ALL_BYTES not in own):
            return []
        h0 = Header.decode(h0b)
        if h0.error is not None:
            raise CollectiveMismatchError(h0.error)
        if h0.op != ALL_TO_ALL:
            return [h0] * len(headers)
    dec = [Header.decode(h) for h in headers]
    for h in dec:
        if h.error is not None:
            raise CollectiveMismatchError(h.error)
    h0 = dec[0]
    for p, h in enumerate(dec[1:], start=1):
        if (h.seq, h.op) != (h0.seq, h0.op):
            raise CollectiveMismatchError(
                f"fcoll {h0.op}: {describe(p)} called {h.op} (collective #{h.seq} of the group) "
                f"but {describe(0)} called {h0.op} (collective #{h0.seq})")
    for p, h in enumerate(dec[1:], start=1):
        _check_pair(h0, h, p, name, describe)
    if h0.op == ALL_TO_ALL:
        _check_splits(dec, name, describe)
    return dec


def _check_pair(h0: Header, h: Header, p: int, name: str, describe) -> None:
    """Raise unless rank ``p``'s header ``h`` agrees with rank 0's ``h0`` (same seq and op)."""
    a2a = h0.op == ALL_TO_ALL
    if h.dtype != h0.dtype or (h.shape != h0.shape and not a2a):
        raise CollectiveMismatchError(
            f"fcoll {name}: {describe(p)} has input shape {_fmt(h)} but {describe(0)} has "
            f"{_fmt(h0)}")
    if a2a and h.shape[1:] != h0.shape[1:]:
        raise CollectiveMismatchError(
            f"fcoll {name}: {describe(p)} has input shape {_fmt(h)} but {describe(0)} has "
            f"{_fmt(h0)} (all dimensions but the first must match)")
    if h.reduce_op != h0.reduce_op:
        raise CollectiveMismatchError(
            f"fcoll {name}: {describe(p)} uses reduce op {h.reduce_op} but {describe(0)} uses "
            f"{h0.reduce_op}")
    if h.root != h0.root:
        raise CollectiveMismatchError(
            f"fcoll {name}: {describe(p)} uses root {h.root} but {describe(0)} uses {h0.root}")
    if not a2a and h.extra != h0.extra:
        if "digest" in (h.extra or ())[:1] or "digest" in (h0.extra or ())[:1]:
            raise CollectiveMismatchError(
                f"fcoll {name}: {describe(p)} and {describe(0)} passed different tensors "
                f"(their dtypes and shapes, too many to list, differ)")
        raise CollectiveMismatchError(
            f"fcoll {name}: {describe(p)} passed {h.extra} but {describe(0)} passed {h0.extra}")


def _check_splits(dec: list[Header], name: str, describe) -> None:
    """all_to_all: the rows each rank sends to each other equal the rows that one expects."""
    for src, h in enumerate(dec):
        for dst, hd in enumerate(dec):
            sent, expected = h.extra[0][dst], hd.extra[1][src]
            if sent != expected:
                raise CollectiveMismatchError(
                    f"fcoll {name}: {describe(dst)} expects {expected} rows from "
                    f"{describe(src)} (output_split_sizes) but {describe(src)} sends "
                    f"{sent} (input_split_sizes)")
