"""``check_rank_consistency``: compare each rank's sequence of collectives before running it.

If ranks compile graphs whose collectives differ (order, op, dtype, shape, reduce op, root), the
first run hangs or, worse, returns wrong values silently (gloo reduces float32 against int32 of
equal width without complaint; see NOTES.md). This pass turns that into an error at compile time,
on every rank, naming the first differing collective.

Protocol, per process group ``g`` that the graph uses (in sorted group-name order), in the default
group's store (``c10d._get_default_store()``), keys under ``fcoll/consistency/v2``. Ranks meet on
the *content* of the sequence, never on a count of compiles:

1. Each rank sets ``<g>/seq/<digest>`` (the sequence, zlib-compressed JSON; the same bytes from
   every rank that has it), then ``<g>/has/<digest>/<rank>`` (presence), then
   ``waiting/<rank> = "<g>\\n<digest>\\n<token>"``: what its check now waits for (the token
   is unique to this check).
2. It polls (1 ms, doubling to 20 ms; the store's own waits cannot wait in short slices) until
   every rank of ``g`` has ``<g>/has/<digest>``, and clears ``waiting/<rank>`` when it leaves.
   A recompile on one rank that issues the same collectives finds the peers' keys from their
   first compile and passes at once, without them: no divergence is reported.
3. Between polls, for each rank ``p`` still missing: if ``waiting/p`` names another sequence,
   or the same on another group, that includes this rank and that this rank has not published,
   then ``p`` waits for this rank and this rank waits for ``p``: neither can go on (a rank
   blocked in this check compiles nothing else). This rank writes ``verdict/<p>/<p's token>``
   (``p`` may not look before this rank leaves; the token keeps it from any later check) and
   raises; ``p`` raises on reading it. A ``waiting/p`` that already has a verdict is stale (``p``
   is leaving that check) and is skipped, and so is one read while ``p`` has meanwhile published
   this sequence: ``p`` passed this check and went on to its next one (this rank reads
   ``waiting/p`` first and ``<g>/has/<digest>/<p>`` again after it; ``p`` wrote them in the
   other order). Both raise the same :class:`RankMismatchError`, naming the first differing
   collective, or both groups, within a poll or two of the later arrival.
4. A rank that never publishes this sequence (dead, slow, running something else, or waiting
   behind a longer cycle of three ranks or more) gives :class:`RankTimeoutError` at
   ``config.check_timeout_s``, naming the missing ranks and what they wait for.

Failure modes: a rank that compiled different collectives and went on to run them (it passed an
earlier check of that sequence, or does not check) is only seen at ``check_timeout_s`` by the
others, or at run time by fcoll's backend (header mismatch: the executor's direct path tags
each call with ``<digest>#<index>``, see :mod:`fcoll.compile.direct_calls`). Two graphs with
the same collective sequence share a digest: they are interchangeable to this check, which
compares what the ranks will issue, not where. Keys are never deleted (about 200 bytes per
distinct sequence per rank, for the store's lifetime).

What is compared is each group's :class:`~fcoll.passes.analysis.fingerprints.Fingerprint`
(:mod:`fcoll.passes.analysis.fingerprints`: the entries, their digest, and how data-dependent
sizes are written and left to run time). The pass logs the data-dependent notes at DEBUG and
keeps the report of every group in ``gm.meta[META_RANK_CHECK]`` (:class:`RankCheck`, its
``format()`` is the table).

No-op (logged at DEBUG) without an initialised process group, on PyTorch's fake process group, on
groups of one rank, and on graphs without collectives. Cost when the ranks agree: four ``set``,
one ``delete_key`` and a ``check`` per other rank and poll, per group
(``benchmarks/passes_scaling.py --rank-costs`` prints the time per compile).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from fcoll.passes.analysis.fingerprints import Fingerprint, collectives_by_group, group_fingerprint
from fcoll.passes.registry import FcollPass, register_pass

__all__ = ["CheckRankConsistency", "RankMismatchError", "RankTimeoutError",
           "compare_across_ranks", "RankCheck", "META_RANK_CHECK", "skip_reason",
           "waiting_for"]

#: graph_module.meta key: group name -> :class:`RankCheck`, written by the pass.
META_RANK_CHECK = "fcoll_rank_check"

log = logging.getLogger(__name__)

_PREFIX = "fcoll/consistency/v2"
_FIRST_POLL_S = 0.001   # first pause between looks at the store, doubling ...
_MAX_POLL_S = 0.02      # ... up to this: the most a check waits after the last rank arrives


class RankMismatchError(RuntimeError):
    """Ranks compiled different collective sequences for one group."""


class RankTimeoutError(RuntimeError):
    """Some ranks of a group never published their fingerprint within the timeout."""


@dataclass(frozen=True)
class RankCheck:
    """What the check did for one group of one graph (``gm.meta[META_RANK_CHECK][group]``).

    Attributes:
        fingerprint: the group's
            :class:`~fcoll.passes.analysis.fingerprints.Fingerprint` on this rank.
        outcome: "agreed on N ranks", or "skipped: <reason>" (fake process group, ...).
    """

    fingerprint: Fingerprint
    outcome: str

    def format(self) -> str:
        """The report as a table: one row per collective, data-dependent sizes marked."""
        fp = self.fingerprint
        notes = dict(fp.data_dependent)
        lines = [f"group {fp.group_name!r}: {len(fp.entries)} collectives, {self.outcome}"]
        for i, entry in enumerate(fp.entries):
            row = f"  #{i:<3} {entry}"
            if i in notes:
                row += (f"  [data-dependent, not compared at compile time: {notes[i]}]")
            lines.append(row)
        return "\n".join(lines)


def _skip_reason(group_name: str) -> tuple[str | None, dist.ProcessGroup | None]:
    if not dist.is_available() or not dist.is_initialized():
        return "no process group is initialised", None
    import torch.distributed.distributed_c10d as c10d

    try:
        pg = c10d._resolve_process_group(group_name)
    except Exception as e:  # noqa: BLE001  unknown name: cannot check, say why
        return f"group {group_name!r} cannot be resolved ({e})", None
    if dist.get_backend(pg) == "fake":
        return "fake process group", pg
    if pg.size() == 1:
        return "group of one rank", pg
    return None, pg


def skip_reason(group_name: str) -> str | None:
    """Why ranks of the group called ``group_name`` need not (or cannot) agree on anything,
    or None: no process group initialised, an unknown name, a fake group, a group of one rank.
    Read from the process group only, so the same on every rank of the group."""
    return _skip_reason(group_name)[0]



def waiting_for(store: dist.Store, rank: int) -> tuple[str, str] | None:
    """``(group name, sequence digest)`` that global rank ``rank`` waits for in
    :func:`check_rank_consistency` now, or None (it waits for nothing). Never blocks."""
    w = _Wait.parse(_get(store, _waiting_key(rank)) or "")
    return (w.group, w.digest) if w is not None else None


def compare_across_ranks(fp: Fingerprint, pg: dist.ProcessGroup, timeout_s: float,
                         store: dist.Store | None = None) -> str:
    """Publish ``fp`` and wait until every rank of ``pg`` has published the same sequence.

    The protocol is in the module docstring: ranks meet on the sequence's digest, not on a
    compile count, so a recompile that issues the same collectives on one rank meets the
    peers' earlier publication at once.

    Args:
        fp: this rank's fingerprint for ``pg``.
        pg: the group; its ranks are compared.
        timeout_s: the most seconds to wait for the other ranks, in total.
        store: where to meet (default: the default group's store).

    Returns:
        The digest the ranks agreed on.

    Raises:
        RankMismatchError: a rank of ``pg`` waits for a different sequence (or the same one
            on another group) that this rank has not published: neither can go on. Raised on
            every rank of the pair, naming the first differing collective.
        RankTimeoutError: some ranks did not publish the sequence within ``timeout_s`` (named,
            with what they wait for, if anything).
    """
    import torch.distributed.distributed_c10d as c10d

    store = store if store is not None else c10d._get_default_store()
    rank = dist.get_rank()
    ranks = dist.get_process_group_ranks(pg)
    me = _Wait(fp.group_name, fp.digest, uuid.uuid4().hex)  # the token names this check
    store.set(_seq_key(me), zlib.compress(json.dumps(fp.entries).encode()))
    store.set(_has_key(me, rank), "1")
    store.set(_waiting_key(rank), me.text())  # after has: a reader sees has, then waiting
    try:
        _wait_for_peers(store, me, fp, rank, ranks, timeout_s, pg)
    finally:
        store.set(_waiting_key(rank), "")
    return fp.digest


#: a peer waiting this long in a collective this rank has not issued, while this rank waits in
#: the check, is a divergence (the peers' counters are read at every poll)
AHEAD_S = 0.1


def _backend(pg: Any) -> Any:
    """The backend object of ``pg`` that may answer ``peers_ahead`` / ``abandon`` (fcoll's
    process group is its own backend; a c10d wrapper is asked for its CPU backend)."""
    if hasattr(pg, "peers_ahead"):
        return pg
    try:
        return pg._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001  no such backend: nothing to ask
        return None


def _blocked_ahead(pg: Any, ranks: list[int], since: dict[int, float], now: float) -> list[int]:
    """Global ranks of ``pg`` that have waited at least :data:`AHEAD_S` in a collective of
    ``pg`` this rank has not issued (asked of the backend, where it can tell: fcoll's);
    ``since`` keeps when each was first seen there."""
    probe = getattr(_backend(pg), "peers_ahead", None)
    ahead = {ranks[p] for p in probe()} if probe is not None else set()
    for r in list(since):
        if r not in ahead:
            del since[r]
    for r in ahead:
        since.setdefault(r, now)
    return sorted(r for r, t in since.items() if now - t >= AHEAD_S)


class _Wait(NamedTuple):
    """What one check of a rank waits for: every rank of ``group`` to publish ``digest``;
    ``token`` is unique to that check (a verdict names it, so it never reaches a later one)."""

    group: str
    digest: str
    token: str

    def text(self) -> str:
        return f"{self.group}\n{self.digest}\n{self.token}"

    def same_sequence(self, other: "_Wait") -> bool:
        return (self.group, self.digest) == (other.group, other.digest)

    @classmethod
    def parse(cls, text: bytes | str) -> "_Wait | None":
        parts = (text.decode() if isinstance(text, bytes) else text).split("\n")
        return cls(*parts) if len(parts) == 3 else None


def _seq_key(w: _Wait) -> str:
    return f"{_PREFIX}/{w.group}/seq/{w.digest}"


def _has_key(w: _Wait, rank: int) -> str:
    return f"{_PREFIX}/{w.group}/has/{w.digest}/{rank}"


def _waiting_key(rank: int) -> str:
    return f"{_PREFIX}/waiting/{rank}"


def _verdict_key(rank: int, w: _Wait) -> str:
    return f"{_PREFIX}/verdict/{rank}/{w.token}"


def _get(store: dist.Store, key: str) -> bytes | None:
    """``store.get(key)`` if the key exists (never blocks), else None."""
    return store.get(key) if store.check([key]) else None


def _members(group: str) -> list[int] | None:
    """Global ranks of the group called ``group``, or None where this process cannot tell
    (it is not a member, or the name is unknown here)."""
    import torch.distributed.distributed_c10d as c10d

    try:
        return dist.get_process_group_ranks(c10d._resolve_process_group(group))
    except Exception:  # noqa: BLE001  not a member / unknown name
        return None


def _wait_for_peers(store: dist.Store, me: _Wait, fp: Fingerprint, rank: int,
                    ranks: list[int], timeout_s: float, pg: Any = None) -> None:
    """Poll the store until every rank of ``ranks`` published ``me``; between looks, find a
    deadlock (see :func:`compare_across_ranks`), a peer's verdict on this rank, or a missing
    peer blocked in a collective of ``pg`` that this rank has not issued (it runs this step
    eagerly, or a graph without these collectives: it waits for this rank, which waits here
    for it)."""
    deadline = time.monotonic() + timeout_s
    poll_s = _FIRST_POLL_S
    missing = [r for r in ranks if r != rank]
    ahead_since: dict[int, float] = {}
    while True:
        missing = [r for r in missing if not store.check([_has_key(me, r)])]
        if not missing:
            return
        blocked = [r for r in (_blocked_ahead(pg, ranks, ahead_since, time.monotonic())
                               if pg is not None else []) if r in missing]
        # published meanwhile (it passed this check and went on): not blocked on this rank
        blocked = [r for r in blocked if not store.check([_has_key(me, r)])]
        if blocked:
            err = RankMismatchError(
                f"check_rank_consistency: rank {rank}, group {me.group!r}: ranks {blocked} wait "
                f"in a collective of this group that this rank has not issued, while this rank "
                f"compiles a graph with {len(fp.entries)} collectives on it (sequence "
                f"{me.digest[:12]}) and waits for them to compile the same: they run this step "
                "without these collectives (eagerly, or a graph without them)")
            # they wait in a collective: unlike a mismatch found here, which no rank issued,
            # only a fence gets them out before the group timeout (the group is unusable then)
            abandon = getattr(_backend(pg), "abandon", None)
            if abandon is not None:
                abandon(err, "check_rank_consistency")
            raise err
        verdict = _get(store, _verdict_key(rank, me))
        if verdict is not None:
            peer, _, text = verdict.decode().partition("\n")
            theirs = _Wait.parse(text)
            raise RankMismatchError(_mismatch_message(
                rank, {rank: (me.group, fp.entries), int(peer): (theirs.group,
                                                                 _entries(store, theirs))}))
        for p in missing:
            theirs = _Wait.parse(_get(store, _waiting_key(p)) or "")
            if theirs is None or theirs.same_sequence(me) or \
                    store.check([_has_key(theirs, rank)]):
                continue  # p is not blocked, or not on something this rank could still give
            members = _members(theirs.group)
            if members is None or rank not in members:
                continue  # p does not wait for this rank
            if store.check([_verdict_key(p, theirs)]):
                continue  # p has a verdict on that check (this rank's, from an earlier check
                # that raised): p is about to leave it, so it is stale, not a deadlock
            if store.check([_has_key(me, p)]):
                continue  # p published ``me`` after ``missing`` was read and went on to its
                # next check: not blocked. Read after ``waiting/p``: p sets its ``has`` before
                # any later ``waiting``, so absent here, p waits without having published it.
            # p waits for ``theirs`` from this rank, which waits for ``me`` from p: neither
            # can go on. Tell p (it may not look at this rank's key before this rank leaves).
            store.set(_verdict_key(p, theirs), f"{rank}\n{me.text()}")
            raise RankMismatchError(_mismatch_message(
                rank, {rank: (me.group, fp.entries), p: (theirs.group, _entries(store, theirs))}))
        if time.monotonic() >= deadline:
            waits = {p: _Wait.parse(_get(store, _waiting_key(p)) or "") for p in missing}
            doing = "; ".join(f"rank {p} waits for sequence {w.digest[:12]} on group "
                              f"{w.group!r}" for p, w in waits.items() if w is not None)
            raise RankTimeoutError(
                f"check_rank_consistency: rank {rank}, group {me.group!r} (sequence "
                f"{me.digest[:12]}, {len(fp.entries)} collectives): ranks {missing} did not "
                f"compile a graph with these collectives on this group within {timeout_s:g} s "
                f"(check_timeout_s); they may have diverged, died, or be compiling something "
                f"else{': ' + doing if doing else ''}")
        # Polled: FileStore.wait rounds its timeout up to whole seconds, and a TCPStore wait
        # that times out logs a warning each time, so neither can wait in short slices.
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))
        poll_s = min(poll_s * 2, _MAX_POLL_S)


def _entries(store: dist.Store, w: _Wait) -> tuple[str, ...]:
    raw = _get(store, _seq_key(w))
    return tuple(json.loads(zlib.decompress(raw))) if raw is not None else ("<unknown>",)


def _mismatch_message(rank: int, seqs: dict[int, tuple[str, tuple[str, ...]]]) -> str:
    """The error every rank of a divergent pair raises: ``seqs`` maps rank -> (group, entries);
    the lowest rank is the reference. Symmetric: both ranks build the same text."""
    ref, *others = sorted(seqs)
    g_ref, s_ref = seqs[ref]
    differ = [r for r in others if seqs[r] != seqs[ref]]

    def first_diff(a: tuple[str, ...], b: tuple[str, ...]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    groups = {seqs[r][0] for r in seqs}
    if len(groups) > 1:
        sides = "; ".join(f"rank {r}: group {seqs[r][0]!r}" for r in sorted(seqs))
        return (f"check_rank_consistency: rank {rank}: ranks {differ} compiled collectives on a "
                f"different group than rank {ref} ({sides}; {len(s_ref)} collectives). Running "
                f"this graph would hang until the timeout.")
    i = min(first_diff(s_ref, seqs[r][1]) for r in differ)

    def at(r: int) -> str:
        s = seqs[r][1]
        return s[i] if i < len(s) else f"<none: rank {r} has only {len(s)} collectives>"

    sides = "; ".join(f"rank {r}: {at(r)}" for r in [ref, *differ])
    return (f"check_rank_consistency: rank {rank}, group {g_ref!r}: ranks {differ} compiled a "
            f"different sequence of collectives than rank {ref}; first difference at "
            f"collective #{i}: {sides}. Running this graph would hang or give wrong results.")


@register_pass
class CheckRankConsistency(FcollPass):
    """Compare the fingerprint of each group's collective sequence across that group's ranks.

    The graph is never modified. See the module docstring for the protocol and the no-op cases.

    Raises:
        RankMismatchError: the ranks' sequences differ (raised on every rank).
        RankTimeoutError: a rank did not arrive within ``config.check_timeout_s``.
    """

    name = "check_rank_consistency"

    def ensures(self, graph_module: fx.GraphModule) -> None:
        """Nothing: the pass never modifies the graph, so there is nothing new to check."""

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        if not dist.is_available() or not dist.is_initialized():
            log.debug("check_rank_consistency: skipped: no process group is initialised")
            return PassResult(graph_module, False)
        groups = collectives_by_group(graph_module)
        if not groups:
            log.debug("check_rank_consistency: no collectives, nothing to check")
        report: dict[str, RankCheck] = {}
        for g, nodes in groups.items():
            reason, pg = _skip_reason(g)   # before fingerprinting: skipped groups cost nothing
            if reason is not None:
                log.debug("check_rank_consistency: skipped for group %r: %s", g, reason)
                continue
            fp = group_fingerprint(g, nodes)
            for i, note in fp.data_dependent:
                log.debug("check_rank_consistency: group %r collective #%d %s: data-dependent "
                          "sizes, not compared at compile time: %s", g, i, nodes[i].name, note)
            t0 = time.perf_counter()
            compare_across_ranks(fp, pg, self.config.check_timeout_s)
            log.debug("check_rank_consistency: group %r sequence %s: %d collectives agree on %d "
                      "ranks (%.1f ms)", g, fp.digest[:12], len(fp.entries), pg.size(),
                      (time.perf_counter() - t0) * 1e3)
            report[g] = RankCheck(fp, f"agreed on {pg.size()} ranks")
        graph_module.meta[META_RANK_CHECK] = report
        return PassResult(graph_module, False)
