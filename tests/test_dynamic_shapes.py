"""Steps whose shapes change from call to call (a batch or a sequence of varying length), as
``torch.compile`` compiles them: once with static shapes, then with a size symbol after the
first new shape (automatic dynamic), or dynamic from the start (``dynamic=True``).

An all_gather's output holds an expression of its input's size (``2*s0`` rows on 2 ranks), and
Inductor reads a symbol's value only off an input that is the symbol itself: a
``compute="inductor"`` segment that received only the gathered tensor failed with Inductor's
``For 2*s0, expected [s0] to have been codegen-ed``. Values are checked against eager on
every shape. The faults were in compiling, not in the process group, so the job runs on fcoll's
group only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fcoll.testing import run_ranks

#: how each case compiles: (torch.compile backend, fcoll's compute, dynamic=)
CASES = (("fcoll", "eager", None), ("fcoll", "inductor", None), ("fcoll", "inductor", True),
         ("inductor", None, None))
BATCHES = (4, 6, 9, 1)


def _step(w1, w2, x, group):
    """Activations all_gathered (twice: one bucket in the static graph, two collectives in the
    dynamic one), all_reduced and reduce_scattered, then the gradients of both weights
    all_reduced."""
    import fcoll

    a = fcoll.all_gather_tensor(x, 0, group)
    b = fcoll.all_gather_tensor(x * 2, 0, group)
    h = a @ w1 + b @ w1
    r1 = fcoll.all_reduce(h, "sum", group)
    r2 = fcoll.all_reduce(h * 3, "avg", group)
    rs = fcoll.reduce_scatter_tensor(h, "sum", 0, group)
    y = torch.tanh(r1 + r2) @ w2
    loss = (y * y).mean() + rs.sum()
    g1, g2 = torch.autograd.grad(loss, [w1, w2])
    return (loss.detach(), fcoll.all_reduce(g1, "avg", group),
            fcoll.all_reduce(g2, "avg", group), rs)


def _varying_batches(rank: int, world: int) -> dict:
    from fcoll.compile.backend import register_compile_listener

    group = dist.group.WORLD
    w1 = torch.randn(16, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    w2 = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
    symbolic: list[bool] = []

    def saw(record) -> None:
        symbolic.append(any(isinstance(d, torch.SymInt)
                            for n in record.after.graph.nodes if n.op == "placeholder"
                            for d in getattr(n.meta.get("val"), "shape", ())))

    handle = register_compile_listener(saw)
    out = {}
    for backend, compute, dynamic in CASES:
        torch._dynamo.reset()
        options = {"options": {"compute": compute}} if backend == "fcoll" else {}
        compiled = torch.compile(_step, backend=backend, dynamic=dynamic, **options)
        worst = 0.0
        for batch in BATCHES:
            x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(batch + rank))
            for want, got in zip(_step(w1, w2, x, group), compiled(w1, w2, x, group)):
                assert got.shape == want.shape, (backend, compute, dynamic, batch)
                worst = max(worst, (want - got).abs().max().item())
        out[backend, compute, dynamic] = worst
    handle.remove()
    out["fcoll saw a symbolic graph"] = any(symbolic)
    return out


def test_varying_batches_compiled_equal_eager():
    for res in run_ranks(_varying_batches, 2, backend="fcoll", timeout_s=400):
        assert res.pop("fcoll saw a symbolic graph")
        for case, worst in res.items():
            assert worst < 1e-3, (case, worst)


def test_inductor_segment_after_an_all_gather_binds_the_size_symbol():
    """Unit: ``x (s0, 16) -> all_gather (2*s0, 16) -> wait -> mm``. The segment after the wait
    takes ``x`` too (it binds ``s0``), and Inductor compiles it."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fcoll
    from fcoll.compile.inductor_compute import ComputeSegment, split_segments

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        name = dist.group.WORLD.group_name

        def f(x, w):
            gathered = torch.ops.fcoll.all_gather_into_tensor(x + 1, 2, name)
            return fcoll.wait_tensor(gathered) @ w

        gm = make_fx(f, tracing_mode="symbolic")(torch.randn(4, 16), torch.randn(16, 8))
        segments = [s for s in split_segments(gm) if isinstance(s, ComputeSegment)]
        last = segments[-1]
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        assert x in last.inputs and x not in last.nodes[0].all_input_nodes
        for s in segments:
            compile_fx_inner(s.graph_module(gm), [n.meta["val"] for n in s.inputs])
    finally:
        dist.destroy_process_group()
