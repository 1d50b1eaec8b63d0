"""Data-dependent (unbacked ``SymInt``) split sizes of all_to_all_single under the default passes.

A mixture-of-experts step on 2 ranks, top-1 routing, one expert per rank::

    expert = argmax(x @ router)            # which rank's expert each token goes to
    counts = one_hot(expert).sum(0)        # tokens this rank sends to each rank   [n]
    recv   = all_to_all_single(counts)     # tokens each rank sends to this rank   [n]
    in_s, out_s = counts.tolist(), recv.tolist()          # unbacked u0, u1 / u2, u3
    y = all_to_all_single(x[sorted], out_s, in_s)         # dispatch: [T, D] -> [u2 + u3, D]
    y = relu(y @ w_expert)
    z = all_to_all_single(y, in_s, out_s)                 # combine:  [u2 + u3, D] -> [u0 + u1, D]
    out = z[unsorted] * gate

compiled with ``torch.compile(backend="fcoll")`` and its default pipeline (lower, bucket, rank
check, reorder_for_overlap), forward and backward, on the fcoll and gloo process groups, against
eager. ``.tolist()`` inside a compiled function needs
``torch._dynamo.config.capture_scalar_outputs = True`` (PyTorch's requirement, not fcoll's):
without it Dynamo breaks the graph at ``.tolist()``.

Single-process tests (fake process group, ``make_fx`` symbolic graphs) pin the two documented
rules: the rank check marks data-dependent sizes instead of guarding on them, and the cost
model sizes such a collective by its fallback (``fcoll.passes.analysis.cost``), marked as estimated.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

import canonical
from fcoll.passes.analysis import cost
from fcoll.passes.config import FcollConfig
from fcoll.passes.analysis.fingerprints import fingerprint
from fcoll.passes.rewrites.consistency import RankCheck
from fcoll.passes.graph import collectives
from fcoll.testing import run_ranks

fc = torch.ops.fcoll
TOKENS, DIM = 8, 4




# --- single process: the rank check's report and the cost model's fallback -------------------

def _moe_collectives(x, counts, w, group_name, cap=None):
    """The three all_to_alls of the module docstring, raw ops (``make_fx`` graphs)."""
    recv = fc.wait_tensor(fc.all_to_all_single(counts, [1, 1], [1, 1], group_name))
    in_s, out_s = counts.tolist(), recv.tolist()
    if cap is not None:
        for s in in_s + out_s:
            torch._check(s <= cap)
    y = fc.wait_tensor(fc.all_to_all_single(x, out_s, in_s, group_name))
    y = torch.relu(y @ w)
    return fc.wait_tensor(fc.all_to_all_single(y, in_s, out_s, group_name))


def _traced(cap=None):
    canonical.ensure_fake_pg()
    name = dist.group.WORLD.group_name
    return make_fx(lambda x, c, w: _moe_collectives(x, c, w, name, cap),
                   tracing_mode="symbolic")(torch.randn(TOKENS, DIM), torch.tensor([3, 5]),
                                             torch.randn(DIM, DIM)), name


def test_rank_check_marks_data_dependent_sizes_and_does_not_guard():
    """counts a2a -> dispatch a2a [8, 4] -> [u2 + u3, 4] -> combine a2a: the fingerprint
    compares what is known (op, dtype, trailing dims) and names the data-dependent sizes."""
    gm, name = _traced()
    fp = fingerprint(gm)[name]
    # traced symbolically: the trailing dim is a symbol too, traced at 4
    assert fp.entries == ("all_to_all_single(int64[*])", "all_to_all_single(float32[*,~4])",
                          "all_to_all_single(float32[*,~4])")
    notes = dict(fp.data_dependent)
    assert sorted(notes) == [1, 2]
    assert "output_split_sizes [u2, u3]" in notes[1] and "input_split_sizes [u0, u1]" in notes[1]
    assert "output [u2 + u3, " in notes[1]
    assert "input [u2 + u3, " in notes[2] and "output [u0 + u1, " in notes[2]
    table = RankCheck(fp, "agreed on 2 ranks").format().splitlines()
    assert table[0] == f"group {name!r}: 3 collectives, agreed on 2 ranks"
    assert "data-dependent" not in table[1]
    assert all("data-dependent, not compared at compile time" in row for row in table[2:])


def test_data_dependent_dim_of_other_collectives_is_a_question_mark():
    """``all_reduce(zeros(u0))``: ranks agree that the dim is data-dependent, not on its value."""
    canonical.ensure_fake_pg()
    name = dist.group.WORLD.group_name

    def f(counts):
        n = counts.tolist()[0]
        torch._check(n >= 0)
        return fc.wait_tensor(fc.all_reduce(counts.new_zeros(n, 3), "sum", name))

    gm = make_fx(f, tracing_mode="symbolic")(torch.tensor([3, 5]))
    fp = fingerprint(gm)[name]
    assert fp.entries == ("all_reduce(int64[?,3], reduce_op=sum)",)
    assert fp.data_dependent[0][0] == 0 and "input [u0, 3]" in fp.data_dependent[0][1]


def test_cost_model_sizes_unbacked_collectives_by_the_documented_fallback():
    """Dispatch: the known input side (rule "other side"); combine: both sides unknown, each
    unbacked symbol UNBACKED_SIZE_FALLBACK rows (rule "fallback"); the counts a2a is exact."""
    gm, _ = _traced()
    counts, dispatch, combine = collectives(gm)
    assert cost.collective_size(counts) == cost.SizeEstimate(2 * 8)
    assert cost.collective_size(dispatch) == cost.SizeEstimate(
        TOKENS * DIM * 4, ("u2", "u3"), "other side")
    est = cost.collective_size(combine)
    assert (est.rule, est.symbols) == ("fallback", ("u0", "u1", "u2", "u3"))
    assert est.nbytes == 2 * cost.UNBACKED_SIZE_FALLBACK * DIM * 4 and est.estimated
    p = cost.default_comm("all_to_all", 2)
    assert cost.CostModel()(combine) == pytest.approx(p.alpha_us + p.beta_us_per_byte *
                                                      est.nbytes)
    # compute on data-dependent rows is estimated the same way instead of raising
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    assert cost.node_flops(mm) == 2 * 2 * cost.UNBACKED_SIZE_FALLBACK * DIM * DIM


def test_value_range_bounds_the_fallback():
    """``torch._check(split <= 16)``: each unbacked symbol is estimated as at most 16 rows."""
    gm, _ = _traced(cap=16)
    est = cost.collective_size(collectives(gm)[2])
    assert (est.rule, est.nbytes) == ("fallback", 2 * 16 * DIM * 4)


def test_scheduler_records_estimated_sizes_and_timeline_marks_them():
    """reorder_for_overlap on the fake process group: the plan uses the fallback sizes and
    says so in node.meta and in the predicted timeline."""
    from fcoll.passes.rewrites.overlap import ReorderForOverlap, predict

    gm, _ = _traced()
    ReorderForOverlap(FcollConfig())(gm)
    counts, dispatch, combine = collectives(gm)
    assert cost.META_SIZE_ESTIMATE not in counts.meta
    assert dispatch.meta[cost.META_SIZE_ESTIMATE] == {
        "bytes": TOKENS * DIM * 4, "rule": "other side", "symbols": ["u2", "u3"]}
    assert combine.meta[cost.META_SIZE_ESTIMATE]["rule"] == "fallback"
    marked = {e.node: e.size_estimated for e in predict(gm) if e.kind == "collective"}
    assert marked == {counts.name: False, dispatch.name: True, combine.name: True}


def test_bucketing_leaves_data_dependent_collectives_alone():
    """bucket_collectives never merges a collective whose splits or shapes are data-dependent
    (a bucket's buffer offsets and byte cap would need their values)."""
    from fcoll.passes.rewrites.bucketing import BucketCollectives

    gm, _ = _traced()
    before = [n.name for n in collectives(gm)]
    result = BucketCollectives(FcollConfig())(gm)
    assert not result.modified and [n.name for n in collectives(gm)] == before


# --- 2 ranks: compiled MoE step, forward and backward, against eager --------------------------

def _moe(x, router, w_expert, group):
    """Top-1 MoE layer of the module docstring (one expert per rank); returns ``[T, D]``."""
    import fcoll

    n = group.size()  # torch 2.11's Dynamo cannot inline dist.get_world_size on a Python group
    probs = torch.softmax(x @ router, dim=-1)
    gate, expert = probs.max(dim=-1)
    order = torch.argsort(expert, stable=True)
    counts = torch.nn.functional.one_hot(expert, n).sum(0)
    recv = fcoll.all_to_all_single(counts, None, None, group)
    in_splits, out_splits = counts.tolist(), recv.tolist()
    y = fcoll.all_to_all_single(x[order], out_splits, in_splits, group)
    y = torch.relu(y @ w_expert)
    z = fcoll.all_to_all_single(y, in_splits, out_splits, group)
    return z[torch.argsort(order)] * gate[:, None]


def _step(x, router, w_expert, group):
    return _moe(x, router, w_expert, group).pow(2).sum()


def _on_ranks(rank: int, world_size: int) -> dict:
    """Eager and compiled steps on two batches of different routing; returns values, grads,
    the split sizes seen, and what the compiled graphs' passes recorded."""
    import fcoll  # noqa: F401
    from fcoll.compile.backend import register_compile_listener
    from fcoll.passes.rewrites.consistency import META_RANK_CHECK

    torch._dynamo.config.capture_scalar_outputs = True   # .tolist() inside the graph
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(100 + rank)
    router = torch.randn(DIM, world_size, generator=gen)
    w = torch.randn(DIM, DIM, generator=gen)
    seen: list = []
    handle = register_compile_listener(lambda rec: seen.append(rec))
    compiled = torch.compile(_step, backend="fcoll", fullgraph=True)
    out: dict = {"eager": [], "compiled": [], "splits": []}
    for _ in range(2):
        x = torch.randn(TOKENS, DIM, generator=gen)
        for mode, fn in (("eager", _step), ("compiled", compiled)):
            leaves = [t.clone().requires_grad_() for t in (x, router, w)]
            loss = fn(*leaves, group)
            loss.backward()
            out[mode].append([loss.detach(), *(t.grad for t in leaves)])
        expert = (x @ router).argmax(-1)
        out["splits"].append(torch.bincount(expert, minlength=world_size).tolist())
    handle.remove()
    out["graphs"] = [{
        "name": rec.name,
        "passes": [p["pass"] for p in rec.after.meta.get("fcoll_passes", [])],
        "rank_check": {g: c.format() for g, c in rec.after.meta.get(META_RANK_CHECK, {}).items()},
        "size_estimates": [n.meta[cost.META_SIZE_ESTIMATE]["rule"] for n in collectives(rec.after)
                           if cost.META_SIZE_ESTIMATE in n.meta],
    } for rec in seen]
    return out


def _check_moe(backend: str) -> None:
    results = run_ranks(_on_ranks, 2, backend=backend, timeout_s=240)
    for rank, r in enumerate(results):
        for eager, compiled in zip(r["eager"], r["compiled"], strict=True):
            for name, e, c in zip(("loss", "x.grad", "router.grad", "w.grad"), eager, compiled,
                                  strict=True):
                torch.testing.assert_close(
                    c, e, msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}")
        kinds = sorted(g["name"].rsplit("_", 1)[-1] for g in r["graphs"])
        assert kinds == ["backward", "forward"], r["graphs"]   # both batches: one compile
        for g in r["graphs"]:
            assert g["passes"] == ["lower_c10d_functional", "fold_all_reduce_sums",
                                   "bucket_collectives", "check_rank_consistency",
                                   "reorder_for_overlap"]
            assert g["size_estimates"], g     # the unbacked a2as were sized by the fallback
            report = "\n".join(g["rank_check"].values())
            assert "data-dependent, not compared at compile time" in report, report
    # the routing is uneven and changes between batches: real data-dependent splits
    splits = [s for r in results for s in r["splits"]]
    assert len({tuple(s) for s in splits}) > 1 and any(a != b for a, b in splits)


def test_moe_unbacked_splits_compile_and_match_eager_on_fcoll():
    _check_moe("fcoll")


def test_moe_unbacked_splits_compile_and_match_eager_on_gloo():
    _check_moe("gloo")
