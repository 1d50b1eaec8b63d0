"""Point-to-point on fcoll's backend (fcoll.shm.p2p.sendrecv): send, recv, isend/irecv,
batch_isend_irecv, recv from any source, and a 2-stage torch.distributed.pipelining schedule,
compared with gloo; size mismatches, a dead peer and a timeout raise errors naming the ranks.

Every multi-rank run sets ``FCOLL_P2P_CHUNK_BYTES`` to one page, so messages above 16 KiB go
through the 4-slot ring in several rounds (the chunking path) without large tensors.
"""

from __future__ import annotations

import time

import pytest
import torch

from fcoll.testing import run_ranks

SMALL_CHUNKS = {"FCOLL_P2P_CHUNK_BYTES": "4096"}
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool, torch.complex64)
SHAPES = ((), (0,), (7,), (3, 5), (64, 130))  # the last one: 8320 elements, several chunks


def _value(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 50
    if dtype == torch.bool:
        return x > 0
    if dtype == torch.complex64:
        return torch.complex(x, -x).to(dtype)
    if dtype == torch.uint8:
        return x.abs().to(dtype)
    return x.to(dtype)


def _exchange(rank, world):
    """Blocking send/recv of every dtype and shape, both directions; returns what arrived."""
    import torch.distributed as dist

    got = {}
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(SHAPES):
            key = f"{dtype}{list(shape)}"
            mine = _value(dtype, shape, 10 * i + j + 1000 * rank)
            buf = torch.empty(shape, dtype=dtype)
            if rank == 0:
                dist.send(mine, 1, tag=j)
                dist.recv(buf, 1, tag=j)
            else:
                dist.recv(buf, 0, tag=j)
                dist.send(mine, 0, tag=j)
            got[key] = buf
    return got


@pytest.mark.timeout(240)
def test_send_recv_of_every_dtype_and_shape_equals_gloo():
    ours = run_ranks(_exchange, 2, backend="fcoll", env=SMALL_CHUNKS, timeout_s=200)
    theirs = run_ranks(_exchange, 2, backend="gloo", timeout_s=200)
    for rank in range(2):
        assert ours[rank].keys() == theirs[rank].keys()
        for key, value in ours[rank].items():
            torch.testing.assert_close(value, theirs[rank][key], msg=key, rtol=0, atol=0)
    i, j = DTYPES.index(torch.bfloat16), SHAPES.index((64, 130))
    torch.testing.assert_close(ours[1]["torch.bfloat16[64, 130]"],
                               _value(torch.bfloat16, (64, 130), 10 * i + j))


def _async_forms(rank, world):
    """isend/irecv, batch_isend_irecv, any source, tags out of order, non-contiguous tensors,
    send to self, concurrent large messages both ways, futures, and a compiled caller."""
    import torch.distributed as dist

    out = {}
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    # a ring exchange in one batch (recv listed first: the order of a batch does not matter)
    buf = torch.empty(5)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, prv),
                                   dist.P2POp(dist.isend, torch.full((5,), float(rank)), nxt)])
    for r in reqs:
        r.wait()
    out["ring"] = buf
    # any source: rank 0 takes one message from each peer, in whatever order they come
    if rank == 0:
        srcs = set()
        for _ in range(world - 1):
            t = torch.empty(2, dtype=torch.int64)
            src = dist.recv(t)
            assert t.tolist() == [src, 7], (src, t)
            srcs.add(src)
        out["any"] = sorted(srcs)
    else:
        dist.send(torch.tensor([rank, 7]), 0)
    # tags out of order: rank 1 sends tag 1 then tag 2, rank 0 receives tag 2 first
    if rank == 1:
        ws = [dist.isend(torch.ones(3), 0, tag=1), dist.isend(torch.ones(3) * 2, 0, tag=2)]
        for w in ws:
            w.wait()
    elif rank == 0:
        a, b = torch.empty(3), torch.empty(3)
        wb, wa = dist.irecv(b, 1, tag=2), dist.irecv(a, 1, tag=1)
        wb.wait()
        wa.wait()
        out["tags"] = (a, b)
    # non-contiguous send and receive, received in the order of the sender's elements
    if rank in (0, 1):
        peer = 1 - rank
        src = torch.arange(12.0).view(3, 4).t() + 100 * rank  # [4, 3], not contiguous
        dst = torch.zeros(3, 4).t()  # [4, 3], not contiguous
        w = dist.irecv(dst, peer)
        dist.send(src, peer)
        w.wait()
        out["noncontig"] = dst
    # send to self (isend / irecv allow it), with a future
    me = torch.empty(4)
    rw = dist.irecv(me, rank, tag=5)
    dist.isend(torch.arange(4.0) * rank, rank, tag=5).wait()
    out["self"] = rw.get_future().wait()[0]
    # large messages both ways at once (each ring holds 16 KiB: both sides must progress)
    if rank in (0, 1):
        peer = 1 - rank
        big_in = torch.empty(300_000)
        ws = [dist.isend(torch.full((300_000,), float(rank)), peer), dist.irecv(big_in, peer)]
        for w in ws:
            w.wait()
        out["big"] = bool((big_in == peer).all())
    # an isend completes while its sender computes, the receiver posts late
    if rank == 0:
        w = dist.isend(torch.arange(50_000.0), 1, tag=9)
        while not w.is_completed():
            time.sleep(0.01)
        out["bg_done"] = w.is_success()
    elif rank == 1:
        time.sleep(0.2)
        late = torch.empty(50_000)
        dist.recv(late, 0, tag=9)
        out["late"] = bool(torch.equal(late, torch.arange(50_000.0)))
    # a compiled caller graph-breaks into the group's (dynamo-disabled) methods and runs
    if rank in (0, 1):
        peer = 1 - rank

        def swap(x):
            y = torch.empty_like(x)
            w = dist.irecv(y, peer, tag=11)
            dist.send(x * 2, peer, tag=11)
            w.wait()
            return y + 1

        out["compiled"] = torch.compile(swap, backend="eager")(torch.full((3,), float(rank)))
    return out


@pytest.mark.timeout(200)
def test_isend_irecv_batch_any_source_tags_noncontiguous_self_and_large():
    res = run_ranks(_async_forms, 3, env=SMALL_CHUNKS, timeout_s=180)
    for rank, out in enumerate(res):
        torch.testing.assert_close(out["ring"], torch.full((5,), float((rank - 1) % 3)))
        torch.testing.assert_close(out["self"], torch.arange(4.0) * rank)
    assert res[0]["any"] == [1, 2]
    torch.testing.assert_close(res[0]["tags"], (torch.ones(3), torch.ones(3) * 2))
    for rank in (0, 1):
        sent = (torch.arange(12.0).view(3, 4).t() + 100 * (1 - rank)).contiguous()
        torch.testing.assert_close(res[rank]["noncontig"], sent)
        assert res[rank]["big"]
        torch.testing.assert_close(res[rank]["compiled"], torch.full((3,), 2.0 * (1 - rank) + 1))
    assert res[0]["bg_done"] and res[1]["late"]


def _mismatch(rank, world):
    """A receive of another size, then of another dtype: both ranks raise; then the channel
    still works."""
    import torch.distributed as dist

    errors = []
    cases = [(torch.zeros(3), torch.zeros(2, 2)), (torch.zeros(4), torch.zeros(4, dtype=torch.int32))]
    for tag, (sent, recv) in enumerate(cases, start=20):
        try:
            if rank == 0:
                dist.send(sent, 1, tag=tag)
            else:
                dist.recv(recv, 0, tag=tag)
        except ValueError as e:
            errors.append(str(e))
    ok = torch.zeros(3)
    if rank == 0:
        dist.send(torch.arange(3.0), 1)
    else:
        dist.recv(ok, 0)
    return errors, ok


@pytest.mark.timeout(120)
def test_size_or_dtype_mismatch_raises_value_error_on_both_ranks_naming_ranks_shapes_tag():
    (e0, _), (e1, ok) = run_ranks(_mismatch, 2, timeout_s=100)
    assert e0 == e1 and len(e0) == 2
    assert e0[0] == ("fcoll p2p: rank 0 sent float32[3] (12 bytes) with tag 20 to rank 1, whose "
                     "receive is float32[2, 2] (16 bytes): the dtype and element count must "
                     "match")
    assert "float32[4] (16 bytes) with tag 21" in e0[1] and "int32[4] (16 bytes)" in e0[1]
    torch.testing.assert_close(ok, torch.arange(3.0))


def _faults(rank, world):
    """Rank 1 dies; rank 0's recv from it fails naming it. Rank 2 never sends; rank 0's recv
    from it times out, and the channel with rank 2 stays unusable after."""
    import os

    import torch.distributed as dist

    from fcoll.shm.transport.fences import PeerError

    if rank == 1:
        os._exit(3)
    if rank == 2:
        time.sleep(4.0)
        return None
    out = {}
    for peer, key in ((1, "dead"), (2, "timeout")):
        t0 = time.monotonic()
        try:
            dist.recv(torch.zeros(2), peer, tag=1)
        except PeerError as e:
            out[key] = (str(e), time.monotonic() - t0)
    try:
        dist.send(torch.zeros(2), 2)
    except RuntimeError as e:
        out["after"] = str(e)
    return out


@pytest.mark.timeout(120)
def test_dead_peer_is_named_and_a_timeout_makes_the_channel_unusable():
    res = run_ranks(_faults, 3, pg_timeout_s=1.5, timeout_s=100, allow_failures=True)
    out = res[0]
    msg, took = out["dead"]
    # "died", not "timed out": the message says the liveness check saw it (the bound is loose:
    # a loaded machine delays a wake-up)
    assert "rank 1 died" in msg and took < 10.0, (msg, took)
    msg, took = out["timeout"]
    assert "recv from rank 2 (tag 1, float32[2] (8 bytes)) timed out after 1.5 s on rank 0" in msg
    assert 1.4 < took < 1.5 + 10.0
    assert "unusable after an earlier error" in out["after"]


def _pipeline(rank, world, schedule: str):
    """A 2-stage MLP trained for two steps with torch.distributed.pipelining."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))
    part = full[:2] if rank == 0 else full[2:]
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    losses = []
    for _ in range(2):
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
    return {"losses": [v.detach() for v in losses], "grads": [p.grad for p in part.parameters()]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stage_pipeline_on_fcoll_equals_gloo(schedule):
    ours = run_ranks(_pipeline, 2, args=(schedule,), timeout_s=140)
    theirs = run_ranks(_pipeline, 2, backend="gloo", args=(schedule,), timeout_s=140)
    assert len(ours[1]["losses"]) == 4
    torch.testing.assert_close(ours, theirs)


def _callback_receives_again(rank, world):
    """Rank 0 attaches to an ``irecv``'s future a callback that receives again and blocks on
    that receive's future; only then (the store orders it) does rank 1 send both messages. The
    first receive finishes on the inbox's thread inside a step of the protocol, which the
    callback's receive re-entered ("message 0 from rank 1, expected 1") before futures were
    completed on a thread of their own."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait(["callback attached"])
        dist.send(torch.ones(4), 0)
        dist.send(torch.full((4,), 7.0), 0)
        return None
    first = torch.zeros(4)

    def receive_again(_):
        second = torch.zeros(4)
        dist.irecv(second, 1).get_future().wait()
        return first + second

    both = dist.irecv(first, 1).get_future().then(receive_again)
    store.set("callback attached", "1")
    return both.wait()


def test_a_future_callback_may_send_and_receive_again():
    got = run_ranks(_callback_receives_again, 2, timeout_s=60, pg_timeout_s=20)[0]
    torch.testing.assert_close(got, torch.full((4,), 8.0))


def _inbox_fds() -> int:
    import os

    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:fcoll-p2p-")
        except OSError:
            pass
    return n


def _destroy_with_pending_send(rank, world):
    """Rank 0 posts a send that rank 1 never receives, then both destroy the group: the pending
    send fails naming the destroyed group, and the inbox is closed then, not at exit."""
    import torch.distributed as dist

    pg = dist.new_group([0, 1])
    work = dist.isend(torch.ones(8), dst=1, group=pg) if rank == 0 else None
    dist.barrier()
    before = _inbox_fds()
    dist.destroy_process_group(pg)
    error = None
    if work is not None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001  the message is the result
            error = str(e)
    return before, _inbox_fds(), error


def test_destroying_a_group_fails_pending_p2p_and_closes_its_inbox():
    (b0, a0, e0), (b1, a1, _) = run_ranks(_destroy_with_pending_send, 2, timeout_s=100)
    assert b0 >= 1 and a0 == 0 and a1 == 0
    assert e0 is not None and "destroyed" in e0


def _peer_leaves(rank, world, how: str):
    """Rank 0 completes one send to rank 1, then leaves its group alive (``abort()`` or
    ``destroy_process_group``) and waits for rank 1's verdict; rank 1 receives the completed
    message, then waits in a receive from rank 0 that can never come (the group timeout is
    60 s) and in a receive from any source with rank 2 still in the group (rank 2 sends once
    rank 1 says so)."""
    import torch.distributed as dist

    from fcoll.shm.transport.fences import PeerError

    store = dist.distributed_c10d._get_default_store()
    pg = dist.new_group([0, 1, 2])
    if rank == 0:
        dist.send(torch.arange(4.0), dst=1, group=pg)
        if how == "abort":
            pg.abort()
        else:
            dist.destroy_process_group(pg)
        store.set("left", "1")
        store.wait(["verdict"])
        return None
    if rank == 2:
        store.wait(["send_now"])
        dist.send(torch.full((2,), 7.0), dst=1, group=pg)
        return None
    try:
        first = torch.zeros(4)
        dist.recv(first, src=0, group=pg)
        store.wait(["left"])
        t0 = time.monotonic()
        try:
            dist.recv(torch.zeros(4), src=0, group=pg)
            err = None
        except PeerError as e:
            err = str(e)
        took = time.monotonic() - t0
        anysrc = torch.zeros(2)
        work = pg.recv_anysource([anysrc], 0)
        store.set("send_now", "1")
        work.wait()  # rank 0 has left, rank 2 has not: a receive from any source still works
        return first, err, took, anysrc, work._source_rank()
    finally:
        store.set("send_now", "1")
        store.set("verdict", "1")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["abort", "destroy"])
def test_a_receive_from_a_peer_that_left_the_group_fails_at_once_naming_it(how):
    res = run_ranks(_peer_leaves, 3, args=(how,), pg_timeout_s=60, timeout_s=150)
    first, err, took, anysrc, source = res[1]
    torch.testing.assert_close(first, torch.arange(4.0))  # completed before it left: delivered
    verb = "aborted" if how == "abort" else "destroyed"
    assert err is not None and f"rank 0 {verb} its process group while rank 1" in err, err
    assert took < 10.0, took  # not the 60 s group timeout (loose: a loaded machine's wake-ups)
    torch.testing.assert_close(anysrc, torch.full((2,), 7.0))
    assert source == 2
