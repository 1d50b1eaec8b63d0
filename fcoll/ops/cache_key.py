"""Keep PyTorch's on-disk compile caches from serving one version of fcoll's ops to another.

PyTorch's FX-graph and AOTAutograd caches key a graph by its code (fcoll's ops by name), example
inputs, configs and torch's version, not by what fcoll's ops mean: their schemas, fake kernels and
autograd formulas. An artifact compiled by another checkout or version of fcoll sharing the cache
directory is run as is (issue 28: a checkout whose all_reduce backward skipped the collective
compiled a step; this one, on the same ``/tmp/torchinductor_$USER``, then gave a gradient off by
4.73 on both ranks, under ``backend="inductor"``). Nothing of a custom op but its name enters those
keys on torch 2.11-2.13; the one knob is process-wide, ``torch.compiler.config.cache_key_tag``.

So each cache directory keeps a registry of the fcoll source digests that compiled in it
(``fcoll-sources.txt``, updated under a file lock). The first digest registered there leaves the
tag alone: one version of fcoll per cache directory, the usual case, changes nothing, and its
entries stay shared with processes that never import fcoll. A process whose digest is not the
only one registered appends ``fcoll-<digest>`` to the tag (after the user's own tag, if any), so it
reads and writes only entries of its own version; untagged entries are then always the first
digest's. A digest is registered before any compile of its process, so two versions starting at
once are ordered by the lock.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
from pathlib import Path

__all__ = ["source_digest", "REGISTRY_NAME", "register", "tag_for", "guard_compile_caches",
           "key_caches_per_rank"]

log = logging.getLogger(__name__)

#: The registry file in the compile cache directory: one fcoll source digest per line.
REGISTRY_NAME = "fcoll-sources.txt"

_PACKAGE = Path(__file__).resolve().parent.parent


def source_digest(package: Path = _PACKAGE) -> str:
    """16 hex digits of SHA-256 over every ``*.py`` file of the fcoll package at ``package``
    (relative path and contents, in sorted order): the same on every rank of a job and for every
    process of one checkout or installed version; any edit changes it.

    Raises:
        OSError: a source file cannot be read.
    """
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def tag_for(user_tag: str, digest: str) -> str:
    """The cache key tag of a process of fcoll ``digest`` that must not share entries: the
    user's ``user_tag`` (kept as the prefix), then ``fcoll-<digest>``."""
    return _appended(user_tag, f"fcoll-{digest}")


def _appended(tag: str, part: str) -> str:
    """``tag`` with ``part`` after it (``"+"`` between), or ``part`` alone for an empty tag."""
    return part if not tag else f"{tag}+{part}"


def register(cache_dir: str | os.PathLike, digest: str) -> bool:
    """Add ``digest`` to ``cache_dir``'s registry (under an exclusive ``flock``); returns whether
    it is the only digest registered there, i.e. whether this process may use untagged entries.

    Raises:
        OSError: the directory or its registry cannot be created, locked, read or written.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache_dir / REGISTRY_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o644)
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        known = [line.strip() for line in f.read().splitlines() if line.strip()]
        if digest not in known:
            f.seek(0, os.SEEK_END)
            f.write(digest + "\n")
            f.flush()
            known.append(digest)
    return known == [digest]


@functools.cache
def guard_compile_caches() -> str | None:
    """Register this fcoll's digest in PyTorch's compile cache directory and tag the caches'
    keys where another fcoll version compiled there (module docstring); once per process.
    Returns the tag set, or None when the tag was left as it was (the only version, or the
    caches are off, or the directory cannot be used: then a DEBUG log says why, and nothing
    else changes)."""
    import torch.compiler.config as cconfig
    from torch._inductor import config as inductor_config
    from torch._functorch import config as functorch_config
    if not (inductor_config.fx_graph_cache or functorch_config.enable_autograd_cache):
        return None
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        digest = source_digest()
        if register(cache_dir(), digest):
            return None
    except OSError as e:
        log.debug("fcoll: compile cache registry not used (%s); cache keys unchanged", e)
        return None
    tag = tag_for(cconfig.cache_key_tag, digest)
    cconfig.cache_key_tag = tag
    log.info("fcoll: another fcoll version compiled in %s; this process's compile cache keys "
             "carry %r", cache_dir(), tag)
    return tag


def key_caches_per_rank(rank: int) -> str:
    """Key PyTorch's compile caches per rank in this process: append ``rank<rank>`` to
    ``torch.compiler.config.cache_key_tag`` (once; the user's tag and the version tag of
    :func:`guard_compile_caches` are kept before it). Returns the tag now in force.

    For programs whose ranks compile the same Dynamo graph from inputs that differ where the
    caches' keys do not look: a DTensor enters the AOTAutograd cache key by its spec (mesh,
    placements, global shape), not by its local shape, so with uneven shards (a dim that does
    not divide by the mesh size) two ranks whose local shapes differ compute one key, and a
    rank whose compile comes second loads the other's artifact: on torch 2.13 a SimpleFSDP
    model with an odd ``d_model`` compiled with ``backend="inductor"`` failed on a warm cache
    in its ``no_grad`` forward with ``assert_size_stride ... expected size 17==16`` (a shape
    check caught it; PyTorch's cache key is the bug). With the rank in the key every rank
    reads and writes only its own entries; results never depend on the tag.
    """
    import torch.compiler.config as cconfig

    own = f"rank{rank}"
    tag = cconfig.cache_key_tag
    if own not in tag.split("+"):
        cconfig.cache_key_tag = _appended(tag, own)
        log.info("fcoll: compile cache keys carry %r (ranks' inputs differ where PyTorch's "
                 "cache keys do not look)", cconfig.cache_key_tag)
    return cconfig.cache_key_tag
