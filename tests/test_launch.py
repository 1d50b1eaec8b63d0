"""``python -m fcoll.launch`` starts ranks like torchrun, prefixes their output, and stops them
all when one fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from fcoll.testing import fcoll_segments

REPO = Path(__file__).resolve().parents[1]
ENV_KEYS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT"]


def _launch(tmp_path: Path, script: str, *args: str, timeout: float = 120):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fcoll.launch", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def test_ranks_get_torchrun_env_prefixed_output_and_fcoll_rendezvous(tmp_path):
    proc, _ = _launch(tmp_path, f"""
        import os, sys
        import torch, torch.distributed as dist, fcoll
        print("env", *[os.environ[k] for k in {ENV_KEYS!r}], sys.argv[1:])
        dist.init_process_group("fcoll")  # env:// rendezvous through MASTER_ADDR / MASTER_PORT
        t = torch.full((3,), float(dist.get_rank() + 1))
        dist.all_reduce(t)
        print("sum", t.tolist())
        print("to stderr", file=sys.stderr)
        dist.destroy_process_group()
        """, "--nproc-per-node", "2", "script.py", "--lr", "0.1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    for r in (0, 1):
        env = next(line for line in out if line.startswith(f"[rank {r}] env "))
        fields = env.split(" ", 3)[3].split(" ")
        assert fields[:7] == [str(r), "2", str(r), "2", "0", "127.0.0.1", fields[6]]
        assert int(fields[6]) > 0
        assert env.endswith("['--lr', '0.1']")
        assert f"[rank {r}] sum [3.0, 3.0, 3.0]" in out
        assert f"[rank {r}] to stderr" in proc.stderr.splitlines()
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in out)
    assert fcoll_segments() == []


def test_failing_rank_stops_the_others_and_sets_the_exit_code(tmp_path):
    proc, elapsed = _launch(tmp_path, """
        import os, signal, sys, time
        if os.environ["RANK"] == "1":
            print("failing", flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 ignores SIGTERM: SIGKILL follows
        print("waiting", flush=True)
        time.sleep(120)
        """, "--nproc-per-node", "3", "--grace-s", "1", "script.py", timeout=60)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert elapsed < 15
    assert "[rank 1] failing" in proc.stdout
    assert "rank 1 exited with status 3" in proc.stderr


def test_module_mode_and_default_single_rank(tmp_path):
    (tmp_path / "mymod.py").write_text("import os, sys\nprint('mod', os.environ['WORLD_SIZE'], "
                                       "sys.argv[1:])\n")
    proc, _ = _launch(tmp_path, "", "-m", "mymod", "x")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[rank 0] mod 1 ['x']"]
