"""Bucket planning: which collectives merge, and where each merged collective is issued and waited.

Planning is pure: :func:`plan_buckets` reads a graph and returns frozen :class:`Bucket` records
(member node names, key, bytes, placement); :mod:`fcoll.passes.rewrites.bucketing` rewrites the
graph.

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

Lane plan (buckets and overlap). Merging saves one collective's latency per member, but a
bucket is issued only when its last member is ready. Before the walk, the timed members of each
key are segmented by :func:`~fcoll.passes.rewrites.bucket_rules.lane_segments`, a model of the key's
communication lane (one collective at a time, each issued once its last member is ready and the
lane is free) in estimated compute time, from the cost model's times of the merged sizes; a
member never joins an open bucket of another segment. A member joins when that does not make
any communication end later past its first use than issuing the bucket and the member apart
(the rule and its consequences are in that function's docstring): while the lane is busy,
members merge; when waiting for the next member would leave the lane idle longer than the
latency merging saves, the bucket goes out, so the first bucket of a communication-bound
backward holds just the first gradients ready, as PyTorch's reducer's small first bucket; with
plenty of compute, buckets grow as long as they still end before they are needed and before
the rest need the lane, and the last one is small. So a DDP backward gets buckets issued as
their last gradient is ready, each hidden by the backward that remains, whether its
all_reduces were traced in order of readiness (compiled autograd's ``python_reducer``) or in
parameter order (the first layer's gradient, ready last, first). The estimates come from the
pass as :class:`BucketCosts` (:func:`model_costs`: the cost model's
:func:`~fcoll.passes.analysis.calibration.cached_model`, which never communicates; the user's
estimator first); the planner itself reads no cost model. all_to_all has no lane plan: its bytes
differ between ranks. The same rule holds for fcoll's shared-memory groups, whose curve is
calibrated like any other (their collectives also take time on the compute's cores; where the cost
model says their communication is cheap, buckets simply grow large).

Invariant (why ranks agree): every decision reads only the graph (order, shapes, dtypes, groups,
scheduler metadata) and the cost model's numbers of the collective's own group: its curves
(the slowest rank's medians, or what its rank 0 already knew) and its compute rates (its rank
0's measurement, sent in the same message), the same on every rank of the group (defaults
before calibration, which happens at the same compile on every rank). Not the model's
``compute``, the rates of the graph's first group, which on a rank of two groups (TP and DP)
may be another process's measurement than on its TP peer
(:meth:`~fcoll.passes.analysis.cost.CostModel.for_group`). Never rank-local state, so every rank
that compiled the same graph gets the same buckets and the same collective order (a user
``estimator`` must keep that promise too). Different orders on different ranks would hang.
Ranks whose graphs differ in compute (rank-dependent code: ``dist.reduce``'s copy on its
destination only, uneven all_to_all sizes downstream) would time their lanes on their own
graphs and could plan differently where a lane decision is close (the determinism audit: 1 in
1000 random cost settings). So ``bucket_collectives`` does not let each rank decide: the
group's lowest rank plans and every rank applies that plan
(:mod:`fcoll.passes.rewrites.shared_plan`), given here as ``forced``
(:class:`~fcoll.passes.rewrites.group_plan.GroupPlan`: buckets as indices into the group's
collective sequence). A forced group is not timed; its members join exactly their planned buckets,
each join still checked against this graph's dependencies, and a plan this graph cannot follow
raises :class:`~fcoll.passes.rewrites.group_plan.BucketPlanError` (:func:`follow_plans` instead
leaves such a member out, for the shared plan's agreed fallback per collective). Issue and wait
points (and moves) are always this graph's own; they never change what is issued. A plan's
collectives issued alone (``GroupPlan.alone``) stay at their traced place, and the group's later
collectives are issued after them (a *barrier*), since they are ready at different points on
different ranks.

Complexity: one pass over the nodes plus one over the collectives, O(N + E); there is no
reachability query, because graph order already answers "does c2 depend on c1?" for the only
question that matters (can they be issued and waited at a common point). Schemas are read once per
op (:class:`~fcoll.passes.rewrites.bucket_key.BucketKeys`), not once per node: a node that is not a
collective costs one dict lookup.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple

import torch
import torch.fx as fx

from fcoll.passes.rewrites.bucket_key import BucketKeys, OpArgs
from fcoll.passes.rewrites.bucket_rules import (
    Member, OpenBucket, add, join_rejection, lane_segments, rejection, wait_index,
)
from fcoll.passes.config import FcollConfig
from fcoll.passes.analysis.memory import OTHER, op_class
from fcoll.passes.graph import (
    META_HIDING, is_collective, is_wait, only_leaves_graph, tensor_bytes, waits_of,
)
from fcoll.passes.rewrites.fsdp_plan import plan_fsdp
from fcoll.passes.rewrites.group_plan import BucketPlanError, ForcedPlans, GroupPlan

__all__ = ["Bucket", "BucketCosts", "model_costs", "plan_buckets", "follow_plans", "Followed",
           "BUCKETABLE_OPS", "MIB", "GroupPlan", "BucketPlanError", "lane_timed"]

log = logging.getLogger(__name__)

#: Bytes per MiB.
MIB = 2**20
#: A lane-planned key whose every member's result only leaves the graph
#: (:func:`~fcoll.passes.graph.only_leaves_graph`: the gradients of a compiled-autograd
#: backward, DDP's python reducer) puts at most 1/OUTPUT_BUCKETS of its bytes (at least 1 MiB)
#: in one bucket, and at most 1 MiB in its first (PyTorch's reducer's first bucket): caps that
#: do not trust the cost model. Nothing in the graph waits for those collectives, so the lane plan's lateness is measured against the
#: end of the graph, and a model that underestimates the link by 2-3x lets one bucket collect
#: most gradients and go out during the last block's backward (the torch-ddp GPT: 22 of 28
#: gradients, 11.3 MiB, issued after 90 % of the backward's compute). With the caps the first
#: bucket goes out with the first MiB of gradients and no bucket waits for more than a quarter
#: of them (and ``reorder_for_overlap`` issues such collectives as soon as they are ready), so
#: communication starts early in the backward whatever the model says; it costs at most
#: OUTPUT_BUCKETS latencies more.
OUTPUT_BUCKETS = 4
#: Op names (either namespace) that bucket_collectives merges.
BUCKETABLE_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                  "all_to_all_single")


def lane_timed(spec: OpArgs) -> bool:
    """Whether the lane plan times collectives of ``spec``'s op: the bucketable ones except
    all_to_all, whose buckets only structure bounds."""
    return spec.op in BUCKETABLE_OPS and spec.kind != "all_to_all"


@dataclass(frozen=True)
class Bucket:
    """A planned merge of collectives.

    Attributes:
        kind: "all_reduce", "all_gather", "reduce_scatter" or "all_to_all".
        key: the shared :func:`fcoll.passes.rewrites.bucket_key.bucket_key` (multi-dtype form) plus
            the op namespace.
        members: names of the member collective nodes, in graph order.
        dtypes: dtype of each member's input, in member order.
        in_bytes: bytes of all member inputs on this rank.
        out_bytes: bytes of all member outputs on this rank.
        issue_key: sort key of the merged collective (see module docstring).
        wait_key: sort key of the merged wait and the views that replace member waits.
        seq: the bucket's number in the plan.
        not_before: FSDP prefetch (:mod:`fcoll.passes.rewrites.fsdp_plan`): the node the merged
            collective is not issued before, by any pass; None: no such bound.
        wait_by: FSDP gradient buckets: the node the merged wait stays before, by any pass.
        mode: how :mod:`fcoll.passes.rewrites.bucketing` issues it, "concat" or "coalesced"
            (``config.bucket_mode``; "auto": coalesced for an FSDP block's bucket).
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
    not_before: str | None = None
    wait_by: str | None = None
    mode: str = "concat"

    @property
    def held_bytes(self) -> int:
        """Bytes a concat bucket holds while in flight: the concat buffer plus the output."""
        return self.in_bytes + self.out_bytes


@dataclass(frozen=True)
class BucketCosts:
    """The cost facts planning needs, gathered by the pass (the planner reads no cost model).

    Attributes:
        compute_us: (node, group name) -> the node's estimated compute microseconds with the
            compute rates of that group, the same on every rank of the group (asked only of
            compute nodes: collectives and waits run on the communication lane; the group is
            the one whose lane is being planned).
        comm_time: collective -> ``bytes -> microseconds`` of one collective of its kind on its
            group, or None: no lane plan for it (only the cap and memory budget bound its
            buckets).
        prepare: builds the cost model now rather than at first use (:func:`model_costs`
            calibrates there at a group's first compile, a collective call), so every rank
            calibrates at the same point even where it times nothing (a forced plan).
    """

    compute_us: Callable[[fx.Node, str], float]
    comm_time: Callable[[fx.Node], Callable[[int], float] | None]
    prepare: Callable[[], None] = lambda: None


def model_costs(gm: fx.GraphModule, config: FcollConfig, estimates: dict | None = None,
                before_calibration: Callable[[], None] | None = None) -> BucketCosts:
    """:class:`BucketCosts` from fcoll's cost model (``config.estimator`` first, ``estimates``
    shared by a pipeline run), built once some member is timed.

    Args:
        before_calibration: None: :func:`~fcoll.passes.analysis.calibration.cached_model`, which
            never communicates (defaults for groups not calibrated yet). Given: where a group of the
            graph is not calibrated yet
            (:func:`~fcoll.passes.analysis.calibration.needs_calibration`, decided per group), this
            is called and then :func:`~fcoll.passes.analysis.calibration.model_for` calibrates the
            graph's groups (a collective call on every rank, at a group's first compile): the pass
            runs the rank check there, so ranks whose graphs differ raise a named error instead of
            hanging in the calibration. Sizing buckets by the defaults (1 GB/s, 50 GFLOP/s) instead
            of the link's and cores' own numbers misjudges which communication hides.
    """
    from fcoll.passes.analysis.calibration import cached_model, model_for, needs_calibration

    @functools.cache
    def model():
        if before_calibration is None or not needs_calibration(gm):
            return cached_model(gm, config.estimator, estimates)
        before_calibration()
        return model_for(gm, config.estimator, estimates,
                         bucket_cap_bytes=int(config.bucket_cap_mb * (1 << 20)))

    @functools.cache
    def group_model(group: str):
        # The group's own rates, not the model's ``compute`` (its first group's): on two ranks
        # of this group those may be two processes' measurements (CostModel.compute).
        return model().for_group(group)

    def compute_us(node: fx.Node, group: str) -> float:
        return group_model(group).estimate(node)

    def comm_time(node: fx.Node) -> Callable[[int], float] | None:
        return model().comm_params(node).time_us

    def prepare() -> None:
        model()

    return BucketCosts(compute_us, comm_time, prepare)


class _Planner:
    """The state of one :func:`plan_buckets` walk: one open bucket per key, positions of the
    graph's nodes, and the buckets closed so far."""

    def __init__(self, gm: fx.GraphModule, config: FcollConfig, costs: BucketCosts,
                 include_moves: bool, forced: ForcedPlans) -> None:
        self.costs = costs
        self.forced = forced
        self.include_moves = include_moves
        self.cap = int(config.bucket_cap_mb * MIB)
        self.budget = int(config.memory_budget_mb * MIB)
        self.mode = config.bucket_mode
        self.nodes = list(gm.graph.nodes)
        self.idx = {n: i for i, n in enumerate(self.nodes)}
        self.last_ph = max((self.idx[n] for n in gm.graph.find_nodes(op="placeholder")),
                           default=0)
        self.keys = BucketKeys()
        self.buckets: list[Bucket] = []
        self.wait_ready: dict[fx.Node, tuple] = {}     # member wait of a closed bucket -> key
        self.open_by_key: dict[tuple, OpenBucket] = {}
        self.open_of_wait: dict[fx.Node, OpenBucket] = {}   # member wait -> its open bucket
        self._names: dict[str, int] = {}
        self._elapsed: dict[str, list[float]] = {}     # group name -> elapsed compute
        self.lanes: dict[fx.Node, Member] = {}        # timed collective -> its lane-plan record
        # group -> sort key of its latest collective issued alone by a forced plan's
        # ``alone``: later collectives of the group are issued after it
        self.barrier: dict[str, tuple] = {}
        # FSDP blocks (fsdp_plan): their segments replace the lane plan's, and prefetch bounds
        # each block's gathers from below
        self.fsdp = plan_fsdp(gm.graph)

    def plan_lanes(self) -> None:
        """Segment the timed members of every key (:func:`lane_segments`) before the walk;
        their positions are the graph's original ones (no bucket is closed yet)."""
        by_key: dict[tuple, list[Member]] = {}
        for node in self.nodes:
            spec = self.keys.op(node) if node.op == "call_function" else None
            if spec is None or not lane_timed(spec):
                continue
            waits = waits_of(node)
            if rejection(node, spec, waits) is not None:
                continue
            key = self.keys.merge_key(node)
            if key[1] in self.forced or (self.fsdp and node in self.fsdp.segment):
                continue   # its group's plan is given, or its block: not timed here
            m = self.member(node, waits[0], key, timed=True)
            if m.comm_us is not None:
                by_key.setdefault(key, []).append(m)
        for members in by_key.values():
            cap, first = self.cap, None
            if all(only_leaves_graph(m.wait) for m in members):   # gradients leaving the graph
                total = sum(m.in_bytes for m in members)
                cap = min(cap, max(MIB, -(-total // OUTPUT_BUCKETS)))
                first = min(cap, MIB)
            lane_segments(members, cap, first)
            self.lanes.update((m.node, m) for m in members)

    def visit(self, node: fx.Node, spec: OpArgs) -> None:
        """Plan collective ``node``: close the buckets whose results it reads, then add it to
        its key's open bucket (closing that first if the node cannot join it)."""
        for u in node.all_input_nodes:   # a reader of an open bucket's wait fixes that bucket
            if u in self.open_of_wait:
                self.close(self.open_of_wait[u], f"{node.name} reads {u.name}")
        if node in self.forced.pinned:   # issued alone where it is; later ones after it
            self.barrier[self.forced.pinned[node]] = (2 * self.idx[node],)
            return
        if spec.op not in BUCKETABLE_OPS:
            log.debug("not bucketing %s: op %s is not bucketed", node.name, spec.op)
            self.forced.not_bucketed(node, f"{spec.op} is never bucketed")
            return
        waits = waits_of(node)
        reason = rejection(node, spec, waits)
        if reason is not None:
            log.debug("not bucketing %s: %s", node.name, reason)
            self.forced.not_bucketed(node, reason)
            return
        key = self.keys.merge_key(node)
        forced = key[1] in self.forced
        m = self.member(node, waits[0], key, timed=lane_timed(spec) and not forced)
        planned = self.lanes.get(node)
        if planned is not None:
            m.segment, m.cut = planned.segment, planned.cut
        if self.fsdp and node in self.fsdp.segment:
            m.segment, m.cut = self.fsdp.segment[node], "FSDP block"
        b = self.open_by_key.get(key)
        if forced:
            self.forced.arrive(node, key)
            why = (self.forced.rejection(b, m)
                   if b is not None and self.forced.bucket_of(node) is not None else None)
            if self.forced.bucket_of(node) is None:
                # planned alone (or dropped, leniently): a bucket of its own, and the key's
                # open bucket stays open for the rest of its planned members
                alone = OpenBucket(key=key)
                add(alone, m)
                self.close(alone, "issued alone")
                return
        else:
            why = (join_rejection(b, m, self.cap, self.budget, self.mode_of(m.node) == "concat")
                   if b is not None else None)
        if why is not None:
            log.debug("closing bucket of %s before %s: %s",
                      [x.node.name for x in b.members], node.name, why)
            self.close(b, why)
            b = None
        if b is None:
            b = self.open_by_key[key] = OpenBucket(key=key)
        add(b, m)
        self.open_of_wait[waits[0]] = b

    def member(self, node: fx.Node, wait: fx.Node, key: tuple, timed: bool) -> Member:
        """``node`` (bucket ``key``) as a :class:`Member`; ``timed``: the lane plan may apply
        to its kind."""
        val, idx = node.args[0].meta["val"], self.idx
        ready = max((self.ready_of(u) for u in node.all_input_nodes), default=(-1,))
        ready = max(ready, self.barrier.get(key[1], (-1,)))
        anchor = self.fsdp.not_before.get(node) if self.fsdp else None
        if anchor is not None:   # prefetch one block ahead, not earlier
            ready = max(ready, (2 * idx[anchor],))
        due = self.fsdp.wait_by.get(node) if self.fsdp else None
        users = [idx[u] for u in wait.users]
        first_use = min(users) if users else len(self.nodes) - 1
        hiding = node.meta.get(META_HIDING)
        hides = [self.by_name()[h] for h in hiding if h in self.by_name()] if hiding else ()
        m = Member(node=node, wait=wait, ready=ready,
                   wait_idx=min(idx[wait], idx[due]) if due is not None else idx[wait],
                   first_use=first_use,
                   last_hide=max(hides, default=-1), in_bytes=tensor_bytes(val),
                   out_bytes=tensor_bytes(node.meta["val"]), dtype=val.dtype)
        comm_time = self.costs.comm_time(node) if timed else None
        if comm_time is not None:
            elapsed = self.elapsed(key[1])
            m.ready_us, m.use_us = elapsed[max(ready[0], -1) // 2 + 1], elapsed[first_use]
            m.comm_time = comm_time
            m.comm_us = comm_time(max(m.in_bytes, m.out_bytes))
        return m

    def ready_of(self, u: fx.Node) -> tuple:
        """Sort key after which ``u``'s value is ready (placeholders: at the last one)."""
        if u in self.wait_ready:
            return self.wait_ready[u]
        return (2 * (self.last_ph if u.op == "placeholder" else self.idx[u]),)

    def by_name(self) -> dict[str, int]:
        """Node name -> index, built on first use (only scheduler metadata needs it)."""
        if not self._names:
            self._names.update((n.name, i) for i, n in enumerate(self.nodes))
        return self._names

    def elapsed(self, group: str) -> list[float]:
        """``elapsed[i]``: estimated compute microseconds of nodes ``0 .. i-1`` with the
        compute rates of ``group`` (collectives and waits count 0: they run on the
        communication lane); built on first use per group."""
        out = self._elapsed.get(group)
        if out is None:
            compute_us, total = self.costs.compute_us, 0.0
            out = self._elapsed[group] = [0.0]
            for n in self.nodes:
                if n.op == "call_function" and op_class(n) == OTHER:
                    total += compute_us(n, group)
                out.append(total)
        return out

    def mode_of(self, node: fx.Node) -> str:
        """How the bucket of collective ``node`` is issued: ``config.bucket_mode``, where
        "auto" is "coalesced" for an FSDP block's collective and "concat" for the others. An
        FSDP block's members share a segment, so a bucket's members share a mode."""
        if self.mode != "auto":
            return self.mode
        return "coalesced" if self.fsdp and node in self.fsdp.segment else "concat"

    def kept(self, i: int, step: int) -> str | None:
        """The name of the node at position ``i``, or, if it is a collective or a wait (which
        bucketing may replace, so a bound naming it would be lost), of the nearest node that is
        neither, stepping by ``step``: -1 for a ``not_before`` bound (issued after an earlier
        node: a weaker bound), +1 for a ``wait_by`` one (waited before a later node: weaker
        too); None if there is none."""
        while 0 <= i < len(self.nodes) and (is_collective(self.nodes[i]) or
                                             is_wait(self.nodes[i])):
            i += step
        return self.nodes[i].name if 0 <= i < len(self.nodes) else None

    def close(self, b: OpenBucket, why: str = "the end of the graph") -> None:
        """Close ``b``: record it as a :class:`Bucket` if it merges, or moves, anything
        (``why`` it closes: for a forced plan's errors)."""
        if self.open_by_key.get(b.key) is b:
            del self.open_by_key[b.key]
        self.forced.close(b, why)
        for m in b.members:
            self.open_of_wait.pop(m.wait, None)
        if len(b.members) < (1 if self.include_moves else 2):
            return
        if len(b.members) == 1 and b.ready >= (2 * self.idx[b.members[0].node],):
            return   # a move only ever goes earlier (placeholders count as ready at the last one)
        seq = len(self.buckets)
        w = wait_index(b.ready, b.wait_idx, b.last_hide)
        anchors = [self.fsdp.not_before[m.node] for m in b.members
                   if self.fsdp and m.node in self.fsdp.not_before]
        bucket = Bucket(
            kind=b.key[0], key=b.key, members=tuple(m.node.name for m in b.members),
            dtypes=tuple(m.dtype for m in b.members), in_bytes=b.in_bytes,
            out_bytes=b.out_bytes, issue_key=b.ready + (1, seq), wait_key=(2 * w - 1, 0, seq),
            seq=seq,
            not_before=self.kept(self.idx[max(anchors, key=self.idx.__getitem__)], -1)
            if anchors else None,
            wait_by=self.kept(w, 1) if any(self.fsdp and m.node in self.fsdp.wait_by
                                           for m in b.members) else None,
            mode=self.mode_of(b.members[0].node))
        self.buckets.append(bucket)
        if len(b.members) == 1:   # a move: its wait stays where it is
            return
        for m in b.members:
            self.wait_ready[m.wait] = bucket.wait_key
        log.debug("bucket %d: %s %d members %s, %d bytes, issued after key %s, waited before "
                  "node %s", seq, bucket.kind, len(bucket.members), bucket.members,
                  bucket.in_bytes, b.ready, self.nodes[w])


def plan_buckets(gm: fx.GraphModule, config: FcollConfig | None = None,
                 costs: BucketCosts | None = None, include_moves: bool = False,
                 forced: Mapping[str, GroupPlan] | None = None) -> list[Bucket]:
    """Plan buckets for every bucketable collective of ``gm``; the graph is not modified.

    Collectives are visited in graph order; each key ((kind, group, group size, reduce op, root),
    every dtype together) has one open bucket. A collective joins its key's open bucket if the
    merged bucket stays valid (``W <= F``, see the module docstring), its input bytes stay within
    ``config.bucket_cap_mb`` and the memory it holds while in flight (concat buffer + output in
    "concat" mode, output in "coalesced" mode) within ``config.memory_budget_mb``; otherwise that
    bucket is closed and a new one opened; the same happens when the lane plan (module
    docstring) put the member in another segment. A bucket whose member's wait is read directly by a later
    collective is closed first, so that reader's issue point is known.

    Args:
        gm: a graph with fcoll or ``_c10d_functional`` collectives whose nodes carry
            ``meta["val"]`` (static shapes; others are left alone, logged at DEBUG).
        config: uses ``bucket_cap_mb``, ``bucket_mode`` and ``memory_budget_mb`` (and, through
            the default ``costs``, ``estimator``).
        costs: the cost facts of the lane plan, from the pass; default :func:`model_costs`.
        include_moves: also return one-member buckets ("moves"): the collective goes to its
            issue point, right after its input is ready. With them, every bucketable
            collective is issued in order of readiness (the same order on every rank, as it is
            read from the graph) instead of keeping its traced place: a DDP step traces one
            all_reduce per parameter in parameter order, and the first layer's gradient, ready
            last, would otherwise hold back every gradient traced after it (the scheduler keeps
            the relative order of collectives).
        forced: group name -> the :class:`~fcoll.passes.rewrites.group_plan.GroupPlan` that group's
            collectives follow instead of being planned here (module docstring); neither the
            cap, the memory budget nor the lane plan is applied to them (the plan's maker
            applied them to the same bytes).

    Returns:
        Buckets of two or more members (and with ``include_moves``, of one), ordered by ``seq``
        (the order they were closed).

    Raises:
        BucketPlanError: a forced plan cannot be applied to ``gm``: it names a collective the
            group lacks, or merges collectives that cannot be bucketed here, have different
            bucket keys here, or whose dependencies here forbid one bucket.
    """
    config = config if config is not None else FcollConfig()
    costs = costs if costs is not None else model_costs(gm, config)
    return _walk(gm, config, costs, include_moves, ForcedPlans(gm, forced or {})).buckets


class Followed(NamedTuple):
    """What :func:`follow_plans` made: the buckets, and per group the collectives (indices
    into its sequence) left out of their planned buckets here, with why."""

    buckets: list[Bucket]
    dropped: dict[str, dict[int, str]]


def follow_plans(gm: fx.GraphModule, config: FcollConfig | None, costs: BucketCosts | None,
                 forced: Mapping[str, GroupPlan]) -> Followed:
    """:func:`plan_buckets` with moves, where a forced plan's member that this graph cannot
    put in its planned bucket (its dependencies forbid it, its bucket was issued before it
    came, it cannot be bucketed here) is issued alone instead of raising; the rest of its
    bucket stays merged. Which members leave is decided in graph order (a member leaves,
    the bucket it could not join stays), so it is the same for every rank with this graph.

    Returns:
        :class:`Followed`; ``dropped`` is empty when every plan applies as given.

    Raises:
        BucketPlanError: a forced plan is malformed (names a collective its group lacks).
    """
    config = config if config is not None else FcollConfig()
    costs = costs if costs is not None else model_costs(gm, config)
    planner = _walk(gm, config, costs, True, ForcedPlans(gm, forced, lenient=True))
    return Followed(planner.buckets, planner.forced.dropped_indices())


def _walk(gm: fx.GraphModule, config: FcollConfig, costs: BucketCosts, include_moves: bool,
          forced: ForcedPlans) -> "_Planner":
    """One planning walk over ``gm`` (see :func:`plan_buckets`); returns the finished walk."""
    planner = _Planner(gm, config, costs, include_moves, forced)
    planner.plan_lanes()
    keys = planner.keys
    for node in planner.nodes:
        spec = keys.op(node) if node.op == "call_function" else None
        if spec is not None:
            planner.visit(node, spec)
    for b in sorted(planner.open_by_key.values(), key=lambda o: planner.idx[o.members[0].node]):
        planner.close(b)
    planner.forced.check_complete(planner.buckets)
    return planner
