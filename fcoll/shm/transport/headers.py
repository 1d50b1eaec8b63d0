"""Collective headers: what every rank says it is doing, exchanged in the first phase of every
collective and checked on every rank before any output is written.

A header is a :class:`Header` record ``(seq, op, dtype, shape, reduce_op, root, extra, error)``.
``error`` is a message when the rank found its own arguments invalid; every rank then raises it.
All ranks see the same headers and run the same checks, so they raise the same message: a
mismatch never hangs and never returns wrong data (gloo aborts or silently mixes in these cases,
see NOTES.md).

Wire format (little-endian). A peer's header is untrusted bytes: the decoder reads every length
and count, checks it against its stated maximum and against the bytes left, and only then reads
what it covers, so a header costs the reader O(its bytes) time and memory (at most
``MAX_PAYLOAD_BYTES``) whatever a peer, or a process scribbling on the segment, wrote::

    offset  bytes  field
    0       1      MAGIC (0x73)
    1       4      u32: the bytes that follow (must be exactly the rest of the payload)
    5       8      seq, i64
    13      1      flags: F_ERROR (an error message follows), F_ALL_TO_ALL (ranks' headers
                   legitimately differ, so they are always decoded)
    14      8      root, i64
    22      1+n    op, dtype, reduce_op: each a u8 length (at most MAX_NAME_BYTES) and UTF-8
            1+8d   shape: u8 ndim (at most MAX_DIMS), then i64 per dimension
            ...    extra: one tagged value (below), nested at most MAX_EXTRA_DEPTH deep
            2+n    error, only with F_ERROR: u16 length (at most MAX_ERROR_BYTES), UTF-8

    extra tags: b"N" None; b"T" / b"F" bool; b"i" i32; b"q" i64; b"s" u8 length + UTF-8;
                b"(" tuple / b"[" list: u16 count, then the items (each at least one byte, so
                a count is bounded by the bytes left); b"a" / b"A" a tuple / list of ints,
                all in i32 range: u16 count, then i32 each (shapes: one unpack); b"S" a
                tuple of two such lists of one length (all_to_all's split sizes): u16 length,
                then i32 each

Messages built from a peer's fields are bounded: names by ``MAX_NAME_BYTES``, a shape or an
``extra`` by ``MAX_FIELD_CHARS`` in a message, an error by ``MAX_ERROR_CHARS``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from typing import Any, Callable, NamedTuple

import torch

from fcoll.shm.transport.segment import HEADER_BYTES

LEN_BYTES = 4  # the u32 length the segment stores before every encoded header
MAX_PAYLOAD_BYTES = HEADER_BYTES - LEN_BYTES
NO_ROOT = -1  # ``root`` of a collective that has none
NO_SEQ = -1  # ``seq`` of a later part of a collective whose first header carried the number
ALL_TO_ALL = "all_to_all_single"  # the one op whose shapes and ``extra`` may differ by rank
DIGEST_BYTES = 16
MAX_ERROR_CHARS = 512  # an error message longer than this is cut to it
MAX_ERROR_BYTES = 4 * MAX_ERROR_CHARS  # its UTF-8 encoding
MAX_NAME_BYTES = 64  # op, dtype, reduce op and strings inside ``extra``
MAX_DIMS = 64
MAX_EXTRA_DEPTH = 4  # a coalesced signature (tuple of (dtype, shape)) is 3 deep
MAX_FIELD_CHARS = 160  # a peer's shape or extra as shown in a message

MAGIC = 0x73
F_ERROR = 1
F_ALL_TO_ALL = 2
_PREFIX = struct.Struct("<BI")
_SEQ = struct.Struct("<q")
_FIXED = struct.Struct("<Bq")  # flags, root
_U16 = struct.Struct("<H")
_I32 = struct.Struct("<i")
_I64 = struct.Struct("<q")
FLAGS_OFF = _PREFIX.size + _SEQ.size
_REST_OFF = FLAGS_OFF + _FIXED.size
MAX_REST_BYTES = MAX_PAYLOAD_BYTES - FLAGS_OFF  # what may follow seq
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_MAX_COUNT = 0xFFFF
_HEAD = struct.Struct("<BIqBq")  # _PREFIX, _SEQ, _FIXED: every fixed field in one unpack
_DIMS = [struct.Struct(f"<{d}q") for d in range(MAX_DIMS + 1)]
_new_header = tuple.__new__  # Header(*fields) without NamedTuple.__new__'s argument parsing
MAX_CACHED_RESTS = 1024  # encoded (op, dtype, shape, reduce_op, root) kept before starting over
_RESTS: dict = {}  # header fields after seq (no extra, no error) -> their bytes
_DECODED: dict = {}  # bytes after seq of a well-formed header -> its fields after seq


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with arguments that disagree, or one rank's were invalid."""


class MalformedHeaderError(CollectiveMismatchError):
    """A peer's header bytes are not a header (the shared memory was written by something else);
    raised before any output is written, like any other mismatch."""


class _Unencodable(Exception):
    """Our own header does not fit the format (too long, too deep, a type it has no tag for)."""


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
            ``("digest", hex)`` for a signature too long for the header. None, bools, ints,
            strings, tuples and lists only (see the module doc).
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

    def tail(self) -> Tail:
        """Every field but ``seq``, encoded once: a fast path that reuses one header keeps this
        and encodes each call with :meth:`Tail.encode` (``seq``), the bytes :meth:`encode`
        gives."""
        return Tail(tuple(self)[1:], _rest_of(self))

    def encode(self) -> bytes:
        """The bytes of this header, at most ``MAX_PAYLOAD_BYTES``; never raises.

        A per-tensor signature too long for the header (a coalesced call of hundreds of tensors,
        a long split list) is replaced by a 16-byte digest of ``(shape, extra)``, which ranks
        still compare exactly; all_to_all's split lists are never digested (every rank reads
        its peers' lists). An error message is cut to ``MAX_ERROR_CHARS``.
        """
        if self.extra is None and self.error is None and type(self.shape) is tuple:
            key = self[1:6]  # the common case: cached
            rest = _RESTS.get(key)
            if rest is None:
                if len(_RESTS) >= MAX_CACHED_RESTS:
                    _RESTS.clear()
                rest = _RESTS[key] = _rest_of(self)
        else:
            rest = _rest_of(self)
        return _PREFIX.pack(MAGIC, _SEQ.size + len(rest)) + _SEQ.pack(self.seq) + rest

    @classmethod
    def decode(cls, payload: bytes) -> Header:
        """The header in ``payload``, a peer's bytes.

        Raises:
            MalformedHeaderError: ``payload`` is not a well-formed header; the reason is in
                the message (bounded length). Costs O(len(payload)).
        """
        try:
            return _decode(payload)
        except (ValueError, IndexError, struct.error) as e:
            raise MalformedHeaderError(str(e)[:MAX_FIELD_CHARS]) from None


class Tail(tuple):
    """:meth:`Header.tail`: the header's fields but ``seq`` (a tuple), and their encoding."""

    def __new__(cls, fields: tuple, rest: bytes):
        self = super().__new__(cls, fields)
        self.rest = rest
        self.prefix = _PREFIX.pack(MAGIC, _SEQ.size + len(rest))
        return self

    def encode(self, seq: int) -> bytes:
        """The bytes of ``Header(seq, *self)``."""
        return self.prefix + _SEQ.pack(seq) + self.rest


def seq_setter(payload: bytearray) -> Callable[[int], None]:
    """``f(seq)`` sets the sequence number of ``payload`` (``Tail.encode``'s bytes) in place;
    a C call, no Python frame (a one-slot plan numbers each call's header with it)."""
    return functools.partial(_SEQ.pack_into, payload, _PREFIX.size)


def spot(offset: int, n: int) -> tuple[int, int, int]:
    """Where :func:`write` puts an ``n``-byte payload at ``offset``: the u32 index of the length
    word and the payload's byte range ``[start, end)`` (for a plan that writes and compares
    headers of one length on every call without recomputing them)."""
    return offset >> 2, offset + LEN_BYTES, offset + LEN_BYTES + n


# ---- encoding (our own header: never raises, falls back instead) ------------------------------
def _rest_of(h: Header) -> bytes:
    """Everything after ``seq``, within ``MAX_REST_BYTES``: as is, else with ``(shape, extra)``
    digested, else as an error header ("header too large")."""
    if h.error is not None and len(h.error) > MAX_ERROR_CHARS:
        h = h._replace(error=h.error[:MAX_ERROR_CHARS])
    try:
        return _rest(h)
    except _Unencodable:
        pass
    if h.error is None and h.op != ALL_TO_ALL:
        digest = hashlib.blake2b(repr((tuple(h.shape), h.extra)).encode(),
                                 digest_size=DIGEST_BYTES).hexdigest()
        try:
            return _rest(h._replace(shape=(), extra=("digest", digest)))
        except _Unencodable:
            pass
    bare = Header(0, _clip_name(h.op), _clip_name(h.dtype), (), _clip_name(h.reduce_op),
                  h.root if _I64_MIN <= h.root <= _I64_MAX else NO_ROOT, None,
                  h.error if h.error is not None else "header too large")
    try:
        return _rest(bare)
    except _Unencodable:  # a message of many multi-byte characters: 4 UTF-8 bytes at most each
        return _rest(bare._replace(error=bare.error[:MAX_ERROR_CHARS // 4]))


def _clip_name(s: str) -> str:
    return s.encode("utf-8", "replace")[:MAX_NAME_BYTES].decode("utf-8", "ignore")


def _rest(h: Header) -> bytes:
    flags = (F_ERROR if h.error is not None else 0) | (F_ALL_TO_ALL if h.op == ALL_TO_ALL else 0)
    root = h.root
    if not _I64_MIN <= root <= _I64_MAX:
        raise _Unencodable
    out = bytearray(_FIXED.pack(flags, root))
    for name in (h.op, h.dtype, h.reduce_op):
        b = name.encode("utf-8", "replace")
        if len(b) > MAX_NAME_BYTES:
            raise _Unencodable
        out.append(len(b))
        out += b
    shape = h.shape
    if len(shape) > MAX_DIMS:
        raise _Unencodable
    out.append(len(shape))
    try:
        out += struct.pack(f"<{len(shape)}q", *shape)
    except struct.error:
        raise _Unencodable from None
    _put(out, h.extra, MAX_EXTRA_DEPTH)
    if h.error is not None:
        b = h.error.encode("utf-8", "replace")
        out += _U16.pack(len(b))
        out += b
    if len(out) > MAX_REST_BYTES:
        raise _Unencodable
    return bytes(out)


def _put(out: bytearray, v: Any, depth: int) -> None:
    """Append the tagged encoding of ``v`` (see the module doc)."""
    if v is None:
        out += b"N"
    elif v is True or v is False:
        out += b"T" if v else b"F"
    elif isinstance(v, int):
        if _I32_MIN <= v <= _I32_MAX:
            out += b"i" + _I32.pack(v)
        elif _I64_MIN <= v <= _I64_MAX:
            out += b"q" + _I64.pack(v)
        else:
            raise _Unencodable
    elif isinstance(v, str):
        b = v.encode("utf-8", "replace")
        if len(b) > MAX_NAME_BYTES:
            raise _Unencodable
        out += b"s" + bytes((len(b),)) + b
    elif isinstance(v, (tuple, list)):
        if (type(v) is tuple and len(v) == 2 and type(v[0]) is list and type(v[1]) is list
                and len(v[0]) == len(v[1]) and _i32s(v[0]) and _i32s(v[1])):
            out += b"S" + _U16.pack(len(v[0]))
            out += struct.pack(f"<{2 * len(v[0])}i", *v[0], *v[1])
            return
        if v and _i32s(v):
            out += (b"A" if isinstance(v, list) else b"a") + _U16.pack(len(v))
            out += struct.pack(f"<{len(v)}i", *v)
            return
        if depth <= 0 or len(v) > _MAX_COUNT or len(out) + len(v) > MAX_REST_BYTES:
            raise _Unencodable
        out += (b"[" if isinstance(v, list) else b"(") + _U16.pack(len(v))
        for x in v:
            _put(out, x, depth - 1)
    else:
        raise _Unencodable


def _i32s(v: list | tuple) -> bool:
    return len(v) <= _MAX_COUNT and all(type(x) is int and _I32_MIN <= x <= _I32_MAX for x in v)


# ---- decoding (a peer's bytes: every length checked before use) --------------------------------
def _decode(p: bytes) -> Header:
    """Decode a peer's header; the fields after ``seq`` of recent headers are cached by their
    bytes (a recurring collective's headers differ only in ``seq``)."""
    rest = p[FLAGS_OFF:]
    fields = _DECODED.get(rest)
    if fields is not None and _PREFIX.unpack_from(p) == (MAGIC, len(p) - _PREFIX.size):
        return _new_header(Header, (_SEQ.unpack_from(p, _PREFIX.size)[0],) + fields)
    h = _decode_new(p)
    if len(_DECODED) >= MAX_CACHED_RESTS:
        _DECODED.clear()
    _DECODED[rest] = h[1:]
    return h


def _decode_new(p: bytes) -> Header:
    n = len(p)
    if n < _REST_OFF + 5:  # three name lengths, ndim and one extra tag at least
        raise ValueError(f"{n} bytes, fewer than the {_REST_OFF + 5} of the fixed fields")
    magic, body, seq, flags, root = _HEAD.unpack_from(p)
    if magic != MAGIC:
        raise ValueError(f"bad magic byte 0x{magic:02x}")
    if body != n - _PREFIX.size:
        raise ValueError(f"it claims {body} bytes but {n - _PREFIX.size} follow")
    # three names: a slice past the end would only be short, so each end is checked
    a = _REST_OFF + 1
    b = a + p[a - 1]
    c = b + 1 + p[b]
    d = c + 1 + p[c]
    if d >= n or b - a > MAX_NAME_BYTES or c - b > MAX_NAME_BYTES + 1 or (
            d - c > MAX_NAME_BYTES + 1):
        raise ValueError("its op, dtype or reduce op name is too long")
    op = str(p[a:b], "utf-8", "replace")
    dtype = str(p[b + 1:c], "utf-8", "replace")
    reduce_op = str(p[c + 1:d], "utf-8", "replace")
    ndim = p[d]
    pos = d + 1
    if ndim > MAX_DIMS or pos + 8 * ndim >= n:
        raise ValueError(f"a shape of {ndim} dimensions at offset {d}")
    shape = _DIMS[ndim].unpack_from(p, pos)
    pos += 8 * ndim
    if p[pos] == 0x4E:  # extra None, the common case
        extra = None
        pos += 1
    else:
        extra, pos = _get(p, pos, MAX_EXTRA_DEPTH)
    error = None
    if flags & F_ERROR:
        (k,) = _U16.unpack_from(p, pos)
        pos += _U16.size
        if k > MAX_ERROR_BYTES or pos + k > n:
            raise ValueError(f"an error message of {k} bytes at offset {pos - 2}")
        error = p[pos:pos + k].decode("utf-8", "replace")[:MAX_ERROR_CHARS]
        pos += k
    if pos != n:
        raise ValueError(f"{n - pos} bytes after the last field")
    if bool(flags & F_ALL_TO_ALL) != (op == ALL_TO_ALL):
        raise ValueError("its all_to_all flag disagrees with its op")
    return _new_header(Header, (seq, op, dtype, shape, reduce_op, root, extra, error))


def _get(p: bytes, pos: int, depth: int) -> tuple[Any, int]:
    """The tagged value at ``pos`` and the offset after it; at most ``depth`` levels deep."""
    n = len(p)
    tag = p[pos]
    pos += 1
    if tag == 0x4E:  # N
        return None, pos
    if tag == 0x54:  # T
        return True, pos
    if tag == 0x46:  # F
        return False, pos
    if tag == 0x69:  # i
        return _I32.unpack_from(p, pos)[0], pos + 4
    if tag == 0x71:  # q
        return _I64.unpack_from(p, pos)[0], pos + 8
    if tag == 0x73:  # s
        k = p[pos]
        if k > MAX_NAME_BYTES or pos + 1 + k > n:
            raise ValueError(f"a string of {k} bytes at offset {pos}")
        return p[pos + 1:pos + 1 + k].decode("utf-8", "replace"), pos + 1 + k
    if tag == 0x53:  # S
        (count,) = _U16.unpack_from(p, pos)
        pos += _U16.size
        if 8 * count > n - pos:
            raise ValueError(f"2 x {count} split sizes claimed with {n - pos} bytes left")
        ints = struct.unpack_from(f"<{2 * count}i", p, pos)
        return (list(ints[:count]), list(ints[count:])), pos + 8 * count
    if tag == 0x61 or tag == 0x41:  # a A
        (count,) = _U16.unpack_from(p, pos)
        pos += _U16.size
        if 4 * count > n - pos:
            raise ValueError(f"{count} ints claimed with {n - pos} bytes left")
        ints = struct.unpack_from(f"<{count}i", p, pos)
        return (list(ints) if tag == 0x41 else ints), pos + 4 * count
    if tag in (0x28, 0x5B):  # ( [
        if depth <= 0:
            raise ValueError(f"values nested more than {MAX_EXTRA_DEPTH} deep")
        (count,) = _U16.unpack_from(p, pos)
        pos += _U16.size
        if count > n - pos:  # every item takes at least one byte
            raise ValueError(f"{count} items claimed with {n - pos} bytes left")
        items = []
        for _ in range(count):
            v, pos = _get(p, pos, depth - 1)
            items.append(v)
        return (items if tag == 0x5B else tuple(items)), pos
    raise ValueError(f"unknown value tag 0x{tag:02x} at offset {pos - 1}")


_DTYPE_NAMES: dict = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``, cached: a coalesced header lists hundreds."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def header_dtype(dtype_name: str, t: torch.Tensor | None) -> str:
    """The header's dtype field: the dtype, plus `` on cuda`` for a CUDA tensor, so ranks
    that pass tensors of different devices to one collective fail the header check."""
    return f"{dtype_name} on cuda" if t is not None and t.is_cuda else dtype_name


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
    """The header at ``offset``: at most ``MAX_PAYLOAD_BYTES`` whatever its length word says
    (a longer claim leaves a payload that :meth:`Header.decode` rejects)."""
    (n,) = struct.unpack_from("<I", buf, offset)
    return bytes(buf[offset + LEN_BYTES:offset + LEN_BYTES + min(n, MAX_PAYLOAD_BYTES)])


def quote_peer(who: str, text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``rank 1 reported: "..."``: ``text`` that came from peer ``who``, clipped to ``limit``
    characters and quoted with JSON string escapes (no control character,
    terminal escape or unbalanced quote of the peer's reaches the message)."""
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return f"{who} reported: {json.dumps(text)}"
