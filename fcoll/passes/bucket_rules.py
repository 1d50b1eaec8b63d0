"""The rules of bucket planning: who may be a member, and who may join an open bucket.

Positions and keys are those of :mod:`fcoll.passes.bucket_plan` (its module docstring states
the placement model and the timing rule); these are pure functions of the records below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from fcoll.passes.bucket_key import OpArgs

__all__ = ["Member", "OpenBucket", "wait_index", "rejection", "join_rejection", "add"]


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
        comm_us: estimated microseconds as a separate collective; None: no timing rule.
        comm_time: bytes -> microseconds of one collective of its kind and group.
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
    ready_us: tuple[float, float] = (float("inf"), float("-inf"))   # (min, max) over members
    use_us: tuple[float, float] = (float("inf"), float("-inf"))
    comm_us: float = 0.0    # the members' estimated time as separate collectives
    comm_bytes: int = 0     # sum over members of max(input, output) bytes (timed members)


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
    rule (``W <= F``) and the timing rule, in that order.

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
    ready = max(b.ready, m.ready)
    w = wait_index(ready, min(b.wait_idx, m.wait_idx), max(b.last_hide, m.last_hide))
    first_use = min(b.first_use, m.first_use)
    if w > first_use:
        return (f"dependency: issue point (after key {ready}) and hiding compute need the wait "
                f"at node #{w}, after the first use of a member result (node #{first_use})")
    return _timing_rejection(b, m) if m.comm_us is not None else None


def _timing_rejection(b: OpenBucket, m: Member) -> str | None:
    """The timing rule (module docstring of :mod:`fcoll.passes.bucket_plan`): members ready and
    first used within their communication time of each other, and a merge that exposes no
    more communication than it saves latency."""
    comm_us = b.comm_us + m.comm_us
    ready_spread = max(b.ready_us[1], m.ready_us) - min(b.ready_us[0], m.ready_us)
    use_spread = max(b.use_us[1], m.use_us) - min(b.use_us[0], m.use_us)
    if max(ready_spread, use_spread) > comm_us:
        return (f"timing: members ready {ready_spread:.0f} us and first used "
                f"{use_spread:.0f} us of compute apart, more than their {comm_us:.0f} us "
                f"of communication as separate collectives")
    time_us = m.comm_time
    alone = time_us(b.comm_bytes)
    merged = time_us(b.comm_bytes + max(m.in_bytes, m.out_bytes))
    exposed_merged = _exposed_us(merged, max(b.ready_us[1], m.ready_us),
                                 min(b.use_us[0], m.use_us))
    exposed_apart = (_exposed_us(alone, b.ready_us[1], b.use_us[0])
                     + _exposed_us(m.comm_us, m.ready_us, m.use_us))
    if exposed_merged > exposed_apart + (alone + m.comm_us - merged):
        return (f"exposure: merged, {exposed_merged:.0f} us of communication would not be "
                f"hidden by compute, against {exposed_apart:.0f} us apart, more than the "
                f"{alone + m.comm_us - merged:.0f} us of latency merging saves")
    return None


def _exposed_us(comm_us: float, ready_us: float, use_us: float) -> float:
    """Communication time not covered by the compute between a collective's issue (its inputs
    ready, ``ready_us`` of compute into the graph) and its first use (``use_us``)."""
    return max(0.0, comm_us - (use_us - ready_us))


def add(b: OpenBucket, m: Member) -> None:
    """Add ``m`` to ``b`` (after :func:`join_rejection` allowed it)."""
    b.members.append(m)
    b.ready = max(b.ready, m.ready)
    b.wait_idx = min(b.wait_idx, m.wait_idx)
    b.first_use = min(b.first_use, m.first_use)
    b.last_hide = max(b.last_hide, m.last_hide)
    b.in_bytes += m.in_bytes
    b.out_bytes += m.out_bytes
    b.ready_us = (min(b.ready_us[0], m.ready_us), max(b.ready_us[1], m.ready_us))
    b.use_us = (min(b.use_us[0], m.use_us), max(b.use_us[1], m.use_us))
    if m.comm_us is not None:
        b.comm_us += m.comm_us
        b.comm_bytes += max(m.in_bytes, m.out_bytes)
