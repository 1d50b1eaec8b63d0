"""``torch.library.opcheck`` for every ``torch.ops.fcoll`` op over dtypes, shapes, requires_grad.

opcheck runs each op for real and reads its output without a ``wait_tensor``. An op calls its
group's backend on every group size, as PyTorch's ops do, and a backend may complete later (gloo
does, on its own thread), so these tests use ``fcoll.testing.one_rank.SyncOneRankGroup``: a
Python ``ProcessGroup`` of one rank whose collectives complete inside the call. Multi-rank values are checked in
test_ops_multiprocess.py.

``torch.ops._c10d_functional.wait_tensor`` returns its input buffer, which opcheck's
``test_schema`` and ``test_faketensor`` flag (PyTorch exempts its own namespace from the aliasing
rule for custom ops). fcoll's ``wait_tensor`` kernel returns a completed copy and passes every
check; the test below pins both facts.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import fcoll  # noqa: F401
from fcoll.testing import one_rank_group
from fcoll.testing.one_rank import SyncOneRankGroup

ops = torch.ops.fcoll

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64, torch.uint8,
          torch.bool]
SHAPES = [(5,), (4, 3), (2, 3, 4)]


@pytest.fixture(scope="module")
def group_name():
    with one_rank_group(SyncOneRankGroup("sync-one-rank")) as group:
        yield group.group_name


def make(shape, dtype, requires_grad=False):
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape).bool()
    elif dtype.is_floating_point:
        t = torch.randn(shape, dtype=dtype)
    else:
        t = torch.randint(0, 100, shape, dtype=dtype)
    return t.requires_grad_(requires_grad and dtype.is_floating_point)


def reduce_op_for(dtype):
    return "sum" if dtype != torch.bool else "max"


def samples(group_name, shape, dtype, requires_grad):
    x = lambda: make(shape, dtype, requires_grad)  # noqa: E731
    r = reduce_op_for(dtype)
    yield ops.all_reduce.default, (x(), r, group_name), {}
    yield ops.all_reduce_coalesced.default, ([x(), x()], r, group_name), {}
    yield ops.all_gather_into_tensor.default, (x(), 1, group_name), {}
    yield ops.all_gather_into_tensor_coalesced.default, ([x(), x()], 1, group_name), {}
    yield ops.reduce_scatter_tensor.default, (x(), r, 1, group_name), {}
    yield ops.reduce_scatter_tensor_coalesced.default, ([x(), x()], r, 1, group_name), {}
    yield ops.all_to_all_single.default, (x(), [shape[0]], [shape[0]], group_name), {}
    yield ops.broadcast.default, (x(), 0, group_name), {}
    if not requires_grad:
        yield ops.all_reduce_.default, (x(), r, group_name), {}
        yield ops.all_reduce_coalesced_.default, ([x(), x()], r, group_name), {}
        yield ops.broadcast_.default, (x(), 0, group_name), {}
        yield (ops.all_gather_into_tensor_out.default, (x(), 1, group_name),
               {"out": make(shape, dtype)})


CASES = [(d, s, g) for d in DTYPES for s in SHAPES for g in (False, True)
         if d.is_floating_point or not g]


@pytest.mark.parametrize("dtype,shape,requires_grad", CASES,
                         ids=[f"{d}-{'x'.join(map(str, s))}-{'grad' if g else 'nograd'}"
                              for d, s, g in CASES])
def test_opcheck_every_op(group_name, dtype, shape, requires_grad):
    for op, args, kwargs in samples(group_name, shape, dtype, requires_grad):
        opcheck(op, args, kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_opcheck_wait_tensor_passes_where_pytorch_aliases(group_name, dtype):
    x = make((4, 3), dtype, requires_grad=dtype.is_floating_point)
    opcheck(ops.wait_tensor.default, (x,))
    theirs = opcheck(torch.ops._c10d_functional.wait_tensor.default, (x,),
                     raise_exception=False)
    assert sorted(k for k, v in theirs.items() if v != "SUCCESS") == ["test_faketensor",
                                                                      "test_schema"]


def test_wait_tensor_completes_the_collective_buffer(group_name):
    """``wait_tensor(y)`` completes ``y`` itself (in-place callers read ``y`` after the wait), and
    its result is a copy that shares no storage with ``y``."""
    x = torch.arange(6.0).reshape(2, 3)
    y = ops.all_reduce(x, "sum", group_name)
    out = ops.wait_tensor(y)
    torch.testing.assert_close(y, x)
    torch.testing.assert_close(out, x)
    assert out.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()


def test_fake_kernels_with_symbolic_shapes(group_name):
    """Fake kernels compute output shapes from SymInts (dynamic shapes under make_fx)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, y):
        a = ops.all_gather_into_tensor(x, 2, group_name)
        b = ops.reduce_scatter_tensor(a, "sum", 2, group_name)
        c = ops.all_to_all_single(y, [y.size(0) - 1, 1], [1, y.size(0) - 1], group_name)
        return ops.wait_tensor(a), ops.wait_tensor(b), ops.wait_tensor(c)

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(6, 3), torch.randn(5, 2))
    x, y = (n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")
    a, b, c = (n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"
               and n.target is ops.wait_tensor.default)
    expr = lambda shape: [s.node.expr for s in shape]  # noqa: E731
    assert expr(a.shape) == expr([2 * x.shape[0], x.shape[1]])
    assert expr(b.shape) == expr(x.shape)
    assert expr(c.shape) == expr(y.shape)
    assert all(isinstance(s, torch.SymInt) for s in (*a.shape, *b.shape, *c.shape))
