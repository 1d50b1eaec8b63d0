"""Executor of lowered graphs: an environment plus a table from op to implementation.

A lowered graph is an aten graph (AOTAutograd's output, after fcoll's passes) holding compute ops,
collectives (``torch.ops.fcoll.*`` or ``torch.ops._c10d_functional.*``) and their ``wait_tensor``
nodes. The executor runs the nodes in graph order, so each collective starts (asynchronously, on
its group's backend) exactly where the passes placed it, and each ``wait_tensor`` blocks exactly
where the passes placed it: the op kernels do that, the executor adds no waits of its own.

One plan, one loop: :func:`plan_steps` turns the graph into a list of :class:`Step` records in
graph order, and :meth:`GraphExecutor.run_steps` interprets them. Compute is either one aten node
per step (``compute="eager"``, this module) or one Inductor-compiled segment per maximal run of
compute nodes (``compute="inductor"``, :mod:`fcoll.compile.inductor_compute`); that is the only
difference between the two executors. With a trace recorder, the loop times each compute step and
records the issue and wait return of each collective in a :class:`fcoll.compile.trace.RunTrace`,
with, on fcoll's groups, when the engine executed it (its own time) and how long its wait blocked.

Without a recorder, the eager executor skips the loop: the graph module's own generated
``forward`` runs (one Python call per node; intermediate values are freed after their last use by
the generated code).

Every ``call_function`` target the executor runs is resolved through :class:`OpTable` when the
executor is built, so a graph with an op the executor does not know fails at compile time, naming
the op and node.
"""

from __future__ import annotations

import enum
import math
import operator
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fcoll.compile.direct_calls import direct_impls, lent_inputs
from fcoll.compile.trace import RunTrace, TraceRecorder, now_us
from fcoll.ops import pending
from fcoll.ops.library import borrowing_inputs
from fcoll.ops.facts import busbw_factor, comm_bytes
from fcoll.passes.graph import (
    collective_info,
    is_collective,
    is_wait,
    tensor_bytes,
    waits_of,
)

__all__ = ["OpTable", "UnknownOpError", "GraphExecutor", "RUNNABLE_NAMESPACES", "StepKind", "Step",
           "CommFacts", "plan_steps"]

#: Operator namespaces whose ops are their own implementation (dispatcher kernels exist).
RUNNABLE_NAMESPACES = frozenset({"aten", "prims", "fcoll", "_c10d_functional", "higher_order"})
_PY_MODULES = frozenset({"_operator", "operator", "math", "builtins"})


class UnknownOpError(NotImplementedError):
    """A graph holds an op the executor has no implementation for."""


class OpTable:
    """Table from a node's target to the callable that runs it.

    Resolution order: an entry of ``overrides`` (by default ``fcoll.wait_tensor`` maps to its
    kernel, see :func:`_default_overrides`); an ``OpOverload`` /
    ``OpOverloadPacket`` / ``HigherOrderOperator`` of a namespace in :data:`RUNNABLE_NAMESPACES`
    (the op itself); Python's scalar functions (``operator``, ``math``, ``torch.sym_*``) used by
    graphs with symbolic sizes. Anything else is unknown.

    Args:
        overrides: target -> implementation (for example to run a custom op's namespace, or to
            replace an op in tests).
    """

    def __init__(self, overrides: Mapping[Any, Callable[..., Any]] | None = None) -> None:
        self._overrides = _default_overrides()
        self._overrides.update(overrides or {})

    def resolve(self, target: Any, node: str = "?", graph: str = "?") -> Callable[..., Any]:
        """The implementation of ``target``.

        Raises:
            UnknownOpError: ``target`` is not in the table (names the op, node and graph).
        """
        impl = self._overrides.get(target)
        if impl is not None:
            return impl
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            ns = target.namespace
        elif isinstance(target, torch._ops.HigherOrderOperator):
            ns = "higher_order"
        else:
            ns = None
        if ns is not None:
            if ns in RUNNABLE_NAMESPACES:
                return target
            raise UnknownOpError(f"fcoll executor: no implementation for op {target} (namespace "
                                 f"{ns!r}) at node {node} of graph {graph}; known namespaces: "
                                 f"{sorted(RUNNABLE_NAMESPACES)}; pass it in OpTable(overrides=)")
        module = getattr(target, "__module__", None) or ""
        name = getattr(target, "__name__", "")
        if module in _PY_MODULES or target in (math.floor, math.ceil, operator.getitem):
            return target
        if (module == "torch" and name.startswith(("sym_", "_sym_"))) or \
                module.startswith("torch.fx.experimental.sym_node"):
            return target
        raise UnknownOpError(f"fcoll executor: no implementation for {target!r} at node {node} "
                             f"of graph {graph}")


def _default_overrides() -> dict[Any, Callable[..., Any]]:
    """``fcoll.wait_tensor`` runs :func:`fcoll.ops.pending.wait_in_profile` directly and returns
    the collective's own buffer. The op's kernel returns a copy (a custom op may not alias its
    input); the executor can skip it because it runs no buffer reuse of its own: a value lives as
    long as a later node reads it. The wait is a ``fcoll::wait_tensor`` range in
    ``torch.profiler``, as the op would be (collectives are ops, so the profiler shows them)."""
    return {torch.ops.fcoll.wait_tensor.default: pending.wait_in_profile}




class StepKind(enum.IntEnum):
    """What one :class:`Step` runs, and what the trace records for it."""

    COMPUTE = 0      #: one compute node; traced as a compute event
    SEGMENT = 1      #: a compiled run of compute nodes (Inductor); traced as one compute event
    COLLECTIVE = 2   #: issues a collective; traced as the begin of an async comm event
    WAIT = 3         #: a wait_tensor; the last wait of a collective ends its comm event
    PLUMBING = 4     #: getitem of a coalesced collective's list; not traced


# The loop compares kinds by identity against these (a global load, no enum attribute lookup).
_COMPUTE, _SEGMENT, _COLLECTIVE, _WAIT, _PLUMBING = StepKind


class CommFacts(NamedTuple):
    """What the trace records of one collective step (computed once, at plan time).

    Attributes:
        kind: collective kind (:data:`fcoll.ops.facts.KINDS`).
        op: op name without namespace.
        group: process group name.
        busbw_factor: nccl-tests bus-bandwidth factor for the group size.
    """

    kind: str
    op: str
    group: str
    busbw_factor: float


class Step(NamedTuple):
    """One step of the executor's plan.

    Attributes:
        kind: what it runs.
        node: the FX node, or for ``SEGMENT`` the segment (with ``name``, ``inputs``,
            ``outputs`` lists of nodes).
        impl: node steps: ``impl(*args, **kwargs)``; ``SEGMENT``: ``impl(list_of_inputs)`` returns
            the outputs in ``node.outputs`` order.
        target: ``COMPUTE`` / ``SEGMENT``: the trace event's ``target`` text; else None.
        comm: ``COLLECTIVE``: its :class:`CommFacts`; else None.
        ends: ``WAIT``: name of the collective whose last wait this is, else None.
        free: values whose last read is this step (dropped from the environment after it).
    """

    kind: StepKind
    node: Any
    impl: Callable[..., Any]
    target: str | None = None
    comm: CommFacts | None = None
    ends: str | None = None
    free: tuple[fx.Node, ...] = ()


def _node_step(node: fx.Node, impl: Callable[..., Any], last_wait: Mapping[fx.Node, str]) -> Step:
    """The step of one node the executor runs itself (not part of a compiled segment)."""
    if is_collective(node):
        info = collective_info(node)
        facts = CommFacts(info.kind, info.op, info.group_name,
                          busbw_factor(info.kind, info.group_size or 0))
        return Step(_COLLECTIVE, node, impl, comm=facts)
    if is_wait(node):
        return Step(_WAIT, node, impl, ends=last_wait.get(node))
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and \
            is_collective(node.args[0]):
        return Step(_PLUMBING, node, impl)
    return Step(_COMPUTE, node, impl, target=str(node.target))


def _reads(step: Step) -> Sequence[fx.Node]:
    return step.node.inputs if step.kind is _SEGMENT else step.node.all_input_nodes


def plan_steps(gm: fx.GraphModule, items: Sequence[fx.Node | Step], table: OpTable,
               name: str, node_impls: Mapping[fx.Node, Callable[..., Any]] | None = None
               ) -> list[Step]:
    """The executor's plan of ``gm``, in graph order.

    Args:
        gm: the lowered graph.
        items: graph order without placeholders, ``get_attr`` and the output node: each an FX node
            (resolved through ``table``; its kind follows from the graph queries) or a ready
            ``SEGMENT`` step.
        table: op implementations.
        name: the graph's name, for errors.
        node_impls: implementations of particular nodes, ahead of ``table`` (the direct path's
            prepared calls, :func:`fcoll.compile.direct_calls.direct_impls`, and the kernels
            of collectives lent their inputs, :func:`~fcoll.compile.direct_calls.lent_inputs`).

    Returns:
        The steps, each with ``free`` set: the values it reads last, except the graph's outputs.

    Raises:
        UnknownOpError: a node that is not a ``call_function``, or whose op ``table`` lacks.
    """
    last_wait = {}
    for node in gm.graph.nodes:
        if is_collective(node):
            waits = waits_of(node)
            if waits:
                last_wait[waits[-1]] = node.name
    steps = []
    for item in items:
        if isinstance(item, Step):
            steps.append(item)
        elif item.op != "call_function":
            raise UnknownOpError(f"fcoll executor: unsupported node kind {item.op!r} at node "
                                 f"{item.name} of graph {name}")
        else:
            impl = node_impls.get(item) if node_impls else None
            if impl is None:
                impl = table.resolve(item.target, item.name, name)
            steps.append(_node_step(item, impl, last_wait))
    last_read: dict[fx.Node, int] = {}
    for i, step in enumerate(steps):
        for n in _reads(step):
            last_read[n] = i
    keep: set[fx.Node] = set()
    fx.node.map_arg(_output_of(gm), keep.add)
    frees: list[list[fx.Node]] = [[] for _ in steps]
    for n, i in last_read.items():
        if n not in keep:
            frees[i].append(n)
    return [s._replace(free=tuple(f)) if f else s for s, f in zip(steps, frees)]


def _timed_engines(groups: Sequence[str]) -> dict[str, Any]:
    """The engines of fcoll's shared-memory groups among ``groups``, each told to keep its
    collectives' execution times (:meth:`fcoll.shm.engine.Engine.keep_times`) for the trace."""
    from fcoll.shm.group.direct import group_engines

    engines = group_engines(groups)
    for eng in engines.values():
        eng.keep_times()
    return engines


def _output_of(gm: fx.GraphModule) -> Any:
    return gm.graph.output_node().args[0]


class GraphExecutor:
    """Runs one lowered graph; called with AOTAutograd's boxed convention (a list of inputs).

    Args:
        gm: the lowered graph module (not modified).
        name: the graph's name in logs, errors and traces (e.g. "graph_0_forward").
        rank: this process's global rank (the trace's ``pid``).
        recorder: where traced runs go; None runs the fast path.
        table: op implementations.
        direct: issue the collectives that qualify straight into fcoll's shared-memory engine
            (:mod:`fcoll.compile.direct_calls`); False runs every collective through its op
            (the c10d path).

    Raises:
        UnknownOpError: at construction, for a node whose op is not in ``table``.
    """

    _boxed_call = True

    def __init__(self, gm: fx.GraphModule, name: str, rank: int = 0,
                 recorder: TraceRecorder | None = None, table: OpTable | None = None,
                 direct: bool = True) -> None:
        self.gm, self.name, self.rank, self.recorder = gm, name, rank, recorder
        table = table or OpTable()
        nodes = list(gm.graph.nodes)
        self._placeholders = [n for n in nodes if n.op == "placeholder"]
        self._attrs = [(n, getattr(gm, n.target)) for n in nodes if n.op == "get_attr"]
        self._output = _output_of(gm)
        items = self._items()
        #: node -> prepared direct-path call (collectives) or its ``wait`` (their waits)
        self.direct = {}
        if direct:
            with unset_fake_temporarily():  # prepared calls hold real views of shared memory
                self.direct = direct_impls(gm, items, name)
        impls = dict(self.direct)
        for node in lent_inputs(gm, skip=self.direct):   # read in place, not copied
            impls[node] = borrowing_inputs(table.resolve(node.target, node.name, name))
        self._steps = plan_steps(gm, items, table, name, impls)
        # The loop unpacks plain tuples: CPython's UNPACK_SEQUENCE has a fast path for exact
        # tuples only, and a NamedTuple subclass costs about 10 % more per step.
        self._loop = [tuple(s) for s in self._steps]
        self._forward = self._fast_forward() if recorder is None else None
        #: the process groups of the graph's collectives: fenced when an exception leaves a run
        self.groups = tuple(sorted({str(collective_info(n).group_name)
                                    for n in nodes if is_collective(n)}))
        #: traced runs: group name -> its engine, which keeps its collectives' own times
        self._engines = _timed_engines(self.groups) if recorder is not None else {}

    def _items(self) -> list[fx.Node | Step]:
        """What :func:`plan_steps` plans: here every node but placeholders, ``get_attr`` and the
        output, so compute runs one node at a time (subclasses compile segments instead)."""
        return [n for n in self.gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]

    def _fast_forward(self) -> Callable[..., Any] | None:
        """The generated ``forward`` of the graph, with call targets replaced by the table's
        implementations where they differ."""
        impls = {s.node: s.impl for s in self._steps}
        if all(impl is n.target for n, impl in impls.items()):
            return self.gm.forward
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        g.output(g.graph_copy(self.gm.graph, env))
        for old, new in env.items():
            if old in impls:
                new.target = impls[old]
        return fx.GraphModule(self.gm, g, self.name).forward

    def __call__(self, args: list[Any]) -> Any:
        try:
            if self._forward is not None:
                inputs = list(args)
                args.clear()
                return self._forward(*inputs)
            run = (self.recorder.start_run(self.name, self._engines)
                   if self.recorder is not None else None)
            try:
                return self.run_steps(args, run)
            finally:
                if run is not None:
                    run.finish()
        except BaseException as e:
            if self.groups:
                self._abandon(e)
            raise

    def _abandon(self, e: BaseException) -> None:
        """An exception leaves a run of a graph that holds collectives: the peers are in, or
        will enter, collectives this rank will not issue (the rest of this step), so each
        fcoll group of the graph is fenced before ``e`` propagates
        (:func:`fcoll.shm.group.direct.abandon_groups`): the peers raise within a wait's tick,
        naming this rank and ``e``'s type, instead of at the group timeout; the group is
        unusable on every rank until created again, as after a timeout. Errors that every
        rank raised alike (a mismatch, an invalid argument) and a peer's failure fence
        nothing more."""
        from fcoll.shm.group.direct import abandon_groups

        abandon_groups(self.groups, e, f"compiled graph {self.name}")

    def run_steps(self, args: list[Any], run: RunTrace | None) -> Any:
        """Interpret the plan once: bind inputs, run every step, return the graph's outputs.

        ``args`` is cleared (boxed convention: the caller gives up its references). With ``run``,
        compute steps are timed and collectives recorded (see :mod:`fcoll.compile.trace`).
        """
        env: dict[fx.Node, Any] = dict(zip(self._placeholders, args))
        if isinstance(args, list):
            args.clear()
        env.update(self._attrs)
        load = env.__getitem__
        map_arg = fx.node.map_arg
        for kind, node, impl, target, comm, ends, free in self._loop:
            if run is not None:
                t0 = now_us()
                if comm is not None:
                    run.before_issue(comm.group)
            if kind is _SEGMENT:
                env.update(zip(node.outputs, impl([load(n) for n in node.inputs])))
            else:
                a = map_arg(node.args, load)
                out = env[node] = impl(*a, **map_arg(node.kwargs, load))
            if run is not None:
                if target is not None:
                    run.compute(node.name, target, t0, now_us())
                elif comm is not None:
                    nbytes = comm_bytes(comm.kind, tensor_bytes(a[0]), tensor_bytes(out))
                    run.comm_begin(node.name, comm.op, comm.group, nbytes, comm.busbw_factor, t0)
                elif ends is not None:
                    run.comm_end(ends, node.name, now_us(), t0)
            for n in free:
                env.pop(n, None)
        return map_arg(self._output, load)
