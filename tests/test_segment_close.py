"""``Segment.close`` never unmaps memory under a live tensor view.

``torch.frombuffer`` holds a reference to the ``mmap`` object but no buffer export, so
``mmap.close()`` used to succeed while a view of the segment lived; reading or writing that view
afterwards was a SIGSEGV. Each case runs in a fresh interpreter so that a crash shows as a
signal (a negative return code), not as the death of pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

PAGE = 4096  # the slot size the script uses
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import json, mmap, os
import torch
from fcoll.shm.transport.segment import PAGE, Layout, Segment, create_sealed_memfd

def mapped(name):
    with open("/proc/self/maps") as f:
        return name in f.read()

def segment(name):
    lay = Layout(2, PAGE)
    fd = create_sealed_memfd(name, lay.total)
    mm = mmap.mmap(fd, lay.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)  # only the mapping keeps the memory now
    return Segment(mm, lay)

out = {}
seg = segment("fcoll-test-view")
view = seg.rows(1, torch.float32)  # a view handed out, as the kernels take them
seg.close()
out["mapped_while_view_lives"] = mapped("fcoll-test-view")
view.fill_(3.0)  # write, then read, through the view of the closed segment
out["sum"] = float(view.sum())
out["numel"] = view.numel()
del view
out["mapped_after_view_dropped"] = mapped("fcoll-test-view")

seg = segment("fcoll-test-noview")
out["mapped_before_close"] = mapped("fcoll-test-noview")
seg.close()
out["mapped_after_close_without_views"] = mapped("fcoll-test-noview")
print(json.dumps(out))
"""


def _run(script: str) -> dict:
    """``script`` in a fresh interpreter (a crash is its signal, not pytest's death); the JSON
    of its last line."""
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env, cwd=_ROOT)
    assert proc.returncode == 0, (f"exit {proc.returncode} (negative: killed by that signal)\n"
                                  f"{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])

def test_close_keeps_memory_mapped_until_last_view_dies():
    """close; write and read a view taken before: no signal, right values; then drop the view:
    the memfd is no longer mapped (/proc/self/maps). A segment with no outside view is unmapped
    by close itself."""
    res = _run(_SCRIPT)
    assert res["mapped_while_view_lives"] is True
    assert res["sum"] == 3.0 * res["numel"] and res["numel"] == 2 * PAGE // 4  # [world, PAGE] bytes as f32
    assert res["mapped_after_view_dropped"] is False
    assert res["mapped_before_close"] is True
    assert res["mapped_after_close_without_views"] is False



_INBOX_SCRIPT = r"""
import json, mmap, os
import torch
from fcoll.shm.p2p.inbox import Inbox, Layout
from fcoll.shm.transport.segment import create_sealed_memfd

def mapped(name):
    with open("/proc/self/maps") as f:
        return name in f.read()

lay = Layout(2, 4096)
fd = create_sealed_memfd("fcoll-test-inbox", lay.total)
inbox = Inbox(fd, lay)
os.close(fd)
view = inbox.data[lay.data:lay.data + 4096].view(torch.float32)  # a received slot's view
inbox.close()
out = {"mapped_while_view_lives": mapped("fcoll-test-inbox")}
view.fill_(2.0)
out["sum"] = float(view.sum())
del view
out["mapped_after_view_dropped"] = mapped("fcoll-test-inbox")
print(json.dumps(out))
"""


def test_inbox_close_keeps_memory_mapped_until_last_view_dies():
    """The p2p inbox closes the same way: a view taken before close is written and read after
    it without a signal, and the memfd is unmapped once that view is dropped."""
    res = _run(_INBOX_SCRIPT)
    assert res == {"mapped_while_view_lives": True, "sum": 2.0 * 1024,
                   "mapped_after_view_dropped": False}
