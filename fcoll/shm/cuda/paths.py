"""CUDA tensors on fcoll's backend: a staged path and an IPC path, both stream-ordered.

Every CUDA collective of a group runs on the group's *side stream* (one per group, on the
rank's device). At issue, the calling thread records an event on its current stream and the
side stream waits on it, so the collective reads its inputs after the caller's earlier work.
When the collective's kernels are enqueued, an event is recorded on the side stream; the
``Work``'s ``wait()`` makes the caller's current stream wait on that event and does not block
the host on the GPU (the design of ProcessGroupNCCL's and ProcessGroupGloo's CUDA works).

**Path choice.** At a group's first CUDA collective (on every rank: it is a collective) the
ranks exchange their GPUs' UUIDs and the UUIDs each can map (its own; peers it has peer
access to). If every rank can map every other rank's GPU, the group takes the IPC path, else
the staged path. ``FCOLL_CUDA_PATH`` = ``auto`` (default), ``ipc`` (an error when the ranks
cannot map each other) or ``staged`` overrides it. Every rank decides from the same exchanged
data, so all take the same path.

**Staged path** (any placement): :class:`~fcoll.shm.cuda.staging.CudaStaging`. The
device-to-host copies of the inputs run on the side stream into pinned host buffers (torch's caching
host allocator reuses them, and keeps each one until the copies that used it completed), the
shared-memory algorithm of the CPU path runs on them on the group's worker thread after the copies'
event, and the host-to-device copies of the outputs run on the side stream.

**IPC path** (ranks on one GPU, or GPUs with peer access): :class:`IpcBuffers`. Each rank owns
one device buffer (grown on demand to the largest collective input, in bytes) and three
interprocess events (``ready``, ``done``, ``mid``); it shares their handles through torch's own
CUDA IPC (``UntypedStorage._share_cuda_``, ``Event.ipc_handle``), and maps the peers'. A
collective ``k`` on rank ``r`` (all on the side stream):

1. first phase (header check, over shared memory): every peer has enqueued collective
   ``k - 1`` entirely, so its ``done`` event's latest record is ``done[k-1]``; wait on it
   (the peers finished reading this rank's buffer), copy the input into the buffer, record
   ``ready``.
2. second phase: every peer recorded ``ready[k]`` and cannot record ``ready[k+1]`` before this
   rank arrives at ``k + 1``; wait on the peers' ``ready``, then run device kernels that read
   the peers' buffers straight into the output; record ``done``.

A collective that moves 0 bytes (on every rank: the header check makes sizes agree) is its
header phase only, as on the CPU path: no buffer growth, no copy, no event recorded or waited
on (:func:`buffer_capacity`). Skipping its ``done`` record keeps step 1 right: the latest
``done`` record of a peer is then that of the last collective that read this rank's buffer.

A host-side phase only says that a peer's event has been *recorded*; the stream waits are what
order the GPU work, so the host never waits for the GPU. all_reduce is one-shot (every rank
reduces all n buffers in rank order) or, for 3 ranks or more and large messages, a
reduce-scatter (rank p reduces chunk p into its own buffer) then, after a third phase on
``mid``, an all-gather of the reduced chunks. Reductions fold the operands in rank order with
the reducers of :mod:`fcoll.ops.reduce`, so every rank computes the same bits; with
``FCOLL_CUDA_TRITON=1`` the fold is one Triton kernel that reads every buffer once and writes
the output once, where it applies (:mod:`fcoll.shm.cuda.fold`).

Allocator safety: every user tensor used on the side stream is ``record_stream``-ed at issue,
and the job holds a reference to it until its kernels are enqueued, so freeing it right after
the call never lets the caching allocator hand its memory out too early. When the IPC path lets
go of memory and events peers use (shares, growth, teardown): :mod:`fcoll.shm.cuda.lifetime`.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from fcoll.shm.cuda.fold import fold_views_into
from fcoll.shm.cuda.lifetime import (Retired, pack_shares, park, share_for, share_record_bytes,
                                     wait_drained, wait_peers_past)
from fcoll.shm.cuda.records import exchange
from fcoll.shm.transport.phases import Call, slice_of

PATH_ENV = "FCOLL_CUDA_PATH"  #: ``auto`` | ``ipc`` | ``staged``
TWO_SHOT_ENV = "FCOLL_CUDA_TWO_SHOT_BYTES"  #: all_reduce size from which 3+ ranks go two-shot
TWO_SHOT_BYTES = 1 << 20
MIN_IPC_BYTES = 1 << 20  # the smallest IPC buffer; it grows to powers of two
UUID_BYTES = 40  # a GPU UUID as text ("GPU-..." or "xxxxxxxx-xxxx-..."), NUL-padded
MAX_MAPPABLE = 16  # GPUs a rank lists as mappable
PATHS = ("auto", "ipc", "staged")


# ---- device checks ----------------------------------------------------------------------------
def device_error(tensors: list[tuple[str, torch.Tensor]], device: int | None) -> str | None:
    """Why the tensors of one call cannot run on this rank, or None.

    Args:
        tensors: ``(argument name, tensor)`` of every tensor of the call.
        device: this rank's CUDA device index (the group's, once fixed), or None (then
            ``torch.cuda.current_device()`` is the rank's device).

    Returns a message for: CPU and CUDA tensors mixed in one call; a CUDA tensor on another
    device than the rank's.
    """
    types = {t.device.type for _, t in tensors}
    if len(types) > 1:
        where = ", ".join(f"{a} on {t.device}" for a, t in tensors)
        return (f"mixes devices in one call ({where}); pass every tensor of a collective on "
                "one device")
    if "cuda" not in types:
        return None
    own = torch.cuda.current_device() if device is None else device
    for a, t in tensors:
        if t.device.index != own:
            return (f"{a} is on {t.device} but this rank's device is cuda:{own} (the current "
                    "device at the group's first CUDA collective; call torch.cuda.set_device "
                    "before it)")
    return None


def _uuid(device: int) -> bytes:
    return str(torch.cuda.get_device_properties(device).uuid).encode()[:UUID_BYTES]


def _mappable(device: int) -> list[bytes]:
    """UUIDs of the GPUs whose memory a kernel on ``device`` can read: its own and those it
    has peer access to (among the GPUs this process sees)."""
    out = [_uuid(device)]
    for j in range(torch.cuda.device_count()):
        if j != device and torch.cuda.can_device_access_peer(device, j):
            out.append(_uuid(j))
    return out[:MAX_MAPPABLE]


def buffer_capacity(needed: int, capacity: int) -> int | None:
    """The IPC buffers' capacity for a collective whose largest per-rank buffer use is
    ``needed`` bytes, when every rank's buffer now holds ``capacity`` bytes (0 before the
    group's first IPC collective).

    Returns:
        None when ``needed`` is 0: the collective moves no bytes, so it is complete after its
        header phase and touches no buffer and no event (as on the CPU path, where a 0-byte
        collective is its header phase; before this rule a 0-byte collective as the group's
        first IPC one indexed the still empty buffer list and broke the group on every rank).
        Else ``capacity`` when it suffices, else the power of two at least ``needed`` and
        at least ``MIN_IPC_BYTES`` that every rank grows to.

    Every rank computes it from the same ``needed`` (equal by the header check, or taken
    from every rank's header for all_to_all) and the same ``capacity``, so all ranks agree
    on whether the collective grows and on whether it runs any further phase.

    Raises:
        ValueError: ``needed`` or ``capacity`` is negative.
    """
    if needed < 0 or capacity < 0:
        raise ValueError(f"fcoll cuda: negative byte count (needed {needed}, "
                         f"capacity {capacity})")
    if needed == 0:
        return None
    if needed <= capacity:
        return capacity
    return max(MIN_IPC_BYTES, 1 << (needed - 1).bit_length())


# ---- the IPC path -----------------------------------------------------------------------------
class IpcBuffers:
    """This rank's shared device buffer and interprocess events, and the peers' mappings.

    Attributes:
        bufs: ``bufs[p]`` is rank p's buffer as a uint8 CUDA tensor of ``capacity`` bytes
            (this rank's own at ``bufs[rank]``).
        ready, done, mid: ``[p]`` is rank p's interprocess event (see the module docstring).
        capacity: bytes of every rank's buffer (equal on all ranks).
    """

    def __init__(self, group: "CudaGroup"):
        self._g = group
        self.capacity = 0
        self.bufs: list[torch.Tensor] = []
        n = group.size
        idle = torch.cuda.Stream(group.device)  # never given work: see lifetime, rule 2
        self.retired = Retired(lambda: torch.cuda.stream(idle))
        mine = [torch.cuda.Event(interprocess=True) for _ in range(3)]
        self._event_handles = [e.ipc_handle() for e in mine]
        # own events at every index until open_events() puts the peers' in their places
        self.ready: list[torch.cuda.Event] = [mine[0]] * n
        self.done: list[torch.cuda.Event] = [mine[1]] * n
        self.mid: list[torch.cuda.Event] = [mine[2]] * n

    def open_events(self, records: list[list[Any]]) -> None:
        """Map every peer's events from their records (fields 0-2 are the handles)."""
        g = self._g
        for p, rec in enumerate(records):
            if p == g.rank:
                continue
            self.ready[p], self.done[p], self.mid[p] = (
                torch.cuda.Event.from_ipc_handle(torch.device("cuda", g.device), h)
                for h in rec[:3])

    def event_fields(self) -> list[bytes]:
        return list(self._event_handles)

    def grow(self, c: Call, cap: int) -> None:
        """Make every rank's buffer ``cap`` bytes (from :func:`buffer_capacity`): allocate,
        exchange the handles (one phase), map the peers'.

        Every rank calls it with the same ``cap`` at the same point of the same collective.
        This rank's old buffer is freed after the side stream waited on the peers' ``done``
        events: the allocator hands its block out again only to later work of the side stream
        (it was allocated there), which runs after every peer's reads of it. Each peer gets a
        share of its own (:mod:`fcoll.shm.cuda.lifetime`, rule 1). The old mappings of the
        peers' buffers are retired behind an event recorded on the side stream now, after every
        kernel that may read them was enqueued, and released once it completed (rule 2).
        """
        g = self._g
        g.wait_peers(self.done)
        with torch.cuda.stream(g.stream):
            own = torch.empty(cap, dtype=torch.uint8, device=g.device)
        storage = own.untyped_storage()
        shares = [None if p == g.rank else storage._share_cuda_() for p in range(g.size)]
        recs = exchange(c, pack_shares(shares, g.rank), g.size, share_record_bytes(g.size))
        bufs = []
        for p, rec in enumerate(recs):
            if p == g.rank:
                bufs.append(own)
                continue
            dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = share_for(
                rec, p, g.rank)
            peer_storage = torch.UntypedStorage._new_shared_cuda(
                g.device, handle, size, offset, rc_handle, rc_offset, ev_handle, bool(ev_sync))
            peer = torch.empty(0, dtype=torch.uint8, device=g.device)
            peer.set_(peer_storage, 0, (size,), (1,))
            bufs.append(peer[:cap])
        old = [b for p, b in enumerate(self.bufs) if p != g.rank]
        if old:
            retire = torch.cuda.Event()
            retire.record(g.stream)
            self.retired.add(retire, old)
            del old
        self.bufs = bufs
        self.capacity = cap
        self.retired.collect()

    def close(self) -> None:
        """Release everything; the caller saw the side stream drain and made sure no peer
        will enqueue another wait on this rank's events (lifetime, rule 3)."""
        self.retired.collect(everything=True)
        with self.retired.release_context():
            self.bufs = []
            self.ready = self.done = self.mid = []


class CudaGroup:
    """The CUDA state of one fcoll process group: device, side stream, path, IPC buffers.

    Args:
        rank, size: this rank and the group size.
    """

    def __init__(self, rank: int, size: int):
        self.rank = rank
        self.size = size
        self.device: int | None = None
        self.stream: torch.cuda.Stream | None = None
        self.path: str | None = None  # "ipc" | "staged" once the first CUDA collective ran
        self.ipc: IpcBuffers | None = None
        self._control: torch.Tensor | None = None  # the group's control words (teardown)
        self._last_phase: int | None = None  # phase count after the last IPC collective
        self.two_shot_bytes = int(os.environ.get(TWO_SHOT_ENV, str(TWO_SHOT_BYTES)))

    def wait_peers(self, events: list[torch.cuda.Event]) -> None:
        """Order the side stream after every peer's recorded event (``events[p]`` is rank
        p's; this rank's own is skipped), as GPU-side waits.

        Measured on an H100 with 2 ranks sharing it, all_reduce 4 KiB to 128 MiB: polling
        the events from the host instead was 1.1-1.6x slower at every size."""
        s = self.stream
        for p, ev in enumerate(events):
            if p != self.rank:
                s.wait_event(ev)

    # -- setup (the run of the group's first CUDA collective's setup job) --------------------
    def bind(self) -> None:
        """Fix this rank's device (the current device) and create the side stream."""
        if self.device is None:
            self.device = torch.cuda.current_device()
            self.stream = torch.cuda.Stream(self.device)

    def setup(self, c: Call) -> None:
        """Choose the path with the peers (one or two phases); on IPC, share the events.

        Raises:
            RuntimeError: ``FCOLL_CUDA_PATH=ipc`` but some rank cannot map another's GPU.
        """
        self.bind()
        path = os.environ.get(PATH_ENV, "auto").strip().lower() or "auto"
        if path not in PATHS:
            raise ValueError(f"fcoll: {PATH_ENV}={path!r}: expected one of {', '.join(PATHS)}")
        with torch.cuda.device(self.device):
            mine = [_uuid(self.device), os.getpid(), *_mappable(self.device)]
            recs = exchange(c, mine, self.size)
            uuids = [r[0] for r in recs]
            can_map = all(u in set(r[2:]) for r in recs for u in uuids)
            if path == "auto":
                path = "ipc" if can_map else "staged"
            if path == "ipc" and not can_map:
                raise RuntimeError(
                    f"fcoll: {PATH_ENV}=ipc but not every pair of ranks can map each other's "
                    f"GPU memory (GPUs by rank: {[u.decode() for u in uuids]}); use "
                    f"{PATH_ENV}=staged or auto")
            if path == "ipc":
                ipc = IpcBuffers(self)
                recs = exchange(c, ipc.event_fields(), self.size)
                ipc.open_events(recs)
                self.ipc = ipc
                self._control = c.ch.seg.control
                self._last_phase = c.ch.phase  # peers open our events after this phase
            self.path = path

    # -- the IPC path's collectives (run by the engine, on any thread) -----------------------
    def run_ipc(self, issued: torch.cuda.Event, body: Callable[[Call, IpcBuffers], None],
                c: Call) -> torch.cuda.Event:
        """Run ``body(c, ipc)`` on the side stream after the caller's ``issued`` event;
        return the event recorded when its kernels are enqueued."""
        s = self.stream
        with torch.cuda.device(self.device), torch.cuda.stream(s):
            s.wait_event(issued)
            try:
                body(c, self.ipc)
            finally:  # also when a phase raised: peers may have seen this rank's records
                self._last_phase = c.ch.phase
            ev = torch.cuda.Event()
            ev.record(s)
        return ev

    def _phase1(self, c: Call, ipc: IpcBuffers, needed: int | None,
                row_bytes: int = 0) -> list:
        """Header phase; grow every buffer to ``needed`` bytes (None: the largest input of
        an all_to_all of ``row_bytes`` rows, from the headers' split sizes); wait for the
        peers' ``done``. Returns the headers (decoded for all_to_all, else maybe ``[]``), or
        None when the collective moves no bytes: it is then complete, and the caller returns
        without touching a buffer or an event (:func:`buffer_capacity`)."""
        heads = c.first_sync(c.slot())
        if needed is None:
            needed = max(sum(h.extra[0]) for h in heads) * row_bytes
        cap = buffer_capacity(needed, ipc.capacity)
        if cap is None:
            return None
        if ipc.retired:
            ipc.retired.collect()
        if cap != ipc.capacity:
            ipc.grow(c, cap)
        self.wait_peers(ipc.done)
        return heads

    def _phase2(self, c: Call, ipc: IpcBuffers) -> None:
        """Publish ``ready``; after every peer did, wait on theirs."""
        ipc.ready[self.rank].record(self.stream)
        c.sync()
        self.wait_peers(ipc.ready)

    def _done(self, ipc: IpcBuffers) -> None:
        ipc.done[self.rank].record(self.stream)

    def all_reduce(self, c: Call, ipc: IpcBuffers, inp: torch.Tensor, out: torch.Tensor,
                   op: str) -> None:
        """``out = op over ranks of inp``; both contiguous, same dtype and numel (may alias)."""
        nbytes = inp.numel() * inp.element_size()
        if self._phase1(c, ipc, nbytes) is None:
            return
        n, r = self.size, self.rank
        dt, N = inp.dtype, inp.numel()
        ipc.bufs[r][:nbytes].view(dt).copy_(inp.view(-1))
        self._phase2(c, ipc)
        views = [b[:nbytes].view(dt) for b in ipc.bufs]
        flat = out.view(-1)
        if n < 3 or nbytes < self.two_shot_bytes:
            fold_views_into(views, op, flat)
            self._done(ipc)
            return
        # reduce-scatter: chunk r of every buffer, reduced into out, then into own buffer
        a, b = slice_of(N, n, r)
        fold_views_into([v[a:b] for v in views], op, flat[a:b])
        views[r][a:b].copy_(flat[a:b])
        ipc.mid[r].record(self.stream)
        c.sync()
        self.wait_peers(ipc.mid)
        for p in range(n):  # all-gather the other chunks
            if p != r:
                pa, pb = slice_of(N, n, p)
                flat[pa:pb].copy_(views[p][pa:pb])
        self._done(ipc)

    def all_reduce_coalesced(self, c: Call, ipc: IpcBuffers,
                             pairs: list[tuple[torch.Tensor, torch.Tensor]], op: str) -> None:
        """``outs[i] = op over ranks of inputs[i]`` for every ``(input, output)`` pair (flat,
        contiguous); the inputs are packed into the buffer by dtype, one fold per dtype."""
        layout, off = [], 0
        for x, _ in pairs:
            off = -(-off // 256) * 256
            layout.append(off)
            off += x.numel() * x.element_size()
        if self._phase1(c, ipc, off) is None:
            return
        own = ipc.bufs[self.rank]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (x, _) in enumerate(pairs):
            by_dtype.setdefault(x.dtype, []).append(i)
            o = layout[i]
            own[o:o + x.numel() * x.element_size()].view(x.dtype).copy_(x)
        self._phase2(c, ipc)
        for dt, idx in by_dtype.items():
            for i in idx:
                x, y = pairs[i]
                o, ln = layout[i], x.numel() * x.element_size()
                fold_views_into([b[o:o + ln].view(dt) for b in ipc.bufs], op, y)
        self._done(ipc)

    def all_gather(self, c: Call, ipc: IpcBuffers, src: torch.Tensor,
                   dst: torch.Tensor) -> None:
        """Bytes: ``src [B]`` uint8 -> ``dst [n * B]`` uint8 (contiguous), rank order."""
        B = src.numel()
        if self._phase1(c, ipc, B) is None:
            return
        ipc.bufs[self.rank][:B].copy_(src)
        self._phase2(c, ipc)
        torch.cat([b[:B] for b in ipc.bufs], out=dst)
        self._done(ipc)

    def reduce_scatter(self, c: Call, ipc: IpcBuffers, inp: torch.Tensor, out: torch.Tensor,
                       op: str) -> None:
        """``inp [n * M]`` -> ``out [M]`` (flat, contiguous): chunk ``rank`` reduced."""
        nbytes = inp.numel() * inp.element_size()
        if self._phase1(c, ipc, nbytes) is None:
            return
        dt, M, r = inp.dtype, out.numel(), self.rank
        ipc.bufs[r][:nbytes].view(dt).copy_(inp)
        self._phase2(c, ipc)
        fold_views_into([b[:nbytes].view(dt)[r * M:(r + 1) * M] for b in ipc.bufs], op, out)
        self._done(ipc)

    def broadcast(self, c: Call, ipc: IpcBuffers, buf: torch.Tensor, root: int) -> None:
        """Bytes: the root's ``buf [B]`` (uint8, contiguous) into every rank's."""
        B = buf.numel()
        if self._phase1(c, ipc, B) is None:
            return
        if self.rank == root:
            ipc.bufs[root][:B].copy_(buf)
        self._phase2(c, ipc)
        if self.rank != root:
            buf.copy_(ipc.bufs[root][:B])
        self._done(ipc)

    def all_to_all(self, c: Call, ipc: IpcBuffers, src: torch.Tensor, dst: torch.Tensor,
                   row_bytes: int) -> None:
        """Bytes: rank p's rows for this rank land in ``dst`` in rank order; the split sizes
        come from every rank's header (``extra = (input_split_sizes, output_split_sizes)``)."""
        heads = self._phase1(c, ipc, None, row_bytes)
        if heads is None:
            return
        ipc.bufs[self.rank][:src.numel()].copy_(src)
        self._phase2(c, ipc)
        r, parts = self.rank, []
        for p, h in enumerate(heads):
            splits = h.extra[0]
            a = sum(splits[:r]) * row_bytes
            parts.append(ipc.bufs[p][a:a + splits[r] * row_bytes])
        torch.cat(parts, out=dst)
        self._done(ipc)

    def close(self) -> None:
        """Drop the peers' mappings, this rank's buffer and events: after the side stream
        drained (no kernel of this rank reads a mapping any more) and after every peer is past
        the last IPC collective (none will enqueue a wait on this rank's events again,
        :mod:`fcoll.shm.cuda.lifetime` rule 3). A stream that does not drain, or a peer that
        shows none of that, within ``TEARDOWN_WAIT_S`` leaves them parked until the process
        exits (a teardown never hangs on the GPU)."""
        drained = True
        if self.stream is not None:
            try:
                drained = wait_drained(self.stream)
            except Exception:  # noqa: BLE001  the context may be gone at interpreter exit
                pass
        ipc, self.ipc = self.ipc, None
        control, self._control = self._control, None
        if ipc is None:
            return
        left = [] if self._last_phase is None else wait_peers_past(
            control, self.rank, self._last_phase)
        if not drained:
            park(ipc, "its side stream did not drain in time (a wait on an event of a peer "
                      "that died with work queued?)")
        elif left:
            park(ipc, f"group ranks {left} did not leave the last IPC collective, give up or "
                      "exit in time, and may still enqueue waits on its events")
        else:
            ipc.close()
