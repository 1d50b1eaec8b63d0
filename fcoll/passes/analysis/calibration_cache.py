"""The calibration's per-job cache file: one JSON file per (backend, group size, host layout),
so that the processes of one job (a restarted rank, a second compile in a fresh process, an
evaluation run launched under the same job) reuse a sweep instead of timing it again.

Only a group's rank 0 reads and writes it (:func:`fcoll.passes.analysis.calibration.calibrate_group`
broadcasts rank 0's numbers), so the ranks never disagree about whether a size is known, and no
file system is assumed shared between hosts.

Where: ``$FCOLL_CALIBRATION_DIR`` (default ``<tempdir>/fcoll-calibration-<uid>``), then one
directory per job, named by a hash of the job's identity: ``$FCOLL_JOB_ID``, else torchrun's
(and ``fcoll.launch``'s) ``$TORCHELASTIC_RUN_ID`` unless it is ``none``. Without a job identity
nothing is read or written: numbers from an unrelated earlier job on a then-quieter (or busier)
machine are not "safe" to reuse. ``FCOLL_CALIBRATION_CACHE=0`` turns the file off.

Job directories untouched for a day are removed when a new job creates its own (every
``fcoll.launch`` is a new job). Safety: the directories are created with mode 0700 and used only when they are real
directories owned by this user and not readable by others; files are written to a temporary
name and renamed (a reader sees the old or the new file, never half of one); a file that does
not parse, whose key differs, or whose numbers are not finite and positive is ignored with a
warning (the group is then timed again and the file rewritten).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import stat
import tempfile
import time
from typing import Any

__all__ = ["FORMAT", "STALE_S", "job_id", "cache_dir", "cache_path", "read_entry", "write_entry"]

log = logging.getLogger(__name__)

#: Version of the file's layout; a file of another version is ignored.
FORMAT = 1


def job_id() -> str | None:
    """The job's identity, or None when there is none (then nothing is cached in files)."""
    if os.environ.get("FCOLL_CALIBRATION_CACHE", "1") == "0":
        return None
    for var in ("FCOLL_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(var, "").strip()
        if value and value.lower() != "none":
            return f"{var}={value}"
    return None


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


def cache_dir(job: str | None = None) -> str | None:
    """This job's cache directory (created, private), or None without a job identity."""
    job = job if job is not None else job_id()
    if job is None:
        return None
    root = os.environ.get("FCOLL_CALIBRATION_DIR") or os.path.join(
        tempfile.gettempdir(), f"fcoll-calibration-{os.getuid()}")
    path = os.path.join(root, hashlib.sha256(job.encode()).hexdigest()[:16])
    if not _private_dir(root):
        return None
    if not os.path.isdir(path):
        _prune(root)
    return path if _private_dir(path) else None


#: A job directory not written for this long is removed when another job creates its own.
STALE_S = 24 * 3600.0


def _prune(root: str) -> None:
    """Remove job directories of ``root`` (private, ours) untouched for :data:`STALE_S`: every
    ``fcoll.launch`` is a new job, and nothing else would ever delete them."""
    now = time.time()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        job = os.path.join(root, name)
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
    """The file of one (backend, group size, host layout) in this job's directory, or None."""
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
    ``path`` if it exists and is valid for ``key``; None otherwise (a bad file: warning)."""
    if path is None or not os.path.exists(path):
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
