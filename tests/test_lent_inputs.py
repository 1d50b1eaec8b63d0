"""The executor lends a collective its inputs (``fcoll.compile.direct_calls.lent_inputs``).

Off the direct path a functional collective's kernel copies its inputs, because an eager caller
may write them once the op returns. fcoll's executor writes nothing its graph does not, so for
a collective whose every result it waits and whose inputs no node of the graph writes, the
kernel reads them in place (``fcoll.ops.library.borrowing_inputs``): a SimpleFSDP block's
coalesced reduce_scatter no longer holds a second copy of the block's float32 gradients.

On 2 ranks, fcoll's group (collectives slowed, so a read of an input that a later write could
reach would show) and gloo: each compiled step equals the same step run eagerly, bit for bit;
the kernels of the compiled coalesced all_gather / reduce_scatter read their inputs in place,
the eager calls copy theirs. A step that writes its input after a collective read it (``x.add_``)
stays right: AOTAutograd applies the mutation after the graph returns, when the graph's waits
have completed every collective. Single process: which nodes of a graph are lent
(``lent_inputs``): not one whose input a node of the graph writes, nor one whose result leaves
the graph un-waited, nor one with a CUDA input (not yet checked on a GPU).
"""

from __future__ import annotations

import operator

import pytest
import torch

from fcoll.testing import fcoll_segments, run_ranks

pytestmark = pytest.mark.timeout(300)


def _lending(rank: int, world_size: int, slow: bool) -> dict:
    import torch.distributed as dist

    import fcoll
    import fcoll.ops.library as library
    from fcoll.testing import slow_collectives

    if slow and dist.get_backend() == "fcoll":
        slow_collectives(0.02)
    in_place: list[bool] = []
    copying = library._owned_input

    def record(pg, t):
        w = copying(pg, t)
        in_place.append(w is t)
        return w
    library._owned_input = record
    group = dist.group.WORLD

    def blocks(a, b, w):   # a block's coalesced gather and gradient reduce_scatter
        ga, gb = fcoll.all_gather_into_tensor_coalesced([a, b], group)
        h = torch.tanh(ga @ w) + gb.sum()
        ra, rb = fcoll.reduce_scatter_tensor_coalesced([h * 2, h + 1], "sum", [0, 0], group)
        z = torch.mm(w, w)   # runs while the reduce_scatter is in flight
        return ra + z.sum(), rb

    def mutating(x):   # the step writes its input after the collective read it
        r = fcoll.reduce_scatter_tensor_coalesced([x * 1.0, x], "sum", [0, 0], group)
        x.add_(1)
        return r[0] + r[1]

    torch.manual_seed(rank)
    a, b, w = torch.randn(4, 8), torch.randn(2, 8), torch.randn(8, 8)
    x = torch.randn(6, 3)
    out: dict = {}
    in_place.clear()
    expected = blocks(a, b, w)
    out["eager_in_place"] = list(in_place)
    in_place.clear()
    compiled = torch.compile(blocks, backend="fcoll", dynamic=False)
    got = compiled(a, b, w)
    out["compiled_in_place"] = list(in_place)
    out["blocks_diff"] = max((g - e).abs().max().item() for g, e in zip(got, expected))
    x_eager, x_compiled = x.clone(), x.clone()
    expected = mutating(x_eager)
    in_place.clear()
    got = torch.compile(mutating, backend="fcoll", dynamic=False)(x_compiled)
    out["mutating_diff"] = (got - expected).abs().max().item()
    out["mutated_input_diff"] = (x_compiled - x_eager).abs().max().item()
    return out


@pytest.mark.parametrize("backend", ["fcoll", "gloo"])
def test_compiled_collectives_read_their_inputs_in_place(backend):
    before = fcoll_segments()
    for r in run_ranks(_lending, 2, backend=backend, args=(True,)):
        assert r["eager_in_place"] and not any(r["eager_in_place"]), r
        # the compiled step's gathers and reduce_scatters: every input read in place
        assert r["compiled_in_place"] and all(r["compiled_in_place"]), r
        assert r["blocks_diff"] == 0.0, r
        assert r["mutating_diff"] == 0.0 and r["mutated_input_diff"] == 0.0, r
    assert fcoll_segments() == before


def _graph(write_input: bool, wait: bool, device: str = "cpu") -> torch.fx.GraphModule:
    """``x -> reduce_scatter_tensor_coalesced([x]) -> getitem -> wait``; ``write_input`` adds an
    ``x.add_(1)`` after the collective; without ``wait`` the result leaves the graph un-waited;
    ``x`` a (fake) tensor on ``device``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = torch.ops.fcoll
    g = torch.fx.Graph()
    x = g.placeholder("x")
    with FakeTensorMode():   # no GPU needed for a CUDA value
        x.meta["val"] = torch.empty(4, 3, device=device)
    rs = g.call_function(ops.reduce_scatter_tensor_coalesced.default, ([x], "sum", 2, "g"))
    item = g.call_function(operator.getitem, (rs, 0))
    result = g.call_function(ops.wait_tensor.default, (item,)) if wait else item
    if write_input:
        g.call_function(torch.ops.aten.add_.Tensor, (x, 1))
    g.output(result)
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("write_input,wait,device,lent", [(False, True, "cpu", True),
                                                          (True, True, "cpu", False),
                                                          (False, False, "cpu", False),
                                                          (False, True, "cuda", False)])
def test_which_collectives_are_lent(write_input, wait, device, lent):
    import fcoll  # noqa: F401  (defines torch.ops.fcoll)
    from fcoll.compile.direct_calls import lent_inputs

    gm = _graph(write_input, wait, device)
    rs = next(n for n in gm.graph.nodes if "reduce_scatter" in str(n.target))
    assert lent_inputs(gm) == ([rs] if lent else [])
    assert lent_inputs(gm, skip={rs}) == []
