"""The ``torch.compile(fn, backend="fcoll", options={...})`` backend.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so no
``import fcoll`` is needed; importing this module also names it in Dynamo's registry, for a
source checkout on ``PYTHONPATH`` that has no entry point (:func:`_name_in_dynamo_registry`).
Flow of one Dynamo graph::

    Dynamo graph ──AOTAutograd──> forward + backward graphs (or one inference graph), aten IR
      each graph: deep copy "before" ─> fcoll pass pipeline ─> compile listeners ─> executor

The executor is :class:`fcoll.compile.executor.GraphExecutor` (``compute="eager"``) or
:class:`fcoll.compile.inductor_compute.InductorExecutor` (``compute="inductor"``).

Partitioning: collectives are never recomputed in backward. PyTorch's partitioners mark every
``_c10d_functional`` node ``CheckpointPolicy.MUST_SAVE`` (``force_save_collectives``); fcoll
marks its own ops the same way before calling them (:func:`_save_collectives`). What a
selective checkpoint tags ``MUST_RECOMPUTE`` (``fcoll.parallel.fully_shard``'s gathers) is
recomputed together with its views (:func:`_recompute_views_of_recomputed`): otherwise the
partitioner saves ``t(weight)`` of ``F.linear``, a full-size alias of the gathered parameter, and
resharding after the forward frees nothing. What the cut saves and recomputes is recorded in both
graphs' ``meta`` (:mod:`fcoll.compile.saved`), for ``fcoll.inspect``. On torch 2.13 a random op
recomputed in a checkpointed region puts a saved ``DeviceMesh`` among the saved tensors, which
fails under PyTorch's own backends; fcoll's cut puts it back where the runtime reads it
(:func:`_saved_opaque_after_tensors`), so FSDP with activation checkpointing compiles.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.hooks import RemovableHandle

from fcoll.compile.executor import GraphExecutor
from fcoll.compile.inductor_compute import InductorExecutor
from fcoll.compile.saved import record_partition
from fcoll.compile.trace import recorder_for, trace_dir_from
from fcoll.ops.remaps import FCOLL_BACKEND_ATTR
from fcoll.passes.config import FcollConfig
from fcoll.passes.graph import is_fcoll_op
from fcoll.passes.registry import run_pipeline

__all__ = ["fcoll_backend", "CompiledGraph", "register_compile_listener", "compile_graph",
           "META_PIPELINE_SECONDS", "META_COMPILE_SECONDS"]

log = logging.getLogger(__name__)

#: graph_module.meta key: seconds spent in fcoll's pass pipeline on this graph.
META_PIPELINE_SECONDS = "fcoll_pipeline_seconds"
#: graph_module.meta key: seconds of each phase of :func:`compile_graph` on this graph
#: (``pipeline``, ``listeners``, ``executor``), for ``benchmarks/compile_time.py``.
META_COMPILE_SECONDS = "fcoll_compile_seconds"


@dataclass(frozen=True)
class CompiledGraph:
    """What a compile listener receives for every graph fcoll compiles.

    Attributes:
        name: "graph_{i}_forward", "graph_{i}_backward" or "graph_{i}_inference", or
            "graph_{i}_compiled_autograd" for the backward graph that compiled autograd
            (``torch._dynamo.compiled_autograd``) hands to the backend, where ``i`` counts the
            Dynamo graphs this process compiled with fcoll.
        before: a deep copy of the AOTAutograd graph, before fcoll's passes.
        after: the graph fcoll executes (after the passes); do not modify it.
        config: the options.
        rank: this process's global rank (0 without a process group).
    """

    name: str
    before: fx.GraphModule
    after: fx.GraphModule
    config: FcollConfig
    rank: int


class _Listener(NamedTuple):
    fn: Callable[[CompiledGraph], None]
    enabled: Callable[[], bool] | None


_listeners: "OrderedDict[int, _Listener]" = OrderedDict()
_graph_ids = itertools.count()


def register_compile_listener(fn: Callable[[CompiledGraph], None], *,
                              enabled: Callable[[], bool] | None = None) -> RemovableHandle:
    """Call ``fn(record)`` for every graph fcoll compiles from now on, in this process.

    This is how layers above compile hear of graphs: ``fcoll.inspect`` registers its tlparse
    artifacts here when it is imported (``import fcoll`` imports it).

    Args:
        fn: the listener; listeners run in registration order.
        enabled: asked once per graph, before the passes; when it returns False, ``fn`` is
            skipped for that graph. The graph is deep-copied into ``record.before`` only when
            some listener is enabled, so a listener that is usually off (tlparse artifacts
            without ``TORCH_TRACE``) costs nothing. None: always enabled.

    Returns:
        A handle; ``handle.remove()`` unregisters ``fn``.
    """
    handle = RemovableHandle(_listeners)
    _listeners[handle.id] = _Listener(fn, enabled)
    return handle


def _enabled_listeners() -> list[Callable[[CompiledGraph], None]]:
    return [li.fn for li in list(_listeners.values()) if li.enabled is None or li.enabled()]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _save_collectives(joint: fx.GraphModule) -> None:
    """Mark every fcoll node MUST_SAVE, as PyTorch does for ``_c10d_functional`` nodes."""
    for node in joint.graph.nodes:
        if is_fcoll_op(node) and node.meta.get("recompute") not in (
                CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _has_recompute_tags(joint: fx.GraphModule) -> bool:
    """True when some node carries a recompute policy (``torch.utils.checkpoint``, a
    selective-checkpoint policy, or a pass that tags, such as SimpleFSDP's reshard after
    forward), read before :func:`_save_collectives` adds its own MUST_SAVE tags."""
    return any(n.meta.get("recompute") is not None for n in joint.graph.nodes)


def _recompute_views_of_recomputed(joint: fx.GraphModule) -> None:
    """Tag ``MUST_RECOMPUTE`` (same checkpoint region) every view op whose input is tagged so,
    transitively, in graph order: a view costs nothing to recompute, and saving it keeps the
    whole base alive."""
    must = CheckpointPolicy.MUST_RECOMPUTE
    for node in joint.graph.nodes:
        target = node.target
        if node.op != "call_function" or node.meta.get("recompute") is not None or \
                not getattr(target, "is_view", False) or not node.args:
            continue
        base = node.args[0]
        if (isinstance(base, fx.Node) and base.meta.get("recompute") == must
                and base.meta.get("ac_graph_id") is not None):
            # the region's id too: the min-cut partitioner orders tagged nodes by it (torch
            # 2.11 compares it, and a None fails there)
            node.meta["recompute"] = must
            node.meta["ac_graph_id"] = base.meta["ac_graph_id"]


def _saved_opaque_after_tensors(fw: fx.GraphModule, bw: fx.GraphModule,
                                num_fwd_outputs: int | None) -> None:
    """Put the opaque objects the forward saves after the tensors it saves, as AOTAutograd's
    runtime reads them (forward outputs ``[outputs, tensors, opaque objects, symints]``, backward
    inputs ``[symints, tensors, opaque objects, tangents]``), in place.

    torch 2.13's partitioners place the saved opaque nodes right, then
    ``functionalize_rng_ops`` (random ops recomputed in an activation-checkpointed region, such
    as ``scaled_dot_product_attention``) inserts the rng states after them, counting only the
    symints as trailing: the runtime then takes the opaque object for a tensor and fails
    ("expected all tensors_saved_with_vc_check to be Tensors, got ... DeviceMesh"), under
    ``aot_eager`` and Inductor alike (a DTensor parameter read inside ``checkpoint``, as with
    FSDP and activation checkpointing). A graph without that pattern is left as it is.
    """
    try:   # AOTAutograd's own tests of what it saves (2.13; 2.11 saves no opaque values)
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node
        from torch._functorch.partitioners import is_sym_node
    except ImportError:
        return
    if num_fwd_outputs is None:
        return
    out = next(iter(fw.graph.find_nodes(op="output")))
    outputs = list(out.args[0])
    saved = outputs[num_fwd_outputs:]
    kinds = [2 if is_sym_node(n) else 1 if is_opaque_node(n) else 0 for n in saved]
    if kinds == sorted(kinds):
        return
    order = sorted(range(len(saved)), key=lambda i: kinds[i])      # stable: tensors, opaque, sym
    out.args = (outputs[:num_fwd_outputs] + [saved[i] for i in order], *out.args[1:])
    fw.recompile()
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    opaque = [ph for ph in placeholders if is_opaque_node(ph)]
    last_tensor = [ph for ph in placeholders[:len(saved)] if not is_opaque_node(ph) and
                   not is_sym_node(ph)][-1]
    for ph in reversed(opaque):
        last_tensor.append(ph)
    bw.recompile()


def _partition_fn(config: FcollConfig) -> Callable[..., Any]:
    """The partitioner: PyTorch's min-cut one (what ``aot_eager`` and Inductor use) where the
    user asked for recomputation or ``compute="inductor"``, else PyTorch's default one.

    The default partitioner saves every forward value the backward reads and recomputes
    nothing, the right trade when nothing fuses recomputed ops (``compute="eager"``); but it
    ignores recompute tags (``MUST_RECOMPUTE`` all_gathers were saved anyway) and refuses an
    activation-checkpointed region holding any impure op but PyTorch's own
    ``_c10d_functional.wait_tensor`` ("Trying to apply AC on a graph with impure op:
    fcoll.wait_tensor"). A joint graph with tags therefore goes to the min-cut partitioner on
    every ``compute``, which honours ``MUST_SAVE`` / ``MUST_RECOMPUTE`` / ``PREFER_*``.
    """
    from torch._functorch import partitioners

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        tagged = _has_recompute_tags(joint)
        _save_collectives(joint)
        base = (partitioners.min_cut_rematerialization_partition
                if config.compute == "inductor" or tagged else partitioners.default_partition)
        _recompute_views_of_recomputed(joint)
        fw, bw = base(joint, joint_inputs, **kwargs)
        _saved_opaque_after_tensors(fw, bw, kwargs.get("num_fwd_outputs"))
        record_partition(fw, bw, kwargs.get("num_fwd_outputs"))   # for fcoll.inspect
        return fw, bw
    return partition


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], config: FcollConfig,
                  name: str) -> Callable[[list[Any]], Any]:
    """Run the pass pipeline on one aten graph, notify listeners, and build its executor.

    Args:
        gm: an AOTAutograd graph (aten IR, functional), rewritten in place by the passes.
        example_inputs: its inputs (fake tensors and ints), for Inductor.
        config: the options.
        name: the graph's name (see :class:`CompiledGraph`).

    Returns:
        A boxed callable (takes the list of inputs).

    Raises:
        fcoll.passes.registry.PassFailed: a pass raised.
        fcoll.compile.executor.UnknownOpError: the graph holds an op the executor cannot run.
    """
    rank = _rank()
    listeners = _enabled_listeners()
    before = copy.deepcopy(gm) if listeners else None
    t0 = time.perf_counter()
    # AOTAutograd calls its compilers inside its FakeTensorMode. Passes read fake values from
    # node.meta and enter their mode themselves; the cost model's calibration times real
    # collectives, which must not be faked.
    names = config.pipeline
    if name.endswith("_compiled_autograd") and config.passes is None:
        # compiled autograd's backward: DDP's reducer hooks copy each reduced gradient back at
        # once; sinking those copies lets bucketing merge the gradients
        # (fcoll.passes.rewrites.output_chains)
        names = ("sink_output_waits",) + tuple(names)
    with unset_fake_temporarily():
        gm = run_pipeline(gm, config, names)
    gm.meta[META_PIPELINE_SECONDS] = time.perf_counter() - t0
    log.debug("%s: pipeline %s in %.1f ms", name, [r["pass"] for r in gm.meta.get(
        "fcoll_passes", [])], gm.meta[META_PIPELINE_SECONDS] * 1e3)
    t1 = time.perf_counter()
    record = CompiledGraph(name=name, before=before, after=gm, config=config, rank=rank)
    for fn in listeners:
        fn(record)
    t2 = time.perf_counter()
    trace_dir = trace_dir_from(config.trace_dir)
    recorder = recorder_for(trace_dir, rank) if trace_dir else None
    if config.compute == "inductor":
        executor = InductorExecutor(gm, example_inputs, name=name, rank=rank, recorder=recorder,
                                    direct=config.direct_collectives,
                                    inductor_options=config.inductor_options)
    else:
        executor = GraphExecutor(gm, name=name, rank=rank, recorder=recorder,
                                 direct=config.direct_collectives)
    gm.meta[META_COMPILE_SECONDS] = {"pipeline": gm.meta[META_PIPELINE_SECONDS],
                                     "listeners": t2 - t1,
                                     "executor": time.perf_counter() - t2}
    return executor


def _in_compiled_autograd() -> bool:
    """True while compiled autograd runs (and compiles) its backward graph."""
    try:
        from torch._dynamo import compiled_autograd
    except ImportError:  # pragma: no cover  (every supported torch has it)
        return False
    return bool(getattr(compiled_autograd, "in_compiled_autograd_region", False))


#: ``torch.compile`` modes fcoll runs, besides "default"
MODES = ("max-autotune", "max-autotune-no-cudagraphs")


def mode_options(mode: str) -> dict[str, Any]:
    """fcoll's options for ``torch.compile(backend="fcoll", mode=mode)``: the compute compiled
    by Inductor under the mode's Inductor config (:func:`torch._inductor.list_mode_options`)
    less CUDA graphs: fcoll's executor runs the collectives and waits between Inductor's
    compiled segments, which one CUDA graph replay cannot hold.

    Raises:
        ValueError: ``mode`` is "reduce-overhead" (CUDA graphs alone) or not a torch.compile
            mode; the message names the modes fcoll runs.
    """
    if mode not in MODES:
        why = ("it is CUDA graphs, which cannot capture a graph whose collectives fcoll's "
               "executor runs between compiled segments" if mode == "reduce-overhead" else
               "it is not a torch.compile mode")
        raise ValueError(f"fcoll backend: mode {mode!r} is not supported: {why}; fcoll runs "
                         f"mode=None, 'default', {', '.join(repr(m) for m in MODES)}")
    from torch._inductor import list_mode_options

    tuned = {k: v for k, v in list_mode_options(mode).items() if k != "triton.cudagraphs"}
    return {"compute": "inductor", "inductor_options": tuned}


def fcoll_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                  options: dict[str, Any] | None = None, mode: str | None = None):
    """The ``"fcoll"`` Dynamo backend: AOTAutograd, fcoll passes, fcoll executor.

    Args:
        gm: Dynamo's graph.
        example_inputs: Dynamo's example inputs.
        options: ``torch.compile(options=...)``; see :class:`FcollConfig`.
        mode: ``torch.compile(mode=...)``: None or "default"; "max-autotune" and
            "max-autotune-no-cudagraphs" compile the compute with Inductor
            (``compute="inductor"``) under that mode's Inductor options without CUDA graphs
            (:func:`mode_options`). torch.compile takes a mode or options, not both.

    Raises:
        ValueError: an unknown option, a bad option value, or an unsupported ``mode``
            ("reduce-overhead": CUDA graphs, which cannot hold fcoll's collectives).
    """
    # torch.ops.fcoll and the "fcoll" process-group backend are registered: importing this
    # module (the entry point) ran fcoll/__init__.py first.
    from torch._dynamo.backends.common import aot_autograd

    if mode not in (None, "default"):
        options = {**(options or {}), **mode_options(mode)}
    config = FcollConfig.from_options(options).for_inputs(example_inputs)
    graph_id = next(_graph_ids)

    if _in_compiled_autograd():
        # Compiled autograd hands its backward graph to torch.compile's backend; AOTAutograd
        # sees a graph that needs no gradient and would call it an inference graph.
        kinds = dict(forward="compiled_autograd", backward="compiled_autograd_backward",
                     inference="compiled_autograd")
    else:
        kinds = dict(forward="forward", backward="backward", inference="inference")

    def compiler(kind: str):
        kind = kinds[kind]

        def compile_one(g: fx.GraphModule, inputs: Sequence[Any]):
            executor = compile_graph(g, inputs, config, f"graph_{graph_id}_{kind}")

            def run(args: list[Any]) -> Any:
                return executor(args)
            # A function attribute, not the executor's class attribute: torch._dynamo.disable's
            # wrapper (around the backward) copies a function's __dict__, so the backward stays
            # boxed, as make_boxed_func's functions do.
            run._boxed_call = True
            return run
        return compile_one

    decompositions = None
    if config.compute == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        decompositions = select_decomp_table()
    # PyTorch's own AOTAutograd backend wrapper (what aot_eager is made of): it flattens list
    # inputs (compiled autograd's backward graphs take their inputs as one list), keeps Dynamo
    # out of the backward compiler and the backward it returns, and defaults the inference
    # compiler. fcoll only supplies the compilers and the partitioner.
    backend = aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        partition_fn=_partition_fn(config),
        decompositions=decompositions,
    )
    return backend(gm, example_inputs)


# The remaps compile broadcast, reduce, barrier and async_op=True calls for this backend only;
# under any other, Dynamo sees what it sees without fcoll (fcoll/ops/remaps.py).
setattr(fcoll_backend, FCOLL_BACKEND_ATTR, True)


class _EntryPointOfThisModule:
    """What Dynamo's registry keeps for a backend it has not loaded yet (an
    ``importlib.metadata.EntryPoint``): its ``load()`` gives :func:`fcoll_backend`."""

    name = "fcoll"
    value = "fcoll.compile.backend:fcoll_backend"

    @staticmethod
    def load() -> Callable[..., Any]:
        return fcoll_backend


def _name_in_dynamo_registry() -> None:
    """Make ``torch.compile(backend="fcoll")`` work once fcoll is imported, installed or not.

    Dynamo finds backends by name in ``torch._dynamo.backends.registry._BACKENDS``, which it
    fills from the ``torch_dynamo_backends`` entry points of installed packages; a checkout on
    ``PYTHONPATH`` has none, and ``backend="fcoll"`` raised ``InvalidBackend``. This adds the
    name only where it is missing, in the same not-yet-loaded form an entry point takes, so
    Dynamo's own ``lookup_backend`` loads and registers it; where the installed entry point is
    there (or replaces this later), nothing changes. Registering the function itself
    (``register_backend``) would break the installed path: loading the entry point imports
    this module, and Dynamo's registration that follows would then find the name taken.
    """
    try:
        from torch._dynamo.backends import registry

        backends = registry._BACKENDS
    except (ImportError, AttributeError):  # another registry layout: the entry point only
        return
    backends.setdefault("fcoll", _EntryPointOfThisModule)


_name_in_dynamo_registry()
