"""Time of the default pass pipeline, per pass, on synthetic transformer training graphs of 1k to
100k nodes.

Usage: ``python benchmarks/passes_scaling.py [--nodes 1000 5000 ...] [--reps 3] [--cap-s 60]
[--passes ...] [--rank-costs] [--json passes_scaling.json]``

The graph: a training step of an FSDP transformer, in ``_c10d_functional`` ops as Dynamo and
AOTAutograd emit them (so ``lower_c10d_functional`` has work). Per layer, forward: all_gather of 4
weight shards, then norm, qkv mm, attention-like mm/softmax, output mm, residual, MLP (2 mm, gelu),
residual; backward: the same 4 all_gathers again, the gradient mms, reduce_scatter (avg) of the 4
weight gradients, all_reduce (avg) of 2 small norm-weight gradients. Every op is waited right after
it is issued (as tracing emits it). The graph has the number of layers whose node count is
nearest the size asked for (80 nodes a layer: "50k" is 49,971 nodes; an earlier version added
layers until the size was passed and measured "50k" on 56,307). Nodes carry fake
``meta["val"]`` (hidden 256, 64 tokens, float32).

Timing: ``run_pipeline(gm, FcollConfig())`` on the fake process group, graphs being
``_LazyGraphModule`` as under ``torch.compile`` (``--eager-recompile`` for plain ones); per pass
seconds come from ``gm.meta["fcoll_passes"]``. Each rep runs on a fresh graph after a
``gc.collect()`` (so a rep does not pay for collecting the previous rep's graph). The table shows
the best of ``--reps`` runs (``timeit``'s convention: on a shared machine the least disturbed run
is the most repeatable); the JSON has the medians too. ``check_rank_consistency`` is a no-op on the
fake process group; ``--rank-costs`` measures what the fake group cannot show.

Rank costs (``--rank-costs``): on 2 real ranks of fcoll's backend (``fcoll.testing.run_ranks``,
its FileStore), per rank: the first ``calibrate_group`` of the fcoll world group and of a gloo
subgroup (the cost model's measurements; a collective call), a second, cached call, and the
median of 20 ``check_rank_consistency`` runs on a graph of 4 layers (56 collectives) of the
step below: the check's cost per compile. Printed as a table and written under ``"rank_costs"``.

Time cap: a run longer than ``--cap-s`` seconds is interrupted (``SIGALRM``); that size is reported
as over the cap and larger sizes are skipped (they would only be slower).

Targets: at most 2 s at 50k nodes, and at most 2.3x time per doubling of nodes (reported
as ``growth per doubling = ratio ** (1 / log2(n2 / n1))`` between consecutive measured sizes).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import statistics
import sys
import time

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.node import map_arg

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
HIDDEN, TOKENS, N = 256, 64, 2


class _G:
    """Graph under construction; values computed on the meta device, wrapped as FakeTensors."""

    def __init__(self) -> None:
        self.graph, self.mode, self.meta = fx.Graph(), FakeTensorMode(), {}
        self.count = 0

    def _set(self, node: fx.Node, meta) -> fx.Node:
        self.meta[node] = meta
        node.meta["val"] = FakeTensor(self.mode, meta, torch.device("cpu"))
        self.count += 1
        return node

    def input(self, shape) -> fx.Node:
        return self._set(self.graph.placeholder(f"in{self.count}"),
                         torch.empty(shape, device="meta"))

    def __call__(self, target, *args) -> fx.Node:
        node = self.graph.call_function(target, args)
        return self._set(node, target(*map_arg(args, self.meta.__getitem__)))

    def waited(self, target, *args) -> fx.Node:
        return self(c10d.wait_tensor.default, self(target, *args))


def _layer_forward(g: _G, x: fx.Node, shards: list[fx.Node], group: str) -> fx.Node:
    w = [g.waited(c10d.all_gather_into_tensor.default, s, N, group) for s in shards]
    h = g(aten.mul.Tensor, g(aten.sub.Tensor, x, g(aten.mean.dim, x, [-1], True)), 0.5)
    qkv = g(aten.mm.default, h, g(aten.t.default, w[0]))
    att = g(aten._softmax.default, g(aten.mm.default, qkv, g(aten.t.default, qkv)), -1, False)
    o = g(aten.mm.default, g(aten.mm.default, att, qkv), g(aten.t.default, w[1]))
    x = g(aten.add.Tensor, x, o)
    m = g(aten.gelu.default, g(aten.mm.default, x, g(aten.t.default, w[2])))
    return g(aten.add.Tensor, x, g(aten.mm.default, m, g(aten.t.default, w[3])))


def _layer_backward(g: _G, grad: fx.Node, x: fx.Node, shards: list[fx.Node], norms: list[fx.Node],
                    group: str) -> fx.Node:
    w = [g.waited(c10d.all_gather_into_tensor.default, s, N, group) for s in shards]
    for wi in reversed(w):
        gw = g(aten.mm.default, g(aten.t.default, grad), x)
        g.waited(c10d.reduce_scatter_tensor.default, gw, "avg", N, group)
        grad = g(aten.mul.Tensor, g(aten.mm.default, grad, wi), 0.5)
    for nw in norms:
        gn = g(aten.sum.dim_IntList, g(aten.mul.Tensor, grad, nw), [0])
        g.waited(c10d.all_reduce.default, gn, "avg", group)
    return grad


def _build(n_layers: int, group: str) -> fx.Graph:
    g = _G()
    x = g.input([TOKENS, HIDDEN])
    layers, saved = [], []
    for _ in range(n_layers):
        shards = [g.input([HIDDEN // N, HIDDEN]) for _ in range(4)]
        norms = [g.input([HIDDEN]) for _ in range(2)]
        saved.append(x)
        x = _layer_forward(g, x, shards, group)
        layers.append((shards, norms))
    grad = g(aten.mul.Tensor, x, 1.0)
    for (shards, norms), xs in zip(reversed(layers), reversed(saved)):
        grad = _layer_backward(g, grad, xs, shards, norms, group)
    g.graph.output((grad,))
    return g.graph


def transformer_step(n_nodes: int, group: str, lazy: bool = True) -> fx.GraphModule:
    """A training-step graph with the number of whole layers (at least one) whose node count is
    nearest ``n_nodes`` (within half a layer: 40 nodes)."""
    one, two = (len(_build(k, group).nodes) for k in (1, 2))
    per_layer = two - one
    graph = _build(max(1, round((n_nodes - (one - per_layer)) / per_layer)), group)
    # As torch.compile hands graphs to backends (TORCH_COMPILE_USE_LAZY_GRAPH_MODULE=1, the
    # default): a lazy module, whose recompile() only marks the code stale, so the passes' timings
    # do not include generating Python code for the whole graph after every pass.
    return _LazyGraphModule(torch.nn.Module(), graph) if lazy else \
        fx.GraphModule(torch.nn.Module(), graph)


class _OverCap(Exception):
    """A pipeline run took longer than ``--cap-s``."""


def _on_alarm(signum, frame):  # noqa: ARG001  signal handler signature
    raise _OverCap


def _run_once(gm: fx.GraphModule, config, names: list[str], cap_s: float) -> fx.GraphModule:
    """``run_pipeline`` under a ``cap_s`` alarm. Raises _OverCap when it runs past it."""
    from fcoll.passes.registry import PassFailed, run_pipeline

    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, cap_s)
    try:
        return run_pipeline(gm, config, names)
    except PassFailed as e:
        if isinstance(e.__cause__, _OverCap):
            raise _OverCap from None
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _measure(target: int, group: str, config, names: list[str], args) -> dict:
    """One row: best and median seconds, total and per pass, over ``args.reps`` fresh graphs."""
    from fcoll.passes.graph import collectives

    per_pass: dict[str, list[float]] = {n: [] for n in names}
    totals: list[float] = []
    row: dict = {"target_nodes": target}
    for _ in range(args.reps):
        gm = transformer_step(target, group, lazy=not args.eager_recompile)
        row.update(nodes=len(gm.graph.nodes), collectives=len(collectives(gm)))
        gc.collect()
        t0 = time.perf_counter()
        try:
            gm = _run_once(gm, config, names, args.cap_s)
        except _OverCap:
            row["over_cap_s"] = args.cap_s
            return row
        totals.append(time.perf_counter() - t0)
        for rec in gm.meta["fcoll_passes"]:
            per_pass[rec["pass"]].append(rec["seconds"])
        row["collectives_after"] = len(collectives(gm))
    best = min(range(len(totals)), key=totals.__getitem__)
    row.update(total_s=totals[best], passes_s={k: v[best] for k, v in per_pass.items()},
               median_total_s=statistics.median(totals),
               median_passes_s={k: statistics.median(v) for k, v in per_pass.items()})
    return row


def _table(rows: list[dict], names: list[str]) -> None:
    """Print per-pass seconds, total and growth per doubling; set ``growth_per_doubling``."""
    short = {n: n.split("_")[0] for n in names}
    print(f"{'nodes':>7} {'colls':>11} " + " ".join(f"{short[k]:>9}" for k in names) +
          f" {'total s':>8} {'growth/doubling':>15}")
    prev = None
    for r in rows:
        colls = f"{r['collectives']}->{r.get('collectives_after', '?')}"
        if "total_s" not in r:
            print(f"{r['nodes']:>7} {colls:>11} over the {r['over_cap_s']:g} s cap")
            continue
        growth = ""
        if prev is not None:
            ratio = r["total_s"] / prev["total_s"]
            r["growth_per_doubling"] = ratio ** (1 / math.log2(r["nodes"] / prev["nodes"]))
            growth = f"{r['growth_per_doubling']:.2f}x"
        print(f"{r['nodes']:>7} {colls:>11} " +
              " ".join(f"{r['passes_s'][k]:9.3f}" for k in names) +
              f" {r['total_s']:8.3f} {growth:>15}")
        prev = r
    at_50k = [r for r in rows if r["target_nodes"] == 50000 and "total_s" in r]
    growths = [r["growth_per_doubling"] for r in rows if "growth_per_doubling" in r]
    if at_50k:
        t = at_50k[0]["total_s"]
        print(f"target <= 2 s at 50k nodes: {t:.3f} s {'ok' if t <= 2.0 else 'MISSED'}")
    if growths:
        g = max(growths)
        print(f"target <= 2.3x per doubling: worst {g:.2f}x {'ok' if g <= 2.3 else 'MISSED'}")


def _rank_costs_on(rank: int, world_size: int) -> dict:  # noqa: ARG001  run_ranks signature
    """One rank of ``--rank-costs``: calibration (first and cached call) and the consistency
    check's median time per compile, in milliseconds."""
    import torch.distributed as dist

    from fcoll.passes.analysis.calibration import calibrate_group
    from fcoll.passes.config import FcollConfig
    from fcoll.passes.rewrites.consistency import CheckRankConsistency

    out: dict = {}
    gloo = dist.new_group(backend="gloo")
    for label, pg in (("fcoll", dist.group.WORLD), ("gloo", gloo)):
        t0 = time.perf_counter()
        calibrate_group(pg)
        t1 = time.perf_counter()
        calibrate_group(pg)
        t2 = time.perf_counter()
        out[f"calibrate_{label}_ms"] = (t1 - t0) * 1e3
        out[f"calibrate_{label}_cached_ms"] = (t2 - t1) * 1e3
    from fcoll.passes.graph import collectives

    gm = _LazyGraphModule(torch.nn.Module(), _build(4, dist.group.WORLD.group_name))
    out["check_collectives"] = len(collectives(gm))
    check = CheckRankConsistency(FcollConfig())
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        check(gm)
        times.append(time.perf_counter() - t0)
    out["check_ms"] = statistics.median(times) * 1e3
    return out


def _rank_costs() -> list[dict]:
    """``--rank-costs``: run :func:`_rank_costs_on` on 2 ranks and print one row per rank."""
    from fcoll.testing import run_ranks

    rows = run_ranks(_rank_costs_on, 2, backend="fcoll", timeout_s=300)
    print(f"\nrank costs (2 ranks, fcoll backend; ms): check_rank_consistency per compile with "
          f"{rows[0]['check_collectives']} collectives (median of 20); calibrate_group first and "
          f"cached call")
    print(f"{'rank':>4} {'check':>7} {'cal fcoll':>10} {'cached':>7} {'cal gloo':>9} {'cached':>7}")
    for rank, r in enumerate(rows):
        print(f"{rank:>4} {r['check_ms']:7.2f} {r['calibrate_fcoll_ms']:10.1f} "
              f"{r['calibrate_fcoll_cached_ms']:7.3f} {r['calibrate_gloo_ms']:9.1f} "
              f"{r['calibrate_gloo_cached_ms']:7.3f}")
    return rows


def main() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fcoll.passes.registry import registered_passes
    from fcoll.passes.config import FcollConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1000, 5000, 10000, 50000, 100000])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cap-s", type=float, default=60.0,
                   help="interrupt a run after this many seconds and skip larger sizes")
    p.add_argument("--passes", nargs="+", default=None,
                   help="time only these passes of the default pipeline (default: all registered)")
    p.add_argument("--eager-recompile", action="store_true",
                   help="plain GraphModules: every pass's recompile() generates code at once")
    p.add_argument("--rank-costs", action="store_true",
                   help="also time calibration and check_rank_consistency on 2 real ranks")
    p.add_argument("--json", default="passes_scaling.json", help="write the rows here")
    args = p.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=N)
    group = dist.group.WORLD.group_name
    config = FcollConfig()
    names = [n for n in config.pipeline if n in registered_passes()
             and (args.passes is None or n in args.passes)]
    print("pipeline:", " -> ".join(names), flush=True)
    rows = []
    for target in sorted(args.nodes):
        r = _measure(target, group, config, names, args)
        rows.append(r)
        if "total_s" not in r:
            print(f"{r['nodes']:>7} nodes: over the {args.cap_s:g} s cap; larger sizes skipped",
                  flush=True)
            break
        print(f"{r['nodes']:>7} nodes {r['collectives']:>5} -> {r['collectives_after']:>4} "
              f"collectives: total {r['total_s']:.3f} s  " +
              "  ".join(f"{k} {v:.3f}" for k, v in r["passes_s"].items()), flush=True)
    print()
    _table(rows, names)
    result = {"pipeline": names, "reps": args.reps, "cap_s": args.cap_s, "rows": rows}
    if args.rank_costs:
        result["rank_costs"] = _rank_costs()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
