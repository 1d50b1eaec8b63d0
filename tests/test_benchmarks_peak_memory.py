"""benchmarks/peak_memory.py: the preloaded allocation counter sees every tensor storage (on the
main thread, on another thread, and Inductor's own buffers) from allocation to free, and is
absent (None) without the preload."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import peak_memory  # noqa: E402

MiB = 1 << 20

CHILD = f"""
import sys, threading
sys.path.insert(0, {BENCH!r})
import torch
from peak_memory import PeakAlloc, available
assert available()
m = PeakAlloc()
with m:
    t = torch.empty(64 * 2**20, dtype=torch.uint8); del t
    kept = torch.empty(16 * 2**20, dtype=torch.uint8)
print("freed", m.rise_bytes)
def alloc():
    u = torch.empty(32 * 2**20, dtype=torch.uint8); del u
with m:
    th = threading.Thread(target=alloc); th.start(); th.join()
print("thread", m.rise_bytes)
print("max", m.max_rise_bytes)
"""


@pytest.mark.timeout(120)
def test_peak_counts_every_storage_on_every_thread_from_allocation_to_free():
    env = peak_memory.preload_env()
    if not env:
        pytest.skip("no C compiler to build benchmarks/peak_alloc.c")
    out = subprocess.run([sys.executable, "-c", CHILD], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=100, check=True).stdout
    got = dict(line.split() for line in out.splitlines())
    # 64 MiB at once, then 16 MiB kept: the peak is the 64 MiB (plus a few small allocations)
    assert 64 * MiB <= int(got["freed"]) < 65 * MiB
    assert 32 * MiB <= int(got["thread"]) < 33 * MiB
    assert int(got["max"]) == int(got["freed"])


def test_without_the_preload_nothing_is_counted():
    m = peak_memory.PeakAlloc()
    with m:
        pass
    assert not peak_memory.available() or "LD_PRELOAD" in os.environ
    if not peak_memory.available():
        assert m.rise_mb is None and m.max_rise_mb is None
