"""A hostile or broken neighbour cannot make fcoll allocate, hang, crash or leak (issue #15,
deliverables 3 and 4).

- Crafted headers (a few bytes claiming gigabytes, deep nesting, huge counts, random mutations)
  are rejected by :func:`fcoll.shm.transport.header_checks.check` in O(header bytes) time and memory, with a
  bounded message naming the rank.
- Random byte flips from a third process in a live segment's headers: every call either returns
  the right result or raises ``CollectiveMismatchError``; the group stays usable.
- The segment is a sealed memfd: a third process cannot truncate it (so no rank can get SIGBUS),
  and attach refuses a segment that is not sealed, not ours, not mode 0600, of the wrong size.
- A whole job SIGKILLed in every phase leaves no /dev/shm name and no live mapping; the sweep
  removes names earlier fcoll versions left once no process maps them.

Multi-process tests have hard timeouts (``run_ranks(timeout_s=...)``, ``subprocess`` timeouts).
"""

from __future__ import annotations

import datetime
import fcntl
import mmap
import os
import random
import struct
import subprocess
import sys
import time
import tracemalloc

import pytest
import torch
import torch.distributed as dist

from fcoll.shm.transport import header_checks
from fcoll.shm.transport import headers as hdr
from fcoll.shm.transport.headers import CollectiveMismatchError, Header, MalformedHeaderError
from fcoll.shm.transport.segment import (HEADER_BYTES, NSLOTS, PAGE, Layout, default_slot_bytes,
                                         open_segment, proc_start_time, sweep_dead_segments)
from fcoll.testing import fcoll_segments, run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

MAX_MESSAGE_CHARS = 1024  # what a message built from peer headers may reach (names + 2 clips)


def _describe(p):
    return f"rank {p}"


def _check_peer(bad: bytes) -> MalformedHeaderError | CollectiveMismatchError | None:
    """check() of [a good header, ``bad``] as rank 1's; the error, or None if accepted."""
    good = Header(5, "all_reduce", "float32", (4,), "sum").encode()
    try:
        header_checks.check([good, bad[:hdr.MAX_PAYLOAD_BYTES]], "all_reduce", _describe, good)
    except CollectiveMismatchError as e:
        return e
    return None


# ---- headers ---------------------------------------------------------------------------------
SAMPLES = [
    Header(7, "all_reduce", "float32", (1024,), "sum"),
    Header(0, "barrier"),
    Header(3, "broadcast", "int64 on cuda", (2, 3), root=1),
    Header(3, "all_to_all_single", "float32", (8, 4), extra=([4, 4], [3, 5])),
    Header(3, "all_reduce_coalesced", "", (), "sum",
           extra=tuple(("float32", (16, i)) for i in range(8))),
    Header(hdr.NO_SEQ, "all_reduce_coalesced", "bfloat16", (12,), "max"),
    Header(9, "all_gather_into_tensor", "float32", (2,), error="fcoll all_gather: bad " * 100),
]


def test_fast_path_bytes_equal_header_encode_and_round_trip():
    """engine.py encodes a fast path's header as ``plan.tail.encode(seq)``; that must stay the
    bytes of :meth:`Header.encode`, and every header must decode to itself."""
    for h in SAMPLES:
        b = h.encode()
        assert b == h.tail().encode(h.seq)
        d = Header.decode(b)
        if h.error is None:
            assert d == h
        else:
            assert d.error == h.error[:hdr.MAX_ERROR_CHARS] and d[:7] == h[:7]


def test_oversized_own_headers_are_digested_or_cut_and_never_raise():
    many = tuple(("float32", (i, i)) for i in range(500))
    h = Header(1, "all_reduce_coalesced", "", (), "sum", extra=many)
    d = Header.decode(h.encode())
    assert d.extra[0] == "digest" and len(h.encode()) <= hdr.MAX_PAYLOAD_BYTES
    other = Header(1, "all_reduce_coalesced", "", (), "sum", extra=many[:-1] + (("int8", (1,)),))
    with pytest.raises(CollectiveMismatchError, match="passed different tensors"):
        header_checks.check([h.encode(), other.encode()], "all_reduce_coalesced", _describe)
    for bad in (Header(1, "x", error="é" * 5000), Header(1, "all_to_all_single", "f", (1,),
                                                         extra=(list(range(3000)), [0])),
                Header(1, "y", "f", tuple(range(100))), Header(1, "z", extra=1.5),
                Header(1, "w", root=1 << 70)):
        b = bad.encode()
        assert len(b) <= hdr.MAX_PAYLOAD_BYTES
        Header.decode(b)


def _crafted() -> dict[str, bytes]:
    """Peer payloads that claim far more than they hold, or nest without end."""
    good = Header(5, "all_reduce", "float32", (4,), "sum").encode()
    body = bytearray(good)
    fixed = hdr._REST_OFF  # seq, flags and root end here; names follow
    names_end = fixed + 1 + len("all_reduce") + 1 + len("float32") + 1 + len("sum")

    def frame(b: bytes) -> bytes:  # a prefix that tells the truth about the length
        return struct.pack("<BI", hdr.MAGIC, len(b) - 5) + b[5:]

    def with_extra(extra: bytes) -> bytes:
        return frame(bytes(body[:names_end]) + bytes((1,)) + struct.pack("<q", 4) + extra)

    return {
        # the 5-byte header: a bytes-type code and a 2 GiB length
        "5 bytes claiming 2 GiB": struct.pack("<BI", hdr.MAGIC, 0x7FFFFFFF),
        "5 bytes claiming 4 GiB": b"s\xff\xff\xff\xff",
        "length word past the slot": good[:5] + b"\xff" * 200,
        "op name of 255 bytes": frame(bytes(body[:fixed]) + b"\xff" + b"a" * 300),
        "255 dimensions": frame(bytes(body[:names_end]) + b"\xff" + b"\x00" * 64),
        "65535 tuple items": with_extra(b"(" + struct.pack("<H", 0xFFFF) + b"N" * 10),
        "65535 ints": with_extra(b"A" + struct.pack("<H", 0xFFFF) + b"\x00" * 16),
        "65535 split pairs": with_extra(b"S" + struct.pack("<H", 0xFFFF) + b"\x00" * 16),
        "1000 levels of nesting": with_extra(b"(\x01\x00" * 1000 + b"N"),
        "error of 65535 bytes": frame(bytes(body[:hdr.FLAGS_OFF]) + bytes((hdr.F_ERROR,))
                                      + bytes(body[hdr.FLAGS_OFF + 1:])
                                      + struct.pack("<H", 0xFFFF) + b"e" * 100),
        "unknown tag": with_extra(b"\x01"),
        "empty": b"",
    }


def test_crafted_headers_are_rejected_without_allocating_or_taking_time():
    for what, bad in _crafted().items():
        tracemalloc.start()
        t0 = time.thread_time()  # CPU time: a shared machine may deschedule the test
        err = _check_peer(bad)
        elapsed = time.thread_time() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert isinstance(err, MalformedHeaderError), (what, err)
        assert "the header of rank 1 is malformed" in str(err), what
        assert len(str(err)) <= MAX_MESSAGE_CHARS, what
        assert peak < 256 * 1024, (what, peak)
        assert elapsed < 0.05, (what, elapsed)


def test_random_mutations_decode_or_raise_bounded_errors_in_bounded_time():
    """20 000 mutated headers (byte flips, cuts, splices): each is a Header or a clear error,
    messages stay short, and the whole run takes well under a second of CPU per thousand (CPU
    time: a loaded machine stretches wall time, not the work done)."""
    rng = random.Random(15)
    seeds = [h.encode() for h in SAMPLES]
    malformed = other = 0
    t0 = time.process_time()
    for i in range(20000):
        b = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.7 and b:
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            elif kind < 0.85:
                b = b[:rng.randrange(len(b) + 1)]
            else:
                b[rng.randrange(len(b) + 1):] = rng.randbytes(rng.randint(0, 40))
        err = _check_peer(bytes(b))  # any exception but a CollectiveMismatchError fails here
        if isinstance(err, MalformedHeaderError):
            malformed += 1
        else:
            other += 1  # decoded, and then differs from rank 0's header (or equals it)
        assert err is None or len(str(err)) <= MAX_MESSAGE_CHARS
    elapsed = time.process_time() - t0
    assert malformed > 5000 and other > 1000, (malformed, other)
    assert elapsed < 20.0, elapsed


def test_messages_built_from_peer_fields_are_bounded():
    h0 = Header(1, "all_reduce", "float32", (4,), "sum")
    wide = Header(1, "all_reduce", "float32", tuple([1 << 60] * hdr.MAX_DIMS), "sum")
    with pytest.raises(CollectiveMismatchError) as ei:
        header_checks.check([h0.encode(), wide.encode()], "all_reduce", _describe)
    assert len(str(ei.value)) <= MAX_MESSAGE_CHARS and "..." in str(ei.value)
    long_error = Header(1, "all_reduce", error="x" * 100000)
    with pytest.raises(CollectiveMismatchError) as ei:
        header_checks.check([h0.encode(), long_error.encode()], "all_reduce", _describe)
    # quoted as rank 1's, its text clipped to MAX_ERROR_CHARS
    assert str(ei.value).startswith('fcoll all_reduce: rank 1 reported: "xxx')
    assert len(str(ei.value)) <= (len('fcoll all_reduce: rank 1 reported: ""')
                                  + hdr.MAX_ERROR_CHARS)


def test_all_to_all_splits_of_the_wrong_form_are_malformed_not_a_crash():
    good = Header(1, "all_to_all_single", "float32", (4,), extra=([2, 2], [2, 2]))
    for extra in (None, ([2, 2],), ([2, 2], [2]), ([2, "x"], [2, 2]), ([-1, 5], [2, 2]),
                  ((2, 2), [2, 2])):
        bad = good._replace(extra=extra).encode()
        with pytest.raises(MalformedHeaderError, match="rank 1 is malformed"):
            header_checks.check([good.encode(), bad], "all_to_all_single", _describe, good.encode())


# ---- byte flips from a third process in a live segment ----------------------------------------
FLIPPER = r"""
import os, random, select, sys
pid, seed, lo, hi, span = (int(x) for x in sys.argv[1:6])
base = None
with open(f"/proc/{pid}/maps") as f:
    for line in f:
        if f"memfd:fcoll-{pid}-" in line:
            base = int(line.split("-")[0], 16)
            break
rng = random.Random(seed)
flips = 0
with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0.0005)[0]:
        off = rng.randrange(lo, hi, 2048) + rng.randrange(span)
        mem.seek(base + off)
        b = mem.read(1)
        mem.seek(base + off)
        mem.write(bytes((b[0] ^ (1 << rng.randrange(8)),)))
        flips += 1
print(flips, flush=True)
"""


def _one_small_collective(i: int, rank: int, world: int) -> None:
    """Call ``i`` of the flipped run: one of four one-phase collectives, its result checked."""
    kind = i % 4
    if kind == 0:
        t = torch.full((8,), float(rank + i))
        dist.all_reduce(t)
        assert t.tolist() == [float(2 * i + 1)] * 8
    elif kind == 1:
        t = torch.full((4,), float(i)) if rank == 1 else torch.zeros(4)
        dist.broadcast(t, src=1)
        assert t.tolist() == [float(i)] * 4
    elif kind == 2:
        out = torch.empty(2 * world)
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
        assert out.tolist() == [float(r) for r in range(world) for _ in range(2)]
    else:
        out = torch.empty(world)
        dist.all_to_all_single(out, torch.arange(world, dtype=torch.float32) + 10 * rank)
        assert out.tolist() == [float(rank + 10 * r) for r in range(world)]


def _flipped(rank, world, min_calls, min_seconds, max_calls):
    """Small one-phase collectives while a third process flips bits in the headers.

    The run lasts at least ``min_calls`` calls and ``min_seconds`` (the flipper flips one byte
    every 0.5 ms, so a fast run of a few hundred calls could see only a handful of flips):
    rank 0 decides after every 100 calls whether to go on and tells rank 1 through the store
    (not a collective, which a flip could hit), so both ranks make the same calls.
    """
    lay = Layout(world, default_slot_bytes())
    flipper = None
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()  # before the flips start: from then on every call may be hit
    if rank == 0:
        flipper = subprocess.Popen(
            [sys.executable, "-c", FLIPPER, str(os.getpid()), "15", str(lay.header_off),
             str(lay.header_off + NSLOTS * world * HEADER_BYTES), "96"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert flipper.stdout.readline().strip() == "ready"
    ok = errors = calls = 0
    t0 = time.monotonic()
    for batch in range(max_calls // 100):
        for i in range(calls, calls + 100):
            try:
                _one_small_collective(i, rank, world)
                ok += 1
            except ValueError as e:  # CollectiveMismatchError, as it comes out of c10d
                errors += 1
                assert str(e).startswith("fcoll ") and len(str(e)) <= MAX_MESSAGE_CHARS, str(e)
        calls += 100
        key = f"test/more/{batch}"
        if rank == 0:
            more = calls < min_calls or time.monotonic() - t0 < min_seconds
            store.set(key, "1" if more else "0")
        else:
            store.wait([key])
            more = store.get(key) == b"1"
        if not more:
            break
    flips = 0
    if flipper is not None:
        flipper.stdin.close()
        flips = int(flipper.stdout.readline())
        flipper.wait(timeout=10)
        store.set("test/flipper_stopped", "1")
    # through the store, not a collective: a header written before the flipper stopped
    # could still be hit
    store.wait(["test/flipper_stopped"])
    t = torch.ones(3)
    dist.all_reduce(t)  # the group is usable after the flips
    return ok, errors, flips, t.tolist(), calls


def test_byte_flips_in_live_headers_give_right_results_or_clear_errors():
    res = run_ranks(_flipped, 2, args=(400, 1.0, 40000), timeout_s=240, pg_timeout_s=30)
    flips = res[0][2]
    errors = sum(r[1] for r in res)
    assert flips > 0
    for ok, err, _, last, calls in res:
        assert calls == res[0][4] and ok + err == calls and last == [2.0, 2.0, 2.0]
    assert errors > 0, res  # the flips were seen, and rejected
    assert fcoll_segments() == []


# ---- truncation --------------------------------------------------------------------------------
TRUNCATOR = r"""
import os, sys
pid = int(sys.argv[1])
with open(f"/proc/{pid}/maps") as f:
    rng = next(line.split()[0] for line in f if f"memfd:fcoll-{pid}-" in line)
try:
    fd = os.open(f"/proc/{pid}/map_files/{rng}", os.O_RDWR)
except PermissionError:
    print("no-access")
    sys.exit(0)
for size in (0, 4096, os.fstat(fd).st_size // 2):
    try:
        os.ftruncate(fd, size)
        print("truncated", size)
    except PermissionError:
        print("refused", size)
"""


def _truncated(rank, world):
    dist.barrier()
    out = ""
    if rank == 0:
        out = subprocess.run([sys.executable, "-c", TRUNCATOR, str(os.getpid())],
                             check=True, capture_output=True, text=True, timeout=60).stdout
    dist.barrier()
    for i in range(20):  # touches every slot: a truncated mapping would SIGBUS here
        t = torch.full((300_000,), float(rank))
        dist.all_reduce(t)
        assert t[0].item() == 1.0
    return out


def test_a_third_process_cannot_truncate_a_live_segment_so_no_rank_gets_sigbus():
    res = run_ranks(_truncated, 2, timeout_s=180, pg_timeout_s=30)  # a SIGBUS fails the run
    if res[0].strip() == "no-access":
        pytest.skip("/proc/<pid>/map_files needs CAP_SYS_ADMIN here")
    lines = res[0].splitlines()  # ftruncate to 0, to one page, to half the size
    assert len(lines) == 3 and all(line.startswith("refused ") for line in lines), lines


# ---- attach checks -----------------------------------------------------------------------------
def _memfd(size: int, mode: int = 0o600, seal: bool = True) -> int:
    fd = os.memfd_create("fcoll-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.fchmod(fd, mode)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def _attach_to(record: str, world: int = 2):
    store = dist.HashStore()
    store.set("fcoll/segment", record)
    store.add("fcoll/attached", world - 1)  # the other ranks have attached
    return open_segment(store, 1, world, PAGE, datetime.timedelta(seconds=5))


def _record(fd: int, ino: int | None = None, start: int | None = None) -> str:
    me = os.getpid()
    return (f"memfd {me} {proc_start_time(me) if start is None else start} {fd} "
            f"{os.fstat(fd).st_ino if ino is None else ino}")


def test_attach_refuses_a_segment_that_is_not_the_groups_sealed_0600_memfd(tmp_path):
    size = Layout(2, PAGE).total
    link = tmp_path / "fcoll-link"
    link.symlink_to("/etc/passwd")
    with pytest.raises(RuntimeError, match="unexpected segment record"):
        _attach_to(str(link))  # a path, as the old design published: never opened
    with pytest.raises(RuntimeError, match="unexpected segment record"):
        _attach_to("memfd 1 2 3 4 /etc/passwd")
    plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(plain, size)
    cases = {
        "not sealed": (_memfd(size, seal=False), {}),
        "mode 0644": (_memfd(size, mode=0o644), {}),
        f"{size // 2} bytes": (_memfd(size // 2), {}),
        "not the published": (_memfd(size), {"ino": 1}),
        "exited": (_memfd(size), {"start": 1}),
        "not sealed against": (plain, {}),
    }
    if os.geteuid() == 0:
        fd = _memfd(size)
        os.fchown(fd, 65534, 65534)
        cases["owned by uid 65534"] = (fd, {})
    try:
        for why, (fd, kw) in cases.items():
            with pytest.raises(RuntimeError, match=why) as ei:
                _attach_to(_record(fd, **kw))
            if why != "exited":
                assert f"/proc/{os.getpid()}/fd/{fd}" in str(ei.value)
        seg = _attach_to(_record(_memfd(size)), world=2)  # the right one is accepted
        seg.close()
    finally:
        for fd, _ in cases.values():
            os.close(fd)


# ---- leaks -------------------------------------------------------------------------------------
def test_sweep_removes_old_segment_names_only_when_no_process_maps_them(tmp_path):
    live = tmp_path / "fcoll-0123456789abcdef0123456789abcdef"
    dead = tmp_path / "fcoll-fedcba9876543210fedcba9876543210"
    other = tmp_path / "unrelated"
    for p in (live, dead, other):
        p.write_bytes(b"\0" * PAGE)
    with open(live, "r+b") as f:
        mm = mmap.mmap(f.fileno(), PAGE)
    try:
        assert sweep_dead_segments(str(tmp_path), min_age_s=3600) == []  # all too young
        assert sweep_dead_segments(str(tmp_path), min_age_s=0) == [str(dead)]
        assert sorted(os.listdir(tmp_path)) == sorted([live.name, other.name])
    finally:
        mm.close()
    assert sweep_dead_segments(str(tmp_path), min_age_s=0) == [str(live)]


def test_whole_job_sigkill_in_every_phase_leaves_nothing():
    import kill_matrix

    res = kill_matrix.run_matrix(iterations=5, world=2, seed=15)
    assert res["hung"] == []
    assert res["names_left"] == [] and res["mapped_left"] == []
    for phase in kill_matrix.PHASES:
        assert sum(res["landed"][phase].values()) == 5
