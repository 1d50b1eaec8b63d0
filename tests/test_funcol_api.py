"""fcoll as a drop-in for torch.distributed._functional_collectives and _c10d_functional.

Single-process checks compare names, signatures and op schemas with the installed torch's;
the 2-rank checks run on gloo (and the fcoll backend where it says so): missed waits, group
forms, the new ops (reduce_scatter_tensor_out, point-to-point) and the in-place helpers.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed._functional_collectives as funcol

import fcoll
from fcoll import compat
from fcoll.testing import run_ranks

# Names of funcol's module that are not API: imports, autograd registration helpers, the
# legacy op library and Dynamo's remap table.
_NOT_API = ("Any", "DeviceMesh", "TYPE_CHECKING", "Union", "backend_impl", "c10d", "cast",
            "contextlib", "dist", "fun_col_impl", "get_proxy_mode", "is_torchdynamo_compiling",
            "lib_impl", "lib_impl_autograd", "legacy_lib", "legacy_lib_impl", "math",
            "my_module", "op_def", "op_name", "ops_defs", "sys", "torch",
            "traceable_collective_remaps", "tree_map_only", "warnings")


def _torch_api() -> list[str]:
    return sorted(n for n in dir(funcol)
                  if not n.startswith("_") and n not in _NOT_API and not n.startswith("legacy_")
                  and not n.endswith(("_backward", "_setup_context")))


def test_every_public_name_of_torch_funcol_is_in_fcoll_with_its_signature():
    for name in _torch_api():
        assert hasattr(fcoll, name), name
        theirs, ours = getattr(funcol, name), getattr(fcoll, name)
        if inspect.isfunction(theirs):
            assert (list(inspect.signature(ours).parameters)
                    == list(inspect.signature(theirs).parameters)), name
            for p, q in zip(inspect.signature(ours).parameters.values(),
                            inspect.signature(theirs).parameters.values()):
                assert p.default == q.default or q.default is None, (name, p.name)


def _schemas(ns: str) -> dict[str, str]:
    return {s.name.split("::")[1]: str(s).split("::", 1)[1]
            for s in torch._C._jit_get_all_schemas() if s.name.startswith(ns + "::")}


def test_every_c10d_functional_op_has_an_fcoll_op_with_the_same_schema():
    theirs, ours = _schemas("_c10d_functional"), _schemas("fcoll")
    for name, schema in theirs.items():
        if name.startswith("_"):
            continue
        assert ours.get(name) == schema, name


def test_compat_group_name_type_follows_torch():
    arg = torch.ops.fcoll.all_reduce.default._schema.arguments[-1]
    theirs = torch.ops._c10d_functional.all_reduce.default._schema.arguments[-1]
    assert str(arg.type) == str(theirs.type) and compat.GROUP_NAME_TYPE in ("Any", "str")


# ---------------------------------------------------------------------------------------------
# 2 ranks

def _missed_waits(rank, world_size):
    import torch.distributed as dist

    W = dist.group.WORLD
    out = {}
    # pytorch#133421: aten.to under inference_mode must wait (it decomposes into _to_copy)
    with torch.inference_mode():
        y = fcoll.all_reduce(torch.full((1024,), float(rank + 1)), "sum", W)
        out["cast"] = y.to(torch.bfloat16)
    # gather_dim != 0: async when the rearrangement is a view, waited otherwise
    a = fcoll.all_gather_tensor(torch.full((1, 3), float(rank)), 1, W)
    out["gather_dim_view"] = (type(a).__name__, a.wait())
    b = fcoll.all_gather_single(torch.arange(4.0).reshape(2, 2) + rank, 1, W)
    out["gather_dim_copy"] = b
    # an AsyncCollectiveTensor as input (and as tangent) of compiled functions
    res = {}
    for backend in ("aot_eager", "fcoll"):
        torch._dynamo.reset()
        w = torch.ones(4, requires_grad=True)
        act = fcoll.all_reduce(w * (rank + 1), "sum", W)
        p = torch.compile(lambda t: t * 2, backend=backend, fullgraph=True)(act)
        p.backward(fcoll.all_reduce(torch.ones(4), "sum", W))
        res[backend] = (p.detach(), w.grad)
    out["act_compiled"] = res
    return out


@pytest.mark.timeout(200)
def test_no_missed_wait_on_gloo():
    for rank, out in enumerate(run_ranks(_missed_waits, 2, backend="gloo", timeout_s=180)):
        torch.testing.assert_close(out["cast"], torch.full((1024,), 3.0, dtype=torch.bfloat16))
        kind, value = out["gather_dim_view"]
        assert kind == "AsyncCollectiveTensor"
        torch.testing.assert_close(value, torch.tensor([[0.0, 0, 0, 1, 1, 1]]))
        torch.testing.assert_close(out["gather_dim_copy"],
                                   torch.tensor([[0.0, 1, 1, 2], [2, 3, 3, 4]]))
        for backend, (p, grad) in out["act_compiled"].items():
            torch.testing.assert_close(p, torch.full((4,), 6.0), msg=backend)
            # d/dw of 2 * sum_k (k+1) w: the tangent 2 (an all_reduce of ones), times 2, all
            # reduced again (4 * 2 = 8), times this rank's factor
            torch.testing.assert_close(grad, torch.full((4,), 8.0 * (rank + 1)), msg=backend)


def _ops_and_forms(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    W = dist.group.WORLD
    F = torch.ops.fcoll
    x = torch.arange(4.0) + 10 * rank
    out = {}
    mesh = init_device_mesh("cpu", (2,))
    for form, group in (("name", W.group_name), ("object", W), ("ranks", [0, 1]),
                        ("mesh", mesh), ("mesh_dim", (mesh, 0))):
        out[f"form_{form}"] = fcoll.all_reduce(x, "sum", group).wait()
    if compat.GROUP_NAME_TYPE == "Any":
        out["op_group_object"] = F.wait_tensor(F.all_reduce(x, "sum", W))
    ts = [x.clone(), x.clone() * 2]
    ret = F.all_reduce_coalesced_(ts, "sum", W.group_name)
    out["coalesced_inplace_returns_inputs"] = [r is t for r, t in zip(ret, ts)]
    fcoll.wait_tensor(ts[0])
    out["coalesced_inplace"] = ts
    o = torch.empty(2)
    r = F.reduce_scatter_tensor_out(x, "sum", 2, W.group_name, out=o)
    out["rs_out"] = (r is o, fcoll.wait_tensor(o).clone())
    out["permute"] = fcoll.permute_tensor(x, [1, 0], W).wait()
    # the in-place helpers (what Dynamo's remaps trace dist.* calls into)
    t = x.clone()
    fcoll.all_reduce_inplace(t, dist.ReduceOp.MAX)
    out["all_reduce_inplace"] = t
    g = torch.empty(8)
    fcoll.all_gather_tensor_inplace(g, x)
    out["all_gather_tensor_inplace"] = g
    lst = [torch.empty(4), torch.empty(4)]
    fcoll.all_gather_inplace(lst, x)
    out["all_gather_inplace"] = lst
    rs = torch.empty(2)
    fcoll.reduce_scatter_tensor_inplace(rs, x, "sum")
    out["reduce_scatter_tensor_inplace"] = rs
    a2a = torch.empty(4)
    fcoll.all_to_all_inplace(a2a, x)
    out["all_to_all_inplace"] = a2a
    # point-to-point
    peer = 1 - rank
    if rank == 0:
        fcoll.wait_tensor(fcoll.isend_inplace(x, 1))
    else:
        buf = torch.zeros(4)
        got = fcoll.irecv_inplace(buf, 0)
        out["irecv"] = (fcoll.wait_tensor(got).clone(), buf)
    recv = torch.zeros(4)
    res = fcoll.batch_p2p_ops_inplace(["isend", "irecv"], [peer, peer], [0, 0], [x, recv], W)
    for t in res:
        fcoll.wait_tensor(t)
    out["batch"] = recv
    return out


@pytest.mark.timeout(200)
def test_ops_group_forms_inplace_helpers_and_p2p_on_gloo():
    results = run_ranks(_ops_and_forms, 2, backend="gloo", timeout_s=180)
    xs = [torch.arange(4.0), torch.arange(4.0) + 10]
    total = xs[0] + xs[1]
    for rank, out in enumerate(results):
        for key in [k for k in out if k.startswith("form_")] + (
                ["op_group_object"] if "op_group_object" in out else []):
            torch.testing.assert_close(out[key], total, msg=key)
        assert out["coalesced_inplace_returns_inputs"] == [True, True]
        torch.testing.assert_close(out["coalesced_inplace"], [total, total * 2])
        same, value = out["rs_out"]
        assert same
        torch.testing.assert_close(value, total[2 * rank:2 * rank + 2])
        torch.testing.assert_close(out["permute"], xs[1 - rank])
        torch.testing.assert_close(out["all_reduce_inplace"], xs[1])
        torch.testing.assert_close(out["all_gather_tensor_inplace"], torch.cat(xs))
        torch.testing.assert_close(out["all_gather_inplace"], xs)
        torch.testing.assert_close(out["reduce_scatter_tensor_inplace"],
                                   total[2 * rank:2 * rank + 2])
        torch.testing.assert_close(out["all_to_all_inplace"],
                                   torch.cat([xs[0][2 * rank:2 * rank + 2],
                                              xs[1][2 * rank:2 * rank + 2]]))
        if rank == 1:
            got, buf = out["irecv"]
            torch.testing.assert_close(got, xs[0])
            torch.testing.assert_close(buf, xs[0])
        torch.testing.assert_close(out["batch"], xs[1 - rank])


def _compiled_p2p(rank, world_size):
    import torch.distributed as dist

    import fcoll.ops.inplace as inplace

    def f(x, buf):
        peer = 1 - dist.get_rank()
        outs = inplace.batch_p2p_ops_inplace(["isend", "irecv"], [peer, peer], [0, 0],
                                             [x * 2, buf], None)
        fcoll.wait_tensor(outs[0])
        return outs[1] + 1

    torch._dynamo.reset()
    x = torch.arange(3.0) + 10 * rank
    return torch.compile(f, backend="aot_eager", fullgraph=True)(x, torch.zeros(3))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["gloo", "fcoll"])
def test_p2p_ops_trace_and_run_compiled(backend):
    """fcoll's batch_p2p_ops compiled; on the fcoll backend it runs on fcoll.shm.p2p."""
    results = run_ranks(_compiled_p2p, 2, backend=backend, timeout_s=100)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got, (torch.arange(3.0) + 10 * (1 - rank)) * 2 + 1)


def test_local_tensor_mode_simulates_fcolls_collectives_and_their_gradients():
    """Under PyTorch's LocalTensorMode (ranks simulated in one process, on the fake process
    group) fcoll's functions give the simulated collective's values and gradients, as PyTorch's
    funcol does: all_gather sums the gradient over ranks, reduce_scatter sums the values."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    if dist.is_initialized():
        pytest.skip("needs a process without a default process group")
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    try:
        with LocalTensorMode(frozenset(range(2))):
            group = dist.group.WORLD.group_name
            for dim in (0, 1, 2):
                x = torch.ones(3, 3, 3, requires_grad=True)
                out = fcoll.all_gather_single_autograd(x * 1.0, dim, group) * 1.0
                expected_shape = [3, 3, 3]
                expected_shape[dim] = 6
                assert list(out.shape) == expected_shape
                out.sum().backward()
                assert isinstance(x.grad, LocalTensor)
                for g in x.grad._local_tensors.values():
                    torch.testing.assert_close(g, torch.full((3, 3, 3), 2.0))
            for dim in (0, 1):
                shape = [3, 3]
                shape[dim] = 6
                x = torch.ones(shape, requires_grad=True)
                out = fcoll.reduce_scatter_single_autograd(x * 1.0, "sum", dim, group)
                for v in out._local_tensors.values():
                    torch.testing.assert_close(v, torch.full((3, 3), 2.0))
                out.sum().backward()
                for g in x.grad._local_tensors.values():
                    torch.testing.assert_close(g, torch.ones(shape))
            # each simulated rank sends row r to rank r: rank r receives every rank's row r
            x = LocalTensor({r: torch.tensor([[10.0 * r], [10.0 * r + 1]]) for r in range(2)})
            out = fcoll.all_to_all_single(x, [1, 1], [1, 1], group)
            for r, v in out._local_tensors.items():
                torch.testing.assert_close(v, torch.tensor([[float(r)], [10.0 + r]]))
            y = LocalTensor({r: torch.full((4,), float(r + 1)) for r in range(2)})
            for v in fcoll.all_reduce(y, "sum", group)._local_tensors.values():
                torch.testing.assert_close(v, torch.full((4,), 3.0))
    finally:
        dist.destroy_process_group()
