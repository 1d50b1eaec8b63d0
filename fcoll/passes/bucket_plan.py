"""Bucket planning: which collectives merge, and where each merged collective is issued and waited.

Planning is pure: :func:`plan_buckets` reads a graph and returns frozen :class:`Bucket` records
(member node names, key, bytes, placement); :mod:`fcoll.passes.bucketing` rewrites the graph.

Placement model. Number the graph's nodes ``0 .. N-1`` in graph (topological) order. A collective
``c`` with wait ``w`` may be issued anywhere after its input is ready and waited anywhere before the
first user of ``w``. For a bucket ``B``:

* ``A`` = the latest ready point of any member's inputs; the bucket is issued right after it
  ("where the latest member's input is ready").
* ``W`` = the earliest member wait, moved later only as far as needed: after ``A`` and after every
  compute node the scheduler recorded as hiding a member (``node.meta["fcoll_hiding_nodes"]``), so
  no planned overlap is lost. The bucket waits right before node ``W``.
* ``F`` = the earliest user of any member's wait. The bucket is valid iff ``W <= F``.

Positions are sort keys: original node ``i`` is ``(2i,)``, a bucket's wait group is
``(2W-1, 0, seq)`` (just before node ``W``) and its issue group is ``A + (1, seq)`` (just after
``A``). ``A`` is an original node's key or, when a member consumes the wait of an earlier bucket
directly, that bucket's wait-group key. Every new node sits after everything it reads and before
everything that reads it, so sorting all nodes by key is a topological order: **a plan can never
create a cycle**. In particular collectives that depend on each other (``c2`` reads ``wait(c1)``,
directly or through compute) never share a bucket, because then ``F(c1) <= A``.

Timing rule (buckets and overlap). Merging saves one collective's latency per member, but a
bucket is issued only when its last member is ready and waited when its first result is needed.
So members must become ready, and be first used, within their own estimated communication time
(as separate collectives) of each other, in estimated compute time (the cost model's
:func:`~fcoll.passes.cost.cached_model`, which never communicates; the user's estimator first).
When compute between members is larger, the earlier members go out alone and that compute hides
them; when communication dominates (the lane is busy anyway), members merge up to the cap. A DDP
step whose gradients are all-reduced in parameter order (the first layer first, though it is
ready last) thus gets one bucket per stretch of backward rather than one bucket issued after the
whole backward. Second, a merge must not expose more communication than it saves latency: with
``exposed(B) = max(0, comm(B) - compute between B's last ready member and its first use)``
(alpha-beta ``comm`` of the merged bytes), a member joins only if ``exposed(merged) <=
exposed(bucket) + exposed(member) + (comm(bucket) + comm(member) - comm(merged))``. This keeps
the parameters an FSDP forward needs first out of a large bucket that nothing could hide (the
first layer's all_gather, issued at the start of the graph), and still merges the gradients
ready at the very end of a backward, which are exposed whether merged or not. all_to_all has
no timing rule: its bytes differ between ranks. Nor do groups of fcoll's shared-memory
backend, whose collectives run on the compute's own cores
(:func:`~fcoll.passes.cost.moves_data_on_compute_cores`): there few large buckets win.

Invariant (why ranks agree): every decision reads only the graph (order, shapes, dtypes, groups,
scheduler metadata) and the cost model, whose calibrated numbers are rank 0's on every rank
(defaults before calibration, which happens at the same compile on every rank), never
rank-local state, so every rank that compiled the same graph gets the same buckets and the same
collective order (a user ``estimator`` must keep that promise too). Different orders on
different ranks would hang.

Complexity: one pass over the nodes plus one over the collectives, O(N + E); there is no
reachability query, because graph order already answers "does c2 depend on c1?" for the only
question that matters (can they be issued and waited at a common point). Schemas are read once per
op (:class:`_OpSpec`), not once per node: a node that is not a collective costs one dict lookup.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fcoll.passes.cost import moves_data_on_compute_cores
from fcoll.passes.graph import (
    META_HIDING, args_by_name, collective_info, collective_kind, is_collective, tensor_bytes,
    waits_of,
)
from fcoll.passes.config import FcollConfig

__all__ = ["Bucket", "plan_buckets", "BUCKETABLE_OPS", "MIB"]

log = logging.getLogger(__name__)

#: Bytes per MiB.
MIB = 2**20
#: Op names (either namespace) that bucket_collectives merges.
BUCKETABLE_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                  "all_to_all_single")


@dataclass(frozen=True)
class Bucket:
    """A planned merge of collectives.

    Attributes:
        kind: "all_reduce", "all_gather", "reduce_scatter" or "all_to_all".
        key: the shared :func:`fcoll.passes.graph.bucket_key` (multi-dtype form).
        members: names of the member collective nodes, in graph order.
        dtypes: dtype of each member's input, in member order.
        in_bytes: bytes of all member inputs on this rank.
        out_bytes: bytes of all member outputs on this rank.
        issue_key: sort key of the merged collective (see module docstring).
        wait_key: sort key of the merged wait and the views that replace member waits.
        seq: the bucket's number in the plan.
    """

    kind: str
    key: tuple
    members: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    in_bytes: int
    out_bytes: int
    issue_key: tuple
    wait_key: tuple
    seq: int

    @property
    def held_bytes(self) -> int:
        """Bytes a concat bucket holds while in flight: the concat buffer plus the output."""
        return self.in_bytes + self.out_bytes


@dataclass
class _Member:
    node: fx.Node
    wait: fx.Node         # the member's single wait
    ready: tuple          # sort key after which every input is ready
    wait_idx: int         # index of the member's wait
    first_use: int        # index of the first user of the wait (or of the output node)
    last_hide: int        # index of the last hiding node, -1 if none
    in_bytes: int
    out_bytes: int
    dtype: torch.dtype
    ready_us: float = 0.0   # estimated compute time before the inputs are ready
    use_us: float = 0.0     # estimated compute time before the first use of the result
    comm_us: float | None = None   # estimated time as a separate collective; None: no timing rule
    comm_params: Any = None        # the cost model's CommParams of its kind and group


@dataclass(frozen=True)
class _OpSpec:
    """What planning reads from a collective op's schema, once per op: its name, kind and the
    positions of the arguments that make up the bucket key (None: the op has no such argument)."""

    op: str
    kind: str
    nargs: int
    group_name: int
    group_size: int | None
    reduce_op: int | None
    src: int | None

    @staticmethod
    def of(node: fx.Node) -> "_OpSpec | None":
        """The spec of ``node``'s op, or None if ``node`` is not a collective."""
        if not is_collective(node):
            return None
        schema = node.target._schema
        names = [a.name for a in schema.arguments]
        pos = {k: names.index(k) if k in names else None
               for k in ("group_name", "group_size", "reduce_op", "src")}
        return _OpSpec(op=schema.name.split("::", 1)[-1], kind=collective_kind(node),
                       nargs=len(names), **pos)


@dataclass
class _Open:
    key: tuple
    members: list[_Member] = field(default_factory=list)
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


def _wait_index(ready: tuple, wait_idx: int, last_hide: int) -> int:
    """Smallest node index ``W`` whose wait group ``(2W-1, 0, seq)`` sorts after the issue."""
    after_issue = (ready[0] + 2) // 2
    return max(wait_idx, after_issue, last_hide + 1)


def _static_shape(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in val.shape)


def _rejection(node: fx.Node, spec: _OpSpec, waits: list[fx.Node]) -> str | None:
    """Why ``node`` cannot join any bucket, or None."""
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
        a = args_by_name(node)
        splits = list(a["output_split_sizes"]) + list(a["input_split_sizes"])
        if not all(isinstance(s, int) for s in splits):
            return "all_to_all split sizes are not constants"
    return None


def _member(node: fx.Node, wait: fx.Node, in_bytes: int, out_bytes: int, dtype: torch.dtype,
            idx: dict[fx.Node, int], ready_of, out_idx: int, by_name, timing) -> _Member:
    """``timing``: None (no timing rule for this member), or ``(elapsed, model)`` of
    :func:`_compute_elapsed_us`."""
    ready = max((ready_of(u) for u in node.all_input_nodes), default=(-1,))
    users = [idx[u] for u in wait.users]
    first_use = min(users) if users else out_idx
    hiding = node.meta.get(META_HIDING)
    hides = [by_name()[h] for h in hiding if h in by_name()] if hiding else ()
    m = _Member(node=node, wait=wait, ready=ready, wait_idx=idx[wait], first_use=first_use,
                last_hide=max(hides, default=-1), in_bytes=in_bytes, out_bytes=out_bytes,
                dtype=dtype)
    if timing is None:
        return m
    elapsed, model = timing
    m.ready_us, m.use_us = elapsed[max(ready[0], -1) // 2 + 1], elapsed[first_use]
    m.comm_params = model.comm_params(node)
    m.comm_us = m.comm_params.time_us(max(in_bytes, out_bytes))
    return m


class _Keys:
    """Bucket keys and sizes of collective nodes, from argument positions read once per op.

    Equal to what :func:`fcoll.passes.graph.collective_info` gives (the multi-dtype
    :func:`~fcoll.passes.graph.bucket_key`), at a fraction of the cost. Group sizes of ops that do
    not carry one are looked up once per group name.
    """

    def __init__(self) -> None:
        self.specs: dict[Any, _OpSpec | None] = {}
        self.group_sizes: dict[str, int | None] = {}

    def spec(self, node: fx.Node) -> _OpSpec | None:
        """The op spec of a ``call_function`` node, None for a non-collective (one dict lookup
        once its op was seen)."""
        t = node.target
        try:
            return self.specs[t]
        except KeyError:
            spec = self.specs[t] = _OpSpec.of(node)
            return spec

    def key(self, node: fx.Node, spec: _OpSpec) -> tuple:
        """(kind, group name, group size, reduce op, root) of a node with every argument given
        by position (as :func:`_rejection` requires)."""
        a = node.args
        group_name = str(a[spec.group_name])
        if spec.group_size is not None and a[spec.group_size] is not None:
            group_size = a[spec.group_size]
        else:
            if group_name not in self.group_sizes:
                self.group_sizes[group_name] = collective_info(node).group_size
            group_size = self.group_sizes[group_name]
        return (spec.kind, group_name, group_size,
                a[spec.reduce_op] if spec.reduce_op is not None else None,
                a[spec.src] if spec.src is not None else None)


def _compute_elapsed_us(gm: fx.GraphModule, nodes: list[fx.Node], config: FcollConfig,
                        estimates: dict | None) -> tuple[list[float], Any]:
    """``(elapsed, model)``: ``elapsed[i]`` is the estimated compute microseconds of nodes
    ``0 .. i-1`` (collectives and waits count 0: they run on the communication lane), by the
    cost ``model`` (:func:`~fcoll.passes.cost.cached_model`, which never communicates)."""
    from fcoll.passes.cost import cached_model
    from fcoll.passes.memory import OTHER, op_class

    model = cached_model(gm, config.estimator, estimates)
    elapsed, total = [0.0], 0.0
    for n in nodes:
        if n.op == "call_function" and op_class(n) == OTHER:
            total += model.estimate(n)
        elapsed.append(total)
    return elapsed, model


def plan_buckets(gm: fx.GraphModule, config: FcollConfig | None = None,
                 estimates: dict | None = None, include_moves: bool = False) -> list[Bucket]:
    """Plan buckets for every bucketable collective of ``gm``; the graph is not modified.

    Collectives are visited in graph order; each key ((kind, group, group size, reduce op, root),
    every dtype together) has one open bucket. A collective joins its key's open bucket if the
    merged bucket stays valid (``W <= F``, see the module docstring), its input bytes stay within
    ``config.bucket_cap_mb`` and the memory it holds while in flight (concat buffer + output in
    "concat" mode, output in "coalesced" mode) within ``config.memory_budget_mb``; otherwise that
    bucket is closed and a new one opened; the same happens when the timing rule (module
    docstring) rejects the member. A bucket whose member's wait is read directly by a later
    collective is closed first, so that reader's issue point is known.

    Args:
        gm: a graph with fcoll or ``_c10d_functional`` collectives whose nodes carry
            ``meta["val"]`` (static shapes; others are left alone, logged at DEBUG).
        config: uses ``bucket_cap_mb``, ``bucket_mode``, ``memory_budget_mb`` and
            ``estimator``.
        estimates: the pipeline run's shared compute estimates (``FcollPass.estimates``).
        include_moves: also return one-member buckets ("moves"): the collective goes to its
            issue point, right after its input is ready. With them, every bucketable
            collective is issued in order of readiness (the same order on every rank, as it is
            read from the graph) instead of keeping its traced place: a DDP step traces one
            all_reduce per parameter in parameter order, and the first layer's gradient, ready
            last, would otherwise hold back every gradient traced after it (the scheduler keeps
            the relative order of collectives).

    Returns:
        Buckets of two or more members (and with ``include_moves``, of one), ordered by ``seq``
        (the order they were closed).
    """
    config = config if config is not None else FcollConfig()
    cap = int(config.bucket_cap_mb * MIB)
    budget = int(config.memory_budget_mb * MIB)
    concat = config.bucket_mode == "concat"
    nodes = list(gm.graph.nodes)
    idx = {n: i for i, n in enumerate(nodes)}
    out_idx = len(nodes) - 1
    last_ph = max((idx[n] for n in gm.graph.find_nodes(op="placeholder")), default=0)
    names: dict[str, int] = {}

    def by_name() -> dict[str, int]:   # built on first use: only scheduler metadata needs it
        if not names:
            names.update((n.name, i) for i, n in enumerate(nodes))
        return names

    _on_compute_cores = functools.lru_cache(maxsize=None)(moves_data_on_compute_cores)

    @functools.cache
    def timing() -> tuple[list[float], Any]:   # only when some member has a timing rule
        return _compute_elapsed_us(gm, nodes, config, estimates)
    keys = _Keys()
    buckets: list[Bucket] = []
    wait_ready: dict[fx.Node, tuple] = {}     # member wait of a closed bucket -> its wait key
    open_by_key: dict[tuple, _Open] = {}
    open_of_wait: dict[fx.Node, _Open] = {}   # member wait -> its (still) open bucket

    def ready_of(u: fx.Node) -> tuple:
        if u in wait_ready:
            return wait_ready[u]
        return (2 * (last_ph if u.op == "placeholder" else idx[u]),)

    def close(b: _Open) -> None:
        if open_by_key.get(b.key) is b:
            del open_by_key[b.key]
        for m in b.members:
            open_of_wait.pop(m.wait, None)
        if len(b.members) < (1 if include_moves else 2):
            return
        if len(b.members) == 1 and b.ready >= (2 * idx[b.members[0].node],):
            return   # a move only ever goes earlier (placeholders count as ready at the last one)
        seq = len(buckets)
        w = _wait_index(b.ready, b.wait_idx, b.last_hide)
        bucket = Bucket(
            kind=b.key[0], key=b.key, members=tuple(m.node.name for m in b.members),
            dtypes=tuple(m.dtype for m in b.members), in_bytes=b.in_bytes,
            out_bytes=b.out_bytes, issue_key=b.ready + (1, seq), wait_key=(2 * w - 1, 0, seq),
            seq=seq)
        buckets.append(bucket)
        if len(b.members) == 1:   # a move: its wait stays where it is
            return
        for m in b.members:
            wait_ready[m.wait] = bucket.wait_key
        log.debug("bucket %d: %s %d members %s, %d bytes, issued after key %s, waited before "
                  "node %s", seq, bucket.kind, len(bucket.members), bucket.members,
                  bucket.in_bytes, b.ready, nodes[w])

    for node in nodes:
        spec = keys.spec(node) if node.op == "call_function" else None
        if spec is None:
            continue
        for u in node.all_input_nodes:   # a reader of an open bucket's wait fixes that bucket
            if u in open_of_wait:
                close(open_of_wait[u])
        if spec.op not in BUCKETABLE_OPS:
            log.debug("not bucketing %s: op %s is not bucketed", node.name, spec.op)
            continue
        waits = waits_of(node)
        reason = _rejection(node, spec, waits)
        if reason is not None:
            log.debug("not bucketing %s: %s", node.name, reason)
            continue
        # The multi-dtype form of graph.bucket_key plus the namespace: a merged collective and
        # its wait must come from one op library.
        key = keys.key(node, spec) + (node.target.namespace,)
        val = node.args[0].meta["val"]
        timed = spec.kind != "all_to_all" and not _on_compute_cores(key[1])
        m = _member(node, waits[0], tensor_bytes(val), tensor_bytes(node.meta["val"]), val.dtype,
                    idx, ready_of, out_idx, by_name, timing() if timed else None)
        b = open_by_key.get(key)
        if b is not None:
            why = _join_rejection(b, m, cap, budget, concat)
            if why is not None:
                log.debug("closing bucket of %s before %s: %s",
                          [x.node.name for x in b.members], node.name, why)
                close(b)
                b = None
        if b is None:
            b = open_by_key[key] = _Open(key=key)
        _add(b, m)
        open_of_wait[waits[0]] = b
    for b in sorted(open_by_key.values(), key=lambda o: idx[o.members[0].node]):
        close(b)
    return buckets


def _join_rejection(b: _Open, m: _Member, cap: int, budget: int, concat: bool) -> str | None:
    """Why ``m`` cannot join ``b``, or None.

    all_to_all sizes differ between ranks (MoE routing gives each rank its own splits), so a byte
    cap would split all_to_all buckets differently on different ranks and hang; all_to_all buckets
    are therefore bounded by structure only, never by ``bucket_cap_mb`` or ``memory_budget_mb``.
    """
    in_bytes = b.in_bytes + m.in_bytes
    if b.key[0] == "all_to_all":
        pass
    elif in_bytes > cap:
        return f"cap: {in_bytes} input bytes > {cap}"
    held = in_bytes + b.out_bytes + m.out_bytes if concat else b.out_bytes + m.out_bytes
    if b.key[0] != "all_to_all" and held > budget:
        return f"memory: bucket would hold {held} bytes > memory_budget {budget}"
    ready = max(b.ready, m.ready)
    w = _wait_index(ready, min(b.wait_idx, m.wait_idx), max(b.last_hide, m.last_hide))
    first_use = min(b.first_use, m.first_use)
    if w > first_use:
        return (f"dependency: issue point (after key {ready}) and hiding compute need the wait "
                f"at node #{w}, after the first use of a member result (node #{first_use})")
    if m.comm_us is not None:
        comm_us = b.comm_us + m.comm_us
        ready_spread = max(b.ready_us[1], m.ready_us) - min(b.ready_us[0], m.ready_us)
        use_spread = max(b.use_us[1], m.use_us) - min(b.use_us[0], m.use_us)
        if max(ready_spread, use_spread) > comm_us:
            return (f"timing: members ready {ready_spread:.0f} us and first used "
                    f"{use_spread:.0f} us of compute apart, more than their {comm_us:.0f} us "
                    f"of communication as separate collectives")
        p = m.comm_params
        alone = p.time_us(b.comm_bytes)
        merged = p.time_us(b.comm_bytes + max(m.in_bytes, m.out_bytes))
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


def _add(b: _Open, m: _Member) -> None:
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
