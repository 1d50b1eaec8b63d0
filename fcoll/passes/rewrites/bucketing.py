"""``bucket_collectives``: merge small collectives into buckets of at most ``bucket_cap_mb``.

Small collectives are latency-bound; one collective of the summed size costs one latency instead
of many. The pass buckets all_reduce, all_gather_into_tensor, reduce_scatter_tensor and
all_to_all_single (either namespace, ``fcoll`` or ``_c10d_functional``). PyTorch 2.13's
``torch/_inductor/fx_passes/bucketing.py`` buckets only *adjacent* all_gather, reduce_scatter and
all_reduce calls of one dtype and never all_to_all; here any collectives of one key that can be
issued and waited at a common point may merge (see :mod:`fcoll.passes.rewrites.bucket_plan`).

Modes (each bucket's ``Bucket.mode``: ``config.bucket_mode``, with "auto" resolved by the
planner to "coalesced" for an FSDP block's bucket and "concat" otherwise):

* ``"concat"``: flatten and concatenate the members into one buffer, one collective, then split
  and view back. all_gather and all_to_all move bytes, so members of any dtypes are viewed as
  ``uint8`` and share one collective. all_reduce and reduce_scatter reduce elementwise and need
  one dtype per reduction: a multi-dtype bucket becomes one concatenated collective per dtype,
  issued together and waited together. Shapes per rank (``n`` = group size):

  - all_reduce: members ``[*s_i]`` -> ``cat(flat) [sum numel_i]`` -> split, view ``[*s_i]``;
    the concatenated buffer is reduced in place (``all_reduce_``): nothing else reads it.
  - reduce_scatter: members ``[n*N_i, *]`` -> each viewed ``[n, N_i*prod(*)]``, concatenated on
    dim 1 and flattened, so rank ``r``'s shard holds every member's shard ``r`` -> split, view.
  - all_gather: members flat ``[k_i]`` -> ``[sum k_i]`` -> gathered ``[n, sum k_i]`` -> column
    slices ``[n, k_i]`` copied to ``[n*N_i, *]``. Members of several dtypes are viewed as
    ``uint8`` first (``k_i`` = bytes) and viewed back after the copy.
  - all_to_all: each member's chunk for rank ``r`` (bytes) is placed rank-major, so the merged
    splits are ``sum_i split_i[r] * row_bytes_i``; the received chunks are split per member and
    concatenated back per member.
* ``"coalesced"``: the ``*_coalesced`` op of the kind (all_reduce, all_gather, reduce_scatter)
  with the members' tensors of any dtypes, no copies; one wait per output. all_to_all has no
  coalesced op and uses concat (logged).

Where the bucket goes: the merged collective is issued right after the latest member input is
ready; its wait goes where the earliest member's wait was, moved later only past the issue point
and past compute that the scheduler recorded as hiding a member (``fcoll_hiding_nodes``), so a
bucket never waits before compute that was hiding one of its members. Views replacing each
member's result follow that wait.

Composition with ``reorder_for_overlap``: the default pipeline is ``lower_c10d_functional ->
bucket_collectives -> check_rank_consistency -> reorder_for_overlap``. Bucketing first lets the
scheduler place few large collectives (its cost model sees the merged sizes), and the planner's
lane plan (:mod:`fcoll.passes.rewrites.bucket_plan`) keeps buckets from swallowing the overlap the
scheduler could find: a member joins a bucket only if that ends no communication later past its
first use than issuing them apart. Both read one cost model, and share its compute
estimates within a pipeline run (``FcollPass.estimates``). When bucketing runs
after the scheduler instead, the hiding metadata keeps the planned overlap: a bucket's wait is never
placed before a member's hiding compute, and a member whose hiding compute would force the wait
past the first use of another member's result does not join.

Rank agreement: which collectives merge is decided once per group, by the group's lowest rank,
and applied by every rank of the group (:mod:`fcoll.passes.rewrites.shared_plan`): ranks whose
graphs differ in compute would otherwise time their lanes differently. Where the merged collectives
go reads only the rank's graph, so every rank issues the same buckets in the same order
(:mod:`fcoll.passes.rewrites.bucket_plan` states why orders never differ). A member some rank
cannot put in its planned bucket is issued alone on every rank of the group (agreed through the
store, logged with the reason), never the whole graph left unbucketed.
``gm.meta[META_BUCKET_PLAN]`` says where each group's plan came from.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.infra.pass_base import PassResult

from fcoll.ops.facts import OPS
from fcoll.passes.rewrites.bucket_plan import Bucket, model_costs, plan_buckets
from fcoll.passes.rewrites.node_emitter import NodeEmitter, ShapeValues, flat_view, view_as
from fcoll.passes.rewrites.fsdp_plan import META_NOT_BEFORE, META_WAIT_BY, plan_fsdp
from fcoll.passes.rewrites.output_chains import output_only_chains
from fcoll.passes.rewrites.shared_plan import (META_BUCKET_PLAN, agreed_buckets,
                                               hoist_input_preparation)
from fcoll.passes.graph import META_HIDING, args_by_name, check_topological, waits_of
from fcoll.passes.registry import FcollPass, get_pass, register_pass
from fcoll.passes.config import FcollConfig

__all__ = ["BucketCollectives", "apply_buckets", "plan_buckets", "Bucket", "META_BUCKET",
           "META_BUCKET_PLAN"]

log = logging.getLogger(__name__)

#: node.meta key on a merged collective: names of the collectives it replaced, in order.
META_BUCKET = "fcoll_bucket_members"

aten = torch.ops.aten
#: kind -> its functional coalesced op (the op-facts table's coalesced twins).
_COALESCED = {f.kind: f.name for f in OPS.values()
              if f.coalesced and not f.mutates and f.functional == f.name}


def _ns(node: fx.Node):
    """The op namespace of a collective node (``torch.ops.fcoll`` or ``_c10d_functional``)."""
    return getattr(torch.ops, node.target.namespace)


class _Coalesced(NamedTuple):
    """Issued: one coalesced collective; ``items`` are its per-member ``getitem`` nodes."""

    items: list[fx.Node]


class _Reduction(NamedTuple):
    """Issued: one concatenated all_reduce or reduce_scatter ``coll`` of the members at
    positions ``sel`` (one dtype), over ``n`` ranks (reduce_scatter; 1 for all_reduce)."""

    coll: fx.Node
    sel: list[int]
    n: int


class _Gathered(NamedTuple):
    """Issued: one all_gather ``coll`` of the concatenated members, ``sizes`` elements (or
    bytes) of each member per rank."""

    coll: fx.Node
    sizes: list[int]


class _Exchanged(NamedTuple):
    """Issued: one all_to_all ``coll``; ``pieces[r][i]`` = bytes of member ``i`` received from
    rank ``r``."""

    coll: fx.Node
    pieces: list[list[int]]


class _Rewrite:
    """State of one bucket's rewrite: its issue group emits the collective(s), its wait group the
    wait(s) and the nodes that replace each member's wait."""

    def __init__(self, bucket: Bucket, members: list[fx.Node], mode: str):
        self.bucket = bucket
        self.members = members
        self.waits = [waits_of(m)[0] for m in members]
        self.mode = mode if bucket.kind != "all_to_all" else "concat"
        # byte-movers with members of several dtypes move uint8; one dtype moves that dtype
        self.as_bytes = bucket.kind == "all_to_all" or len(set(bucket.dtypes)) > 1
        # what the wait group needs from the issue group, one record per issued collective
        self.pending: list[_Coalesced | _Reduction | _Gathered | _Exchanged] = []
        self.replacements: list[fx.Node] = []      # one per member, in member order

    # -- issue ---------------------------------------------------------------------------------
    def issue(self, emit: NodeEmitter, inputs: list[fx.Node]) -> None:
        first, ns = self.members[0], _ns(self.members[0])
        extra = first.args[1:]
        if self.mode == "coalesced":
            op = getattr(ns, _COALESCED[self.bucket.kind]).default
            coll = emit(op, inputs, *extra)
            self.pending.append(_Coalesced(emit.getitems(coll, len(inputs))))
            self._tag(coll)
        elif self.bucket.kind in ("all_reduce", "reduce_scatter"):
            for dtype in dict.fromkeys(self.bucket.dtypes):   # per-dtype sub-buckets, in order
                sel = [i for i, d in enumerate(self.bucket.dtypes) if d == dtype]
                self._issue_reduction(emit, ns, extra, inputs, sel)
        elif self.bucket.kind == "all_gather":
            self._issue_all_gather(emit, ns, extra, inputs)
        else:
            self._issue_all_to_all(emit, ns, inputs)

    def _tag(self, coll: fx.Node) -> None:
        coll.meta[META_BUCKET] = list(self.bucket.members)
        if self.bucket.not_before is not None:
            coll.meta[META_NOT_BEFORE] = self.bucket.not_before
        hides = [h for m in self.members for h in m.meta.get(META_HIDING) or ()]
        if hides:
            coll.meta[META_HIDING] = list(dict.fromkeys(hides))

    def _issue_reduction(self, emit, ns, extra, inputs, sel) -> None:
        n = self.bucket.key[2] if self.bucket.kind == "reduce_scatter" else 1
        op = self.members[sel[0]].target
        if self.bucket.kind == "all_reduce":
            flats = [flat_view(emit, inputs[i]) for i in sel]
            buf = flats[0] if len(flats) == 1 else emit(aten.cat.default, flats)
            if len(flats) > 1:
                # The concat buffer is the bucket's own, read by nothing else: reduce it in
                # place, so no output buffer is allocated and first written, as DDP reduces
                # its bucket buffers in place.
                op = ns.all_reduce_.default
        else:
            rows = [emit(aten.reshape.default, inputs[i], [n, -1]) for i in sel]
            cat = rows[0] if len(rows) == 1 else emit(aten.cat.default, rows, 1)
            buf = emit(aten.reshape.default, cat, [-1])
        coll = emit(op, buf, *extra)
        self._tag(coll)
        self.pending.append(_Reduction(coll, sel, n))

    def _issue_all_gather(self, emit, ns, extra, inputs) -> None:
        if self.as_bytes:
            flats = [emit(aten.view.dtype, flat_view(emit, x, dense=True), torch.uint8)
                     for x in inputs]
        else:
            flats = [flat_view(emit, x) for x in inputs]
        buf = emit(aten.cat.default, flats)
        coll = emit(self.members[0].target, buf, *extra)
        self._tag(coll)
        self.pending.append(_Gathered(coll, [f.meta["val"].numel() for f in flats]))

    def _issue_all_to_all(self, emit, ns, inputs) -> None:
        args = [args_by_name(m) for m in self.members]
        n = len(args[0]["input_split_sizes"])
        # bytes per row from the trailing dims: the row count differs between ranks (and may be 0)
        row_bytes = [math.prod(x.meta["val"].shape[1:]) * x.meta["val"].element_size()
                     for x in inputs]
        chunks = []
        for x, a, rb in zip(inputs, args, row_bytes):
            flat = emit(aten.view.dtype, flat_view(emit, x, dense=True), torch.uint8)
            sizes = [s * rb for s in a["input_split_sizes"]]
            chunks.append(emit.getitems(emit(aten.split_with_sizes.default, flat, sizes), n))
        buf = emit(aten.cat.default, [chunks[i][r] for r in range(n) for i in range(len(inputs))])
        in_splits = [sum(a["input_split_sizes"][r] * rb for a, rb in zip(args, row_bytes))
                     for r in range(n)]
        out_splits = [sum(a["output_split_sizes"][r] * rb for a, rb in zip(args, row_bytes))
                      for r in range(n)]
        coll = emit(self.members[0].target, buf, out_splits, in_splits, args[0]["group_name"])
        self._tag(coll)
        pieces = [[a["output_split_sizes"][r] * rb for a, rb in zip(args, row_bytes)]
                  for r in range(n)]
        self.pending.append(_Exchanged(coll, pieces))

    # -- wait ----------------------------------------------------------------------------------
    def wait(self, emit: NodeEmitter) -> None:
        """Emit the wait(s) and one replacement per member (``self.replacements``)."""
        op = _ns(self.members[0]).wait_tensor.default

        def wait(coll: fx.Node) -> fx.Node:
            w = emit(op, coll)
            if self.bucket.wait_by is not None:
                w.meta[META_WAIT_BY] = self.bucket.wait_by
            return w
        out: list[fx.Node | None] = [None] * len(self.members)
        for item in self.pending:
            if isinstance(item, _Coalesced):
                for i, g in enumerate(item.items):
                    out[i] = wait(g)
            elif isinstance(item, _Reduction):
                self._wait_reduction(emit, wait(item.coll), item, out)
            elif isinstance(item, _Gathered):
                self._wait_all_gather(emit, wait(item.coll), item, out)
            else:
                self._wait_all_to_all(emit, wait(item.coll), item, out)
        self.replacements = out

    def _wait_reduction(self, emit: NodeEmitter, w: fx.Node, item: _Reduction, out: list) -> None:
        sizes = [self.members[i].meta["val"].numel() for i in item.sel]
        for i, p in zip(item.sel, self._split(emit, w, sizes, 0)):
            out[i] = view_as(emit, p, self.members[i].meta["val"].shape)

    def _wait_all_gather(self, emit: NodeEmitter, w: fx.Node, item: _Gathered, out: list) -> None:
        """Each member's output from the bucket's ``[n, sum(sizes)]`` result: its column block,
        copied once into a contiguous tensor (the member's own output was contiguous, and the
        graph's later views were traced on those strides). Not ``reshape``: where the member's
        leading dim is ``n`` (one row per rank, e.g. a batch of 1 gathered on its sequence dim)
        the block reshapes without a copy into a tensor with the grid's row stride, and a later
        ``view`` merging that dim fails ("view size is not compatible with input tensor's size
        and stride")."""
        sizes, n = item.sizes, self.bucket.key[2]
        grid = emit(aten.view.default, w, [n, sum(sizes)])
        for i, p in enumerate(self._split(emit, grid, sizes, 1)):
            if len(sizes) > 1:   # a column block of the grid: strided
                p = emit(aten.clone.default, p, memory_format=torch.contiguous_format)
            out[i] = (self._as_member(emit, p, i) if self.as_bytes
                      else view_as(emit, p, self.members[i].meta["val"].shape))

    def _wait_all_to_all(self, emit: NodeEmitter, w: fx.Node, item: _Exchanged, out: list) -> None:
        parts = self._split(emit, w, [s for row in item.pieces for s in row], 0)
        m = len(self.members)
        for i in range(m):
            mine = [parts[r * m + i] for r in range(len(item.pieces))]
            cat = mine[0] if len(mine) == 1 else emit(aten.cat.default, mine)
            out[i] = self._as_member(emit, cat, i)

    @staticmethod
    def _split(emit: NodeEmitter, node: fx.Node, sizes: list[int], dim: int) -> list[fx.Node]:
        if len(sizes) == 1:
            return [node]
        return emit.getitems(emit(aten.split_with_sizes.default, node, sizes, dim), len(sizes))

    def _as_member(self, emit: NodeEmitter, byte_node: fx.Node, i: int) -> fx.Node:
        val = self.members[i].meta["val"]
        typed = emit(aten.view.dtype, byte_node, val.dtype)
        return view_as(emit, typed, val.shape)


def apply_buckets(gm: fx.GraphModule, buckets: list[Bucket],
                  config: FcollConfig | None = None) -> fx.GraphModule:
    """Rewrite ``gm`` in place so that each planned bucket is one collective (or one per dtype).

    New nodes go where the plan's sort keys say (issue group right after the latest member input,
    wait group right before the planned wait node); member collectives and waits are erased after
    every group is inserted, so anchors stay valid while inserting.

    Args:
        gm: the graph :func:`plan_buckets` planned, unchanged since.
        buckets: the plan; a one-member bucket moves its collective to its issue point.
        config: the options (each bucket carries its own mode, ``Bucket.mode``).

    Returns:
        ``gm``, rewritten, checked (:func:`check_topological`) and recompiled.

    Raises:
        KeyError: a member named in the plan is not in the graph (the plan is stale).
    """
    config = config if config is not None else FcollConfig()
    if not buckets:
        return gm
    g = gm.graph
    nodes = list(g.nodes)
    by_name = {n.name: n for n in nodes}
    vals = [by_name[b.members[0]].args[0].meta["val"] for b in buckets]
    fake_vals = ShapeValues(detect_fake_mode(vals) or FakeTensorMode(allow_non_fake_inputs=True))
    moves = {b.seq: by_name[b.members[0]] for b in buckets if len(b.members) == 1}
    for b in buckets:
        if b.seq in moves and b.not_before is not None:
            moves[b.seq].meta[META_NOT_BEFORE] = b.not_before
    rewrites = {b.seq: _Rewrite(b, [by_name[m] for m in b.members], b.mode)
                for b in buckets if b.seq not in moves}
    _insert_groups(g, nodes, buckets, moves, rewrites, fake_vals)
    for rw in rewrites.values():
        for member, wait, new in zip(rw.members, rw.waits, rw.replacements):
            wait.replace_all_uses_with(new)
            g.erase_node(wait)
            g.erase_node(member)
        if rw.mode != rw.bucket.mode:
            log.debug("bucket %d (%s): no coalesced op for %s, used concat", rw.bucket.seq,
                      list(rw.bucket.members), rw.bucket.kind)
    check_topological(g)
    gm.recompile()
    return gm


def _insert_groups(g: fx.Graph, nodes: list[fx.Node], buckets: list[Bucket],
                   moves: dict[int, fx.Node], rewrites: dict[int, _Rewrite],
                   fake_vals: ShapeValues) -> None:
    """Insert every bucket's issue and wait group (and move one-member buckets) in sort-key
    order; groups at one anchor follow each other in that order."""
    replaced: dict[fx.Node, fx.Node] = {}
    groups = sorted([(b.issue_key, b.seq, "issue") for b in buckets]
                    + [(b.wait_key, b.seq, "wait") for b in buckets if b.seq not in moves])
    moved = set(moves.values())
    anchor_now, cursor = None, None
    for key, seq, what in groups:
        # A group goes right after original node key[0] // 2. If that node is a collective that
        # a move took earlier (moves are processed first: a move's key is below its node's),
        # the place is after the last original node before it that is still where it was.
        i = max(key[0], 0) // 2
        while nodes[i] in moved:
            i -= 1
        anchor = nodes[i]
        if anchor is not anchor_now:
            anchor_now, cursor = anchor, anchor
        nxt = cursor.next
        if seq in moves:   # a one-member bucket: the collective itself moves to its issue point
            member = moves[seq]
            if member is not nxt:
                nxt.prepend(member)
            cursor = member
            continue
        rw = rewrites[seq]
        meta = {k: rw.members[0].meta[k] for k in ("stack_trace",) if k in rw.members[0].meta}
        with g.inserting_before(nxt):
            emit = NodeEmitter(g, fake_vals, meta)
            if what == "issue":
                rw.issue(emit, [replaced.get(m.args[0], m.args[0]) for m in rw.members])
            else:
                rw.wait(emit)
                replaced.update(zip(rw.waits, rw.replacements))
        cursor = nxt.prev


def _prepare_fsdp(gm: fx.GraphModule) -> None:
    """Make an FSDP graph's rank-dependent compute (DTensor pads an uneven shard before its
    all_gather and narrows its reduce_scatter's result, on the ranks with fewer rows) leave the
    collectives' issue and wait points where rank 0's are: each gather's input is computed at
    the start (:func:`~fcoll.passes.rewrites.shared_plan.hoist_input_preparation`, which a rank
    that cannot apply a received plan also uses), and every wait that only feeds the output
    moves to the end with its chain (as ``sink_output_waits``). No value changes; the group's
    plan (rank 0's) then applies on every rank."""
    graph = gm.graph
    hoist_input_preparation(gm)
    output = next(iter(graph.find_nodes(op="output")))
    for node in output_only_chains(graph):
        output.prepend(node)
    graph.lint()
    gm.recompile()


@register_pass
class BucketCollectives(FcollPass):
    """Merge collectives into buckets of at most ``config.bucket_cap_mb`` MiB of input.

    The lane plan needs the groups' real numbers: at a group's first compile the pass
    calibrates it (:func:`~fcoll.passes.analysis.calibration.model_for`). Each group's merges are
    its lowest rank's plan on every rank (:mod:`fcoll.passes.rewrites.shared_plan`). Before either
    rendezvous the pass runs ``check_rank_consistency`` on the unbucketed graph (once, unless
    ``config.check_ranks`` is off), since ranks whose graphs differ would hang in a calibration
    or wait for a plan nobody makes; the pipeline's own check, after this pass, still compares
    the bucketed sequences.

    ``ar(g1) -> wait -> ... ar(g2) -> wait -> out`` becomes
    ``cat(g1, g2) -> ar -> ... wait -> split -> out``. See the module docstring for modes and
    placement.

    Raises:
        fcoll.passes.rewrites.consistency.RankMismatchError, RankTimeoutError: the unbucketed rank
            check failed.
        fcoll.passes.rewrites.group_plan.BucketPlanError: a group's plan cannot be applied here.
        fcoll.passes.rewrites.shared_plan.BucketPlanTimeoutError: a group's planner did not publish
            its plan within ``config.check_timeout_s``.
    """

    name = "bucket_collectives"

    def ensures(self, graph_module: fx.GraphModule) -> None:
        """Nothing more: :func:`apply_buckets` already ended with :func:`check_topological`."""

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        checked = []

        def check_ranks() -> None:   # once, before calibrating or exchanging plans
            if self.config.check_ranks and not checked:
                checked.append(True)
                get_pass("check_rank_consistency", self.config)(graph_module)

        if plan_fsdp(graph_module.graph) is not None:
            _prepare_fsdp(graph_module)
        else:
            # a collective's input padded or cast from a graph input on some ranks only (an
            # uneven shard re-gathered in a backward) is ready at the start there too, so
            # collectives issued in order of readiness go out in one order on every rank
            hoist_input_preparation(graph_module, movement_only=True)
        costs = model_costs(graph_module, self.config, self.estimates, check_ranks)
        buckets, origins = agreed_buckets(graph_module, self.config, costs, check_ranks)
        graph_module.meta[META_BUCKET_PLAN] = origins
        merged = [b for b in buckets if len(b.members) > 1]
        if merged:
            log.debug("bucket_collectives: %d buckets from %d collectives", len(merged),
                      sum(len(b.members) for b in merged))
        apply_buckets(graph_module, buckets, self.config)
        return PassResult(graph_module, bool(buckets))
