"""The Python floor of an eager ``dist.all_reduce`` on a Python process group, on this machine.

Usage: ``python benchmarks/python_floor.py [--sizes 4K 64K 1M] [--json floor.json]``

fcoll's backend is a Python ``dist.ProcessGroup``, so an eager ``dist.all_reduce`` pays, before
fcoll does anything, c10d's own Python path (``distributed_c10d.all_reduce``: argument checks,
default-group lookup, ``AllreduceOptions``, the group's method, ``Work.wait``), and any
shared-memory all_reduce of a tensor that does not live in shared memory then copies it in and
reduces the peer's copy into it. This prints those parts, in one process:

* ``c10d``: ``dist.all_reduce(t)`` into a no-op Python group (its ``allreduce`` returns a
  finished Python ``Work``, as fcoll's fast path does) of one rank;
* ``copy_`` and ``add_`` of the size (float32, one intra-op thread, as ``torchrun`` sets);
* ``floor`` = their sum: an eager all_reduce through a Python backend cannot cost less, whatever
  the backend does, before the two ranks' synchronisation (two cache-line transfers) and the
  peer's bytes coming from the other core's cache.

Best of 9 repeats, thread CPU time (``time.thread_time``: a busy machine's preemptions do not
count, its cache interference does), nanoseconds per call. Compare with
``benchmarks/collectives.py`` (fcoll, gloo, DeepSpeed's raw C++ op) in the same minute.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import timeit

import torch
import torch.distributed as dist


class _DoneWork(dist.Work):
    def wait(self, timeout=None) -> bool:
        return True


class NoOpGroup(dist.ProcessGroup):
    """A process group whose all_reduce does nothing and returns one finished ``Work``."""

    def __init__(self, store, rank: int, size: int, timeout=None):
        super().__init__(rank, size)
        self._work = _DoneWork()

    def allreduce(self, tensors, opts=None) -> dist.Work:
        return self._work

    def getBackendName(self) -> str:
        return "noop"


def _ns(fn, calls: int) -> float:
    return min(timeit.repeat(fn, number=calls, repeat=9, timer=time.thread_time)) / calls * 1e9


def main(argv=None) -> int:
    from collectives import parse_size

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="*", type=parse_size, default=[4 << 10, 64 << 10, 1 << 20])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.Backend.register_backend("noop", NoOpGroup, devices=["cpu"])
    dist.init_process_group("noop", store=dist.HashStore(), rank=0, world_size=1)
    load = os.getloadavg()[0]
    rows = []
    print(f"# Python floor of an eager all_reduce, ns per call (best of 9, thread CPU time), "
          f"1-min load {load:.2f}")
    print(f"{'size':>9} | {'c10d':>8} {'copy_':>9} {'add_':>9} | {'floor':>9}")
    for size in args.sizes:
        t, u = torch.ones(size // 4), torch.ones(size // 4)
        calls = max(20, min(20000, (64 << 20) // size))
        row = {"size": size, "c10d_ns": _ns(lambda: dist.all_reduce(t), calls),
               "copy_ns": _ns(lambda: u.copy_(t), calls), "add_ns": _ns(lambda: t.add_(u), calls)}
        row["floor_ns"] = row["c10d_ns"] + row["copy_ns"] + row["add_ns"]
        rows.append(row)
        print(f"{size:>9} | {row['c10d_ns']:>8.0f} {row['copy_ns']:>9.0f} {row['add_ns']:>9.0f} | "
              f"{row['floor_ns']:>9.0f}")
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "loadavg": load}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
