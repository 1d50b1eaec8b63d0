"""CUDA tensors: fcoll's IPC path, fcoll's staged path and gloo side by side in one run.

Usage: ``python benchmarks/collectives.py --device cuda --nproc 2 [--quick] [--json out.json]``
(local rank r on ``cuda:{r % device_count}``: with one GPU every rank shares it).

One job of ``nproc`` ranks (default group: fcoll, used only for CPU barriers and agreements)
makes three groups: two fcoll groups whose CUDA path is fixed at their first CUDA collective by
``FCOLL_CUDA_PATH`` (``ipc``, ``staged``; :func:`fcoll.shm.cuda_path` reports what each got), and
a gloo group. Per op and size the three are warmed up, checked once for correct results, then
timed in interleaved repetitions (so they see the same machine noise).

Conventions (nccl-tests, ``doc/PERFORMANCE.md``; sizes as in :mod:`collectives`):

* ``time`` (us): the median over repetitions of one collective's time; a repetition is ``k``
  back-to-back calls between two ``torch.cuda.synchronize()`` after a barrier (``Work.wait()`` on
  CUDA is a stream wait, so host timers around ``wait()`` alone would measure launches). ``k``
  makes a repetition last about :data:`REP_TARGET_US` (at least 1 call), agreed by all ranks.
  The slowest rank's median is reported.
* ``lat`` (us, sizes up to :data:`LATENCY_MAX_BYTES`): the median of one call followed by
  ``torch.cuda.synchronize()``, after a barrier: what a lone small collective costs.
* ``algbw = size / time``, ``busbw = algbw * factor`` (GB/s, 1 GB = 1e9 B); factor all_reduce
  2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast 1.
* ``ceiling`` (GB/s): device-to-device copy bandwidth, ``dst.copy_(src)`` of
  :data:`CEILING_BYTES` timed with CUDA events, counting bytes read + written (2 x size per
  copy), measured in the same run on each GPU the ranks use; with several GPUs, the sum over
  them (the bytes below spread over their memories).
* ``% of ceiling`` (all_reduce): every rank must read its input and write its output, so an
  all_reduce of ``size`` moves at least ``2 * n * size`` bytes through device memory:
  ``2 * n * size / time / ceiling``.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from fcoll.ops.facts import OPS as OPS_FACTS, busbw_factor
from fcoll.testing import run_ranks

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB,
         128 * MiB, 256 * MiB]
QUICK_SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 128 * MiB]
CONFIGS = ("ipc", "staged", "gloo")  # "ipc" / "staged": fcoll groups; "gloo": a gloo group
LABELS = {"ipc": "fcoll-ipc", "staged": "fcoll-staged", "gloo": "gloo"}
LATENCY_MAX_BYTES = 64 * KiB
CEILING_BYTES = 256 * MiB
REP_TARGET_US = 3000.0
MAX_CALLS_PER_REP = 200

__all__ = ["SIZES", "QUICK_SIZES", "CONFIGS", "run", "report", "targets", "pct_of_ceiling"]


def bus_factor(op: str, n: int) -> float:
    return busbw_factor(OPS_FACTS[op].kind, n)


def pct_of_ceiling(size: int, n: int, time_us: float, ceiling_gbps: float) -> float:
    """Percent of the copy ceiling an all_reduce of ``size`` bytes per rank reached:
    ``2 * n * size`` bytes (each rank reads its input, writes its output) / time / ceiling."""
    return 100.0 * 2 * n * size / (time_us * 1e-6) / 1e9 / ceiling_gbps


# ---------------------------------------------------------------------------------------------
# On the ranks

def _make_call(op: str, size: int, n: int, device: torch.device):
    """``(call(group), fill(value), check() -> str | None)`` of ``op`` on ``size`` bytes.

    ``fill(rank + 1)`` then one call makes outputs that ``check`` verifies exactly (float32
    small integers): sums are ``n (n + 1) / 2``, gathered row ``r`` is ``r + 1``, a broadcast is 1.
    """
    numel = max(size // 4, n)
    numel -= numel % n
    total = n * (n + 1) / 2
    new = lambda k: torch.empty(k, device=device)  # noqa: E731
    if op == "all_reduce":
        t = new(numel)
        return (lambda g: dist.all_reduce(t, group=g), t.fill_,
                lambda: None if bool((t == total).all()) else f"values {t[:4].tolist()} != {total}")
    if op == "broadcast":
        t = new(numel)
        return (lambda g: dist.broadcast(t, src=0, group=g), t.fill_,
                lambda: None if bool((t == 1).all()) else f"values {t[:4].tolist()} != 1")
    rows = torch.arange(1, n + 1, device=device, dtype=torch.float32).repeat_interleave(numel // n)
    if op == "all_gather_into_tensor":
        out, inp = new(numel), new(numel // n)
        return (lambda g: dist.all_gather_into_tensor(out, inp, group=g), inp.fill_,
                lambda: None if torch.equal(out, rows) else "gathered rows != rank + 1")
    if op == "reduce_scatter_tensor":
        out, inp = new(numel // n), new(numel)
        return (lambda g: dist.reduce_scatter_tensor(out, inp, group=g), inp.fill_,
                lambda: None if bool((out == total).all()) else f"values != {total}")
    if op == "all_to_all_single":
        out, inp = new(numel), new(numel)
        return (lambda g: dist.all_to_all_single(out, inp, group=g), inp.fill_,
                lambda: None if torch.equal(out, rows) else "received rows != rank + 1")
    raise ValueError(op)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_gbps(device: torch.device, nbytes: int = CEILING_BYTES, iters: int = 10,
               reps: int = 5) -> float:
    """Median device-to-device copy bandwidth (bytes read + written per second / 1e9), timed
    with CUDA events (host timer on CPU, where only the tests run it)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            for _ in range(iters):
                dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) * 1e-3
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src)
            seconds = time.perf_counter() - t0
        out.append(2 * nbytes * iters / seconds / 1e9)
    return statistics.median(out)


def _agree_max(values: list[float]) -> list[float]:
    """Elementwise max over ranks (CPU tensor on the default group)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _cuda_path(group) -> str:
    try:
        import fcoll.shm as shm

        return getattr(shm, "cuda_path")(group) or "?"
    except Exception:  # noqa: BLE001  not landed yet
        return "?"


def _groups(configs: list[str], device: torch.device) -> tuple[dict, dict, dict]:
    """The groups of ``configs``, each past its first CUDA collective; (groups, paths, errors)."""
    groups, paths, errors = {}, {}, {}
    for cfg in configs:
        groups[cfg] = dist.new_group(backend="gloo" if cfg == "gloo" else "fcoll")
    saved = os.environ.get("FCOLL_CUDA_PATH")
    for cfg in configs:
        if cfg != "gloo":
            os.environ["FCOLL_CUDA_PATH"] = cfg
        try:
            dist.all_reduce(torch.ones(4, device=device), group=groups[cfg])
            _sync(device)
            paths[cfg] = "gloo" if cfg == "gloo" else _cuda_path(groups[cfg])
        except Exception as e:  # noqa: BLE001  reported, that configuration is left out
            errors[cfg] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        finally:
            if saved is None:
                os.environ.pop("FCOLL_CUDA_PATH", None)
            else:
                os.environ["FCOLL_CUDA_PATH"] = saved
    failed = _agree_max([float(c in errors) for c in configs])
    for cfg, f in zip(configs, failed):
        if f:
            errors.setdefault(cfg, "failed on another rank")
            groups.pop(cfg)
    return groups, paths, errors


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _timed(call: Callable[[], None], k: int, barrier: Callable[[], None],
           device: torch.device) -> float:
    barrier()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(k):
        call()
    _sync(device)
    return (time.perf_counter() - t0) / k * 1e6


def _bench_one(op, size, rank, world, device, groups, reps, barrier, errors):
    """{config: {"us", "lat_us", "k"}} for one op and size (configs that fail are left out)."""
    calls, fill, check = _make_call(op, size, world, device)
    names = list(groups)
    if not names:  # the same on every rank (agreed in _groups)
        return {}
    bad = []
    for cfg in names:
        try:
            fill(float(rank + 1))
            calls(groups[cfg])
            _sync(device)
            why = check()
            if why is not None:
                raise AssertionError(f"wrong result: {why}")
            calls(groups[cfg])  # a second warm-up call
        except Exception as e:  # noqa: BLE001
            errors[f"{cfg} {op} {size}"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            bad.append(cfg)
    failed = _agree_max([float(c in bad) for c in names])
    names = [c for c, f in zip(names, failed) if not f]
    if not names:
        return {}
    fill(0.0)  # in-place all_reduce: keep the values finite
    one = _agree_max([_timed(lambda c=c: calls(groups[c]), 1, barrier, device) for c in names])
    ks = {c: max(1, min(MAX_CALLS_PER_REP, int(REP_TARGET_US / max(t, 1e-3))))
          for c, t in zip(names, one)}
    times: dict[str, list[float]] = {c: [] for c in names}
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for c in order:
            times[c].append(_timed(lambda c=c: calls(groups[c]), ks[c], barrier, device))
    out = {c: {"us": statistics.median(times[c]), "k": ks[c]} for c in names}
    if size <= LATENCY_MAX_BYTES:
        for c in names:
            out[c]["lat_us"] = statistics.median(
                _timed(lambda c=c: calls(groups[c]), 1, barrier, device)
                for _ in range(max(reps, 15)))
    return out


def _bench(rank: int, world: int, ops: list[str], sizes: list[int], reps: int,
           configs: list[str], device_type: str = "cuda", ceiling_bytes: int = CEILING_BYTES
           ) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) %
                              torch.cuda.device_count())
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    else:  # tests: the whole benchmark on CPU tensors (fcoll's CPU path, no CUDA call)
        device, name = torch.device("cpu"), "cpu"
    flag = torch.zeros(1)
    barrier = lambda: dist.all_reduce(flag)  # noqa: E731  CPU, fcoll default group: microseconds
    ceiling = {}
    for r in range(world):  # one rank at a time, so a shared GPU is measured alone
        barrier()
        if r == rank:
            ceiling = {"device": device.index or 0, "name": name,
                       "copy_gbps": _copy_gbps(device, ceiling_bytes), "bytes": ceiling_bytes}
        barrier()
    _empty_cache(device)
    groups, paths, errors = _groups(configs, device)
    res = {}
    for op in ops:
        for size in sizes:
            res[(op, size)] = _bench_one(op, size, rank, world, device, groups, reps, barrier,
                                         errors)
            _empty_cache(device)
    return {"results": res, "paths": paths, "errors": errors, "ceiling": ceiling,
            "torch_cuda": torch.version.cuda, "device_type": device_type}


def run(nproc: int, ops: list[str], sizes: list[int], reps: int,
        configs: list[str] = list(CONFIGS), device_type: str = "cuda",
        ceiling_bytes: int = CEILING_BYTES) -> list[dict]:
    """Per-rank results of the CUDA benchmark (``nproc`` spawned ranks, fcoll default group).

    ``device_type="cpu"`` runs the same code on CPU tensors (for the tests on machines without
    a GPU); ``ceiling_bytes`` shrinks the copy there.
    """
    return run_ranks(_bench, nproc, args=(ops, sizes, reps, configs, device_type,
                                          ceiling_bytes), timeout_s=900, pg_timeout_s=300)


# ---------------------------------------------------------------------------------------------
# Report

def _fmt_size(b: int) -> str:
    return f"{b // MiB} MiB" if b >= MiB else f"{b // KiB} KiB"


def ceiling_gbps(per_rank: list[dict]) -> float:
    """Sum over the distinct GPUs of their copy bandwidth (first rank measured on each)."""
    seen: dict[int, float] = {}
    for r in per_rank:
        seen.setdefault(r["ceiling"]["device"], r["ceiling"]["copy_gbps"])
    return sum(seen.values())


def summarize(per_rank: list[dict], ops: list[str], sizes: list[int], n: int,
              ceiling: float) -> dict:
    """``{op: {size: row}}``: the slowest rank's times, algbw, busbw, ratios to gloo."""
    out: dict = {}
    for op in ops:
        for size in sizes:
            row: dict = {}
            for cfg in CONFIGS:
                rs = [r["results"][(op, size)].get(cfg) for r in per_rank]
                if any(x is None for x in rs):
                    continue
                us = max(x["us"] for x in rs)
                alg = size / (us * 1e-6) / 1e9
                row[f"{cfg}_us"] = us
                row[f"{cfg}_algbw_gbps"] = alg
                row[f"{cfg}_busbw_gbps"] = alg * bus_factor(op, n)
                if all("lat_us" in x for x in rs):
                    row[f"{cfg}_lat_us"] = max(x["lat_us"] for x in rs)
                if op == "all_reduce" and ceiling > 0:
                    row[f"{cfg}_pct_of_ceiling"] = pct_of_ceiling(size, n, us, ceiling)
            for cfg in ("ipc", "staged"):
                if f"{cfg}_us" in row and "gloo_us" in row:
                    row[f"{cfg}_vs_gloo"] = row["gloo_us"] / row[f"{cfg}_us"]  # = busbw ratio
            out.setdefault(op, {})[size] = row
    return out


def targets(table: dict) -> list[tuple[str, str, bool | None]]:
    """The issue's targets on an H100: ``(name, measured, passed)``; passed None when not run.

    all_reduce 128 MiB: ipc busbw >= 100x gloo, ipc >= 40 % of ceiling, staged busbw >= 3x
    gloo; all_reduce 4 KiB: ipc time <= 30 us (nccl-tests' time: back-to-back calls).
    """
    ar = table.get("all_reduce", {})
    big, small = ar.get(128 * MiB, {}), ar.get(4 * KiB, {})

    def check(row, key, ok, fmt):
        return (fmt % row[key], ok(row[key])) if key in row else ("not run", None)

    rows = [("all_reduce 128 MiB: fcoll-ipc busbw >= 100x gloo",
             *check(big, "ipc_vs_gloo", lambda v: v >= 100, "%.1fx")),
            ("all_reduce 128 MiB: fcoll-ipc >= 40 % of ceiling",
             *check(big, "ipc_pct_of_ceiling", lambda v: v >= 40, "%.1f %%")),
            ("all_reduce 4 KiB: fcoll-ipc time <= 30 us",
             *check(small, "ipc_us", lambda v: v <= 30, "%.1f us")),
            ("all_reduce 128 MiB: fcoll-staged busbw >= 3x gloo",
             *check(big, "staged_vs_gloo", lambda v: v >= 3, "%.1fx"))]
    return rows


def _ratio(row: dict, cfg: str) -> str:
    key = f"{cfg}_vs_gloo"
    return f"{row[key]:>7.1f}x" if key in row else f"{'-':>8}"


def _cell(row: dict, cfg: str) -> str:
    if f"{cfg}_us" not in row:
        return f"{'-':>10} {'-':>7} {'-':>7}"
    return (f"{row[f'{cfg}_us']:>10.1f} {row[f'{cfg}_algbw_gbps']:>7.2f} "
            f"{row[f'{cfg}_busbw_gbps']:>7.2f}")


def report(per_rank: list[dict], ops: list[str], sizes: list[int], n: int) -> dict:
    """Print the tables and the target lines; return the JSON body (``results`` etc.)."""
    ceiling = ceiling_gbps(per_rank)
    table = summarize(per_rank, ops, sizes, n, ceiling)
    paths = per_rank[0]["paths"]
    errors = {f"rank {i}: {k}": v for i, r in enumerate(per_rank) for k, v in r["errors"].items()}
    devs = sorted({(r["ceiling"]["device"], r["ceiling"]["name"]) for r in per_rank})
    kind = per_rank[0]["device_type"]
    print(f"# {n} ranks on {len(devs)} device(s) "
          f"({', '.join(f'{kind}:{d} {name}' for d, name in devs)}), "
          f"CUDA {per_rank[0]['torch_cuda']}")
    print("# configurations: " + ", ".join(
        f"{LABELS[c]} (path {paths.get(c, 'failed')})" for c in CONFIGS))
    print(f"# ceiling: device-to-device copy {ceiling:.1f} GB/s (bytes read + written, "
          f"{_fmt_size(per_rank[0]['ceiling']['bytes'])} copy_, CUDA events, sum over GPUs)")
    head = f"{'us':>10} {'algbw':>7} {'busbw':>7}"
    for op in ops:
        pct = op == "all_reduce"
        print(f"\n# {op}  (busbw factor {bus_factor(op, n):.3g})")
        print(f"{'size':>9} | {'fcoll-ipc':^26}{' %ceil' if pct else ''} | {'fcoll-staged':^26} | "
              f"{'gloo':^26} | {'ipc/gloo':>8} {'stg/gloo':>8}")
        print(f"{'':>9} | {head}{'      ' if pct else ''} | {head} | {head} |")
        for size in sizes:
            row = table[op][size]
            p = f" {row['ipc_pct_of_ceiling']:>5.1f}" if pct and "ipc_pct_of_ceiling" in row \
                else (f" {'-':>5}" if pct else "")
            print(f"{_fmt_size(size):>9} | {_cell(row, 'ipc')}{p} | {_cell(row, 'staged')} | "
                  f"{_cell(row, 'gloo')} | {_ratio(row, 'ipc')} {_ratio(row, 'staged')}")
        small = [s for s in sizes if s <= LATENCY_MAX_BYTES]
        if small:
            print("  latency (one call + cuda synchronize, us): " + "; ".join(
                f"{_fmt_size(s)} " + " ".join(
                    f"{LABELS[c]} {table[op][s][c + '_lat_us']:.1f}"
                    for c in CONFIGS if c + "_lat_us" in table[op][s]) for s in small))
    print("\nus: median time of one call (back-to-back calls between cuda synchronizes), slowest "
          "rank; algbw = size / time, busbw = algbw x nccl-tests factor (GB/s = 1e9 B/s);\n"
          "%ceil (all_reduce, fcoll-ipc): 2 x n x size bytes (every rank reads its input and "
          "writes its output) / time / ceiling; x/gloo: busbw ratio.")
    result = targets(table)
    print()
    for name, measured, ok in result:
        print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}: {name}: {measured}")
    for k, v in errors.items():
        print(f"error: {k}: {v}")
    return {"results": {op: {str(s): row for s, row in rows.items()}
                        for op, rows in table.items()},
            "ceiling": {"copy_gbps": ceiling, "bytes": per_rank[0]["ceiling"]["bytes"],
                        "per_rank": [r["ceiling"] for r in per_rank]},
            "cuda_paths": {LABELS[c]: paths.get(c) for c in CONFIGS},
            "targets": [{"name": a, "measured": b, "pass": c} for a, b, c in result],
            "errors": errors}
