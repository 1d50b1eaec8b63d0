"""How a step recorded on ``n0`` ranks changes on ``n`` ranks: layouts, shards, bytes, times.

Assumptions (printed with every report, :data:`ASSUMPTIONS`):

- *Weak scaling*: every rank keeps its batch, so compute on full tensors (activations,
  gathered parameters) takes the same time and memory on any world size.
- Collectives on a group of the graph's world size ``n0`` (the largest group in the graph) run
  on all ``n`` ranks; smaller groups (e.g. tensor parallel) keep their size and their bytes and
  are placed within one host.
- *Shards* shrink as ``n0 / n``: a value is a shard when it is the result of a reduce_scatter,
  an all_gather's input or what that input is computed from (the bucket's ``cat`` of
  parameter shards, their casts, the shard parameters), or computed from a shard (the
  optimizer step on shards). Their bytes and their compute time scale by ``n0 / n``, except
  each op's fixed overhead (``op_overhead_us`` of the cost model), which stays.
- Collective bytes per rank (nccl-tests' ``S``): all_reduce, broadcast and all_to_all keep
  their bytes (DDP: gradients are the model's size on any world size; all_to_all: each rank
  keeps its tokens); all_gather keeps its gathered output (FSDP: the whole parameter) and its
  input shard is ``S / n``; reduce_scatter keeps its input (the whole gradient) and its output
  shard is ``S / n``. A collective whose input is a shard scales by ``n0 / n``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fcoll.sim.program import Node, Program

__all__ = ["Layout", "layouts", "shard_names", "ScaledCollective", "scaled_collective",
           "ASSUMPTIONS"]

ASSUMPTIONS = (
    "weak scaling: each rank keeps its batch; compute on full tensors keeps its time",
    "groups of the graph's world size span all ranks; smaller groups stay within a host",
    "shards (reduce_scatter results, all_gather inputs and their sources, what is computed "
    "from them) shrink as n0/n in bytes and compute time (each op's fixed overhead stays)",
    "bytes per rank: all_reduce/broadcast/all_to_all constant (DDP), all_gather output and "
    "reduce_scatter input constant (FSDP: shards 1/n, gathered sizes constant)",
    "graphs run back to back; in a graph, compute is serial, each group's collectives run one "
    "at a time on their own stream, issued in graph order; a wait blocks compute",
    "'shm' collectives get a stream of their own, as on GPUs and NICs; fcoll's CPU backend "
    "moves data on the compute's cores, so on CPU hosts hidden communication is overstated",
    "flat algorithms across hosts run every step at the inter-host link's rate and latency; "
    "hierarchical ones use one inter-host link per rank (a NIC per rank)",
    "peak memory: the storage model of fcoll.passes.analysis.memory (inputs pinned, every "
    "other value freed after its last use, collective inputs held until their wait), shards scaled",
)


@dataclass(frozen=True)
class Layout:
    """A cluster layout: ``ranks`` ranks, ``ranks_per_host`` of them on each host.

    Raises:
        ValueError: ``ranks`` or ``ranks_per_host`` below 1, or ``ranks`` more than one host
            holds and not a multiple of ``ranks_per_host``.
    """

    ranks: int
    ranks_per_host: int

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"--ranks: a layout needs at least 1 rank, got {self.ranks}")
        if self.ranks_per_host < 1:
            raise ValueError(f"--hosts-of: ranks per host must be >= 1, got "
                             f"{self.ranks_per_host}")
        if self.ranks > self.ranks_per_host and self.ranks % self.ranks_per_host:
            raise ValueError(f"--ranks: {self.ranks} ranks do not fill hosts of "
                             f"{self.ranks_per_host} (--hosts-of); use a multiple of it")

    @property
    def hosts(self) -> int:
        return math.ceil(self.ranks / self.ranks_per_host)

    @property
    def per_host(self) -> int:
        """Ranks on each host (fewer than ``ranks_per_host`` when one host is not full)."""
        return min(self.ranks, self.ranks_per_host)

    def __str__(self) -> str:
        return f"{self.hosts}x{self.per_host}"


def layouts(ranks: list[int], ranks_per_host: int) -> list[Layout]:
    """One :class:`Layout` per entry of ``ranks`` (raises as :class:`Layout` does)."""
    return [Layout(int(r), int(ranks_per_host)) for r in ranks]


def shard_names(program: Program) -> set[str]:
    """Names of the nodes whose values are shards (module docstring), found from the graph's
    ops alone: sources are reduce_scatter results (their waits) and all_gather inputs, walked
    back through compute to the placeholders they come from; then every compute node or
    collective (and its waits) reading a shard is a shard too."""
    by_name = program.by_name
    sharded: set[str] = set()
    stack = []
    for n in program.nodes:
        if n.cls == "wait" and by_name[n.collective].kind == "reduce_scatter":
            sharded.add(n.name)
        if n.cls == "collective" and n.kind == "all_gather":
            stack.extend(n.inputs)
    while stack:                       # back from all_gather inputs to their sources
        name = stack.pop()
        node = by_name[name]
        if name in sharded or node.cls not in ("compute", "placeholder"):
            continue
        sharded.add(name)
        stack.extend(node.inputs)
    for n in program.nodes:            # forward: what is computed from shards
        if n.name in sharded or n.cls == "placeholder":
            continue
        if n.cls == "wait":
            if n.collective in sharded:
                sharded.add(n.name)
        elif n.cls == "compute" or n.kind != "all_gather":
            if any(i in sharded for i in n.inputs):
                sharded.add(n.name)
    return sharded


@dataclass(frozen=True)
class ScaledCollective:
    """A collective on the simulated layout.

    Attributes:
        kind: its collective kind.
        ranks: ranks of its group on the layout.
        nbytes: nccl-tests bytes per rank (``S``, :func:`fcoll.ops.facts.comm_bytes`).
        out_bytes: bytes of its output(s) on one rank.
    """

    kind: str
    ranks: int
    nbytes: float
    out_bytes: float


def scaled_collective(node: Node, n0: int, layout: Layout, input_is_shard: bool
                      ) -> ScaledCollective:
    """``node`` (a collective recorded on a group of ``node.group_size`` ranks in a graph of
    world size ``n0``) on ``layout`` (module docstring's rules)."""
    g0 = node.group_size or n0
    n = layout.ranks if g0 == n0 else g0
    f = g0 / n if input_is_shard else 1.0
    kind, inb, outb = node.kind, node.in_bytes * f, node.out_bytes * f
    if kind == "all_gather":
        outb = node.out_bytes      # the gathered whole is the same on any world size
        inb = outb / n
    elif kind == "reduce_scatter":
        outb = inb / n
    s = inb if kind == "all_to_all" else max(inb, outb)
    return ScaledCollective(kind, n, s, outb)
