"""Registry of in-flight collectives, keyed by the storage of their output.

An eager collective op returns its output buffer at once and registers the ``Work`` that will
fill it. ``wait_tensor(t)`` looks up ``t``'s storage, waits for every ``Work`` registered on it,
runs the finishers (for example the division of an ``avg`` emulated as ``sum`` on gloo, or the
copy back into a non-contiguous in-place target), and returns ``t``. A view of the output shares
its storage, so waiting on a view waits for the whole collective, as in PyTorch's
``_c10d_functional`` registry.

Keys are ``StorageWeakRef``s: a weak reference keeps the storage's C++ object from being freed and
its address reused while the entry lives, so a new tensor can never match a stale entry.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.autograd.profiler as _profiler
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["register", "wait", "wait_in_profile", "num_pending"]


@dataclass
class _Pending:
    ref: StorageWeakRef
    works: list = field(default_factory=list)
    finishers: list[Callable[[], None]] = field(default_factory=list)


_lock = threading.Lock()
_pending: dict[int, _Pending] = {}


def register(tensor: torch.Tensor, work, finisher: Callable[[], None] | None = None) -> None:
    """Record that ``work`` (a ``torch.distributed.Work`` or None) writes into ``tensor``.

    ``finisher`` runs once, after every work on the storage is done, inside ``wait``.
    """
    ref = StorageWeakRef(tensor.untyped_storage())
    with _lock:
        entry = _pending.get(ref.cdata)
        if entry is None or entry.ref.expired():
            entry = _pending[ref.cdata] = _Pending(ref)
        if work is not None:
            entry.works.append(work)
        if finisher is not None:
            entry.finishers.append(finisher)


def wait(tensor: torch.Tensor) -> torch.Tensor:
    """Block until every collective writing into ``tensor``'s storage is done; return ``tensor``.

    A tensor with nothing in flight in fcoll's registry is waited for in c10d's (a collective
    started with ``async_op=True`` under ``allow_inflight_collective_as_graph_input_ctx``, or a
    ``_c10d_functional`` op's output), which returns it as it is when nothing is in flight there.

    Raises:
        Whatever the backend's ``Work.wait()`` raises (a peer died, a timeout, a mismatch).
    """
    if tensor.device.type == "meta":
        return tensor
    if not _pending:
        return _c10d_wait(tensor)
    key = StorageWeakRef(tensor.untyped_storage()).cdata
    with _lock:
        entry = _pending.pop(key, None)
    if entry is None:
        return _c10d_wait(tensor)
    for work in entry.works:
        work.wait()
    for finish in entry.finishers:
        finish()
    return tensor


def wait_in_profile(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`wait`, shown by ``torch.profiler`` as a ``fcoll::wait_tensor`` range.

    fcoll's executor waits with this instead of the op (whose kernel copies): without the range
    a profile would not show where a step waits, as it shows PyTorch's own ``wait_tensor``. With
    no profiler running it costs one attribute read more than :func:`wait`.
    """
    if _profiler._is_profiler_enabled:
        with torch.profiler.record_function("fcoll::wait_tensor"):
            return wait(tensor)
    return wait(tensor)


def _c10d_wait(tensor: torch.Tensor) -> torch.Tensor:
    torch.ops._c10d_functional.wait_tensor.default(tensor)
    return tensor


def num_pending() -> int:
    """Number of storages with a collective still registered (expired entries excluded)."""
    with _lock:
        for key in [k for k, e in _pending.items() if e.ref.expired()]:
            del _pending[key]
        return len(_pending)
