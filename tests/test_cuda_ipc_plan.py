"""The IPC path's planning and data logic on the CPU, without a GPU.

:class:`fcoll.shm.cuda.paths.CudaGroup`'s IPC collectives are torch ops on buffers plus event
records and stream waits. Here every rank is a thread, the "GPU" is CPU tensors shared between
the threads, phases are a ``threading.Barrier``, and events and streams are stand-ins that count
records and waits. This checks what a GPU cannot make easier to see: which phases run, when
buffers grow, and that a 0-byte collective touches no buffer and no event (the first IPC
collective of a group used to index its empty buffer list: IndexError on every rank).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from fcoll.ops.reduce import check_reduce_op, reduce_rows_into
from fcoll.shm.cuda.lifetime import Retired
from fcoll.shm.cuda.paths import MIN_IPC_BYTES, CudaGroup, IpcBuffers, buffer_capacity

OPS = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor"]
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.bool]


def test_buffer_capacity_plans_nothing_for_zero_bytes_and_powers_of_two_to_grow():
    assert buffer_capacity(0, 0) is None  # the first IPC collective moves nothing: no grow
    assert buffer_capacity(0, 1 << 20) is None
    assert buffer_capacity(1, 0) == MIN_IPC_BYTES
    assert buffer_capacity(MIN_IPC_BYTES, MIN_IPC_BYTES) == MIN_IPC_BYTES
    assert buffer_capacity(MIN_IPC_BYTES + 1, MIN_IPC_BYTES) == 2 * MIN_IPC_BYTES
    assert buffer_capacity(5 << 20, 0) == 8 << 20
    assert buffer_capacity(100, 8 << 20) == 8 << 20  # never shrinks
    with pytest.raises(ValueError, match="negative"):
        buffer_capacity(-1, 0)


class _Event:
    """An interprocess event: counts its records."""

    def __init__(self):
        self.records = 0

    def record(self, stream=None) -> None:
        self.records += 1


class _Stream:
    def __init__(self):
        self.waits = 0

    def wait_event(self, ev) -> None:
        self.waits += 1


class _World:
    """What the ranks share: their buffers (the device memory) and the phase barrier."""

    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.bufs: list[torch.Tensor | None] = [None] * n
        self.events = [[_Event() for _ in range(3)] for _ in range(n)]
        self.grows = 0


class _Call:
    """The phases of one collective: every sync is a barrier; the first returns the headers."""

    def __init__(self, world: _World, heads: list):
        self.w, self.heads, self.phases = world, heads, 0

    def slot(self) -> int:
        return 0

    def first_sync(self, slot: int) -> list:
        self.sync()
        return self.heads

    def sync(self) -> None:
        self.phases += 1
        self.w.barrier.wait()


class _Ipc(IpcBuffers):
    """IpcBuffers whose growth allocates CPU tensors and exchanges them through ``_World``."""

    def __init__(self, g: CudaGroup, w: _World):  # noqa: super().__init__ makes CUDA events
        self._g, self._w, self.capacity, self.bufs = g, w, 0, []
        self.retired = Retired()
        self.ready, self.done, self.mid = ([w.events[p][i] for p in range(w.n)] for i in range(3))

    def grow(self, c, cap: int) -> None:
        own = torch.zeros(cap, dtype=torch.uint8)
        self._w.bufs[self._g.rank] = own
        if self._g.rank == 0:
            self._w.grows += 1
        c.sync()  # the handle exchange
        self.bufs = list(self._w.bufs)
        self.capacity = cap


def _run(n: int, fn, two_shot_bytes: int = 1 << 20) -> tuple[list, _World]:
    """``fn(rank, cg, ipc)`` on n threads; returns each rank's result (or raises its error)."""
    w = _World(n)
    out: list = [None] * n
    errors: list = []

    def rank_main(r: int) -> None:
        cg = CudaGroup(r, n)
        cg.stream, cg.two_shot_bytes = _Stream(), two_shot_bytes
        try:
            out[r] = fn(r, cg, _Ipc(cg, w), w)
        except BaseException as e:  # noqa: BLE001  reported below, peers released
            errors.append((r, e))
            w.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    first = [e for e in errors if not isinstance(e[1], threading.BrokenBarrierError)]
    if errors:
        r, e = (first or errors)[0]
        raise AssertionError(f"rank {r} raised {type(e).__name__}: {e}") from e
    return out, w


def _value(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    base = (torch.arange(numel) * 7 + rank * 3) % 5
    return base % 2 == 0 if dtype == torch.bool else (base + 1 + rank % 2).to(dtype)


def _records(w: _World) -> int:
    return sum(e.records for evs in w.events for e in evs)


def _zero_byte_calls(r, cg, ipc, w):
    """Every IPC collective with 0 bytes, as the group's first: one phase each, nothing else."""
    n = cg.size
    empty = torch.empty(0)
    e8 = torch.empty(0, dtype=torch.uint8)
    calls = [
        lambda c: cg.all_reduce(c, ipc, empty, empty, "sum"),
        lambda c: cg.all_reduce_coalesced(c, ipc, [(empty, empty), (empty, empty)], "max"),
        lambda c: cg.all_gather(c, ipc, e8, e8),
        lambda c: cg.reduce_scatter(c, ipc, empty, empty, "sum"),
        lambda c: cg.broadcast(c, ipc, e8, 0),
    ]
    phases = []
    for call in calls:
        c = _Call(w, [])
        call(c)
        phases.append(c.phases)
    c = _Call(w, [SimpleNamespace(extra=([0] * n, [0] * n))] * n)
    cg.all_to_all(c, ipc, e8, e8, 12)
    phases.append(c.phases)
    return phases, ipc.capacity, cg.stream.waits


@pytest.mark.parametrize("n", [2, 3])
def test_zero_byte_first_ipc_collective_completes_touching_no_buffer_or_event(n):
    res, w = _run(n, _zero_byte_calls)
    for phases, capacity, waits in res:
        assert phases == [1] * 6  # the header phase only
        assert capacity == 0 and waits == 0
    assert w.grows == 0 and w.bufs == [None] * n and _records(w) == 0


def _zero_between(r, cg, ipc, w):
    """A 0-byte all_reduce after the buffers grew, then a real one: results right."""
    x = _value(r, 100, torch.float32)
    cg.all_reduce(_Call(w, []), ipc, x, x, "sum")
    w.barrier.wait()  # every rank recorded its events
    before = _records(w)
    w.barrier.wait()
    empty = torch.empty(0)
    c = _Call(w, [])
    cg.all_reduce(c, ipc, empty, empty, "sum")
    w.barrier.wait()
    touched = _records(w) - before
    y = _value(r, 50, torch.float32)
    cg.all_reduce(_Call(w, []), ipc, y, y, "max")
    return x, y, c.phases, touched


def test_zero_byte_collective_between_others_leaves_them_right():
    res, w = _run(2, _zero_between)
    want_x = _value(0, 100, torch.float32) + _value(1, 100, torch.float32)
    want_y = torch.maximum(_value(0, 50, torch.float32), _value(1, 50, torch.float32))
    for x, y, phases, touched in res:
        assert torch.equal(x, want_x) and torch.equal(y, want_y)
        assert phases == 1 and touched == 0
    assert w.grows == 1


def _reduced(n: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    out = torch.empty(numel, dtype=dtype)
    reduce_rows_into(torch.stack([_value(p, numel, dtype) for p in range(n)]), op, out)
    return out


def _all_reduce_every_op(r, cg, ipc, w):
    got = {}
    for dt in DTYPES:
        for op in OPS:
            if check_reduce_op(op, dt) is None:
                x = _value(r, 3000, dt)
                cg.all_reduce(_Call(w, []), ipc, x, x, op)
                got[(dt, op)] = x
    big = _value(r, (3 << 20) // 4, torch.float32)  # grows the buffers mid-run to 4 MiB
    cg.all_reduce(_Call(w, []), ipc, big, big, "sum")
    got["big"] = big
    return got, ipc.capacity


@pytest.mark.parametrize("n,two_shot", [(2, 1 << 20), (3, 1 << 20), (3, 0)])
def test_ipc_all_reduce_matches_the_reference_one_and_two_shot(n, two_shot):
    res, w = _run(n, _all_reduce_every_op, two_shot_bytes=two_shot)
    for got, capacity in res:
        for key, x in got.items():
            numel, dt, op = ((3 << 20) // 4, torch.float32, "sum") if key == "big" else (
                3000, *key)
            want = _reduced(n, numel, dt, op)
            assert torch.allclose(x.double(), want.double()), key
        assert capacity == 4 << 20
    assert w.grows == 2  # 1 MiB at the first collective, 4 MiB at the big one
