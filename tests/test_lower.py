"""Tests of the ``lower_c10d_functional`` pass (single process, fake process group)."""

from __future__ import annotations

import operator

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import fcoll  # noqa: F401
from fcoll.compat import AUTO_FUNCTIONALIZES_ALIASED_RETURNS
from fcoll.inspect import format_graph
from fcoll.passes import graph as G
from fcoll.passes.rewrites.lower import RULES
from fcoll.passes.registry import get_pass, run_pipeline

_C = torch.ops._c10d_functional
_F = torch.ops.fcoll


@pytest.fixture(scope="module", autouse=True)
def fake_pg():
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _lower(gm: fx.GraphModule):
    return get_pass("lower_c10d_functional")(gm)


def _namespaces(gm: fx.GraphModule) -> set[str]:
    return {n.target.namespace for n in gm.graph.nodes
            if isinstance(n.target, torch._ops.OpOverload)}


def _funcol_graph() -> fx.GraphModule:
    """Every functional collective of ``torch.distributed._functional_collectives``."""
    g = dist.group.WORLD

    def f(x, y):
        a = funcol.all_reduce(x, "sum", g)
        b = funcol.all_gather_tensor(x, 0, g)
        c = funcol.reduce_scatter_tensor(y, "avg", 0, g)
        d = funcol.all_to_all_single(y, [1, 3], [2, 2], g)
        e = funcol.broadcast(x, 1, g)
        h = funcol.all_reduce_coalesced([x, y], "max", g)
        i = funcol.all_gather_into_tensor_coalesced([x, y], g)
        j = funcol.reduce_scatter_tensor_coalesced([y, y], "sum", [0, 0], g)
        return a, b, c, d, e, *h, *i, *j

    with FakeTensorMode():
        return make_fx(f)(torch.randn(4, 3), torch.randn(4, 3))


def test_every_funcol_op_maps_to_its_fcoll_twin():
    gm = _funcol_graph()
    before = {n.name: n.target for n in gm.graph.nodes if n.op == "call_function"
              and getattr(n.target, "namespace", None) == "_c10d_functional"}
    assert len(before) == 8 + 11  # 8 collectives, 11 waits
    result = _lower(gm)
    assert result.modified
    after = {n.name: n.target for n in result.graph_module.graph.nodes}
    for name, src in before.items():
        twin = getattr(_F, src._schema.name.split("::")[-1]).default
        assert after[name] is twin, name
    assert "_c10d_functional" not in _namespaces(result.graph_module)
    assert len(G.collectives(result.graph_module)) == 8
    for start in G.collectives(result.graph_module):
        assert G.is_fcoll_op(start) and G.waits_of(start)


def test_lowering_keeps_meta_and_is_idempotent():
    gm = _funcol_graph()
    metas = {n.name: (n.meta.get("val"), n.meta.get("stack_trace")) for n in gm.graph.nodes}
    gm = _lower(gm).graph_module
    for n in gm.graph.nodes:
        assert (n.meta.get("val"), n.meta.get("stack_trace")) == metas[n.name]
    assert not _lower(gm).modified


def test_lowered_graph_snapshot():
    """``ar(x) -> wait`` and the in-place coalesced op, lowered (fcoll ops, same order)."""
    g = dist.group.WORLD.group_name

    def f(x):
        a = funcol.all_reduce(x, "SUM", g)
        z = x.clone()
        ys = _C.all_reduce_coalesced_([z, x.clone()], "sum", g)
        return a + _C.wait_tensor(ys[0]), _C.wait_tensor(ys[1])

    with FakeTensorMode():
        gm = make_fx(f)(torch.randn(4))
    gm = run_pipeline(gm, names=["lower_c10d_functional"])
    T().assertExpectedInline(format_graph(gm), """\
graph(%arg0: f32[4]):
  %ar0: f32[4] = fcoll.all_reduce(%arg0, 'sum', '0')  # all_reduce group=0 ranks=2 op=sum
  %wait0: f32[4] = fcoll.wait_tensor(%ar0)  # waits %ar0
  %clone0: f32[4] = aten.clone(%arg0)
  %clone1: f32[4] = aten.clone(%arg0)
  %ar_0: f32[4] = fcoll.all_reduce_(%clone0, 'sum', '0')  # all_reduce group=0 ranks=2 op=sum
  %ar_1: f32[4] = fcoll.all_reduce_(%clone1, 'sum', '0')  # all_reduce group=0 ranks=2 op=sum
  %wait1: f32[4] = fcoll.wait_tensor(%ar_0)  # waits %ar_0
  %add0: f32[4] = aten.add.Tensor(%wait0, %wait1)
  %wait2: f32[4] = fcoll.wait_tensor(%ar_1)  # waits %ar_1
  return (%add0, %wait2)""")


class T(expecttest.TestCase):
    def runTest(self):  # pragma: no cover - instantiated only for assertExpectedInline
        pass


def test_reduce_scatter_out_becomes_functional_plus_copy_at_the_wait():
    """``rs_out(y, out=o) -> mm -> wait(o)`` becomes ``rs(y) -> mm -> wait -> copy_(o, wait)``."""
    g = dist.group.WORLD.group_name

    def f(y, w):
        o = torch.empty(2, 3)
        _C.reduce_scatter_tensor_out(y, "sum", 2, g, out=o)
        m = w @ w
        return _C.wait_tensor(o) + 1, m

    with FakeTensorMode():
        gm = make_fx(f)(torch.randn(4, 3), torch.randn(3, 3))
    gm = _lower(gm).graph_module
    (rs,) = G.collectives(gm)
    assert rs.target is _F.reduce_scatter_tensor.default
    wait = G.wait_of(rs)
    order = list(gm.graph.nodes)
    mm = next(n for n in order if n.target is torch.ops.aten.mm.default)
    assert order.index(rs) < order.index(mm) < order.index(wait)
    (copy,) = wait.users
    assert copy.target is torch.ops.aten.copy_.default and copy.args[1] is wait
    add = next(n for n in order if n.target is torch.ops.aten.add.Tensor)
    assert add.args[0] is copy


def test_legacy_c10d_functional_namespace_is_lowered():
    """Hand-built graph of ``c10d_functional`` (tag, ranks, group_size) ops."""
    L = torch.ops.c10d_functional
    graph = fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode():
        x.meta["val"] = torch.empty(4, 3)
    nodes = [
        graph.call_function(L.all_reduce.default, (x, "SUM", "", [0, 1], 2)),
        graph.call_function(L.all_gather_into_tensor.default, (x, "", [0, 1], 2)),
        graph.call_function(L.reduce_scatter_tensor.default, (x, "max", "", [0, 1], 2)),
        graph.call_function(L.all_to_all_single.default, (x, None, None, "", [0, 1], 2)),
        graph.call_function(L.broadcast.default, (x, 1, "", [0, 1], 2)),
    ]
    waits = [graph.call_function(L.wait_tensor.default, (n,)) for n in nodes]
    graph.output(tuple(waits))
    gm = _lower(fx.GraphModule(torch.nn.Module(), graph)).graph_module
    assert _namespaces(gm) == {"fcoll"}
    name = dist.group.WORLD.group_name
    assert [tuple(n.args[1:]) for n in G.collectives(gm)] == [
        ("sum", name), (2, name), ("max", 2, name), ([2, 2], [2, 2], name), (1, name)]
    assert [G.start_of(w) for w in gm.graph.nodes if G.is_wait(w)] == G.collectives(gm)


def test_group_name_given_as_process_group_is_normalised_to_str():
    graph = fx.Graph()
    x = graph.placeholder("x")
    ar = graph.call_function(_C.all_reduce.default, (x, "avg", "0"))
    graph.output(graph.call_function(_C.wait_tensor.default, (ar,)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    ar.args = (x, "avg", dist.group.WORLD)  # not printable as code: set after codegen
    gm = _lower(gm).graph_module
    (ar,) = G.collectives(gm)
    assert ar.args == (x, "avg", dist.group.WORLD.group_name)
    assert isinstance(ar.args[2], str)


def test_fcoll_op_given_a_process_group_gets_its_name_and_str_names_are_untouched():
    """fcoll.all_reduce(x, "sum", WORLD) -> fcoll.all_reduce(x, "sum", "0"); a graph whose
    group names are already str is not modified (the pass reports no change)."""
    world = dist.group.WORLD
    graph = fx.Graph()
    x = graph.placeholder("x")
    ar = graph.call_function(_F.all_reduce.default, (x, "sum", "0"))
    ag = graph.call_function(_F.all_gather_into_tensor.default, (x, 2),
                             {"group_name": "0"})
    outs = [graph.call_function(_F.wait_tensor.default, (n,)) for n in (ar, ag)]
    graph.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert not _lower(gm).modified
    ar.args = (x, "sum", world)  # not printable as code: set after codegen
    ag.kwargs = {"group_name": world}
    result = _lower(gm)
    assert result.modified
    assert ar.target is _F.all_reduce.default and ar.args == (x, "sum", world.group_name)
    assert ag.kwargs == {"group_name": world.group_name}
    assert all(isinstance(n.args[2] if n is ar else n.kwargs["group_name"], str)
               for n in (ar, ag))


@pytest.mark.skipif(not hasattr(_F.all_reduce, "group"),
                    reason="torch's collectives take str group_name (before 2.13): no .group")
def test_fcoll_group_overload_becomes_the_default_overload_with_the_name():
    world = dist.group.WORLD
    graph = fx.Graph()
    x = graph.placeholder("x")
    ar = graph.call_function(_F.all_reduce.group, (x, "sum", "0"))
    graph.output(graph.call_function(_F.wait_tensor.default, (ar,)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    ar.args = (x, "sum", world)  # not printable as code: set after codegen
    assert _lower(gm).modified
    assert ar.target is _F.all_reduce.default and ar.args == (x, "sum", world.group_name)


_NEEDS_P2P = pytest.mark.skipif(
    not hasattr(_C, "isend"),
    reason="torch.ops._c10d_functional.isend is missing (added after torch 2.11)")


@_NEEDS_P2P
def test_point_to_point_ops_and_their_waits_lower_to_fcoll():
    """isend / irecv / batch_p2p_ops have fcoll twins of the same schema: they and their waits
    (through getitem for the batch) become fcoll's."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    send = graph.call_function(_C.isend.default, (x, 1, 0, "0"))
    w = graph.call_function(_C.wait_tensor.default, (send,))
    recv = graph.call_function(_C.irecv.default, (x, 1, 0, "0"))
    w2 = graph.call_function(_C.wait_tensor.default, (recv,))
    batch = graph.call_function(_C.batch_p2p_ops.default,
                                (["isend", "irecv"], [1, 1], [0, 0], [x, x], "0"))
    got = graph.call_function(operator.getitem, (batch, 1))
    w3 = graph.call_function(_C.wait_tensor.default, (got,))
    graph.output((w, w2, w3))
    _lower(fx.GraphModule(torch.nn.Module(), graph))
    assert (send.target, recv.target, batch.target) == (
        _F.isend.default, _F.irecv.default, _F.batch_p2p_ops.default)
    assert w.target is w2.target is w3.target is _F.wait_tensor.default


@_NEEDS_P2P
def test_wait_on_an_op_without_fcoll_twin_stays_in_torch_namespace(monkeypatch):
    """An op the table does not lower (here isend, its rule removed) keeps its wait torch's,
    or the wait would not wait."""
    from fcoll.passes.rewrites import lower

    monkeypatch.delitem(lower.RULES, _C.isend.default)
    graph = fx.Graph()
    x = graph.placeholder("x")
    send = graph.call_function(_C.isend.default, (x, 1, 0, "0"))
    w = graph.call_function(_C.wait_tensor.default, (send,))
    ar = graph.call_function(_C.all_reduce.default, (x, "sum", "0"))
    w2 = graph.call_function(_C.wait_tensor.default, (ar,))
    graph.output((w, w2))
    _lower(fx.GraphModule(torch.nn.Module(), graph))
    assert w.target is _C.wait_tensor.default and send.target is _C.isend.default
    assert w2.target is _F.wait_tensor.default and ar.target is _F.all_reduce.default


def _aot_forward(fn, *inputs) -> fx.GraphModule:
    """The forward graph AOTAutograd makes of ``fn`` (before any fcoll pass)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def backend(gm, example_inputs):
        def fw(g, _):
            graphs.append(g)
            return g
        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return graphs[0]


def test_auto_functionalized_inplace_collectives_become_functional():
    """AOT wraps fcoll's in-place ops in ``auto_functionalized_v2``; they become functional.

    Torch 2.11 auto-functionalizes none of them: they get fcoll's Functionalize kernels
    (``compat.functionalize_as_twins``) and are traced as their functional twins directly.
    ``all_reduce_coalesced_`` returns its list (``Tensor[](a!)``, as torch's), which no torch
    auto-functionalizes: it is traced as ``all_reduce_coalesced`` on every version.
    """
    g = dist.group.WORLD.group_name

    def f(x):
        y = x * 2
        _F.all_reduce_(y, "sum", g)
        z = x * 3
        _F.broadcast_(z, 1, g)
        o = torch.empty(4, 3)
        _F.all_gather_into_tensor_out(x, 2, g, out=o)
        a, b = x * 4, x * 5
        _F.all_reduce_coalesced_([a, b], "max", g)
        return (_F.wait_tensor(y) + _F.wait_tensor(z), _F.wait_tensor(o),
                _F.wait_tensor(a) - _F.wait_tensor(b))

    gm = _aot_forward(f, torch.ones(2, 3))
    hops = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.auto_functionalized_v2]
    if AUTO_FUNCTIONALIZES_ALIASED_RETURNS:
        assert [h.args[0] for h in hops] == [_F.all_reduce_.default, _F.broadcast_.default,
                                             _F.all_gather_into_tensor_out.default]
    else:
        assert hops == []
        assert [n.target for n in G.collectives(gm)] == [
            _F.all_reduce.default, _F.broadcast.default, _F.all_gather_into_tensor.default,
            _F.all_reduce_coalesced.default]
    gm = _lower(gm).graph_module
    assert not any(n.target is torch.ops.higher_order.auto_functionalized_v2
                   for n in gm.graph.nodes)
    ops = [n.target for n in G.collectives(gm)]
    assert ops == [_F.all_reduce.default, _F.broadcast.default,
                   _F.all_gather_into_tensor.default, _F.all_reduce_coalesced.default]
    for start in G.collectives(gm):
        assert G.waits_of(start), start.name
    # The lowered graph still runs (fake pg: collectives are no-ops on rank 0's data).
    out = gm(torch.ones(2, 3))
    torch.testing.assert_close(out[0], torch.full((2, 3), 5.0))


def test_auto_functionalized_of_a_view_is_kept():
    """``all_reduce_`` of a slice mutates part of a base: no exact functional rewrite; kept."""
    g = dist.group.WORLD.group_name

    def f(x):
        y = x * 2
        _F.all_reduce_(y[1:], "sum", g)
        return _F.wait_tensor(y) + 1

    gm = _aot_forward(f, torch.ones(4, 3))
    assert not _lower(gm).modified
    if AUTO_FUNCTIONALIZES_ALIASED_RETURNS:
        assert any(n.target is torch.ops.higher_order.auto_functionalized_v2
                   for n in gm.graph.nodes)
    else:
        # 2.11: the twin on the slice, waited before the write-back into the base.
        (ar,) = G.collectives(gm)
        assert ar.target is _F.all_reduce.default
        assert ar.args[0].target is torch.ops.aten.slice.Tensor
        (w,) = G.waits_of(ar)
        (scatter,) = w.users
        assert scatter.target is torch.ops.aten.slice_scatter.default
        assert scatter.args[:2] == (ar.args[0].args[0], w)
    out = gm(torch.ones(4, 3))
    torch.testing.assert_close(out[0], torch.full((4, 3), 3.0))


def test_rule_table_covers_every_c10d_functional_collective():
    for name in ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_",
                 "all_gather_into_tensor", "all_gather_into_tensor_out",
                 "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
                 "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced",
                 "all_to_all_single", "broadcast", "broadcast_", "wait_tensor"):
        assert getattr(_C, name).default in RULES, name


def test_dtensor_redistribute_graph_is_fully_lowered():
    """``Shard(0) -> Replicate()`` traces to a _c10d_functional all_gather; lowered to fcoll."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))

    def f(x):
        d = DTensor.from_local(x, mesh, [Shard(0)])
        return d.redistribute(mesh, [Replicate()]).to_local() + 1

    gm = make_fx(f)(torch.randn(4, 3))
    assert "_c10d_functional" in _namespaces(gm)
    gm = _lower(gm).graph_module
    assert "_c10d_functional" not in _namespaces(gm)
    (ag,) = G.collectives(gm)
    assert ag.target is _F.all_gather_into_tensor.default and G.wait_of(ag) is not None


def test_c10d_functional_autograd_namespace_is_lowered():
    g = dist.group.WORLD.group_name
    A = torch.ops._c10d_functional_autograd

    def f(x):
        a = _C.wait_tensor(A.all_gather_into_tensor(x, 2, g))
        r = _C.wait_tensor(A.reduce_scatter_tensor(x, "sum", 2, g))
        t = _C.wait_tensor(A.all_to_all_single(x, [2, 2], [2, 2], g))
        return a, r, t

    with FakeTensorMode():
        gm = make_fx(f)(torch.randn(4, 3))
    gm = _lower(gm).graph_module
    assert _namespaces(gm) == {"fcoll"}
    assert [n.target for n in G.collectives(gm)] == [
        _F.all_gather_into_tensor.default, _F.reduce_scatter_tensor.default,
        _F.all_to_all_single.default]
