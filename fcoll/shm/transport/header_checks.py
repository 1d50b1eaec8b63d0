"""The cross-rank check of collective headers: every rank checks every rank's header (its own
included) before any output is written, and all raise the same message.

A rank that found its own arguments invalid sent its message in its header's ``error``: every
rank raises it. Otherwise ranks must agree on the sequence number and op (a rank that skipped or
reordered a collective), dtype and shape (all_to_all: all dimensions but the first), reduce op,
root and ``extra`` (a coalesced call's tensors, the direct path's call-site tag); all_to_all's
split sizes must say the same rows on both ends. Messages name both ranks and are bounded in
length whatever a peer wrote (:mod:`fcoll.shm.transport.headers`).
"""

from __future__ import annotations

from typing import Any

from fcoll.shm.transport.headers import (ALL_TO_ALL, F_ALL_TO_ALL, F_ERROR, FLAGS_OFF,
                                         MAX_FIELD_CHARS, CollectiveMismatchError, Header,
                                         MalformedHeaderError, quote_peer)

__all__ = ["check"]


def _clip(v: Any) -> str:
    s = str(v)
    return s if len(s) <= MAX_FIELD_CHARS else s[:MAX_FIELD_CHARS - 3] + "..."


def _fmt(h: Header) -> str:
    return f"{_clip(list(h.shape))} {h.dtype}"


def _decode_from(p: int, payload: bytes, name: str, describe) -> Header:
    try:
        return Header.decode(payload)
    except MalformedHeaderError as e:
        raise MalformedHeaderError(
            f"fcoll {name}: the header of {describe(p)} is malformed ({e}); something other "
            "than fcoll wrote to the group's shared memory") from None


def check(headers: list[bytes], name: str, describe, own: bytes | None = None) -> list[Header]:
    """Check the headers of every rank; return them decoded.

    Args:
        headers: encoded header of every group rank (each at most ``MAX_PAYLOAD_BYTES``, as
            :func:`read` returns them).
        name: the collective's name for messages (``"all_reduce"``).
        describe: group rank -> ``"rank 1"`` / ``"rank 1 (global rank 3)"``.
        own: this rank's header, known to be valid: when every header equals it (the common
            case) nothing is decoded and ``[]`` is returned, unless the op is all_to_all.

    Raises:
        CollectiveMismatchError: a rank flagged its input invalid, or ranks disagree on the
            sequence number, op, dtype, shape, reduce op or root.
        MalformedHeaderError: a header is not well formed (or, for all_to_all, its split lists
            are not two lists of group-size non-negative ints).
    """
    h0b = headers[0]
    if all(h == h0b for h in headers):
        if (own is not None and h0b == own and len(own) > FLAGS_OFF
                and not own[FLAGS_OFF] & (F_ERROR | F_ALL_TO_ALL)):
            return []
        h0 = _decode_from(0, h0b, name, describe)
        if h0.error is not None:
            _raise_error(headers, [h0] * len(headers), name, describe, own)
        if h0.op != ALL_TO_ALL:
            return [h0] * len(headers)
        dec = [h0] * len(headers)  # equal bytes, equal headers
    else:
        dec = [_decode_from(p, h, name, describe) for p, h in enumerate(headers)]
        if any(h.error is not None for h in dec):
            _raise_error(headers, dec, name, describe, own)
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


def _raise_error(headers: list[bytes], dec: list[Header], name: str, describe,
                 own: bytes | None) -> None:
    """Raise the error of a rank that flagged its arguments invalid: this rank's own message
    as it is if it has one, else the first flagging peer's, quoted as that peer's (its bytes
    are the peer's to choose: ``fcoll all_reduce: rank 1 reported: "rank 1: ..."``)."""
    for p, h in enumerate(dec):
        if h.error is not None and own is not None and headers[p] == own:
            raise CollectiveMismatchError(h.error)
    for p, h in enumerate(dec):
        if h.error is not None:
            text = h.error
            prefix = f"fcoll {name}: "
            if text.startswith(prefix):
                text = text[len(prefix):]
            raise CollectiveMismatchError(f"fcoll {name}: {quote_peer(describe(p), text)}")


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
        if _is_digest(h.extra) or _is_digest(h0.extra):
            raise CollectiveMismatchError(
                f"fcoll {name}: {describe(p)} and {describe(0)} passed different tensors "
                f"(their dtypes and shapes, too many to list, differ)")
        raise CollectiveMismatchError(
            f"fcoll {name}: {describe(p)} passed {_clip(h.extra)} but {describe(0)} passed "
            f"{_clip(h0.extra)}")


def _is_digest(extra: Any) -> bool:
    return isinstance(extra, tuple) and len(extra) == 2 and extra[0] == "digest"


def _is_splits(s: Any, n: int) -> bool:
    """Whether ``s`` is a list of ``n`` non-negative ints. A decoded value holds no floats (the
    format has no tag for them), so a ``min`` that is neither an int nor a bool raises."""
    try:
        return type(s) is list and len(s) == n and (n == 0 or min(s) >= 0)
    except TypeError:
        return False


def _check_splits(dec: list[Header], name: str, describe) -> None:
    """all_to_all: the rows each rank sends to each other equal the rows that one expects."""
    n = len(dec)
    for p, h in enumerate(dec):
        e = h.extra
        if not (type(e) is tuple and len(e) == 2 and _is_splits(e[0], n)
                and _is_splits(e[1], n)):
            raise MalformedHeaderError(
                f"fcoll {name}: the header of {describe(p)} is malformed (its split sizes "
                f"{_clip(e)} are not two lists of {n} non-negative ints)")
    for src, h in enumerate(dec):
        for dst, hd in enumerate(dec):
            sent, expected = h.extra[0][dst], hd.extra[1][src]
            if sent != expected:
                raise CollectiveMismatchError(
                    f"fcoll {name}: {describe(dst)} expects {expected} rows from "
                    f"{describe(src)} (output_split_sizes) but {describe(src)} sends "
                    f"{sent} (input_split_sizes)")
