"""When the IPC path may let go of device memory and events that peers use.

The IPC path (:mod:`fcoll.shm.cuda.paths`) holds three kinds of objects another process also
uses: this rank's buffer (exported to every peer), its three interprocess events (peers' streams
wait on them), and the peers' buffers and events it maps. Letting go of one too early is
undefined behaviour in CUDA (a kernel reading a closed mapping; a wait enqueued on an event its
exporter destroyed), and torch's IPC bookkeeping adds its own rules. Three rules, each here:

1. **One share per consumer** (:func:`pack_shares`, :func:`share_for`). torch counts the
   consumers of a ``_share_cuda_()`` handle with one counter set to 1, and every consumer's
   mapping decrements it once when it is released (``torch/csrc/StorageSharing.cpp``,
   ``CudaIPCTypes.cpp``); the exporter's memory stays out of its allocator ("limbo") while the
   counter is above 0. One handle mapped by n - 1 peers drives the counter to 0 when the first
   peer lets go, while the others may still read it, and then below 0, which the unsigned
   counter reads as a huge value, so the block stays in limbo for ever. So a rank calls
   ``_share_cuda_()`` once per peer and sends each peer its own handle and counter.
2. **A growth retires mappings, it does not drop them** (:class:`Retired`). Releasing a
   peer's mapping runs torch's deleter, which closes the CUDA IPC mapping *before* it
   synchronizes the *current* stream of the releasing thread, not the group's side stream
   where kernels that read the mapping may still be queued. A growth therefore records an event
   on the side stream after every kernel that may read the old mappings (they were all
   enqueued before it) and keeps the mappings until that event has completed; they are then
   released with an idle stream current, so the deleter's synchronize costs nothing.
3. **Teardown waits until every peer is past the last IPC collective**
   (:func:`peers_not_past`). A rank leaves a collective once its last phase passed, but a
   peer that passed the same phase enqueues its waits on this rank's events (``ready``,
   ``mid``) only afterwards. Destroying the events in that window makes the peer's wait
   undefined (``cudaIpcOpenEventHandle``: operations on an imported event after its exporter
   destroyed it). So close waits, bounded, until every peer arrived at a later phase (it left
   that collective), gave up (it will not enqueue again: its group is fenced), or died; when
   the bound passes first, the objects are parked for the rest of the process instead of
   being destroyed. The same holds when this rank's own side stream does not drain in time
   (:func:`wait_drained`: it may wait on an event of a peer that died with work queued).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterable

import torch

from fcoll.shm.transport.segment import (U32_BITS, U32_MASK, W_ARRIVE, W_GAVE_UP, W_PID,
                                         W_START_HI, W_START_LO, proc_alive)

log = logging.getLogger(__name__)

SHARE_FIELDS = 8  # fields of one ``UntypedStorage._share_cuda_()`` tuple
# room for one share tuple in an exchange record: about 220 bytes with a plain cudaMalloc block;
# the allocator's shareable handle can be longer (expandable segments), as before this rule
SHARE_RECORD_BYTES = 2048
TEARDOWN_WAIT_S = 5.0  # how long close waits for the peers to leave the last IPC collective
_POLL_S = 0.001

#: IPC objects of closed groups whose peers never showed they were done with them: kept until
#: the process exits (destroying them could make a peer's enqueued wait undefined, rule 3).
#: Module level on purpose: it must outlive the group; it only grows when a teardown times out.
_PARKED: list[Any] = []


# ---- rule 1: one share per consumer ------------------------------------------------------------
def pack_shares(shares: list[tuple | None], rank: int) -> list[Any]:
    """The exchange record of this rank's buffer: the share made for each peer, in rank order,
    without this rank's own slot (``shares[rank]`` is None), flattened.

    Args:
        shares: ``shares[p]`` is the ``_share_cuda_()`` tuple (8 fields) made for rank p.
        rank: this rank.

    Raises:
        ValueError: a share for a peer is missing or has another number of fields.
    """
    out: list[Any] = []
    for p, s in enumerate(shares):
        if p == rank:
            continue
        if s is None or len(s) != SHARE_FIELDS:
            raise ValueError(f"fcoll cuda: the share for rank {p} has "
                             f"{None if s is None else len(s)} fields, not {SHARE_FIELDS}")
        out.extend(s)
    return out


def share_for(record: list[Any], exporter: int, me: int) -> list[Any]:
    """The share tuple that rank ``exporter`` made for rank ``me`` in its exchange record
    (made by :func:`pack_shares`; ``me != exporter``).

    Raises:
        ValueError: the record has no share for ``me``.
    """
    i = me if me < exporter else me - 1
    s = record[i * SHARE_FIELDS:(i + 1) * SHARE_FIELDS]
    if me == exporter or len(s) != SHARE_FIELDS:
        raise ValueError(f"fcoll cuda: rank {exporter}'s buffer record has no share for "
                         f"rank {me}")
    return s


def share_record_bytes(n: int) -> int:
    """Bytes of one rank's exchange record of per-peer shares for a group of ``n`` ranks."""
    return max(1, n - 1) * SHARE_RECORD_BYTES + 64


# ---- rule 2: retired mappings -----------------------------------------------------------------
class Retired:
    """Tensors (peers' old buffer mappings) kept until an event says no queued kernel reads them.

    ``release_ctx`` is entered around every release (on CUDA: an idle stream made current, so
    the IPC deleter's synchronize of the current stream returns at once).
    """

    def __init__(self, release_ctx: Callable[[], Any] = contextlib.nullcontext):
        self._held: list[tuple[Any, list[torch.Tensor]]] = []
        self._release_ctx = release_ctx

    def add(self, event: Any, tensors: Iterable[torch.Tensor]) -> None:
        """Keep ``tensors`` until ``event`` (recorded after every kernel that reads them) has
        completed (``event.query()``)."""
        held = [t for t in tensors if t is not None]
        if held:
            self._held.append((event, held))

    def collect(self, everything: bool = False) -> int:
        """Release the tensors whose event has completed (all with ``everything``: the caller
        synchronized the stream); returns how many groups of tensors are still held."""
        if not self._held:
            return 0
        done = [h for h in self._held if everything or h[0].query()]
        if done:
            self._held = [h for h in self._held if not any(h is d for d in done)]
            with self._release_ctx():
                done.clear()  # the last references go here, inside the context
        return len(self._held)

    def release_context(self):
        """The context every release runs in (``release_ctx()``), for other releases too."""
        return self._release_ctx()

    def __len__(self) -> int:
        return len(self._held)


# ---- rule 3: teardown ------------------------------------------------------------------------
def _serial_after(a: int, b: int) -> bool:
    """Whether u32 counter value ``a`` is after ``b`` (serial-number order, RFC 1982)."""
    d = (a - b) & U32_MASK
    return 0 < d < (1 << (U32_BITS - 1))


def peers_not_past(control: torch.Tensor, rank: int, last_phase: int,
                   alive: Callable[[int, int], bool] = proc_alive) -> list[int]:
    """Group ranks that may still enqueue a wait on this rank's events of the IPC collective
    whose last phase was ``last_phase`` (this rank's phase counter at its end).

    A peer is past it when its arrive counter is after ``last_phase`` (it arrived at a later
    phase, so its host finished that collective), when it gave up a collective (its group is
    fenced: every later collective fails on the host before any stream wait), or when its
    process is gone.

    Args:
        control: the group's control records, int32 ``[world, CONTROL_BYTES / 4]``
            (:attr:`fcoll.shm.transport.segment.Segment.control`).
        rank: this rank (never listed).
        last_phase: this rank's phase count after its last IPC collective.
        alive: ``alive(pid, start_time)``, :func:`~fcoll.shm.transport.segment.proc_alive`.
    """
    words = control.tolist()
    out = []
    for p, w in enumerate(words):
        if p == rank:
            continue
        arrive = w[W_ARRIVE] & U32_MASK
        if _serial_after(arrive, last_phase & U32_MASK) or w[W_GAVE_UP] != 0:
            continue
        start = (w[W_START_LO] & U32_MASK) | ((w[W_START_HI] & U32_MASK) << U32_BITS)
        if not alive(w[W_PID] & U32_MASK, start):
            continue
        out.append(p)
    return out


def wait_peers_past(control: torch.Tensor, rank: int, last_phase: int,
                    timeout_s: float = TEARDOWN_WAIT_S,
                    alive: Callable[[int, int], bool] = proc_alive) -> list[int]:
    """Poll :func:`peers_not_past` until it is empty or ``timeout_s`` passed (seconds);
    returns the peers still not past (empty: safe to destroy the IPC objects)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = peers_not_past(control, rank, last_phase, alive)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(_POLL_S)


def wait_drained(stream: Any, timeout_s: float = TEARDOWN_WAIT_S) -> bool:
    """Poll ``stream.query()`` until the stream has no pending work or ``timeout_s`` passed
    (seconds); returns whether it drained. Bounded, unlike ``synchronize()``: a side stream
    that waits on an event of a peer that died with work queued may never drain, and a
    group's teardown must not hang on it."""
    deadline = time.monotonic() + timeout_s
    while not stream.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def park(objects: Any, why: str) -> None:
    """Keep ``objects`` until the process exits (rule 3), saying why at WARNING once per park."""
    _PARKED.append(objects)
    log.warning("fcoll cuda: keeping this group's IPC buffer and events until the process "
                "exits: %s", why)
