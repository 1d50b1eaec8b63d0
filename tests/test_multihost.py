"""Emulated hosts (network namespaces made by fcoll.testing.hosts) running ``fcoll.launch``
with torchrun's multi-node arguments: the fcoll world spans them as a hierarchical group.

Skipped, with the reason, where this machine cannot make network namespaces.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fcoll.testing import fcoll_segments
from fcoll.testing.hosts import EmulatedHosts, netns_unavailable, sweep_stale_namespaces

REPO = Path(__file__).resolve().parents[1]
WHY_NOT = netns_unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")

SCRIPT = """
    import os
    import torch, torch.distributed as dist, fcoll
    from fcoll.shm.multihost.host_layout import host_id
    dist.init_process_group("fcoll")
    rank, n = dist.get_rank(), dist.get_world_size()
    t = torch.arange(1000, dtype=torch.float32) + rank
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(1000, dtype=torch.float32) * n + n * (n - 1) / 2)
    out = torch.empty(n * 3, dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.full((3,), rank))
    assert out.tolist() == [r for r in range(n) for _ in range(3)]
    rs = torch.empty(5)
    dist.reduce_scatter_tensor(rs, torch.ones(n * 5) * (rank + 1))
    assert rs.tolist() == [n * (n + 1) / 2] * 5
    b = torch.full((4,), float(rank))
    dist.broadcast(b, src=n - 1)
    assert b.tolist() == [float(n - 1)] * 4
    dist.barrier()
    print("ok", type(dist.group.WORLD).__name__, os.environ["GROUP_RANK"], host_id(),
          flush=True)
    dist.destroy_process_group()
    """


def _ns_names(hosts: EmulatedHosts) -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines()} & {*hosts.hosts, hosts.switch}


def test_two_emulated_hosts_run_one_hierarchical_job_through_the_launcher(tmp_path):
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    with EmulatedHosts(2, rate="1gbit") as hosts:
        procs = hosts.launch(2, [str(tmp_path / "script.py")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=150)
            assert p.returncode == 0, err[-3000:]
            outs += [line for line in out.splitlines() if " ok " in line]
        assert _ns_names(hosts) == {*hosts.hosts, hosts.switch}
    assert _ns_names(hosts) == set()
    assert len(outs) == 4 and all("HierarchicalProcessGroup" in line for line in outs), outs
    host_ids = {line.split()[-1] for line in outs}
    assert len(host_ids) == 2 and all("/netns:" in h for h in host_ids)  # 2 hosts, by netns
    assert fcoll_segments() == []


def test_namespaces_and_processes_go_on_exception_and_stale_ones_are_swept():
    with pytest.raises(RuntimeError, match="boom"), EmulatedHosts(2) as hosts:
        sleeper = hosts.popen(1, [sys.executable, "-c", "import time; time.sleep(300)"])
        raise RuntimeError("boom")
    assert sleeper.poll() is not None and _ns_names(hosts) == set()
    # a namespace left by a process that died: its pid is in the name
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"fcoll-{dead.pid}-abc123-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in sweep_stale_namespaces()
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert stale not in out


def test_bad_arguments_are_refused_before_anything_is_made():
    with pytest.raises(ValueError, match="rate 'fast'"):
        EmulatedHosts(2, rate="fast")
    with pytest.raises(ValueError, match="num_hosts 0"):
        EmulatedHosts(0)


def test_sigterm_removes_the_namespaces_of_the_process_it_stops(tmp_path):
    """A process killed with SIGTERM inside ``with EmulatedHosts`` deletes its namespaces."""
    script = tmp_path / "hold.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from fcoll.testing.hosts import EmulatedHosts
        with EmulatedHosts(2) as hosts:
            print(" ".join([*hosts.hosts, hosts.switch]), flush=True)
            time.sleep(300)
        """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        names = proc.stdout.readline().split()
        assert len(names) == 3
        proc.terminate()
        assert proc.wait(timeout=60) == 128 + 15
    finally:
        if proc.poll() is None:
            proc.kill()
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not set(names) & {line.split()[0] for line in out.splitlines() if line.strip()}
