"""``sink_output_waits``: move waits whose results only leave the graph to just before its output.

Compiled autograd hands the backend the whole backward, with DDP's gradient hooks inlined: under
``optimize_ddp = "python_reducer"`` each gradient is all-reduced and copied back into its buffer
right away (``all_reduce -> wait_tensor -> copy``), and the copy feeds only the graph's output.
In that order every gradient's result is "first used" before the next gradient is even computed,
so :mod:`fcoll.passes.rewrites.bucket_plan` (which never moves a member's users) can merge nothing,
and the DDP step pays one collective latency per parameter. Moving each such wait, with the chain of
nodes that lead from it to the output, to the end of the graph (in their original relative order)
changes no value: those nodes read only values computed earlier, and nothing but the output reads
them. The bucketing pass then sees the gradients first used at the end, as PyTorch's reducer
buckets them, and the scheduler places the waits again anyway.

Deterministic: one walk in graph order; the result depends only on the graph.
"""

from __future__ import annotations

import logging

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from fcoll.passes.graph import is_collective, is_wait
from fcoll.passes.registry import FcollPass, register_pass

__all__ = ["SinkOutputWaits", "output_only_chains"]

log = logging.getLogger(__name__)


def output_only_chains(graph: fx.Graph) -> list[fx.Node]:
    """The waits whose every (transitive) user is the output, with those users, in graph order.

    A chain qualifies only if it holds no collective and no other wait (moving a collective
    would change the order ranks issue them in) and only ``call_function`` nodes.
    """
    output = next(iter(graph.find_nodes(op="output")))
    movable: dict[fx.Node, bool] = {}   # node -> all its users are movable or the output

    def reaches_only_output(node: fx.Node) -> bool:
        if node in movable:
            return movable[node]
        movable[node] = False   # no cycles in a DAG, but be safe against re-entry
        ok = node.op == "call_function" and not is_collective(node) and all(
            u is output or reaches_only_output(u) for u in node.users)
        movable[node] = ok
        return ok

    chosen: set[fx.Node] = set()
    for node in graph.nodes:
        if not is_wait(node) or not node.users:
            continue
        if all(u is output or (not is_wait(u) and reaches_only_output(u)) for u in node.users):
            stack = [node]
            while stack:
                n = stack.pop()
                if n in chosen or n is output:
                    continue
                chosen.add(n)
                stack.extend(n.users)
    return [n for n in graph.nodes if n in chosen]


@register_pass
class SinkOutputWaits(FcollPass):
    """Move the waits that only feed the output (and their chains) to just before it.

    Not in the default pipeline: :mod:`fcoll.compile.backend` runs it first on compiled
    autograd's backward graphs, whose DDP gradient hooks produce that pattern.
    """

    name = "sink_output_waits"

    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        chain = output_only_chains(graph)
        output = next(iter(graph.find_nodes(op="output")))
        nodes = list(graph.nodes)
        tail = nodes[len(nodes) - 1 - len(chain):-1]
        moved = bool(chain) and tail != chain   # already at the end, in order: nothing to do
        if moved:
            for node in chain:
                output.prepend(node)
            graph.lint()
            gm.recompile()
        log.debug("sink_output_waits: %s %d node(s) of %d wait chain(s)",
                  "moved" if moved else "kept", len(chain), sum(is_wait(n) for n in chain))
        return PassResult(gm, bool(moved))
