"""DeepSpeed's shared-memory all_reduce as a column of ``collectives.py`` (when deepspeed is
installed): the CPU backend users pick today instead of gloo.

What it is: DeepSpeed's ``ShareMemCommBuilder`` op (``csrc/cpu/comm/shm.cpp``, built with g++
and ninja on first use into ``~/.cache/torch_extensions``), called as DeepSpeed's
``inference_all_reduce`` calls it when the op is loaded: ``torch.ops.deepspeed.
inference_all_reduce_(t)``, in place, sum only. What it needs, as DeepSpeed's launcher sets it:
``LOCAL_SIZE`` = the number of ranks on the host (without it both ranks segfault), and
``MASTER_ADDR`` / ``MASTER_PORT`` (it names its /dev/shm files after them). Its limits, stated
where a user would meet them: float32 needs AVX2 and bf16/fp16 AVX-512BW
(``vector_kernel_level``), other dtypes and non-contiguous tensors are not reduced, no groups,
no timeout, a /dev/shm file per rank left behind.

This module never falls back to ``dist.all_reduce`` (DeepSpeed's ``inference_all_reduce`` does,
silently, when the op is missing): a rank whose op is not loaded raises, so a column is always
DeepSpeed's own kernel.
"""

from __future__ import annotations

import contextlib
import io
import os

import torch

__all__ = ["Availability", "availability", "build", "DeepSpeedAllReduce", "removes_its_files"]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "deepspeed_"   # its buffers: deepspeed_allreduce_buffer_<name>_<rank>


class Availability:
    """Whether the column can run here; ``version`` (deepspeed's) or ``reason`` (why not)."""

    def __init__(self, version: str | None, reason: str | None):
        self.version, self.reason = version, reason

    def __bool__(self) -> bool:
        return self.version is not None

    def header(self) -> str:
        """One line for the benchmark's header."""
        if not self:
            return f"deepspeed: not run ({self.reason})"
        return (f"deepspeed {self.version}: ShareMemCommBuilder op (built with g++/ninja into "
                "~/.cache/torch_extensions on first use), LOCAL_SIZE = world size, "
                "torch.ops.deepspeed.inference_all_reduce_ (sum, in place, float32)")


def availability() -> Availability:
    """Whether deepspeed is installed and its shared-memory op can be built on this machine."""
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return Availability(None, "deepspeed is not installed")
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return Availability(None, "deepspeed's ShareMemCommBuilder is not compatible here")
    return Availability(deepspeed.__version__, None)


def build():
    """Load (building on first use, about 2 minutes) DeepSpeed's shared-memory op module.

    Call once in the benchmark's parent before starting ranks, so that two ranks never build
    it at once; the ranks then load the cached build.
    """
    from deepspeed.accelerator import get_accelerator

    with contextlib.redirect_stdout(io.StringIO()):   # its build chatter
        return get_accelerator().create_op_builder("ShareMemCommBuilder").load()


@contextlib.contextmanager
def removes_its_files():
    """Inside the block DeepSpeed's op may leave a /dev/shm file per rank (about 69 MB each,
    never removed by DeepSpeed); on exit, those that appeared during the block are removed."""
    def names():
        try:
            return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}
        except OSError:
            return set()

    before = names()
    try:
        yield
    finally:
        for name in names() - before:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))


class DeepSpeedAllReduce:
    """DeepSpeed's raw shared-memory all_reduce in one rank of a job of ``world`` ranks on one
    host (the default process group must exist: the op is initialised from its rank).

    Raises:
        RuntimeError: the op did not load, or this CPU lacks the AVX2 its float32 kernel needs.
    """

    def __init__(self, rank: int, world: int):
        os.environ.setdefault("LOCAL_SIZE", str(world))
        module = build()
        module.initialize(world, rank)
        if module.vector_kernel_level() < 1:
            raise RuntimeError("deepspeed's shm all_reduce needs AVX2 for float32")
        if not hasattr(torch.ops, "deepspeed") or not hasattr(torch.ops.deepspeed,
                                                               "inference_all_reduce_"):
            raise RuntimeError("deepspeed's shm op loaded but registered no "
                               "torch.ops.deepspeed.inference_all_reduce_")
        self._op = torch.ops.deepspeed.inference_all_reduce_

    def call(self, numel: int):
        """A zero-argument function running one all_reduce (sum) of ``numel`` float32 in place."""
        t = torch.ones(numel)
        op = self._op
        return lambda: op(t)
