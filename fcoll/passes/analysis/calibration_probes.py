"""Calibration probes: the calls that calibration times, and the loops that time them.

What one measurement is, with no decision about what to measure, how often, in what order or
what to reuse:

- timing loops (fastest / median of a few runs, per-call time of back-to-back calls) and the
  compute microbenchmark (:func:`time_compute_rates`: a transformer-sized matmul, a large copy,
  a tiny aten op as the executor calls it);
- the blocking collective of each kind on a group over float32 buffers of a size
  (:func:`blocking_collective`, :func:`probe_buffers`; reduce_scatter on gloo by fcoll's own
  algorithm) and the group's backend name (:func:`backend_of`);
- a group's host layout (:func:`host_layout`: one all_gather of a hash of
  :func:`host_identity`), which decides the ``link`` of its curves and its cache key.

Kept apart from :mod:`fcoll.passes.analysis.calibration`, which holds the protocol built on
these: the sweep's sizes, runs, rounds and order (``time_collectives``), rank 0's decision and
broadcast, the slowest rank's medians, the per-process cache and reuse, and the cost model of a
graph's groups. That module imports :func:`probe_buffers`, :func:`blocking_collective`,
:func:`backend_of` and :func:`host_layout` by name and calls them through its own globals, so a
test or benchmark that replaces ``calibration.blocking_collective`` changes what is timed.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from typing import Any, Callable

import torch

from fcoll.passes.analysis.cost import ComputeRates

__all__ = ["host_identity", "host_layout", "time_compute_rates", "backend_of", "probe_buffers",
           "blocking_collective"]


# ---------------------------------------------------------------------------------------------
# Timing loops

def _times_us(fn: Callable[[], None], reps: int) -> list[float]:
    """The time of each of ``reps`` runs of ``fn``, in us."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def _min_us(fn: Callable[[], None], reps: int) -> float:
    """Fastest of ``reps`` runs, in us (on a shared machine the minimum is the least noisy)."""
    return min(_times_us(fn, reps))


def _median_us(fn: Callable[[], None], reps: int) -> float:
    """Median of ``reps`` runs, in us: for kernels long enough that the minimum is a lucky run
    (a matmul that found the caches warm and the other cores idle)."""
    return sorted(_times_us(fn, reps))[reps // 2]


def _per_call_us(fn: Callable[[], None], calls: int, reps: int) -> float:
    """Fastest of ``reps`` runs of ``calls`` back-to-back calls, in us per call."""
    return _min_us(lambda: [fn() for _ in range(calls)], reps) / calls


# ---------------------------------------------------------------------------------------------
# Compute rates

#: The calibration matmul: [1024, 256] @ [256, 768], a transformer layer's QKV projection for
#: 1024 tokens of width 256, the scale of the matmuls the passes schedule.
_MM_SHAPE = (1024, 256, 768)


def time_compute_rates(reps: int = 5) -> ComputeRates:
    """Run the compute microbenchmark of
    :func:`fcoll.passes.analysis.calibration.measure_compute_rates` now (that function documents
    what is timed and why, and caches the result per process). Returns :class:`ComputeRates`
    (FLOPs/us, bytes/us, us per op)."""
    m, k, n = _MM_SHAPE
    a, b = torch.randn(m, k), torch.randn(k, n)
    src, dst = torch.randn(1 << 20), torch.empty(1 << 20)
    x = torch.ones(4)
    add = torch.ops.aten.add.Tensor
    torch.mm(a, b)
    torch.mm(a, b)
    dst.copy_(src)
    op_us = _per_call_us(lambda: add(x, x), 50, reps)
    mm_us = _median_us(lambda: torch.mm(a, b), reps)
    copy_us = _min_us(lambda: dst.copy_(src), reps)
    rates = ComputeRates(flops_per_us=2 * m * k * n / max(mm_us - op_us, 1.0),
                         bytes_per_us=2 * src.numel() * 4 / max(copy_us - op_us, 1.0),
                         op_overhead_us=max(op_us, 0.5))
    return rates


# ---------------------------------------------------------------------------------------------
# The collectives that are timed

def backend_of(pg: Any) -> str:
    """``pg``'s backend name as c10d reports it (``"gloo"``, ``"fcoll"``, ``"fake"``), or
    ``"unknown"`` for a group c10d does not know (made outside its registry)."""
    import torch.distributed as dist

    try:
        return str(dist.get_backend(pg))
    except Exception:  # noqa: BLE001  groups made outside c10d's registry
        return "unknown"


def _quiet(fn, *args, **kwargs):
    """Call a c10d function with its ``FutureWarning`` (a deprecation notice) silenced."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return fn(*args, **kwargs)


def _reduce_scatter(pg: Any, out: torch.Tensor, input: torch.Tensor) -> None:
    """One blocking reduce_scatter of ``input [n * N]`` into ``out [N]``: on gloo by the
    algorithm fcoll's ops pick there (``all_to_all_single`` and a local sum,
    :func:`fcoll.ops.library.start_reduce_scatter`); elsewhere the backend's single-tensor
    ``reduce_scatter_tensor``, the call the other kinds are timed by (``dist.all_reduce``,
    ``dist.all_gather_into_tensor``).

    Not ``start_reduce_scatter`` on fcoll's backend: there it is the backend's
    ``reduce_scatter_tensor_coalesced`` of one tensor, which takes the general path, and
    compiled graphs do not run it (static shapes take the executor's direct path); the
    coalesced call is several times slower than either at small sizes.
    """
    import torch.distributed as dist

    from fcoll.ops.wire import reduces_scatter_by_all_to_all, start_reduce_scatter

    if not reduces_scatter_by_all_to_all(pg):
        _quiet(dist.reduce_scatter_tensor, out, input, group=pg)
        return
    work, finish = start_reduce_scatter(pg, out, input, "sum", input.dtype)
    work.wait()
    if finish is not None:
        finish()


def probe_buffers(pg: Any, nbytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 buffers for collectives of ``nbytes`` on ``pg``: (whole, whole, shard), whole
    ``[max(n, nbytes // 4 // n * n)]`` and shard ``[whole // n]`` for ``n = pg.size()``."""
    n = pg.size()
    numel = max(n, nbytes // 4 // n * n)
    return torch.zeros(numel), torch.zeros(numel), torch.zeros(numel // n)


def blocking_collective(kind: str, pg: Any, bufs: tuple[torch.Tensor, ...]
                        ) -> Callable[[], None]:
    """A call of one blocking collective of ``kind`` on ``pg`` over :func:`probe_buffers`'
    tensors, moving the whole buffer's bytes (the larger buffer, as
    :func:`fcoll.ops.facts.comm_bytes` counts). Every rank of ``pg`` must call it alike.

    Raises:
        KeyError: ``kind`` is not one of the five collective kinds.
    """
    import torch.distributed as dist

    big, out, small = bufs
    ops = {
        "all_reduce": lambda: dist.all_reduce(big, group=pg),
        "all_gather": lambda: _quiet(dist.all_gather_into_tensor, big, small, group=pg),
        "reduce_scatter": lambda: _reduce_scatter(pg, small, big),
        "all_to_all": lambda: dist.all_to_all_single(out, big, group=pg),
        "broadcast": lambda: dist.broadcast(big, group=pg, group_src=0),
    }
    return ops[kind]


# ---------------------------------------------------------------------------------------------
# Host layout of a group

def host_identity() -> str:
    """This process's host: ``$FCOLL_HOST_ID`` if set (tests emulating hosts), else the host
    name and the network namespace's inode (two namespaces of one machine are two hosts)."""
    override = os.environ.get("FCOLL_HOST_ID")
    if override:
        return override
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{netns}"


def host_layout(pg: Any) -> str:
    """Host index of each group rank, in order of first appearance (``"0.0.1"``): one
    all_gather of a 64-bit hash of :func:`host_identity`. A collective call."""
    import torch.distributed as dist

    digest = hashlib.blake2b(host_identity().encode(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    every = torch.empty(pg.size(), dtype=torch.int64)
    _quiet(dist.all_gather_into_tensor, every, mine, group=pg)
    index: dict[int, int] = {}
    return ".".join(str(index.setdefault(h, len(index))) for h in every.tolist())
