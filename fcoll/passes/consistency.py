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

import torch.distributed as dist
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from fcoll.passes.graph import collective_info, is_collective
from fcoll.passes.registry import FcollPass, register_pass

__all__ = ["CheckRankConsistency", "Fingerprint", "fingerprint", "RankMismatchError",
           "RankTimeoutError", "compare_across_ranks"]

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
        entries: one readable string per collective, in graph order.
        digest: sha256 hex digest of the entries.
    """

    group_name: str
    entries: tuple[str, ...]
    digest: str


def _entry(node: fx.Node) -> str:
    info = collective_info(node)
    tensors = []
    for dtype, shape in zip(info.dtypes, info.shapes):
        dims = ("*", *shape[1:]) if info.kind == "all_to_all" and shape else shape
        tensors.append(f"{str(dtype).removeprefix('torch.')}[{','.join(map(str, dims))}]")
    extra = [f"reduce_op={info.reduce_op}"] if info.reduce_op is not None else []
    extra += [f"src={info.src}"] if info.src is not None else []
    return f"{info.op}({', '.join(tensors + extra)})"


def fingerprint(gm: fx.GraphModule) -> dict[str, Fingerprint]:
    """Fingerprint of the collectives of ``gm``, per group name (graph order within a group)."""
    return {g: _fingerprint(g, nodes) for g, nodes in _collectives_by_group(gm).items()}


def _fingerprint(group_name: str, nodes: list[fx.Node]) -> Fingerprint:
    entries = tuple(_entry(n) for n in nodes)
    return Fingerprint(group_name, entries, hashlib.sha256("\n".join(entries).encode()).hexdigest())


def _collectives_by_group(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
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
            g = collective_info(node).group_name
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
        groups = _collectives_by_group(graph_module)
        if not groups:
            log.debug("check_rank_consistency: no collectives, nothing to check")
        for g, nodes in groups.items():
            reason, pg = _skip_reason(g)   # before fingerprinting: skipped groups cost nothing
            if reason is not None:
                log.debug("check_rank_consistency: skipped for group %r: %s", g, reason)
                continue
            fp = _fingerprint(g, nodes)
            t0 = time.perf_counter()
            k = compare_across_ranks(fp, pg, self.config.check_timeout_s)
            log.debug("check_rank_consistency: group %r compile #%d: %d collectives agree on %d "
                      "ranks (%.1f ms)", g, k, len(fp.entries), pg.size(),
                      (time.perf_counter() - t0) * 1e3)
        return PassResult(graph_module, False)
