"""Registry of in-flight collectives, keyed by the storage of their output.

An eager collective op returns its output buffer at once and registers the ``Work`` that will
fill it. ``wait_tensor(t)`` looks up ``t``'s storage, waits for every ``Work`` registered on it,
runs the finishers (for example the division of an ``avg`` emulated as ``sum`` on gloo, or the
copy back into a non-contiguous in-place target), and returns ``t``. A view of the output shares
its storage, so waiting on a view waits for the whole collective, as in PyTorch's
``_c10d_functional`` registry.

Keys are ``StorageWeakRef``s: a weak reference keeps the storage's C++ object from being freed and
its address reused while the entry lives, so a new tensor can never match a stale entry.

Every entry is also entered in c10d's own work registry (the one PyTorch's ``_c10d_functional``
ops use), as a :class:`_C10dHandle`, so ``torch.ops._c10d_functional.wait_tensor`` waits for an
fcoll collective too (and, as before, fcoll's wait for a PyTorch one): a program that pairs the
two namespaces by hand gets the result, never the buffer before the collective wrote it. A wait
through either side takes the output out of both registries. It costs an eager collective about
4.5 us (the handle, its registration, c10d's wait that removes it: register + wait 7.4 us
against 2.9 us before, in one process); an output never waited is reported at exit by c10d's
warning, as PyTorch's own funcol outputs are.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.autograd.profiler as _profiler
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["register", "wait", "wait_in_profile", "num_pending"]


@dataclass
class _Pending:
    ref: StorageWeakRef
    works: list = field(default_factory=list)
    finishers: list[Callable[[], None]] = field(default_factory=list)
    in_c10d: bool = False  # a _C10dHandle for it is in c10d's registry


_lock = threading.Lock()
_pending: dict[int, _Pending] = {}
_register_in_c10d = torch._C._distributed_c10d._register_work
_c10d_wait_op = torch.ops._c10d_functional.wait_tensor.default


class _C10dHandle(dist.Work):
    """What c10d's work registry holds for one fcoll entry: PyTorch's ``wait_tensor`` pops it
    and calls :meth:`wait`, which waits for the entry's works and runs its finishers, as fcoll's
    :func:`wait` does. It keeps the storage's key, not the tensor, so it holds no memory."""

    def __init__(self, key: int):
        super().__init__()
        self._key = key

    def wait(self, timeout=None) -> bool:  # noqa: ARG002  the works' own timeouts apply
        with _lock:
            entry = _pending.pop(self._key, None)
        if entry is not None:  # else fcoll's wait took it first
            _finish(entry)
        return True

    def is_completed(self) -> bool:
        with _lock:
            entry = _pending.get(self._key)
        return entry is None or all(w.is_completed() for w in entry.works)


def register(tensor: torch.Tensor, work, finisher: Callable[[], None] | None = None) -> None:
    """Record that ``work`` (a ``torch.distributed.Work`` or None) writes into ``tensor``.

    ``finisher`` runs once, after every work on the storage is done, inside ``wait``.
    """
    ref = StorageWeakRef(tensor.untyped_storage())
    with _lock:
        entry = _pending.get(ref.cdata)
        new = entry is None or entry.ref.expired()
        if new:
            entry = _pending[ref.cdata] = _Pending(ref)
        if work is not None:
            entry.works.append(work)
        if finisher is not None:
            entry.finishers.append(finisher)
    if new:
        try:
            _register_in_c10d(tensor, _C10dHandle(ref.cdata))
            entry.in_c10d = True
        except RuntimeError:  # a c10d collective in flight on this storage already
            pass              # (allow_inflight_collective_as_graph_input_ctx): ours waits both


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
    _finish(entry)
    if entry.in_c10d:
        _c10d_wait(tensor)  # takes the handle out of c10d's registry; its wait finds nothing
    return tensor


def _finish(entry: _Pending) -> None:
    for work in entry.works:
        work.wait()
    for finish in entry.finishers:
        finish()


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
    """c10d's wait for ``tensor``, below autograd: PyTorch's funcol gives the op a Python
    autograd formula (4 us a call) that an identity wait whose result is dropped does not need."""
    with torch._C._AutoDispatchBelowADInplaceOrView():
        _c10d_wait_op(tensor)
    return tensor


def num_pending() -> int:
    """Number of storages with a collective still registered (expired entries excluded)."""
    with _lock:
        for key in [k for k, e in _pending.items() if e.ref.expired()]:
            del _pending[key]
        return len(_pending)
