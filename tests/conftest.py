"""Test-session isolation: each test module starts without a default process group.

Single-process tests initialise PyTorch's fake process group or a one-rank gloo group; the
default group is process-global, so a module that leaves one behind would change the group size
seen by the next module (and so its snapshots). This fixture destroys any default group after
every module.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True, scope="module")
def _no_default_process_group_across_modules():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
