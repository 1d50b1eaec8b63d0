"""fcoll's shared-memory backend gives gloo's results, op by op, dtype by dtype.

Each multi-process test is one ``run_ranks`` call (process start-up dominates, so a test may
run two or three related scenarios in one call; its name says what they check) that builds an
fcoll group (the default group) and a gloo group over the same ranks, runs every collective on
the same inputs on both, and compares with ``torch.testing.assert_close``. gloo has no int16 and
no integer AVG: int16 is compared with gloo on int32 (the same values modulo 2**16), and AVG
with gloo's SUM divided by the group size, truncated toward zero on integers (NCCL's integer
avg, the rule of :mod:`fcoll.ops.reduce`).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import collective_reference
from fcoll.testing import fcoll_segments, run_ranks

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]
R = dist.ReduceOp
OPS = {"sum": R.SUM, "product": R.PRODUCT, "min": R.MIN, "max": R.MAX, "band": R.BAND,
       "bor": R.BOR, "bxor": R.BXOR, "avg": R.AVG}
SMALL, LARGE = 37, 2_200_001  # LARGE float32 spans several 1 MiB slots: exercises chunking


def _valid(op: str, dt: torch.dtype) -> bool:
    """The rule of :func:`fcoll.ops.reduce.check_reduce_op` for these (non-complex) dtypes."""
    if op in ("band", "bor", "bxor"):
        return not dt.is_floating_point
    if op == "avg":
        return dt != torch.bool
    return True


def _make(shape, dt, rank: int, seed: int) -> torch.Tensor:
    """Small integer values, so sums and products are exact in every dtype."""
    g = torch.Generator().manual_seed(seed * 131 + rank)
    if dt == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    lo = 0 if dt == torch.uint8 else -3
    return torch.randint(lo, 4, shape, generator=g).to(dt)


def _gloo_dt(dt):
    return torch.int32 if dt == torch.int16 else dt


def _on_both(fn, gl, *tensors, op: str | None = None):
    """Run ``fn(group, reduce_op, *tensors)`` (or ``fn(group, *tensors)`` when ``op`` is None)
    on fcoll (default group) and gloo; return both result sets.

    ``op="avg"`` runs SUM on gloo and divides every gloo tensor by the group size afterwards,
    truncating toward zero on integers (gloo has no integer AVG; fcoll follows NCCL)."""
    a = [t.clone() for t in tensors]
    b = [t.clone().to(_gloo_dt(t.dtype)) for t in tensors]
    if op is None:
        fn(None, *a)
        fn(gl, *b)
    else:
        fn(None, OPS[op], *a)
        fn(gl, OPS["sum" if op == "avg" else op], *b)
    if op == "avg":
        n = dist.get_world_size(gl)
        b = [x / n if x.is_floating_point() else torch.div(x, n, rounding_mode="trunc")
             for x in b]
    return a, [x.to(y.dtype) for x, y in zip(b, a)]


def _check(a, b, what):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, msg=lambda m: f"{what}: {m}")


def _all_reduce_everything(rank, world, gl):
    """all_reduce (synchronous: the fast path up to one slot; async: the queued path) and
    reduce, every dtype and reduce op, one chunk to several (LARGE float32)."""
    n = 0
    for dt in DTYPES:
        for name in OPS:
            if not _valid(name, dt):
                continue
            for size in (SMALL, 5000) if dt != torch.float32 else (SMALL, 5000, LARGE):
                x = _make((size,), dt, rank, n)
                n += 1
                a, b = _on_both(lambda g, op, t: dist.all_reduce(t, op=op, group=g), gl, x,
                                op=name)
                _check(a, b, f"all_reduce {name} {dt} {size}")
                if size != LARGE:  # the queued path, one chunk and chunked
                    a, b = _on_both(lambda g, op, t: dist.all_reduce(t, op=op, group=g,
                                                                     async_op=True).wait(),
                                    gl, x, op=name)
                    _check(a, b, f"all_reduce async {name} {dt} {size}")
                if size == SMALL:  # rooted reduce: only the root's result is defined
                    root = n % world
                    a, b = _on_both(lambda g, op, t: dist.reduce(t, dst=root, op=op, group=g),
                                    gl, x, op=name)
                    if rank == root:
                        _check(a, b, f"reduce {name} {dt} root {root}")


def _movement_everything(rank, world, gl):
    for i, dt in enumerate(DTYPES):
        for size in (SMALL, 70_000) if dt != torch.uint8 else (SMALL, 2_500_000):
            x = _make((size, 2), dt, rank, 1000 + i)
            out = torch.empty((world * size, 2), dtype=dt)
            a, b = _on_both(lambda g, o, t: dist.all_gather_into_tensor(o, t, group=g), gl, out, x)
            _check(a[:1], b[:1], f"all_gather_into_tensor {dt} {size}")
            y = _make((world * size, 3), dt, rank, 2000 + i)
            out = torch.empty((size, 3), dtype=dt)
            names = ("sum", "max", "band") if not dt.is_floating_point else ("sum", "min")
            for name in names + (("avg",) if dt != torch.bool else ()):
                a, b = _on_both(
                    lambda g, op, o, t: dist.reduce_scatter_tensor(o, t, op=op, group=g),
                    gl, out, y, op=name)
                _check(a[:1], b[:1], f"reduce_scatter_tensor {name} {dt} {size}")
            for root in range(world):
                z = _make((size,), dt, rank, 3000 + i)
                a, b = _on_both(lambda g, t: dist.broadcast(t, src=root, group=g), gl, z)
                _check(a, b, f"broadcast {dt} root {root}")
        # all_to_all_single, even and uneven splits (rank p sends p + q + 1 rows to q)
        x = _make((world * 4, 3), dt, rank, 4000 + i)
        out = torch.empty_like(x)
        a, b = _on_both(lambda g, o, t: dist.all_to_all_single(o, t, group=g), gl, out, x)
        _check(a[:1], b[:1], f"all_to_all_single even {dt}")
        ins = [rank + q + 1 for q in range(world)]
        outs = [p + rank + 1 for p in range(world)]
        x = _make((sum(ins), 3), dt, rank, 5000 + i)
        out = torch.empty((sum(outs), 3), dtype=dt)
        a, b = _on_both(lambda g, o, t: dist.all_to_all_single(o, t, outs, ins, group=g),
                        gl, out, x)
        _check(a[:1], b[:1], f"all_to_all_single uneven {dt}")
    # a large uneven all_to_all (several rounds through the slots)
    ins = [100_000 * (rank + q + 1) for q in range(world)]
    outs = [100_000 * (p + rank + 1) for p in range(world)]
    x = _make((sum(ins),), torch.float32, rank, 77)
    out = torch.empty(sum(outs))
    a, b = _on_both(lambda g, o, t: dist.all_to_all_single(o, t, outs, ins, group=g), gl, out, x)
    _check(a[:1], b[:1], "all_to_all_single large uneven")


def _layouts_and_forms(rank, world, gl):
    # non-contiguous inputs and outputs: gloo gets contiguous copies of the same views
    base = _make((8, 6 * world), torch.float32, rank, 11)
    ref = base[:, ::2].contiguous()
    dist.all_reduce(ref, group=gl)
    dist.all_reduce(base[:, ::2])
    _check([base[:, ::2], base[:, 1::2]], [ref, _make((8, 6 * world), torch.float32, rank, 11)
                                          [:, 1::2]], "all_reduce non-contiguous")
    x = _make((6, 4), torch.float32, rank, 12).t()
    out = torch.zeros((4 * world, 6 * 2), dtype=torch.float32)
    ref = torch.empty((4 * world, 6))
    dist.all_gather_into_tensor(ref, x.contiguous(), group=gl)
    dist.all_gather_into_tensor(out[:, ::2], x)
    _check([out[:, ::2], out[:, 1::2]], [ref, torch.zeros(4 * world, 6)],
           "all_gather_into_tensor non-contiguous")
    y = _make((world * 3, 5), torch.float32, rank, 13)[:, 1:4]
    out = torch.zeros((3, 6))
    ref = torch.empty((3, 3))
    dist.reduce_scatter_tensor(ref, y.contiguous(), group=gl)
    dist.reduce_scatter_tensor(out[:, ::2], y)
    _check([out[:, ::2], out[:, 1::2]], [ref, torch.zeros(3, 3)],
           "reduce_scatter_tensor non-contiguous")
    z = _make((10, 4), torch.int64, rank, 14).t()
    ref = z.contiguous()
    dist.broadcast(ref, src=world - 1, group=gl)
    dist.broadcast(z, src=world - 1)
    _check([z], [ref], "broadcast non-contiguous")
    # list forms and coalesced forms
    x = _make((5,), torch.float64, rank, 15)
    outs_f = [torch.empty(5, dtype=torch.float64) for _ in range(world)]
    outs_g = [torch.empty(5, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(outs_f, x)
    dist.all_gather(outs_g, x, group=gl)
    _check(outs_f, outs_g, "all_gather list")
    ts = [_make((7,), torch.float32, rank, 16), _make((3, 2), torch.float32, rank, 17)]
    tf, tg = [t.clone() for t in ts], [t.clone() for t in ts]
    dist.all_reduce_coalesced(tf)
    for t in tg:
        dist.all_reduce(t, group=gl)
    _check(tf, tg, "all_reduce_coalesced")
    mixed = [_make((9,), torch.int32, rank, 18), _make((4,), torch.float64, rank, 19)]
    mf = [t.clone() for t in mixed]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in mf:
            dist.all_reduce(t)
    cm.wait()
    for t, ref in zip(mf, mixed):
        expect = ref.clone()
        dist.all_reduce(expect, group=gl)
        _check([t], [expect], "coalescing manager all_reduce (mixed dtypes)")
    ins = [_make((world * 2,), torch.float32, rank, 20 + k) for k in range(3)]
    outs_f = [torch.empty(2) for _ in ins]
    with dist._coalescing_manager():
        for o, t in zip(outs_f, ins):
            dist.reduce_scatter_tensor(o, t)
    for o, t in zip(outs_f, ins):
        e = torch.empty(2)
        dist.reduce_scatter_tensor(e, t, group=gl)
        _check([o], [e], "coalescing manager reduce_scatter")
    outs_f = [torch.empty(world * 2) for _ in ins]
    with dist._coalescing_manager():
        for o, t in zip(outs_f, ins):
            dist.all_gather_into_tensor(o, t[:2])
    for o, t in zip(outs_f, ins):
        e = torch.empty(world * 2)
        dist.all_gather_into_tensor(e, t[:2], group=gl)
        _check([o], [e], "coalescing manager all_gather")
    # rooted gather / scatter, empty tensors
    x = _make((4,), torch.int32, rank, 30)
    outs_f = [torch.empty(4, dtype=torch.int32) for _ in range(world)] if rank == 0 else None
    outs_g = [torch.empty(4, dtype=torch.int32) for _ in range(world)] if rank == 0 else None
    dist.gather(x, outs_f, dst=0)
    dist.gather(x, outs_g, dst=0, group=gl)
    if rank == 0:
        _check(outs_f, outs_g, "gather")
    src = [_make((3,), torch.float64, 0, 40 + p) for p in range(world)]
    of, og = torch.empty(3, dtype=torch.float64), torch.empty(3, dtype=torch.float64)
    dist.scatter(of, src if rank == world - 1 else None, src=world - 1)
    dist.scatter(og, src if rank == world - 1 else None, src=world - 1, group=gl)
    _check([of], [og], "scatter")
    e = torch.empty(0)
    dist.all_reduce(e)
    dist.broadcast(e, 0)
    out = torch.empty(0)
    dist.all_gather_into_tensor(out, e)
    dist.barrier()


def _async_overlap(rank, world, gl):
    """Collectives return at once, progress while the caller computes, and run in issue order.

    Rank 0 issues its all_reduce before any peer does (they wait for its store key), so the
    call can only return if it does not wait for the peers, and the Work is not complete. It
    then computes and blocks on the store (not on the Work) until every peer's blocking
    all_reduce returned, which happens only if rank 0's share moved without its thread waiting.
    """
    store = dist.distributed_c10d._get_default_store()
    big = torch.full((3_000_000,), float(rank + 1))
    small = torch.full((10,), float(rank))
    if rank == 0:
        w1 = dist.all_reduce(big, async_op=True)
        assert not w1.is_completed(), "complete before any peer issued it"
        store.set("async_overlap/issued", "1")
        m = torch.randn(256, 256)
        for _ in range(5):
            m = torch.tanh(m @ m)  # main-thread compute while the collective runs
        store.wait([f"async_overlap/done{p}" for p in range(1, world)])
        w2 = dist.all_reduce(small, op=dist.ReduceOp.MAX, async_op=True)
    else:
        store.wait(["async_overlap/issued"])
        w1 = dist.all_reduce(big, async_op=True)
        w1.wait()
        store.set(f"async_overlap/done{rank}", "1")
        w2 = dist.all_reduce(small, op=dist.ReduceOp.MAX, async_op=True)
    w2.wait()
    w1.wait()
    expect = world * (world + 1) / 2
    assert big.min().item() == expect and big.max().item() == expect
    assert small.tolist() == [float(world - 1)] * 10
    futs = [dist.all_reduce(torch.ones(3), async_op=True).get_future() for _ in range(4)]
    torch.futures.wait_all(futs)
    assert all(f.value()[0].tolist() == [float(world)] * 3 for f in futs)


def _validation_errors(rank, world, gl):
    """Bad input raises on every rank, names op, argument and rank, and moves no data."""
    t = torch.ones(4)
    with pytest.raises(ValueError, match=rf"all_reduce: rank {rank}: reduce op BAND is not valid "
                                         r"for dtype float32"):
        dist.all_reduce(t, op=dist.ReduceOp.BAND)
    # bool AVG (a mean of bools is not a bool) on every reducing path, outputs untouched
    b = torch.ones(2 * world, dtype=torch.bool)
    out = torch.zeros(2, dtype=torch.bool)
    for what, call in (
            ("all_reduce", lambda: dist.all_reduce(b, op=R.AVG)),
            ("all_reduce", lambda: dist.all_reduce(b, op=R.AVG, async_op=True)),
            ("reduce", lambda: dist.reduce(b, dst=0, op=R.AVG)),
            ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(out, b, op=R.AVG)),
            ("all_reduce_coalesced", lambda: dist.all_reduce_coalesced([out, b], op=R.AVG))):
        with pytest.raises(ValueError, match=rf"{what}: rank {rank}: (tensors\[0\]: )?reduce op "
                                             r"AVG is not valid for dtype bool"):
            call()
    assert b.all() and not out.any()
    with pytest.raises(ValueError, match=rf"reduce_scatter_tensor: rank {rank}: input's first "
                                         rf"dimension {3 * world + 1} is not divisible"):
        dist.reduce_scatter_tensor(torch.empty(1), torch.ones(3 * world + 1))
    with pytest.raises(ValueError, match="output_tensor has 5 elements"):
        dist.all_gather_into_tensor(torch.empty(5), torch.ones(4))
    with pytest.raises(ValueError, match="overlapping memory"):
        dist.all_reduce(torch.ones(1).expand(10))
    # only rank 0's splits are wrong: rank 0 raises at once, the others raise its message,
    # quoted as rank 0's
    ins = [1] * world if rank else [2] * world
    x, out = torch.ones(world), torch.empty(world)
    said = ": " if rank == 0 else ' reported: "rank 0: '
    with pytest.raises(ValueError,
                       match=rf"fcoll all_to_all_single: rank 0{said}input_split_sizes "
                             rf"\[2(, 2)*\] sum to {2 * world} but input has {world} rows") as ei:
        dist.all_to_all_single(out, x, [1] * world, ins)
    # mismatched shapes across ranks: same message on every rank, output untouched
    t = torch.full((4, 4 if rank == 0 else 3), 7.0)
    with pytest.raises(ValueError, match=r"fcoll all_reduce: rank 1 has input shape \[4, 3\] "
                                           r"float32 but rank 0 has \[4, 4\] float32"):
        dist.all_reduce(t)
    assert (t == 7).all()
    # the group stays usable after these errors
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [float(world)] * 3


def _coalesced_of_hundreds_of_tensors(rank, world, gl):
    """A coalesced all_reduce of 300 tensors (a whole model's gradients in one bucket): the
    per-tensor signature outgrows the header and is compared through a digest."""
    ts = [torch.full((3 + i % 5,), float(rank + i)) for i in range(300)]
    dist.all_reduce_coalesced(ts)
    for i, t in enumerate(ts):
        assert t.tolist() == [float(sum(r + i for r in range(world)))] * (3 + i % 5), i
    # one rank's 250th tensor differs: every rank raises, names the difference, moves no data
    bad = [torch.ones(4 if (i == 250 and rank == 0) else 3) for i in range(300)]
    with pytest.raises(ValueError, match=r"all_reduce_coalesced: rank 1 and rank 0 passed "
                                         r"different tensors"):
        dist.all_reduce_coalesced(bad)
    assert all((t == 1).all() for t in bad)


def _two_rank_split_paths(rank, world, gl):
    """At 2 ranks, a synchronous reduce_scatter with pieces of 256 KiB or more, and an even
    all_to_all with rows that large, send only the peer's part through shared memory. Results
    match gloo, for every reduce op, and also when the other rank takes the general path (its
    input is not contiguous) in the same collective."""
    size = 40_000  # float32: 320 KB pieces, 640 KB input (one slot)
    for dt, names in ((torch.float32, ("sum", "product", "max", "min", "avg")),
                      (torch.int32, ("sum", "avg", "bxor"))):
        for name in names:
            y = _make((2 * size, 2), dt, rank, 6000)
            out = torch.empty((size, 2), dtype=dt)
            a, b = _on_both(lambda g, op, o, t: dist.reduce_scatter_tensor(o, t, op=op, group=g),
                            gl, out, y, op=name)
            _check(a[:1], b[:1], f"reduce_scatter_tensor split {name} {dt}")
    yb = _make((2 * 8 * size,), torch.bool, rank, 6002)
    outb = torch.empty((8 * size,), dtype=torch.bool)
    a, b = _on_both(lambda g, o, t: dist.reduce_scatter_tensor(o, t, op=R.MAX, group=g),
                    gl, outb, yb)
    _check(a[:1], b[:1], "reduce_scatter_tensor split bool max")
    # rank 0 on the general path (non-contiguous input), rank 1 on the split fast path
    wide = _make((2 * size, 4), torch.float32, rank, 6003)
    y = wide[:, ::2] if rank == 0 else wide[:, ::2].contiguous()
    out = torch.empty((size, 2))
    a, b = _on_both(lambda g, o, t: dist.reduce_scatter_tensor(o, t, group=g), gl, out, y)
    _check(a[:1], b[:1], "reduce_scatter_tensor split, peer on the general path")
    for mixed in (False, True):
        wide = _make((2 * size, 4), torch.float32, rank, 6004)
        x = wide[:, ::2] if mixed and rank == 1 else wide[:, ::2].contiguous()
        out = torch.empty((2 * size, 2))
        a, b = _on_both(lambda g, o, t: dist.all_to_all_single(o, t, group=g), gl, out, x)
        _check(a[:1], b[:1], f"all_to_all_single split (peer on the general path: {mixed})")


def _held_sync_works_keep_their_results(rank, world, gl):
    """Synchronous fast-path calls reuse their Work object only when nobody else holds it."""
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    pg = dist.group.WORLD
    a, b = torch.ones(3), torch.full((3,), 2.0)
    wa = pg.allreduce([a], opts)
    fa = wa.get_future()
    wb = pg.allreduce([b], opts)
    assert wa is not wb
    assert wa.result()[0] is a and wb.result()[0] is b and fa.value()[0] is a
    assert a.tolist() == [float(world)] * 3 and b.tolist() == [2.0 * world] * 3
    del wa, wb, fa
    for _ in range(3):
        dist.all_reduce(a)  # c10d drops each Work after wait(): reused, results still right
    assert a.tolist() == [float(world ** 4)] * 3


def _all_gather_fast_and_general_peers_agree(rank, world, gl):
    """One-slot all_gather packs every rank's part into one region, on the fast path (a
    contiguous input) and on the general path (here: odd ranks pass a non-contiguous one)."""
    for size in (5, 3000, 60_000):  # 60_000 x 2 float32 = 480 KB: fills most of a 1 MiB slot
        wide = _make((size, 4), torch.float32, rank, 7000 + size)
        x = wide[:, ::2] if rank % 2 else wide[:, ::2].contiguous()
        out = torch.empty((world * size, 2))
        a, b = _on_both(lambda g, o, t: dist.all_gather_into_tensor(o, t, group=g), gl, out, x)
        _check(a[:1], b[:1], f"all_gather_into_tensor fast/general mix {size}")


def _subgroups_and_mesh(rank, world, gl):
    from torch.distributed.device_mesh import init_device_mesh

    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    t = torch.full((5,), float(rank))
    dist.all_reduce(t, group=mine)
    assert t.tolist() == [float(2 + 2 * (rank % 2))] * 5
    assert dist.get_backend(mine) == "fcoll"
    mesh = init_device_mesh("cpu", (2, 2))
    for dim in (0, 1):
        g = mesh.get_group(dim)
        x = torch.full((3,), float(rank))
        dist.all_reduce(x, group=g)
        peers = dist.get_process_group_ranks(g)
        assert x.tolist() == [float(sum(peers))] * 3
        out = torch.empty(2 * 3)
        dist.all_gather_into_tensor(out, torch.full((3,), float(rank)), group=g)
        assert out.tolist() == [float(p) for p in peers for _ in range(3)]
    import torch.distributed._functional_collectives as funcol

    y = funcol.all_reduce(torch.full((2,), float(rank)), "sum", (mesh, 1))
    assert y.tolist() == [float(sum(dist.get_process_group_ranks(mesh.get_group(1))))] * 2


def _version_counters(rank, world, gl):
    """A collective writes its outputs below autograd, as gloo's and NCCL's C++ do: the version
    counter of an in-place target, a receive buffer or an output is unchanged, on the fast path
    (one slot) and the general path alike, so a view of a tensor taken before it is broadcast
    into stays usable in autograd (DTensor's ``distribute_tensor`` broadcasts into
    ``x.detach()``; before, ranks 1.. failed "a view ... has been modified inplace")."""
    for n in (4, 1 << 18):  # 16 B (one slot) and 1 MiB (chunks at 4 ranks' 64 KiB slots)
        outs = {}
        t = torch.ones(n); dist.broadcast(t, 0); outs["broadcast"] = t
        t = torch.ones(n); dist.all_reduce(t); outs["all_reduce"] = t
        t = torch.ones(n); dist.reduce(t, 0); outs["reduce"] = t
        t = [torch.ones(n), torch.ones(n)]; dist.all_reduce_coalesced(t); outs["coalesced"] = t[1]
        o = torch.empty(n * world); dist.all_to_all_single(o, torch.ones(n * world))
        outs["all_to_all_single"] = o
        o = torch.empty(n * world); dist.all_gather_into_tensor(o, torch.ones(n))
        outs["all_gather_into_tensor"] = o
        o = torch.empty(n); dist.reduce_scatter_tensor(o, torch.ones(n * world))
        outs["reduce_scatter_tensor"] = o
        o = torch.empty(n)
        if rank == 0:
            dist.send(torch.ones(n), 1)
        elif rank == 1:
            dist.recv(o, 0)
        outs["recv"] = o
        o = torch.empty(n)  # a ring of isend / irecv
        works = [dist.isend(torch.ones(n), (rank + 1) % world),
                 dist.irecv(o, (rank - 1) % world)]
        for work in works:
            work.wait()
        outs["irecv"] = o
        bumped = {k: v._version for k, v in outs.items() if v._version}
        assert not bumped, (rank, n, bumped)
    x = torch.randn(6, 4, requires_grad=True)
    local = torch.chunk(x, 2)[rank % 2]  # a view of x, taken before the broadcast into x
    dist.broadcast(x.detach(), 0)
    (local * 2).sum().backward()  # raised on ranks 1.. when the broadcast bumped x's counter
    assert x.grad is not None


def _scenarios(rank, world, scenarios):
    """Run each ``scenario(rank, world, gloo_group)`` in turn on one set of ranks."""
    gl = dist.new_group(backend="gloo")
    for scenario in scenarios:
        scenario(rank, world, gl)
    return True


def _run_scenarios(world, *scenarios, timeout_s=180):
    # at 4 ranks, 64 KiB slots: every op of more than 64 KiB goes through several chunks
    env = {"FCOLL_SHM_SLOT_BYTES": str(64 << 10)} if world == 4 else {}
    assert run_ranks(_scenarios, world, args=(scenarios,), timeout_s=timeout_s,
                     env=env) == [True] * world
    assert fcoll_segments() == []


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_and_reduce_match_gloo_for_every_dtype_and_reduce_op(world):
    """Integer avg included: the sum divided by the group size, truncated toward zero."""
    _run_scenarios(world, _all_reduce_everything)


@pytest.mark.parametrize("world", [2, 4])
def test_gather_reduce_scatter_broadcast_all_to_all_match_gloo_for_every_dtype_and_form(world):
    """Every dtype (reduce_scatter: avg included), even and uneven splits, non-contiguous
    tensors, list, coalesced and rooted forms; a fast-path rank and a general-path peer in one
    collective agree; at 2 ranks, the split paths (only the peer's part through the slot)."""
    extra = (_two_rank_split_paths,) if world == 2 else ()
    _run_scenarios(world, _movement_everything, _all_gather_fast_and_general_peers_agree,
                   _layouts_and_forms, *extra)


@pytest.mark.parametrize("world", [2, 4])
def test_async_work_overlaps_compute_and_invalid_calls_raise_on_every_rank(world):
    """Async collectives return at once and run in issue order; a synchronous fast-path Work is
    reused only when nobody holds it; invalid or mismatched calls (bool avg, a coalesced
    signature only a digest can compare) raise the same error on every rank, move no data,
    and leave the group usable; no collective bumps its outputs' version counters."""
    _run_scenarios(world, _async_overlap, _held_sync_works_keep_their_results,
                   _validation_errors, _coalesced_of_hundreds_of_tensors, _version_counters)


def test_subgroups_and_device_mesh_groups_run_on_the_fcoll_backend():
    _run_scenarios(4, _subgroups_and_mesh, timeout_s=120)


def _bound_to_a_device(rank, world, store_path):
    """``init_process_group("fcoll", device_id=torch.device("cuda", rank))``, as PyTorch's docs
    advise on a GPU machine, then a subgroup, a 2-D DeviceMesh and collectives on them.

    c10d refuses a ``device_id`` that is not the machine's accelerator, so on a CPU-only
    machine the accelerator is mocked as CUDA with ``world`` devices; nothing here touches a
    CUDA tensor. What c10d does with the id is what a GPU machine does: it asks the group for
    its backend on that device (``pg._get_backend(device_id).supports_splitting``), which raised
    "No backend type associated with device type cuda" on fcoll's Python group."""
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh

    acc = torch.accelerator
    with mock.patch.object(acc, "current_accelerator", return_value=torch.device("cuda")), \
            mock.patch.object(acc, "device_count", return_value=world), \
            mock.patch.object(acc, "is_available", return_value=True):
        device = torch.device("cuda", rank)
        dist.init_process_group("fcoll", store=dist.FileStore(store_path, world), rank=rank,
                                world_size=world, device_id=device)
        pg = dist.group.WORLD
        assert pg._get_backend(device) is pg and pg._get_backend("cpu") is pg
        assert not pg.supports_splitting and not pg.supports_tensor_alloc(device)
        with pytest.raises(RuntimeError, match="device type xpu"):
            pg._get_backend(torch.device("xpu"))
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        pair = pairs[rank // 2]
        mesh = init_device_mesh("cpu", (2, world // 2))
        sums = []
        for group in (pg, pair, mesh.get_group(0), mesh.get_group(1)):
            assert dist.get_backend(group) == "fcoll"
            t = torch.full((3,), float(rank))
            dist.all_reduce(t, group=group)
            sums.append(t[0].item())
        dist.barrier()
    return sums


def test_init_with_a_device_id_binds_nothing_and_every_group_works(tmp_path):
    sums = run_ranks(_bound_to_a_device, 4, backend=None, args=(str(tmp_path / "store"),),
                     timeout_s=120)
    # world 0+1+2+3; pairs {0,1} {2,3}; mesh dim 0 {0,2} {1,3}; dim 1 {0,1} {2,3}
    assert sums == [[6.0, 1.0, 2.0, 1.0], [6.0, 1.0, 4.0, 1.0], [6.0, 5.0, 2.0, 5.0],
                    [6.0, 5.0, 4.0, 5.0]]
    assert fcoll_segments() == []


def _pairs_made_apart(rank, world):
    """Ranks 0 and 1 call ``new_group([0, 1])`` while ranks 2 and 3 call ``new_group([2, 3])``
    (against PyTorch's rule that every rank calls ``new_group`` with the same ranks): c10d
    gives both groups one name; each must still reduce over its own members."""
    pair = dist.new_group([0, 1] if rank < 2 else [2, 3])
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=pair)
    return t.tolist()


def test_groups_of_one_name_and_different_ranks_do_not_meet():
    # before: the two pairs met under one store key; rank 3 returned 3.0, the others failed
    assert run_ranks(_pairs_made_apart, 4, timeout_s=120) == [[1.0] * 3] * 2 + [[5.0] * 3] * 2
    assert fcoll_segments() == []


def _coalesced_inputs(rank: int, op: str, seed: int) -> list[torch.Tensor]:
    """Mixed dtypes in one list (float32 ones in between, so the dtypes interleave), sizes
    from empty (and 0-d) to many 4 KiB slots, pieces straddling chunk boundaries, non-contiguous
    views (a transpose, a strided slice). float32, float64 and int32 total more than 64 KiB
    (3+ ranks: the two-phase path), bfloat16 and bool less."""
    dts = [torch.float32, torch.float64, torch.bfloat16, torch.int32]
    if op != "avg":
        dts.append(torch.bool)
    out, k = [], 0
    for dt in dts:
        for shape in [(1,), (1000,), (1500,), (0,), (), (3000,), (17000,)]:
            out.append(_make(shape, dt, rank, seed + k))
            out.append(_make((7,), torch.float32, rank, seed + 100 + k))
            k += 1
        out.append(_make((41, 37), dt, rank, seed + k).t())  # non-contiguous
        out.append(_make((2 * 1111,), dt, rank, seed + k + 1)[::2])
        k += 2
    return out


def _coalesced_reference(op: str, world: int, seed: int) -> list[torch.Tensor]:
    """The reduction of every rank's :func:`_coalesced_inputs`, computed locally by
    ``collective_reference`` (exact: small integer values; avg truncates integers)."""
    per_rank = [_coalesced_inputs(p, op, seed) for p in range(world)]
    return [collective_reference.all_reduce([t.contiguous() for t in ts], op)[0]
            for ts in zip(*per_rank)]


def _coalesced_zero_copy(rank, world):
    """Coalesced all_reduce (in place and out of place, on the process group and through the
    ops) of many dtypes in one call, run with 4 KiB slots so that the pieces of the inputs
    straddle chunk boundaries, equals a reference reduction, bit for bit; the out-of-place
    forms leave their inputs alone and return contiguous outputs of the inputs' shapes."""
    import fcoll
    from fcoll.ops import pending
    from fcoll.ops.groups import group_from_name

    gname = dist.group.WORLD.group_name
    pg = group_from_name(gname)
    for seed, op in enumerate(["sum", "avg", "max"]):
        seed *= 1000
        ref = _coalesced_reference(op, world, seed)

        def check(got, form):
            assert len(got) == len(ref), form
            for i, (g, r) in enumerate(zip(got, ref)):
                assert g.shape == r.shape and g.dtype == r.dtype, (form, i, g.shape, r.shape)
                assert torch.equal(g, r), f"{form} {op}: tensor {i} {r.dtype} {tuple(r.shape)}"

        ins = _coalesced_inputs(rank, op, seed)
        keep = [t.clone() for t in ins]
        # out of place on the group; rank 0 runs the in-place form at the same time (the
        # header is the same, so ranks may mix them)
        if rank == 0:
            pg.allreduce_coalesced(ins, _coalesced_opts(op)).wait()
            check(ins, "pg in place (mixed with out of place)")
            ins = [t.clone() for t in keep]
        else:
            outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in ins]
            pg.allreduce_coalesced_out_of_place(ins, outs, OPS[op]).wait()
            check(outs, "pg out of place")
            assert all(torch.equal(a, b) for a, b in zip(ins, keep)), "input modified"
        # the functional op: fresh outputs, inputs untouched
        res = fcoll.all_reduce_coalesced(ins, op, dist.group.WORLD)
        res = [t.wait() for t in res]
        check(res, "fcoll.all_reduce_coalesced")
        assert all(t.is_contiguous() for t in res)
        assert all(torch.equal(a, b) for a, b in zip(ins, keep)), "functional input modified"
        # the in-place op, non-contiguous targets included
        torch.ops.fcoll.all_reduce_coalesced_(ins, op, gname)
        for t in ins:
            pending.wait(t)
        check(ins, "fcoll.all_reduce_coalesced_")
    return _signed_zeros(rank, pg)


def _signed_zeros(rank, pg):
    """max/min of -0.0 and +0.0 (``torch.maximum(-0., 0.)`` is 0., with the operands swapped
    -0.): every rank must still get the same bits, on every all_reduce path."""
    import fcoll

    out = {}
    for op in ("max", "min"):
        zeros = [torch.full((n,), -0.0 if rank % 2 == 0 else 0.0) for n in (5, 3000)]
        for n, z in zip((5, 3000), zeros):
            t = z.clone()
            dist.all_reduce(t, op=OPS[op])  # one-slot fast path / chunked general path
            out[f"{op} all_reduce {n}"] = torch.signbit(t).tolist()
            t = z.clone()
            dist.all_reduce(t, op=OPS[op], async_op=True).wait()
            out[f"{op} all_reduce async {n}"] = torch.signbit(t).tolist()
        ts = [z.clone() for z in zeros]
        pg.allreduce_coalesced(ts, _coalesced_opts(op)).wait()
        out[f"{op} coalesced in place"] = [torch.signbit(t).tolist() for t in ts]
        res = [t.wait() for t in fcoll.all_reduce_coalesced(zeros, op, dist.group.WORLD)]
        out[f"{op} coalesced"] = [torch.signbit(t).tolist() for t in res]
    return out


def _coalesced_opts(op: str):
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = OPS[op]
    return opts


@pytest.mark.parametrize("world", [2, 4])
def test_coalesced_all_reduce_reduces_pieces_in_place_and_out_of_place(world):
    env = {"FCOLL_SHM_SLOT_BYTES": "4096"}
    signs = run_ranks(_coalesced_zero_copy, world, timeout_s=180, env=env)
    for key in signs[0]:
        assert all(s[key] == signs[0][key] for s in signs), f"ranks differ: {key}"
    assert fcoll_segments() == []


def _single(rank, world):
    t = torch.arange(5.0)
    dist.all_reduce(t)
    out = torch.empty(5)
    dist.all_gather_into_tensor(out, t)
    dist.reduce_scatter_tensor(out, t)
    dist.all_to_all_single(out, t)
    dist.broadcast(t, 0)
    dist.barrier()
    return t.tolist(), out.tolist()


def test_world_size_1_is_identity():
    assert run_ranks(_single, 1, timeout_s=60) == [([0.0, 1, 2, 3, 4], [0.0, 1, 2, 3, 4])]
    assert fcoll_segments() == []


def _cuda(rank, world):
    t = torch.full((1000,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    out = torch.empty(2000, device="cuda")
    dist.all_gather_into_tensor(out, t)
    return t.cpu().tolist()[:2], out.device.type


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_staged_through_host_memory():
    res = run_ranks(_cuda, 2, timeout_s=120)
    assert res == [([3.0, 3.0], "cuda")] * 2


def _threads_in_collectives(rank, world):
    """Synchronous collectives (one-slot fast path, chunked general path) with torch at 2
    intra-op threads: the kernels run with ``collective_threads`` threads, seen from inside a
    reduce op patched to record ``torch.get_num_threads()``, and the caller's count is back
    afterwards; results are gloo's."""
    from fcoll.ops import reduce as reduce_mod
    from fcoll.shm import engine

    torch.set_num_threads(2)
    seen = []
    real = reduce_mod._PAIR_INPLACE["sum"]

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return real(*a, **k)

    # the in-place pair reduction both paths call: the one-slot plan's (pair_reducer, chosen
    # when the plan is made, below) and the chunked algorithm's (reduce_pair_inplace)
    reduce_mod._PAIR_INPLACE["sum"] = spy
    gl = dist.new_group(backend="gloo")
    out = []
    for numel in (1 << 18, 3 << 18):  # 1 MiB: one slot; 3 MiB: three chunks
        a = torch.arange(numel, dtype=torch.float32) * (rank + 1)
        b = a.clone()
        dist.all_reduce(a)
        dist.all_reduce(b, group=gl)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        out.append(torch.get_num_threads())
    return seen, out, engine.collective_threads(world)


def test_synchronous_collectives_run_with_the_collectives_threads_and_restore_the_callers():
    for seen, after, limit in run_ranks(_threads_in_collectives, 2, timeout_s=120):
        assert limit == max(1, len(os.sched_getaffinity(0)) // 2)
        assert len(seen) == 4 and set(seen) == {min(2, limit)}, seen  # 1 slot + 3 chunks
        assert after == [2, 2]
