"""A group's bucket plan in a form every rank of the group can apply, and the rules applying it.

A :class:`GroupPlan` names each merged bucket by the indices of its members in the group's
collective sequence (:func:`~fcoll.passes.analysis.fingerprints.collectives_by_group` order: the
sequence ``check_rank_consistency`` fingerprints, the same on every rank). Node names, positions and
timings differ between ranks; those indices do not. :mod:`fcoll.passes.rewrites.shared_plan` passes
one rank's plan to the others; :func:`~fcoll.passes.rewrites.bucket_plan.plan_buckets` (``forced``)
applies it with :class:`ForcedPlans`: members join exactly their planned bucket, each join checked
against this rank's graph (:func:`~fcoll.passes.rewrites.bucket_rules.dependency_rejection`), and
anything this graph cannot follow raises :class:`BucketPlanError`, never a silently
different plan. Leniently (``lenient=True``, :func:`~fcoll.passes.rewrites.bucket_plan.follow_plans`)
a member that cannot join its planned bucket here is left out of it instead, and recorded with
the reason (:attr:`ForcedPlans.dropped`): the shared plan's fallback per collective, which the
ranks of a group then agree on (:mod:`fcoll.passes.rewrites.shared_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch.fx as fx

from fcoll.passes.rewrites.bucket_rules import Member, OpenBucket, dependency_rejection
from fcoll.passes.analysis.fingerprints import collectives_by_group

__all__ = ["BucketPlanError", "GroupPlan", "group_plans", "ForcedPlans", "without"]


class BucketPlanError(RuntimeError):
    """A group's bucket plan cannot be applied to this rank's graph (or is malformed)."""


@dataclass(frozen=True)
class GroupPlan:
    """The merges of one group's collectives, the same on every rank of the group.

    Attributes:
        group: the group's name.
        buckets: each merged bucket (two or more members) as increasing indices into the
            group's collective sequence; a collective in no bucket is issued alone.
        source: where the plan came from, for errors ("the plan of rank 0 ...").
        alone: collectives (increasing indices) that some rank of the group could not put
            in their planned bucket (:mod:`fcoll.passes.rewrites.shared_plan`'s fallback):
            each is issued at its traced place on every rank, no bucket spans it, and every
            later collective of the group is issued after it, so the group's collective
            order is the same on every rank although its readiness differs between ranks.
    """

    group: str
    buckets: tuple[tuple[int, ...], ...]
    source: str = "a given plan"
    alone: tuple[int, ...] = ()


def without(plan: GroupPlan, left_out: Iterable[int]) -> GroupPlan:
    """``plan`` with the collectives ``left_out`` (indices) issued alone (``GroupPlan.alone``):
    each leaves its bucket, a bucket is split where it spans one, and a part of fewer than two
    members is no bucket."""
    alone = tuple(sorted(set(plan.alone) | set(left_out)))
    parts = []
    for b in plan.buckets:
        part: list[int] = []
        for i in b:
            if part and any(part[-1] < a < i for a in alone):
                parts.append(tuple(part))
                part = []
            if i not in alone:
                part.append(i)
        parts.append(tuple(part))
    return GroupPlan(plan.group, tuple(p for p in parts if len(p) > 1), plan.source, alone)


def group_plans(gm: fx.GraphModule, buckets: Sequence[Any]) -> dict[str, GroupPlan]:
    """The merges of ``buckets`` (:class:`~fcoll.passes.rewrites.bucket_plan.Bucket` records planned
    on ``gm``) per group; every group of ``gm`` has an entry, empty when nothing merges."""
    out: dict[str, list[tuple[int, ...]]] = {}
    index: dict[str, int] = {}
    for group, nodes in collectives_by_group(gm).items():
        out[group] = []
        index.update((n.name, i) for i, n in enumerate(nodes))
    for b in buckets:
        if len(b.members) > 1:
            out[b.key[1]].append(tuple(index[m] for m in b.members))
    return {g: GroupPlan(g, tuple(sorted(bs))) for g, bs in out.items()}


class ForcedPlans:
    """The given plans of one planning walk: which planned bucket each member belongs to, and
    what happened to each planned bucket so far. A planned bucket is ``(group, number)``."""

    def __init__(self, gm: fx.GraphModule, plans: Mapping[str, GroupPlan],
                 lenient: bool = False) -> None:
        """Map every member of ``plans`` to its planned bucket.

        Args:
            gm: the graph the plans are applied to.
            plans: group name -> its plan.
            lenient: a member this graph cannot put in its planned bucket leaves it (recorded
                in :attr:`dropped`) instead of raising :class:`BucketPlanError`.

        Raises:
            BucketPlanError: a plan names a collective its group does not have here, one
                twice, or a bucket of fewer than two (also when ``lenient``).
        """
        self.plans = dict(plans)
        self.lenient = lenient
        #: member left out of its planned bucket here -> why (``lenient`` only)
        self.dropped: dict[fx.Node, str] = {}
        #: collective of ``GroupPlan.alone`` -> its group
        self.pinned: dict[fx.Node, str] = {}
        self.seqs = collectives_by_group(gm) if plans else {}
        self.planned: dict[fx.Node, tuple[str, int]] = {}
        self.keys: dict[tuple[str, int], tuple] = {}      # planned bucket -> its bucket key
        self.closed: dict[tuple[str, int], str] = {}      # planned bucket -> why it closed
        for group, plan in self.plans.items():
            nodes = self.seqs.get(group, [])
            for n, members in enumerate(plan.buckets):
                if len(members) < 2 or list(members) != sorted(set(members)) or \
                        not 0 <= members[0] <= members[-1] < len(nodes):
                    raise BucketPlanError(_where(plan) + (
                        f"bucket {list(members)} is not a bucket of this group's "
                        f"{len(nodes)} collectives (increasing indices, at least two)"))
                for i in members:
                    if nodes[i] in self.planned:
                        raise BucketPlanError(_where(plan) + (
                            f"collective #{i} ({nodes[i].name}) is in two buckets"))
                    self.planned[nodes[i]] = (group, n)
            for i in plan.alone:
                if not 0 <= i < len(nodes) or nodes[i] in self.planned:
                    raise BucketPlanError(_where(plan) + (
                        f"collective #{i} to issue alone is not a collective of this group's "
                        f"{len(nodes)} outside the plan's buckets"))
                self.pinned[nodes[i]] = group

    def __contains__(self, group: str) -> bool:
        return group in self.plans

    def bucket_of(self, node: fx.Node) -> tuple[str, int] | None:
        """``node``'s planned bucket here, None when it is issued alone (planned so, or
        dropped)."""
        return self.planned.get(node)

    def not_bucketed(self, node: fx.Node, why: str) -> None:
        """``node`` cannot join any bucket here (``why``).

        Raises:
            BucketPlanError: its plan merges it (not ``lenient``).
        """
        pid = self.planned.get(node)
        if pid is not None:
            self._cannot(pid, node, f"{node.name} cannot be bucketed: {why}")

    def arrive(self, node: fx.Node, key: tuple) -> None:
        """``node`` (bucket key ``key``) is visited.

        Raises:
            BucketPlanError: its planned bucket holds members of another key here, or was
                closed (issued) before ``node`` came (not ``lenient``).
        """
        pid = self.planned.get(node)
        if pid is None:
            return
        first = self.keys.setdefault(pid, key)
        if first != key:
            self._cannot(pid, node, f"{node.name} has bucket key {key[:5]}, another member "
                                    f"{first[:5]}")
        elif pid in self.closed:
            self._cannot(pid, node, f"the bucket is issued before {node.name} comes: "
                                    f"{self.closed[pid]}")

    def rejection(self, b: OpenBucket, m: Member) -> str | None:
        """Why ``m``, planned in some bucket, does not join ``b`` (both of a forced group):
        the plan puts it in another bucket. None: it joins, or it was dropped (``lenient``:
        :meth:`bucket_of` is then None).

        Raises:
            BucketPlanError: the plan puts ``m`` in ``b``, but this graph's dependencies
                forbid it (not ``lenient``).
        """
        pid = self.planned.get(m.node)
        if pid is None or self.planned.get(b.members[0].node) != pid:
            return f"plan: {self.plans[b.key[1]].source} puts {m.node.name} in another bucket"
        why = dependency_rejection(b, m)
        if why is not None:
            self._cannot(pid, m.node, f"{m.node.name} cannot join "
                                      f"{[x.node.name for x in b.members]}: {why}")
        return None

    def _cannot(self, pid: tuple[str, int], node: fx.Node, why: str) -> None:
        """``node`` cannot be in its planned bucket ``pid`` here: raise, or (``lenient``) drop
        it from the plan and record ``why``."""
        if not self.lenient:
            raise self.error(pid, why)
        del self.planned[node]
        self.dropped[node] = why

    def dropped_indices(self) -> dict[str, dict[int, str]]:
        """Group -> index in its collective sequence -> why, of every dropped member."""
        out: dict[str, dict[int, str]] = {}
        for group, nodes in self.seqs.items():
            for i, n in enumerate(nodes):
                if n in self.dropped:
                    out.setdefault(group, {})[i] = self.dropped[n]
        return out

    def close(self, b: OpenBucket, why: str) -> None:
        """``b`` is closed (``why``)."""
        pid = self.planned.get(b.members[0].node)
        if pid is not None:
            self.closed[pid] = why

    def check_complete(self, made: Sequence[Any]) -> None:
        """After the walk: every planned bucket (less its dropped members) is one of ``made``
        (the walk's buckets).

        Raises:
            BucketPlanError: a planned bucket was closed without some of its members.
        """
        names = {b.members for b in made}
        for group, plan in self.plans.items():
            nodes = self.seqs[group]
            for n, members in enumerate(plan.buckets):
                kept = tuple(nodes[i].name for i in members if nodes[i] not in self.dropped)
                if len(kept) > 1 and kept not in names:
                    raise self.error((group, n), "they did not end in one bucket")

    def error(self, pid: tuple[str, int], why: str) -> BucketPlanError:
        """The error for planned bucket ``pid``: rank, group, its collectives and ``why``."""
        plan = self.plans[pid[0]]
        nodes = self.seqs[pid[0]]
        members = ", ".join(f"#{i} {nodes[i].name}" for i in plan.buckets[pid[1]])
        return BucketPlanError(_where(plan) + (
            f"it merges collectives {members}, but here {why}. Every rank of a group applies "
            f"one plan, and this graph orders or connects these collectives differently from "
            f"the graph the plan was made for (rank-dependent code, or another graph with the "
            f"same collectives on this group compiled first). Options: bucket=False, or the "
            f"same code between these collectives on every rank."))


def _where(plan: GroupPlan) -> str:
    """The start of a :class:`BucketPlanError` message: rank, group and plan."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"bucket_collectives: rank {rank}, group {plan.group!r}: cannot apply {plan.source}: "
