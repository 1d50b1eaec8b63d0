"""A one-rank Python process group whose collectives complete in the call, for tests that run
fcoll's ops in one process (with :func:`fcoll.testing.one_rank_group`)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["DoneWork", "SyncOneRankGroup"]


class DoneWork(dist.Work):
    """A ``Work`` that is already complete."""

    def wait(self, timeout=None) -> bool:
        return True


class SyncOneRankGroup(dist.ProcessGroup):
    """One rank; every method fcoll's ops call completes its copy before returning (on one
    rank every collective's result is its input).

    Args:
        name: the group name, also the name the backend is registered under; one per test
            module (c10d keeps registered backend names for the whole process).
    """

    def __init__(self, name: str) -> None:
        super().__init__(0, 1)
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def allreduce(self, tensors, opts=None):
        return DoneWork()

    def allreduce_coalesced(self, tensors, opts=None):
        return DoneWork()

    def broadcast(self, tensors, opts=None):
        return DoneWork()

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for out, x in zip(outputs, inputs):
            out.copy_(x.reshape(out.shape))
        return DoneWork()

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        output.copy_(input)
        return DoneWork()
