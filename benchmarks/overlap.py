"""Overlap benchmark: the DDP and FSDP training steps of ``examples/train_gpt.py`` on 2 ranks.

Measures, in one run, per parallel mode (median step time over every timed step: each variant
is compiled once, then timed for ``--steps`` steps after ``--warmup`` in each of ``--rounds``
rounds, the variants interleaved and their order reversed every other round, so that a change in
the machine's load falls on every variant alike; ratios are medians of the per-round ratios):

- ``off``: ``torch.compile(backend="fcoll", options={"overlap": False})`` (no reorder pass);
- ``on``: ``backend="fcoll"`` with the default pipeline (``reorder_for_overlap`` included);
- ``compute``: the same step with every collective replaced by a local copy of the same size
  (compute-only time);
- ``comm``: the step's collectives alone (same kinds and bytes, bucketed like the compiled step
  at ``bucket_cap_mb``, issued back to back and waited at the end): communication-only time;
- ``exposed_comm = step - compute`` for ``off`` and ``on``; targets: ``exposed_comm <= 0.15 *
  comm`` when compute >= comm, and ``step <= 1.1 * max(compute, comm)``;
- ``floor``: no schedule of one step can beat ``max(compute, forward + comm)`` for DDP, where
  ``forward`` is the compiled loss alone (gradients, and so their collectives, exist only after
  it), nor, for FSDP, ``max(forward, all_gathers) + max(compute - forward, reduce_scatters)``
  (each kind timed alone, like ``comm``); ``on/floor`` says how close the schedule comes;
- ``inductor``: PyTorch's best available setting on the same step (``backend="inductor"`` with
  Inductor's FX bucketing, ``bucket_all_reduces_fx`` / ``bucket_all_gathers_fx`` /
  ``bucket_reduce_scatters_fx = "all"``, PyTorch's funcol): :func:`pytorch_best`. (2.13's
  ``reorder_for_compute_comm_overlap`` has an empty pass list, and its overlap scheduler,
  ``aten_distributed_optimizations.enable_overlap_scheduling``, fails on CPU: NOTES.md);
  ``ind/on`` = inductor / on (target >= 1.3).

``--parallel torch-ddp torch-fsdp2 simple-fsdp tp``: the same GPT as ``nn.Module``s in
PyTorch's own ``DistributedDataParallel`` / ``fully_shard``, in ``fcoll.parallel.fully_shard``
(SimpleFSDP on DTensor) or tensor parallel (``parallelize_module``) (``examples/train_gpt.py``'s
:class:`TorchModuleStep`: DDP with the python reducer and compiled autograd; FSDP2 and
SimpleFSDP per block), timed with ``backend="fcoll"`` (``fcoll``) and with PyTorch's own
compiled module (``backend="inductor"`` with :func:`pytorch_best`, ``pytorch``), beside the
hand-written step of the same kind when it ran in the same invocation; ``pytorch/fcoll`` is the
speed-up (target >= 1.3). ``torch-fsdp2`` also runs FSDP2 eagerly (``eager``: no compiler, as
PyTorch runs it), and ``simple-fsdp`` also fcoll with ``bucket_mode="coalesced"``
(``coalesced``: buckets without the concat mode's copies in and out), and its one-step floor
(:func:`simple_fsdp_floor`: compute from the same step on a mesh of one rank, the forward alone,
the all_gathers and the reduce_scatters alone; target fcoll/floor <= 1.15). Every FSDP row (``fsdp``'s
``off`` / ``on`` / ``inductor``, and each module variant) gives its peak memory: rank 0's
largest rise of live heap bytes within a timed step over their value at the step's start,
counted at every allocation and free by a preloaded library (``benchmarks/peak_memory.py``;
every tensor storage of the process, on every thread, Inductor's buffers included); the target
is SimpleFSDP under fcoll at most 1.1x FSDP2 eager.

``torch-ddp``'s variants are compiled afresh in every round (compiled autograd's cache is
process-wide), and timed against every way
PyTorch compiles DDP: ``ca-inductor`` / ``ca-aot_eager`` (python reducer + compiled autograd,
the all_reduces in the backward graph, Inductor with :func:`pytorch_best` or no compiler
passes) and ``ddpopt-inductor`` /
``ddpopt-aot_eager`` (the default ``optimize_ddp``: graphs split at DDP's buckets, the C++
reducer's 25 MiB buckets, its first one 1 MiB, all_reduced by autograd hooks as gradients are
ready). Beside them: ``compute`` (the module without DDP, compiled the same way: no
communication), ``comm`` (the gradients' all_reduces alone, bucketed at 25 MiB, back to back),
``forward`` (the compiled loss alone); ``exposed = fcoll - compute``, ``overlap = 1 - exposed /
comm`` and the one-step floor ``max(compute, forward + comm)`` (gradients, and so their
all_reduces, exist only after the forward). Medians over every timed step of every round; the
ratios are medians of the per-round ratios. The load average is printed before and after;
``--param-dtype bfloat16 --reduce-dtype float32`` runs the FSDP module rows (``torch-fsdp2``,
``simple-fsdp``) with that ``MixedPrecisionPolicy`` on every ``fully_shard`` call (torchtitan's
default). ``--background-load N`` runs N busy processes (``collectives.BackgroundLoad``, in the
ranks' session) for the whole run.

The ranks talk over gloo inside a network namespace whose loopback is rate-limited with
``tc qdisc add dev lo root tbf rate 1gbit burst 256kb latency 100ms`` (0.125 GB/s; NOTES.md).
Without root, ``ip`` or ``tc`` it falls back to plain loopback, and says so in the table and
the JSON (``"network"``). ``--group fcoll`` runs every row on fcoll's own shared-memory
process group instead (no link to rate-limit: the collectives are the ranks' CPU work), where
overlap competes with compute for the cores. Measured 2026-11-28 (2 ranks, 2 vCPUs, one
intra-op thread each): DDP ``off`` 362.6 ms against ``on`` 377.5 (compute 306.8, comm 7.7;
3 rounds, no Inductor), FSDP 329.8 against 314.0; in two later runs (1-2 rounds) DDP ``on``
296.8 and 301.9 against ``inductor`` 263.8 and 272.2 (ind/on 0.89, 0.92: PyTorch's one
bucket at the end of the backward, run blocking, beats fcoll's overlapped buckets here;
docs/design.md, "Asynchronous collectives with no spare core"); three later runs, 3 rounds
each: DDP ``on/floor`` 1.01-1.07 and ``ind/on`` 0.93-1.51 (Inductor's column moves most).
FSDP's ``inductor`` fails on this group: Inductor's bucketed all_gather calls PyTorch's C++
``all_gather_into_tensor_out``, which needs a C++ device backend (README, "No backend type
associated with device type cpu").

    python benchmarks/overlap.py --json overlap.json       # every row, one run
    python benchmarks/overlap.py --background-load 2 --json overlap-loaded.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

#: modes timed as nn.Modules (``_torch_module_variants``; torch-ddp has its own table)
MODULE_MODES = ("torch-fsdp2", "simple-fsdp", "tp")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETNS_ENV = "FCOLL_BENCH_NETWORK"
TBF = ["tbf", "rate", "1gbit", "burst", "256kb", "latency", "100ms"]


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = ["ddp", "fsdp", "torch-ddp", "torch-fsdp2", "simple-fsdp", "tp"]
    p.add_argument("--parallel", nargs="+", default=modes, choices=modes)
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--no-inductor", action="store_true", help="skip the PyTorch baseline")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of every variant, interleaved (the order reversed every other "
                        "round)")
    p.add_argument("--group", choices=["gloo", "fcoll"], default="gloo",
                   help="the ranks' process group: gloo over --network, or fcoll's shared "
                   "memory (--network is then unused)")
    p.add_argument("--network", choices=["auto", "tbf", "loopback"], default="auto")
    p.add_argument("--json", default="overlap.json")
    p.add_argument("--timeout-s", type=float, default=3000)
    p.add_argument("--param-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="torch-fsdp2 and simple-fsdp rows: FSDP2's MixedPrecisionPolicy."
                   "param_dtype for every fully_shard call (torchtitan: bfloat16)")
    p.add_argument("--reduce-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="with --param-dtype: the gradients' reduction dtype (torchtitan: float32)")
    p.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="N busy processes during the run (collectives.BackgroundLoad, in the "
                   "ranks' session)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Network namespace (driver side)

def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _run_in_netns(argv: list[str]) -> int | None:
    """Re-run this script inside a rate-limited namespace; None if one cannot be made."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("no root / ip / tc: falling back to plain loopback", file=sys.stderr)
        return None
    ns = f"fcoll-bench-{os.getpid()}"
    try:
        _sh("ip", "netns", "add", ns)
    except subprocess.CalledProcessError as e:
        print(f"cannot create a network namespace ({e.stderr.strip()}): plain loopback",
              file=sys.stderr)
        return None
    try:
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", *TBF)
        env = dict(os.environ, **{NETNS_ENV: "tbf 1gbit loopback in a network namespace"})
        return subprocess.run(["ip", "netns", "exec", ns, sys.executable,
                               os.path.abspath(__file__), *argv, "--network", "loopback"],
                              env=env).returncode
    except subprocess.CalledProcessError as e:
        print(f"cannot rate-limit the namespace ({e.stderr.strip()}): plain loopback",
              file=sys.stderr)
        return None
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# ---------------------------------------------------------------------------------------------
# Ranks

def pytorch_best():
    """Inductor's config patch for PyTorch's best collective optimization on CPU (2.13): FX
    bucketing of every all_reduce, all_gather and reduce_scatter."""
    import torch._inductor.config as icfg

    return icfg.patch(bucket_all_reduces_fx="all", bucket_all_gathers_fx="all",
                      bucket_reduce_scatters_fx="all")


class LocalComm:
    """Collectives replaced by local copies of the same output size (compute-only time)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def all_reduce_avg(self, t):
        return t.clone()

    def all_gather(self, shard):
        return shard.repeat(self.n)  # [k] -> [n * k], backward sums the n chunks


def _time_steps(run, args_fn, warmup: int, steps: int, barrier, mem=None) -> list[float]:
    """Seconds of each of ``steps`` steps after ``warmup``; ``mem`` (a
    :class:`peak_memory.PeakAlloc`) is entered around each timed step, after a ``gc.collect()``
    (untimed) so that cyclic garbage of earlier variants is not freed inside the window."""
    import gc

    times = []
    for i in range(warmup + steps):
        inputs = args_fn(i)
        if mem is not None:
            gc.collect()
        barrier()
        with mem if mem is not None and i >= warmup else contextlib.nullcontext():
            t0 = time.perf_counter()
            run(*inputs)
            t = time.perf_counter() - t0
        if i >= warmup:
            times.append(t)
    return times


def _comm_only(params, parallel: str, n: int, cap_bytes: int, group, steps: int,
               only: str | None = None, dtype=None) -> list[float]:
    """The step's collectives alone: same kinds and bytes, bucketed at ``cap_bytes``; ``only``
    keeps one kind ("all_gather" or "reduce_scatter"); ``dtype``: the buffers' (default
    float32)."""
    import torch
    import torch.distributed as dist

    import fcoll

    dtype = dtype or torch.float32
    size = dtype.itemsize
    numels = [p.numel() for p in params.values()]
    kinds = [("all_reduce", numels)] if parallel == "ddp" else \
        [("all_gather", numels), ("reduce_scatter", numels)]
    kinds = [k for k in kinds if only is None or k[0] == only]
    buckets = []
    for kind, sizes in kinds:
        cur = 0
        for s in sizes:
            if cur and (cur + s) * size > cap_bytes:
                buckets.append((kind, cur))
                cur = 0
            cur += s
        buckets.append((kind, cur))
    bufs = [(k, torch.randn(s * (n if k == "reduce_scatter" else 1)).to(dtype))
            for k, s in buckets]
    times = []
    for _ in range(steps + 1):
        dist.barrier(group)
        t0 = time.perf_counter()
        outs = []
        for kind, b in bufs:
            if kind == "all_reduce":
                outs.append(fcoll.all_reduce(b, "sum", group))
            elif kind == "all_gather":
                outs.append(fcoll.all_gather_tensor(b, 0, group))
            else:
                outs.append(fcoll.reduce_scatter_tensor(b, "sum", 0, group))
        for o in outs:
            fcoll.wait_tensor(o)
        times.append(time.perf_counter() - t0)
    return times[1:]


def _best(backend: str):
    """:func:`pytorch_best` for Inductor (its FX bucketing is read when Inductor compiles, at the
    first steps and at any recompile, so every call of an Inductor variant runs inside it)."""
    return pytorch_best() if backend == "inductor" else contextlib.nullcontext()


def _failed(e: BaseException) -> str:
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _interleaved(timers: dict, rounds: int, per_round=None,
                 compiles_in_rounds: bool = False) -> tuple[dict, list[dict]]:
    """Times every variant in ``rounds`` rounds, interleaved (the order reversed every other
    round), so a change of the machine's load during the run falls on every variant alike.

    Args:
        timers: name -> a callable that times that variant's steps and returns their seconds;
            one that raises is reported as ``"failed: ..."`` and not run again.
        per_round: optional callable returning extra per-round medians (``{name: seconds}``),
            for example the collectives alone.
        compiles_in_rounds: the timers compile afresh in every round (in their untimed
            warm-up steps); otherwise a graph compiled during the rounds is reported as
            ``times["recompiled_graphs"]``, since a variant was then timed compiling.

    Returns:
        ``(times, rounds)``: every timed step's seconds per name (or the failure message), and
        per round the median of each name (for the ratios, which are medians of per-round
        ratios).
    """
    import torch

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    times: dict = {name: [] for name in timers}
    by_round: list[dict] = []
    for r in range(rounds):
        this_round: dict = {}
        for name in (list(timers) if r % 2 == 0 else list(timers)[::-1]):
            if isinstance(times[name], str):
                continue
            try:
                t = timers[name]()
            except Exception as e:  # noqa: BLE001  a failing variant is reported, not fatal
                times[name] = _failed(e)
                continue
            times[name] += t
            this_round[name] = statistics.median(t)
        for name, v in (per_round() if per_round else {}).items():
            times.setdefault(name, []).append(v)
            this_round[name] = v
        by_round.append(this_round)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    if compiled and not compiles_in_rounds:   # a variant timed compiling: say so
        times["recompiled_graphs"] = f"failed: {compiled} graph(s) compiled in the timed rounds"
    return times, by_round


def _medians(times: dict, by_round: list[dict], ref: str) -> dict:
    """Per name, the median of its steps (seconds) or its failure message, and
    ``<name>_over_<ref>``: the median of the per-round ratios name / ref."""
    res = {k: (statistics.median(v) if isinstance(v, list) and v else v)
           for k, v in times.items()}
    for k in times:
        paired = [x[k] / x[ref] for x in by_round if k in x and ref in x and k != ref]
        if paired:
            res[f"{k}_over_{ref}"] = statistics.median(paired)
    return res


def _torch_module_variants(T, cfg, corpus, parallel: str, rank: int, world: int, barrier,
                           a: dict) -> dict:
    """Median step time of the GPT module (PyTorch's FSDP2, fcoll's SimpleFSDP, tensor
    parallel) compiled with fcoll and with Inductor (:func:`pytorch_best`), and for FSDP2 also
    run eagerly (``eager``: FSDP2 as PyTorch runs it without a compiler); FSDP modes also each
    variant's peak memory over its timed steps (MiB, ``<name>_peak_mb``:
    :class:`peak_memory.PeakAlloc`, the largest rise of live heap bytes within a step).

    ``simple-fsdp`` also times what its one-step floor is made of (:func:`simple_fsdp_floor`):
    ``compute`` (the same step sharded over a mesh of one rank: the same graphs, compiled the
    same way, with no collective in them), ``forward`` (that module's compiled loss alone, no
    gradients) and, per round, its collectives alone: ``comm_all_gather`` (every parameter's
    shard gathered, in the parameter dtype) and ``comm_reduce_scatter`` (every gradient, in
    the reduce dtype), each bucketed at 25 MiB and issued back to back."""
    import torch

    from peak_memory import PeakAlloc

    data_rank, data_world = (0, 1) if parallel == "tp" else (rank, world)

    def batch(i):
        return T.get_batch(corpus.train, a["batch_size"], a["seq_len"], seed=0, step=i,
                           rank=data_rank, world_size=data_world)

    backends = {"fcoll": ("fcoll", {"compute": "inductor"})}
    if not a["no_inductor"]:
        backends["pytorch"] = ("inductor", None)
    if parallel == "torch-fsdp2":
        backends["eager"] = ("eager", None)
    solo, comm_alone = None, None   # simple-fsdp's floor: the step on a mesh of one rank
    if parallel == "simple-fsdp":   # buckets without copies in or out (peak memory)
        from torch.distributed.device_mesh import init_device_mesh

        backends["coalesced"] = ("fcoll", {"compute": "inductor", "bucket_mode": "coalesced"})
        backends["compute"] = backends["forward"] = ("fcoll", {"compute": "inductor"})
        solo = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "solo"))["solo"]
        comm_alone = _fsdp_comm_alone(T.shard_params(T.init_params(cfg, 0), rank, world),
                                      world, a)
    res: dict = {}
    timers, mems = {}, {}
    torch._dynamo.reset()
    for name, (backend, options) in backends.items():
        counts, stop = T.count_compiled_collectives()
        alone = name in ("compute", "forward")
        try:
            with _best(backend), _stance(name):
                step = T.TorchModuleStep(cfg, T.init_params(cfg, 0), parallel, T.AdamW(),
                                         torch.device("cpu"), backend, options,
                                         mp_policy=T.mp_policy(a["param_dtype"], a["reduce_dtype"])
                                         if parallel in T.FSDP_MODES else None,
                                         mesh=solo if alone else None)
                if name == "forward":
                    step = _ForwardOnly(step)
                step(*batch(0))   # compiles before the timed rounds
        except Exception as e:  # noqa: BLE001  a failing variant is reported, not fatal
            res[name] = _failed(e)
            continue
        finally:
            stop()
        if backend == "fcoll" and not alone:
            res["fcoll_collectives"] = sum(counts.values())
        mems[name] = PeakAlloc() if "fsdp" in parallel and not alone else None

        def timer(step=step, name=name, backend=backend):
            with _best(backend), _stance(name):
                return _time_steps(step, batch, a["warmup"], a["steps"], barrier, mems[name])
        timers[name] = timer
    with torch._dynamo.config.patch(recompile_limit=64):  # every variant keeps its graphs
        times, by_round = _interleaved(timers, a["rounds"], comm_alone)
    res.update(_medians(times, by_round, "fcoll"))
    for name, mem in mems.items():
        if mem is not None:
            res[f"{name}_peak_mb"] = mem.max_rise_mb
    return res


def _fsdp_comm_alone(shards: dict, world: int, a: dict):
    """A per-round timer (:func:`_interleaved`) of an FSDP step's collectives alone, each kind
    in its dtype: ``comm_all_gather`` of ``shards`` in the parameter dtype, and
    ``comm_reduce_scatter`` of the full gradients in the reduce dtype (medians, seconds)."""
    import torch
    import torch.distributed as dist

    param_dtype = getattr(torch, a["param_dtype"] or "float32")
    reduce_dtype = getattr(torch, a["reduce_dtype"] or a["param_dtype"] or "float32")

    def comm_alone() -> dict:
        return {f"comm_{kind}": statistics.median(_comm_only(
            shards, "fsdp", world, 25 * 2 ** 20, dist.group.WORLD, a["steps"], only=kind,
            dtype=dtype)) for kind, dtype in (("all_gather", param_dtype),
                                              ("reduce_scatter", reduce_dtype))}
    return comm_alone


class _ForwardOnly:
    """A :class:`TorchModuleStep`'s compiled loss alone (no gradients, no optimizer)."""

    def __init__(self, step) -> None:
        self.step = step

    def __call__(self, x, y):
        import torch

        with torch.no_grad():
            return self.step.forward(x, y)


def simple_fsdp_floor(ms: dict) -> float:
    """The one-step floor of a SimpleFSDP step resharded after the forward (ms): its forward
    lasts at least as long as the forward's compute and as its all_gathers, and its backward at
    least as long as the backward's compute and as the backward's collectives, which gather the
    parameters again and reduce_scatter the gradients on the same link:
    ``max(forward, all_gathers) + max(compute - forward, all_gathers + reduce_scatters)``.

    Args:
        ms: medians in ms: ``compute`` (the whole step without communication), ``forward``,
            ``comm_all_gather`` (every parameter gathered once), ``comm_reduce_scatter``.
    """
    ag, rs, comp, fwd = (ms["comm_all_gather"], ms["comm_reduce_scatter"], ms["compute"],
                         ms["forward"])
    return max(fwd, ag) + max(comp - fwd, ag + rs)


def _stance(name: str):
    """FSDP2 as PyTorch runs it without a compiler (``eager``): the compiled module forced
    eager."""
    import torch

    return (torch.compiler.set_stance("force_eager") if name == "eager"
            else contextlib.nullcontext())


class _PlainModuleStep:
    """The GPT module without DDP, compiled as :class:`TorchModuleStep` compiles DDP's (forward
    by ``torch.compile``, backward by compiled autograd, ``torch.optim.AdamW``): the same
    compute with no communication. ``forward_only``: the compiled loss alone."""

    def __init__(self, T, cfg, backend: str, options, forward_only: bool = False) -> None:
        import torch

        self.module = T.GPTModule(cfg, T.init_params(cfg, 0))
        self.optimizer = T.torch_adamw(self.module, T.AdamW())
        self.forward = torch.compile(self.module, backend=backend, options=options)
        self.backward_compiler = torch.compile(backend=backend, options=options)
        self.forward_only = forward_only

    def __call__(self, x, y):
        import torch
        from torch._dynamo import compiled_autograd

        if self.forward_only:
            with torch.no_grad():
                return self.forward(x, y)
        loss = self.forward(x, y)
        with compiled_autograd._enable(self.backward_compiler):
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


class _DDPOptimizerStep:
    """PyTorch's default compiled DDP: ``torch.compile(DDP(module))`` with ``optimize_ddp=True``
    (the graph split at DDP's bucket boundaries), the backward run eagerly by autograd with
    DDP's C++ reducer (``bucket_cap_mb=25``, first bucket 1 MiB), ``torch.optim.AdamW``."""

    def __init__(self, T, cfg, backend: str) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.module = T.GPTModule(cfg, T.init_params(cfg, 0))
        self.optimizer = T.torch_adamw(self.module, T.AdamW())
        with torch._dynamo.config.patch(optimize_ddp=True):   # read by DDP's constructor too
            self.forward = torch.compile(DDP(self.module), backend=backend)

    def __call__(self, x, y):
        import torch

        with torch._dynamo.config.patch(optimize_ddp=True):
            loss = self.forward(x, y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def _torch_ddp_variants(T, cfg, corpus, rank: int, world: int, barrier, group, a: dict) -> dict:
    """Step times (seconds, every timed step of every round) of PyTorch's DDP compiled with
    fcoll and in every way PyTorch compiles it, plus compute-only, forward-only and comm-only
    times (module docstring); ``rounds``: per round, the median of each variant."""
    import torch

    def batch(i):
        return T.get_batch(corpus.train, a["batch_size"], a["seq_len"], seed=0, step=i,
                           rank=rank, world_size=world)

    cpu = torch.device("cpu")
    fcoll_options = {"compute": "inductor"}
    makers = {
        "fcoll": lambda: T.TorchModuleStep(cfg, T.init_params(cfg, 0), "torch-ddp", T.AdamW(),
                                           cpu, "fcoll", fcoll_options),
        "compute": lambda: _PlainModuleStep(T, cfg, "fcoll", fcoll_options),
        "forward": lambda: _PlainModuleStep(T, cfg, "fcoll", fcoll_options, forward_only=True),
    }
    if not a["no_inductor"]:
        for b in ("inductor", "aot_eager"):
            makers[f"ca-{b}"] = (lambda b=b: T.TorchModuleStep(
                cfg, T.init_params(cfg, 0), "torch-ddp", T.AdamW(), cpu, b, None))
            makers[f"ddpopt-{b}"] = lambda b=b: _DDPOptimizerStep(T, cfg, b)
    collectives: list[int] = []   # fcoll's compiled collectives, per round it ran in

    def timer(name: str):
        def run() -> list[float]:
            torch._dynamo.reset()
            counts, stop = T.count_compiled_collectives()
            try:   # Inductor compiles at the first steps, inside pytorch_best
                with _best("inductor" if name.endswith("inductor") else name):
                    t = _time_steps(makers[name](), batch, a["warmup"], a["steps"], barrier)
            finally:
                stop()
            if name == "fcoll":
                collectives.append(sum(counts.values()))
            return t
        return run

    params = T.init_params(cfg, 0)

    def comm_alone() -> dict:
        return {"comm": statistics.median(_comm_only(params, "ddp", world, 25 * 2 ** 20, group,
                                                     a["steps"]))}

    times, rounds = _interleaved({name: timer(name) for name in makers}, a["rounds"],
                                 comm_alone, compiles_in_rounds=True)
    for this_round, n in zip(rounds, collectives):   # fcoll ran in every round until a failure
        this_round["fcoll_collectives"] = n
    return {"times": times, "rounds": rounds}


def _hand_variants(T, cfg, full, params, parallel: str, variants: dict, batch, barrier, group,
                   world: int, a: dict) -> dict:
    """Median step seconds of the hand-written step's variants (``off``, ``on``, ``compute``,
    ``inductor``), of its forward alone, and of its collectives alone (``comm``, and for FSDP
    each kind alone), every one compiled once and then timed in ``--rounds`` interleaved rounds
    (:func:`_interleaved`); ``<variant>_over_on``: medians of per-round ratios; FSDP also each
    variant's peak memory (MiB)."""
    import torch

    from peak_memory import PeakAlloc

    res: dict = {}
    timers, mems = {}, {}
    torch._dynamo.reset()
    shapes = {k: v.shape for k, v in full.items()} if parallel == "fsdp" else None
    for name, (comm, backend, options) in variants.items():
        step = T.make_train_step(cfg, comm, parallel, shapes=shapes)
        try:
            with _best(backend):
                run = T.compile_step(step, backend, None if backend == "inductor" else options)
                run(*batch(0))   # compiles before the timed rounds
        except Exception as e:  # noqa: BLE001  a baseline that fails is reported, not fatal
            res[name] = _failed(e)
            continue
        mems[name] = PeakAlloc() if parallel == "fsdp" and name != "compute" else None

        def timer(run=run, name=name, backend=backend):
            with _best(backend):
                return _time_steps(run, batch, a["warmup"], a["steps"], barrier, mems[name])
        timers[name] = timer

    # The forward's compute alone (the loss of full parameters, no collective): DDP's
    # gradients, and so its collectives, exist only after it; FSDP's all_gathers must be
    # hidden by it, its reduce_scatters by the rest.
    def forward(params, state, x, y):
        return T.gpt_loss(full.__getitem__, x, y, cfg)
    forward_run = T.compile_step(forward, "fcoll", {})
    forward_run(*batch(0))
    timers["forward"] = lambda: _time_steps(forward_run, batch, a["warmup"], a["steps"], barrier)

    def comm_alone() -> dict:
        kinds = {"comm": None}
        if parallel == "fsdp":
            kinds.update(comm_all_gather="all_gather", comm_reduce_scatter="reduce_scatter")
        return {k: statistics.median(_comm_only(params, parallel, world, 25 * 2 ** 20, group,
                                                a["steps"], only=only))
                for k, only in kinds.items()}

    with torch._dynamo.config.patch(recompile_limit=64):  # every variant keeps its graphs
        times, by_round = _interleaved(timers, a["rounds"], comm_alone)
    res.update(_medians(times, by_round, "on"))
    for name, mem in mems.items():
        if mem is not None and mem.max_rise_mb is not None:
            res[f"{name}_peak_mb"] = mem.max_rise_mb
    return res


def _rank(rank: int, world: int, a: dict) -> dict:
    import torch
    import torch.distributed as dist

    sys.path[:0] = [os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks")]
    import train_gpt as T

    torch.set_num_threads(1)
    group = dist.group.WORLD
    corpus = T.Corpus(T.load_text())
    cfg = T.GPTConfig(vocab_size=corpus.vocab_size, seq_len=a["seq_len"], n_layer=a["n_layer"],
                      n_head=4, d_model=a["d_model"])
    results: dict = {}
    barrier = lambda: dist.barrier(group)  # noqa: E731
    for parallel in a["parallel"]:
        if parallel == "torch-ddp":
            results[parallel] = _torch_ddp_variants(T, cfg, corpus, rank, world, barrier, group,
                                                    a)
            continue
        if parallel in MODULE_MODES:
            results[parallel] = _torch_module_variants(T, cfg, corpus, parallel, rank, world,
                                                       barrier, a)
            continue
        full = T.init_params(cfg, 0)
        params = T.shard_params(full, rank, world) if parallel == "fsdp" else full
        state = T.init_adamw(params)

        def batch(i):
            x, y = T.get_batch(corpus.train, a["batch_size"], a["seq_len"], seed=0, step=i,
                               rank=rank, world_size=world)
            return params, state, x, y

        variants = {
            "off": (T.FcollComm(group), "fcoll", {"overlap": False}),
            "on": (T.FcollComm(group), "fcoll", {}),
            "compute": (LocalComm(world), "fcoll", {}),
        }
        if not a["no_inductor"]:
            variants["inductor"] = (T.TorchComm(group), "inductor", None)
        res = _hand_variants(T, cfg, full, params, parallel, variants, batch, barrier, group,
                             world, a)
        results[parallel] = res
    return results


# ---------------------------------------------------------------------------------------------
# Report

def _table(results: dict, network: str, group: str = "gloo") -> tuple[str, dict]:
    lines = [f"network: {network}; times: median step, ms (2 ranks, {group})",
             f"{'mode':6} {'compute':>9} {'comm':>9} {'off':>9} {'on':>9} {'inductor':>12} "
             f"{'ind/on':>7} {'exp_off':>9} {'exp_on':>9} {'exp_on/comm':>11} {'on/max':>7} "
             f"{'floor':>7} {'on/floor':>8}  targets"]
    summary = {}
    ddp_lines: list[str] = []
    module_lines = []
    for mode, r in results.items():
        if mode == "torch-ddp":
            ddp_lines = _torch_ddp_rows(r, summary)
            continue
        if mode in MODULE_MODES:
            hand = {"torch-fsdp2": "fsdp", "simple-fsdp": "fsdp"}.get(mode)
            module_lines.append(_module_row(mode, r, results.get(hand) if hand else None,
                                            summary))
            continue
        ms = {k: (v * 1e3 if isinstance(v, float) else None) for k, v in r.items()}
        comp, comm, off, on = ms["compute"], ms["comm"], ms["off"], ms["on"]
        s = {"compute_ms": comp, "comm_ms": comm, "step_off_ms": off, "step_on_ms": on,
             "inductor_ms": ms.get("inductor"), "inductor_over_on": r.get("inductor_over_on"),
             "inductor_error": r.get("inductor") if ms.get("inductor") is None else None}
        if None not in (comp, comm, off, on):
            s["exposed_comm_off_ms"] = off - comp
            s["exposed_comm_on_ms"] = on - comp
            s["exposed_over_comm"] = (on - comp) / comm
            s["step_over_max"] = on / max(comp, comm)
            s["target_exposed_met"] = (comp < comm) or s["exposed_over_comm"] <= 0.15
            s["target_step_met"] = s["step_over_max"] <= 1.1
            s["target_speedup_met"] = (s["inductor_over_on"] or 0.0) >= 1.3
            # No schedule of one step beats this: DDP's collectives start only once the forward
            # is done (the gradients do not exist before), so the step is at least forward +
            # comm; FSDP's forward takes at least as long as its all_gathers, and its backward
            # as long as its reduce_scatters.
            fwd = ms.get("forward") or 0.0
            s["forward_ms"] = fwd
            if "comm_all_gather" in ms:
                ag, rs = ms["comm_all_gather"], ms["comm_reduce_scatter"]
                s["comm_all_gather_ms"], s["comm_reduce_scatter_ms"] = ag, rs
                s["floor_ms"] = max(max(fwd, ag) + max(comp - fwd, rs), comp, comm)
            else:
                s["floor_ms"] = max(comp, fwd + comm)
            s["step_over_floor"] = on / s["floor_ms"]
            ind = (f"{ms['inductor']:.1f}" if ms.get("inductor") is not None else
                   "skipped" if "inductor" not in r else "failed")
            ratio = s["inductor_over_on"]
            ratio_cell = f"{ratio:7.2f}" if ratio else f"{'-':>7}"
            lines.append(
                f"{mode:6} {comp:9.1f} {comm:9.1f} {off:9.1f} {on:9.1f} {ind:>12} {ratio_cell} "
                f"{off - comp:9.1f} {on - comp:9.1f} {s['exposed_over_comm']:11.2f} "
                f"{s['step_over_max']:7.2f} {s['floor_ms']:7.1f} {s['step_over_floor']:8.2f}"
                f"  exposed<=15%: {s['target_exposed_met']}, "
                f"step<=1.1x: {s['target_step_met']}, ind/on>=1.3: {s['target_speedup_met']}")
        else:
            lines.append(f"{mode:6} failed: {r}")
        s["errors"] = {k: v for k, v in r.items() if isinstance(v, str)}
        lines += [f"{mode:6} {k}: {v}" for k, v in s["errors"].items() if k != "inductor"]
        summary[mode] = s
    fsdp = results.get("fsdp", {})
    peaks = {k: fsdp.get(f"{k}_peak_mb") for k in ("off", "on", "inductor")}
    if any(v is not None for v in peaks.values()):
        summary.setdefault("fsdp", {}).update({f"{k}_peak_mb": v for k, v in peaks.items()})
        lines.append("fsdp peak memory (largest rise of live heap bytes in a step, MiB): " +
                     ", ".join(f"{k} {v:.1f}" for k, v in peaks.items() if v is not None))
    if module_lines:
        lines += ["", "GPT modules, median step ms: fcoll = backend='fcoll' (compute='inductor'), "
                  "pytorch = backend='inductor' with FX bucketing (PyTorch's best on CPU), hand = "
                  "the hand-written step with fcoll; peak = largest rise of live heap bytes in a "
                  "step, MiB (eager: FSDP2 without a compiler)",
                  f"{'mode':12} {'fcoll':>9} {'pytorch':>9} {'hand':>9} {'pytorch/fcoll':>13} "
                  f"{'collectives in graphs':>22} {'peak fcoll':>10} {'peak torch':>10} "
                  f"{'peak eager':>10}  target pytorch/fcoll >= 1.3"] + module_lines
        fs, f2 = summary.get("simple-fsdp", {}), summary.get("torch-fsdp2", {})
        ours = fs.get("fcoll_peak_mb")
        refs = {"FSDP2 eager": f2.get("eager_peak_mb"), "FSDP2 Inductor": f2.get("pytorch_peak_mb"),
                "SimpleFSDP Inductor": fs.get("pytorch_peak_mb")}
        floor_line = (_simple_fsdp_floor_line(results["simple-fsdp"], fs)
                      if "simple-fsdp" in results else None)
        if floor_line:
            lines.append(floor_line)
        co = summary.get("simple-fsdp", {})
        if co.get("coalesced_ms") is not None:
            lines.append(f"SimpleFSDP under fcoll with bucket_mode='coalesced': "
                         f"{co['coalesced_ms']:.1f} ms, peak {co['coalesced_peak_mb']:.1f} MiB")
            if refs["FSDP2 eager"]:
                fs["coalesced_peak_over_fsdp2_eager"] = (co["coalesced_peak_mb"]
                                                         / refs["FSDP2 eager"])
        for label, ref in refs.items():
            if ours is not None and ref:
                key = {"FSDP2 eager": "peak_over_fsdp2_eager",
                       "FSDP2 Inductor": "peak_over_fsdp2_inductor",
                       "SimpleFSDP Inductor": "peak_over_inductor"}[label]
                fs[key] = ours / ref
                target = (f" (target <= 1.1: {ours / ref <= 1.1})"
                          if label == "FSDP2 eager" else "")
                lines.append(f"SimpleFSDP under fcoll peak {ours:.1f} MiB / {label} {ref:.1f} "
                             f"MiB = {ours / ref:.2f}{target}")
    return "\n".join(lines + ddp_lines), summary


def _torch_ddp_rows(r: dict, summary: dict) -> list[str]:
    """The torch-ddp table: each variant's median step, its ratio to fcoll's (median of the
    per-round ratios), and fcoll's exposed communication, overlap and floor."""
    times, rounds = r["times"], r["rounds"]
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()
           if isinstance(v, list) and v}
    paired = {k: [x[k] / x["fcoll"] for x in rounds if k in x and "fcoll" in x]
              for k in med if k != "fcoll"}
    s_colls = sorted({x["fcoll_collectives"] for x in rounds if "fcoll_collectives" in x})
    ratios = {k: statistics.median(v) for k, v in paired.items() if v}
    s: dict = {"step_ms": med, "over_fcoll": ratios, "fcoll_collectives": s_colls,
               "errors": {k: v for k, v in times.items() if isinstance(v, str)}}
    lines = ["", (f"torch-ddp (PyTorch's DDP module), {len(rounds)} round(s), median step ms; "
                  "ratio = variant / fcoll, median of per-round ratios; collectives in "
                  f"fcoll's compiled graphs: {s_colls}"),
             f"{'variant':18} {'step_ms':>9} {'ratio':>7}"]
    for k, v in med.items():
        ratio = 1.0 if k == "fcoll" else ratios.get(k, float("nan"))
        lines.append(f"{k:18} {v:9.1f} {ratio:7.2f}")
    if {"fcoll", "compute", "comm", "forward"} <= med.keys():
        exposed = med["fcoll"] - med["compute"]
        s.update(exposed_comm_ms=exposed, overlap_ratio=1 - max(exposed, 0.0) / med["comm"],
                 floor_ms=max(med["compute"], med["forward"] + med["comm"]))
        s["fcoll_over_floor"] = med["fcoll"] / s["floor_ms"]
        baselines = [k for k in ratios if k.startswith(("ca-", "ddpopt-"))]
        s["target_met"] = bool(baselines) and min(ratios[k] for k in baselines) >= 1.3
        lines.append(f"fcoll: exposed communication {exposed:.1f} ms of {med['comm']:.1f} ms "
                     f"(overlap {100 * s['overlap_ratio']:.0f} %); floor max(compute, forward + "
                     f"comm) = {s['floor_ms']:.1f} ms, fcoll/floor {s['fcoll_over_floor']:.2f}; "
                     f"target every PyTorch variant / fcoll >= 1.3: {s['target_met']}")
    lines += [f"{k}: {v}" for k, v in s["errors"].items()]
    summary["torch-ddp"] = s
    return lines


def _simple_fsdp_floor_line(r: dict, s: dict) -> str | None:
    """The SimpleFSDP row's floor (:func:`simple_fsdp_floor`), written into its summary ``s``;
    None when a part of it was not measured."""
    parts = ("fcoll", "compute", "forward", "comm_all_gather", "comm_reduce_scatter")
    if not all(isinstance(r.get(k), float) for k in parts):
        return None
    ms = {k: r[k] * 1e3 for k in parts}
    floor = simple_fsdp_floor(ms)
    comm = 2 * ms["comm_all_gather"] + ms["comm_reduce_scatter"]
    exposed = ms["fcoll"] - ms["compute"]
    s.update(compute_ms=ms["compute"], forward_ms=ms["forward"],
             comm_all_gather_ms=ms["comm_all_gather"],
             comm_reduce_scatter_ms=ms["comm_reduce_scatter"], comm_ms=comm,
             exposed_comm_ms=exposed, overlap_ratio=1 - max(exposed, 0.0) / comm,
             floor_ms=floor, fcoll_over_floor=ms["fcoll"] / floor,
             target_floor_met=ms["fcoll"] / floor <= 1.15)
    return (f"SimpleFSDP under fcoll: compute {ms['compute']:.1f} ms (the step on a mesh of one "
            f"rank), forward {ms['forward']:.1f}, all_gathers {ms['comm_all_gather']:.1f} (x2: "
            f"resharded after forward), reduce_scatters {ms['comm_reduce_scatter']:.1f}; exposed "
            f"communication {exposed:.1f} of {comm:.1f} ms (overlap "
            f"{100 * s['overlap_ratio']:.0f} %); floor max(forward, all_gathers) + "
            f"max(compute - forward, all_gathers + reduce_scatters) = {floor:.1f} ms, "
            f"fcoll/floor {ms['fcoll'] / floor:.2f} (target <= 1.15: {s['target_floor_met']})")


def _module_row(mode: str, r: dict, hand: dict | None, summary: dict) -> str:
    ms = {k: (v * 1e3 if isinstance(v, float) else None) for k, v in r.items()
          if k in ("fcoll", "pytorch")}
    hand_ms = hand["on"] * 1e3 if hand and isinstance(hand.get("on"), float) else None
    fc, pt = ms.get("fcoll"), ms.get("pytorch")
    ratio = r.get("pytorch_over_fcoll")   # the median of per-round ratios
    peaks = {k: r.get(f"{k}_peak_mb") for k in ("fcoll", "pytorch", "eager")}
    eager, co = r.get("eager"), r.get("coalesced")
    summary[mode] = {"fcoll_ms": fc, "pytorch_ms": pt, "hand_ms": hand_ms,
                     "eager_ms": eager * 1e3 if isinstance(eager, float) else None,
                     "coalesced_ms": co * 1e3 if isinstance(co, float) else None,
                     "coalesced_peak_mb": r.get("coalesced_peak_mb"),
                     **{f"{k}_peak_mb": v for k, v in peaks.items()},
                     "pytorch_over_fcoll": ratio, "fcoll_collectives": r.get("fcoll_collectives"),
                     "errors": {k: v for k, v in r.items() if isinstance(v, str)},
                     "target_met": ratio is not None and ratio >= 1.3}
    cell = lambda v: f"{v:9.1f}" if v is not None else f"{'-':>9}"  # noqa: E731
    return (f"{mode:12} {cell(fc)} {cell(pt)} {cell(hand_ms)} "
            f"{(f'{ratio:13.2f}' if ratio else f'{chr(45):>13}')} "
            f"{str(r.get('fcoll_collectives', '-')):>22} "
            + "".join(f"{v:10.1f} " if v is not None else f"{'-':>10} " for v in peaks.values())
            + f"  {summary[mode]['target_met']}"
            + "".join(f"; {k} {v}" for k, v in summary[mode]["errors"].items()))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parse(argv)
    if a.group == "gloo" and a.network in ("auto", "tbf") and NETNS_ENV not in os.environ:
        rc = _run_in_netns([x for x in argv if x not in ("auto", "tbf", "--network")])
        if rc is not None:
            return rc
        if a.network == "tbf":
            return 2
    network = ("fcoll's shared-memory group (no link)" if a.group == "fcoll"
               else os.environ.get(NETNS_ENV, "plain loopback (NOT rate-limited)"))
    sys.path.insert(0, ROOT)
    from fcoll.testing import run_ranks

    from collectives import BackgroundLoad, _sigterm_raises
    from peak_memory import preload_env

    # the ranks start with the allocation counter preloaded (peak columns); only they do
    # (run_ranks sets env before each rank's interpreter starts)
    preload = preload_env()
    t0, load_before = time.time(), os.getloadavg()
    with _sigterm_raises(), BackgroundLoad(a.background_load):
        r0 = run_ranks(_rank, 2, backend=a.group, args=(vars(a),), timeout_s=a.timeout_s,
                       pg_timeout_s=a.timeout_s, env=preload)[0]
        load_after = os.getloadavg()
    text, summary = _table(r0, network, a.group)
    print(text)
    if a.param_dtype or a.reduce_dtype:
        print(f"FSDP module rows in mixed precision: parameters {a.param_dtype or 'float32'}, "
              f"gradients reduced in {a.reduce_dtype or a.param_dtype} (MixedPrecisionPolicy)")
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after} "
          f"({os.cpu_count()} cores; {a.background_load} background busy processes; peak "
          f"memory: {'counted' if preload else 'unavailable (no C compiler)'})")
    with open(a.json, "w") as f:
        json.dump({"network": network, "args": vars(a), "results": summary,
                   "background_load": a.background_load,
                   "raw_seconds": r0, "wall_s": time.time() - t0,
                   "load_average": {"before": load_before, "after": load_after}}, f, indent=2)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
