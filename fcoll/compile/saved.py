"""What a forward/backward partition saves for the backward, and what the backward recomputes.

AOTAutograd's partitioner (fcoll's :func:`fcoll.compile.backend._partition_fn`) cuts the joint
graph into a forward graph whose outputs are the user's outputs followed by the values saved for
the backward, and a backward graph that reads those values and recomputes what the partitioner
chose to recompute (``MUST_RECOMPUTE`` tags: ``fcoll.parallel.fully_shard``'s gathers with
``reshard_after_forward=True``). :func:`record_partition` describes that cut as plain data
(:class:`SavedForBackward`: no graph nodes, so it survives deep copies) in ``gm.meta[META_SAVED]``
of both graphs, where ``fcoll.inspect`` reads it for its "saved for backward" report.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx as fx

from fcoll.passes.graph import collective_kind, is_collective, is_wait, size_hint, start_of

__all__ = ["SavedValue", "SavedForBackward", "record_partition", "saved_for_backward",
           "META_SAVED"]

#: graph_module.meta key (forward and backward graph of one partition): a
#: :class:`SavedForBackward`.
META_SAVED = "fcoll_saved_for_backward"


@dataclass(frozen=True)
class SavedValue:
    """One value the forward graph saves for the backward.

    Attributes:
        name: the forward graph's node (the backward graph's input of the same name).
        op: the op that produced it (``aten.t.default``; ``placeholder`` for a graph input
            saved as is); for a value that is no tensor, its type (``SymInt``).
        shape: its shape (per rank), () for a scalar or symbolic int; a symbolic dim by its
            size hint (a data-dependent one estimated, as the cost model does:
            :func:`fcoll.passes.graph.size_hint`), never a guard.
        dtype: its dtype as text (``torch.float32``), "" for no tensor.
        bytes: its own bytes, ``numel * element_size`` (0 for no tensor).
        base: the node it is a view of, through view ops (itself if it is no view).
        base_bytes: the base's bytes: what keeping this value keeps alive.
        collective: the kind of the collective whose result the base is (``all_gather``: a
            gathered parameter), or None.
        is_input: the base is a graph input (a parameter or its shard, held anyway).
    """

    name: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    base: str
    base_bytes: int
    collective: str | None
    is_input: bool


@dataclass(frozen=True)
class SavedForBackward:
    """The cut of one joint graph.

    Attributes:
        saved: the saved values, in the forward graph's output order.
        recomputed_collectives: names of the forward's collectives that the backward graph
            issues again (recomputed instead of saved), in backward graph order.
        backward_collectives: every collective the backward graph issues, recomputed or not.
    """

    saved: tuple[SavedValue, ...]
    recomputed_collectives: tuple[str, ...]
    backward_collectives: int

    @property
    def saved_bytes(self) -> int:
        """Bytes kept alive between forward and backward by the saved values that are not
        graph inputs: each base counted once (views of one base share its storage)."""
        bases = {v.base: v.base_bytes for v in self.saved if not v.is_input}
        return sum(bases.values())

    @property
    def saved_collective_bytes(self) -> int:
        """Of :attr:`saved_bytes`, the bytes of collectives' results (gathered parameters)."""
        bases = {v.base: v.base_bytes for v in self.saved
                 if not v.is_input and v.collective is not None}
        return sum(bases.values())

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields and both byte totals."""
        return {"saved": [asdict(v) for v in self.saved],
                "recomputed_collectives": list(self.recomputed_collectives),
                "backward_collectives": self.backward_collectives,
                "saved_bytes": self.saved_bytes,
                "saved_collective_bytes": self.saved_collective_bytes}


def _shape(val: torch.Tensor) -> tuple[int, ...]:
    return tuple(size_hint(d) for d in val.shape)


def _bytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return math.prod(_shape(val)) * val.element_size()
    return 0


def _base(node: fx.Node) -> fx.Node:
    """``node``, or the node it views, through view ops (``t``, ``view``, ``detach``...)."""
    while (node.op == "call_function" and getattr(node.target, "is_view", False)
           and node.args and isinstance(node.args[0], fx.Node)):
        node = node.args[0]
    return node


def _value(node: fx.Node) -> SavedValue:
    val = node.meta.get("val")
    base = _base(node)
    start = start_of(base) if is_wait(base) else (base if is_collective(base) else None)
    if isinstance(val, torch.Tensor):
        shape, dtype = _shape(val), str(val.dtype)
    else:
        shape, dtype = (), ""
    if not isinstance(val, torch.Tensor):   # a symbolic int (a size, a seed) or a constant
        op = type(val).__name__
    else:
        op = "placeholder" if node.op == "placeholder" else str(node.target)
    return SavedValue(name=node.name, op=op, shape=shape, dtype=dtype, bytes=_bytes(val),
                      base=base.name, base_bytes=_bytes(base.meta.get("val")),
                      collective=collective_kind(start) if start is not None else None,
                      is_input=base.op == "placeholder")


def saved_for_backward(fw: fx.GraphModule, bw: fx.GraphModule,
                       num_fwd_outputs: int) -> SavedForBackward:
    """Describe the cut into ``fw`` and ``bw`` (a partitioner's result).

    Args:
        fw: the forward graph; its first ``num_fwd_outputs`` outputs are the user's (and
            AOTAutograd's: mutated inputs, intermediate bases), the rest are saved.
        bw: the backward graph. A partitioner copies nodes keeping their joint-graph names,
            so a backward collective named like a forward node is that node recomputed.
        num_fwd_outputs: the partitioner's ``num_fwd_outputs`` argument.

    Raises:
        ValueError: ``num_fwd_outputs`` is negative or more than the forward's outputs.
    """
    (out,) = fw.graph.find_nodes(op="output")
    outs = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    if not 0 <= num_fwd_outputs <= len(outs):
        raise ValueError(f"saved_for_backward: num_fwd_outputs={num_fwd_outputs} but the "
                         f"forward graph has {len(outs)} outputs")
    saved = tuple(_value(n) for n in outs[num_fwd_outputs:] if isinstance(n, fx.Node))
    forward_names = {n.name for n in fw.graph.nodes}
    colls = [n for n in bw.graph.nodes if is_collective(n)]
    return SavedForBackward(saved, tuple(n.name for n in colls if n.name in forward_names),
                            len(colls))


def record_partition(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int | None
                     ) -> None:
    """Store :func:`saved_for_backward` in both graphs' ``meta[META_SAVED]`` (nothing when the
    partitioner was not told ``num_fwd_outputs``)."""
    if num_fwd_outputs is None:
        return
    record = saved_for_backward(fw, bw, num_fwd_outputs)
    fw.meta[META_SAVED] = record
    bw.meta[META_SAVED] = record
