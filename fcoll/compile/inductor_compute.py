"""``compute="inductor"``: Inductor compiles the compute, fcoll runs the collectives and waits.

The lowered graph is cut at every communication node (collective, ``wait_tensor``, ``getitem``
of a coalesced collective): each maximal run of compute nodes between two communication nodes
becomes one *segment*, an FX graph compiled with Inductor's ``compile_fx_inner`` (the compiler
Inductor itself applies to AOTAutograd's graphs; on CPU it generates C++, no triton needed). At
run time the segments and the communication nodes run in graph order, so every collective is
issued, and every wait blocks, exactly where fcoll's passes placed it.

Inductor never sees an fcoll op. That is required, not only tidy: ``wait_tensor`` returns its
input buffer (the collective's output, as PyTorch's ``_c10d_functional.wait_tensor`` does), an
alias that Inductor's buffer reuse and its functional-graph assumptions do not expect.

Example::

    x -> mm -> all_reduce -> relu -> wait -> add      (lowered graph)
    [segment_0: mm] all_reduce [segment_1: relu] wait [segment_2: add]
"""

from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

from fcoll.passes.graph import collective_info, is_collective, is_fcoll_op, is_wait, waits_of
from fcoll.compile.executor import OpTable, comm_bytes
from fcoll.compile.trace import TraceRecorder, busbw_factor, now_us

__all__ = ["Segment", "split_segments", "InductorExecutor", "is_comm_node"]

log = logging.getLogger(__name__)


def is_comm_node(node: fx.Node) -> bool:
    """True for nodes fcoll runs itself: collectives, waits, getitems of collectives, any op of
    the ``fcoll`` or ``_c10d_functional`` namespaces."""
    if node.op != "call_function":
        return False
    if is_collective(node) or is_wait(node) or is_fcoll_op(node):
        return True
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return is_collective(node.args[0])
    return getattr(node.target, "namespace", None) == "_c10d_functional"


@dataclass
class Segment:
    """A maximal run of compute nodes of the lowered graph.

    Attributes:
        name: "segment_{i}".
        nodes: the nodes of the run, in graph order.
        inputs: values defined before the run and used in it (segment input order).
        outputs: values defined in the run and used after it (segment output order).
    """

    name: str
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]

    def graph_module(self, owner: fx.GraphModule) -> fx.GraphModule:
        """The run as a standalone graph: placeholders for ``inputs``, a tuple of ``outputs``."""
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in self.inputs:
            p = g.placeholder(n.name)
            p.meta = dict(n.meta)
            env[n] = p
        for n in self.nodes:
            env[n] = g.node_copy(n, env.__getitem__)
        g.output(tuple(env[n] for n in self.outputs))
        return fx.GraphModule(owner, g, self.name)


def split_segments(gm: fx.GraphModule) -> list[Segment | fx.Node]:
    """Graph order as a list of compute :class:`Segment`\\ s and communication nodes.

    Placeholders, ``get_attr`` and the output node are not listed (the executor binds them).
    """
    items: list[Segment | fx.Node] = []
    run: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if is_comm_node(node):
            if run:
                items.append(run)
                run = []
            items.append(node)
        else:
            run.append(node)
    if run:
        items.append(run)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    out: list[Segment | fx.Node] = []
    count = 0
    for item in items:
        if isinstance(item, fx.Node):
            out.append(item)
            continue
        members = set(item)
        first, last = position[item[0]], position[item[-1]]
        inputs: dict[fx.Node, None] = {}
        for n in item:
            for i in n.all_input_nodes:
                if i not in members:
                    inputs[i] = None
        outputs = [n for n in item if any(position[u] > last for u in n.users)]
        assert all(position[i] < first for i in inputs), "segment input defined after it"
        out.append(Segment(f"segment_{count}", item, list(inputs), outputs))
        count += 1
    return out


class InductorExecutor:
    """Runs a lowered graph: Inductor-compiled segments and fcoll communication, in graph order.

    Args:
        gm: the lowered graph (after fcoll's passes, decomposed for Inductor by AOTAutograd).
        example_inputs: unused (each segment is compiled with the fake values in node.meta).
        name: graph name for logs, errors and traces.
        rank: global rank (trace ``pid``).
        recorder: trace recorder, or None.

    Raises:
        fcoll.compile.executor.UnknownOpError: a communication node's op is unknown.
    """

    _boxed_call = True

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], name: str,
                 rank: int = 0, recorder: TraceRecorder | None = None,
                 table: OpTable | None = None) -> None:
        from torch._inductor.compile_fx import compile_fx_inner

        self.gm, self.name, self.rank, self.recorder = gm, name, rank, recorder
        table = table or OpTable()
        t0 = time.perf_counter()
        nodes = list(gm.graph.nodes)
        self._placeholders = [n for n in nodes if n.op == "placeholder"]
        self._attrs = [(n, getattr(gm, n.target)) for n in nodes if n.op == "get_attr"]
        self._output = nodes[-1].args[0]
        last_wait = {}
        for n in nodes:
            if is_collective(n):
                waits = waits_of(n)
                if waits:
                    last_wait[waits[-1]] = n.name
        self.segments: list[Segment] = []
        steps: list[tuple] = []
        for item in split_segments(gm):
            if isinstance(item, Segment):
                sub = item.graph_module(gm)
                # Each segment reports its output strides into a list of its own: AOTAutograd's
                # list is for the whole graph's outputs, whose strides are the traced ones.
                with torch._guards.TracingContext.report_output_strides():
                    compiled = compile_fx_inner(sub, [n.meta["val"] for n in item.inputs])
                self.segments.append(item)
                steps.append(("segment", item, compiled,
                              f"inductor:{item.nodes[0].name}..{item.nodes[-1].name}"))
            else:
                impl = table.resolve(item.target, item.name, name)
                extra = None
                if is_collective(item):
                    info = collective_info(item)
                    extra = (info.kind, info.op, info.group_name,
                             busbw_factor(info.kind, info.group_size or 0))
                steps.append(("collective" if extra else "wait" if is_wait(item) else "node",
                              item, impl, extra if extra else last_wait.get(item)))
        self._steps = self._with_frees(steps, nodes)
        log.debug("%s: %d Inductor segments, %d communication nodes, compiled in %.1f s", name,
                  len(self.segments), len(steps) - len(self.segments), time.perf_counter() - t0)

    def _with_frees(self, steps: list[tuple], nodes: list[fx.Node]) -> list[tuple]:
        """Append to each step the values whose last use it is (freed after it runs)."""
        last: dict[fx.Node, int] = {}
        for i, s in enumerate(steps):
            used = s[1].inputs if s[0] == "segment" else s[1].all_input_nodes
            for n in used:
                last[n] = i
        keep: set[fx.Node] = set()
        fx.node.map_arg(self._output, lambda x: keep.add(x))
        frees: list[list[fx.Node]] = [[] for _ in steps]
        for n, i in last.items():
            if n not in keep:
                frees[i].append(n)
        return [s + (tuple(f),) for s, f in zip(steps, frees)]

    def __call__(self, args: list[Any]) -> Any:
        env: dict[fx.Node, Any] = dict(zip(self._placeholders, args))
        if isinstance(args, list):
            args.clear()
        env.update(self._attrs)
        run = self.recorder.start_run() if self.recorder is not None else None
        load = env.__getitem__
        try:
            for kind, item, fn, extra, free in self._steps:
                t0 = now_us() if run is not None else 0.0
                if kind == "segment":
                    outs = fn([env[n] for n in item.inputs])
                    env.update(zip(item.outputs, outs))
                    if run is not None:
                        run.compute(item.name, extra, t0, now_us())
                else:
                    out = env[item] = fn(*fx.node.map_arg(item.args, load),
                                         **fx.node.map_arg(item.kwargs, load))
                    if run is not None and kind == "collective":
                        op_kind, op, group, factor = extra
                        run.comm_begin(item.name, op, group,
                                       comm_bytes(op_kind, load(item.args[0]) if isinstance(
                                           item.args[0], fx.Node) else [load(a) for a in
                                                                        item.args[0]], out),
                                       factor, t0)
                    elif run is not None and kind == "wait" and extra is not None:
                        run.comm_end(extra, item.name, now_us())
                for n in free:
                    env.pop(n, None)
            return fx.node.map_arg(self._output, load)
        finally:
            if run is not None:
                run.finish()
