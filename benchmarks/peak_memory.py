"""Peak memory of a step, exactly: live heap bytes counted at every allocation and free.

Sampling the resident set misses short peaks and sees what the C library keeps rather than what
a step holds, and PyTorch's profiler (``profile_memory=True``) records no allocation of
Inductor's buffers on CPU (tried on 2.13: one event for a compiled ``mm -> relu -> mm``). So the
benchmarks preload ``peak_alloc.c``, built here with the system's C compiler: it wraps the C
library's allocation functions and keeps the live bytes and their peak, on every thread, which
is every tensor storage of the process (PyTorch's CPU allocator, Inductor's buffers, gloo's and
fcoll's), counted by ``malloc_usable_size`` from allocation to free.

Use: :func:`preload_env` as the ranks' start-up environment (``fcoll.testing.run_ranks(env=...)``:
the library must be loaded when a process starts), then :class:`PeakAlloc` around a step in a
rank.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

__all__ = ["build", "preload_env", "PeakAlloc", "available"]

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peak_alloc.c")


def build() -> str | None:
    """Path of the compiled ``peak_alloc.c`` (cached by its source's hash under the temp dir),
    or None without a C compiler or when compiling fails."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    out = os.path.join(tempfile.gettempdir(), f"fcoll-peak-alloc-{os.getuid()}-{digest}.so")
    if not os.path.exists(out):
        tmp = f"{out}.{os.getpid()}"
        r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, SOURCE],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return None
        os.replace(tmp, out)
    return out


def preload_env() -> dict[str, str]:
    """``{"LD_PRELOAD": path}`` to put in ``os.environ`` before starting processes whose peak
    memory is wanted; ``{}`` if the library cannot be built."""
    path = build()
    if path is None:
        return {}
    prior = os.environ.get("LD_PRELOAD")
    return {"LD_PRELOAD": f"{path} {prior}" if prior else path}


def _lib():
    lib = ctypes.CDLL(None)
    try:
        fns = lib.fcoll_live_bytes, lib.fcoll_peak_bytes, lib.fcoll_reset_peak
    except AttributeError:
        return None
    for fn in fns:
        fn.restype = ctypes.c_long
    return lib


def available() -> bool:
    """Whether this process was started with the library preloaded."""
    return _lib() is not None


class PeakAlloc:
    """The largest rise of this process's live heap bytes over their value when the block
    starts (``rise_bytes``, ``rise_mb`` in MiB); None values without the preloaded library.
    Blocks may be entered repeatedly: ``max_rise_mb`` keeps the largest rise of them all."""

    def __init__(self) -> None:
        self.lib = _lib()
        self.rise_bytes: int | None = None
        self.max_rise_bytes: int | None = None

    def __enter__(self) -> "PeakAlloc":
        if self.lib is not None:
            self.start = self.lib.fcoll_reset_peak()
        return self

    def __exit__(self, *exc) -> None:
        if self.lib is None:
            return
        self.rise_bytes = self.lib.fcoll_peak_bytes() - self.start
        self.max_rise_bytes = max(self.max_rise_bytes or 0, self.rise_bytes)

    @property
    def rise_mb(self) -> float | None:
        return None if self.rise_bytes is None else self.rise_bytes / 2 ** 20

    @property
    def max_rise_mb(self) -> float | None:
        return None if self.max_rise_bytes is None else self.max_rise_bytes / 2 ** 20
