"""The rules of bucket planning: who may be a member, and who may join an open bucket.

Positions and keys are those of :mod:`fcoll.passes.rewrites.bucket_plan` (its module docstring
states the placement model and the lane plan); these are pure functions of the records below.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from fcoll.passes.analysis.comm_cost import describe
from fcoll.passes.rewrites.bucket_key import OpArgs

__all__ = ["Member", "OpenBucket", "wait_index", "rejection", "join_rejection",
           "dependency_rejection", "add", "lane_segments"]

log = logging.getLogger(__name__)

#: A member starts a new bucket only when merging loses by more than this fraction of the merged
#: collective's estimated time (:func:`lane_segments`): lateness differences within it are
#: within the cost model's noise (calibrations of one machine differ by 5-10 % run to run), and
#: a close call then goes to the one default, merging, instead of to whichever way the last
#: timing fell.
MERGE_MARGIN = 0.10


@dataclass
class Member:
    """A collective that may join a bucket, in plan positions (node indices, sort keys).

    Attributes:
        node / wait: the collective and its single wait.
        ready: sort key after which every input is ready.
        wait_idx: index of the member's wait.
        first_use: index of the first user of the wait (or of the output node).
        last_hide: index of the last compute node recorded as hiding it, -1 if none.
        in_bytes / out_bytes: bytes of its input and output on this rank.
        dtype: its input's dtype.
        ready_us / use_us: estimated compute microseconds before its inputs are ready, and
            before the first use of its result.
        comm_us: estimated microseconds as a separate collective; None: no lane plan.
        comm_time: bytes -> microseconds of one collective of its kind and group.
        segment: the bucket :func:`lane_segments` planned it into (timed members only); a
            member never joins an open bucket of another segment.
        cut: why its segment starts at it (``lane_segments``'s reason), for the DEBUG log.
    """

    node: fx.Node
    wait: fx.Node
    ready: tuple
    wait_idx: int
    first_use: int
    last_hide: int
    in_bytes: int
    out_bytes: int
    dtype: torch.dtype
    ready_us: float = 0.0
    use_us: float = 0.0
    comm_us: float | None = None
    comm_time: Callable[[int], float] | None = None
    segment: int | None = None
    cut: str = ""

    @property
    def comm_bytes(self) -> int:
        """Bytes that size its communication: the larger of input and output."""
        return max(self.in_bytes, self.out_bytes)


@dataclass
class OpenBucket:
    """A bucket being filled: its members and their combined positions and estimates."""

    key: tuple
    members: list[Member] = field(default_factory=list)
    ready: tuple = (-1,)
    wait_idx: int = 1 << 62
    first_use: int = 1 << 62
    last_hide: int = -1
    in_bytes: int = 0
    out_bytes: int = 0


def wait_index(ready: tuple, wait_idx: int, last_hide: int) -> int:
    """Smallest node index ``W`` whose wait group ``(2W-1, 0, seq)`` sorts after the issue."""
    after_issue = (ready[0] + 2) // 2
    return max(wait_idx, after_issue, last_hide + 1)


def _static_shape(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in val.shape)


def rejection(node: fx.Node, spec: OpArgs, waits: list[fx.Node]) -> str | None:
    """Why ``node`` cannot join any bucket, or None.

    Symbolic sizes, data-dependent (unbacked) ones included, are never bucketed: a collective
    joins only with static input and output shapes and, for all_to_all, constant split sizes.
    A merged buffer's offsets and the byte cap would need those sizes' values, and comparing
    an unbacked size would guard on it (``GuardOnDataDependentSymNode``); such a collective
    simply stays as it is (logged at DEBUG with this reason).
    """
    if len(waits) != 1 or len(node.users) != 1:
        return f"{len(waits)} waits and {len(node.users)} users (need exactly one wait)"
    if node.kwargs or len(node.args) != spec.nargs:
        return "arguments passed by keyword (the rewrite reads them by position)"
    inp = node.args[0]
    if not isinstance(inp, fx.Node) or not _static_shape(inp.meta.get("val")):
        return "input has no static-shape meta['val']"
    if not _static_shape(node.meta.get("val")):
        return "output has no static-shape meta['val']"
    if spec.kind == "all_to_all":
        splits = [*spec.arg(node, "output_split_sizes"), *spec.arg(node, "input_split_sizes")]
        if not all(isinstance(s, int) for s in splits):
            return "all_to_all split sizes are not constants"
    return None


def join_rejection(b: OpenBucket, m: Member, cap: int, budget: int, concat: bool) -> str | None:
    """Why ``m`` cannot join ``b``, or None: the byte cap, the memory budget, the dependency
    rule (``W <= F``) and the lane plan (:func:`lane_segments`), in that order.

    all_to_all sizes differ between ranks (MoE routing gives each rank its own splits), so a byte
    cap would split all_to_all buckets differently on different ranks and hang; all_to_all buckets
    are therefore bounded by structure only, never by ``bucket_cap_mb`` or ``memory_budget_mb``.
    """
    in_bytes = b.in_bytes + m.in_bytes
    if b.key[0] != "all_to_all":
        if in_bytes > cap:
            return f"cap: {in_bytes} input bytes > {cap}"
        held = in_bytes + b.out_bytes + m.out_bytes if concat else b.out_bytes + m.out_bytes
        if held > budget:
            return f"memory: bucket would hold {held} bytes > memory_budget {budget}"
    why = dependency_rejection(b, m)
    if why is not None:
        return why
    last = b.members[-1].segment if b.members else None
    if m.segment is not None and last is not None and m.segment != last:
        return f"lane plan: {m.cut}"
    return None


def dependency_rejection(b: OpenBucket, m: Member) -> str | None:
    """Why ``m`` cannot join ``b`` in this graph whatever the costs, or None: the merged bucket
    must be issued after every member input is ready and after the compute hiding a member,
    and waited before the first use of any member result (``W <= F``, module docstring of
    :mod:`fcoll.passes.rewrites.bucket_plan`)."""
    ready = max(b.ready, m.ready)
    w = wait_index(ready, min(b.wait_idx, m.wait_idx), max(b.last_hide, m.last_hide))
    first_use = min(b.first_use, m.first_use)
    if w > first_use:
        return (f"dependency: issue point (after key {ready}) and hiding compute need the wait "
                f"at node #{w}, after the first use of a member result (node #{first_use})")
    return None


def add(b: OpenBucket, m: Member) -> None:
    """Add ``m`` to ``b`` (after :func:`join_rejection` allowed it)."""
    b.members.append(m)
    b.ready = max(b.ready, m.ready)
    b.wait_idx = min(b.wait_idx, m.wait_idx)
    b.first_use = min(b.first_use, m.first_use)
    b.last_hide = max(b.last_hide, m.last_hide)
    b.in_bytes += m.in_bytes
    b.out_bytes += m.out_bytes


def lane_segments(members: Sequence[Member], cap: int, first_cap: int | None = None) -> None:
    """Plan which timed members of one bucket key share a bucket: sets each member's
    ``segment`` (and ``cut``, why a new one starts at it). Pure; O(n log n) for n members.

    Model (times in estimated compute microseconds from the graph's start, as
    :class:`Member` holds them): member ``k`` is ready at ``r_k`` and first used at ``u_k``;
    the key's collectives run one at a time on one lane; a bucket is issued once its last
    member is ready and the lane is free, and takes ``comm(bytes)``, the cost model's time of
    one collective of the merged size (the alpha-beta curve: merging saves a latency). A wait
    stalls compute until its collective ends and the stall delays all that follows, so a
    schedule's exposed communication is its largest lateness ``F - u`` (``F`` = end of the
    collective), not the sum.

    Members are taken in order of readiness (ties: graph order). Backwards first,
    ``S_k = min(S_{k+1}, u_k) - comm(k)`` (``S_{n+1} = inf``) is the latest the lane may start
    member ``k`` if it and every later member went out alone, each finished before its first
    use and before the next one starts: when the lane must be free for the rest. Then forwards,
    with an open bucket ``B`` (last member ready at ``r_B``, earliest first use ``u_B``, the lane
    free at ``L``), member ``k`` either

    - goes apart: ``B`` ends at ``F_B = max(r_B, L) + comm(B)``, ``k`` at
      ``F_k = max(r_k, F_B) + comm(k)``; lateness ``max(F_B - u_B, F_k - D_k, 0)``;
    - or joins: ``F = max(r_k, L) + comm(B + k)``; lateness ``max(F - min(u_B, D_k), 0)``;

    with ``D_k = min(u_k, S_{k+1})``. ``k`` joins unless that lateness exceeds apart's by more
    than the latency merging saves (``comm(B) + comm(k) - comm(B + k)``: a collective's latency
    is also paid by the ranks that issue and wait it, which lateness does not count), or the
    bucket would pass ``cap`` bytes of input. Both latenesses are first reduced by a margin,
    :data:`MERGE_MARGIN` (10 %) of ``comm(B + k)``, and floored at 0: lateness that small is
    within the model's noise. Without it a decision at the edge of "ends before its first use"
    flipped with 5 % timing changes (train_gpt's DDP step: a join 0 us late at one
    calibration was 22.7 us late with communication x 1.05 and compute x 0.95, past the
    14.9 us merging saved, and a bucket of four split in two). A margin moves the point where
    a decision flips, it cannot remove it; what makes plans repeat is the per-machine
    calibration cache. Each decision is logged at DEBUG with these numbers, the alpha-beta
    in force and where the curve comes from (:func:`fcoll.passes.analysis.comm_cost.describe`).

    What follows: while the lane is busy (communication dominates) members merge, since waiting
    for the lane costs nothing, and a bucket goes out alone as soon as waiting for the next
    member would leave the lane idle longer than the latency merging saves, so the first
    bucket holds only the first gradients ready (PyTorch's reducer makes its first bucket small,
    1 MiB, for the same reason). While compute dominates, buckets grow as long as they still end
    before their first use and before the rest need the lane: a backward with plenty of
    compute gets a few large buckets, issued as their last gradient is ready, and a small last
    one (nothing runs after it to hide it). Every input is the graph's and the cost model's, so
    every rank plans the same segments. ``first_cap``: the first segment's cap instead of
    ``cap`` (PyTorch's reducer's ``first_bucket_bytes``).
    """
    order = sorted(range(len(members)), key=lambda i: (members[i].ready_us, i))
    ms = [members[i] for i in order]
    latest = [math.inf] * (len(ms) + 1)
    for k in range(len(ms) - 1, -1, -1):
        latest[k] = min(latest[k + 1], ms[k].use_us) - (ms[k].comm_us or 0.0)
    segment, lane_free = 0, -math.inf
    first = ms[0] if ms else None
    ready, use, nbytes, in_bytes = 0.0, 0.0, 0, 0
    for k, m in enumerate(ms):
        comm = m.comm_time
        if m is not first:
            due = min(m.use_us, latest[k + 1])
            end_b = max(ready, lane_free) + comm(nbytes)
            end_k = max(m.ready_us, end_b) + m.comm_us
            apart = max(end_b - use, end_k - due, 0.0)
            end = max(m.ready_us, lane_free) + comm(nbytes + m.comm_bytes)
            merged = max(end - min(use, due), 0.0)
            together = comm(nbytes + m.comm_bytes)
            saved = comm(nbytes) + m.comm_us - together
            margin = MERGE_MARGIN * together
            limit = first_cap if segment == 0 and first_cap is not None else cap
            late_merged, late_apart = max(merged - margin, 0.0), max(apart - margin, 0.0)
            split = late_merged > late_apart + saved
            if log.isEnabledFor(logging.DEBUG) and in_bytes + m.in_bytes <= limit:
                log.debug("lane plan: %s %s: merged, its bucket ends %.1f us after it is "
                          "needed, apart %.1f us; less the margin %.1f us (%.0f %% of the "
                          "merged %.1f us): %.1f %s %.1f + %.1f us merging saves (%s)",
                          m.node.name, "starts a bucket" if split else "joins", merged, apart,
                          margin, MERGE_MARGIN * 100, together, late_merged,
                          ">" if split else "<=", late_apart, saved,
                          describe(comm, nbytes + m.comm_bytes))
            if in_bytes + m.in_bytes > limit:
                m.cut = f"cap: {in_bytes + m.in_bytes} input bytes > {limit}"
            elif split:
                m.cut = (f"{m.node.name} would keep its bucket waiting: merged, the lane plan's "
                         f"communication ends {merged:.0f} us after it is needed, apart "
                         f"{apart:.0f} us, more than the {saved:.0f} us of latency merging "
                         f"saves and the {margin:.0f} us margin")
            else:
                ready, use = m.ready_us, min(use, m.use_us)
                nbytes, in_bytes = nbytes + m.comm_bytes, in_bytes + m.in_bytes
                m.segment = segment
                continue
            lane_free, segment = end_b, segment + 1
        ready, use, nbytes, in_bytes = m.ready_us, m.use_us, m.comm_bytes, m.in_bytes
        m.segment = segment
