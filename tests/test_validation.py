"""Validation before any data moves, on every rank, for every op and argument (issue #15,
deliverable 2).

A table-generated matrix of malformed calls (every op x every bad-argument kind, each made on
every rank and on rank 1 only) runs in one ``run_ranks`` call per layout: 2 ranks on one host,
and 2 emulated hosts x 2 ranks (a hierarchical group, where the bad rank's peers on the other
host must hear of it across the gloo link). For every call:

- every rank raises ``ValueError`` or ``TypeError`` naming the op, the argument and the rank
  (the rank whose arguments were bad: its peer raises the same message, sent in the header);
- nothing hangs (the group timeout is short; a hang breaks the group and fails every later
  case; the whole run has a hard timeout);
- no output was written (outputs are filled with a sentinel that must survive);
- the group is usable afterwards: a correct all_reduce follows every case and must be right.

Then valid edge cases (zero-size tensors in every op) must work, and no segment is left.
The calls go to the process group's methods (what ``torch.distributed`` calls), so c10d's own
Python-side checks, which run on one rank only, are not what is tested.
"""

from __future__ import annotations

import datetime
import itertools

import pytest
import torch
import torch.distributed as dist

from fcoll.testing import fcoll_segments, run_ranks

WORLD = 2
GROUP_TIMEOUT_S = 10.0  # a case that hangs breaks the group here, and every later case fails
RUN_TIMEOUT_S = 150.0
SENTINEL = -7.0

# reduce ops x dtypes the backend must reject (the table of fcoll.ops.reduce), as c10d names
UNSUPPORTED_REDUCTIONS = [
    (rop, dt) for dt in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
                         "complex32", "qint8", "bits8")
    for rop in ("SUM", "MIN", "MAX")
] + [("MAX", "complex64"), ("MIN", "complex128"), ("BAND", "float32"), ("BXOR", "bfloat16"),
     ("AVG", "bool"), ("PREMUL_SUM", "float32")]
# what the message of an unsupported (reduce op, dtype) pair must name
_REDUCTION_ARG = {"PREMUL_SUM": "reduce op"}


def _tensor(dtype: str, n: int = 4) -> torch.Tensor:
    if dtype.startswith("q"):
        return torch.quantize_per_tensor(torch.ones(n), 0.1, 0, getattr(torch, dtype))
    if dtype == "complex32":
        return torch.zeros(n, dtype=torch.complex32)
    return torch.ones(n).to(getattr(torch, dtype)) if dtype != "bits8" else torch.zeros(
        n, dtype=torch.uint8).view(torch.bits8)


def _out(n: int = 4) -> torch.Tensor:
    return torch.full((n,), SENTINEL)


def _bad_tensors(n: int = 4, write: bool = True) -> dict:
    """Bad-argument kinds for a tensor argument (the good one is ``torch.ones(n)``); an
    expanded view is bad only where the collective writes (reading one is valid)."""
    bad = {
        "not_a_tensor": [1.0] * n,
        "none": None,
        "meta": torch.empty(n, device="meta"),
        "sparse": torch.ones(n).to_sparse(),
        "quantized": _tensor("qint8", n),
        "bits_dtype": _tensor("bits8", n),
    }
    if write:
        bad["expanded"] = torch.ones(1).expand(n)
    return bad


def _opts(kind: str, **kw):
    o = getattr(dist, kind)()
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def _rop(name: str):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(2.0)
    return getattr(dist.ReduceOp, name)


def _cases(rank: int, n: int = WORLD) -> list[tuple[str, str, str, object]]:
    """``(case name, op named in the message, argument named, call(pg) -> Work)`` for a group
    of ``n`` ranks."""
    cases = []

    def add(name, op, arg, call):
        if "expanded" in name and ("/in" in name or arg.startswith("input")):
            return  # an expanded view is a valid argument where the collective only reads
        cases.append((name, op, arg, call))

    # -- a bad tensor in each tensor argument of each op (meta, sparse, quantized, ...) --------
    for kind, bad in _bad_tensors(write=True).items():  # written (in place or outputs)
        if kind != "sparse":  # all-reduced as gloo does (test_sparse_all_reduce.py)
            add(f"all_reduce/{kind}", "all_reduce", "tensor",
                lambda pg, b=bad: pg.allreduce([b], _opts("AllreduceOptions")))
        add(f"reduce/{kind}", "reduce", "tensor",
            lambda pg, b=bad: pg.reduce([b], _opts("ReduceOptions", rootRank=0)))
        add(f"broadcast/{kind}", "broadcast", "tensor",
            lambda pg, b=bad: pg.broadcast([b], _opts("BroadcastOptions", rootRank=0)))
        add(f"all_reduce_coalesced/{kind}", "all_reduce_coalesced", "tensors[1]",
            lambda pg, b=bad: pg.allreduce_coalesced([torch.ones(4), b],
                                                     _opts("AllreduceCoalescedOptions")))
        add(f"all_gather_into_tensor/in/{kind}", "all_gather_into_tensor", "input_tensor",
            lambda pg, b=bad: pg._allgather_base(_out(4 * n), b))
        add(f"all_gather_into_tensor/out/{kind}", "all_gather_into_tensor", "output_tensor",
            lambda pg, b=bad: pg._allgather_base(b, torch.ones(4)))
        add(f"all_gather/in/{kind}", "all_gather", "input_tensors[0]",
            lambda pg, b=bad: pg.allgather([[_out() for _ in range(n)]], [b]))
        for i in range(n):  # every element of the list form, not only the first
            add(f"all_gather/out{i}/{kind}", "all_gather", f"output_tensors[{i}]",
                lambda pg, b=bad, i=i: pg.allgather(
                    [[b if j == i else _out() for j in range(n)]], [torch.ones(4)]))
        add(f"reduce_scatter_tensor/in/{kind}", "reduce_scatter_tensor", "input",
            lambda pg, b=bad: pg._reduce_scatter_base(_out(2), b))
        add(f"reduce_scatter_tensor/out/{kind}", "reduce_scatter_tensor", "output",
            lambda pg, b=bad: pg._reduce_scatter_base(b, torch.ones(4 * n)))
        add(f"reduce_scatter/out/{kind}", "reduce_scatter", "output_tensors[0]",
            lambda pg, b=bad: pg.reduce_scatter([b], [[torch.ones(4)] * n]))
        for i in range(n):
            add(f"reduce_scatter/in{i}/{kind}", "reduce_scatter", f"input_tensors[{i}]",
                lambda pg, b=bad, i=i: pg.reduce_scatter(
                    [_out()], [[b if j == i else torch.ones(4) for j in range(n)]]))
        add(f"all_to_all_single/in/{kind}", "all_to_all_single", "input",
            lambda pg, b=bad: pg.alltoall_base(_out(4), b, [], []))
        add(f"all_to_all_single/out/{kind}", "all_to_all_single", "output",
            lambda pg, b=bad: pg.alltoall_base(b, torch.ones(4), [], []))
        for i in range(n):
            add(f"all_to_all/in{i}/{kind}", "all_to_all", f"input_tensors[{i}]",
                lambda pg, b=bad, i=i: pg.alltoall(
                    [_out(2) for _ in range(n)],
                    [b if j == i else torch.ones(2) for j in range(n)]))
            add(f"all_to_all/out{i}/{kind}", "all_to_all", f"output_tensors[{i}]",
                lambda pg, b=bad, i=i: pg.alltoall(
                    [b if j == i else _out(2) for j in range(n)],
                    [torch.ones(2) for _ in range(n)]))
        add(f"gather/in/{kind}", "gather", "input_tensors[0]",
            lambda pg, b=bad: pg.gather([[_out() for _ in range(n)]], [b],
                                        _opts("GatherOptions", rootRank=0)))
        add(f"scatter/out/{kind}", "scatter", "output_tensors[0]",
            lambda pg, b=bad: pg.scatter([b], [[torch.ones(4)] * n],
                                         _opts("ScatterOptions", rootRank=0)))

    # -- reduce op x dtype pairs outside the table -----------------------------------------------
    for rop, dt in UNSUPPORTED_REDUCTIONS:
        add(f"all_reduce/{rop}/{dt}", "all_reduce", _REDUCTION_ARG.get(rop, "dtype"),
            lambda pg, r=rop, d=dt: pg.allreduce([_tensor(d)],
                                                 _opts("AllreduceOptions", reduceOp=_rop(r))))
        add(f"reduce/{rop}/{dt}", "reduce", _REDUCTION_ARG.get(rop, "dtype"),
            lambda pg, r=rop, d=dt: pg.reduce([_tensor(d)], _opts(
                "ReduceOptions", reduceOp=_rop(r), rootRank=0)))
        add(f"reduce_scatter_tensor/{rop}/{dt}", "reduce_scatter_tensor", _REDUCTION_ARG.get(rop, "dtype"),
            lambda pg, r=rop, d=dt: pg._reduce_scatter_base(
                _tensor(d, 2), _tensor(d, 2 * n), _opts("ReduceScatterOptions",
                                                        reduceOp=_rop(r))))
        add(f"all_reduce_coalesced/{rop}/{dt}", "all_reduce_coalesced", _REDUCTION_ARG.get(rop, "dtype"),
            lambda pg, r=rop, d=dt: pg.allreduce_coalesced(
                [torch.ones(4), _tensor(d)], _opts("AllreduceCoalescedOptions",
                                                   reduceOp=_rop(r))))

    # -- sizes, dtypes, counts, roots, splits ------------------------------------------------------
    i64 = torch.ones(4, dtype=torch.int64)
    add("all_gather_into_tensor/out_size", "all_gather_into_tensor", "output_tensor",
        lambda pg: pg._allgather_base(_out(4 * n + 1), torch.ones(4)))
    add("all_gather_into_tensor/out_dtype", "all_gather_into_tensor", "dtype",
        lambda pg: pg._allgather_base(_out(4 * n).double(), torch.ones(4)))
    add("all_gather_into_tensor/aliased", "all_gather_into_tensor", "overlap",
        lambda pg: (lambda o: pg._allgather_base(o, o[1:5]))(_out(4 * n)))
    for i in range(n):
        add(f"all_gather/out{i}_size", "all_gather", f"output_tensors[{i}]",
            lambda pg, i=i: pg.allgather([[_out(5 if j == i else 4) for j in range(n)]],
                                         [torch.ones(4)]))
        add(f"all_gather/out{i}_dtype", "all_gather", f"output_tensors[{i}]",
            lambda pg, i=i: pg.allgather([[i64 * 0 if j == i else _out() for j in range(n)]],
                                         [torch.ones(4)]))
    add("all_gather/list_len", "all_gather", "output_tensors",
        lambda pg: pg.allgather([[_out()] * (n + 1)], [torch.ones(4)]))
    add("all_gather/two_inputs", "all_gather", "input_tensors",
        lambda pg: pg.allgather([[_out() for _ in range(n)]], [torch.ones(4)] * 2))
    add("reduce_scatter_tensor/out_size", "reduce_scatter_tensor", "output",
        lambda pg: pg._reduce_scatter_base(_out(3), torch.ones(4 * n)))
    add("reduce_scatter_tensor/indivisible", "reduce_scatter_tensor", "input",
        lambda pg: pg._reduce_scatter_base(_out(2), torch.ones(2 * n + 1)))
    add("reduce_scatter_tensor/out_dtype", "reduce_scatter_tensor", "dtype",
        lambda pg: pg._reduce_scatter_base(_out(4).double(), torch.ones(4 * n)))
    add("reduce_scatter_tensor/aliased", "reduce_scatter_tensor", "overlap",
        lambda pg: (lambda x: pg._reduce_scatter_base(x[2:6], x))(torch.ones(4 * n)))
    add("reduce_scatter/list_len", "reduce_scatter", "input_tensors",
        lambda pg: pg.reduce_scatter([_out()], [[torch.ones(4)] * (n + 1)]))
    add("all_to_all_single/split_len", "all_to_all_single", "input_split_sizes",
        lambda pg: pg.alltoall_base(_out(4), torch.ones(4), [], [4]))
    add("all_to_all_single/split_negative", "all_to_all_single", "input_split_sizes",
        lambda pg: pg.alltoall_base(_out(4), torch.ones(4), [], [6, -2]))
    add("all_to_all_single/split_sum", "all_to_all_single", "output_split_sizes",
        lambda pg: pg.alltoall_base(_out(4), torch.ones(4), [1, 1], []))
    add("all_to_all_single/indivisible", "all_to_all_single", "input",
        lambda pg: pg.alltoall_base(_out(3), torch.ones(3), [], []))
    add("all_to_all_single/dtype", "all_to_all_single", "dtype",
        lambda pg: pg.alltoall_base(_out(4).double(), torch.ones(4), [], []))
    add("all_to_all_single/aliased", "all_to_all_single", "overlap",
        lambda pg: (lambda x: pg.alltoall_base(x[1:5], x[0:4], [], []))(torch.ones(6)))
    add("all_to_all/list_len", "all_to_all", "input_tensors",
        lambda pg: pg.alltoall([_out(2)] * n, [torch.ones(2)] * (n + 1)))
    add("all_to_all/dtypes", "all_to_all", "dtype",
        lambda pg: pg.alltoall([_out(2) for _ in range(n)],
                               [torch.ones(2)] * (n - 1) + [i64[:2]]))
    for root in (-1, n, 1 << 40):
        add(f"broadcast/root{root}", "broadcast", "root",
            lambda pg, r=root: pg.broadcast([torch.ones(4)], _opts("BroadcastOptions",
                                                                   rootRank=r)))
        add(f"reduce/root{root}", "reduce", "root",
            lambda pg, r=root: pg.reduce([torch.ones(4)], _opts("ReduceOptions", rootRank=r)))
        add(f"gather/root{root}", "gather", "root",
            lambda pg, r=root: pg.gather([[_out() for _ in range(n)]], [torch.ones(4)],
                                         _opts("GatherOptions", rootRank=r)))
        add(f"scatter/root{root}", "scatter", "root",
            lambda pg, r=root: pg.scatter([_out()], [[torch.ones(4)] * n],
                                          _opts("ScatterOptions", rootRank=r)))
    # coalesced forms: lists of different lengths would issue different numbers of collectives
    add("all_gather_coalesced/lengths", "all_gather", "input_list",
        lambda pg: pg.allgather_coalesced([[_out() for _ in range(n)]] * 2, [torch.ones(4)]))
    add("all_gather_into_tensor_coalesced/lengths", "all_gather_into_tensor", "inputs",
        lambda pg: pg.all_gather_single_coalesced([_out(4 * n)] * 2, [torch.ones(4)]))
    add("reduce_scatter_tensor_coalesced/lengths", "reduce_scatter_tensor", "inputs",
        lambda pg: pg.reduce_scatter_single_coalesced([_out(4)], [torch.ones(4 * n)] * 2))
    add("all_reduce/two_tensors", "all_reduce", "tensors",
        lambda pg: pg.allreduce([torch.ones(4), torch.ones(4)], _opts("AllreduceOptions")))
    add("all_reduce/no_tensor", "all_reduce", "tensors",
        lambda pg: pg.allreduce([], _opts("AllreduceOptions")))
    add("broadcast/two_tensors", "broadcast", "tensors",
        lambda pg: pg.broadcast([torch.ones(4)] * 2, _opts("BroadcastOptions", rootRank=0)))
    # the root's inputs are checked (rank 1 is the root: the bad rank of the "rank1" variant)
    add("scatter/inputs_len", "scatter", "input_tensors",
        lambda pg: pg.scatter([_out()], [[torch.ones(4)] * (n + 1)],
                              _opts("ScatterOptions", rootRank=1)))
    add("scatter/inputs_size", "scatter", f"input_tensors[{n - 1}]",
        lambda pg: pg.scatter([_out()], [[torch.ones(4)] * (n - 1) + [torch.ones(5)]],
                              _opts("ScatterOptions", rootRank=1)))
    return cases


def _fcoll_pg():
    g = dist.group.WORLD
    from fcoll.shm.multihost.hierarchical import HierarchicalProcessGroup

    if hasattr(g, "_engine") or isinstance(g, HierarchicalProcessGroup):
        return g
    return g._get_backend(torch.device("cpu"))


def _usable(pg, rank: int, n: int = WORLD) -> bool:
    t = torch.full((8,), float(rank + 1))
    pg.allreduce([t], _opts("AllreduceOptions")).wait()
    return bool((t == sum(range(1, n + 1))).all())


def _matrix(rank: int, world: int) -> list:
    import warnings

    warnings.simplefilter("ignore")  # quantized and complex32 tensors warn on creation
    pg = _fcoll_pg()
    out = []
    for (name, op, arg, call), who in itertools.product(_cases(rank, world), ("all", "rank1")):
        bad_here = who == "all" or rank == 1
        err = None
        try:
            work = call(pg) if bad_here else _valid_twin(op, pg, world)
            if work is not None:
                work.wait()
        except (ValueError, TypeError) as e:  # CollectiveMismatchError is a ValueError
            err = ("ValueError" if isinstance(e, ValueError) else "TypeError", str(e))
        except Exception as e:  # noqa: BLE001  reported, not raised: the matrix goes on
            err = (f"unexpected {type(e).__name__}", str(e)[:400])
        out.append((name, who, op, arg, err, _usable(pg, rank, world)))
    return out


def _valid_twin(op: str, pg, n: int = WORLD):
    """A valid call of ``op``: what the good rank does while its peer passes a bad one."""
    o = _opts
    calls = {
        "all_reduce": lambda: pg.allreduce([torch.ones(4)], o("AllreduceOptions")),
        "reduce": lambda: pg.reduce([torch.ones(4)], o("ReduceOptions", rootRank=0)),
        "broadcast": lambda: pg.broadcast([torch.ones(4)], o("BroadcastOptions", rootRank=0)),
        "all_reduce_coalesced": lambda: pg.allreduce_coalesced(
            [torch.ones(4), torch.ones(4)], o("AllreduceCoalescedOptions")),
        "all_gather_into_tensor": lambda: pg._allgather_base(_out(4 * n), torch.ones(4)),
        "all_gather": lambda: pg.allgather([[_out() for _ in range(n)]], [torch.ones(4)]),
        "reduce_scatter_tensor": lambda: pg._reduce_scatter_base(_out(4), torch.ones(4 * n)),
        "reduce_scatter": lambda: pg.reduce_scatter([_out()], [[torch.ones(4)] * n]),
        "all_to_all_single": lambda: pg.alltoall_base(_out(4), torch.ones(4), [], []),
        "all_to_all": lambda: pg.alltoall([_out(2) for _ in range(n)],
                                          [torch.ones(2) for _ in range(n)]),
        "gather": lambda: pg.gather([[_out() for _ in range(n)]], [torch.ones(4)],
                                    o("GatherOptions", rootRank=0)),
        "scatter": lambda: pg.scatter([_out()], [[torch.ones(4)] * n],
                                      o("ScatterOptions", rootRank=1)),
    }
    return calls[op]()


def _zero_size(rank: int, world: int) -> dict:
    """Valid calls on zero-size tensors: each must work and leave the group usable."""
    pg = _fcoll_pg()
    n = world
    e = torch.empty(0)
    res = {}
    calls = {
        "all_reduce": lambda: pg.allreduce([e.clone()], _opts("AllreduceOptions")),
        "all_gather_into_tensor": lambda: pg._allgather_base(torch.empty(0), e),
        "all_gather": lambda: pg.allgather([[torch.empty(0) for _ in range(n)]], [e]),
        "all_gather_2d": lambda: pg._allgather_base(torch.empty(0, 3), torch.empty(0, 3)),
        "reduce_scatter_tensor": lambda: pg._reduce_scatter_base(torch.empty(0), e),
        "all_to_all_single": lambda: pg.alltoall_base(torch.empty(0, 2), torch.empty(0, 2),
                                                      [], []),
        "broadcast": lambda: pg.broadcast([e.clone()], _opts("BroadcastOptions", rootRank=0)),
        "all_reduce_coalesced": lambda: pg.allreduce_coalesced(
            [e.clone(), torch.ones(2)], _opts("AllreduceCoalescedOptions")),
    }
    x = torch.full((1,), float(rank + 1)).expand(4)  # valid: an expanded view, only read
    expect = torch.cat([torch.full((4,), float(p + 1)) for p in range(n)])
    calls["all_gather_into_tensor_expanded_input"] = lambda: _expect(
        pg._allgather_base(o := torch.empty(4 * n), x), o, expect)
    calls["reduce_scatter_tensor_expanded_input"] = lambda: _expect(
        pg._reduce_scatter_base(o := torch.empty(2), torch.ones(1).expand(2 * n)), o,
        torch.full((2,), float(n)))
    for name, call in calls.items():
        try:
            call().wait()
            res[name] = None
        except Exception as ex:  # noqa: BLE001
            res[name] = f"{type(ex).__name__}: {ex}"[:300]
        res[name + "/usable"] = _usable(pg, rank, n)
    return res


def _expect(work, out: torch.Tensor, want: torch.Tensor):
    work.wait()
    torch.testing.assert_close(out, want)
    return work


def _all(rank: int, world: int) -> dict:
    return {"matrix": _matrix(rank, world), "zero_size": _zero_size(rank, world)}


# one host (shared memory), and 2 emulated hosts x 2 ranks (HierarchicalProcessGroup: shared
# memory inside a host, gloo between), where rank 1's bad call must reach the other host too
LAYOUTS = {"one_host": (WORLD, None), "2x2_hosts": (4, [0, 0, 1, 1])}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def results(request):
    world, hosts = LAYOUTS[request.param]
    return run_ranks(_all, world, hosts=hosts, timeout_s=RUN_TIMEOUT_S * world / WORLD,
                     pg_timeout_s=GROUP_TIMEOUT_S)


def test_matrix_has_at_least_300_malformed_calls(results):
    assert len(results[0]["matrix"]) >= 300


def test_every_malformed_call_raises_a_clear_error_on_every_rank(results):
    """ValueError/TypeError on both ranks, naming the op and the bad rank; the argument is
    named in the bad rank's message."""
    bad = []
    for rank, rows in enumerate(results):
        for name, who, op, arg, err, _ in rows["matrix"]:
            culprit = "rank 1" if who == "rank1" else "rank "
            if err is None or err[0] not in ("ValueError", "TypeError"):
                bad.append((rank, name, who, err))
            elif f"fcoll {op}" not in err[1] or culprit not in err[1]:
                bad.append((rank, name, who, "op/rank not named", err[1][:200]))
            elif arg.split("[")[0] not in err[1]:
                bad.append((rank, name, who, f"argument {arg!r} not named", err[1][:200]))
    assert not bad, f"{len(bad)} calls:\n" + "\n".join(map(str, bad[:40]))


def test_group_is_usable_after_every_rejected_call(results):
    unusable = [(rank, name, who) for rank, rows in enumerate(results)
                for name, who, _, _, _, ok in rows["matrix"] if not ok]
    assert not unusable, unusable[:20]


def test_zero_size_calls_are_valid_and_work(results):
    for rank in range(len(results)):
        failed = {k: v for k, v in results[rank]["zero_size"].items() if v not in (None, True)}
        assert not failed, (rank, failed)


def test_no_segment_is_left(results):
    assert fcoll_segments() == []


# ---- the dtype x reduce-op table (one process) ----------------------------------------------
def test_every_reduction_the_table_accepts_has_working_reducers_with_right_results():
    """Each (reduce op, dtype) that :func:`check_reduce_op` accepts runs through every
    reducer the backend uses (2 rows in place, 2 rows, 3 rows) and gives the reference
    result; so nothing the table accepts can fail after data moved."""
    from fcoll.ops.reduce import (DATA_DTYPES, REDUCE_OPS, check_reduce_op, reduce_pair_inplace,
                                  reduce_rows)

    accepted = 0
    for dt in sorted(DATA_DTYPES, key=str):
        for op in REDUCE_OPS:
            if check_reduce_op(op, dt) is not None:
                continue
            accepted += 1
            rows = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 1, 1]]).to(dt)
            ref = {"sum": rows.to(torch.int64).sum(0), "avg": rows.to(torch.int64).sum(0) // 3,
                   "product": rows.to(torch.int64).prod(0), "min": rows.to(torch.int64).amin(0),
                   "max": rows.to(torch.int64).amax(0)}
            out3 = torch.empty(3, dtype=dt)
            reduce_rows(rows, op, out3)
            out2 = torch.empty(3, dtype=dt)
            reduce_rows(rows[:2], op, out2, list(rows[:2].unbind(0)))
            mine = rows[0].clone()
            reduce_pair_inplace(mine, rows[1], op)
            assert torch.equal(out2, mine), (op, dt)
            if op in ref and dt != torch.bool:
                assert torch.equal(out3.to(torch.int64) if not dt.is_complex else
                                   out3.real.to(torch.int64), ref[op]), (op, dt, out3)
    assert accepted >= 80


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
                                   "complex32", "qint8", "bits8"])
def test_dtypes_without_cpu_reducers_are_rejected_for_sum_min_max_but_moved_when_possible(dtype):
    from fcoll.ops.reduce import check_dtype, check_reduce_op

    dt = getattr(torch, dtype)
    for op in ("sum", "min", "max", "avg", "product"):
        assert check_reduce_op(op, dt) is not None
    movable = not dtype.startswith(("q", "bits"))
    assert (check_dtype(dt) is None) == movable
