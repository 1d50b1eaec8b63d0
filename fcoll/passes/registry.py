"""Pass registry and pipeline.

Every fcoll pass is a ``torch.fx.passes.infra.pass_base.PassBase`` subclass registered by name
with :func:`register_pass`. :func:`run_pipeline` runs a list of names in order on one graph,
records in ``gm.meta["fcoll_passes"]`` which pass ran, whether it modified the graph and how long
it took (seconds), and names the failing pass when one raises.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import Callable, ClassVar, Sequence, TypeVar

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fcoll.passes.graph import META_PASSES, check_topological
from fcoll.passes.config import FcollConfig

__all__ = ["FcollPass", "register_pass", "get_pass", "registered_passes", "run_pipeline",
           "PassFailed"]

log = logging.getLogger(__name__)


class PassFailed(RuntimeError):
    """A pass raised; the message names the pass and the graph."""


class FcollPass(PassBase):
    """Base of fcoll passes: ``GraphModule -> PassResult(gm, modified)``.

    Subclasses set ``name`` and implement ``call``. ``ensures`` checks the graph after the pass
    (:func:`~fcoll.passes.graph.check_topological`), so a pass that breaks topological order or
    leaves a dangling node fails loudly, by name.
    """

    name: ClassVar[str] = ""

    def __init__(self, config: FcollConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else FcollConfig()
        #: Set by :func:`run_pipeline` to one dict shared by the passes of the run: compute
        #: estimates per node (see :func:`fcoll.passes.analysis.calibration.model_for`). None: no
        #: sharing.
        self.estimates: dict | None = None

    def call(self, graph_module: fx.GraphModule) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def ensures(self, graph_module: fx.GraphModule) -> None:
        check_topological(graph_module.graph)


_REGISTRY: dict[str, type[FcollPass]] = {}
P = TypeVar("P", bound=type[FcollPass])


def register_pass(cls: P) -> P:
    """Class decorator: register ``cls`` under ``cls.name``.

    Raises:
        ValueError: the name is empty or already registered by another class.
    """
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no pass name")
    if _REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"pass name {cls.name!r} is already registered by "
                         f"{_REGISTRY[cls.name].__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def registered_passes() -> list[str]:
    """Names of every registered pass, sorted."""
    _load_builtin_passes()
    return sorted(_REGISTRY)


def get_pass(name: str, config: FcollConfig | None = None) -> FcollPass:
    """Instantiate the pass registered as ``name``.

    Raises:
        ValueError: no pass of that name (the message lists the registered ones).
    """
    _load_builtin_passes()
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown fcoll pass {name!r}; registered passes: "
                         f"{sorted(_REGISTRY)}") from None
    return cls(config)


def run_pipeline(gm: fx.GraphModule, config: FcollConfig | None = None,
                 names: Sequence[str] | None = None,
                 on_pass: Callable[[str, fx.GraphModule], None] | None = None) -> fx.GraphModule:
    """Run the passes ``names`` (default: ``config.pipeline``) in order on ``gm``.

    Args:
        gm: the graph; passes may rewrite it in place or return a new module.
        config: options for every pass.
        names: pass names, in order.
        on_pass: called after each pass with its name and the resulting graph (inspection).

    Returns:
        The rewritten graph module; ``gm.meta["fcoll_passes"]`` lists what ran.

    Raises:
        ValueError: an unknown pass name.
        PassFailed: a pass raised (the original error is chained).
    """
    config = config if config is not None else FcollConfig()
    names = tuple(names if names is not None else config.pipeline)
    passes = [get_pass(n, config) for n in names]
    estimates: dict = {}   # lives for this run only (it holds nodes)
    for p in passes:
        p.estimates = estimates
    gm = _lazy(gm)
    records = list(gm.meta.get(META_PASSES, []))
    with gc_paused():
        gm = _run_passes(gm, passes, records, on_pass)
    gm.meta[META_PASSES] = records
    return gm


@contextlib.contextmanager
def gc_paused():
    """Pause Python's cyclic GC while passes run (or one pass plans), then restore its state.

    Passes allocate tens of thousands of FX nodes on large graphs, and each automatic GC
    generation sweep scans the whole heap: measured here as a large, erratic share of the time
    of a 50k-node pipeline. Garbage made meanwhile (FX nodes form reference cycles) is collected
    by the first GC run after the pipeline.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _run_passes(gm: fx.GraphModule, passes: list[FcollPass], records: list[dict],
                on_pass: Callable[[str, fx.GraphModule], None] | None) -> fx.GraphModule:
    for p in passes:
        t0 = time.perf_counter()
        try:
            result = p(gm)
        except Exception as e:
            raise PassFailed(f"fcoll pass {p.name!r} failed: {type(e).__name__}: {e}") from e
        if result is None:
            raise PassFailed(f"fcoll pass {p.name!r} returned None instead of a PassResult")
        seconds = time.perf_counter() - t0
        gm = result.graph_module
        records.append({"pass": p.name, "modified": bool(result.modified), "seconds": seconds})
        log.debug("pass %s: modified=%s in %.1f ms", p.name, result.modified, seconds * 1e3)
        if on_pass is not None:
            on_pass(p.name, gm)
    return gm


def _lazy(gm: fx.GraphModule) -> fx.GraphModule:
    """The same graph in a module whose ``recompile()`` only marks the code stale.

    Every pass ends with ``recompile()``; on a 50k-node graph each real code generation costs
    seconds, so the pipeline generates code once, when the module is first called or printed
    (PyTorch's ``_LazyGraphModule``, as Inductor uses it for the same reason).
    """
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if isinstance(gm, _LazyGraphModule):
        return gm
    lazy = _LazyGraphModule(gm, gm.graph, class_name=type(gm).__name__)
    lazy.meta.update(gm.meta)
    return lazy


def _load_builtin_passes() -> None:
    """Import the modules that define the built-in passes (they register on import)."""
    import importlib

    for module in ("lower", "overlap", "bucketing", "consistency"):
        importlib.import_module(f"fcoll.passes.rewrites.{module}")
