"""Collective headers: what every rank says it is doing, exchanged in the first phase of every
collective and checked on every rank before any output is written.

A header is ``marshal``-encoded (no code execution on load, unlike pickle) and holds::

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

from fcoll.shm.segment import HEADER_BYTES


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with arguments that disagree, or one rank's were invalid."""


def encode(seq: int, op: str, dtype: str, shape: tuple, reduce_op: str, root: int,
           extra=None, error: str | None = None) -> bytes:
    payload = marshal.dumps((seq, op, dtype, tuple(shape), reduce_op, root, extra, error))
    if len(payload) > HEADER_BYTES - 4 and error is None and op != "all_to_all_single":
        # A long per-tensor signature (a coalesced call of hundreds of tensors, a long split
        # list): ranks still compare it exactly, through a digest of shape and extra.
        digest = hashlib.blake2b(marshal.dumps((tuple(shape), extra)), digest_size=16).hexdigest()
        payload = marshal.dumps((seq, op, dtype, (), reduce_op, root, ("digest", digest), None))
    if len(payload) > HEADER_BYTES - 4:  # only a huge error message gets here
        error = (error or "header too large")[:HEADER_BYTES // 4]
        payload = marshal.dumps((seq, op, dtype, (), reduce_op, root, None, error))
    return payload


def write(buf: memoryview, offset: int, payload: bytes, words: memoryview | None = None) -> None:
    """Store ``payload`` and its length at ``offset`` (4-byte aligned); ``words`` is ``buf``
    as u32, when the caller has it (one aligned store instead of packing the length)."""
    n = len(payload)
    buf[offset + 4:offset + 4 + n] = payload
    if words is not None:
        words[offset >> 2] = n
    else:
        buf[offset:offset + 4] = struct.pack("<I", n)


def equals(buf: memoryview, words: memoryview, offset: int, payload: bytes) -> bool:
    """Whether the header at ``offset`` (4-byte aligned; ``words`` is ``buf`` as u32) is
    ``payload``, without copying it out."""
    n = len(payload)
    return words[offset >> 2] == n and buf[offset + 4:offset + 4 + n] == payload


def read(buf: memoryview, offset: int) -> bytes:
    (n,) = struct.unpack_from("<I", buf, offset)
    return bytes(buf[offset + 4:offset + 4 + min(n, HEADER_BYTES - 4)])


def _fmt(h) -> str:
    return f"{list(h[3])} {h[2]}"


def check(headers: list[bytes], name: str, describe, own: bytes | None = None) -> list[tuple]:
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
                and b"all_to_all_single" not in own):
            return []
        h0 = marshal.loads(h0b)
        if h0[7] is not None:
            raise CollectiveMismatchError(h0[7])
        if h0[1] != "all_to_all_single":
            return [h0] * len(headers)
    dec = [marshal.loads(h) for h in headers]
    for h in dec:
        if h[7] is not None:
            raise CollectiveMismatchError(h[7])
    h0 = dec[0]
    for p, h in enumerate(dec[1:], start=1):
        if (h[0], h[1]) != (h0[0], h0[1]):
            raise CollectiveMismatchError(
                f"fcoll {h0[1]}: {describe(p)} called {h[1]} (collective #{h[0]} of the group) "
                f"but {describe(0)} called {h0[1]} (collective #{h0[0]})")
    for p, h in enumerate(dec[1:], start=1):
        if h[2] != h0[2] or (h[3] != h0[3] and h0[1] != "all_to_all_single"):
            raise CollectiveMismatchError(
                f"fcoll {name}: {describe(p)} has input shape {_fmt(h)} but {describe(0)} has "
                f"{_fmt(h0)}")
        if h0[1] == "all_to_all_single" and h[3][1:] != h0[3][1:]:
            raise CollectiveMismatchError(
                f"fcoll {name}: {describe(p)} has input shape {_fmt(h)} but {describe(0)} has "
                f"{_fmt(h0)} (all dimensions but the first must match)")
        if h[4] != h0[4]:
            raise CollectiveMismatchError(
                f"fcoll {name}: {describe(p)} uses reduce op {h[4]} but {describe(0)} uses {h0[4]}")
        if h[5] != h0[5]:
            raise CollectiveMismatchError(
                f"fcoll {name}: {describe(p)} uses root {h[5]} but {describe(0)} uses {h0[5]}")
        if h0[1] != "all_to_all_single" and h[6] != h0[6]:
            if "digest" in (h[6] or ())[:1] or "digest" in (h0[6] or ())[:1]:
                raise CollectiveMismatchError(
                    f"fcoll {name}: {describe(p)} and {describe(0)} passed different tensors "
                    f"(their dtypes and shapes, too many to list, differ)")
            raise CollectiveMismatchError(
                f"fcoll {name}: {describe(p)} passed {h[6]} but {describe(0)} passed {h0[6]}")
    if h0[1] == "all_to_all_single":
        # extra = (input_split_sizes, output_split_sizes), in rows
        for src, h in enumerate(dec):
            for dst, hd in enumerate(dec):
                sent, expected = h[6][0][dst], hd[6][1][src]
                if sent != expected:
                    raise CollectiveMismatchError(
                        f"fcoll {name}: {describe(dst)} expects {expected} rows from "
                        f"{describe(src)} (output_split_sizes) but {describe(src)} sends "
                        f"{sent} (input_split_sizes)")
    return dec
