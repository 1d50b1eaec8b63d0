"""``check_rank_consistency``: compare each rank's sequence of collectives before running it.

If ranks compile graphs whose collectives differ (order, op, dtype, shape, reduce op, root), the
first run hangs or, worse, returns wrong values silently (gloo reduces float32 against int32 of
equal width without complaint; see NOTES.md). This pass turns that into an error at compile time,
on every rank, naming the first differing collective.

Protocol, per process group ``g`` that the graph uses (in sorted group-name order):

1. ``k = store.add("fcoll/consistency/<g>/count/<rank>", 1)``: this process's compile counter for
   ``g``, kept in the store itself (no module state). Ranks that compile the same graphs in the
   same order agree on ``k``.
2. Each rank sets ``.../<g>/<k>/hash/<rank>`` (sha256 of the sequence) and ``.../seq/<rank>``
   (the sequence, zlib-compressed JSON) in the default group's store
   (``c10d._get_default_store()``).
3. Each rank waits for every other rank of ``g`` with ``store.wait`` and one deadline,
   ``config.check_timeout_s``: a rank that never arrives gives an error naming the missing ranks,
   never a hang.
4. If the hashes differ, every rank reads the sequences and raises the same error: the index of
   the first differing collective, each side's entry, and the ranks that differ from the lowest.

The fingerprint entry of a collective is ``op(dtype[shape], ..., reduce_op=, src=, group=)``.
all_to_all inputs keep only their trailing dims: the first dim follows each rank's splits and
legitimately differs (MoE routing).

Data-dependent sizes (unbacked ``SymInt``: split sizes from ``counts.tolist()``, a dim that
follows them) have no value at compile time, so the check cannot compare them and never guards
on them (``int()`` of one raises ``GuardOnDataDependentSymNode``). In the entry such a dim is
``?``: ranks must agree that it is data-dependent, not on its value. Each collective with
data-dependent sizes gets a note in :attr:`Fingerprint.data_dependent` naming them (``output
[u2 + u3, 4], output_split_sizes [u2, u3]``); the pass logs the notes at DEBUG and keeps the
report of every group in ``gm.meta[META_RANK_CHECK]`` (:class:`RankCheck`, its ``format()`` is
the table). Those sizes are compared at run time by fcoll's backend: the first phase of every
collective exchanges each rank's header (shape, split sizes) and raises the same error on every
rank if they disagree (``fcoll/shm/headers.py``); other backends (gloo) do not compare them.

No-op (logged at DEBUG) without an initialised process group, on PyTorch's fake process group, on
groups of one rank, and on graphs without collectives. Cost: one ``add``, two ``set``, one
``wait`` per other rank and one ``multi_get`` per group (``benchmarks/passes_scaling.py
--rank-costs`` prints the time per compile).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.fx.passes.infra.pass_base import PassResult

from fcoll.passes.graph import arg_of, is_collective, op_kind, size_hint
from fcoll.passes.registry import FcollPass, register_pass

__all__ = ["CheckRankConsistency", "Fingerprint", "fingerprint", "collectives_by_group", "RankMismatchError",
           "RankTimeoutError", "compare_across_ranks", "RankCheck", "META_RANK_CHECK"]

#: graph_module.meta key: group name -> :class:`RankCheck`, written by the pass.
META_RANK_CHECK = "fcoll_rank_check"

log = logging.getLogger(__name__)

_PREFIX = "fcoll/consistency"


class RankMismatchError(RuntimeError):
    """Ranks compiled different collective sequences for one group."""


class RankTimeoutError(RuntimeError):
    """Some ranks of a group never published their fingerprint within the timeout."""


@dataclass(frozen=True)
class Fingerprint:
    """The ordered collectives of one group in one graph.

    Attributes:
        group_name: the process group's name.
        entries: one readable string per collective, in graph order (data-dependent dims
            are ``?``).
        digest: sha256 hex digest of the entries.
        data_dependent: ``(index, note)`` per collective with data-dependent sizes, the note
            naming them (``output [u2 + u3, 4], output_split_sizes [u2, u3]``); not part of the
            digest: their values are unknown until run time.
    """

    group_name: str
    entries: tuple[str, ...]
    digest: str
    data_dependent: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class RankCheck:
    """What the check did for one group of one graph (``gm.meta[META_RANK_CHECK][group]``).

    Attributes:
        fingerprint: the group's :class:`Fingerprint` on this rank.
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


def _dim(s: Any, unbacked: list[str]) -> str:
    """One size as the entry shows it: an int, or ``?`` for a data-dependent size (whose
    expression is appended to ``unbacked``); a backed symbolic size is evaluated with its hint
    (ranks that traced different sizes differ)."""
    if isinstance(s, int):
        return str(s)
    if isinstance(s, torch.SymInt) and free_unbacked_symbols(s):
        unbacked.append(str(s))
        return "?"
    return str(size_hint(s))


def _sizes_text(sizes: Any) -> tuple[str, bool]:
    """``[a, b]`` of a shape or split list (symbols as their expressions) and whether any
    element is data-dependent."""
    vals = [v.meta.get("val") if isinstance(v, fx.Node) else v for v in sizes]
    dd = any(isinstance(v, torch.SymInt) and free_unbacked_symbols(v) for v in vals)
    return f"[{', '.join(map(str, vals))}]", dd


def _inputs(node: fx.Node) -> list[Any]:
    first = arg_of(node, "input", None)
    if first is None:
        first = arg_of(node, "inputs", None)
    items = first if isinstance(first, (list, tuple)) else [first]
    return [i.meta.get("val") if isinstance(i, fx.Node) else i for i in items]


def _entry(node: fx.Node) -> tuple[str, str | None]:
    """The fingerprint entry of collective ``node`` and its data-dependent note (or None).

    Sizes are read from ``meta["val"]`` without evaluating a data-dependent one.
    """
    kind = op_kind(node.target)
    op = node.target._schema.name.split("::", 1)[-1]
    tensors, notes = [], []
    for t in (v for v in _inputs(node) if isinstance(v, torch.Tensor)):
        unbacked: list[str] = []
        dims = [_dim(s, unbacked) for s in t.shape]
        if kind == "all_to_all" and dims:
            dims[0] = "*"
        tensors.append(f"{str(t.dtype).removeprefix('torch.')}[{','.join(dims)}]")
        if unbacked:
            notes.append(f"input {_sizes_text(t.shape)[0]}")
    out = node.meta.get("val")
    for t in out if isinstance(out, (list, tuple)) else [out]:
        if isinstance(t, torch.Tensor):
            text, dd = _sizes_text(t.shape)
            if dd:
                notes.append(f"output {text}")
    for name in ("output_split_sizes", "input_split_sizes"):
        splits = arg_of(node, name, None)
        if isinstance(splits, (list, tuple)):
            text, dd = _sizes_text(splits)
            if dd:
                notes.append(f"{name} {text}")
    reduce_op, src = arg_of(node, "reduce_op", None), arg_of(node, "src", None)
    extra = [f"reduce_op={reduce_op}"] if reduce_op is not None else []
    extra += [f"src={src}"] if src is not None else []
    return f"{op}({', '.join(tensors + extra)})", ", ".join(notes) or None


def fingerprint(gm: fx.GraphModule) -> dict[str, Fingerprint]:
    """Fingerprint of the collectives of ``gm``, per group name (graph order within a group)."""
    return {g: _fingerprint(g, nodes) for g, nodes in collectives_by_group(gm).items()}


def _fingerprint(group_name: str, nodes: list[fx.Node]) -> Fingerprint:
    made = [_entry(n) for n in nodes]
    entries = tuple(e for e, _ in made)
    notes = tuple((i, note) for i, (_, note) in enumerate(made) if note is not None)
    return Fingerprint(group_name, entries,
                       hashlib.sha256("\n".join(entries).encode()).hexdigest(), notes)


def collectives_by_group(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Collective nodes per group name, groups sorted by name, nodes in graph order.

    One walk; whether an op is a collective, and where its ``group_name`` argument is, is read
    once per op (a node that is not a collective costs one dict lookup).
    """
    group_arg: dict[Any, int | None] = {}    # op -> position of group_name; absent: not collective
    groups: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        t = node.target
        if t not in group_arg:
            if not is_collective(node):
                group_arg[t] = -1
                continue
            names = [a.name for a in t._schema.arguments]
            group_arg[t] = names.index("group_name") if "group_name" in names else None
        i = group_arg[t]
        if i == -1:
            continue
        if i is not None and not node.kwargs and i < len(node.args):
            g = str(node.args[i])
        else:
            g = str(arg_of(node, "group_name"))
        groups.setdefault(g, []).append(node)
    return dict(sorted(groups.items()))


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


def compare_across_ranks(fp: Fingerprint, pg: dist.ProcessGroup, timeout_s: float,
                         store: dist.Store | None = None) -> int:
    """Publish ``fp`` and compare it with every other rank of ``pg``.

    Args:
        fp: this rank's fingerprint for ``pg``.
        pg: the group; its ranks are compared.
        timeout_s: the most seconds to wait for the other ranks, in total.
        store: where to meet (default: the default group's store).

    Returns:
        The compile counter ``k`` used for the keys.

    Raises:
        RankTimeoutError: some ranks did not publish within ``timeout_s`` (they are named).
        RankMismatchError: the sequences differ (first differing collective and ranks named).
    """
    import torch.distributed.distributed_c10d as c10d

    store = store if store is not None else c10d._get_default_store()
    rank = dist.get_rank()
    ranks = dist.get_process_group_ranks(pg)
    g = fp.group_name
    k = store.add(f"{_PREFIX}/{g}/count/{rank}", 1)
    base = f"{_PREFIX}/{g}/{k}"
    store.set(f"{base}/seq/{rank}", zlib.compress(json.dumps(fp.entries).encode()))
    store.set(f"{base}/hash/{rank}", fp.digest)
    deadline = time.monotonic() + timeout_s
    for r in ranks:
        remaining = deadline - time.monotonic()
        try:
            store.wait([f"{base}/hash/{r}"], datetime.timedelta(seconds=max(remaining, 1e-3)))
        except Exception:  # noqa: BLE001  a store timeout: find every rank still missing
            missing = [x for x in ranks if not store.check([f"{base}/hash/{x}"])]
            raise RankTimeoutError(
                f"check_rank_consistency: rank {rank}, group {g!r} (compile #{k}): ranks "
                f"{missing} did not compile a graph with collectives on this group within "
                f"{timeout_s:g} s (check_timeout_s); they may have diverged or died") from None
    digests = store.multi_get([f"{base}/hash/{r}" for r in ranks])
    if all(d == digests[0] for d in digests):
        return k
    seqs = {r: tuple(json.loads(zlib.decompress(s)))
            for r, s in zip(ranks, store.multi_get([f"{base}/seq/{r}" for r in ranks]))}
    raise RankMismatchError(_mismatch_message(g, k, rank, ranks, seqs))


def _mismatch_message(g: str, k: int, rank: int, ranks: list[int],
                      seqs: dict[int, tuple[str, ...]]) -> str:
    ref = ranks[0]
    differ = [r for r in ranks if seqs[r] != seqs[ref]]

    def first_diff(a: tuple[str, ...], b: tuple[str, ...]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    i = min(first_diff(seqs[ref], seqs[r]) for r in differ)

    def at(r: int) -> str:
        s = seqs[r]
        return s[i] if i < len(s) else f"<none: rank {r} has only {len(s)} collectives>"

    sides = "; ".join(f"rank {r}: {at(r)}" for r in [ref, *differ])
    return (f"check_rank_consistency: rank {rank}, group {g!r} (compile #{k}): ranks {differ} "
            f"compiled a different sequence of collectives than rank {ref}; first difference at "
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
            fp = _fingerprint(g, nodes)
            for i, note in fp.data_dependent:
                log.debug("check_rank_consistency: group %r collective #%d %s: data-dependent "
                          "sizes, not compared at compile time: %s", g, i, nodes[i].name, note)
            t0 = time.perf_counter()
            k = compare_across_ranks(fp, pg, self.config.check_timeout_s)
            log.debug("check_rank_consistency: group %r compile #%d: %d collectives agree on %d "
                      "ranks (%.1f ms)", g, k, len(fp.entries), pg.size(),
                      (time.perf_counter() - t0) * 1e3)
            report[g] = RankCheck(fp, f"agreed on {pg.size()} ranks")
        graph_module.meta[META_RANK_CHECK] = report
        return PassResult(graph_module, False)
