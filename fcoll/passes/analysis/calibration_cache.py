"""The calibration's cache file: one JSON file per (backend, group size, host layout), so that
every run on this machine reuses a group shape's sweep instead of timing it again, and so gets
the same cost model, hence the same bucket plan and schedule, in every run.

Only a group's rank 0 reads and writes it (:func:`fcoll.passes.analysis.calibration.calibrate_group`
broadcasts rank 0's numbers), so the ranks never disagree about whether a size is known, and no
file system is assumed shared between hosts.

Where: ``$FCOLL_CALIBRATION_DIR`` (default ``<tempdir>/fcoll-calibration-<uid>``), then one
directory per identity, named by its hash:

- by default, the **machine**'s (:func:`machine_identity`: host name, CPU model, CPU count, torch
  version): the numbers of the first run on this machine serve every later run;
- with ``$FCOLL_JOB_ID``, that **job**'s: its processes share numbers timed for it alone (a job
  that wants its own, say on a machine whose load changed); job directories untouched for a
  day are removed when a new job creates its own.

``FCOLL_RECALIBRATE=1`` times every group again and rewrites its file (``python -m
fcoll.calibrate --refresh`` does it before a job); ``FCOLL_CALIBRATION_CACHE=0`` turns the file
off (every process times its groups, as the test suite does). Safety: the directories are
created with mode 0700 and used only when they are real directories owned by this user and not
readable by others; files are written to a temporary name and renamed (a reader sees the old or
the new file, never half of one); a file that does not parse, whose key differs, or whose numbers
are not finite and positive is ignored with a warning (the group is then timed again and the
file rewritten).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import socket
import stat
import tempfile
import time
from typing import Any

__all__ = ["FORMAT", "STALE_S", "cache_identity", "machine_identity", "refresh_requested",
           "cache_dir", "cache_path", "read_entry", "write_entry"]

log = logging.getLogger(__name__)

#: Version of the file's layout; a file of another version is ignored.
FORMAT = 1


def machine_identity() -> str:
    """What makes numbers of one machine valid on another run of it: host name, CPU model,
    CPU count and torch version (a new torch may time its kernels differently)."""
    import torch

    model = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    return f"machine={socket.gethostname()}|{model}|{os.cpu_count()}|torch {torch.__version__}"


def cache_identity() -> str | None:
    """The identity the cache is kept under: ``FCOLL_JOB_ID=...`` when that is set, else
    :func:`machine_identity`; None when ``FCOLL_CALIBRATION_CACHE=0`` (no file)."""
    if os.environ.get("FCOLL_CALIBRATION_CACHE", "1") == "0":
        return None
    job = os.environ.get("FCOLL_JOB_ID", "").strip()
    return f"FCOLL_JOB_ID={job}" if job else machine_identity()


def refresh_requested() -> bool:
    """``FCOLL_RECALIBRATE=1``: time every group again and rewrite its file."""
    return os.environ.get("FCOLL_RECALIBRATE", "0") not in ("", "0")


def _private_dir(path: str) -> bool:
    """Create ``path`` (mode 0700) if needed; True if it is a directory of ours that others
    cannot read or write (else the cache is not used, with a warning)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        log.warning("calibration cache %s unusable (%s): not cached", path, e)
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        log.warning("calibration cache %s is not a private directory of uid %d (mode %o, "
                    "uid %d): not cached", path, os.getuid(), st.st_mode & 0o7777, st.st_uid)
        return False
    return True


def cache_dir(identity: str | None = None) -> str | None:
    """The cache directory of ``identity`` (default :func:`cache_identity`; created, private):
    ``machine-<hash>`` or ``job-<hash>``; None when the cache is off."""
    identity = identity if identity is not None else cache_identity()
    if identity is None:
        return None
    root = os.environ.get("FCOLL_CALIBRATION_DIR") or os.path.join(
        tempfile.gettempdir(), f"fcoll-calibration-{os.getuid()}")
    kind = "machine" if identity.startswith("machine=") else "job"
    path = os.path.join(root, f"{kind}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}")
    if not _private_dir(root):
        return None
    if not os.path.isdir(path):
        _prune(root)
    return path if _private_dir(path) else None


#: A job directory not written for this long is removed when another job creates its own.
STALE_S = 24 * 3600.0


def _prune(root: str) -> None:
    """Remove job directories of ``root`` (private, ours) untouched for :data:`STALE_S`:
    nothing else would ever delete them. Machine directories stay: they are the default."""
    now = time.time()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        job = os.path.join(root, name)
        if name.startswith("machine-"):
            continue
        try:
            if os.path.islink(job) or not os.path.isdir(job):
                continue
            if now - os.stat(job).st_mtime < STALE_S:
                continue
            for f in os.listdir(job):
                os.unlink(os.path.join(job, f))
            os.rmdir(job)
        except OSError:
            continue   # another process pruning or writing it: leave it


def cache_path(backend: str, group_size: int, layout: str) -> str | None:
    """The file of one (backend, group size, host layout) in the cache directory, or None."""
    d = cache_dir()
    if d is None:
        return None
    digest = hashlib.sha256(layout.encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in backend)
    return os.path.join(d, f"{safe}-{group_size}ranks-{digest}.json")


def _valid(entry: Any, key: dict[str, Any]) -> bool:
    def positive(x: Any) -> bool:
        return isinstance(x, (int, float)) and math.isfinite(x) and x > 0

    if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
        return False
    rates, points = entry.get("compute"), entry.get("points")
    if not (isinstance(rates, list) and len(rates) == 3 and all(map(positive, rates))):
        return False
    return isinstance(points, dict) and all(
        isinstance(k, str) and isinstance(v, list) and
        all(isinstance(p, list) and len(p) == 2 and positive(p[0]) and positive(p[1])
            for p in v) for k, v in points.items())


def read_entry(path: str | None, key: dict[str, Any]) -> dict[str, Any] | None:
    """The cached entry ``{"compute": [3 floats], "points": {kind: [[bytes, us], ...]}}`` at
    ``path`` if it exists and is valid for ``key``; None otherwise (a bad file: warning;
    ``FCOLL_RECALIBRATE=1``: always None, so the group is timed again and the file rewritten)."""
    if path is None or not os.path.exists(path):
        return None
    if refresh_requested():
        log.info("calibration cache %s: FCOLL_RECALIBRATE is set, timing again", path)
        return None
    try:
        with open(path, encoding="utf-8") as f:
            entry = json.load(f)
    except (OSError, ValueError) as e:
        log.warning("calibration cache %s unreadable (%s): timing again", path, e)
        return None
    if not _valid(entry, key):
        log.warning("calibration cache %s does not hold valid numbers for %s: timing again",
                    path, key)
        return None
    return entry


def write_entry(path: str | None, key: dict[str, Any], compute: list[float],
                points: dict[str, list[list[float]]]) -> None:
    """Write (atomically) one entry; failures are logged, never raised (the cache is an
    optimisation)."""
    if path is None:
        return
    entry = {"format": FORMAT, "key": key, "compute": compute, "points": points}
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entry, f)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        log.warning("calibration cache %s not written: %s", path, e)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
