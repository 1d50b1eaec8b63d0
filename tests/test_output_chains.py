"""``sink_output_waits``: the DDP python-reducer pattern of compiled autograd's backward graph
(each gradient all-reduced and copied back at once) becomes bucketable."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import fcoll  # noqa: F401  registers torch.ops.fcoll
from fcoll.passes import get_pass
from fcoll.passes.graph import is_collective, is_wait
from fcoll.passes.rewrites.output_chains import output_only_chains


def _reducer_graph() -> fx.GraphModule:
    """grad_i = x @ w_i; each all-reduced, waited and copied back before the next is computed;
    one reduced value is also read by compute (its wait must stay)."""
    g = fx.Graph()
    x = g.placeholder("x")
    ws = [g.placeholder(f"w{i}") for i in range(3)]
    outs = []
    for i, w in enumerate(ws):
        grad = g.call_function(torch.ops.aten.mm.default, (x, w))
        ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (grad, "sum", "0"))
        wt = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
        if i == 1:  # read by compute: not output-only
            x = g.call_function(torch.ops.aten.add.Tensor, (x, wt))
        outs.append(g.call_function(torch.ops.aten.clone.default, (wt,)))
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


def test_output_only_chains_are_found_and_moved_to_the_end_in_order():
    gm = _reducer_graph()
    waits = [n for n in gm.graph.nodes if is_wait(n)]
    clones = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
    add = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor)
    assert output_only_chains(gm.graph) == [waits[0], clones[0], waits[2], clones[2]]
    assert get_pass("sink_output_waits")(gm).modified
    order = list(gm.graph.nodes)
    # the two output-only chains end the graph; the wait read by compute keeps its place
    assert order[-5:-1] == [waits[0], clones[0], waits[2], clones[2]]
    assert order.index(waits[1]) < order.index(add)
    # collectives keep their relative order
    colls = [n for n in order if is_collective(n)]
    assert [c.args[0].args[1].name for c in colls] == ["w0", "w1", "w2"]
    gm.graph.lint()


def test_values_unchanged_and_idempotent():
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    try:
        gm = _reducer_graph()
        args = [torch.randn(4, 4) for _ in range(4)]
        expected = gm(*args)
        get_pass("sink_output_waits")(gm)
        for a, b in zip(expected, gm(*args)):
            torch.testing.assert_close(a, b)
        before = [n.name for n in gm.graph.nodes]
        assert not get_pass("sink_output_waits")(gm).modified
        assert [n.name for n in gm.graph.nodes] == before
        assert sum(is_wait(n) for n in gm.graph.nodes) == 3
    finally:
        dist.destroy_process_group()
