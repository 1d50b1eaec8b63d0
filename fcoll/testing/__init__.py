"""Multi-process test harness: run a function on N local ranks with a hard timeout.

``run_ranks(fn, world_size, backend="fcoll")`` starts ``world_size`` fresh Python processes
(``spawn``), initialises a process group of ``backend`` in each one over a ``FileStore``, calls
``fn(rank, world_size, *args)``, and returns the per-rank results in rank order. A rank that
raises makes the whole call raise :class:`RankFailure` with every failing rank's traceback; a run
that exceeds ``timeout_s`` kills every rank and raises :class:`TimeoutError`. Either way no rank
outlives the call, and the caller can check :func:`fcoll_segments` for leaked shared memory.

Process start-up (import torch, init the group) costs about 2-3 s per rank on the 2-core CI
machine, so tests batch many checks into one ``run_ranks`` call.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator, Sequence

__all__ = ["RankFailure", "run_ranks", "fcoll_segments", "one_rank_group", "slow_collectives",
           "SHM_DIR", "SEGMENT_PREFIX"]

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "fcoll-"


class RankFailure(RuntimeError):
    """One or more ranks raised; ``failures`` maps rank -> formatted traceback."""

    def __init__(self, failures: dict[int, str]):
        self.failures = dict(sorted(failures.items()))
        lines = [f"{len(failures)} rank(s) failed:"]
        for rank, tb in self.failures.items():
            lines.append(f"--- rank {rank} ---\n{tb}")
        super().__init__("\n".join(lines))


def fcoll_segments() -> list[str]:
    """Names of fcoll shared-memory segments currently in ``/dev/shm``."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(SEGMENT_PREFIX))
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def one_rank_group(backend: Any) -> Iterator[Any]:
    """In this process, a one-rank default group (gloo on a ``HashStore``) and a group of that
    one rank whose backend is ``backend`` (a Python ``torch.distributed.ProcessGroup``
    subclass instance, registered under its ``group_name``); yields that group. Any process
    group already initialised here is destroyed first, and both are destroyed on exit."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.Backend.register_backend(backend.group_name, lambda *args: backend,
                                      devices=["cpu"])
        yield dist.new_group(ranks=[0], backend=backend.group_name)
    finally:
        dist.destroy_process_group()


def _dumps(obj: Any) -> bytes:
    """Serialise with torch.save: tensors travel by value, not as shared-memory handles that
    die with the rank that made them."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


@contextlib.contextmanager
def _environ(updates: dict[str, str]):
    """``os.environ`` with ``updates`` applied inside the block, restored after it."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    backend: str | None,
    store_path: str,
    pg_timeout_s: float,
    args: Sequence[Any],
    env: dict[str, str],
    results: "mp.Queue[tuple[int, bool, Any]]",
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=env.get("LOCAL_RANK", str(rank)),
        LOCAL_WORLD_SIZE=env.get("LOCAL_WORLD_SIZE", str(world_size)),
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        import fcoll  # noqa: F401  registers the "fcoll" backend

        if backend is not None:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
            )
        try:
            out = fn(rank, world_size, *args)
        finally:
            if backend is not None and dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, True, _dumps(out)))
    except BaseException:  # noqa: BLE001  report everything, including SystemExit
        results.put((rank, False, traceback.format_exc()))


#: Seconds :func:`run_ranks` lets the other ranks run once one has failed (without
#: ``allow_failures``), before killing them.
PEER_GRACE_S = 10.0


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str | None = "fcoll",
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    pg_timeout_s: float = 30.0,
    env: dict[str, str] | None = None,
    allow_failures: bool = False,
    hosts: Sequence[Any] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    Args:
        fn: a module-level (picklable) function; its return value must be picklable.
        world_size: number of ranks, 1 to 8.
        backend: process-group backend to initialise before ``fn`` ("fcoll", "gloo"), or None
            to call ``fn`` with no process group.
        args: extra positional arguments for ``fn``.
        timeout_s: hard wall-clock limit for the whole run, in seconds.
        pg_timeout_s: the ``timeout`` given to ``init_process_group``, in seconds.
        env: extra environment variables for the ranks, set before each rank's interpreter
            starts (so what is read at start-up, ``LD_PRELOAD`` or malloc tunables, applies).
        allow_failures: if True, failing ranks do not raise; their slot in the result holds a
            :class:`RankFailure` for that rank instead.
        hosts: the emulated host of each rank (``hosts[r]``, any str or int): rank r runs with
            ``FCOLL_HOST_ID`` set from it (see :mod:`fcoll.shm.multihost.host_layout`), and ``LOCAL_RANK`` /
            ``LOCAL_WORLD_SIZE`` of its host, so ranks with different hosts form a
            hierarchical group without network namespaces. None: one host.

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        RankFailure: a rank raised (and ``allow_failures`` is False); ranks still running
            :data:`PEER_GRACE_S` seconds after the first failure are killed and reported
            with it.
        TimeoutError: the run exceeded ``timeout_s``; every rank was killed.
        ValueError: ``hosts`` does not name one host per rank.
    """
    rank_envs = [dict(env or {}) for _ in range(world_size)]
    if hosts is not None:
        if len(hosts) != world_size:
            raise ValueError(f"run_ranks: hosts names {len(hosts)} hosts for world_size "
                             f"{world_size} ranks (one per rank needed)")
        for r, h in enumerate(hosts):
            same = [q for q in range(world_size) if hosts[q] == h]
            rank_envs[r].update(FCOLL_HOST_ID=f"run_ranks-host-{h}",
                                LOCAL_RANK=str(same.index(r)), LOCAL_WORLD_SIZE=str(len(same)))
    ctx = mp.get_context("spawn")
    results: "mp.Queue[tuple[int, bool, Any]]" = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fcoll-test-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, r, world_size, backend, store_path, pg_timeout_s, tuple(args),
                      rank_envs[r], results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p, rank_env in zip(procs, rank_envs):
            with _environ(rank_env):  # a spawned child copies os.environ at start
                p.start()
        deadline = time.monotonic() + timeout_s
        got: dict[int, tuple[bool, Any]] = {}
        failed_first: int | None = None
        try:
            while len(got) < world_size:
                failed = [r for r, (ok, _) in got.items() if not ok]
                if failed and failed_first is None and not allow_failures:
                    # the run fails whatever the others do: let them report (a peer's own
                    # error often says more), then stop them instead of waiting for a rank
                    # blocked on the failed one until timeout_s
                    failed_first = failed[0]
                    deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
                remaining = deadline - time.monotonic()
                if remaining <= 0 and failed_first is not None:
                    for r in sorted(set(range(world_size)) - set(got)):
                        got[r] = (False, f"rank {r} was still running {PEER_GRACE_S:.0f} s "
                                         f"after rank {failed_first} failed; killed")
                    break
                if remaining <= 0:
                    raise TimeoutError(
                        f"run_ranks({getattr(fn, '__name__', fn)}, world_size={world_size}) "
                        f"exceeded {timeout_s:.0f} s; ranks still running: "
                        f"{sorted(set(range(world_size)) - set(got))}"
                    )
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 0.2))
                    got[rank] = (ok, value)
                except queue.Empty:
                    for r, p in enumerate(procs):
                        if r not in got and p.exitcode is not None:
                            # Died without reporting (killed, segfault): drain once more.
                            try:
                                rank, ok, value = results.get(timeout=0.5)
                                got[rank] = (ok, value)
                            except queue.Empty:
                                got[r] = (False, f"rank {r} exited with code {p.exitcode} "
                                                 "without reporting a result")
        finally:
            for p in procs:
                p.join(timeout=5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            results.close()
    failures = {r: v for r, (ok, v) in got.items() if not ok}
    if failures and not allow_failures:
        raise RankFailure(failures)
    return [_loads(got[r][1]) if got[r][0] else RankFailure({r: got[r][1]})
            for r in range(world_size)]


def slow_collectives(delay_s: float) -> None:
    """Make fcoll's engine worker sleep ``delay_s`` seconds before every collective it runs, in
    this process only (call it in a rank): a collective then completes long after its op
    returned, which is how tests and ``benchmarks/compile_stress.py`` make a read of a
    collective's input or output that races its completion show up on demand. Collectives run
    on the caller's thread are not delayed."""
    import threading
    import time

    from fcoll.shm import engine

    execute = engine.Engine._execute

    def slow(self, job):
        if threading.current_thread() is self._thread:
            time.sleep(delay_s)
        return execute(self, job)
    engine.Engine._execute = slow
