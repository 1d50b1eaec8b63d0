"""The one prepared device check of fcoll's CUDA path (issue #29): every stage in one run.

Usage, on the GPU machine from the repository root (one H100 or H200, torch 2.11; no
expecttest needed)::

    python benchmarks/gpu_check.py --out $OUT            # about 8 minutes at most
    python benchmarks/gpu_check.py --out /tmp/x --dry-run  # anywhere: every stage SKIP

Stages, in order of value (each a subprocess with its own timeout, killed with its whole
process group when it runs over; a stage that cannot start within what is left of
``--budget-s`` is SKIP):

0. ``floor``: ``gpu_sharing_floor.py`` without and with an MPS daemon (does MPS work here at
   all: the H100 run of 2026-11-27 saw no gain from it).
1. ``tests``: ``pytest tests/test_cuda.py`` (every CUDA test).
2. ``probe:<name>``: the probes of :mod:`cuda_probes` (0-byte first collective, buffer growth
   with kernels queued, bf16/fp16 at 64 MiB, world size 1 on NCCL and on fcoll under
   ``compute="inductor"``, peer death with work queued, teardown while a peer waits, 3 ranks,
   the Triton fold against the torch fold).
3. ``sweep``: all_reduce 4 KiB..128 MiB on the IPC path and gloo, 2 ranks on one GPU
   (``benchmarks/collectives.py --device cuda``), with the device-to-device copy ceiling of the
   same run and ``%ceil`` (``2 n S / t`` over the ceiling: 4S/t at 2 ranks).
4. ``stress``: ``benchmarks/cuda_stress.py`` at its default (budget) size.
5. ``step:mps-off`` / ``step:mps-on``: the compiled train_gpt DDP step, 2 ranks on one GPU,
   ``backend="fcoll"`` (``compute="inductor"``), ``"inductor"`` (PyTorch's funcol on the same
   fcoll group), ``"aot_eager"``, and ``"inductor"`` on a gloo group, under
   ``python -m fcoll.launch --mps off|on`` (``--step-worker`` below is what the ranks run).
6. ``sweep:mps``: the sweep again with an MPS daemon of this script's own (when time is left);
   ``sweep:triton``: the sweep with ``FCOLL_CUDA_TRITON=1`` (the one-kernel fold of
   :mod:`fcoll.shm.cuda.fold`), to compare with ``sweep``.

A stage left SKIP by the budget runs in a second call: ``--only step sweep:mps`` (prefixes of
stage names). Output: ``PASS`` / ``FAIL`` / ``SKIP`` lines as stages end, a final table, and under ``--out``:
``gpu_check.json`` (``{"device", "torch", "stages": [{"name", "status", "seconds", "detail",
"data"}]}``) and ``gpu_check_logs.txt`` (each stage's output, the last 200 KB of each).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
BUDGET_S = 450.0  # the whole run; leaves room in 8 minutes for start-up and the last stage's end
LOG_TAIL_BYTES = 200_000
KILL_GRACE_S = 8.0  # between SIGTERM and SIGKILL of a stage that ran over
SWEEP_SIZES = ["4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M", "128M"]
STEP_VARIANTS = ("fcoll", "inductor", "aot_eager", "inductor_gloo")
STATUSES = ("PASS", "FAIL", "SKIP")


@dataclass
class Stage:
    """One stage's outcome: ``status`` in :data:`STATUSES`, ``seconds`` of wall time."""

    name: str
    status: str
    seconds: float = 0.0
    detail: str = ""
    data: dict = field(default_factory=dict)


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, BENCH] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run_cmd(cmd: list[str], timeout_s: float, env: dict | None = None) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group; returns ``(exit code or None on timeout, output)``.
    On timeout the whole group gets SIGTERM (``fcoll.launch`` then stops its ranks and its MPS
    daemon), and SIGKILL :data:`KILL_GRACE_S` later, so nothing is left running."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or _env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout_s))
        return proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        return None, out.decode(errors="replace") + f"\n[gpu_check] timed out after {timeout_s:.0f} s"


def _last_json(text: str) -> dict | None:
    """The last line of ``text`` that parses as a JSON object."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


# ---- the stages --------------------------------------------------------------------------------
def stage_tests(timeout_s: float, out_dir: str) -> tuple[Stage, str]:
    # --durations: on the H100 (2026-11-27) 9 of the 16 tests took about 150 s; say which
    rc, log = run_cmd([sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider",
                       "--durations=0", "tests/test_cuda.py"], timeout_s)
    counts = {k: sum(1 for ln in log.splitlines() if ln.startswith("tests/") and f" {k}" in ln)
              for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    failed = [ln.split(" ")[0] for ln in log.splitlines()
              if ln.startswith("tests/") and (" FAILED" in ln or " ERROR" in ln)]
    detail = ", ".join(f"{v} {k.lower()}" for k, v in counts.items() if v) or f"exit {rc}"
    if rc is None:
        detail += " (timed out: the rest did not run)"
    if failed:
        detail += f"; failed: {failed}"
    status = "PASS" if rc == 0 else "FAIL"
    return Stage("tests", status, detail=detail, data={"counts": counts, "failed": failed}), log


def stage_probe(name: str) -> Callable[[float, str], tuple[Stage, str]]:
    def run(timeout_s: float, out_dir: str) -> tuple[Stage, str]:
        rc, log = run_cmd([sys.executable, os.path.join(BENCH, "cuda_probes.py"), name],
                          timeout_s)
        res = _last_json(log) or {}
        ok = rc == 0 and res.get("ok") is True
        status = "SKIP" if rc == 0 and res and res.get("ok") is None else \
            "PASS" if ok else "FAIL"
        detail = res.get("detail") or (f"exit {rc}" if rc is not None else "timed out")
        return Stage(f"probe:{name}", status, detail=detail, data=res), log
    return run


def stage_sweep(mps: bool, triton: bool = False) -> Callable[[float, str], tuple[Stage, str]]:
    def run(timeout_s: float, out_dir: str) -> tuple[Stage, str]:
        name = "sweep:mps" if mps else "sweep:triton" if triton else "sweep"
        path = os.path.join(tempfile.mkdtemp(prefix="gpu_check-"), "sweep.json")
        cmd = [sys.executable, os.path.join(BENCH, "collectives.py"), "--device", "cuda",
               "--nproc", "2", "--ops", "all_reduce", "--configs", "ipc", "gloo", "--quick",
               "--sizes", *SWEEP_SIZES, "--json", path]
        if mps:
            from fcoll import mps as fmps

            if shutil.which(fmps.CONTROL_BINARY) is None:
                return Stage(name, "SKIP", detail=f"no {fmps.CONTROL_BINARY} on PATH"), ""
            with fmps.MpsDaemon() as daemon:
                rc, log = run_cmd(cmd, timeout_s, dict(_env(), **daemon.env))
                served = daemon.server_started()
        else:
            rc, log = run_cmd(cmd, timeout_s, dict(_env(), FCOLL_CUDA_TRITON="1") if triton
                              else None)
        data = {}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
        rows = data.get("results", {}).get("all_reduce", {})
        pct = {k: round(v.get("ipc_pct_of_ceiling", float("nan")), 1) for k, v in rows.items()}
        fails = [t["name"] for t in data.get("targets", []) if t.get("pass") is False]
        detail = (f"ceiling {data.get('ceiling', {}).get('copy_gbps', float('nan')):.0f} GB/s; "
                  f"%ceil by size {pct}; targets failed: {fails or 'none'}") if data else \
            (f"exit {rc}" if rc is not None else "timed out")
        if mps:  # were the ranks MPS clients at all? (the 2026-11-27 H100 run left it open)
            data["mps_server_started"] = served
            detail = f"MPS server started: {served}; " + detail
        ok = rc == 0 and bool(data) and not data.get("errors")
        return Stage(name, "PASS" if ok else "FAIL", detail=detail, data=data), log
    return run


def stage_floor(timeout_s: float, out_dir: str) -> tuple[Stage, str]:
    """``gpu_sharing_floor.py`` without and with an MPS daemon of this script's own: whether MPS
    works on this machine at all (the per-turn hand-off should drop by about 10x), apart from
    anything fcoll does."""
    from fcoll import mps as fmps

    tmp = tempfile.mkdtemp(prefix="gpu_check-")
    cmd = [sys.executable, os.path.join(BENCH, "gpu_sharing_floor.py"), "--iters", "500",
           "--json"]
    logs, data = [], {}
    rc, log = run_cmd(cmd + [os.path.join(tmp, "off.json")], timeout_s / 2)
    logs.append(log)
    modes = [("off", None)]
    if shutil.which(fmps.CONTROL_BINARY) is not None:
        with fmps.MpsDaemon() as daemon:
            rc_on, log = run_cmd(cmd + [os.path.join(tmp, "on.json")], timeout_s / 2,
                                 dict(_env(), **daemon.env))
            data["mps_server_started"] = daemon.server_started()
        logs.append(log)
        modes.append(("on", rc_on))
    for mode, _ in modes:
        path = os.path.join(tmp, f"{mode}.json")
        if os.path.exists(path):
            with open(path) as f:
                data[f"mps_{mode}"] = {k: round(v, 1) for k, v in json.load(f).items()}
    detail = "; ".join(f"{k}: {v}" for k, v in data.items()) or \
        (f"exit {rc}" if rc is not None else "timed out")
    ok = rc == 0 and "mps_off" in data
    return Stage("floor", "PASS" if ok else "FAIL", detail=detail, data=data), "\n".join(logs)


def stage_stress(timeout_s: float, out_dir: str) -> tuple[Stage, str]:
    path = os.path.join(tempfile.mkdtemp(prefix="gpu_check-"), "stress.json")
    rc, log = run_cmd([sys.executable, os.path.join(BENCH, "cuda_stress.py"), "--json", path,
                       "--budget-s", str(max(10.0, timeout_s - 15)), "--job-timeout-s",
                       str(max(10.0, min(120.0, timeout_s - 15)))], timeout_s)
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    detail = data.get("summary") or (f"exit {rc}" if rc is not None else "timed out")
    ok = rc == 0 and data.get("ok") is True
    return Stage("stress", "PASS" if ok else "FAIL", detail=detail, data=data), log


def stage_step(mps: str, variants: tuple[str, ...]) -> Callable[[float, str], tuple[Stage, str]]:
    def run(timeout_s: float, out_dir: str) -> tuple[Stage, str]:
        name = f"step:mps-{mps}"
        if mps == "on":
            from fcoll import mps as fmps

            if shutil.which(fmps.CONTROL_BINARY) is None:
                return Stage(name, "SKIP", detail=f"no {fmps.CONTROL_BINARY} on PATH"), ""
        path = os.path.join(tempfile.mkdtemp(prefix="gpu_check-"), "step.json")
        rc, log = run_cmd([sys.executable, "-m", "fcoll.launch", "--nproc-per-node", "2",
                           "--mps", mps, os.path.join(BENCH, "gpu_check.py"), "--step-worker",
                           "--result", path, "--variants", *variants], timeout_s)
        data = {}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
        ms = {v: round(r["step_ms"], 2) for v, r in data.get("variants", {}).items()
              if "step_ms" in r}
        errs = {v: r["error"] for v, r in data.get("variants", {}).items() if "error" in r}
        detail = f"median ms/step {ms}" + (f"; errors {errs}" if errs else "") if data else \
            (f"exit {rc}" if rc is not None else "timed out")
        ok = rc == 0 and bool(ms) and not errs
        return Stage(name, "PASS" if ok else "FAIL", detail=detail, data=data), log
    return run


def plan() -> list[tuple[str, Callable[[float, str], tuple[Stage, str]], float]]:
    """``(name, run(timeout_s, out_dir), timeout_s)`` of every stage, in run order."""
    from cuda_probes import PROBES

    stages = [("floor", stage_floor, 60.0), ("tests", stage_tests, 200.0)]
    stages += [(f"probe:{p}", stage_probe(p), t) for p, t in PROBES.items()]
    stages += [("sweep", stage_sweep(False), 60.0), ("stress", stage_stress, 120.0),
               ("step:mps-off", stage_step("off", STEP_VARIANTS), 200.0),
               ("step:mps-on", stage_step("on", ("fcoll", "inductor")), 100.0),
               ("sweep:mps", stage_sweep(True), 60.0),
               ("sweep:triton", stage_sweep(False, triton=True), 60.0)]
    return stages


# ---- the step worker (run by each rank under fcoll.launch) -------------------------------------
def step_worker(ns: argparse.Namespace) -> int:
    """One rank of the step comparison: train_gpt's compiled DDP step per variant, timed."""
    import statistics

    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_gpt as tg

    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = ns.step_device == "cuda"
    dev = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("fcoll")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    corpus = tg.Corpus(tg.load_text())
    cfg = tg.GPTConfig(vocab_size=corpus.vocab_size, seq_len=128, n_layer=4, n_head=4,
                       d_model=256)
    out: dict[str, Any] = {"world": world,
                           "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
                           "mps_pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"), "variants": {}}
    for variant in ns.variants:
        torch._dynamo.reset()
        try:
            group = gloo if variant == "inductor_gloo" else dist.group.WORLD
            comm = (tg.FcollComm if variant == "fcoll" else tg.TorchComm)(group)
            params = {k: v.to(dev) for k, v in tg.init_params(cfg, 0).items()}
            state = tg.init_adamw(params)
            step = tg.make_train_step(cfg, comm, "ddp", tg.AdamW(lr=3e-3))
            run = (tg.compile_step(step, "fcoll", {"compute": "inductor"}) if variant == "fcoll"
                   else tg.compile_step(step, "inductor" if variant.startswith("inductor")
                                        else variant))
            times, loss = [], float("nan")
            for i in range(ns.steps):
                x, y = tg.get_batch(corpus.train, 8, 128, seed=0, step=i, rank=rank,
                                    world_size=world)
                x, y = x.to(dev), y.to(dev)
                sync()
                t0 = time.perf_counter()
                loss_t, _, params, state = run(params, state, x, y)
                sync()
                times.append(time.perf_counter() - t0)
                loss = float(loss_t)
            out["variants"][variant] = {"step_ms": statistics.median(times[2:]) * 1e3,
                                        "compile_s": times[0], "final_loss": loss}
        except Exception as e:  # noqa: BLE001  reported per variant, the others still run
            out["variants"][variant] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        dist.barrier()
    if rank == 0 and ns.result:
        with open(ns.result, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()
    return 0


# ---- driver --------------------------------------------------------------------------------------
def device_info() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch": None, "cuda": False}
    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if info["cuda"]:
        info["device"] = torch.cuda.get_device_name(0)
        info["device_count"] = torch.cuda.device_count()
    return info


def ordered(stages: list, only: list[str] | None) -> list:
    """``stages`` whose name starts with one of ``only``, in the order ``only`` names them
    (plan order among the stages one prefix selects; a prefix that is a whole stage name selects
    that stage alone); all of them when ``only`` is None."""
    if only is None:
        return list(stages)
    picked: list = []
    for prefix in only:
        exact = [s for s in stages if s[0] == prefix]
        picked += [s for s in exact or stages if s[0].startswith(prefix) and s not in picked]
    return picked


def table(stages: list[Stage]) -> str:
    """The final table: one line per stage."""
    w = max([len(s.name) for s in stages] + [5])
    lines = [f"{'stage':<{w}}  status  seconds  detail", "-" * (w + 40)]
    for s in stages:
        lines.append(f"{s.name:<{w}}  {s.status:<6}  {s.seconds:7.1f}  {s.detail[:160]}")
    counts = {k: sum(s.status == k for s in stages) for k in STATUSES}
    lines.append(f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."),
                   help="directory for gpu_check.json and gpu_check_logs.txt (default $OUT)")
    p.add_argument("--dry-run", action="store_true", help="report every stage SKIP, run nothing")
    p.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help="wall-clock budget of all stages together, seconds")
    p.add_argument("--only", nargs="*", default=None, help="run only stages whose name "
                   "starts with one of these, in this order (e.g. sweep step tests probe:)")
    p.add_argument("--step-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=20, help=argparse.SUPPRESS)
    p.add_argument("--step-device", choices=("cuda", "cpu"), default="cuda",
                   help=argparse.SUPPRESS)  # cpu: the step worker's own check, off the GPU
    p.add_argument("--variants", nargs="*", default=list(STEP_VARIANTS),
                   choices=STEP_VARIANTS, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.step_worker:
        return step_worker(ns)
    sys.path[:0] = [ROOT, BENCH]
    os.makedirs(ns.out, exist_ok=True)
    info = device_info()
    skip_why = "dry run" if ns.dry_run else None if info.get("cuda") else "no GPU"
    started = time.monotonic()
    stages: list[Stage] = []
    logs: list[str] = []
    print(f"# gpu_check {datetime.datetime.now(datetime.timezone.utc).isoformat()} "
          f"{json.dumps(info)}", flush=True)
    for name, run, limit in ordered(plan(), ns.only):
        left = ns.budget_s - (time.monotonic() - started)
        if skip_why is not None:
            st, log = Stage(name, "SKIP", detail=skip_why), ""
        elif left < 20:
            st, log = Stage(name, "SKIP", detail=f"budget: {left:.0f} s left"), ""
        else:
            t0 = time.monotonic()
            try:
                st, log = run(min(limit, left - KILL_GRACE_S - 2), ns.out)
            except Exception as e:  # noqa: BLE001  one stage's bug must not lose the others
                st, log = Stage(name, "FAIL", detail=f"gpu_check: {type(e).__name__}: {e}"), ""
            st.seconds = time.monotonic() - t0
        stages.append(st)
        logs.append(f"===== {name}: {st.status} ({st.seconds:.1f} s)\n"
                    f"{log[-LOG_TAIL_BYTES:]}\n")
        print(f"{st.status}: {name} ({st.seconds:.1f} s): {st.detail}", flush=True)
        _write(ns.out, info, stages, logs)  # after every stage: a killed run keeps what it had
    print("\n" + table(stages))
    return 1 if any(s.status == "FAIL" for s in stages) else 0


def _write(out: str, info: dict, stages: list[Stage], logs: list[str]) -> None:
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump({**info, "stages": [asdict(s) for s in stages]}, f, indent=1, default=str)
    with open(os.path.join(out, "gpu_check_logs.txt"), "w") as f:
        f.write("".join(logs))


if __name__ == "__main__":
    sys.exit(main())
