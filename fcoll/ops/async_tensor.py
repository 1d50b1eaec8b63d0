"""``AsyncCollectiveTensor``: an eager collective's result that waits on first real use.

Mirrors ``torch.distributed._functional_collectives.AsyncCollectiveTensor``: a wrapper subclass
around the collective's output buffer. View ops (``view``, slicing, ``transpose``, ...) run on the
buffer without waiting and return another ``AsyncCollectiveTensor``; any other op, a custom op
included, first calls ``fcoll.wait_tensor`` on every wrapped input. ``tolist()``, ``numpy()``,
``repr()`` and dtype or device casts (``aten._to_copy``) wait too.

It is a subclass of PyTorch's ``AsyncCollectiveTensor``, so every place in torch that recognises
an un-waited funcol result by ``isinstance`` treats fcoll's results alike: AOTAutograd waits for
one passed into a compiled function before tracing and at each call (torch 2.13's
``frontend_utils``; without that a view of it returned from the compiled function made autograd
expect an ``AsyncCollectiveTensor`` tangent and fail in backward), and DTensor, FSDP2, the state
dict utilities and ``LocalTensorMode`` call ``.wait()`` on it. Only the waiting is fcoll's own.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed._functional_collectives as _funcol
from torch._dynamo.external_utils import is_compiling as _dynamo_is_compiling
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._pytree import tree_map_only

from fcoll.ops import pending

__all__ = ["AsyncCollectiveTensor", "TorchACT", "complete", "is_tracing", "wrap_async"]


def is_tracing() -> bool:
    """True under Dynamo, fake mode, the Python dispatcher, or make_fx (as PyTorch decides)."""
    if _dynamo_is_compiling():
        return True
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return True
    if torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher):
        return True
    return get_proxy_mode() is not None


def complete(tensor: torch.Tensor) -> torch.Tensor:
    """Wait for the collective writing ``tensor`` and return its values.

    While tracing this is ``torch.ops.fcoll.wait_tensor``, so the graph records the wait. Eagerly
    it is :func:`fcoll.ops.pending.wait`, which returns ``tensor`` itself: the op's kernel would
    return a copy (a custom op may not alias its input), which eager callers do not need.
    """
    if is_tracing():
        return torch.ops.fcoll.wait_tensor(tensor)
    return pending.wait(tensor)


@functools.lru_cache(maxsize=None)
def _is_view_op(func) -> bool:
    """Whether ``func`` may run on the un-waited buffer: its first argument is a non-mutable
    alias (a view op), and it has no ``CompositeImplicitAutograd`` kernel.

    The second condition is PyTorch's fix for pytorch#133421: a composite op such as
    ``aten.to.dtype`` declares ``Tensor(a)`` on its input (it *may* return it), yet decomposes
    into ``_to_copy``, which reads the data. Under ``inference_mode`` the decomposition happens
    below this subclass, so treating it as a view read the buffer before the collective was done.
    """
    if not isinstance(func, torch._ops.OpOverload):
        return False
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(),
                                                      torch.DispatchKey.CompositeImplicitAutograd):
        return False
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and not args[0].alias_info.is_write


#: PyTorch's class, the base of fcoll's: ``isinstance(t, TorchACT)`` holds for both.
TorchACT = _funcol.AsyncCollectiveTensor


class AsyncCollectiveTensor(TorchACT):
    """A tensor whose values arrive when the collective that produces them completes.

    Attributes (PyTorch's ``__slots__``):
        elem: the collective's output buffer (same shape, dtype, strides).
        completed: True once ``wait_tensor`` has run on it.
    """

    __slots__ = ()

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, layout=elem.layout, device=elem.device,
            requires_grad=elem.requires_grad,
        )
        r.elem = elem
        r.completed = False
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return AsyncCollectiveTensor(inner_tensors["elem"])

    def __coerce_same_metadata_as_tangent__(self, expected_metadata: Any,
                                            expected_type: type | None = None):
        if expected_type is not torch.Tensor:
            return None
        return self.trigger_wait()

    def trigger_wait(self) -> torch.Tensor:
        """Wait for the collective (once) and return the plain output tensor."""
        if not self.completed:
            out = complete(self.elem)
            self.completed = True
            return out
        return self.elem

    def wait(self) -> torch.Tensor:
        """Wait for the collective and return the plain output tensor."""
        return self.trigger_wait()

    def tolist(self):
        return self.trigger_wait().tolist()

    def numpy(self, *args, **kwargs):  # type: ignore[override]
        return self.trigger_wait().numpy(*args, **kwargs)

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return f"AsyncCollectiveTensor({self.trigger_wait()})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is torch.ops.aten.view.default:
            return AsyncCollectiveTensor(func(args[0].elem, args[1]))
        is_view = _is_view_op(func)

        def unwrap(e: TorchACT) -> torch.Tensor:   # PyTorch's among the arguments too
            return e.elem if is_view else e.trigger_wait()

        out = func(*tree_map_only(TorchACT, unwrap, args),
                   **tree_map_only(TorchACT, unwrap, kwargs or {}))
        if is_view:
            out = tree_map_only(torch.Tensor, AsyncCollectiveTensor, out)
        return out


@torch.library.custom_op("fcoll::_wrap_async", mutates_args=(), schema="(Tensor input) -> Tensor")
def _wrap_async(input: torch.Tensor) -> torch.Tensor:
    """Wrap an output in ``AsyncCollectiveTensor`` as an op, so autograd flows through it."""
    return AsyncCollectiveTensor(input)


@_wrap_async.register_fake
def _(input: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(input)


def _wrap_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    return grad


def _wrap_setup(ctx, inputs, output) -> None:
    return None


_wrap_async.register_autograd(_wrap_backward, setup_context=_wrap_setup)


def wrap_async(t: torch.Tensor) -> torch.Tensor:
    """Return ``t`` wrapped so that it waits on first non-view use (eager mode only)."""
    return _wrap_async(t)
