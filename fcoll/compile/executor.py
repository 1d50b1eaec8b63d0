"""Executor of lowered graphs: an environment plus a table from op to implementation.

A lowered graph is an aten graph (AOTAutograd's output, after fcoll's passes) holding compute ops,
collectives (``torch.ops.fcoll.*`` or ``torch.ops._c10d_functional.*``) and their ``wait_tensor``
nodes. The executor runs the nodes in graph order, so each collective starts (asynchronously, on
its group's backend) exactly where the passes placed it, and each ``wait_tensor`` blocks exactly
where the passes placed it: the op kernels do that, the executor adds no waits of its own.

Two paths, one semantics:

- *fast* (no tracing): the graph module's own generated ``forward`` runs. Python overhead per node
  is one call, and intermediate values are freed after their last use by the generated code.
- *traced* (``trace_dir`` set): a small interpreter over a precomputed plan, which times each
  compute node and records the issue and wait return of each collective in a
  :class:`fcoll.compile.trace.RunTrace` (see that module for the format).

Every ``call_function`` target is resolved through :class:`OpTable` when the executor is built,
so a graph with an op the executor does not know fails at compile time, naming the op and node.
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fcoll.passes.graph import collective_info, is_collective, is_wait, waits_of
from fcoll.compile.trace import RunTrace, TraceRecorder, busbw_factor, now_us

__all__ = ["OpTable", "UnknownOpError", "GraphExecutor", "RUNNABLE_NAMESPACES", "comm_bytes"]

log = logging.getLogger(__name__)

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
    """``fcoll.wait_tensor`` runs :func:`fcoll.ops.pending.wait` directly and returns the
    collective's own buffer. The op's kernel returns a copy (a custom op may not alias its input);
    the executor can skip it because it runs no buffer reuse of its own: a value lives as long as
    a later node reads it."""
    from fcoll.ops import pending

    return {torch.ops.fcoll.wait_tensor.default: pending.wait}


def _tensor_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(t) for t in x)
    return 0


def comm_bytes(kind: str, inputs: Any, outputs: Any) -> int:
    """Bytes of one collective, nccl-tests convention (see :mod:`fcoll.compile.trace`)."""
    if kind == "all_to_all":
        return _tensor_bytes(inputs)
    return max(_tensor_bytes(inputs), _tensor_bytes(outputs))


# Plan steps: (kind, node, impl, extra)
_PLACEHOLDER, _GET_ATTR, _COMPUTE, _COLLECTIVE, _WAIT, _PLUMBING, _OUTPUT = range(7)


class GraphExecutor:
    """Runs one lowered graph; called with AOTAutograd's boxed convention (a list of inputs).

    Args:
        gm: the lowered graph module (not modified).
        name: the graph's name in logs, errors and traces (e.g. "graph_0_forward").
        rank: this process's global rank (the trace's ``pid``).
        recorder: where traced runs go; None runs the fast path.
        table: op implementations.

    Raises:
        UnknownOpError: at construction, for a node whose op is not in ``table``.
    """

    _boxed_call = True

    def __init__(self, gm: fx.GraphModule, name: str, rank: int = 0,
                 recorder: TraceRecorder | None = None, table: OpTable | None = None) -> None:
        self.gm = gm
        self.name = name
        self.rank = rank
        self.recorder = recorder
        table = table or OpTable()
        impls = {}
        for node in gm.graph.nodes:
            if node.op == "call_function":
                impls[node] = table.resolve(node.target, node.name, name)
        self._forward = gm.forward
        if any(impl is not n.target for n, impl in impls.items()):
            self._forward = self._bound_module(impls).forward
        self._plan = self._make_plan(impls) if recorder is not None else None

    def __call__(self, args: list[Any]) -> Any:
        if self._plan is None:
            inputs = list(args)
            args.clear()
            return self._forward(*inputs)
        run = self.recorder.start_run() if self.recorder is not None else None
        try:
            return self._interpret(args, run)
        finally:
            if run is not None:
                run.finish()

    def _bound_module(self, impls: dict[fx.Node, Callable[..., Any]]) -> fx.GraphModule:
        """A copy of the graph whose call targets are the table's implementations."""
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        out = g.graph_copy(self.gm.graph, env)
        g.output(out)
        for old, new in env.items():
            if old in impls:
                new.target = impls[old]
        return fx.GraphModule(self.gm, g, self.name)

    # -- traced path -------------------------------------------------------------

    def _make_plan(self, impls: dict[fx.Node, Callable[..., Any]]) -> list[tuple]:
        nodes = list(self.gm.graph.nodes)
        last_use: dict[fx.Node, fx.Node] = {}
        for node in reversed(nodes):
            for inp in node.all_input_nodes:
                last_use.setdefault(inp, node)
        free_after: dict[fx.Node, list[fx.Node]] = {}
        for value, user in last_use.items():
            free_after.setdefault(user, []).append(value)
        last_wait = {}
        for node in nodes:
            if is_collective(node):
                waits = waits_of(node)
                if waits:
                    last_wait[waits[-1]] = node
        plan = []
        for node in nodes:
            free = tuple(free_after.get(node, ()))
            if node.op == "placeholder":
                plan.append((_PLACEHOLDER, node, None, None, free))
            elif node.op == "get_attr":
                plan.append((_GET_ATTR, node, None, None, free))
            elif node.op == "output":
                plan.append((_OUTPUT, node, None, None, free))
            elif node.op != "call_function":
                raise UnknownOpError(f"fcoll executor: unsupported node kind {node.op!r} at "
                                     f"node {node.name} of graph {self.name}")
            elif is_collective(node):
                info = collective_info(node)
                extra = (info.kind, info.op, info.group_name,
                         busbw_factor(info.kind, info.group_size or 0))
                plan.append((_COLLECTIVE, node, impls[node], extra, free))
            elif is_wait(node):
                start = last_wait.get(node)
                plan.append((_WAIT, node, impls[node], start.name if start is not None else None,
                             free))
            elif node.target is operator.getitem and isinstance(node.args[0], fx.Node) and \
                    is_collective(node.args[0]):
                plan.append((_PLUMBING, node, impls[node], None, free))
            else:
                plan.append((_COMPUTE, node, impls[node], str(node.target), free))
        return plan

    def _interpret(self, args: Sequence[Any], run: RunTrace | None) -> Any:
        env: dict[fx.Node, Any] = {}
        inputs = iter(list(args))
        if isinstance(args, list):
            args.clear()
        load = env.__getitem__
        for kind, node, impl, extra, free in self._plan:
            if kind == _PLACEHOLDER:
                env[node] = next(inputs)
                continue
            if kind == _OUTPUT:
                return fx.node.map_arg(node.args[0], load)
            if kind == _GET_ATTR:
                env[node] = getattr(self.gm, node.target)
                continue
            a = fx.node.map_arg(node.args, load)
            kw = fx.node.map_arg(node.kwargs, load)
            if run is None:
                env[node] = impl(*a, **kw)
            elif kind == _COMPUTE:
                t0 = now_us()
                env[node] = impl(*a, **kw)
                run.compute(node.name, extra, t0, now_us())
            elif kind == _COLLECTIVE:
                t0 = now_us()
                out = env[node] = impl(*a, **kw)
                op_kind, op, group, factor = extra
                run.comm_begin(node.name, op, group, comm_bytes(op_kind, a[0], out), factor, t0)
            elif kind == _WAIT:
                env[node] = impl(*a, **kw)
                if extra is not None:
                    run.comm_end(extra, node.name, now_us())
            else:
                env[node] = impl(*a, **kw)
            for value in free:
                env.pop(value, None)
        raise RuntimeError(f"fcoll executor: graph {self.name} has no output node")
