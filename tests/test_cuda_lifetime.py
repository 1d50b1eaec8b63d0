"""The IPC path's lifetime rules (:mod:`fcoll.shm.cuda.lifetime`) on the CPU.

Rule 1: one share per consumer, packed into bounded exchange records. Rule 2: a growth's old
peer mappings are released only after their event completed. Rule 3: teardown destroys the
events only once every peer is past the last IPC collective (arrived later, gave up, or died).
"""

from __future__ import annotations

import gc
import mmap
import weakref

import pytest
import torch

from fcoll.shm.cuda.lifetime import (SHARE_FIELDS, Retired, pack_shares, peers_not_past,
                                     share_for, share_record_bytes, wait_drained,
                                     wait_peers_past)
from fcoll.shm.cuda.records import decode, encode
from fcoll.shm.transport.segment import (PAGE, U32_MASK, W_ARRIVE, W_GAVE_UP, W_PID,
                                         W_START_HI, W_START_LO, Layout, Segment)


def _share(exporter: int, consumer: int) -> tuple:
    """A stand-in for ``_share_cuda_()``'s tuple, as large as a real one (64-byte handles)."""
    tag = bytes([exporter, consumer])
    return (0, tag * 32, 1 << 30, 0, b"/torch_4194304_4294967295" + tag, consumer,
            tag * 32, True)


@pytest.mark.parametrize("n", [2, 3, 8, 16])
def test_every_peer_gets_the_share_made_for_it(n):
    """Rank e exports one share per consumer; after encode/decode every consumer finds its
    own (rule 1: torch's counter of a share has exactly one consumer)."""
    records = []
    for e in range(n):
        shares = [None if p == e else _share(e, p) for p in range(n)]
        rec = encode(pack_shares(shares, e), share_record_bytes(n))
        assert len(rec) <= share_record_bytes(n)
        records.append(decode(rec))
    for me in range(n):
        for e in range(n):
            if e != me:
                got = share_for(records[e], e, me)
                assert len(got) == SHARE_FIELDS and tuple(got) == _share(e, me)


def test_share_packing_refuses_missing_or_foreign_shares():
    with pytest.raises(ValueError, match="share for rank 1"):
        pack_shares([None, None], 0)
    with pytest.raises(ValueError, match="no share for rank 0"):
        share_for([], 1, 0)
    with pytest.raises(ValueError, match="no share for rank 1"):
        share_for(pack_shares([None, _share(0, 1)], 0), 1, 1)  # its own slot


class _Event:
    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


def test_retired_mappings_live_until_their_event_completes():
    """rule 2: a retired tensor is released only once its event completed, inside the
    release context; ``everything`` (after a synchronize) releases the rest."""
    entered = []

    class _Ctx:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    r = Retired(_Ctx)
    a, b = torch.ones(4), torch.ones(4)
    wa, wb = weakref.ref(a), weakref.ref(b)
    ea, eb = _Event(), _Event()
    r.add(ea, [a])
    r.add(eb, [b])
    del a, b
    assert r.collect() == 2 and wa() is not None and wb() is not None and entered == []
    eb.done = True
    assert r.collect() == 1
    gc.collect()
    assert wa() is not None and wb() is None and entered == [True]
    assert r.collect(everything=True) == 0
    assert wa() is None and len(r) == 0


def _control(world: int):
    """A real segment's control words, rank p's process recorded as pid ``1000 + p``."""
    lay = Layout(world, PAGE)
    seg = Segment(mmap.mmap(-1, lay.total), lay)
    for p in range(world):
        seg.words[lay.word(p, W_PID)] = 1000 + p
        seg.words[lay.word(p, W_START_LO)] = 1
        seg.words[lay.word(p, W_START_HI)] = 0
    return seg, lay


def test_teardown_waits_for_peers_that_may_still_wait_on_our_events():
    """rule 3, ``ar (last phase 7) -> close`` on rank 0: rank 1 arrived at phase 7 only (it
    may still enqueue its wait on our ``ready``), rank 2 at 8 (it left), rank 3 gave up,
    rank 4 is dead."""
    seg, lay = _control(5)
    w = seg.words
    for p, arrive in enumerate([7, 7, 8, 7, 7]):
        w[lay.word(p, W_ARRIVE)] = arrive
    w[lay.word(3, W_GAVE_UP)] = 1 + 9
    dead = {4}

    def alive(pid, start):
        assert start == 1
        return pid - 1000 not in dead

    assert peers_not_past(seg.control, 0, 7, alive) == [1]
    assert peers_not_past(seg.control, 0, 6, alive) == []  # every peer arrived after 6
    dead.clear()
    assert peers_not_past(seg.control, 0, 7, alive) == [1, 4]
    w[lay.word(1, W_ARRIVE)] = 8
    assert peers_not_past(seg.control, 0, 7, alive) == [4]
    seg.close()


def test_teardown_counters_compare_across_the_u32_wrap():
    seg, lay = _control(2)
    seg.words[lay.word(1, W_ARRIVE)] = 2  # phase 2**32 + 2, stored mod 2**32
    assert peers_not_past(seg.control, 0, (1 << 32) + 1, lambda p, s: True) == []
    assert peers_not_past(seg.control, 0, (1 << 32) + 2, lambda p, s: True) == [1]
    assert peers_not_past(seg.control, 0, U32_MASK, lambda p, s: True) == []
    seg.close()


def test_teardown_wait_is_bounded_and_reads_a_closed_segments_view():
    """A peer that never moves: the wait returns it after the bound (then close parks the
    IPC objects); the control view stays readable after the segment closed (it keeps the
    mapping alive)."""
    seg, lay = _control(2)
    seg.words[lay.word(1, W_ARRIVE)] = 3
    control = seg.control
    seg.close()
    alive = lambda pid, start: True  # noqa: E731
    assert wait_peers_past(control, 0, 3, timeout_s=0.05, alive=alive) == [1]
    assert wait_peers_past(control, 0, 2, timeout_s=5.0, alive=alive) == []


class _Stream:
    def __init__(self, busy_polls: int):
        self.left = busy_polls

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0


def test_teardown_stream_wait_is_bounded():
    """A side stream that never drains (it waits on a dead peer's event) does not hang close:
    the wait gives up after its bound; one that drains is seen as drained."""
    assert wait_drained(_Stream(3), timeout_s=5.0) is True
    assert wait_drained(_Stream(10 ** 9), timeout_s=0.05) is False
