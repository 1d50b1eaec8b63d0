"""Tests of the communication model's fit (fcoll.passes.analysis.comm_cost) on synthetic
measurements, and of calibration reuse (fcoll.passes.analysis.calibration,
fcoll.passes.analysis.calibration_cache): within a process, across processes of one job, and rank
0's numbers on every rank. No timing assertions: whether the fitted curves hold on this machine is
``benchmarks/cost_model.py``'s question."""

from __future__ import annotations

import json
import logging
import os
import time
import weakref

import pytest

import canonical  # noqa: E402

from fcoll.passes.analysis import calibration as calibrate  # noqa: E402
from fcoll.passes.analysis import calibration_cache, comm_cost, cost  # noqa: E402
from fcoll.passes.analysis.comm_cost import CommCurve, CommKey, CommParams, CommTable  # noqa: E402
from fcoll.passes.graph import collectives  # noqa: E402
from fcoll.testing import run_ranks  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


def setup_module():
    canonical.ensure_fake_pg()


# ---------------------------------------------------------------------------------------------
# The fit's arithmetic

def test_curve_passes_through_measured_points_and_interpolates_per_segment():
    pts = [(4 * KiB, 20.0), (64 * KiB, 50.0), (1 * MiB, 500.0)]
    c = CommCurve.fit(pts)
    for b, t in pts:
        assert c.time_us(b) == pytest.approx(t)
    # between 64 KiB and 1 MiB: the segment's alpha-beta (a straight line in bytes)
    beta = (500.0 - 50.0) / (MiB - 64 * KiB)
    mid = 512 * KiB
    assert c.time_us(mid) == pytest.approx(50.0 + beta * (mid - 64 * KiB))
    assert c.segment(mid) == CommParams(50.0 - beta * 64 * KiB, beta)


def test_curve_extrapolates_with_the_end_segments():
    c = CommCurve.fit([(4 * KiB, 20.0), (64 * KiB, 50.0), (1 * MiB, 500.0)])
    beta_last = (500.0 - 50.0) / (MiB - 64 * KiB)
    assert c.time_us(4 * MiB) == pytest.approx(500.0 + beta_last * 3 * MiB)
    assert c.beta_us_per_byte == pytest.approx(beta_last)
    beta_first = 30.0 / (60 * KiB)
    alpha_first = 20.0 - beta_first * 4 * KiB
    assert c.time_us(1024) == pytest.approx(alpha_first + beta_first * 1024)
    assert c.alpha_us == pytest.approx(alpha_first)


def test_above_the_largest_size_a_flattened_last_segment_keeps_the_curves_bandwidth():
    """A slow 256 KiB cell lowered to 1 MiB's time by the envelope leaves the last segment
    flat; extrapolated as it is, a 12 MiB bucket would cost what 1 MiB does (seen on train_gpt:
    every size from 0.8 to 12 MiB predicted at 1929 us). Above the largest size the time per
    byte is at least the whole curve's."""
    c = CommCurve.fit([(4 * KiB, 30.0), (64 * KiB, 200.0), (256 * KiB, 3972.0), (MiB, 1929.0)])
    assert c.times_us == (30.0, 200.0, 1929.0, 1929.0)
    overall = (1929.0 - 30.0) / (MiB - 4 * KiB)
    assert c.time_us(12 * MiB) == pytest.approx(1929.0 + overall * 11 * MiB)
    assert c.time_us(12 * MiB) > 10 * c.time_us(MiB)


def test_a_group_is_timed_up_to_the_largest_bucket_its_collectives_can_form():
    """A DDP backward's gradients: timed up to its largest gradient alone before; now up to
    the bucket they can form, all of them up to the cap."""
    gm = canonical.ddp_backward(n_layers=4, batch=64, hidden=256)
    sizes = [cost.collective_size(n).nbytes for n in collectives(gm.graph)]
    assert len(sizes) > 1
    (single,) = calibrate._largest_collectives(gm).values()
    (uncapped,) = calibrate._largest_collectives(gm, bucket_cap_bytes=1 << 40).values()
    (capped,) = calibrate._largest_collectives(gm, bucket_cap_bytes=sum(sizes) // 2).values()
    (below,) = calibrate._largest_collectives(gm, bucket_cap_bytes=1).values()
    assert single == max(sizes)
    assert uncapped == sum(sizes)
    assert capped == max(sum(sizes) // 2, max(sizes))
    assert below == single


def test_below_the_smallest_size_a_negative_latency_becomes_the_smallest_sizes_time():
    """A first segment steeper than proportional would give a negative latency: below the
    smallest measured size the curve is then flat at that size's time (a message smaller than
    any measured costs at least the latency; a line through the origin priced a 48-byte
    collective at about 1 us from a noisy 16 KiB median), and stays non-decreasing."""
    c = CommCurve.fit([(1000, 10.0), (2000, 100.0)])
    assert c.alpha_us == 10.0
    assert c.time_us(500) == c.time_us(0) == c.time_us(48) == 10.0
    assert c.time_us(1000) == 10.0 and c.time_us(1500) == pytest.approx(55.0)


def test_fit_never_makes_a_larger_message_cheaper():
    """A median that caught a burst of load is lowered to what a larger message took; it
    does not raise its neighbours."""
    assert comm_cost.lower_envelope([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.0, 2.0, 4.0]
    assert comm_cost.lower_envelope([130.0, 20000.0, 200.0, 300.0]) == [130.0, 200.0, 200.0,
                                                                         300.0]
    c = CommCurve.fit([(4096, 90.0), (16384, 30.0), (65536, 60.0), (262144, 200.0)])
    assert c.times_us == (30.0, 30.0, 60.0, 200.0)
    assert list(c.times_us) == sorted(c.times_us)
    sizes = [1 << p for p in range(10, 22)]
    times = [c.time_us(b) for b in sizes]
    assert times == sorted(times)


def test_curve_rejects_unusable_points():
    with pytest.raises(ValueError, match="at least two"):
        CommCurve.fit([(4096, 1.0)])
    with pytest.raises(ValueError, match="duplicate sizes"):
        CommCurve.fit([(4096, 1.0), (4096, 2.0)])
    with pytest.raises(ValueError, match="finite"):
        CommCurve.fit([(4096, 1.0), (8192, float("nan"))])
    with pytest.raises(ValueError, match="positive"):
        CommCurve((0, 10), (1.0, 2.0))


def test_two_point_fit_recovers_alpha_and_beta():
    p = comm_cost.fit_alpha_beta([(1000, 50.0 + 1000 * 0.002),
                                  (100000, 50.0 + 100000 * 0.002)])
    assert (p.alpha_us, p.beta_us_per_byte) == (pytest.approx(50.0), pytest.approx(0.002))


# ---------------------------------------------------------------------------------------------
# Lookup: table, links, defaults

def test_table_keeps_intra_and_inter_host_links_apart():
    intra = CommCurve.fit([(4096, 10.0), (MiB, 100.0)])
    inter = CommCurve.fit([(4096, 50.0), (MiB, 1000.0)])
    table = CommTable({CommKey("fcoll", "all_reduce", 4, "intra"): intra,
                       CommKey("fcoll", "all_reduce", 4, "inter"): inter})
    assert table.time_us("fcoll", "all_reduce", 4, MiB) == pytest.approx(100.0)
    assert table.time_us("fcoll", "all_reduce", 4, MiB, link="inter") == pytest.approx(1000.0)
    with pytest.raises(KeyError, match="no calibrated all_gather for backend 'fcoll', 4 ranks"):
        table.time_us("fcoll", "all_gather", 4, MiB)
    # comm_time_us: the table's curve, else the documented defaults
    assert comm_cost.comm_time_us("fcoll", "all_reduce", 4, MiB, "inter",
                                  table=table) == pytest.approx(1000.0)
    assert comm_cost.comm_time_us("gloo", "all_reduce", 4, MiB, table=table) == \
        cost.default_comm("all_reduce", 4).time_us(MiB)


def test_comm_time_rejects_bad_arguments_by_name():
    with pytest.raises(ValueError, match="link must be one of"):
        comm_cost.comm_time_us("fcoll", "all_reduce", 2, 10, link="wan")
    with pytest.raises(ValueError, match="unknown collective kind 'allreduce'"):
        comm_cost.comm_time_us("fcoll", "allreduce", 2, 10)
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        comm_cost.comm_time_us("fcoll", "all_reduce", 2, -1)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        comm_cost.comm_time_us("fcoll", "all_reduce", 0, 10)


def test_cost_model_looks_up_the_groups_link():
    """A graph's all_reduce on group "0": the model uses the curve of that group's backend and
    link, and defaults for a group it has no curve for."""
    gm = canonical.ddp_backward(n_layers=1)
    ar = collectives(gm)[0]
    nbytes = cost.collective_size(ar).nbytes
    slow = CommCurve.fit([(4096, 1000.0), (64 * MiB, 9000.0)])
    fast = CommCurve.fit([(4096, 1.0), (64 * MiB, 2.0)])
    comm = {CommKey("gloo", "all_reduce", 2, "inter"): slow,
            CommKey("gloo", "all_reduce", 2, "intra"): fast}
    inter = cost.assemble_model(None, comm, {"0": "gloo"}, group_links={"0": "inter"})
    intra = cost.assemble_model(None, comm, {"0": "gloo"})
    assert inter(ar) == pytest.approx(slow.time_us(nbytes))
    assert intra(ar) == pytest.approx(fast.time_us(nbytes))
    assert cost.CostModel()(ar) == pytest.approx(
        cost.default_comm("all_reduce", 2).time_us(nbytes))


def test_sweep_covers_the_graphs_largest_collective_and_at_least_1_mib():
    assert calibrate.SWEEP_BYTES[0] == 4 * KiB and calibrate.SWEEP_BYTES[-1] == 64 * MiB
    assert 2 * MiB in calibrate.SWEEP_BYTES      # a 2-rank all_gather's last one-phase size
    assert calibrate.sizes_for(100)[-1] == MiB
    assert calibrate.sizes_for(MiB + 1)[-1] == 2 * MiB
    assert calibrate.sizes_for(2 * MiB + 1)[-1] == 4 * MiB
    assert calibrate.sizes_for(4 * MiB)[-1] == 4 * MiB
    assert calibrate.sizes_for(1 << 30) == calibrate.SWEEP_BYTES
    assert calibrate.sizes_for(None) == calibrate.SWEEP_BYTES


def test_cells_are_timed_kind_by_kind_each_after_an_untimed_run_of_the_same_cell(monkeypatch):
    """In every round the kinds come in order and each kind's sizes largest first, so a
    cell's neighbours are its own kind (a step's buckets; interleaving the kinds made fcoll's
    small collectives 1.15-1.3x slower); each cell runs once untimed, then its timed runs back
    to back (a collective timed right after a larger one measures that one's exit skew: a
    16 MiB broadcast after a 64 MiB one, 1.35-1.48x).

    all_reduce 16M, 256K, 4K; broadcast 16M, 256K, 4K (round 0)
    -> ar16M x(1+1) | ar256K x(1+3) | ar4K x(1+3) | bc16M x(1+1) | bc256K x(1+3) | ..."""
    calls: list[tuple[str, int]] = []
    sizes = (4 * KiB, 256 * KiB, 16 * MiB)
    cells = [(kind, size) for kind in ("all_reduce", "broadcast") for size in sizes]
    # a cell's "buffers" are its size; its "collective" records the call
    monkeypatch.setattr(calibrate, "probe_buffers", lambda pg, nbytes: nbytes)
    monkeypatch.setattr(calibrate, "blocking_collective",
                        lambda kind, pg, nbytes: lambda: calls.append((kind, nbytes)))
    times = calibrate.time_collectives(object(), cells)
    assert {cell: len(t) for cell, t in times.items()} == {
        cell: calibrate.reps_for(cell[1]) for cell in cells}
    body = calls[len(cells):]                 # after one warm-up run of every cell
    runs = []                                 # (cell, consecutive calls)
    for cell in body:
        if runs and runs[-1][0] == cell:
            runs[-1][1] += 1
        else:
            runs.append([cell, 1])
    expected = []
    for r in range(calibrate.ROUNDS):
        for kind in ("all_reduce", "broadcast"):
            for size in sorted(sizes, reverse=True):
                timed = calibrate._runs_in_round(calibrate.reps_for(size), r)
                if timed:
                    expected.append([(kind, size), 1 + timed])
    assert runs == expected
    assert expected[:3] == [[("all_reduce", 16 * MiB), 2], [("all_reduce", 256 * KiB), 4],
                            [("all_reduce", 4 * KiB), 4]]


def test_reps_are_a_function_of_the_size_alone_and_fill_every_round():
    """Every rank issues the same collectives (the count never depends on a clock), and each of
    the three rounds times a cell back to back: three times up to 256 KiB, twice up to 4 MiB."""
    for size in calibrate.SWEEP_BYTES:
        reps = calibrate.reps_for(size)
        per_round = [calibrate._runs_in_round(reps, r) for r in range(calibrate.ROUNDS)]
        assert sum(per_round) == reps and min(per_round) >= 1
        if size <= 256 * KiB:
            assert per_round == [3, 3, 3]
        elif size <= 4 * MiB:
            assert per_round == [2, 2, 2]


# ---------------------------------------------------------------------------------------------
# The job's cache file

@pytest.fixture
def job_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FCOLL_CALIBRATION_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FCOLL_JOB_ID", "test-job")
    monkeypatch.delenv("FCOLL_CALIBRATION_CACHE", raising=False)
    return tmp_path / "cache"


KEY = {"backend": "fcoll", "group_size": 2, "layout": "0.0"}


def test_cache_file_round_trip(job_dir):
    path = calibration_cache.cache_path("fcoll", 2, "0.0")
    assert path is not None and path.startswith(str(job_dir))
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    points = {"all_reduce": [[4096, 20.0], [MiB, 300.0]]}
    calibration_cache.write_entry(path, KEY, [1.0, 2.0, 3.0], points)
    entry = calibration_cache.read_entry(path, KEY)
    assert entry["compute"] == [1.0, 2.0, 3.0] and entry["points"] == points
    assert calibration_cache.read_entry(path, {**KEY, "layout": "0.1"}) is None  # another key
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no temp files left


def test_bad_cache_files_are_ignored_with_a_warning(job_dir, caplog):
    path = calibration_cache.cache_path("fcoll", 2, "0.0")
    with open(path, "w") as f:
        f.write("{not json")
    with caplog.at_level(logging.WARNING, logger="fcoll.passes.analysis.calibration_cache"):
        assert calibration_cache.read_entry(path, KEY) is None
    assert "unreadable" in caplog.text
    bad = {"format": calibration_cache.FORMAT, "key": KEY, "compute": [1.0, 2.0, 3.0],
           "points": {"all_reduce": [[4096, -5.0]]}}
    with open(path, "w") as f:
        json.dump(bad, f)
    assert calibration_cache.read_entry(path, KEY) is None


def test_without_a_job_identity_the_cache_is_this_machines(monkeypatch, tmp_path):
    """The default: one directory per machine, whatever torchrun's run id (every launch has a
    new one), so every run on this machine reuses the first run's numbers and plans alike;
    ``FCOLL_JOB_ID`` gives a job its own; ``FCOLL_CALIBRATION_CACHE=0`` turns it off."""
    monkeypatch.setenv("FCOLL_CALIBRATION_DIR", str(tmp_path))
    monkeypatch.delenv("FCOLL_CALIBRATION_CACHE", raising=False)
    monkeypatch.delenv("FCOLL_JOB_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    machine = calibration_cache.cache_path("fcoll", 2, "0.0")
    assert os.path.basename(os.path.dirname(machine)).startswith("machine-")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "def")
    assert calibration_cache.cache_path("fcoll", 2, "0.0") == machine
    monkeypatch.setenv("FCOLL_JOB_ID", "my-run")
    job = calibration_cache.cache_path("fcoll", 2, "0.0")
    assert os.path.basename(os.path.dirname(job)).startswith("job-") and job != machine
    monkeypatch.setenv("FCOLL_CALIBRATION_CACHE", "0")
    assert calibration_cache.cache_path("fcoll", 2, "0.0") is None


def test_recalibrate_ignores_the_file_and_old_job_directories_go_but_machines_stay(
        monkeypatch, tmp_path):
    monkeypatch.setenv("FCOLL_CALIBRATION_DIR", str(tmp_path))
    monkeypatch.delenv("FCOLL_CALIBRATION_CACHE", raising=False)
    monkeypatch.delenv("FCOLL_JOB_ID", raising=False)
    path = calibration_cache.cache_path("fcoll", 2, "0.0")
    calibration_cache.write_entry(path, KEY, [1.0, 2.0, 3.0], {"all_reduce": [[4096, 20.0]]})
    assert calibration_cache.read_entry(path, KEY) is not None
    monkeypatch.setenv("FCOLL_RECALIBRATE", "1")
    assert calibration_cache.read_entry(path, KEY) is None
    monkeypatch.delenv("FCOLL_RECALIBRATE")
    old = time.time() - calibration_cache.STALE_S - 60
    monkeypatch.setenv("FCOLL_JOB_ID", "old-job")
    old_job = os.path.dirname(calibration_cache.cache_path("fcoll", 2, "0.0"))
    for d in (old_job, os.path.dirname(path)):
        os.utime(d, (old, old))
    monkeypatch.setenv("FCOLL_JOB_ID", "new-job")
    calibration_cache.cache_path("fcoll", 2, "0.0")   # a new job directory prunes
    assert not os.path.exists(old_job)
    assert calibration_cache.read_entry(path, KEY) is not None   # the machine's stays


def test_a_directory_others_can_write_is_refused(job_dir, caplog):
    job_dir.mkdir(mode=0o777)
    os.chmod(job_dir, 0o777)
    with caplog.at_level(logging.WARNING, logger="fcoll.passes.analysis.calibration_cache"):
        assert calibration_cache.cache_path("fcoll", 2, "0.0") is None
    assert "not a private directory" in caplog.text


# ---------------------------------------------------------------------------------------------
# Reuse and determinism on two real ranks

def _curves(comm):
    return {f"{k.backend}/{k.kind}/{k.group_size}/{k.link}": c.as_points()
            for k, c in sorted(comm.items())}


def _reuse_in_one_process(rank, world_size):
    """Calibrate the fcoll world group up to 64 KiB (1 MiB covered), then the same group again
    and for 4 MiB (cached, never communicates), then a new fcoll group of the same size for
    4 MiB (rank 0's numbers reused, only 2 and 4 MiB timed)."""
    import torch.distributed as dist

    from fcoll.passes.analysis import calibration as cal

    os.environ["FCOLL_CALIBRATION_CACHE"] = "0"
    world = dist.group.WORLD
    steps = {}
    _, a = cal.calibrate_group(world, 64 * KiB)
    steps["first"] = cal.calibration_stats()
    cal.calibrate_group(world, 64 * KiB)                 # covered: no communication
    steps["again"] = cal.calibration_stats()
    _, b = cal.calibrate_group(world, 4 * MiB)           # cached: extrapolated, not timed
    steps["larger"] = cal.calibration_stats()
    _, c = cal.calibrate_group(dist.new_group(backend="fcoll"), 4 * MiB)   # another group
    steps["other_group"] = cal.calibration_stats()
    return {"steps": steps, "a": _curves(a), "b": _curves(b), "c": _curves(c),
            "table": sorted(str(k) for k in cal.calibrated_table().entries)}


def test_calibration_is_reused_within_a_process_and_every_rank_has_rank_0s_curves():
    r0, r1 = run_ranks(_reuse_in_one_process, 2, backend="fcoll", timeout_s=150)
    for label in ("a", "b", "c"):
        assert r0[label] == r1[label], label
    s0, s1 = r0["steps"], r1["steps"]
    for s in (s0, s1):
        assert s["first"]["sweeps"] == 1 and s["first"]["timed_sizes"] == 5   # 4 KiB .. 1 MiB
        assert s["again"] == s["first"] and s["larger"] == s["first"]
        assert s["other_group"]["sweeps"] == 2 and s["other_group"]["timed_sizes"] == 7
    assert s0["other_group"]["key_hits"] == 1                 # rank 0 reused its numbers
    assert r0["a"] == r0["b"]
    assert {len(p) for p in r0["b"].values()} == {5}
    assert {len(p) for p in r0["c"].values()} == {7}          # + 2 MiB and 4 MiB
    assert len(r0["a"]) == len(cost.KINDS)
    assert all("link='intra'" in k for k in r0["table"])


def _calibrate_with_job_cache(rank, world_size, cache_dir, inject):
    import torch.distributed as dist

    from fcoll.passes.analysis import calibration as cal

    os.environ.update(FCOLL_CALIBRATION_DIR=cache_dir, FCOLL_JOB_ID="job-42")
    os.environ.pop("FCOLL_CALIBRATION_CACHE", None)
    if inject is not None and rank == inject["rank"]:
        # this rank alone "knows" other numbers: only rank 0's knowledge may count
        points = {k: {s: inject["us"] * (i + 1) for i, s in enumerate(cal.sizes_for(64 * KiB))}
                  for k in cost.KINDS}
        cal._CACHE.by_key[("fcoll", world_size, "0.0")] = cal.GroupCalibration(
            "fcoll", world_size, "0.0", "intra", cost.DEFAULT_COMPUTE, points, {})
    rates, comm = cal.calibrate_group(dist.group.WORLD, 64 * KiB)
    return {"curves": _curves(comm), "rates": rates, "stats": cal.calibration_stats()}


def _rank_dependent_times(rank, world_size):
    """Calibrate with a stand-in timing loop in which rank r measures 10 * (r + 1) us (and
    an outlier run of 1000 us) for every cell."""
    import torch.distributed as dist

    from fcoll.passes.analysis import calibration as cal

    os.environ["FCOLL_CALIBRATION_CACHE"] = "0"
    cal.time_collectives = lambda pg, cells, reps=None: {
        cell: [10.0 * (rank + 1), 1000.0, 10.0 * (rank + 1)] for cell in cells}
    _, comm = cal.calibrate_group(dist.group.WORLD, 64 * KiB)
    return _curves(comm)


def test_every_rank_gets_the_slowest_ranks_median_of_each_cell():
    """Each cell's number is the largest of the ranks' medians (a step waits for its slowest
    rank; a broadcast's root returns before its peers copied the data out): rank 0 measured
    10 us, rank 1 20 us, so every rank's curves go through 20 us at every timed size."""
    r0, r1 = run_ranks(_rank_dependent_times, 2, backend="fcoll", timeout_s=150)
    assert r0 == r1
    assert len(r0) == len(cost.KINDS)
    for pts in r0.values():
        assert pts == [[s, 20.0] for s in calibrate.sizes_for(64 * KiB)]


def test_fcoll_reduce_scatter_is_timed_by_the_single_tensor_call(monkeypatch):
    """Off gloo, reduce_scatter is timed as the other kinds are, by the backend's single-tensor
    c10d call (``dist.reduce_scatter_tensor``), not by the one-tensor coalesced call that
    ``fcoll.ops`` makes eagerly (fcoll's general path, 4-7x slower at 4-64 KiB, and not what
    compiled graphs run); gloo keeps fcoll's all_to_all plus a local sum."""
    import torch.distributed as dist

    import fcoll.ops.library as library

    seen = []
    monkeypatch.setattr(dist, "reduce_scatter_tensor",
                        lambda out, inp, group=None: seen.append((out.numel(), inp.numel())))
    monkeypatch.setattr(library, "start_reduce_scatter", lambda *a, **k: seen.append("coalesced"))
    world = dist.group.WORLD      # the fake process group
    bufs = calibrate.probe_buffers(world, 4 * KiB)
    calibrate.blocking_collective("reduce_scatter", world, bufs)()
    assert seen == [(512, 1024)]


def test_calibration_is_reused_across_processes_of_one_job(tmp_path):
    first = run_ranks(_calibrate_with_job_cache, 2, backend="fcoll",
                      args=(str(tmp_path), None), timeout_s=150)
    second = run_ranks(_calibrate_with_job_cache, 2, backend="fcoll",
                       args=(str(tmp_path), None), timeout_s=150)
    assert first[0]["stats"]["sweeps"] == 1 and first[0]["stats"]["file_hits"] == 0
    assert second[0]["stats"]["file_hits"] == 1                  # rank 0 read the file
    assert second[0]["stats"]["sweeps"] == second[1]["stats"]["sweeps"] == 0   # nobody timed
    for r in (*first, *second):
        assert r["curves"] == first[0]["curves"] and r["rates"] == first[0]["rates"]
    (job,) = os.listdir(tmp_path)
    (name,) = os.listdir(tmp_path / job)
    assert name.startswith("fcoll-2ranks-") and name.endswith(".json")


def test_only_rank_0s_knowledge_decides(tmp_path):
    """Rank 1 alone holding numbers for the key neither skips the sweep (that would hang) nor
    leaks its numbers; rank 0 holding them gives them to every rank without timing."""
    r0, r1 = run_ranks(_calibrate_with_job_cache, 2, backend="fcoll",
                       args=(str(tmp_path / "a"), {"rank": 1, "us": 7.0}), timeout_s=150)
    assert r0["curves"] == r1["curves"]
    assert r0["stats"]["sweeps"] == r1["stats"]["sweeps"] == 1
    assert 7.0 not in {t for pts in r0["curves"].values() for _, t in pts}
    r0, r1 = run_ranks(_calibrate_with_job_cache, 2, backend="fcoll",
                       args=(str(tmp_path / "b"), {"rank": 0, "us": 7.0}), timeout_s=150)
    assert r0["curves"] == r1["curves"]
    assert r0["stats"]["sweeps"] == r1["stats"]["sweeps"] == 0
    assert r1["rates"] == cost.DEFAULT_COMPUTE
    want = [[s, 7.0 * (i + 1)] for i, s in enumerate(calibrate.sizes_for(64 * KiB))]
    for pts in r1["curves"].values():
        assert pts == want


def test_precompute_cli_fills_the_job_cache(job_dir, monkeypatch, capsys):
    from fcoll.calibrate import main

    assert main(["--nproc", "2", "--backends", "fcoll", "--max-bytes", "4K"]) == 0
    path = calibration_cache.cache_path("fcoll", 2, "0.0")
    entry = calibration_cache.read_entry(path, KEY)
    assert entry is not None
    assert {len(v) for v in entry["points"].values()} == {len(calibrate.sizes_for(4 * KiB))}
    assert path in capsys.readouterr().out
    assert main(["--nproc", "2", "--backends", "fcoll", "--max-bytes", "4K"]) == 0
    assert "; 0 sizes timed, 1 read from the cache file)" in capsys.readouterr().out
    assert main(["--nproc", "2", "--backends", "fcoll", "--max-bytes", "4K", "--refresh"]) == 0
    assert f"; {len(calibrate.sizes_for(4 * KiB))} sizes timed, 0 read from the cache file)" \
        in capsys.readouterr().out
    monkeypatch.setenv("FCOLL_CALIBRATION_CACHE", "0")
    assert main(["--nproc", "2"]) == 2
    assert "turns the cache file off" in capsys.readouterr().err


def test_a_new_job_removes_job_directories_untouched_for_a_day(job_dir, monkeypatch):
    import time

    old = calibration_cache.cache_path("fcoll", 2, "0.0")
    calibration_cache.write_entry(old, KEY, [1.0, 2.0, 3.0], {})
    monkeypatch.setenv("FCOLL_JOB_ID", "recent-job")
    recent = calibration_cache.cache_path("fcoll", 2, "0.0")
    two_days_ago = time.time() - 2 * calibration_cache.STALE_S
    os.utime(os.path.dirname(old), (two_days_ago, two_days_ago))
    monkeypatch.setenv("FCOLL_JOB_ID", "new-job")
    assert calibration_cache.cache_path("fcoll", 2, "0.0") is not None
    assert not os.path.exists(os.path.dirname(old))
    assert os.path.isdir(os.path.dirname(recent))


def _different_max_bytes(rank, world_size):
    import torch.distributed as dist

    from fcoll.passes.analysis import calibration as cal

    os.environ["FCOLL_CALIBRATION_CACHE"] = "0"
    mine = [64 * KiB, 4 * MiB][rank]      # as if a size hint differed between the ranks
    _, first = cal.calibrate_group(dist.group.WORLD, mine)
    _, second = cal.calibrate_group(dist.group.WORLD, [4 * MiB, 64 * KiB][rank])
    return _curves(first), _curves(second), cal.calibration_stats()


def test_ranks_asking_for_different_sizes_time_what_rank_0_asks():
    """What to time is rank 0's decision: a rank asking for more (or less) neither hangs nor
    gets other numbers; a second call never communicates."""
    (a0, b0, s0), (a1, b1, s1) = run_ranks(_different_max_bytes, 2, backend="fcoll",
                                           timeout_s=150)
    assert a0 == a1 == b0 == b1
    assert {len(p) for p in a0.values()} == {len(calibrate.sizes_for(64 * KiB))}
    assert s0["sweeps"] == s1["sweeps"] == 1


def test_needs_calibration_is_decided_per_group(monkeypatch):
    """A graph whose other group was calibrated by an earlier graph still needs calibrating
    for its new group (the bucket planner then calibrates at the same pass as for a graph of
    new groups only, on every rank), not the defaults; fake groups never need it."""
    class Group:  # weak-referenceable stand-in for a process group
        pass

    old, new = Group(), Group()
    groups = {"old": old, "new": new, "fake": None}
    names: list[str] = []
    monkeypatch.setattr(calibrate, "_group_names", lambda gm: list(names))
    monkeypatch.setattr(calibrate, "_real_group", groups.get)
    monkeypatch.setattr(calibrate._CACHE, "groups", weakref.WeakKeyDictionary({old: None}))
    names[:] = ["old"]
    assert not calibrate.needs_calibration(None)
    names[:] = ["old", "new"]
    assert calibrate.needs_calibration(None)
    names[:] = ["fake", "old"]
    assert not calibrate.needs_calibration(None)
    calibrate._CACHE.groups[new] = None
    names[:] = ["old", "new"]
    assert not calibrate.needs_calibration(None)
