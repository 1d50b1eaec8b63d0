"""The one table of collective-op facts, read by every layer above the ops.

Each collective op of ``torch.ops.fcoll`` (and of ``torch.ops._c10d_functional``, whose op names
and argument order fcoll mirrors) has one :class:`OpFacts` row in :data:`OPS`: its kind, its
functional and in-place twins, its short code in :func:`fcoll.inspect.format_graph`, and how its
output shape follows from its input. The graph queries (``fcoll.passes.graph``), lowering,
bucketing, the cost model, the executor and ``fcoll.inspect`` all read this table instead of
keeping their own lists of op names.

Bandwidth conventions are nccl-tests' (``doc/PERFORMANCE.md`` of NVIDIA/nccl-tests): ``algbw =
bytes / time`` where ``bytes`` is the larger of one rank's input and output (all_to_all: its
input), and ``busbw = algbw * factor`` with :func:`busbw_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["KINDS", "OpFacts", "OPS", "facts", "busbw_factor", "comm_bytes"]

#: The collective kinds, in the order tables list them.
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


@dataclass(frozen=True)
class OpFacts:
    """Facts of one collective op.

    Attributes:
        name: op name without namespace, e.g. ``"all_reduce_coalesced_"``.
        kind: one of :data:`KINDS`.
        code: short code used in formatted graphs, e.g. ``"ar_co_"``.
        functional: the out-of-place op of the same kind and arity (``name`` itself when the op
            is functional); lowering rewrites mutating ops to it under ``auto_functionalized``.
        inplace: the op that reduces or broadcasts into its input, where one exists (None for
            the functional ops that have none, and for ``_out`` ops).
        coalesced: takes a list of tensors (``inputs``) and returns a list.
        mutates: writes into an argument (``input`` for in-place ops, ``out`` for ``_out`` ops).
        output_rows: first output dim of the single-tensor functional op, from the input's first
            dim and the op's positional args (as the fake kernels give it); None for the other
            ops. Bucketing emits its flat buffers with it.
    """

    name: str
    kind: str
    code: str
    functional: str
    inplace: str | None = None
    coalesced: bool = False
    mutates: bool = False
    output_rows: Callable[[int, Sequence[Any]], int] | None = None


def _rows_same(rows: int, args: Sequence[Any]) -> int:
    return rows


def _rows_gathered(rows: int, args: Sequence[Any]) -> int:
    return rows * args[1]          # (input, group_size, group_name)


def _rows_scattered(rows: int, args: Sequence[Any]) -> int:
    return rows // args[2]         # (input, reduce_op, group_size, group_name)


def _rows_exchanged(rows: int, args: Sequence[Any]) -> int:
    return sum(args[1])            # (input, output_split_sizes, input_split_sizes, group_name)


_ROWS = (
    OpFacts("all_reduce", "all_reduce", "ar", "all_reduce", inplace="all_reduce_",
            output_rows=_rows_same),
    OpFacts("all_reduce_", "all_reduce", "ar_", "all_reduce", inplace="all_reduce_",
            mutates=True, output_rows=_rows_same),
    OpFacts("all_reduce_coalesced", "all_reduce", "ar_co", "all_reduce_coalesced",
            inplace="all_reduce_coalesced_", coalesced=True),
    OpFacts("all_reduce_coalesced_", "all_reduce", "ar_co_", "all_reduce_coalesced",
            inplace="all_reduce_coalesced_", coalesced=True, mutates=True),
    OpFacts("all_gather_into_tensor", "all_gather", "ag", "all_gather_into_tensor",
            output_rows=_rows_gathered),
    OpFacts("all_gather_into_tensor_out", "all_gather", "ag_out", "all_gather_into_tensor",
            mutates=True),
    OpFacts("all_gather_into_tensor_coalesced", "all_gather", "ag_co",
            "all_gather_into_tensor_coalesced", coalesced=True),
    OpFacts("reduce_scatter_tensor", "reduce_scatter", "rs", "reduce_scatter_tensor",
            output_rows=_rows_scattered),
    OpFacts("reduce_scatter_tensor_out", "reduce_scatter", "rs_out", "reduce_scatter_tensor",
            mutates=True),
    OpFacts("reduce_scatter_tensor_coalesced", "reduce_scatter", "rs_co",
            "reduce_scatter_tensor_coalesced", coalesced=True),
    OpFacts("all_to_all_single", "all_to_all", "a2a", "all_to_all_single",
            output_rows=_rows_exchanged),
    OpFacts("broadcast", "broadcast", "bc", "broadcast", inplace="broadcast_"),
    OpFacts("broadcast_", "broadcast", "bc_", "broadcast", inplace="broadcast_", mutates=True),
)

#: op name (no namespace) -> :class:`OpFacts`, for every collective op (not ``wait_tensor``).
OPS: dict[str, OpFacts] = {f.name: f for f in _ROWS}


def facts(name: str) -> OpFacts:
    """The facts of collective op ``name`` (no namespace).

    Raises:
        KeyError: ``name`` is not a collective op (the message lists the known ones).
    """
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a collective op; known: {sorted(OPS)}") from None


def busbw_factor(kind: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor of collective ``kind`` on ``n`` ranks.

    all_reduce ``2(n-1)/n``; all_gather, reduce_scatter, all_to_all ``(n-1)/n``; broadcast 1
    (nccl-tests ``doc/PERFORMANCE.md``). One rank moves nothing across ranks: 0 for every kind.

    Raises:
        ValueError: ``kind`` is not one of :data:`KINDS`.
    """
    if kind not in KINDS:
        raise ValueError(f"busbw_factor: unknown collective kind {kind!r}; known: {KINDS}")
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind == "broadcast":
        return 1.0
    return (n - 1) / n


def comm_bytes(kind: str, in_bytes: int, out_bytes: int) -> int:
    """Bytes of one collective on one rank, nccl-tests convention: the larger of input and
    output, except all_to_all, which counts its input (bytes)."""
    return in_bytes if kind == "all_to_all" else max(in_bytes, out_bytes)
