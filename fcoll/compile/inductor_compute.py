"""``compute="inductor"``: Inductor compiles the compute, fcoll runs the collectives and waits.

The lowered graph is cut at every communication node (collective, ``wait_tensor``, ``getitem``
of a coalesced collective): each maximal run of compute nodes between two communication nodes
becomes one *compute segment* (:class:`ComputeSegment`), an FX graph compiled with Inductor's
``compile_fx_inner`` (the compiler Inductor itself applies to AOTAutograd's graphs; on CPU it
generates C++, no triton needed). At run time the segments and the communication nodes run in
graph order, through the executor's one plan and loop (:mod:`fcoll.compile.executor`), so every
collective is issued, and every wait blocks, exactly where fcoll's passes placed it.

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
from typing import Any, Mapping, Sequence

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from fcoll.compile.executor import GraphExecutor, OpTable, Step, StepKind
from fcoll.compile.trace import TraceRecorder, segment_target
from fcoll.passes.graph import is_collective, is_fcoll_op, is_wait

__all__ = ["ComputeSegment", "split_segments", "InductorExecutor", "is_comm_node"]

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
class ComputeSegment:
    """A maximal run of compute nodes of the lowered graph (not to be confused with
    :class:`fcoll.shm.transport.segment.Segment`, a shared-memory segment).

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


def _runs(gm: fx.GraphModule) -> list[list[fx.Node] | fx.Node]:
    """Graph order: communication nodes alone, maximal runs of other nodes as lists."""
    items: list[list[fx.Node] | fx.Node] = []
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
    return items


def _getitems_next_to_producers(gm: fx.GraphModule) -> None:
    """Move every ``getitem`` of a multi-output compute op right after that op (a pure
    projection, so the program is unchanged). Otherwise a collective the scheduler placed
    between them would end the producer's segment with a tuple output, which Inductor
    rejects (seen with CUDA's multi-output attention kernel)."""
    last: dict[fx.Node, fx.Node] = {}
    moved = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not operator.getitem:
            continue
        src = node.args[0]
        if (not isinstance(src, fx.Node) or src.op != "call_function" or is_comm_node(src)
                or is_comm_node(node)):
            continue
        anchor = last.get(src, src)
        if anchor.next is not node:
            anchor.append(node)
            moved = True
        last[src] = node
    if moved:
        gm.recompile()


def _binds(val: Any) -> set:
    """Size symbols that Inductor can read off an input holding ``val``: a SymInt that is one
    symbol, or a tensor's dimensions that are one symbol each (``(s0, 16)`` binds ``s0``;
    ``(2*s0, 16)`` binds nothing)."""
    if isinstance(val, torch.SymInt):
        return {val.node.expr} if isinstance(val.node.expr, sympy.Symbol) else set()
    if isinstance(val, torch.Tensor):
        return {d.node.expr for d in val.shape
                if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol)}
    return set()


def _symbol_binders(gm: fx.GraphModule) -> dict[sympy.Symbol, list[fx.Node]]:
    """Per size symbol, the nodes whose value binds it (:func:`_binds`): SymInt nodes first,
    then tensors, each in graph order."""
    out: dict[sympy.Symbol, list[fx.Node]] = {}
    for prefer_tensor in (False, True):
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) is prefer_tensor:
                for sym in _binds(val):
                    out.setdefault(sym, []).append(node)
    return out


def _unbound_symbols(nodes: list[fx.Node], inputs: dict[fx.Node, None]) -> set:
    """Size symbols that the run's values use and neither its inputs nor its own nodes bind."""
    used: set = set()
    bound: set = set()
    for n in list(inputs) + nodes:
        val = n.meta.get("val")
        for v in (val if isinstance(val, (tuple, list)) else (val,)):
            if isinstance(v, (torch.Tensor, torch.SymInt)):
                used |= free_symbols(v)
        if n in inputs:
            bound |= _binds(val)
        else:   # defined in the run: a SymInt value (``.item()``) or unbacked bindings
            bound |= _binds(val) if isinstance(val, torch.SymInt) else set()
            bound |= set(n.meta.get("unbacked_bindings") or {})
    return used - bound


def split_segments(gm: fx.GraphModule) -> list[ComputeSegment | fx.Node]:
    """Graph order as a list of :class:`ComputeSegment`\\ s and communication nodes.

    Placeholders, ``get_attr`` and the output node are not listed (the executor binds them).
    ``getitem``\\ s of multi-output compute ops first move next to their producers.

    Under dynamic shapes, Inductor reads each size symbol of a segment off its inputs (a SymInt
    input, or a tensor dimension that is the symbol itself). A segment whose inputs only hold
    expressions of a symbol (an all_gather's output of ``2*s0`` rows) also takes a node of the
    graph that binds it: a SymInt placeholder where the graph has one, else the earliest
    tensor with a dimension ``s0``; a binder defined in an earlier segment becomes one of that
    segment's outputs.
    """
    _getitems_next_to_producers(gm)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    binders = _symbol_binders(gm)
    needed_later: set[fx.Node] = set()   # binders that later segments take as inputs
    out: list[ComputeSegment | fx.Node] = []
    segments: list[ComputeSegment] = []
    for item in _runs(gm):
        if isinstance(item, fx.Node):
            out.append(item)
            continue
        members = set(item)
        first = position[item[0]]
        inputs: dict[fx.Node, None] = {}
        for n in item:
            for i in n.all_input_nodes:
                if i not in members:
                    inputs[i] = None
        unbound = _unbound_symbols(item, inputs) if binders else ()   # () for static graphs
        for sym in sorted(unbound, key=str):
            binder = next((b for b in binders.get(sym, ()) if position[b] < first), None)
            if binder is not None:    # else Inductor names the symbol it cannot bind
                inputs[binder] = None
                needed_later.add(binder)
        assert all(position[i] < first for i in inputs), "segment input defined after it"
        segments.append(ComputeSegment(f"segment_{len(segments)}", item, list(inputs), []))
        out.append(segments[-1])
    for seg in segments:   # outputs once every segment's inputs are known
        last = position[seg.nodes[-1]]
        seg.outputs = [n for n in seg.nodes
                       if any(position[u] > last for u in n.users) or n in needed_later]
    return out


class InductorExecutor(GraphExecutor):
    """Runs a lowered graph: Inductor-compiled segments and fcoll communication, in graph order.

    The plan and the loop are :class:`fcoll.compile.executor.GraphExecutor`'s; only compute
    differs: each :class:`ComputeSegment` is one ``SEGMENT`` step, compiled by Inductor.

    Args:
        gm: the lowered graph (after fcoll's passes, decomposed for Inductor by AOTAutograd).
        example_inputs: unused (each segment is compiled with the fake values in node.meta).
        name: graph name for logs, errors and traces.
        rank: global rank (trace ``pid``).
        recorder: trace recorder, or None.
        table: implementations of the communication nodes.
        inductor_options: Inductor config applied while the segments compile (``config.patch``),
            or None (:attr:`fcoll.passes.config.FcollConfig.inductor_options`).

    Raises:
        fcoll.compile.executor.UnknownOpError: a communication node's op is unknown.
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], name: str,
                 rank: int = 0, recorder: TraceRecorder | None = None,
                 table: OpTable | None = None, direct: bool = True,
                 inductor_options: Mapping[str, Any] | None = None) -> None:
        t0 = time.perf_counter()
        self.segments: list[ComputeSegment] = []
        self.inductor_options = dict(inductor_options or {})
        super().__init__(gm, name, rank, recorder, table, direct)
        log.debug("%s: %d Inductor segments, %d communication nodes, compiled in %.1f s", name,
                  len(self.segments), len(self._steps) - len(self.segments),
                  time.perf_counter() - t0)

    def _items(self) -> list[fx.Node | Step]:
        """Communication nodes, and one ``SEGMENT`` step per compute segment, in graph order."""
        from torch._inductor.compile_fx import compile_fx_inner  # heavy; only for this mode

        out: list[fx.Node | Step] = []
        for item in split_segments(self.gm):
            if isinstance(item, fx.Node):
                out.append(item)
                continue
            # Each segment reports its output strides into a list of its own: AOTAutograd's
            # list is for the whole graph's outputs, whose strides are the traced ones.
            with torch._guards.TracingContext.report_output_strides(), \
                    torch._inductor.config.patch(self.inductor_options):
                compiled = compile_fx_inner(item.graph_module(self.gm),
                                            [n.meta["val"] for n in item.inputs])
            self.segments.append(item)
            out.append(Step(StepKind.SEGMENT, item, compiled,
                            target=segment_target(item.nodes[0].name, item.nodes[-1].name)))
        return out

    def _fast_forward(self) -> None:
        """No generated forward: the segments run through the plan's loop."""
        return None
