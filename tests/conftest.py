"""Test-session isolation: each test module starts without a default process group.

Single-process tests initialise PyTorch's fake process group or a one-rank gloo group; the
default group is process-global, so a module that leaves one behind would change the group size
seen by the next module (and so its snapshots). This fixture destroys any default group after
every module. Calibration's cache file is off for the whole session (below).
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist


# Calibration is timed afresh in every test process (and its ranks, which inherit this): a
# machine-wide cache file left by an earlier run would decide what tests of calibration time.
# Tests of the cache set their own directory and turn it on.
os.environ["FCOLL_CALIBRATION_CACHE"] = "0"


@pytest.fixture(autouse=True, scope="module")
def _no_default_process_group_across_modules():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
