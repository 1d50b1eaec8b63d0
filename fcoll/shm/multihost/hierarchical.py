"""``HierarchicalProcessGroup``: an fcoll group whose ranks span several hosts.

:func:`fcoll.shm.create_process_group` builds one when a group's ranks have more than one host
identity (:mod:`fcoll.shm.multihost.host_layout`). It holds three groups, made in this order on
every rank:

- ``intra``: an :class:`~fcoll.shm.group.process_group.FcollProcessGroup` of the ranks of this host
  (shared memory), on the store prefix ``intra/<host>/``; absent on a host with one rank;
- ``inter``: a gloo group of the ranks with this rank's *local rank* on every host (host ``h``
  is its group rank ``h``), on ``inter/<local rank>/``; only when every host holds the same
  number of ranks (an *even* layout);
- ``flat``: a gloo group of all ranks (``flat/``), for the ops and layouts composition does
  not serve.

With H hosts of L ranks each (n = H * L), a rank (host h, local rank l) runs, per op:

================  ===============================================================================
all_reduce        intra reduce_scatter -> shard of N/L (padded); inter all_reduce of the shard;
                  intra all_gather. Inter-host bytes per host: 2 (H-1)/H * N, the minimum
                  (a flat ring over n ranks crossing hosts sends 2 (n-1)/n * N over each
                  crossing link). avg reduces with sum and divides by n once.
all_gather        inter all_gather ([H, N]: rank (h', l)'s inputs), intra all_gather
                  ([L, H, N]), one index_select into group-rank order.
reduce_scatter    rows reordered so that local rank l' owns the rows of ranks (*, l'); intra
                  reduce_scatter -> [H, N]; inter all_to_all + a local reduction of the H rows
                  (every dtype and reduce op, and (H-1)/H of the rows sent: gloo's own
                  reduce_scatter measured as slow as its all_reduce of the whole input).
broadcast         inter broadcast among the root's local rank, then intra broadcast.
reduce            all_reduce into a scratch copy; only the root writes its tensor.
barrier           intra barrier, then inter barrier (a rank passes the inter barrier only once
                  every host's ranks passed their intra barrier).
coalesced forms   all_reduce: tensors of each dtype concatenated, one all_reduce each;
                  all_gather / reduce_scatter: one composed op per tensor, one Work.
================  ===============================================================================

Fallbacks to ``flat`` (documented choices): every op on an uneven layout (3 ranks on one host,
1 on another: correct, slower); all_to_all (every byte bound for another host crosses the link
whatever the composition, and split sizes differ by rank, so there is nothing to save);
gather, scatter and point-to-point. Inter-host all_reduce of a dtype/op gloo cannot reduce
(complex product, ...) runs as an inter all_gather and a local reduction.

Ops run in issue order, one at a time, on the group's worker thread or on the thread that
waits for one (:class:`~fcoll.shm.multihost.ordered_queue.OrderedRunner`: every rank issues the
inner groups' collectives in the same order); a ``Work`` completes when its op ran. CPU
tensors are tested; CUDA tensors go through the inner groups' own CUDA support, untested here.

No size threshold switches small ops to ``flat``: gloo aborts on mismatched sizes, so a flat
op needs the same argument check across the link as a composed one (an intra-host exchange of
the arguments and one inter-host exchange), and check + flat measured slower than the composed
steps at 64 KiB - 1 MiB (docs/design.md, "Across hosts"). The algorithm therefore depends on
the layout alone, the same on every rank.

The class holds the sub-groups, lifecycle, the queue and the pre-flight, every op's argument
check, and the ops that always run on ``flat`` (all_to_all, gather, scatter, point-to-point).
The compositions of the table above are algorithms over the group's
:class:`~fcoll.shm.multihost.compositions.Subgroups` (:mod:`fcoll.shm.multihost.compositions`);
the c10d identity is :class:`~fcoll.shm.group.identity.GroupIdentity`'s.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import datetime
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fcoll.ops.reduce import reduce_op_name
from fcoll.compat import run_eagerly_under_dynamo
from fcoll.shm.group import arg_checks as checks
from fcoll.shm.group.identity import GroupIdentity
from fcoll.shm.group.sparse import is_sparse_coo, sparse_all_reduce
from fcoll.shm.group.validate import check_all_gather
from fcoll.shm.multihost import compositions as comp
from fcoll.shm.kernels import movement
from fcoll.shm.transport.fences import GAVE_UP_PEER_GAVE_UP, PeerError
from fcoll.shm.transport.op_codes import dtype_code, kind_code
from fcoll.shm.multihost.ordered_queue import ChainedWork, HierarchicalWork, OrderedRunner
from fcoll.shm.multihost.host_layout import HostLayout
from fcoll.shm.multihost.gloo_link import REDUCE_CODES, SIGNATURE, agree, as_bytes
from fcoll.shm.group.process_group import FcollProcessGroup

__all__ = ["HierarchicalProcessGroup", "HierarchicalWork"]


#: gloo's words for a connection its peer closed or reset (``gloo/transport/tcp/pair.cc``)
_CLOSED_LINK = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


@run_eagerly_under_dynamo
class HierarchicalProcessGroup(GroupIdentity, dist.ProcessGroup):
    """fcoll process group over several hosts: shared memory inside a host, gloo between hosts.

    Args:
        store: the group's store; sub-groups use ``PrefixStore``s of it.
        rank, size: this rank and the group size.
        timeout: timeout of every sub-group.
        layout: which group ranks share a host (the same on every rank).
        global_ranks: global rank of each group rank (for error messages).

    Shapes per rank are those of :class:`~fcoll.shm.group.process_group.FcollProcessGroup`.

    Raises (from the methods): ``ValueError`` naming op, rank and shapes for arguments invalid
    on this rank (a reduce op undefined for the dtype, an all_gather output that is not
    ``size`` times the input, ...); errors of the inner groups through ``Work.wait``.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                 layout: HostLayout, global_ranks: list[int] | None = None):
        super().__init__(rank, size)
        self._init_identity(rank, size, global_ranks)
        self.layout = layout
        self.host = layout.host_of(rank)
        self.local_rank = layout.local_rank_of(rank)
        members = layout.ranks_of[self.host]
        self._intra: FcollProcessGroup | None = None
        if len(members) > 1:
            self._intra = FcollProcessGroup(
                dist.PrefixStore(f"intra/{self.host}/", store), self.local_rank, len(members),
                timeout, global_ranks=[self._global_ranks[r] for r in members])
        self._inter: dist.ProcessGroup | None = None
        if layout.even:
            self._inter = dist.ProcessGroupGloo(
                dist.PrefixStore(f"inter/{self.local_rank}/", store), self.host,
                layout.num_hosts, timeout=timeout)
        self._flat = dist.ProcessGroupGloo(dist.PrefixStore("flat/", store), rank, size,
                                           timeout=timeout)
        H = layout.num_hosts
        gather_order = scatter_order = None
        if layout.even:
            L = len(members)
            # all_gather: rows arrive as [l][h]; row l*H+h is group rank (h, l)'s
            gather_order = torch.tensor(
                [layout.local_rank_of(r) * H + layout.host_of(r) for r in range(size)])
            # reduce_scatter: local rank l' receives the rows of ranks (0, l'), ..., (H-1, l')
            scatter_order = torch.tensor(
                [layout.rank_at(h, lq) for lq in range(L) for h in range(H)])
        self._sub = comp.Subgroups(layout, rank, size, self.local_rank, self._intra, self._inter,
                                   self._flat, gather_order, scatter_order)
        self._runner = OrderedRunner(f"fcoll-hier-r{rank}")
        self._lock = threading.Lock()
        self._coalescing: list[cf.Future] | None = None
        self._broken: BaseException | None = None

    # ---- identity (GroupIdentity), lifecycle -----------------------------------------------
    def __repr__(self) -> str:
        hosts = "x".join(str(len(rs)) for rs in self.layout.ranks_of)
        return (f"HierarchicalProcessGroup(rank={self._rank}, size={self._size}, "
                f"hosts={hosts}, name={self._group_name!r})")

    def shutdown(self) -> None:
        self._runner.shutdown()
        if self._intra is not None:
            self._intra.shutdown()

    def abort(self) -> None:
        """c10d's ``ProcessGroup.abort``: queued ops are cancelled, the same-host peers are
        fenced (:meth:`FcollProcessGroup.abort`) and the gloo groups destroyed, which closes
        their connections, so a peer on any host waiting in an op of this group raises at once
        (gloo reports the closed connection; :meth:`_submit` names it) instead of at the group
        timeout."""
        self._runner.shutdown(cancel=True)
        self._break(None)

    def _break(self, error: BaseException | None) -> None:
        """Make the group unusable on this rank (``error``: why; None: aborted) and tell every
        peer: the intra-host group is aborted (its fence names this rank) and the gloo groups
        are destroyed (their connections close, so a cross-host peer's op fails at once)."""
        with self._lock:
            if self._broken is not None:
                return
            self._broken = error if error is not None else RuntimeError("it was aborted")
        if self._intra is not None:
            self._intra.abort()
        # gloo's abort() leaves its connections open (measured, torch 2.11 and 2.13); they
        # close when the group is destroyed: here, or when an op running on the runner
        # thread lets go of it
        self._inter = self._flat = None
        self._sub = dataclasses.replace(self._sub, inter=None, flat=None)

    # ---- submission -----------------------------------------------------------------------
    def _error(self, op: str, msg: str) -> ValueError:
        return ValueError(f"fcoll {op}: rank {self._rank} (global rank "
                          f"{self._global_ranks[self._rank]}): {msg}")

    def _submit(self, fn: Callable[[], Any]) -> HierarchicalWork:
        """Queue ``fn`` (one op) on the runner.

        An op that fails other than by a ``ValueError`` or ``TypeError`` (invalid or mismatched
        arguments, raised on every rank: :func:`~fcoll.shm.multihost.gloo_link.agree`; the
        group stays usable) breaks the group (:meth:`_break`): its peers, on this host and
        across the link, raise at once rather than at the timeout, and later ops raise naming
        the first error. gloo's error for a connection a peer closed (that peer aborted or
        broke the group, or died) is raised as a :class:`PeerError` that says so.
        """
        def run():
            if self._broken is not None:
                raise RuntimeError(f"fcoll: rank {self._rank} (global rank "
                                   f"{self._global_ranks[self._rank]}): the process group is "
                                   f"unusable after an earlier error: {self._broken}")
            try:
                # below autograd, as a C++ backend writes its outputs: in place, leaving
                # their version counters alone
                with torch._C._AutoDispatchBelowADInplaceOrView():
                    return fn()
            except (ValueError, TypeError):   # arguments: every rank raises, as gloo_link.agree
                raise
            except BaseException as e:
                broken_meanwhile = self._broken
                error = self._link_error(e) or e
                self._break(error)
                if broken_meanwhile is not None:   # aborted on another thread while it ran
                    raise RuntimeError(
                        f"fcoll: rank {self._rank} (global rank "
                        f"{self._global_ranks[self._rank]}): the process group became "
                        f"unusable while this op ran: {broken_meanwhile}") from e
                if error is e:
                    raise
                raise error from e

        with self._lock:
            fut = self._runner.submit(run)
            if self._coalescing is not None:
                self._coalescing.append(fut)
        return HierarchicalWork([fut], self._runner)

    def _link_error(self, e: BaseException) -> PeerError | None:
        """gloo's error for a closed or reset connection as a :class:`PeerError` naming this
        rank, or None for any other error."""
        text = str(e)
        if not isinstance(e, RuntimeError) or not any(m in text for m in _CLOSED_LINK):
            return None
        return PeerError(
            f"fcoll: rank {self._rank} (global rank {self._global_ranks[self._rank]}): a rank "
            f"on another host closed its connection in the middle of an op of this group (it "
            f"aborted the group, gave up an op, or died); the process group is no longer "
            f"usable. gloo said: {text.splitlines()[0][:200]}", reason=GAVE_UP_PEER_GAVE_UP)

    def _preflight(self, name: str, x: torch.Tensor | None, code: int = 0,
                   error: str | None = None, reduce_op: str = "", on_flat: bool = False) -> None:
        """The first step of every composed op: every rank learns whether any rank's arguments
        are invalid (``error``: this rank's) or differ from the others', before data moves.

        Even layout: an intra-host header exchange (fcoll's own: op, dtype, shape, reduce op,
        ``code``; an invalid rank's header carries its message), then :func:`agree` on
        ``inter`` (op, dtype, numel, ``code``; a rank whose host failed sends the error), so a
        failure anywhere reaches every host: its own host through the header, each other host
        through the column of every rank of the failing host. Uneven layout: :func:`agree` on
        ``flat`` (also for the ops that run on ``flat``: ``on_flat``). Every rank makes the same
        calls whatever failed, so the group stays in step and usable after a refused call.

        Raises:
            ValueError: some rank's arguments are invalid (that rank's message), or ranks
                passed different arguments.
        """
        numbers = [kind_code(name), dtype_code(x.dtype) if x is not None else -1,
                   x.numel() if x is not None else -1, code]
        failure: BaseException | None = self._error(name, error) if error else None
        if on_flat or not self.layout.even:
            agree(self._flat, name, self._rank, numbers, SIGNATURE, failure)
            return
        if self._intra is not None:
            try:
                self._intra._submit(name, x, reduce_op=reduce_op, extra=("preflight", code),
                                    error=error, run=movement.barrier).wait()
            except Exception as e:  # noqa: BLE001  the hosts across the link must hear of it
                failure = e
        agree(self._inter, name, self._rank, numbers, SIGNATURE, failure)

    def _op(self, name: str, x, error: str | None, run: Callable[[], Any], code: int = 0,
            reduce_op: str = "", on_flat: bool = False) -> HierarchicalWork:
        """Queue op ``name``: its pre-flight (:meth:`_preflight`), then ``run``.

        Raises:
            ValueError: ``error`` (this rank's arguments are invalid), at once, after queueing
                the pre-flight that tells the peers (they raise the same message).
        """
        x = checks.tensor_or_none(x)
        if error is not None:
            self._submit(lambda: self._preflight(name, x, code, error, reduce_op, on_flat))
            raise self._error(name, error)

        def body():
            self._preflight(name, x, code, None, reduce_op, on_flat)
            return run()
        return self._submit(body)

    def _start_coalescing(self, device=None) -> None:
        self._coalescing = []

    def _end_coalescing(self, device=None) -> dist.Work:
        futs, self._coalescing = self._coalescing or [], None
        return HierarchicalWork(futs, self._runner)

    # ---- composed collectives (algorithms: fcoll.shm.multihost.compositions) -------------
    def allreduce(self, tensors, opts=None) -> dist.Work:
        op = reduce_op_name((opts or dist.AllreduceOptions()).reduceOp)
        if is_sparse_coo(tensors):  # DDP's gradient of a sparse embedding
            return sparse_all_reduce(self, tensors[0], op, self._coalescing is not None)
        err = checks.all_reduce_error(tensors, op, self._size)
        t = checks.first(tensors)
        return self._op("all_reduce", t, err, lambda: comp.all_reduce_into(self._sub, t, op),
                        REDUCE_CODES.get(op, -1), op)

    def allreduce_out_of_place(self, input: torch.Tensor, output: torch.Tensor,  # noqa: A002
                               op: dist.ReduceOp) -> dist.Work:
        """All-reduce ``input`` into ``output`` (same shape and dtype), input untouched."""
        name = reduce_op_name(op)
        err = checks.coalesced_all_reduce_error([input], [output], name)
        return self._op("all_reduce", input, err,
                        lambda: comp.all_reduce_into(self._sub, input, name, output),
                        REDUCE_CODES.get(name, -1), name)

    def reduce(self, tensors, opts=None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceOptions()
        op, root = reduce_op_name(opts.reduceOp), opts.rootRank
        err = checks.all_reduce_error(tensors, op, self._size, root)
        t = checks.first(tensors)
        code = REDUCE_CODES.get(op, -1) * (1 << 32) + (root if not err else 0)
        return self._op("reduce", t, err, lambda: comp.reduce_into(self._sub, t, op, root), code,
                        op)

    def allreduce_coalesced(self, tensors, opts=None) -> dist.Work:
        """All-reduce every tensor in place in one op (dtypes may mix: one composed
        all_reduce per dtype, over the tensors of that dtype concatenated)."""
        op = reduce_op_name((opts or dist.AllreduceCoalescedOptions()).reduceOp)
        err = checks.coalesced_all_reduce_error(tensors, None, op)
        code = 0 if err else comp.coalesced_code(tensors, op)
        return self._op("all_reduce_coalesced", None, err,
                        lambda: comp.all_reduce_by_dtype(self._sub, list(tensors), op), code, op)

    def allreduce_coalesced_out_of_place(self, inputs, outputs, op) -> dist.Work:
        """``outputs[i] = all_reduce(inputs[i])`` for every i, in one op; inputs untouched."""
        name = reduce_op_name(op)
        err = checks.coalesced_all_reduce_error(inputs, outputs, name)
        code = 0 if err else comp.coalesced_code(inputs, name)

        def run():
            for a, b in zip(inputs, outputs):
                b.copy_(a)
            return comp.all_reduce_by_dtype(self._sub, list(outputs), name)
        return self._op("all_reduce_coalesced", None, err, run, code, name)

    def all_gather_single(self, output, input, opts=None) -> dist.Work:
        err = check_all_gather(input, output, self._size, self._rank)
        return self._op("all_gather_into_tensor", input, err,
                        lambda: comp.all_gather_into(self._sub, output, input))

    _allgather_base = all_gather_single

    def allgather(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        """List form: ``output_tensors[0][r]`` receives rank r's ``input_tensors[0]``."""
        err = checks.all_gather_list_error(output_tensors, input_tensors, self._size, self._rank)
        inp = checks.first(input_tensors)
        if err:
            return self._op("all_gather", inp, err, list)
        outs = list(output_tensors[0])
        stacked = inp.new_empty((self._size, *inp.shape))

        def run():
            comp.all_gather_into(self._sub, stacked, inp)
            for o, s in zip(outs, stacked.unbind(0)):
                o.copy_(s)
            return [outs]
        return self._op("all_gather", inp, None, run)

    def allgather_coalesced(self, output_lists, input_list, opts=None) -> dist.Work:
        err = checks.pairs_error("output_lists", output_lists, "input_list", input_list)
        if err:
            return self._op("all_gather", None, err, list)
        works = [self.allgather([o], [i]) for o, i in zip(output_lists, input_list)]
        return HierarchicalWork([f for w in works for f in w._futures], self._runner)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        err = checks.pairs_error("outputs", outputs, "inputs", inputs)
        if err:
            return self._op("all_gather_into_tensor", None, err, list)
        works = [self.all_gather_single(o, i) for o, i in zip(outputs, inputs)]
        return HierarchicalWork([f for w in works for f in w._futures], self._runner)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single(self, output, input, opts=None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = reduce_op_name(opts.reduceOp)
        err = checks.reduce_scatter_tensor_error(output, input, op, self._size)
        return self._op("reduce_scatter_tensor", input, err,
                        lambda: comp.reduce_scatter_into(self._sub, output, input, op),
                        REDUCE_CODES.get(op, -1), op)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_lists, opts=None) -> dist.Work:
        """List form: ``output_tensors[0]`` = reduction of every rank's ``input_lists[0][me]``."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = reduce_op_name(opts.reduceOp)
        err = checks.reduce_scatter_list_error(output_tensors, input_lists, op, self._size)
        out = checks.first(output_tensors)
        if err:
            return self._op("reduce_scatter", out, err, list)
        stacked = torch.stack([i.detach().reshape(-1) for i in input_lists[0]]).view(-1)
        return self._op("reduce_scatter", out, None,
                        lambda: comp.reduce_scatter_into(self._sub, out, stacked, op),
                        REDUCE_CODES.get(op, -1), op)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        err = checks.pairs_error("outputs", outputs, "inputs", inputs)
        if err:
            return self._op("reduce_scatter_tensor", None, err, list)
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return HierarchicalWork([f for w in works for f in w._futures], self._runner)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def broadcast(self, tensors, opts=None) -> dist.Work:
        root = (opts or dist.BroadcastOptions()).rootRank
        err = checks.broadcast_error(tensors, root, self._size)
        t = checks.first(tensors)
        if err:
            return self._op("broadcast", t, err, list)
        return self._op("broadcast", t, None, lambda: comp.broadcast_into(self._sub, t, root),
                        root)

    def barrier(self, opts=None) -> dist.Work:
        return self._submit(lambda: comp.barrier(self._sub))

    # ---- on ``flat``: all_to_all ----------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None) -> dist.Work:
        """On ``flat`` (see the module docstring)."""
        o_s, i_s = list(output_split_sizes or []), list(input_split_sizes or [])
        err = checks.all_to_all_single_error(output, input, o_s, i_s, self._size)

        def run():
            self._check_splits(input, output, o_s, i_s)
            src = input.detach().contiguous()
            dst = output if output.is_contiguous() else output.contiguous()
            row = input[0].numel() * input.element_size() if input.dim() and len(input) else 0
            out_row = (output[0].numel() * output.element_size()
                       if output.dim() and len(output) else 0)
            self._flat.alltoall_base(as_bytes(dst), as_bytes(src), [s * out_row for s in o_s],
                                     [s * row for s in i_s], dist.AllToAllOptions()).wait()
            if dst is not output:
                output.copy_(dst)
            return [output]
        # split sizes differ by rank: the splits are compared in run(), the dtype here
        code = 0 if err else dtype_code(input.dtype)
        return self._op("all_to_all_single", None, err, run, code, on_flat=True)

    alltoall_base = all_to_all_single

    def _check_splits(self, input, output, o_s, i_s) -> None:
        """Every rank's dtype, row size and split sizes, checked against each other (one
        all_gather on ``flat``) before gloo moves anything."""
        n = self._size

        def rows(t: torch.Tensor) -> int:
            return t.shape[0] if t.dim() else 1

        i_eff = i_s or [rows(input) // n] * n
        o_eff = o_s or [rows(output) // n] * n
        row = input[0].numel() if input.dim() and len(input) else 0
        mine = torch.tensor([dtype_code(input.dtype), row, *i_eff, *o_eff], dtype=torch.int64)
        got = torch.empty((n, mine.numel()), dtype=torch.int64)
        self._flat._allgather_base(got.view(-1), mine).wait()
        sent, recv = got[:, 2:2 + n], got[:, 2 + n:]
        if not (bool((got[:, :2] == got[0, :2]).all()) and bool((sent == recv.t()).all())):
            raise ValueError(f"fcoll all_to_all_single: rank {self._rank}: ranks disagree on "
                             f"dtype, row size or split sizes (per rank: dtype code, row "
                             f"elements, input splits, output splits: {got.tolist()})")

    def alltoall(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        """List form, via ``all_to_all_single`` on flattened, concatenated tensors."""
        err = checks.all_to_all_error(output_tensors, input_tensors, self._size)
        if err:
            return self._op("all_to_all", None, err, list, on_flat=True)
        src = torch.cat([t.detach().reshape(-1) for t in input_tensors])
        dst = src.new_empty(sum(o.numel() for o in output_tensors))

        def run():
            size = src.element_size()
            self._flat.alltoall_base(as_bytes(dst), as_bytes(src),
                                     [o.numel() * size for o in output_tensors],
                                     [t.numel() * size for t in input_tensors],
                                     dist.AllToAllOptions()).wait()
            off = 0
            for o in output_tensors:
                o.copy_(dst[off:off + o.numel()].view(o.shape))
                off += o.numel()
            return [list(output_tensors)]
        return self._op("all_to_all", None, None, run, dtype_code(src.dtype), on_flat=True)

    # ---- on ``flat``: gather, scatter, point-to-point -------------------------------------
    def gather(self, output_lists, input_tensors, opts=None) -> dist.Work:
        root = (opts or dist.GatherOptions()).rootRank
        err = checks.gather_error(output_lists, input_tensors, root, self._rank, self._size)
        x = checks.first(input_tensors)

        def run():
            self._flat.gather(output_lists, input_tensors, opts).wait()
            return output_lists
        return self._op("gather", x, err, run, 0 if err else root, on_flat=True)

    def scatter(self, output_tensors, input_lists, opts=None) -> dist.Work:
        root = (opts or dist.ScatterOptions()).rootRank
        err = checks.scatter_error(output_tensors, input_lists, root, self._rank, self._size)
        x = checks.first(output_tensors)

        def run():
            self._flat.scatter(output_tensors, input_lists, opts).wait()
            return output_tensors
        return self._op("scatter", x, err, run, 0 if err else root, on_flat=True)

    def send(self, tensors, dstRank, tag=0) -> dist.Work:
        """Point-to-point on ``flat``, issued in queue order; the Work waits for gloo's."""
        issued = self._submit(lambda: self._flat.send(tensors, dstRank, tag))
        return ChainedWork(issued)

    def recv(self, tensors, srcRank, tag=0) -> dist.Work:
        issued = self._submit(lambda: self._flat.recv(tensors, srcRank, tag))
        return ChainedWork(issued)

    def recv_anysource(self, tensors, tag=0) -> dist.Work:
        issued = self._submit(lambda: self._flat.recv_anysource(tensors, tag))
        return ChainedWork(issued)
