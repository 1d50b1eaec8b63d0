"""Dynamo remaps of legacy ``torch.distributed`` calls (fcoll/ops/remaps.py).

Single-process tests use the fake process group; the results check runs every call on 2 ranks,
eager against compiled, on gloo and on fcoll's own backend (one ``run_ranks`` call each).
"""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch._dynamo.testing
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import fcoll  # noqa: F401  installs the remaps
from fcoll.inspect import format_graph
from fcoll.ops import remaps
from fcoll.passes import graph as G
from fcoll.compile.backend import register_compile_listener
from fcoll.testing import run_ranks

RO = dist.ReduceOp


@pytest.fixture(scope="module")
def fake_pg():
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.new_group([0, 1])
    dist.destroy_process_group()


# One small program per remapped call (rank 0 of 2; x is [4, 3] float, i is [4] int64).
CALLS = {
    "all_reduce": lambda x, i, g: dist.all_reduce(x),
    "all_reduce_max_positional_group": lambda x, i, g: dist.all_reduce(x, RO.MAX, g),
    "all_reduce_bxor_keyword_group": lambda x, i, g: dist.all_reduce(i, op=RO.BXOR, group=g),
    "all_reduce_world": lambda x, i, g: dist.all_reduce(x, group=dist.group.WORLD),
    "all_gather_into_tensor": lambda x, i, g: dist.all_gather_into_tensor(
        x.new_empty(8, 3), x, g),
    "_all_gather_base": lambda x, i, g: dist._all_gather_base(x.new_empty(2, 4, 3), x),
    "all_gather": lambda x, i, g: dist.all_gather([x.new_empty(4, 3), x.new_empty(4, 3)], x),
    "reduce_scatter_tensor": lambda x, i, g: dist.reduce_scatter_tensor(
        x.new_empty(2, 3), x, op=RO.MIN, group=None),
    "_reduce_scatter_base": lambda x, i, g: dist._reduce_scatter_base(x.new_empty(2, 3), x),
    "all_to_all_single_even": lambda x, i, g: dist.all_to_all_single(torch.empty_like(x), x),
    "all_to_all_single_uneven": lambda x, i, g: dist.all_to_all_single(
        x.new_empty(5, 3), x, [2, 3], [1, 3], group=g),
    "broadcast": lambda x, i, g: dist.broadcast(x, 1, g),
    "broadcast_group_src": lambda x, i, g: dist.broadcast(x, group=g, group_src=1),
    "reduce": lambda x, i, g: dist.reduce(x, 0, op=RO.PRODUCT),
    "barrier": lambda x, i, g: dist.barrier(),
    "all_reduce_async": lambda x, i, g: dist.all_reduce(x, async_op=True).wait(),
}
# Names torch 2.13 added (2.11 has only all_gather_into_tensor / reduce_scatter_tensor).
CALLS.update({name: fn for name, fn in {
    "all_gather_single": lambda x, i, g: dist.all_gather_single(x.new_empty(8, 3), x, g, True
                                                                ).wait(),
    "reduce_scatter_single": lambda x, i, g: dist.reduce_scatter_single(x.new_empty(2, 3), x),
}.items() if hasattr(dist, name)})

# The calls PyTorch's Dynamo graph-breaks on (no remap, or async_op=True) or fails on (an
# [n, N, *] output): fcoll compiles them only for its own backend; under any other, Dynamo does
# what it does without fcoll (fcoll/ops/remaps.py, issue 28.5).
FCOLL_ONLY = {"_all_gather_base", "broadcast", "broadcast_group_src", "reduce", "barrier",
              "all_reduce_async", "all_gather_single"}

# Collective kinds each program must compile to (wait_tensor counted separately).
KINDS = {
    "all_gather_into_tensor": ["all_gather"], "_all_gather_base": ["all_gather"],
    "all_gather": ["all_gather"], "reduce_scatter_tensor": ["reduce_scatter"],
    "all_gather_single": ["all_gather"], "reduce_scatter_single": ["reduce_scatter"],
    "_reduce_scatter_base": ["reduce_scatter"], "all_to_all_single_even": ["all_to_all"],
    "all_to_all_single_uneven": ["all_to_all"], "broadcast": ["broadcast"],
    "broadcast_group_src": ["broadcast"],
}


def _overloads(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with each op packet (what Dynamo records, PyTorch's remaps and fcoll's alike)
    replaced by its default overload, as AOTAutograd's graphs that the passes read have them."""
    for node in gm.graph.nodes:
        if isinstance(node.target, torch._ops.OpOverloadPacket):
            node.target = node.target.default
    return gm


def _as_fcolls(backend):
    """``backend`` marked as fcoll's, so the remaps compile every call for it: Dynamo's graph,
    which fcoll's backend receives, recorded without running fcoll's passes."""
    setattr(backend, remaps.FCOLL_BACKEND_ATTR, True)
    return backend


@pytest.mark.parametrize("call", sorted(CALLS))
def test_each_call_compiles_to_one_graph_with_c10d_functional_ops(fake_pg, call):
    """Under fcoll's backend every call is one graph of PyTorch's ``_c10d_functional`` ops
    (what fcoll's lowering reads)."""
    fn = CALLS[call]
    counter = _as_fcolls(torch._dynamo.testing.CompileCounterWithBackend("eager"))
    torch._dynamo.reset()
    # fullgraph=True: any graph break raises.
    torch.compile(fn, backend=counter, fullgraph=True)(torch.ones(4, 3), torch.arange(4),
                                                       fake_pg)
    assert counter.frame_count == 1
    (gm,) = counter.graphs
    starts = G.collectives(_overloads(gm))
    assert [G.collective_kind(s) for s in starts] == KINDS.get(call, ["all_reduce"])
    assert all(s.target.namespace == "_c10d_functional" and G.wait_of(s) is not None
               for s in starts)


def test_fcoll_backend_traces_all_calls_in_one_function_without_graph_break(fake_pg):
    def f(x, i, g):
        for call in CALLS.values():
            call(x, i, g)
        return x

    counter = _as_fcolls(torch._dynamo.testing.CompileCounterWithBackend("eager"))
    torch._dynamo.reset()
    torch.compile(f, backend=counter, fullgraph=True)(torch.ones(4, 3), torch.arange(4),
                                                      fake_pg)
    assert counter.frame_count == 1


@pytest.mark.parametrize("call", sorted(CALLS))
def test_other_backends_graph_break_where_pytorch_does(fake_pg, call):
    """Under any backend but fcoll's, ``fullgraph=True`` fails on a call PyTorch does not
    compile (a graph break at the call; ``_all_gather_base`` into ``[n, N, *]`` fails in
    PyTorch's remap), as without fcoll, and compiles the calls PyTorch remaps."""
    torch._dynamo.reset()
    compiled = torch.compile(CALLS[call], backend="eager", fullgraph=True)
    args = (torch.ones(4, 3), torch.arange(4), fake_pg)
    if call in FCOLL_ONLY:
        with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.TorchRuntimeError)):
            compiled(*args)
    else:
        compiled(*args)


def test_is_fcoll_backend_sees_through_dynamos_wrappers():
    from fcoll.compile.backend import fcoll_backend

    assert remaps.is_fcoll_backend(fcoll_backend)
    assert remaps.is_fcoll_backend("fcoll")
    assert remaps.is_fcoll_backend(torch._dynamo.testing.CompileCounterWithBackend("fcoll"))
    assert not remaps.is_fcoll_backend("eager")
    assert not remaps.is_fcoll_backend(torch._dynamo.testing.CompileCounter())


def test_aot_eager_and_inductor_see_pytorchs_own_ops_with_fcoll_imported(fake_pg):
    """``import fcoll`` changes nothing for other backends: the graph AOTAutograd hands a
    backend (aot_eager, Inductor) after every call PyTorch remaps and a PyTorch funcol call holds
    PyTorch's ``_c10d_functional`` ops and none of fcoll's, and Inductor applies its own
    rewrite to them (re-inplacing ``all_reduce`` of a buffer it allocated into
    ``all_reduce_``), as without fcoll."""
    import torch.distributed._functional_collectives as funcol
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import run_and_get_code

    pytorchs = [call for name, call in CALLS.items() if name not in FCOLL_ONLY]

    def every_call(x, i, g):
        for call in pytorchs:
            call(x, i, g)
        return funcol.all_reduce(x + 1, "sum", g) * 2

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(every_call, backend=aot_autograd(fw_compiler=keep), fullgraph=True)(
        torch.ones(4, 3), torch.arange(4), fake_pg)
    (gm,) = graphs
    ops = [n.target for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    namespaces = {op.namespace for op in ops}
    assert "fcoll" not in namespaces, namespaces
    starts = [op for op in ops if op.namespace == "_c10d_functional" and
              op is not torch.ops._c10d_functional.wait_tensor.default]
    waits = [op for op in ops if op is torch.ops._c10d_functional.wait_tensor.default]
    assert len(starts) == len(pytorchs) + 1 == len(waits), (len(starts), len(waits))

    def g(x):
        y = x + 1
        dist.all_reduce(y)
        return y * 2

    torch._dynamo.reset()
    _, (code,) = run_and_get_code(torch.compile(g, backend="inductor", fullgraph=True),
                                  torch.ones(4))
    assert "torch.ops._c10d_functional.all_reduce_.default" in code
    assert "torch.ops._c10d_functional.wait_tensor.default" in code
    assert "fcoll" not in code


def test_group_forms_resolve_to_the_group_name(fake_pg):

    def f(x):
        dist.all_reduce(x)
        dist.all_reduce(x, RO.SUM, None)
        dist.all_reduce(x, group=dist.group.WORLD)
        dist.all_reduce(x, RO.SUM, fake_pg)
        dist.all_reduce(x, group=fake_pg)
        return x

    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    torch.compile(f, backend=counter, fullgraph=True)(torch.ones(2))
    names = [G.collective_info(s).group_name
             for s in G.collectives(_overloads(counter.graphs[0]))]
    world = dist.group.WORLD.group_name
    assert names == [world, world, world, fake_pg.group_name, fake_pg.group_name]
    assert world != fake_pg.group_name


def test_reduce_ops_map_to_fcoll_strings():
    expected = {RO.SUM: "sum", RO.AVG: "avg", RO.PRODUCT: "product", RO.MIN: "min",
                RO.MAX: "max", RO.BAND: "band", RO.BOR: "bor", RO.BXOR: "bxor"}
    for op, name in expected.items():
        assert remaps.reduce_op_name(op) == name
        assert remaps.reduce_op_name(RO(op)) == name  # the ReduceOp object form


@pytest.mark.parametrize("op", [RO.PREMUL_SUM, dist._make_nccl_premul_sum(2.0)],
                         ids=["PREMUL_SUM", "premul_sum_object"])
def test_unsupported_reduce_op_raises_instead_of_compiling(fake_pg, op):
    with pytest.raises(ValueError, match="PREMUL_SUM and premul-sum ReduceOps are not"):
        remaps.reduce_op_name(op)

    def f(x):
        dist.all_reduce(x, op=op)
        return x

    torch._dynamo.reset()
    with pytest.raises(Exception, match="cannot compile torch.distributed.all_reduce with reduce op"):
        torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))


def test_install_is_idempotent_and_installed():
    assert remaps.installed()
    remaps.install()
    remaps.install()
    assert remaps.installed()


def test_a_moved_dynamo_hook_fails_loudly(monkeypatch):
    from torch._dynamo.variables.functions import PolyfilledFunctionVariable

    monkeypatch.delattr(PolyfilledFunctionVariable, "_get_polyfill_handlers")
    with pytest.raises(ImportError, match="_get_polyfill_handlers is gone"):
        remaps.install()


# ---------------------------------------------------------------------------------------------
# Snapshots of the forward graph after lower_c10d_functional (fcoll compile backend)

class Snap(expecttest.TestCase):
    def runTest(self):  # pragma: no cover
        pass


def _lowered_forward(fn, *args) -> str:
    graphs = []
    handle = register_compile_listener(lambda rec: graphs.append(rec.after))
    try:
        torch._dynamo.reset()
        torch.compile(fn, backend="fcoll", fullgraph=True,
                      options={"passes": ("lower_c10d_functional",)})(*args)
    finally:
        handle.remove()
    (gm,) = graphs
    return format_graph(gm)


def test_snapshot_all_reduce_broadcast_reduce_barrier(fake_pg):
    """``dist.all_reduce(x); dist.broadcast(y, 1, g); dist.reduce(y, 1); dist.barrier()``:
    functional op -> wait -> copy_ for each; reduce to dst 1 copies nothing on rank 0."""
    def f(x, y):
        dist.all_reduce(x, op=RO.AVG)
        dist.broadcast(y, 1, fake_pg)
        dist.reduce(y, 1)
        dist.barrier()
        return x + y

    Snap().assertExpectedInline(_lowered_forward(f, torch.ones(4), torch.ones(4)), """\
graph(%arg0: f32[4], %arg1: f32[4]):
  %ar0: f32[4] = fcoll.all_reduce(%arg0, 'avg', '0')  # all_reduce group=0 ranks=2 op=avg
  %wait0: f32[4] = fcoll.wait_tensor(%ar0)  # waits %ar0
  %copy0: f32[4] = aten.copy(%arg0, %wait0)
  %bc0: f32[4] = fcoll.broadcast(%arg1, 1, '1')  # broadcast group=1 ranks=2 src=1
  %wait1: f32[4] = fcoll.wait_tensor(%bc0)  # waits %bc0
  %copy1: f32[4] = aten.copy(%arg1, %wait1)
  %ar1: f32[4] = fcoll.all_reduce(%copy1, 'sum', '0')  # all_reduce group=0 ranks=2 op=sum
  %wait2: f32[4] = fcoll.wait_tensor(%ar1)  # waits %ar1
  %zeros0: f32[1] = aten.zeros([1], device=device(type='cpu'), pin_memory=False)
  %ar2: f32[1] = fcoll.all_reduce(%zeros0, 'sum', '0')  # all_reduce group=0 ranks=2 op=sum
  %wait3: f32[1] = fcoll.wait_tensor(%ar2)  # waits %ar2
  %add0: f32[4] = aten.add.Tensor(%copy0, %copy1)
  return (%copy0, %copy1, %add0)""")


def test_snapshot_async_wait_lands_at_work_wait(fake_pg):
    """``w = all_reduce(x, async_op=True); mm; w.wait()``: the wait is after the mm, not at the
    call, so the mm can run while the all_reduce is in flight."""
    def f(x, w):
        work = dist.all_reduce(x, async_op=True)
        h = w @ w
        work.wait()
        return x + h

    text = _lowered_forward(f, torch.ones(4, 4), torch.ones(4, 4))
    Snap().assertExpectedInline(text, """\
graph(%arg0: f32[4, 4], %arg1: f32[4, 4]):
  %ar0: f32[4, 4] = fcoll.all_reduce(%arg0, 'sum', '0')  # all_reduce group=0 ranks=2 op=sum
  %mm0: f32[4, 4] = aten.mm(%arg1, %arg1)
  %wait0: f32[4, 4] = fcoll.wait_tensor(%ar0)  # waits %ar0
  %copy0: f32[4, 4] = aten.copy(%arg0, %wait0)
  %add0: f32[4, 4] = aten.add.Tensor(%copy0, %mm0)
  return (%copy0, %add0)""")
    lines = text.splitlines()
    at = {k: next(i for i, ln in enumerate(lines) if k in ln) for k in ("fcoll.all_reduce",
                                                                       "aten.mm",
                                                                       "fcoll.wait_tensor")}
    assert at["fcoll.all_reduce"] < at["aten.mm"] < at["fcoll.wait_tensor"]


# ---------------------------------------------------------------------------------------------
# Results on 2 ranks: compiled (backend "fcoll") against eager, gloo and fcoll process groups

def _program(x, ints, sub, rank, eager):
    """Every remapped call, sync and async; returns the tensors they wrote."""
    ws = 2
    out = {}
    for name, op in (("sum", RO.SUM), ("product", RO.PRODUCT), ("min", RO.MIN),
                     ("max", RO.MAX)):
        t = x.clone()
        dist.all_reduce(t, op, sub if name == "min" else None)
        out[f"all_reduce_{name}"] = t
    for name, op in (("band", RO.BAND), ("bor", RO.BOR), ("bxor", RO.BXOR)):
        t = ints.clone()
        dist.all_reduce(t, op=op, group=sub)
        out[f"all_reduce_{name}"] = t
    t = x.clone()
    if eager:  # gloo has no AVG: the eager reference sums and divides
        dist.all_reduce(t)
        t /= ws
    else:
        dist.all_reduce(t, op=RO.AVG, group=dist.group.WORLD)
    out["all_reduce_avg"] = t
    out["all_gather_into_tensor"] = x.new_empty(ws * 4, 3)
    dist.all_gather_into_tensor(out["all_gather_into_tensor"], x)
    out["_all_gather_base"] = x.new_empty(ws * 4, 3)  # gloo rejects the [n, N, *] form
    dist._all_gather_base(out["_all_gather_base"], x, sub)
    lst = [torch.empty_like(x) for _ in range(ws)]
    dist.all_gather(lst, x, group=sub)
    out["all_gather_0"], out["all_gather_1"] = lst
    out["reduce_scatter_tensor"] = x.new_empty(2, 3)
    dist.reduce_scatter_tensor(out["reduce_scatter_tensor"], x, op=RO.MAX)
    out["_reduce_scatter_base"] = x.new_empty(2, 3)
    dist._reduce_scatter_base(out["_reduce_scatter_base"], x, RO.SUM, sub)
    out["all_to_all_even"] = torch.empty_like(x)
    dist.all_to_all_single(out["all_to_all_even"], x)
    in_splits, out_splits = ([1, 3], [1, 2]) if rank == 0 else ([2, 2], [3, 2])
    out["all_to_all_uneven"] = x.new_empty(sum(out_splits), 3)
    dist.all_to_all_single(out["all_to_all_uneven"], x, out_splits, in_splits, group=sub)
    b = x.clone()
    dist.broadcast(b, 1, sub)
    out["broadcast"] = b
    b = x.clone()
    dist.broadcast(b, group=sub, group_src=0)
    out["broadcast_group_src"] = b
    r = x.clone()
    dist.reduce(r, 1, RO.MAX)
    out["reduce_to_1"] = r
    dist.barrier()
    dist.barrier(sub)
    out.update(_async_program(x, sub))
    return out


def _async_program(x, sub):
    """async_op=True: start everything, compute, then wait."""
    ws = 2
    out = {}
    a, g, bc, rs = x.clone(), x.new_empty(ws * 4, 3), x.clone(), x.new_empty(2, 3)
    a2a, red, lst = torch.empty_like(x), x.clone(), [torch.empty_like(x) for _ in range(ws)]
    works = [dist.all_reduce(a, group=sub, async_op=True),
             dist.all_gather_into_tensor(g, x, async_op=True),
             dist.broadcast(bc, 0, async_op=True),
             dist.reduce_scatter_tensor(rs, x, async_op=True),
             dist.all_to_all_single(a2a, x, async_op=True),
             dist.reduce(red, 0, async_op=True),
             dist.all_gather(lst, x, async_op=True),
             dist.barrier(async_op=True)]
    out["compute"] = x @ x.T
    for w in works:
        w.wait()
    out.update(async_all_reduce=a, async_all_gather_into_tensor=g, async_broadcast=bc,
               async_reduce_scatter=rs, async_all_to_all=a2a, async_reduce_to_0=red,
               async_all_gather_0=lst[0], async_all_gather_1=lst[1])
    return out


def _rank_eager_vs_compiled(rank, world_size):
    import torch._dynamo.testing

    sub = dist.new_group([0, 1])
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * rank + 1
    ints = torch.tensor([0b1100, 0b1010, 7, 1 << rank]) + rank
    eager = _program(x.clone(), ints.clone(), sub, rank, True)
    counter = torch._dynamo.testing.CompileCounterWithBackend("fcoll")
    compiled = torch.compile(_program, backend=counter, fullgraph=True)(
        x.clone(), ints.clone(), sub, rank, False)
    return {"eager": eager, "compiled": compiled, "x": x, "frames": counter.frame_count}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["gloo", "fcoll"])
def test_results_match_eager_on_two_ranks(backend):
    results = run_ranks(_rank_eager_vs_compiled, 2, backend=backend, timeout_s=140)
    for rank, res in enumerate(results):
        assert res["frames"] == 1
        eager, compiled = res["eager"], res["compiled"]
        assert sorted(eager) == sorted(compiled)
        for key in eager:
            if (key, rank) in (("reduce_to_1", 0), ("async_reduce_to_0", 1)):
                # Not the root: PyTorch leaves it unspecified (gloo leaves partial sums);
                # fcoll leaves the tensor unchanged.
                torch.testing.assert_close(compiled[key], res["x"], msg=f"{key} rank {rank}")
                continue
            torch.testing.assert_close(compiled[key], eager[key], msg=f"{key} rank {rank}")


def _works_leave_the_frame(rank, world_size, slow_s):
    """``async_op=True`` works that leave their compiled frame and are waited on outside it:
    returned (and waited in eager code, or in a graph ``aot_eager`` compiles), and appended to a
    list by gradient hooks that compiled autograd traces (a hand-written DDP). Their waits once
    ran PyTorch's ``_c10d_functional`` wait, which does not know fcoll's collectives: the copy
    read the output while the collective still wrote it (wrong gradients, 0.03-0.1 off)."""
    import torch.nn as nn
    from torch._dynamo import compiled_autograd

    from fcoll.testing import slow_collectives

    if slow_s:
        slow_collectives(slow_s)   # fcoll's group: complete long after the op returns
    out = {}

    def start(x):
        a, g, lst = x.clone(), x.new_empty(2 * 4, 3), [torch.empty_like(x) for _ in range(2)]
        works = [dist.all_reduce(a, async_op=True),
                 dist.all_gather_into_tensor(g, x, async_op=True),
                 dist.all_gather(lst, x * 2, async_op=True)]
        return works, a, g, lst

    x = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * rank + 1
    works, *tensors = torch.compile(start, backend="fcoll", fullgraph=True)(x)

    def wait(works):
        for w in works:
            w.wait()

    torch.compile(wait, backend="aot_eager")(works[:2])   # in another backend's graph
    wait(works[2:])                                        # in eager code
    want = start(x)
    for w in want[0]:
        w.wait()
    out["returned"] = max((a - b).abs().max().item() for a, b in
                          zip([tensors[0], tensors[1], *tensors[2]], [want[1], want[2], *want[3]]))

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    data = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    ref = model()
    ref(data).pow(2).mean().backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
    m, handles = model(), []
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(
            lambda p: handles.append(dist.all_reduce(p.grad, async_op=True)))
    loss = torch.compile(m, backend="fcoll")(data).pow(2).mean()
    with compiled_autograd._enable(torch.compile(backend="fcoll")):
        loss.backward()
    for h in handles:
        h.wait()
    out["hooks"] = max((a.grad - b.grad).abs().max().item()
                       for a, b in zip(ref.parameters(), m.parameters()))
    return out


@pytest.mark.parametrize("backend", ["gloo", "fcoll"])
def test_async_works_waited_outside_their_compiled_frame(backend):
    slow_s = 0.05 if backend == "fcoll" else 0.0
    for res in run_ranks(_works_leave_the_frame, 2, backend=backend, args=(slow_s,),
                         timeout_s=200):
        assert res == {"returned": 0.0, "hooks": 0.0}, res


# The calls PyTorch's own remaps compile (the rest graph-break without fcoll).
_PYTORCH_REMAPPED = '''
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
if sys.argv[1] == "fcoll":
    import fcoll
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
x, i = torch.randn(4, 3), torch.arange(4)
calls = {
    "all_reduce": lambda: dist.all_reduce(x),
    "all_reduce_max": lambda: dist.all_reduce(x, dist.ReduceOp.MAX),
    "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(x.new_empty(8, 3), x),
    "_all_gather_base": lambda: dist._all_gather_base(x.new_empty(8, 3), x),
    "all_gather": lambda: dist.all_gather([x.new_empty(4, 3), x.new_empty(4, 3)], x),
    "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(x.new_empty(2, 3), x),
    "_reduce_scatter_base": lambda: dist._reduce_scatter_base(x.new_empty(2, 3), x),
    "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x),
    "all_to_all_single_uneven": lambda: dist.all_to_all_single(x.new_empty(5, 3), x, [2, 3],
                                                               [1, 3]),
}
out = {}
for name, call in calls.items():
    torch._dynamo.reset()
    graphs = []
    torch.compile(lambda: call(), backend=lambda gm, ex: graphs.append(gm) or gm,
                  fullgraph=True)()
    out[name] = [gm.code for gm in graphs] + [
        [getattr(n.target, "__name__", str(n.target)) if callable(n.target) else n.target
         for n in gm.graph.nodes if n.op == "call_function"] for gm in graphs] + [
        [type(n.target).__name__ for n in gm.graph.nodes] for gm in graphs]
print(json.dumps(out))
'''


def test_remapped_calls_record_what_pytorch_records():
    """``import fcoll`` changes nothing in the graphs of the calls PyTorch remaps itself: the
    same op packets (not overloads), no extra ``reshape`` or ``contiguous``, the same node
    names and placeholder order (issue 28.5; PyTorch's Inductor tests compare these)."""
    import json
    import subprocess
    import sys

    graphs = {}
    for mode in ("torch", "fcoll"):
        run = subprocess.run([sys.executable, "-c", _PYTORCH_REMAPPED, mode], check=True,
                             timeout=240, capture_output=True, text=True)
        graphs[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    for name in graphs["torch"]:
        assert graphs["fcoll"][name] == graphs["torch"][name], name


def test_all_gather_tensor_of_a_contiguous_input_records_no_contiguous(fake_pg):
    """``fcoll.all_gather_tensor`` records the collective and its wait only, as PyTorch's does
    (a ``contiguous`` node only for a non-contiguous input)."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    torch.compile(lambda x: fcoll.all_gather_tensor(x, 0, fake_pg), backend=counter,
                  fullgraph=True)(torch.ones(4, 3))
    (gm,) = counter.graphs
    targets = [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert targets == [torch.ops.fcoll.all_gather_into_tensor, torch.ops.fcoll.wait_tensor], \
        targets
