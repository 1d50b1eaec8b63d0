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
from fcoll.testing import one_rank_group, run_ranks
from fcoll.testing.one_rank import SyncOneRankGroup

# Names of funcol's module that are not its API, by kind: imports (modules, typing, helpers of
# other modules), the legacy ``c10d_functional`` op library and its loop variables, and Dynamo's
# remap table (fcoll remaps through polyfills, fcoll/ops/remaps.py). Funcol's autograd
# registration helpers (``*_backward`` / ``*_setup_context``, the formulas registered for
# ``_c10d_functional`` ops with ``torch.library.register_autograd``) are left out by suffix:
# fcoll registers its own for its own ops (fcoll/ops/autograd.py).
_NOT_API = ("Any", "DeviceMesh", "TYPE_CHECKING", "Union", "backend_impl", "c10d", "cast",
            "contextlib", "dist", "fun_col_impl", "get_proxy_mode", "is_torchdynamo_compiling",
            "lib_impl", "lib_impl_autograd", "legacy_lib", "legacy_lib_impl", "math",
            "my_module", "op_def", "op_name", "ops_defs", "sys", "torch",
            "traceable_collective_remaps", "tree_map_only", "warnings")


def _torch_api() -> list[str]:
    """The installed torch's funcol API: its public names less :data:`_NOT_API`, the
    ``legacy_*`` functions and the autograd registration helpers."""
    return sorted(n for n in dir(funcol)
                  if not n.startswith("_") and n not in _NOT_API and not n.startswith("legacy_")
                  and not n.endswith(("_backward", "_setup_context")))


def _params(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_public_name_of_torch_funcol_is_in_fcoll_with_its_signature():
    """Every name of the installed torch's funcol API is exported by fcoll (``__all__`` too):
    functions with the same parameters (names, kinds, defaults), the same constants, and an
    ``AsyncCollectiveTensor`` that is PyTorch's subclass (torch's ``isinstance`` checks,
    AOTAutograd's wait for one passed into a compiled function among them, see fcoll's)."""
    api = _torch_api()
    assert len(api) >= 20, api   # the enumeration itself still finds torch's API (2.11: 22)
    for name in api:
        assert name in fcoll.__all__ and hasattr(fcoll, name), name
        theirs, ours = getattr(funcol, name), getattr(fcoll, name)
        if inspect.isfunction(theirs):
            assert _params(ours) == _params(theirs), (name, inspect.signature(ours),
                                                      inspect.signature(theirs))
    assert fcoll.REDUCE_OP_TO_STR == funcol.REDUCE_OP_TO_STR
    assert issubclass(fcoll.AsyncCollectiveTensor, funcol.AsyncCollectiveTensor)
    # the private group expansion that funcol-era code (PyTorch's TestExpand, TestPgTag) calls
    # through the module is PyTorch's own, and stays out of __all__
    assert fcoll._expand_group is funcol._expand_group
    assert "_expand_group" not in fcoll.__all__
    assert fcoll._expand_group([[0, 1], [2, 3]], "t") == ("t", [0, 1, 2, 3], 2)


def _schemas(ns: str) -> dict[str, str]:
    return {s.name.split("::")[1] + (f".{s.overload_name}" if s.overload_name else ""):
            str(s).split("::", 1)[1]
            for s in torch._C._jit_get_all_schemas() if s.name.startswith(ns + "::")}


def test_every_c10d_functional_op_has_an_fcoll_op_with_the_same_schema():
    """Every public op overload of the installed torch's ``_c10d_functional`` namespace has an
    ``fcoll`` twin with the same schema string: argument names, types, defaults and alias
    annotations (``Tensor(a!)`` in, ``Tensor(a!)`` out). Where torch's takes ``Any
    group_name`` (2.13), the twin is fcoll's ``.group`` overload and fcoll's default overload
    is the same schema with ``str group_name``."""
    theirs, ours = _schemas("_c10d_functional"), _schemas("fcoll")
    public = {k: v for k, v in theirs.items() if not k.startswith("_")}
    assert len(public) >= 12, sorted(theirs)   # 2.11: 14, 2.13: 17
    for name, schema in public.items():
        if "Any group_name" in schema:
            head, rest = schema.split("(", 1)
            assert ours.get(f"{name}.group") == f"{head}.group({rest}", name
            assert ours.get(name) == schema.replace("Any group_name", "str group_name"), name
        else:
            assert ours.get(name) == schema, (name, ours.get(name), schema)


def test_compat_group_name_type_follows_torch():
    theirs = torch.ops._c10d_functional.all_reduce.default._schema.arguments[-1]
    assert str(theirs.type) == compat.GROUP_NAME_TYPE in ("Any", "str")
    arg = torch.ops.fcoll.all_reduce.default._schema.arguments[-1]
    assert str(arg.type) == "str"  # what Inductor's C++ wrapper can pass (schemas.py)
    assert hasattr(torch.ops.fcoll.all_reduce, "group") == (compat.GROUP_NAME_TYPE == "Any")


def _aliasing_calls(g: str) -> dict[str, tuple]:
    """For each op of fcoll whose schema returns an alias, eager arguments on a one-rank group
    ``g`` and which argument the result must be."""
    x = lambda: torch.arange(4.0)  # noqa: E731
    pair = [x(), x()]
    out4 = torch.empty(4)
    return {
        "all_reduce_": ((x(), "sum", g), {}, 0),
        "broadcast_": ((x(), 0, g), {}, 0),
        "all_reduce_coalesced_": ((pair, "sum", g), {}, 0),
        "all_gather_into_tensor_out": ((x(), 1, g), {"out": out4}, "out"),
        "reduce_scatter_tensor_out": ((x(), "sum", 1, g), {"out": torch.empty(4)}, "out"),
    }


def test_ops_whose_schema_aliases_return_that_argument_itself():
    """Every ``_c10d_functional`` op whose schema returns an alias (``-> Tensor(a!)``) returns
    the very tensor (or list of tensors) it aliases in fcoll too, and it holds the result."""
    aliasing = [name.split(".")[0] for name, schema in _schemas("_c10d_functional").items()
                if not name.startswith("_") and "(a!)" in schema.split("->")[1]]
    with one_rank_group(SyncOneRankGroup("funcol-api-one-rank")) as group:
        calls = _aliasing_calls(group.group_name)
        assert sorted(aliasing) == sorted(calls), (aliasing, sorted(calls))
        for name, (args, kwargs, which) in calls.items():
            target = kwargs[which] if which == "out" else args[which]
            result = getattr(torch.ops.fcoll, name)(*args, **kwargs)
            if isinstance(target, list):
                assert isinstance(result, list) and all(r is t for r, t in zip(result, target))
                waited = [fcoll.wait_tensor(t) for t in target]
            else:
                assert result is target, name
                waited = [fcoll.wait_tensor(target)]
            for t in waited:
                torch.testing.assert_close(t, torch.arange(4.0), msg=name)


def test_inductor_cpp_wrapper_compiles_fcoll_ops():
    """Inductor's C++ wrapper (``cpp_wrapper=True``) calls fcoll's ops as custom ops, which it
    can do only with no ``Any`` argument: fcoll's default overloads take ``str group_name``
    (on 2.13 the failure was "arg type Any is not yet supported by custom_op_wrapper"). A group
    object given to a raw op becomes a graph input, which the C++ wrapper refuses for
    PyTorch's own ops too; fcoll's API resolves it to a name while tracing."""
    from torch._inductor.utils import run_and_get_code

    with one_rank_group(SyncOneRankGroup("funcol-api-cpp-wrapper")) as group:
        F = torch.ops.fcoll

        def step(x):
            y = fcoll.wait_tensor(fcoll.all_reduce(x + 1, "sum", group))
            z = F.wait_tensor(F.all_gather_into_tensor(y * 2, 1, group.group_name))
            return z - 1

        x = torch.arange(6.0).reshape(2, 3)
        torch._dynamo.reset()
        with torch._inductor.config.patch(cpp_wrapper=True):
            out, codes = run_and_get_code(torch.compile(step, backend="inductor",
                                                        fullgraph=True), x)
        torch._dynamo.reset()
        torch.testing.assert_close(out, (x + 1) * 2 - 1)
        code = "\n".join(codes)
        for op in ("all_reduce", "all_gather_into_tensor"):  # "fcoll::op" (2.13), "fcoll.op"
            assert f"fcoll::{op}" in code or f"fcoll.{op}" in code, (op, code)


def test_numpy_is_a_dependency_so_torch_never_warns_that_it_failed_to_initialize_numpy():
    """A user who followed the README has numpy (fcoll requires it), so importing torch and
    fcoll and using ``.numpy()`` prints no "Failed to initialize NumPy" (torch's warning when
    numpy is missing, which every run of the main job used to print)."""
    import importlib.metadata
    import subprocess
    import sys

    required = [r.split(";")[0].strip() for r in importlib.metadata.requires("fcoll")
                if "extra ==" not in r]
    assert "numpy" in required, required
    run = subprocess.run([sys.executable, "-W", "default", "-c",
                          "import torch, fcoll; print(torch.ones(2).numpy().sum())"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert "NumPy" not in run.stderr and "numpy" not in run.stderr.lower(), run.stderr
    assert run.stdout.strip() == "2.0"


# ---------------------------------------------------------------------------------------------
# 2 ranks

# Aliasing aten ops applied to an un-waited result: views stay async (PyTorch's rule), every
# other op (in-place and out= ones too) waits first. name -> op on a [4, 6] tensor.
VIEWS = {
    "view": lambda t: t.view(24), "reshape": lambda t: t.reshape(6, 4), "t": lambda t: t.t(),
    "transpose": lambda t: t.transpose(0, 1), "slice": lambda t: t[1:3],
    "select": lambda t: t.select(0, 2), "narrow": lambda t: t.narrow(1, 1, 3),
    "unsqueeze": lambda t: t.unsqueeze(0), "expand": lambda t: t.unsqueeze(0).expand(2, 4, 6),
    "permute": lambda t: t.permute(1, 0), "unflatten": lambda t: t.unflatten(1, (2, 3)),
    "diagonal": lambda t: t.diagonal(), "detach": lambda t: t.detach(),
    "alias": lambda t: torch.ops.aten.alias(t), "view_dtype": lambda t: t.view(torch.float64),
    "as_strided": lambda t: t.as_strided((2, 2), (6, 1)), "split": lambda t: t.split(2),
    "unbind": lambda t: t.unbind(0), "chunk": lambda t: t.chunk(3, 1),
}
WRITES = {
    "add_": lambda t: t.add_(1), "mul_": lambda t: t.mul_(2), "zero_": lambda t: t.zero_(),
    "copy_": lambda t: t.copy_(torch.ones(4, 6, dtype=t.dtype)),
    "out=": lambda t: torch.add(torch.ones(4, 6, dtype=t.dtype), 1, out=t),
    "index_put_": lambda t: t.index_put_((torch.tensor([0]),), torch.tensor(7, dtype=t.dtype)),
}


def _materialize(r):
    return [x.clone() for x in r] if isinstance(r, (list, tuple)) else r.clone()


def _missed_waits(rank, world_size):
    """Every place an un-waited result can go, on 2 ranks. The results are int64 averages:
    every backend sums integers and divides when the collective is waited
    (``fcoll.ops.pending`` finishers), so a missed wait reads the sum (2x the value) and leaves
    the collective registered (``pending.num_pending()`` > 0)."""
    import torch.distributed as dist

    from fcoll.ops import pending

    W = dist.group.WORLD
    out = {}

    def fresh():   # ranks 0, 1 give 10, 20: the average is 15, the sum 30
        return fcoll.all_reduce(torch.full((4, 6), 10 * (rank + 1)), "avg", W)

    # pytorch#133421: aten.to under inference_mode must wait (it decomposes into _to_copy)
    with torch.inference_mode():
        y = fresh().to(torch.bfloat16)
        out["cast_inference_mode"] = (type(y) is torch.Tensor, y, pending.num_pending())
        g = fcoll.all_gather_single(torch.full((2, 2), 10 * (rank + 1)), 0, W).to(torch.float64)
        out["gather_cast_inference_mode"] = (type(g) is torch.Tensor, g, pending.num_pending())
    for name, op in VIEWS.items():
        r = op(fresh())
        kinds = {type(x).__name__ for x in (r if isinstance(r, (list, tuple)) else [r])}
        out[f"view {name}"] = (kinds, pending.num_pending(), _materialize(r),
                               pending.num_pending())
    for name, op in WRITES.items():
        t = fresh()
        r = op(t)
        out[f"write {name}"] = (r.clone(), t.clone(), pending.num_pending())
    # a view of an un-waited result fed to a fcoll op (its schema reads it): waited first
    v = fresh()[1:3]
    z = fcoll.all_reduce(v, "sum", W).wait()
    out["view into collective"] = (z, pending.num_pending())
    # gather_dim != 0: async when the rearrangement is a view (PyTorch's rule), waited otherwise
    a = fcoll.all_gather_single(torch.full((1, 3), rank), 1, W)
    out["gather_dim_view"] = (type(a).__name__, pending.num_pending(), a.clone())
    b = fcoll.all_gather_tensor(torch.arange(4).reshape(2, 2) + rank, 1, W)
    out["gather_dim_copy"] = (type(b).__name__, pending.num_pending(), b)
    # negative dims count from the end, the view case included (PyTorch's funcol fails there
    # with a reshape error); a dim out of range is refused before anything is issued
    a = fcoll.all_gather_single(torch.full((1, 3), rank), -1, W)
    out["gather_dim_negative"] = (type(a).__name__, pending.num_pending(), a.clone())
    out["scatter_dim_negative"] = fcoll.reduce_scatter_tensor(
        torch.arange(4.0).reshape(1, 4) + rank, "sum", -1, W).wait()
    refused = []
    for call in (lambda: fcoll.all_gather_single(torch.ones(2, 3), 2, W),
                 lambda: fcoll.reduce_scatter_tensor(torch.ones(2, 4), "sum", -3, W)):
        with pytest.raises(IndexError) as e:
            call()
        refused.append((str(e.value), pending.num_pending()))
    out["dim_out_of_range"] = refused
    # an un-waited result as the input, and as the tangent, of compiled functions (forward and
    # backward), returned as a plain value or as a view of itself
    res = {}
    for backend in ("aot_eager", "inductor", "fcoll"):
        for ret, fn in (("value", lambda t: t * 2), ("view", lambda t: t.unsqueeze(0))):
            torch._dynamo.reset()
            w = torch.ones(4, requires_grad=True)
            act = fcoll.all_reduce(w * (rank + 1), "avg", W)
            p = torch.compile(fn, backend=backend, fullgraph=True)(act)
            p.backward(fcoll.all_reduce(torch.ones_like(p), "sum", W))
            res[f"{backend} {ret}"] = (p.detach().reshape(4).clone(), w.grad,
                                       pending.num_pending())
    out["act_compiled"] = res
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["gloo", "fcoll"])
def test_no_missed_wait_anywhere_an_async_result_flows(backend):
    avg = torch.full((4, 6), 15)
    for rank, out in enumerate(run_ranks(_missed_waits, 2, backend=backend, timeout_s=380)):
        plain, y, left = out["cast_inference_mode"]
        assert plain and left == 0
        torch.testing.assert_close(y, avg.to(torch.bfloat16))
        plain, g, left = out["gather_cast_inference_mode"]
        assert plain and left == 0
        torch.testing.assert_close(g, torch.cat([torch.full((2, 2), 10.0),
                                                 torch.full((2, 2), 20.0)]).double())
        for name, op in VIEWS.items():
            kinds, in_flight, value, left = out[f"view {name}"]
            assert kinds == {"AsyncCollectiveTensor"} and in_flight == 1, (name, kinds)
            assert left == 0, name
            torch.testing.assert_close(value, _materialize(op(avg.clone())), msg=name)
        for name, op in WRITES.items():
            r, t, left = out[f"write {name}"]
            want = avg.clone()
            op(want)
            assert left == 0, name
            torch.testing.assert_close((r, t), (want, want), msg=name)
        z, left = out["view into collective"]
        torch.testing.assert_close(z, torch.full((2, 6), 30))
        assert left == 0
        kind, in_flight, value = out["gather_dim_view"]
        assert (kind, in_flight) == ("AsyncCollectiveTensor", 1)
        torch.testing.assert_close(value, torch.tensor([[0, 0, 0, 1, 1, 1]]))
        kind, left, value = out["gather_dim_copy"]
        assert (kind, left) == ("Tensor", 0)
        torch.testing.assert_close(value, torch.tensor([[0, 1, 1, 2], [2, 3, 3, 4]]))
        kind, in_flight, value = out["gather_dim_negative"]
        assert (kind, in_flight) == ("AsyncCollectiveTensor", 1)
        torch.testing.assert_close(value, torch.tensor([[0, 0, 0, 1, 1, 1]]))
        torch.testing.assert_close(out["scatter_dim_negative"],
                                   torch.tensor([[1.0, 3.0]]) + 4 * rank)
        (gathered, left_g), (scattered, left_s) = out["dim_out_of_range"]
        assert gathered == (f"fcoll.all_gather_tensor: rank {rank}: gather_dim=2 is out of range "
                            "for an input of shape [2, 3] (expected -2 <= gather_dim < 2)")
        assert "scatter_dim=-3 is out of range for an input of shape [2, 4]" in scattered
        assert left_g == left_s == 0
        for key, (p, grad, left) in out["act_compiled"].items():
            # p = s * avg_k (k+1) w with s = 2 (value) or 1 (view): 3 or 1.5. The tangent is 2
            # (a sum of ones); avg's adjoint averages s * 2 over the ranks (equal): s * 2, times
            # this rank's factor (rank + 1)
            s = 2.0 if key.endswith("value") else 1.0
            torch.testing.assert_close(p, torch.full((4,), 1.5 * s), msg=key)
            torch.testing.assert_close(grad, torch.full((4,), 2 * s * (rank + 1)), msg=key)
            assert left == 0, key


def _every_function(x, rank, g):
    """Each function of the funcol API that takes a group, called with group ``g``; returns
    its results, waited."""
    peer = 1 - rank
    out = {
        "all_reduce": fcoll.all_reduce(x, "sum", g),
        "all_reduce_coalesced": fcoll.all_reduce_coalesced([x, 2 * x], "max", g),
        "all_gather_single dim 0": fcoll.all_gather_single(x, 0, g),
        "all_gather_single dim 1": fcoll.all_gather_single(x.view(2, 2), 1, g),
        "all_gather_single_autograd": fcoll.all_gather_single_autograd(x, 0, g),
        "all_gather_single_coalesced": fcoll.all_gather_single_coalesced([x, x[:1]], g),
        "reduce_scatter_single": fcoll.reduce_scatter_single(x, "sum", 0, g),
        "reduce_scatter_single dim 1": fcoll.reduce_scatter_single(x.view(2, 2), "sum", 1, g),
        "reduce_scatter_single_coalesced":
            fcoll.reduce_scatter_single_coalesced([x, x[:2]], "sum", [0, 0], g),
        "all_to_all_single": fcoll.all_to_all_single(x, None, None, g),
        "all_to_all_single uneven": fcoll.all_to_all_single(
            x, [1, 2] if rank == 0 else [3, 2], [1, 3] if rank == 0 else [2, 2], g),
        "broadcast": fcoll.broadcast(x, 1, g),
        "permute_tensor": fcoll.permute_tensor(x, [1, 0], g),
    }
    t = x.clone()
    fcoll.all_reduce_inplace(t, "max", g)
    out["all_reduce_inplace"] = t
    o = torch.empty(8)
    fcoll.all_gather_tensor_inplace(o, x, g)
    out["all_gather_tensor_inplace"] = o
    lst = [torch.empty(4), torch.empty(4)]
    fcoll.all_gather_inplace(lst, x, g)
    out["all_gather_inplace"] = lst
    o = torch.empty(2)
    fcoll.reduce_scatter_tensor_inplace(o, x, "sum", g)
    out["reduce_scatter_tensor_inplace"] = o
    o = torch.empty(4)
    fcoll.all_to_all_inplace(o, x, group=g)
    out["all_to_all_inplace"] = o
    if rank == 0:
        fcoll.wait_tensor(fcoll.isend_inplace(x, 1, group=g))
    else:
        buf = torch.zeros(4)
        fcoll.wait_tensor(fcoll.irecv_inplace(buf, 0, group=g))
        out["irecv_inplace"] = buf
    recv = torch.zeros(4)
    for r in fcoll.batch_p2p_ops_inplace(["isend", "irecv"], [peer, peer], [0, 0], [x, recv], g):
        fcoll.wait_tensor(r)
    out["batch_p2p_ops_inplace"] = recv
    return {k: ([fcoll.wait_tensor(t) for t in v] if isinstance(v, list) else fcoll.wait_tensor(v))
            for k, v in out.items()}


def _expected(rank: int) -> dict:
    xs = [torch.arange(4.0), torch.arange(4.0) + 10]
    total, mine, other = xs[0] + xs[1], slice(2 * rank, 2 * rank + 2), xs[1 - rank]
    two = [x.view(2, 2) for x in xs]
    return {
        "all_reduce": total, "all_reduce_coalesced": [xs[1], 2 * xs[1]],
        "all_gather_single dim 0": torch.cat(xs), "all_gather_single dim 1": torch.cat(two, 1),
        "all_gather_single_autograd": torch.cat(xs),
        "all_gather_single_coalesced": [torch.cat(xs), torch.cat([xs[0][:1], xs[1][:1]])],
        "reduce_scatter_single": total[mine], "reduce_scatter_single dim 1":
            (two[0] + two[1])[:, rank:rank + 1],
        "reduce_scatter_single_coalesced": [total[mine], total[:2][rank:rank + 1]],
        "all_to_all_single": torch.cat([xs[0][mine], xs[1][mine]]),
        "all_to_all_single uneven": (torch.cat([xs[0][:1], xs[1][:2]]) if rank == 0 else
                                     torch.cat([xs[0][1:], xs[1][2:]])),
        "broadcast": xs[1], "permute_tensor": other, "all_reduce_inplace": xs[1],
        "all_gather_tensor_inplace": torch.cat(xs), "all_gather_inplace": xs,
        "reduce_scatter_tensor_inplace": total[mine],
        "all_to_all_inplace": torch.cat([xs[0][mine], xs[1][mine]]),
        "batch_p2p_ops_inplace": other, **({"irecv_inplace": xs[0]} if rank == 1 else {}),
    }


def _ops_and_forms(rank, world_size):
    """Every function with each group form PyTorch accepts, and the ops' own forms."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    W = dist.group.WORLD
    F = torch.ops.fcoll
    x = torch.arange(4.0) + 10 * rank
    mesh, mesh2 = init_device_mesh("cpu", (2,)), init_device_mesh("cpu", (2, 1))
    forms = {"name": W.group_name, "object": W, "ranks": [0, 1], "mesh": mesh,
             "mesh_dim": (mesh, 0), "2-D mesh_dim": (mesh2, 0)}
    out = {form: _every_function(x, rank, g) for form, g in forms.items()}
    if compat.GROUP_NAME_TYPE == "Any":   # 2.13: the ops take a ProcessGroup as group_name
        out["op_group_object"] = F.wait_tensor(F.all_reduce(x, "sum", W))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["gloo", "fcoll"])
def test_every_function_takes_every_group_form(backend):
    """Group as name, ProcessGroup, list of ranks, 1-D DeviceMesh and (mesh, dim) of a 1-D and
    a 2-D mesh, wherever PyTorch's funcol takes a group: the collectives, the ``*_inplace``
    helpers, ``permute_tensor`` and point-to-point; values against ones computed here."""
    results = run_ranks(_ops_and_forms, 2, backend=backend, timeout_s=280)
    for rank, out in enumerate(results):
        expected = _expected(rank)
        if "op_group_object" in out:
            torch.testing.assert_close(out.pop("op_group_object"), expected["all_reduce"])
        assert len(out) == 6
        for form, got in out.items():
            assert sorted(got) == sorted(expected), form
            for key, want in expected.items():
                torch.testing.assert_close(got[key], want, msg=f"{form}: {key} rank {rank}")


def test_a_rank_list_before_init_process_group_says_what_is_missing():
    """A rank list names a group only through the default process group; before
    ``init_process_group`` PyTorch's resolver fails a bare ``assert`` (no text), so the message
    says what to call instead of ending in an empty reason."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"cannot resolve \[0\] to a process group: no default "
                                         r"process group: call dist.init_process_group first"):
        fcoll.all_reduce(torch.ones(2), "sum", [0])


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
    """fcoll's batch_p2p_ops compiled; on the fcoll backend it runs on fcoll.shm.p2p.sendrecv."""
    results = run_ranks(_compiled_p2p, 2, backend=backend, timeout_s=100)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got, (torch.arange(3.0) + 10 * (1 - rank)) * 2 + 1)


def _pytorchs_p2p_ops(rank, world_size):
    """PyTorch's own ``_c10d_functional`` p2p ops and funcol wrappers on this rank's group,
    eager, and PyTorch's wrapper compiled by fcoll's backend (which lowers the ops to fcoll's)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as torch_funcol

    C, W, peer = torch.ops._c10d_functional, dist.group.WORLD, 1 - rank
    x = torch.arange(3.0) + 10 * rank
    out = {}
    if rank == 0:
        C.wait_tensor(C.isend(x, 1, 3, W.group_name))
        torch_funcol.wait_tensor(torch_funcol.isend_inplace(x * 2, 1, tag=4))
    else:
        a, b = torch.zeros(3), torch.zeros(3)
        C.wait_tensor(C.irecv(a, 0, 3, W.group_name))
        torch_funcol.wait_tensor(torch_funcol.irecv_inplace(b, 0, tag=4))
        out["irecv"], out["irecv_inplace"] = a, b
    recv = torch.zeros(3)
    try:
        for t in C.batch_p2p_ops(["isend", "irecv"], [peer, peer], [5, 5], [x, recv],
                                 W.group_name):
            C.wait_tensor(t)
        out["batch_p2p_ops"] = recv
    except RuntimeError as e:   # PyTorch's C++ op asks the group for a C++ device backend
        out["batch_p2p_ops"] = str(e)
    sent, got = torch.ops.fcoll.batch_p2p_ops(["isend", "irecv"], [peer, peer], [7, 7],
                                              [x, torch.zeros(3)], W.group_name)
    fcoll.wait_tensor(sent)
    out["fcoll batch_p2p_ops"] = fcoll.wait_tensor(got)   # fcoll's receive: a new tensor

    def swap(x, buf):
        outs = torch_funcol.batch_p2p_ops_inplace(["isend", "irecv"], [peer, peer], [6, 6],
                                                  [x * 2, buf], W)
        torch_funcol.wait_tensor(outs[0])
        return torch_funcol.wait_tensor(outs[1]) + 1

    torch._dynamo.reset()
    out["compiled"] = torch.compile(swap, backend="fcoll", fullgraph=True)(x, torch.zeros(3))
    return out


@pytest.mark.timeout(200)
@pytest.mark.skipif(not hasattr(torch.ops._c10d_functional, "isend"),
                    reason="this torch's _c10d_functional has no p2p ops (2.11)")
@pytest.mark.parametrize("backend", ["gloo", "fcoll"])
def test_pytorchs_own_p2p_ops_run_on_the_group(backend):
    """``torch.ops._c10d_functional.isend / irecv`` and PyTorch's funcol p2p wrappers run on a
    group of fcoll's backend (its send/recv), as on gloo, and a function calling PyTorch's
    ``batch_p2p_ops_inplace`` compiles with fcoll's backend (which lowers the op to fcoll's).

    The one exception: PyTorch's eager C++ ``_c10d_functional.batch_p2p_ops`` asks the group
    for its C++ device backend, which a Python ``ProcessGroup`` (fcoll's) cannot have
    (c10d's ``Backend`` has no Python constructor), so it raises there; fcoll's own
    ``torch.ops.fcoll.batch_p2p_ops`` runs on both."""
    for rank, out in enumerate(run_ranks(_pytorchs_p2p_ops, 2, backend=backend, timeout_s=180)):
        other = torch.arange(3.0) + 10 * (1 - rank)
        if rank == 1:
            torch.testing.assert_close(out["irecv"], other)
            torch.testing.assert_close(out["irecv_inplace"], other * 2)
        if backend == "gloo":
            torch.testing.assert_close(out["batch_p2p_ops"], other)
        else:
            assert "No backend type associated with device type cpu" in out["batch_p2p_ops"]
        torch.testing.assert_close(out["fcoll batch_p2p_ops"], other)
        torch.testing.assert_close(out["compiled"], other * 2 + 1)


def test_every_group_form_compiles_with_no_graph_break():
    """Inside ``torch.compile(fullgraph=True)`` every function takes every group form (a rank
    list or DeviceMesh once graph-broke on torch 2.13: a ``c10d.GroupName`` NewType call),
    and each form names the same group in the graph. Fake process group, 2 ranks, rank 0."""
    import torch._dynamo.testing
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("needs a process without a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh, mesh2 = init_device_mesh("cpu", (2,)), init_device_mesh("cpu", (2, 1))
        W = dist.group.WORLD
        forms = {"name": W.group_name, "object": W, "ranks": [0, 1], "mesh": mesh,
                 "mesh_dim": (mesh, 0), "2-D mesh_dim": (mesh2, 0)}

        def every(x, g):
            return [fcoll.all_reduce(x, "sum", g), *fcoll.all_reduce_coalesced([x], "sum", g),
                    fcoll.all_gather_single(x, 0, g), fcoll.all_gather_tensor(x, 1, g),
                    *fcoll.all_gather_single_coalesced([x], g),
                    fcoll.reduce_scatter_single(x, "sum", 0, g),
                    *fcoll.reduce_scatter_tensor_coalesced([x], "sum", [0], g),
                    fcoll.all_to_all_single(x, None, None, g), fcoll.broadcast(x, 1, g),
                    fcoll.permute_tensor(x, [1, 0], g)]

        names = {}
        for form, g in forms.items():
            counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
            torch._dynamo.reset()
            torch.compile(lambda x: every(x, g), backend=counter, fullgraph=True)(
                torch.ones(4, 2))
            (gm,) = counter.graphs
            starts = [n for n in gm.graph.nodes if n.op == "call_function"   # op packets
                      and str(n.target).startswith("fcoll.") and "wait" not in str(n.target)]
            assert len(starts) == 10, (form, [n.target for n in starts])
            names[form] = {n.args[-1] for n in starts}
        mesh_name = mesh.get_group(0).group_name
        assert names["name"] == names["object"] == names["ranks"] == {W.group_name}, names
        assert names["mesh"] == names["mesh_dim"] == {mesh_name}, names
        assert len(names["2-D mesh_dim"]) == 1, names
    finally:
        dist.destroy_process_group()


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
