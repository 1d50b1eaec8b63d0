"""Peak-memory accounting of a node order, and the ordering constraints of aliasing and mutation.

Storage model (bytes from ``node.meta["val"]``, sizes evaluated with hints):

- A node that returns a fresh tensor allocates a *storage* of its output's bytes when it runs.
  Views (aliasing schema returns), ``getitem``, in-place ops (``Tensor(a!)``) and
  ``wait_tensor`` (at runtime the wait returns the collective's buffer) allocate nothing: their
  storage *root* is their input's root.
- A storage is freed after the last node that uses any alias of it. A collective's inputs stay
  alive until its last wait (the backend reads them until then), so waits count as their uses.
- Placeholders, attributes and the roots of graph outputs are never freed and are not counted:
  they are the same in every order, so *extra* peak memory is unaffected by them.

The same model gives the mutation constraints the schedulers must keep: a node that writes a
storage stays after earlier readers of that storage and before later ones; for an in-place
collective "later" means after its wait, since the buffer changes until then.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx

from fcoll.passes.graph import is_collective, is_wait, per_op, start_of, tensor_bytes, waits_of

__all__ = ["Storage", "storage_model", "LiveBytes", "peak_bytes", "mutation_deps", "OpClass",
           "op_class", "OTHER", "COLLECTIVE", "WAIT", "value_bytes", "written_inputs"]


class OpClass(enum.IntEnum):
    """What a node is to the schedulers: compute (``OTHER``), a collective, or a wait."""

    OTHER = 0
    COLLECTIVE = 1
    WAIT = 2


OTHER, COLLECTIVE, WAIT = OpClass.OTHER, OpClass.COLLECTIVE, OpClass.WAIT


class _Probe:
    """A stand-in node for :mod:`fcoll.passes.graph`'s queries, which read only op and target."""

    op = "call_function"

    def __init__(self, target: Any) -> None:
        self.target = target


@per_op
def _target_class(target: torch._ops.OpOverload) -> OpClass:
    probe = _Probe(target)
    return COLLECTIVE if is_collective(probe) else WAIT if is_wait(probe) else OTHER


def op_class(node: fx.Node) -> OpClass:
    """:data:`COLLECTIVE`, :data:`WAIT` or :data:`OTHER`: ``is_collective`` / ``is_wait``,
    memoized per op (a 50k-node graph has a few dozen distinct ops; passes ask per node)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return OTHER
    return _target_class(node.target)


@per_op
def _alias_positions(target: torch._ops.OpOverload) -> tuple[int, ...]:
    """Positions of the arguments the first return of ``target`` aliases (schema facts)."""
    returns = target._schema.returns
    if not returns or returns[0].alias_info is None:
        return ()
    sets = returns[0].alias_info.before_set
    return tuple(i for i, arg in enumerate(target._schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.before_set & sets)


@per_op
def _write_arguments(target: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of the ``Tensor(a!)`` arguments of ``target``."""
    return tuple((i, a.name) for i, a in enumerate(target._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def written_inputs(node: fx.Node) -> list[fx.Node]:
    """Input nodes whose storage ``node`` writes (``Tensor(a!)`` schema arguments)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    out: list[fx.Node] = []
    for i, name in _write_arguments(target):
        if name in node.kwargs:
            value = node.kwargs[name]
        elif i < len(node.args):
            value = node.args[i]
        else:
            continue
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, fx.Node):
                out.append(v)
    return out


@dataclass
class Storage:
    """The storage model of one graph (see the module docstring).

    Attributes:
        root: node -> the node that allocated its storage (itself for fresh tensors).
        size: root -> bytes it allocates (0 for pinned roots).
        uses: root -> nodes that use any alias of it (collective inputs: also its waits).
        pinned: roots never freed (placeholders, attributes, graph outputs).
        touches: node -> :meth:`roots_used` of it, filled by :func:`storage_model`.
        cls: node -> :func:`op_class` of it, filled by :func:`storage_model`.
        start: wait -> the collective it waits on (:func:`start_of`), filled by
            :func:`storage_model`.
    """

    root: dict[fx.Node, fx.Node] = field(default_factory=dict)
    size: dict[fx.Node, int] = field(default_factory=dict)
    uses: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    pinned: set[fx.Node] = field(default_factory=set)
    touches: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    cls: dict[fx.Node, OpClass] = field(default_factory=dict)
    start: dict[fx.Node, fx.Node] = field(default_factory=dict)

    def alloc(self, node: fx.Node) -> int:
        """Bytes ``node`` allocates when it runs."""
        return self.size.get(node, 0) if self.root.get(node) is node else 0

    def roots_used(self, node: fx.Node) -> list[fx.Node]:
        """Roots whose storage ``node`` touches (its inputs'; a wait: its collective's inputs)."""
        cached = self.touches.get(node)
        if cached is not None:
            return cached
        seen: list[fx.Node] = []
        for i in _uses_of(node):
            r = self.root[i]
            if r not in seen:
                seen.append(r)
        return seen


def value_bytes(val: Any) -> int:
    """``tensor_bytes`` with a fast path for static shapes (``nbytes`` is then a plain int)."""
    if isinstance(val, torch.Tensor):
        if not val._has_symbolic_sizes_strides:
            try:
                return val.nbytes   # numel() * element_size(), in one call
            except RuntimeError:    # sparse layouts define no nbytes
                return val.numel() * val.element_size()
    elif isinstance(val, (list, tuple)):
        return sum(value_bytes(v) for v in val)
    else:
        return 0
    return tensor_bytes(val)


def _uses_of(node: fx.Node, cls: OpClass | None = None) -> list[fx.Node]:
    inputs = node.all_input_nodes
    if (cls if cls is not None else op_class(node)) == WAIT:
        inputs = list(inputs)
        start = start_of(node)
        if start is not None:
            inputs += start.all_input_nodes
    return inputs


def _node_facts(target: Any) -> tuple[OpClass, tuple[int, ...]]:
    """(:func:`op_class`, alias positions) of a ``call_function`` target."""
    if not isinstance(target, torch._ops.OpOverload):
        return OTHER, ()
    return _target_class(target), _alias_positions(target)


def storage_model(graph: fx.Graph) -> Storage:
    """Build the :class:`Storage` model of ``graph`` (in topological order: roots follow data
    edges). O(N + E); also fills ``Storage.touches``, ``cls`` and ``start``."""
    st = Storage()
    root, size, uses, touches, pinned = st.root, st.size, st.uses, st.touches, st.pinned
    classes, starts = st.cls, st.start
    # id(op) -> _node_facts(op), for this call only (the graph keeps its ops alive meanwhile):
    # one dict lookup per node instead of three memoized schema queries.
    facts: dict[int, tuple[OpClass, tuple[int, ...]]] = {}
    nodes = list(graph.nodes)
    for node in nodes:
        c, src = OTHER, None
        if node.op == "call_function":
            target = node.target
            f = facts.get(id(target))
            if f is None:
                f = facts[id(target)] = _node_facts(target)
            c = f[0]
            if c == WAIT:
                src = node.args[0]
                start = start_of(node)
                if start is not None:
                    starts[node] = start
            elif target is operator.getitem:
                src = node.args[0]
                # getitem of a multi-output op picks a distinct tensor: it aliases only itself.
                if isinstance(src, fx.Node) and root[src] is src:
                    src = None
            else:
                src = _first_node_at(node.args, f[1])
        classes[node] = c
        if isinstance(src, fx.Node):
            root[node] = root[src]
            continue
        root[node] = node
        uses[node] = []
        if node.op in ("placeholder", "get_attr"):
            pinned.add(node)
            size[node] = 0
        else:
            size[node] = value_bytes(node.meta.get("val"))
    for node in nodes:
        if node.op == "output":
            pinned.update(root[i] for i in node.all_input_nodes)
            continue
        # roots_used, computed once (schedulers ask per step)
        inputs = node._input_nodes   # all_input_nodes without the list copy
        start = starts.get(node)
        if start is not None:
            inputs = [*inputs, *start._input_nodes]
        rs = [root[i] for i in inputs]
        if len(rs) > 1:
            rs = list(dict.fromkeys(rs))
        touches[node] = rs
        for r in rs:
            uses[r].append(node)
    for r in pinned:
        size[r] = 0
    return st


def _first_node_at(args: tuple, positions: tuple[int, ...]) -> fx.Node | None:
    """The node at the first of ``positions`` in ``args`` (or the first node of a list there):
    how schema alias positions are read."""
    for i in positions:
        if i >= len(args):
            break
        value = args[i]
        if isinstance(value, fx.Node):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], fx.Node):
            return value[0]
    return None


class LiveBytes:
    """Live bytes of an order built backwards, from its last node to its first: the one
    peak-memory model of fcoll (the scheduler plans backwards and counts with it as it places;
    :func:`peak_bytes` feeds it a finished order reversed).

    Method: a root's storage is live from the node that allocates it (the root) through the last
    node that touches it (``Storage.touches``). Placing ``n`` backwards, every root ``n`` touches
    is used at or after ``n``; when the root itself is placed, its storage is allocated there, so
    it is not live before it. Hence ``live`` before ``n``'s own allocation is exactly the bytes
    allocated earlier and used at or after ``n``: the live bytes when ``n`` runs forwards. Peaks
    are counted at allocations only (nothing else raises the live bytes); a value nothing uses
    counts at its allocation and is freed at once.

    Attributes:
        live: bytes live (forwards) just before the last placed node runs, its allocation
            excluded.
        peak: the largest ``live + allocation`` over the placed nodes, in bytes.
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.touched: set[fx.Node] = set()
        self.live = 0
        self.peak = 0

    def place(self, node: fx.Node) -> None:
        """Account for ``node``, which runs before every node placed so far."""
        st, touched = self.storage, self.touched
        used = st.touches.get(node)
        live = self.live
        for r in used if used is not None else st.roots_used(node):
            if r not in touched:
                touched.add(r)
                live += st.size[r]
        if st.root.get(node) is node:
            b = st.size[node]
            if node in touched:
                live -= b   # running backwards: its storage is allocated here
            if live + b > self.peak:
                self.peak = live + b
        self.live = live


def peak_bytes(order: Iterable[fx.Node], storage: Storage | None = None) -> int:
    """Peak live bytes (excluding pinned storages) of running the nodes in ``order``: the
    :class:`LiveBytes` model, fed ``order`` from its last node to its first."""
    order = list(order)
    if storage is None:
        storage = storage_model(order[0].graph) if order else Storage()
    tracker = LiveBytes(storage)
    place = tracker.place
    for node in reversed(order):
        place(node)
    return tracker.peak


def mutation_deps(order: Sequence[fx.Node], storage: Storage) -> list[tuple[fx.Node, fx.Node]]:
    """Edges ``(before, after)`` that keep writes ordered with the reads of the same storage.

    For each node ``m`` that writes storage ``r``: every earlier node touching ``r`` precedes
    ``m``, and every later node touching ``r`` follows ``m`` and, if ``m`` is a collective, its
    waits that came before that node. ``order`` is the original order.
    """
    pos = {n: i for i, n in enumerate(order)}
    edges: list[tuple[fx.Node, fx.Node]] = []
    writes: dict[int, bool] = {}   # id(op) -> it has Tensor(a!) arguments, for this call only
    for m in order:
        target = m.target
        if m.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        w = writes.get(id(target))
        if w is None:
            w = writes[id(target)] = bool(_write_arguments(target))
        if not w:
            continue
        written = {storage.root[x] for x in written_inputs(m)}
        if not written:
            continue
        waits = waits_of(m) if is_collective(m) else []
        for r in written:
            for other in storage.uses.get(r, []):
                if other is m or other in waits:
                    continue
                if pos[other] < pos[m]:
                    edges.append((other, m))
                else:
                    edges.append((m, other))
                    edges.extend((w, other) for w in waits if pos[w] < pos[other])
    return edges
