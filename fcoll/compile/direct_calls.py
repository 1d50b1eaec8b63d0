"""Which collectives of a compiled graph take the direct path, and their prepared calls; which
of the others may read their inputs in place.

The executor (:mod:`fcoll.compile.executor`) runs a collective node through its op (the c10d
path: dispatcher, Python kernel, process-group method, ``Work``, in-flight registry) unless
:func:`direct_impls` gives the node a prepared call of :mod:`fcoll.shm.group.direct`, checked once
here. A node qualifies when all of these hold, read from the graph once:

- it is ``fcoll.all_reduce`` (the gradient and bucket graphs), ``fcoll.all_gather_into_tensor``
  or ``fcoll.reduce_scatter_tensor`` (sharded parameters and gradients), :data:`DIRECT_OPS`;
  the other ops (coalesced, in-place, all_to_all, broadcast, p2p) keep the c10d path;
- its group is fcoll's shared-memory group of 2 ranks or more (gloo, nccl, the fake group and
  groups of one rank keep the c10d path);
- its input's ``meta["val"]`` is a CPU tensor of static shape (symbolic shapes keep the
  c10d path and its per-call checks), and the reduce op is defined for its dtype (an invalid
  one, or a ``group_size`` that is not the group's, keeps the c10d path, which raises the op's
  own error on every rank);
- every user of the node is a ``wait_tensor`` in this graph (an output that leaves the graph
  un-waited is waited through the in-flight registry, which only the c10d path fills).

The node's waits get the call's ``wait``. Both show in ``torch.profiler`` as the ops they stand
for would (``fcoll::all_reduce``, ``fcoll::wait_tensor``), so a profile of a compiled step shows
where it waits whichever path ran (:func:`_in_profile`). A call whose first wait is the very
next step of the executor's plan runs synchronously (nothing could overlap it). Each call
carries a call-site tag in its header: the first 12 hex digits of the group's
collective-sequence digest (:func:`fcoll.passes.analysis.fingerprints.fingerprint`, the rank
check's) and the call's index in that sequence, so ranks running different call sites at one sequence number
raise a mismatch.

**Inputs read in place** (:func:`lent_inputs`). Off the direct path, a functional collective's
kernel copies its inputs, since its caller may write them once the op returns
(:func:`fcoll.ops.library.borrowing_inputs`). The executor writes nothing a graph does not, so
it lends the inputs of a collective that copies them (:data:`fcoll.ops.library.COPYING_OPS`)
when its inputs are CPU tensors (CUDA inputs keep the copy: the CUDA paths' stream and
allocator rules for a lent input are not yet checked on a GPU, #29), every result of that
collective is waited in the graph (it completes before the graph returns) and no node of the
graph writes the storage of any of its inputs (the ``Tensor(a!)``
arguments of :func:`fcoll.passes.analysis.memory.written_inputs`, through views). SimpleFSDP's
block reduce_scatters are such calls: lent, a block's float32 gradients are not held twice
while their bucket is in flight (3 MiB of the 4-block GPT's bf16 step on gloo).
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Sequence

import torch
import torch.autograd.profiler as _profiler
import torch.fx as fx

from fcoll.ops.groups import group_from_name
from fcoll.ops.library import COPYING_OPS
from fcoll.passes.analysis.fingerprints import collectives_by_group, fingerprint
from fcoll.passes.analysis.memory import storage_model, written_inputs
from fcoll.passes.rewrites.consistency import META_RANK_CHECK
from fcoll.passes.graph import is_wait

__all__ = ["direct_impls", "lent_inputs", "tag_for", "DIRECT_OPS"]

_OPS = torch.ops.fcoll
#: the ops that take the direct path (their ``.default`` overloads)
DIRECT_OPS = frozenset({_OPS.all_reduce.default, _OPS.all_gather_into_tensor.default,
                        _OPS.reduce_scatter_tensor.default})

log = logging.getLogger(__name__)


def tag_for(digest: str, index: int) -> str:
    """The header tag of call ``index`` of a group's collective sequence of ``digest``."""
    return f"site {digest[:12]}#{index}"


def _static_cpu_tensor(val: Any) -> bool:
    return (isinstance(val, torch.Tensor) and val.device.type == "cpu"
            and all(isinstance(d, int) for d in val.shape))


def _group(name: Any) -> Any | None:
    from fcoll.shm.group.direct import direct_group

    try:
        return direct_group(group_from_name(name))
    except ValueError:
        return None


def _prepare(node: fx.Node, pg: Any, val: torch.Tensor, tag: str, sync: bool) -> Any:
    """The prepared call of collective ``node`` (one of :data:`DIRECT_OPS`).

    Raises:
        ValueError: the call cannot take the direct path (an invalid reduce op, a group size
            that is not the group's, a shape the op rejects): the op raises its own error.
    """
    from fcoll.shm.group import direct

    shape, a = tuple(val.shape), node.args
    if node.target is _OPS.all_reduce.default:
        return direct.DirectAllReduce(pg, val.dtype, shape, a[1], tag=tag, sync=sync)
    if node.target is _OPS.all_gather_into_tensor.default:
        _same_size(a[1], pg)
        return direct.DirectAllGather(pg, val.dtype, shape, tag=tag, sync=sync)
    _same_size(a[2], pg)
    return direct.DirectReduceScatter(pg, val.dtype, shape, a[1], tag=tag, sync=sync)


def _in_profile(range_name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, run inside a ``torch.profiler`` range ``range_name`` while a profiler records
    (the op the direct path replaces would be one); one attribute read more otherwise."""
    def run(*args: Any, **kwargs: Any) -> Any:
        if _profiler._is_profiler_enabled:
            with torch.profiler.record_function(range_name):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return run


def _same_size(group_size: Any, pg: Any) -> None:
    if group_size != pg.size():
        raise ValueError(f"group_size={group_size} but the group has {pg.size()} ranks")


def direct_impls(gm: fx.GraphModule, items: Sequence[Any], name: str
                 ) -> dict[fx.Node, Callable[..., Any]]:
    """Prepared calls for the collectives of ``gm`` that take the direct path, and their waits.

    Args:
        gm: the lowered graph (after the passes).
        items: the executor's plan order (FX nodes, or segment steps), for the sync rule.
        name: the graph's name, for logs.

    Returns:
        node -> implementation, for each qualifying collective node and each of its waits.
    """
    targets = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in DIRECT_OPS]
    if not targets:
        return {}
    digests = {g: rc.fingerprint for g, rc in gm.meta.get(META_RANK_CHECK, {}).items()}
    position = {item: i for i, item in enumerate(items) if isinstance(item, fx.Node)}
    index: dict[fx.Node, int] = {}   # node -> its index in its group's sequence
    for nodes in collectives_by_group(gm).values():
        index.update((n, i) for i, n in enumerate(nodes))
    impls: dict[fx.Node, Callable[..., Any]] = {}
    for node in targets:
        inp, group_name = node.args[0], node.args[-1]
        val = inp.meta.get("val") if isinstance(inp, fx.Node) else None
        users = list(node.users)
        if node.kwargs or not users or not all(is_wait(u) for u in users) or \
                not _static_cpu_tensor(val):
            continue
        pg = _group(group_name)
        if pg is None:
            continue
        g = str(group_name)
        if g not in digests:
            digests.update(fingerprint(gm))
        first_wait = min(users, key=lambda u: position.get(u, len(position)))
        sync = position.get(first_wait) == position.get(node, -2) + 1
        try:
            call = _prepare(node, pg, val, tag_for(digests[g].digest, index[node]), sync)
        except ValueError as e:  # the op raises its own error, on every rank
            log.debug("%s: %s keeps the c10d path: %s", name, node.name, e)
            continue
        impls[node] = _in_profile(node.target.name(), call)
        wait = _in_profile(torch.ops.fcoll.wait_tensor.default.name(), call.wait)
        for u in users:
            impls[u] = wait
    log.debug("%s: %d of %d collectives on the direct path", name,
              sum(1 for n in impls if n in targets), len(targets))
    return impls


def _waited_here(node: fx.Node) -> bool:
    """Every result of collective ``node`` is waited in its graph (a list result: each
    ``getitem`` of it)."""
    for user in node.users:
        if is_wait(user):
            continue
        if user.target is operator.getitem and any(is_wait(u) for u in user.users):
            continue
        return False
    return bool(node.users)


def lent_inputs(gm: fx.GraphModule, skip: Any = ()) -> list[fx.Node]:
    """The collectives of ``gm`` (but ``skip``: those on the direct path) whose kernels the
    executor calls through :func:`fcoll.ops.library.borrowing_inputs`, reading their inputs in
    place (module docstring: copying ops, CPU inputs, every result waited in ``gm``, no input
    storage written by any node of ``gm``). In graph order."""
    nodes = [n for n in gm.graph.nodes
             if n.op == "call_function" and n.target in COPYING_OPS and n not in skip]
    nodes = [n for n in nodes if _waited_here(n) and all(_on_cpu(i) for i in n.all_input_nodes)]
    writes = [w for n in gm.graph.nodes for w in written_inputs(n)]
    if not nodes or not writes:   # a functional graph: no storage model needed
        return nodes
    root = storage_model(gm.graph).root
    written = {root[w] for w in writes}
    return [n for n in nodes if not any(root[i] in written for i in n.all_input_nodes)]


def _on_cpu(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "cpu"
