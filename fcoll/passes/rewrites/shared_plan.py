"""One bucket plan per group: the group's lowest rank plans, every rank of the group applies it.

Why. The lane plan (:mod:`fcoll.passes.rewrites.bucket_plan`) times each rank's own graph: compute
estimates per node, first-use and ready times. Ranks' graphs may legitimately differ while
their collectives agree (fcoll's remap of ``dist.reduce`` copies the result on the destination
only; uneven all_to_all splits change shapes downstream), so a close lane decision can fall
differently on two ranks: different buckets, which ``check_rank_consistency`` reports as a
mismatch of a valid program (the determinism audit: 1 in 1000 random cost settings with the
same communication costs on both ranks). Here the plan is the same on every rank by
construction: one rank makes it, the others apply it.

Protocol, per shared group ``g`` (below), in the default group's store
(``c10d._get_default_store()``, as :mod:`fcoll.passes.rewrites.consistency`):

1. The key is ``fcoll/bucket_plan/v1/<g>/<digest>/<options>``: ``digest`` is the sha256 of the
   group's collective sequence *before* bucketing
   (:func:`~fcoll.passes.analysis.fingerprints.fingerprint`, so every rank that compiled the same
   collectives computes the same key), ``options`` the ones planning reads (``bucket_cap_mb``,
   ``bucket_mode``, ``memory_budget_mb``).
2. The planner is the group's lowest global rank (its group rank 0: c10d sorts a group's
   ranks). Every other rank waits for the key (``store.wait``, at most
   ``config.check_timeout_s``, then :class:`BucketPlanTimeoutError` naming the rank, the group,
   the key and what the planner waits for in ``check_rank_consistency``, if anything) and
   reads it. A rank that plans some of its groups and not others first receives, then plans
   with the received plans forced, then publishes: a rank only ever waits for lower ranks, so
   the waits of a graph's groups never form a cycle.
3. The planner plans and stores its merges with ``compare_set(key, "", plan)``: the first plan
   stored under a key stays (keys are never deleted; a recompile, on one rank or on all, finds
   it). Where the key already held another plan (an earlier compile of the same collectives on
   this group, from another graph), the planner applies the stored one as well. So at every
   compile every rank applies the one plan stored under the key.
4. A plan is rank-independent: each bucket is a list of indices into the group's sequence
   (:class:`~fcoll.passes.rewrites.group_plan.GroupPlan`). Every rank applies it with
   :func:`~fcoll.passes.rewrites.bucket_plan.follow_plans`: exactly those merges, nothing
   timed; where the merged collectives are issued and waited is each rank's own graph's
   business.
5. Fallback per collective, agreed. A rank whose graph cannot put a member in its planned
   bucket (rank-dependent compute that reads a collective's result, so it cannot be hoisted,
   makes the member's input ready only after the first use of another member's result there)
   first hoists the pure compute that prepares collectives' inputs
   (:func:`hoist_input_preparation`) and tries again; what still does not fit it leaves out
   of its bucket, in graph order, with the reason. Every rank then stores its report under
   ``<key>/alone/<round>/<rank>`` (``compare_set``: a recompile reads the first compile's) and
   reads every rank's of the group; the union is issued alone on every rank
   (:func:`~fcoll.passes.rewrites.group_plan.without`: such a collective stays at its traced
   place, no bucket spans it, and every later collective of the group is issued after it, so
   the group's order is the same on every rank although that collective is ready at another
   point on each). The rest of the plan stays. Leaving collectives out only makes buckets
   easier to place, but it changes where the ones after them go, so the ranks report again
   until a round in which no rank of the group leaves anything out (at most one round per
   collective; one round when the plan applies everywhere). Each collective issued alone is
   logged at INFO on every rank with the reporting rank's reason, and listed in
   :attr:`PlanOrigin.alone`. The whole graph is never left unbucketed for it.

Before the exchange, when ``config.check_ranks``, the pass runs ``check_rank_consistency`` on
the unbucketed graph (once; at a group's first compile it does so anyway, before calibrating).
Ranks whose collectives differ would otherwise wait for keys no planner writes, and raise only
at the timeout; the check names the first differing collective at once.

Not shared (each rank plans alone, as before), decided from the process group and the
sequence only, so alike on every rank of a group: no initialised process group, PyTorch's fake
process group, a group of one rank, no default store, and a group whose plan does not depend on
timing (no bucket key with two or more all_reduce, all_gather or reduce_scatter collectives:
only those are timed; all_to_all buckets are bounded by structure alone). fcoll's shared-memory
groups are shared like any other: their lane plan is timed too.

Cost per shared group and compile: the planner one ``compare_set``, every other rank one
``wait`` and one ``get``, both a few hundred bytes (about 10 bytes per merged collective); the
other ranks also wait for the planner to plan. Then per round (one, unless some rank leaves a
collective out) every rank one ``compare_set``, one ``wait`` and one ``get`` per rank of the
group: the planner now also waits until every rank has applied its plan. Plus the
unbucketed rank check where it did not already run. Keys stay for the store's lifetime, one
per distinct sequence and options (and round and rank).

Limits. The plan under a key is the planner's plan of the first graph compiled with those
collectives on that group: a later graph with the same collectives gets it too (the same on
every rank, not necessarily the best for that graph), and so do the reports: a later graph
that must leave out other collectives than the first one's raises ``BucketPlanError``
(options that change the key, or ``bucket=False``, avoid it); so does a group whose ranks
agreed on a round with nothing left out while another group's fallback, later, changes this
graph's placement. A planner that raises before publishing leaves the others to their
timeout; a rank that raises before reporting, the others likewise.

The pass records where each group's plan came from in ``gm.meta[META_BUCKET_PLAN]``
(:class:`PlanOrigin` per group; ``format()`` prints it) and logs it at DEBUG.
"""

from __future__ import annotations

import datetime
import json
import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.fx as fx

from fcoll.passes.analysis import fingerprints
from fcoll.passes.rewrites import consistency
from fcoll.passes.rewrites.bucket_key import BucketKeys
from fcoll.passes.rewrites.bucket_plan import (Bucket, BucketCosts, follow_plans, lane_timed,
                                               plan_buckets)
from fcoll.passes.rewrites.group_plan import BucketPlanError, GroupPlan, group_plans, without
from fcoll.passes.analysis.memory import written_inputs
from fcoll.passes.config import FcollConfig
from fcoll.passes.graph import is_collective, is_wait
from fcoll.passes.rewrites.ordering import apply_order

__all__ = ["agreed_buckets", "PlanOrigin", "BucketPlanTimeoutError", "META_BUCKET_PLAN",
           "plan_key", "hoist_input_preparation", "sink_input_preparation"]

log = logging.getLogger(__name__)

#: graph_module.meta key: group name -> :class:`PlanOrigin`, written by ``bucket_collectives``.
META_BUCKET_PLAN = "fcoll_bucket_plan"

_PREFIX = "fcoll/bucket_plan/v1"


class BucketPlanTimeoutError(BucketPlanError):
    """The group's planner did not publish its bucket plan within ``check_timeout_s``."""


@dataclass(frozen=True)
class PlanOrigin:
    """Where one group's bucket plan came from (``gm.meta[META_BUCKET_PLAN][group]``).

    Attributes:
        group: the group's name.
        source: "local" (planned here alone; ``detail`` says why it is not shared),
            "published" (planned here, the group's planner, and stored under ``detail``, the
            key), "stored" (this rank is the planner, but the key already held another plan,
            from an earlier compile of these collectives: that one applies) or "received"
            (read from ``planner`` under ``detail``, the key).
        detail: see ``source``.
        planner: the global rank whose plan this is (None: local).
        buckets: the merges applied, each as indices into the group's collective sequence.
        alone: (index, why) of each collective the plan merges that every rank of the group
            issues alone, because some rank could not put it in its planned bucket (``why``
            names that rank and its reason; module docstring, step 5).
    """

    group: str
    source: str
    detail: str
    planner: int | None
    buckets: tuple[tuple[int, ...], ...]
    alone: tuple[tuple[int, str], ...] = ()

    def format(self) -> str:
        """One line: group, source, planner and buckets."""
        who = f" from rank {self.planner}" if self.planner is not None else ""
        left = (f"; issued alone: {[i for i, _ in self.alone]}" if self.alone else "")
        return (f"group {self.group!r}: {self.source}{who} ({self.detail}): "
                f"{len(self.buckets)} buckets {[list(b) for b in self.buckets]}{left}")


class _Shared(NamedTuple):
    """A group whose plan is exchanged: its planner (global rank), key and store."""

    group: str
    planner: int
    key: str
    digest: str
    size: int
    store: Any
    ranks: tuple[int, ...] = ()


def plan_key(group: str, digest: str, config: FcollConfig) -> str:
    """The store key of group ``group``'s plan for the unbucketed sequence ``digest`` under
    ``config``'s planning options (module docstring)."""
    return (f"{_PREFIX}/{group}/{digest}/cap={config.bucket_cap_mb!r}/"
            f"mode={config.bucket_mode}/budget={config.memory_budget_mb!r}")


def agreed_buckets(gm: fx.GraphModule, config: FcollConfig, costs: BucketCosts,
                   before_exchange: Callable[[], None]) -> tuple[list[Bucket],
                                                                 dict[str, PlanOrigin]]:
    """Plan ``gm``'s buckets (with moves) so that every rank of each group applies one plan.

    Args:
        gm: the unbucketed graph.
        config: the options (planning options, ``check_timeout_s``).
        costs: the cost facts; ``costs.prepare()`` runs before any exchange, so every rank
            calibrates at the same point.
        before_exchange: called once before the first exchange (the pass's unbucketed rank
            check), not at all when no group is shared.

    Returns:
        The buckets for :func:`~fcoll.passes.rewrites.bucketing.apply_buckets`, and each group's
        :class:`PlanOrigin`.

    Raises:
        BucketPlanTimeoutError: a group's planner did not publish, or a rank did not report
            what it leaves out (step 5), within ``config.check_timeout_s``.
        BucketPlanError: a plan or report is malformed, or the agreed plan still cannot be
            applied here (module docstring, Limits).
    """
    shared: dict[str, _Shared] = {}
    local: dict[str, str] = {}
    for g, nodes in fingerprints.collectives_by_group(gm).items():
        reason = _local_reason(g, nodes)
        if reason is None:
            s, reason = _shared(g, nodes, config)
            if s is not None:
                shared[g] = s
        if reason is not None:
            local[g] = reason
            log.debug("bucket_collectives: group %r plans alone: %s", g, reason)
    if not shared:
        buckets = plan_buckets(gm, config, costs, include_moves=True)
        return buckets, _origins(gm, buckets, local, {})
    before_exchange()
    costs.prepare()
    rank = dist.get_rank()
    forced = {g: _receive(s, rank, config.check_timeout_s)
              for g, s in shared.items() if s.planner != rank}
    sources = {g: "received" for g in forced}
    mine = [g for g, s in shared.items() if s.planner == rank]
    if mine:
        plans = group_plans(gm, follow_plans(gm, config, costs, forced).buckets)
        stored = {g: _publish(shared[g], plans[g]) for g in mine}
        sources.update((g, "published" if stored[g].buckets == plans[g].buckets else "stored")
                       for g in mine)
        forced.update(stored)
    buckets, alone = _settle(gm, config, costs, shared, forced, rank)
    return buckets, _origins(gm, buckets, local, {g: (sources[g], shared[g]) for g in shared},
                             alone)


def _settle(gm: fx.GraphModule, config: FcollConfig, costs: BucketCosts,
            shared: dict[str, _Shared], plans: dict[str, GroupPlan], rank: int
            ) -> tuple[list[Bucket], dict[str, dict[int, str]]]:
    """Apply every shared group's plan, agreeing with the group's ranks on the collectives
    that some rank cannot put in their planned bucket (module docstring, step 5).

    Returns:
        The buckets, and per group the collectives (indices) issued alone on every rank
        although the plan merges them, with the reason of the rank that could not.

    Raises:
        BucketPlanTimeoutError: a rank of a group did not report within ``check_timeout_s``.
        BucketPlanError: this graph cannot apply the agreed plan (a group that settled
            earlier is affected by another group's fallback, or this rank's report stored by
            an earlier compile of the same collectives differs from its own now).
    """
    alone: dict[str, dict[int, str]] = {g: {} for g in shared}
    settling, round_ = set(shared), 0
    while True:
        current = {g: without(p, alone[g]) for g, p in plans.items()}
        followed = follow_plans(gm, config, costs, current)
        if round_ == 0 and followed.dropped and hoist_input_preparation(gm):
            log.debug("bucket_collectives: rank %d: %s; retrying with the collectives' input "
                      "preparation hoisted", rank, _first(followed.dropped))
            followed = follow_plans(gm, config, costs, current)
        late = {g: why for g, why in followed.dropped.items() if g not in settling}
        if late:
            raise _unagreed(rank, late, "the group's ranks had agreed on its plan, and another "
                                        "group's fallback changed this graph's placement")
        for g in sorted(settling):   # every report first, then the waits
            _report(shared[g], round_, rank, {
                i: f"rank {rank}: {why}" for i, why in followed.dropped.get(g, {}).items()})
        changed = False
        for g in sorted(settling):
            new = _reports(shared[g], round_, rank, config.check_timeout_s)
            mine = followed.dropped.get(g, {})
            if not mine.keys() <= new.keys():
                raise _unagreed(rank, {g: {i: w for i, w in mine.items() if i not in new}},
                                "this rank's report stored by an earlier compile of the same "
                                "collectives on this group (another graph) applies")
            if new:
                alone[g].update(new)
                changed = True
            else:
                settling.discard(g)
        if not changed:   # no rank of any group left anything out: this walk is the plan
            return followed.buckets, alone
        round_ += 1


def _unagreed(rank: int, dropped: dict[str, dict[int, str]], why: str) -> BucketPlanError:
    """The error of a rank that cannot apply what its groups agreed on."""
    return BucketPlanError(
        f"bucket_collectives: rank {rank}: cannot apply the agreed bucket plans: "
        f"{_first(dropped)}; {why}. Options: bucket=False, options that change the plan's "
        f"store key, or the same code between these collectives on every rank.")


def _first(dropped: dict[str, dict[int, str]]) -> str:
    """The first dropped collective of ``dropped``, for a message."""
    g = min(dropped)
    i = min(dropped[g])
    return f"group {g!r}, collective #{i}: {dropped[g][i]}"


def _report_key(s: _Shared, round_: int, rank: int) -> str:
    """The store key of ``rank``'s report of round ``round_`` for group ``s.group``."""
    return f"{s.key}/alone/{round_}/{rank}"


def _report(s: _Shared, round_: int, rank: int, mine: dict[int, str]) -> None:
    """Store this rank's report of round ``round_``: the collectives of ``s.group`` (indices)
    it cannot put in their planned bucket, with why. The first report under the key stays
    (a recompile reads the report of the first compile of these collectives)."""
    text = json.dumps({str(i): why for i, why in sorted(mine.items())})
    s.store.compare_set(_report_key(s, round_, rank), "", text)


def _reports(s: _Shared, round_: int, rank: int, timeout_s: float) -> dict[int, str]:
    """Every rank's report of round ``round_`` for group ``s.group``, together: index ->
    the reason of the lowest rank that reported it.

    Raises:
        BucketPlanTimeoutError: a rank did not report within ``timeout_s``.
        BucketPlanError: a stored report is malformed.
    """
    keys = {r: _report_key(s, round_, r) for r in s.ranks}
    try:
        s.store.wait(list(keys.values()), datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001  the store's timeout error differs per store
        missing = [r for r, k in keys.items() if not s.store.check([k])]
        raise BucketPlanTimeoutError(
            f"bucket_collectives: rank {rank}, group {s.group!r}: ranks {missing} did not "
            f"report within {timeout_s:g} s (check_timeout_s) which collectives of the bucket "
            f"plan they must issue alone (round {round_}, sequence {s.digest[:12]}); they "
            f"died, are slow, or compiled other collectives ({type(e).__name__}: {e})") from e
    out: dict[int, str] = {}
    for r in sorted(keys):
        raw = s.store.get(keys[r])
        try:
            report = json.loads(raw)
            got = {int(i): str(why) for i, why in report.items()}
        except (ValueError, AttributeError) as e:
            raise BucketPlanError(f"bucket_collectives: group {s.group!r}: malformed report of "
                                  f"rank {r} under store key {keys[r]!r}: {e}: "
                                  f"{raw[:200]!r}") from e
        for i, why in got.items():
            if not 0 <= i < s.size:
                raise BucketPlanError(f"bucket_collectives: group {s.group!r}: rank {r} "
                                      f"reports collective #{i} of {s.size}")
            out.setdefault(i, why)
    return out


#: Ops that only move, pad or cast data (no arithmetic across elements): what DTensor and
#: FSDP do to a parameter shard before gathering it. Any view op counts too.
_MOVEMENT_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "constant_pad_nd", "clone", "cat", "split_with_sizes", "_to_copy", "narrow", "expand",
    "permute", "squeeze", "unsqueeze")) | {torch.ops.aten.split.Tensor,
                                          torch.ops.aten.slice.Tensor, operator.getitem,
                                          torch.ops.prims.convert_element_type.default}


def _moves_data_only(node: fx.Node) -> bool:
    return node.target in _MOVEMENT_OPS or getattr(node.target, "is_view", False)


def _input_preparation(nodes: list[fx.Node], movement_only: bool) -> set[fx.Node]:
    """The ``call_function`` nodes among ``nodes`` (a graph, in order) that a collective's
    input is made from, computed from graph inputs alone: pure, no collective or wait, and,
    ``movement_only``, only ops that move, pad or cast data (:data:`_MOVEMENT_OPS`, views)."""
    early: set[fx.Node] = set()      # nodes computable from graph inputs alone
    for n in nodes:
        if n.op in ("placeholder", "get_attr"):
            early.add(n)
        elif (n.op == "call_function" and not is_collective(n) and not is_wait(n)
              and not n.is_impure() and all(i in early for i in n.all_input_nodes)
              and (not movement_only or _moves_data_only(n))):
            early.add(n)
    feeding: set[fx.Node] = set()    # of those, the ones a collective's input is made from
    stack = [i for c in nodes if is_collective(c) for i in c.all_input_nodes]
    while stack:
        n = stack.pop()
        if n in early and n.op == "call_function" and n not in feeding:
            feeding.add(n)
            stack.extend(n.all_input_nodes)
    return feeding


def hoist_input_preparation(gm: fx.GraphModule, movement_only: bool = False) -> bool:
    """Move the compute that prepares a collective's input from graph inputs alone (and
    nothing else) to right after the last placeholder, in graph order; True if anything moved.
    ``movement_only``: only such compute made of ops that move, pad or cast data
    (:data:`_MOVEMENT_OPS`, views), for graphs where graph inputs are not just parameters (in
    a backward graph every value is computed from graph inputs).

    Ranks' graphs differ in such compute where their collectives agree: an uneven
    ``Shard(0)`` (a vocabulary of 65 over 2 ranks) is padded before its all_gather on the
    ranks with the short shard only, so there the input is ready only just before the
    collective, while on the planner it is a graph input, ready at the start. A plan that
    merges it with earlier collectives is then valid on the planner and, as placed, not on
    the padding rank, although the padding could run at the start there too. Hoisting it makes
    the input as ready as on the planner. The moved nodes are pure (no collective, wait or
    side effect) and read only placeholders, ``get_attr`` nodes and each other, so values are
    unchanged; the padded copies are made earlier and live until the collective.
    """
    nodes = list(gm.graph.nodes)
    anchor = max((n for n in nodes if n.op == "placeholder"), key=nodes.index, default=None)
    if anchor is None:
        return False
    feeding = _input_preparation(nodes, movement_only)
    moved = False
    for n in nodes:
        if n in feeding:
            if anchor.next is not n:
                anchor.append(n)
                moved = True
            anchor = n
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


def sink_input_preparation(gm: fx.GraphModule) -> bool:
    """Undo :func:`hoist_input_preparation` once the collectives are placed: each node that
    prepares a collective's input from graph inputs alone by moving, padding or casting data
    (:func:`_input_preparation` with ``movement_only``) moves to just before its first user;
    True if anything moved.

    Hoisting makes such inputs (an uneven shard's padding, the ``param_dtype`` cast of mixed
    precision) ready at the start on every rank, so that the group's plan applies everywhere;
    after the scheduler has placed the collectives (and the plan is applied), each value need
    only exist from just before its collective or other first user: computed at the start, the
    bf16 copies of a backward's shards were live through it (2.5 MiB of train_gpt's SimpleFSDP
    peak). No collective or wait moves relative to any other node but these, and they read only
    graph inputs and each other, so values are unchanged. A graph that writes any storage (an
    input mutated in place) is left as it is: a moved read could cross the write.
    """
    nodes = list(gm.graph.nodes)
    if any(written_inputs(n) for n in nodes):
        return False
    feeding = _input_preparation(nodes, movement_only=True)
    if not feeding:
        return False
    order: list[fx.Node] = []
    placed: set[fx.Node] = set()

    def place_chain(node: fx.Node) -> None:   # ``node`` after its deferred inputs
        todo = [(node, False)]
        while todo:
            n, inputs_placed = todo.pop()
            if n in placed:
                continue
            if inputs_placed:
                placed.add(n)
                order.append(n)
                continue
            todo.append((n, True))
            todo.extend((i, False) for i in reversed(n.all_input_nodes)
                        if i in feeding and i not in placed)

    for n in nodes:
        if n in feeding:
            continue
        for i in n.all_input_nodes:
            if i in feeding and i not in placed:
                place_chain(i)
        order.append(n)
        placed.add(n)
    if not apply_order(gm.graph, order):
        return False
    gm.graph.lint()
    gm.recompile()
    return True


def _local_reason(group: str, nodes: list[fx.Node]) -> str | None:
    """Why ``group`` plans alone on each rank, or None: read from the process group and the
    collective sequence only (module docstring), so alike on every rank of the group."""
    reason = consistency.skip_reason(group)
    if reason is not None:
        return reason
    keys, counts = BucketKeys(), {}
    for node in nodes:
        spec = keys.op(node)
        if spec is not None and lane_timed(spec):
            key = keys.merge_key(node)
            counts[key] = counts.get(key, 0) + 1
            if counts[key] > 1:
                return None
    return "the plan does not depend on timing (no two timed collectives of one bucket key)"


def _shared(group: str, nodes: list[fx.Node], config: FcollConfig
            ) -> tuple[_Shared | None, str | None]:
    """The exchange record of ``group`` (collectives ``nodes``), or None and why not (no
    default store)."""
    import torch.distributed.distributed_c10d as c10d

    try:
        store = c10d._get_default_store()
    except Exception as e:  # noqa: BLE001  no store: nothing to meet in
        return None, f"no default store ({type(e).__name__}: {e})"
    digest = fingerprints.sequence_digest(group, nodes)
    ranks = dist.get_process_group_ranks(c10d._resolve_process_group(group))
    return _Shared(group, min(ranks), plan_key(group, digest, config), digest, len(nodes),
                   store, tuple(sorted(ranks))), None


def _receive(s: _Shared, rank: int, timeout_s: float) -> GroupPlan:
    """Wait for and read the plan of ``s``'s planner.

    Raises:
        BucketPlanTimeoutError: it did not arrive within ``timeout_s``.
    """
    try:
        s.store.wait([s.key], datetime.timedelta(seconds=timeout_s))
        raw = s.store.get(s.key)
    except Exception as e:  # noqa: BLE001  the store's timeout error differs per store
        raise BucketPlanTimeoutError(
            f"bucket_collectives: rank {rank}, group {s.group!r}: no bucket plan from rank "
            f"{s.planner} (the group's lowest rank, which plans for it) within {timeout_s:g} s "
            f"(check_timeout_s) for the group's {s.size} collectives (sequence "
            f"{s.digest[:12]}, store key {s.key!r}); rank {s.planner} died, is slow, or "
            f"compiled other collectives{_doing(s)} ({type(e).__name__}: {e})") from e
    return _decode(s, raw, f"the plan of rank {s.planner} (the group's lowest rank) for "
                           f"sequence {s.digest[:12]}")


def _doing(s: _Shared) -> str:
    """What the planner waits for in ``check_rank_consistency`` now, if anything."""
    try:
        waiting = consistency.waiting_for(s.store, s.planner)
    except Exception:  # noqa: BLE001  only for the message
        return ""
    if waiting is None:
        return ""
    group, digest = waiting
    return (f"; rank {s.planner} waits in check_rank_consistency for sequence {digest[:12]} "
            f"on group {group!r}")


def _publish(s: _Shared, plan: GroupPlan) -> GroupPlan:
    """Store ``plan`` under ``s.key`` unless a plan is there; return the stored plan."""
    mine = json.dumps([list(b) for b in plan.buckets])
    stored = s.store.compare_set(s.key, "", mine)
    if stored == mine.encode():
        return plan
    return _decode(s, stored, f"the plan stored for sequence {s.digest[:12]} by an earlier "
                              f"compile")


def _decode(s: _Shared, raw: bytes, source: str) -> GroupPlan:
    """The :class:`GroupPlan` stored as ``raw`` under ``s.key``.

    Raises:
        BucketPlanError: ``raw`` is not a list of lists of indices.
    """
    try:
        buckets = json.loads(raw)
        if not isinstance(buckets, list) or not all(
                isinstance(b, list) and all(type(i) is int for i in b) for b in buckets):
            raise ValueError("not a list of lists of indices")
    except ValueError as e:
        raise BucketPlanError(f"bucket_collectives: group {s.group!r}: malformed bucket plan "
                              f"under store key {s.key!r}: {e}: {raw[:200]!r}") from e
    return GroupPlan(s.group, tuple(tuple(b) for b in buckets), source)


def _origins(gm: fx.GraphModule, buckets: list[Bucket], local: dict[str, str],
             shared: dict[str, tuple[str, _Shared]],
             alone: dict[str, dict[int, str]] | None = None) -> dict[str, PlanOrigin]:
    """Each group's :class:`PlanOrigin` (logged at DEBUG), and one INFO line per collective
    that every rank issues alone although the plan merges it."""
    plans = group_plans(gm, buckets)
    seqs = fingerprints.collectives_by_group(gm) if alone else {}
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    out = {}
    for g, plan in plans.items():
        if g in shared:
            source, s = shared[g]
            left = tuple(sorted((alone or {}).get(g, {}).items()))
            out[g] = PlanOrigin(g, source, s.key, s.planner, plan.buckets, left)
            for i, why in left:
                log.info("bucket_collectives: rank %d, group %r: collective #%d (%s here) is "
                         "issued alone on every rank of the group, out of its planned bucket: "
                         "%s", rank, g, i, seqs[g][i].name, why)
        else:
            out[g] = PlanOrigin(g, "local", local.get(g, ""), None, plan.buckets)
        log.debug("bucket_collectives: %s", out[g].format())
    return out
