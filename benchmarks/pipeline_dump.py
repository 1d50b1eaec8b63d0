"""Dump `format_graph` and every `fcoll_*` meta after the full default pipeline, for 68 graphs x 3
configs, to check that a refactor changes no pass decision: dump before and after, then `cmp`.

Usage: ``python benchmarks/pipeline_dump.py REPO_ROOT OUT.txt``
"""
import sys, os
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import torch
import canonical as C
import graphs_bucketing as G
C.ensure_fake_pg()
import fcoll
try:
    from fcoll.passes.config import FcollConfig
except ImportError:
    from fcoll.runtime.config import FcollConfig
from fcoll.passes import run_pipeline
from fcoll.inspect import format_graph

def graphs():
    yield "ddp", lambda: C.ddp_backward()
    yield "fsdp_f", lambda: C.fsdp_forward()
    yield "fsdp_b", lambda: C.fsdp_backward()
    yield "moe", lambda: C.moe_all_to_all()
    yield "mm", lambda: C.mm_overlap()
    for s in range(33):
        yield f"dag{s}", (lambda s=s: C.random_dag(s, n_ops=40))
    grp = torch.distributed.group.WORLD.group_name
    for s in range(30):
        yield f"rg{s}", (lambda s=s: G.random_graph(s, grp, 0))

configs = {
    "default": dict(),
    "tight": dict(memory_budget_mb=0.01, max_in_flight_mb=0.01, bucket_cap_mb=0.001),
    "middle": dict(memory_budget_mb=2, max_in_flight_mb=4, bucket_cap_mb=1),
}

def fmt(v):
    if isinstance(v, torch.fx.Node):
        return v.name
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(fmt(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(round(v, 6))
    return repr(v)

out = open(sys.argv[2], "w")
for cname, kw in configs.items():
    for gname, build in graphs():
        gm = build()
        gm = run_pipeline(gm, FcollConfig(**kw))
        out.write(f"==== {cname} {gname}\n")
        out.write(format_graph(gm) + "\n")
        for n in gm.graph.nodes:
            for k in sorted(n.meta):
                if k.startswith("fcoll_"):
                    out.write(f"  {n.name}.{k} = {fmt(n.meta[k])}\n")
        for k in sorted(gm.meta):
            if k.startswith("fcoll_") and k != "fcoll_passes":
                out.write(f"  gm.{k} = {fmt(gm.meta[k])}\n")
        out.write("  passes = " + ",".join(f"{r['pass']}:{r['modified']}" for r in gm.meta.get("fcoll_passes", [])) + "\n")
