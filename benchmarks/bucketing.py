"""Bucketed against unbucketed all_reduce of 200 gradients, on fcoll's backend and on gloo.

Usage: ``python benchmarks/bucketing.py [--reps 15] [--json bucketing.json]``

The step: 200 gradients of 4 KiB to 256 KiB (float32; sizes 4, 8, ..., 256 KiB in turn, 13.6 MiB
in all), each all_reduced (sum) and waited as tracing emits it (``ar -> wait`` per gradient).
Variants, each a ``GraphModule`` run on 2 ranks as ``backend="fcoll"`` runs graphs: by fcoll's
``GraphExecutor``, whose ``wait_tensor`` returns the collective's own buffer (called through the
dispatcher, the op returns a copy, since a custom op may not alias its input):

* ``unbucketed``: the traced graph, 200 collectives.
* ``fcoll_concat`` / ``fcoll_coalesced``: after fcoll's ``bucket_collectives`` (default
  ``bucket_cap_mb=25``).
* ``torch_bucket_all_reduce``: the same graph in ``_c10d_functional`` ops, bucketed by PyTorch
  2.13's ``torch._inductor.fx_passes.bucketing.bucket_all_reduce`` (the pass behind
  ``bucket_all_reduces_fx``) with the same 25 MiB cap, then lowered to fcoll ops by
  ``lower_c10d_functional`` so that both run on the same runtime.

Communication time = wall time of one step (every op of the graph: copies into and out of a
bucket included), median over ``--reps`` repetitions after a barrier each, slowest rank's median.
Variants are interleaved within each repetition so that they see the same machine noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KiB, MiB = 1 << 10, 1 << 20
SIZES_KIB = [4, 8, 16, 32, 64, 128, 256]
N_GRADS = 200


def _grad_sizes() -> list[int]:
    return [SIZES_KIB[i % len(SIZES_KIB)] * KiB // 4 for i in range(N_GRADS)]   # elements


def _graph(namespace: str, group: str):
    """``ar(g_i) -> wait`` for each gradient, built with fake values."""
    import torch
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    ns = getattr(torch.ops, namespace)
    g, mode = fx.Graph(), FakeTensorMode()
    outs = []
    for i, numel in enumerate(_grad_sizes()):
        p = g.placeholder(f"g{i}")
        with mode:
            p.meta["val"] = torch.empty(numel)
            ar = g.call_function(ns.all_reduce.default, (p, "sum", group))
            ar.meta["val"] = torch.empty(numel)
            w = g.call_function(ns.wait_tensor.default, (ar,))
            w.meta["val"] = torch.empty(numel)
        outs.append(w)
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


def _variants(group: str) -> dict:
    from torch._inductor.fx_passes.bucketing import bucket_all_reduce

    from fcoll.passes.registry import run_pipeline
    from fcoll.passes.config import FcollConfig

    out = {"unbucketed": _graph("fcoll", group)}
    for mode in ("concat", "coalesced"):
        out[f"fcoll_{mode}"] = run_pipeline(_graph("fcoll", group),
                                            FcollConfig(bucket_mode=mode),
                                            ["bucket_collectives"])
    ref = _graph("_c10d_functional", group)
    bucket_all_reduce(ref, lambda idx: FcollConfig().bucket_cap_mb)
    ref.recompile()
    out["torch_bucket_all_reduce"] = run_pipeline(ref, FcollConfig(), ["lower_c10d_functional"])
    return out


def _runner(executor):
    """``gm(*grads)`` through ``executor`` (which takes AOTAutograd's boxed list of inputs)."""
    return lambda *args: executor(list(args))


def _bench(rank: int, world_size: int, reps: int) -> dict:
    import torch
    import torch.distributed as dist

    from fcoll.passes.graph import collectives

    torch.manual_seed(rank)
    from fcoll.compile.executor import GraphExecutor

    graphs = _variants(dist.group.WORLD.group_name)
    variants = {name: _runner(GraphExecutor(gm, name)) for name, gm in graphs.items()}
    grads = [torch.randn(n) for n in _grad_sizes()]
    want = None
    times: dict[str, list[float]] = {k: [] for k in variants}
    for name, gm in variants.items():       # warm up, and check every variant's values
        got = gm(*grads)
        want = got if want is None else want
        for a, b in zip(want, got):
            torch.testing.assert_close(a, b)
    for _ in range(reps):
        for name, gm in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            gm(*grads)
            times[name].append(time.perf_counter() - t0)
    return {name: {"median_ms": statistics.median(t) * 1e3,
                   "collectives": len(collectives(graphs[name]))}
            for name, t in times.items()}


def main() -> None:
    from fcoll.testing import run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--backends", nargs="+", default=["fcoll", "gloo"])
    p.add_argument("--json", default=None, help="write results to this file")
    args = p.parse_args()
    out: dict = {"n_grads": N_GRADS, "grad_kib": SIZES_KIB, "nproc": 2,
                 "total_mib": sum(_grad_sizes()) * 4 / MiB, "results": {}}
    print(f"{N_GRADS} gradients, {out['total_mib']:.1f} MiB, 2 ranks, median of {args.reps}, "
          "slowest rank")
    print(f"{'backend':8} {'variant':26} {'colls':>5} {'ms':>9} {'vs unbucketed':>14} "
          f"{'vs torch':>9}")
    for backend in args.backends:
        per_rank = run_ranks(_bench, 2, backend=backend, args=(args.reps,), timeout_s=600)
        res = {k: {"median_ms": max(r[k]["median_ms"] for r in per_rank),
                   "collectives": per_rank[0][k]["collectives"]} for k in per_rank[0]}
        base = res["unbucketed"]["median_ms"]
        ref = res["torch_bucket_all_reduce"]["median_ms"]
        for k, v in res.items():
            v["speedup_vs_unbucketed"] = base / v["median_ms"]
            v["speedup_vs_torch"] = ref / v["median_ms"]
            print(f"{backend:8} {k:26} {v['collectives']:5d} {v['median_ms']:9.2f} "
                  f"{v['speedup_vs_unbucketed']:13.2f}x {v['speedup_vs_torch']:8.2f}x")
        out["results"][backend] = res
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
