"""Emulated hosts: network namespaces joined by rate-limited links, made and removed here.

``EmulatedHosts(2, rate="1gbit")`` builds, on entry::

    fcoll-<pid>-<tag>-h0  (eth0 10.77.0.1/24) --veth--+
    fcoll-<pid>-<tag>-h1  (eth0 10.77.0.2/24) --veth--+-- bridge br0 in fcoll-<pid>-<tag>-sw

Each host's link is limited by ``tc qdisc ... tbf rate R burst B latency L`` in both directions
(on the host's ``eth0`` and on its switch port; netem is not in this kernel). Interfaces are
created inside the namespaces, never in the caller's, so instances never clash on a name, and
deleting a namespace removes its links. Traffic between hosts stays inside these namespaces;
traffic between the ranks of one host goes over that host's loopback, unlimited, as on a real
machine. Processes are started in a host with :meth:`EmulatedHosts.popen` (``ip netns exec``);
the hosts share the machine's filesystem and ``/dev/shm``, and their network namespaces differ,
so :func:`fcoll.shm.multihost.host_layout.host_id` tells them apart.

On exit (also on an exception, and on SIGTERM while the ``with`` block runs in the main thread)
every process started in a host is killed (its whole session) and every namespace deleted.
Namespace names carry the creating process's pid, so :func:`sweep_stale_namespaces` removes
those of a process that died without cleaning up (run at every entry).

Needs root (``CAP_SYS_ADMIN``) and iproute2; :func:`netns_unavailable` says why not where the
machine cannot make namespaces, so tests skip with that reason.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import uuid
from collections.abc import Sequence

__all__ = [
    "GLOO_IFNAME",
    "PREFIX",
    "EmulatedHosts",
    "netns_unavailable",
    "rate_bytes_per_s",
    "sweep_stale_namespaces",
]

PREFIX = "fcoll-"
#: The interface of every emulated host; gloo binds it through ``GLOO_SOCKET_IFNAME``.
GLOO_IFNAME = "eth0"
_NAME = re.compile(r"^fcoll-(\d+)-[0-9a-f]+-(h\d+|sw)$")
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$")
_RATE_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({proc.returncode}): "
                           f"{proc.stderr.strip()}")
    return proc


def _namespaces() -> list[str]:
    proc = _ip("netns", "list", check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _delete(ns: str) -> None:
    _kill_namespace_processes(ns)
    _ip("netns", "del", ns, check=False)


def sweep_stale_namespaces() -> list[str]:
    """Delete the namespaces of :class:`EmulatedHosts` whose creating process is gone (killed
    before its ``with`` block ended); return their names. Namespaces of live owners stay."""
    removed = []
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m and not _alive(int(m.group(1))):
            _delete(ns)
            removed.append(ns)
    return removed


def netns_unavailable() -> str | None:
    """Why this machine cannot make emulated hosts (no ``ip``, no permission, no ``tc``), or
    None when it can. Makes and deletes one probe namespace."""
    probe = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}-sw"
    try:
        proc = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "iproute2's `ip` is not installed"
    if proc.returncode != 0:
        return f"`ip netns add` failed: {proc.stderr.strip()} (needs root / CAP_SYS_ADMIN)"
    try:
        tc = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo",
                             "root", "tbf", "rate", "1gbit", "burst", "256kb", "latency",
                             "50ms"], capture_output=True, text=True, timeout=30)
        if tc.returncode != 0:
            return f"`tc qdisc ... tbf` failed: {tc.stderr.strip()}"
    except FileNotFoundError:
        return "`tc` is not installed"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def rate_bytes_per_s(rate: str) -> float:
    """A tc rate (``"1gbit"``, ``"500mbit"``) in bytes per second (1gbit -> 1.25e8).

    Raises:
        ValueError: ``rate`` is not a number followed by bit, kbit, mbit, gbit or tbit.
    """
    m = _RATE.match(rate)
    if m is None:
        raise ValueError(f"rate must look like '1gbit' or '500mbit', got {rate!r}")
    return float(rate[:m.start(2)]) * _RATE_BITS[m.group(2)] / 8


def _burst_bytes(rate: str) -> int:
    """tbf's bucket: at least 256 KiB (a GSO packet on veth is up to 64 KiB, and a bucket
    smaller than a packet drops it), and 2 ms of traffic at ``rate``."""
    return max(256 << 10, int(rate_bytes_per_s(rate) * 0.002))


class EmulatedHosts:
    """``num_hosts`` network namespaces on one switch, each link limited to ``rate``.

    Args:
        num_hosts: number of hosts, 1 to 200.
        rate: tbf rate of each host's link in each direction, tc's syntax (``"1gbit"``,
            ``"10gbit"``, ``"500mbit"``).
        latency_ms: tbf's ``latency``: the longest a packet may wait in the bucket before it is
            dropped, in ms (not a propagation delay; netem is not available).
        subnet: the first three octets of the hosts' addresses (``10.77.0`` -> 10.77.0.1 ...).

    Raises:
        ValueError: ``num_hosts`` out of range or a ``rate`` tc would not parse.
        RuntimeError: on entry, an ``ip``/``tc`` command failed (everything made so far is
            removed first).
    """

    def __init__(self, num_hosts: int, rate: str = "1gbit", latency_ms: float = 100.0,
                 subnet: str = "10.77.0"):
        if not 1 <= num_hosts <= 200:
            raise ValueError(f"EmulatedHosts: num_hosts {num_hosts} is not in 1..200")
        if not _RATE.match(rate):
            raise ValueError(f"EmulatedHosts: rate {rate!r} is not a tc rate like '1gbit'")
        self.num_hosts = num_hosts
        self.rate = rate
        self.latency_ms = latency_ms
        self.subnet = subnet
        tag = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.switch = f"{tag}-sw"
        self.hosts = [f"{tag}-h{i}" for i in range(num_hosts)]
        self._procs: list[subprocess.Popen] = []
        self._old_sigterm = None

    def address(self, host: int) -> str:
        """IPv4 address of host ``host`` (0-based)."""
        return f"{self.subnet}.{host + 1}"

    # ---- lifetime ---------------------------------------------------------------------------
    def __enter__(self) -> EmulatedHosts:
        sweep_stale_namespaces()
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_sigterm(self, signum, frame) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def _build(self) -> None:
        tbf = ["tbf", "rate", self.rate, "burst", str(_burst_bytes(self.rate)), "latency",
               f"{self.latency_ms:g}ms"]
        _ip("netns", "add", self.switch)
        self._exec(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        self._exec(self.switch, "ip", "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            _ip("netns", "add", ns)
            port = f"p{i}"
            _ip("link", "add", GLOO_IFNAME, "netns", ns, "type", "veth", "peer", "name", port,
                "netns", self.switch)
            self._exec(ns, "ip", "link", "set", "lo", "up")
            self._exec(ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", GLOO_IFNAME)
            self._exec(ns, "ip", "link", "set", GLOO_IFNAME, "up")
            self._exec(ns, "tc", "qdisc", "add", "dev", GLOO_IFNAME, "root", *tbf)
            self._exec(self.switch, "ip", "link", "set", port, "master", "br0")
            self._exec(self.switch, "ip", "link", "set", port, "up")
            self._exec(self.switch, "tc", "qdisc", "add", "dev", port, "root", *tbf)

    def close(self) -> None:
        """Kill every process started in the hosts (whole sessions), delete every namespace.
        Idempotent; never raises for what is already gone."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        existing = set(_namespaces())
        for ns in [*self.hosts, self.switch]:
            if ns in existing:
                _delete(ns)
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    # ---- running commands -------------------------------------------------------------------
    def _exec(self, ns: str, *cmd: str) -> None:
        proc = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True,
                              text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"in namespace {ns}: `{' '.join(cmd)}` failed "
                               f"({proc.returncode}): {proc.stderr.strip()}")

    def popen(self, host: int, cmd: Sequence[str], env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start ``cmd`` in host ``host`` (its own session, so :meth:`close` kills all it
        started). ``env`` is added to this process's environment, with ``GLOO_SOCKET_IFNAME``
        set to the host's interface (gloo would otherwise resolve the machine's hostname,
        which names no address inside the namespace)."""
        if not 0 <= host < self.num_hosts:
            raise ValueError(f"EmulatedHosts.popen: host {host} is not in 0..{self.num_hosts - 1}")
        full_env = dict(os.environ, GLOO_SOCKET_IFNAME=GLOO_IFNAME, **(env or {}))
        p = subprocess.Popen(["ip", "netns", "exec", self.hosts[host], *cmd], env=full_env,
                             start_new_session=True, **kwargs)
        self._procs.append(p)
        return p

    def launch(self, nproc_per_node: int, target: Sequence[str], port: int = 29500,
               env: dict[str, str] | None = None, **kwargs) -> list[subprocess.Popen]:
        """Start ``python -m fcoll.launch`` in every host as node i of ``num_hosts``, with the
        rendezvous on host 0 (``--master-addr`` its address, ``--master-port port``).
        ``target`` is the launcher's target and its arguments (``["train.py", "--lr", "1"]``
        or ``["-m", "pkg.mod"]``)."""
        import sys

        return [self.popen(i, [sys.executable, "-m", "fcoll.launch", "--nnodes",
                               str(self.num_hosts), "--node-rank", str(i), "--master-addr",
                               self.address(0), "--master-port", str(port),
                               "--nproc-per-node", str(nproc_per_node), *target],
                           env=env, **kwargs)
                for i in range(self.num_hosts)]
