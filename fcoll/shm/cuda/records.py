"""Bounded records for the CUDA setup and buffer exchanges (no pickle, no marshal).

A rank's record is a list of ints, bools, bytes and None, encoded with tags into at most
``record_bytes`` and all-gathered through the group's shared-memory slots
(:func:`exchange`), so a peer's record can never make this rank run code or allocate without
bound.
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from fcoll.shm.kernels import movement
from fcoll.shm.transport.phases import Call

RECORD_BYTES = 2048  # one rank's record in the setup exchanges
_MAGIC = b"FCUD"


def encode(fields: list[Any], record_bytes: int = RECORD_BYTES) -> bytes:
    """ints, bools, bytes and None as tagged fields: ``i`` + i64, ``b`` + u16 length + bytes,
    ``n``. Raises ValueError when the record would not fit ``record_bytes``."""
    out = [_MAGIC, struct.pack("<H", len(fields))]
    for f in fields:
        if f is None:
            out.append(b"n")
        elif isinstance(f, (bool, int)):
            out.append(b"i" + struct.pack("<q", int(f)))
        else:
            f = bytes(f)
            out.append(b"b" + struct.pack("<H", len(f)) + f)
    rec = b"".join(out)
    if len(rec) > record_bytes:
        raise ValueError(f"fcoll cuda: a setup record of {len(rec)} bytes exceeds "
                         f"{record_bytes}")
    return rec


def decode(rec: bytes) -> list[Any]:
    """The fields of a record made by :func:`encode`. Raises ValueError on a malformed one."""
    if rec[:4] != _MAGIC:
        raise ValueError("fcoll cuda: malformed setup record (bad magic)")
    (count,) = struct.unpack_from("<H", rec, 4)
    pos, fields = 6, []
    for _ in range(count):
        tag = rec[pos:pos + 1]
        pos += 1
        if tag == b"n":
            fields.append(None)
        elif tag == b"i":
            fields.append(struct.unpack_from("<q", rec, pos)[0])
            pos += 8
        elif tag == b"b":
            (ln,) = struct.unpack_from("<H", rec, pos)
            pos += 2
            if pos + ln > len(rec):
                raise ValueError("fcoll cuda: malformed setup record (truncated field)")
            fields.append(bytes(rec[pos:pos + ln]))
            pos += ln
        else:
            raise ValueError(f"fcoll cuda: malformed setup record (tag {tag!r})")
    return fields


def exchange(c: Call, fields: list[Any], n: int,
              record_bytes: int = RECORD_BYTES) -> list[list[Any]]:
    """All-gather one record of at most ``record_bytes`` per rank through the shared-memory
    slots (one phase, or more for large records; the first also checks the header)."""
    rec = encode(fields, record_bytes)
    src = torch.zeros(record_bytes, dtype=torch.uint8)
    src[:len(rec)] = torch.frombuffer(bytearray(rec), dtype=torch.uint8)
    dst = torch.empty((n, record_bytes), dtype=torch.uint8)
    movement.all_gather(c, src, dst)
    return [decode(dst[p].numpy().tobytes()) for p in range(n)]
