"""The reducing collectives of :class:`~fcoll.shm.group.process_group.FcollProcessGroup`.

all_reduce (in place and out of place), reduce, all_reduce_coalesced (in place and out of place)
and reduce_scatter (tensor, list and coalesced forms): each checks its arguments (reduce op
included, see :func:`fcoll.ops.reduce.check_reduce_op`), stages its inputs and submits an
algorithm of :mod:`fcoll.shm.kernels.reductions` through the group's ``_submit`` (or, on the CUDA
IPC path, a kernel body of :mod:`fcoll.shm.cuda.submission`).

They are a mixin of the group (:class:`ReducingCollectives`) so that each file holds one idea:
in ``process_group.py``, the group (lifecycle, submission) and its data-movement collectives;
here, the collectives that take a reduce op. :func:`fcoll.compat.run_eagerly_under_dynamo` walks
the group's MRO, so these methods are eager entry points under Dynamo like the group's own.

Shapes per rank (n = group size): all_reduce ``[*] -> [*]``; reduce_scatter ``[n * N, ...] ->
[N, ...]``; reduce in place. ``avg`` is valid on every dtype but bool, and truncates toward zero
on integers (:mod:`fcoll.ops.reduce`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fcoll.ops.reduce import check_reduce_op, reduce_op_name
from fcoll.shm.kernels import reductions
from fcoll.shm.group import arg_checks as checks
from fcoll.shm.cuda.paths import IpcBuffers
from fcoll.shm.cuda.staging import CudaStaging
from fcoll.shm.group.fast_paths import plain
from fcoll.shm.group.sparse import is_sparse_coo, sparse_all_reduce
from fcoll.shm.transport.headers import NO_ROOT, dtype_name, header_dtype
from fcoll.shm.transport.phases import Call
from fcoll.shm.group.validate import Staging, check_reduce_scatter, check_tensor


class ReducingCollectives:
    """Mixin: the collectives of :class:`~fcoll.shm.group.process_group.FcollProcessGroup` that
    take a reduce op. The host class provides ``_rank``, ``_size``, ``_coalescing``, ``_fast``,
    ``_cuda``, ``_submit`` and the CUDA helpers of
    :class:`~fcoll.shm.cuda.submission.CudaSubmission`."""

    def allreduce(self, tensors, opts=None) -> dist.Work:
        if (opts is not None and not opts.asyncOp and len(tensors) == 1
                and self._coalescing is None):
            work = self._fast.all_reduce(tensors[0], opts.reduceOp)
            if work is not None:
                return work
        opts = opts if opts is not None else dist.AllreduceOptions()
        if is_sparse_coo(tensors):  # DDP's gradient of a sparse embedding
            return sparse_all_reduce(self, tensors[0], reduce_op_name(opts.reduceOp),
                                     self._coalescing is not None)
        return self._allreduce("all_reduce", tensors, reduce_op_name(opts.reduceOp), opts=opts)


    def _allreduce(self, name: str, tensors, op: str, root: int | None = None,
                   opts=None) -> dist.Work:
        err = checks.all_reduce_error(tensors, op, self._size, root)
        if err and not (checks.is_seq(tensors) and len(tensors) == 1):
            return self._submit(name, None, reduce_op=op, error=err)
        t = tensors[0]
        err = err or self._device_error([("tensor", t)])
        hroot = NO_ROOT if root is None else root
        if err:
            return self._submit(name, t, reduce_op=op, root=hroot, error=err)
        if t.is_cuda and self._cuda_setup(name, t, reduce_op=op, root=hroot) == "ipc":
            return self._ipc_all_reduce(name, t, None, op, [t], opts, root=hroot)
        st = self._staging(t)
        flat = st.inout(t).view(-1)
        writes = root is None or root == self._rank

        def run(c: Call) -> None:
            reductions.all_reduce(c, flat, flat if writes else None, op)

        return self._submit(name, t, reduce_op=op, root=NO_ROOT if root is None else root,
                            run=run, st=st, result=[t], opts=opts)


    def allreduce_out_of_place(self, input: torch.Tensor, output: torch.Tensor,
                               op: dist.ReduceOp) -> dist.Work:
        """All-reduce ``input`` into ``output`` (same shape and dtype), leaving ``input`` alone,
        asynchronously (the call returns at once; the ``Work`` completes it).

        The functional ``all_reduce`` would otherwise clone its input and reduce the clone in
        place: a full extra copy, which this path does not make (the algorithm reads the input
        into the shared slots and reduces into the output). Ranks may mix this and
        ``allreduce``: the header is the same.

        Raises (through the Work, on every rank): the errors of ``allreduce`` for ``input``;
        ``output`` of another shape or dtype is a ``ValueError`` here.
        """
        if output.shape != input.shape or output.dtype != input.dtype:
            raise ValueError(f"fcoll all_reduce: rank {self._rank}: output {tuple(output.shape)} "
                             f"{output.dtype} does not match input {tuple(input.shape)} "
                             f"{input.dtype}")
        name, red = "all_reduce", reduce_op_name(op)
        err = (check_tensor(input, "input") or check_tensor(output, "output", True)
               or check_reduce_op(red, input.dtype)
               or self._device_error([("input", input), ("output", output)]))
        if err:
            return self._submit(name, input, reduce_op=red, error=err)
        if input.is_cuda and self._cuda_setup(name, input, reduce_op=red) == "ipc":
            return self._ipc_all_reduce(name, input, output, red, [output],
                                        dist.AllreduceOptions())
        st = self._staging(input)
        src, dst = st.input(input).view(-1), st.output(output).view(-1)

        return self._submit(name, input, reduce_op=red,
                            run=lambda c: reductions.all_reduce(c, src, dst, red), st=st,
                            result=[output], opts=dist.AllreduceOptions())


    def reduce(self, tensors, opts=None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._allreduce("reduce", tensors, reduce_op_name(opts.reduceOp), opts.rootRank,
                               opts=opts)


    def allreduce_coalesced(self, tensors, opts=None) -> dist.Work:
        """All-reduce every tensor of ``tensors`` in place (any shapes, dtypes mixed): one
        collective, in which the tensors of each dtype (in order of first appearance) are
        reduced as if concatenated, through :func:`fcoll.shm.kernels.reductions.all_reduce_many` (no
        concatenated copy). Shapes and dtypes may differ by tensor, not by rank.

        The header of the first phase carries every tensor's dtype and shape, so ranks that
        pass different lists raise the same ``ValueError`` instead of hanging.
        """
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._coalesced(tensors, None, opts.reduceOp, opts)


    def allreduce_coalesced_out_of_place(self, inputs: list[torch.Tensor],
                                         outputs: list[torch.Tensor],
                                         op: dist.ReduceOp) -> dist.Work:
        """All-reduce ``inputs[i]`` into ``outputs[i]`` (same shape and dtype) for every i in one
        collective, leaving the inputs alone, asynchronously (the ``Work`` completes it).

        The functional ``all_reduce_coalesced`` would otherwise clone every input and reduce
        the clones in place; here the algorithm reads each input into the shared slots and
        reduces straight into its output. Ranks may mix this and ``allreduce_coalesced``: the
        header is the same. Outputs must not overlap any input.

        Raises (through the Work, on every rank): the errors of ``allreduce_coalesced`` for
        ``inputs``; lists of different lengths, or an output of another shape or dtype than
        its input, are a ``ValueError`` here.
        """
        if len(inputs) != len(outputs):
            raise ValueError(f"fcoll all_reduce_coalesced: rank {self._rank}: {len(outputs)} "
                             f"outputs for {len(inputs)} inputs")
        for i, (x, y) in enumerate(zip(inputs, outputs)):
            if y.shape != x.shape or y.dtype != x.dtype:
                raise ValueError(f"fcoll all_reduce_coalesced: rank {self._rank}: outputs[{i}] "
                                 f"{tuple(y.shape)} {y.dtype} does not match inputs[{i}] "
                                 f"{tuple(x.shape)} {x.dtype}")
        return self._coalesced(inputs, outputs, op, None)


    def _coalesced(self, inputs, outputs, rop, opts) -> dist.Work:
        """``allreduce_coalesced`` (``outputs`` None: in place) and its out-of-place form.

        A bucket holds hundreds of tensors, so the per-tensor work on the calling thread is
        kept to one pass: dense contiguous CPU tensors outside autograd (the common case) are
        used as they are, without ``Staging``'s detach and device checks. The algorithm runs
        under ``no_grad``: autograd may wrap an output once the op has returned it, before
        the collective writes it."""
        op = reduce_op_name(rop)
        name = "all_reduce_coalesced"
        err = None
        on_cuda = False
        for i, x in enumerate(inputs):  # one pass; the usual tensor costs two attribute reads
            if type(x) is not torch.Tensor or not x.is_cpu:
                err = err or check_tensor(x, f"tensors[{i}]", outputs is None)
                on_cuda = on_cuda or getattr(x, "is_cuda", False)
        if outputs is not None:
            for i, y in enumerate(outputs):
                if type(y) is not torch.Tensor or not y.is_cpu:
                    err = err or check_tensor(y, f"outputs[{i}]", True)
                    on_cuda = on_cuda or getattr(y, "is_cuda", False)
        if err is not None:
            return self._submit(name, None, reduce_op=op, error=err)
        if on_cuda:
            named = [(f"tensors[{i}]", x) for i, x in enumerate(inputs)]
            if outputs is not None:
                named += [(f"outputs[{i}]", y) for i, y in enumerate(outputs)]
            err = self._device_error(named)
        st = CudaStaging(self._cuda) if on_cuda and err is None else Staging()
        groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        sig = []
        for i, x in enumerate(inputs):
            dt = x.dtype
            sig.append((header_dtype(dtype_name(dt), x), tuple(x.shape)))
            if err is not None:
                continue  # the whole signature still goes into the header
            o = x if outputs is None else outputs[i]
            is_plain = plain(o)
            err = check_reduce_op(op, dt)
            if err is not None:
                err = f"tensors[{i}]: {err}"
            elif not is_plain:
                err = (check_tensor(o, f"tensors[{i}]" if outputs is None else f"outputs[{i}]",
                                    True) or check_tensor(x, f"tensors[{i}]"))
            if err is not None:
                continue
            srcs, dsts = groups.get(dt) or groups.setdefault(dt, ([], []))
            if outputs is None:
                srcs.append(_flat(x) if is_plain else st.inout(x).view(-1))
            else:
                srcs.append(_flat(x) if plain(x) else st.input(x).view(-1))
                dsts.append(_flat(o) if is_plain else st.output(o).view(-1))
        sig = tuple(sig)
        if err:
            return self._submit(name, None, reduce_op=op, extra=sig, error=err)
        if on_cuda and self._cuda_setup(name, None, reduce_op=op, extra=sig) == "ipc":
            return self._ipc_coalesced(inputs, outputs, op, sig, opts)

        def run(c: Call) -> None:
            with torch.no_grad():
                reductions.all_reduce_by_dtype(c, groups, outputs is None, op)

        return self._submit(name, None, reduce_op=op, extra=sig, run=run, st=st,
                            result=list(inputs if outputs is None else outputs),
                            opts=opts if opts is not None else dist.AllreduceCoalescedOptions())


    def reduce_scatter_single(self, output, input,  # noqa: A002
                              opts=None) -> dist.Work:
        if opts is not None and not opts.asyncOp and self._coalescing is None:
            work = self._fast.reduce_scatter(output, input, opts.reduceOp)
            if work is not None:
                return work
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        name = "reduce_scatter_tensor"
        op = reduce_op_name(opts.reduceOp)
        n = self._size
        err = (check_reduce_scatter(input, output, n) or check_reduce_op(op, input.dtype)
               or self._device_error([("input", input), ("output", output)]))
        if err:
            return self._submit(name, input, reduce_op=op, error=err)
        if input.is_cuda and self._cuda_setup(name, input, reduce_op=op) == "ipc":
            cg = self._cuda
            src = self._dense(input).view(-1)
            dst = self._dense_out(output)

            def body(c: Call, ipc: IpcBuffers) -> None:
                cg.reduce_scatter(c, ipc, src, dst.view(-1), op)
                self._write_back(output, dst)

            return self._submit_ipc(name, input, body, [input, output, src, dst], [output],
                                    opts, reduce_op=op)
        st = self._staging(input)
        src = st.input(input).view(n, -1)
        dst = st.output(output).view(-1)
        return self._submit(name, input, reduce_op=op,
                            run=lambda c: reductions.reduce_scatter(c, src, dst, op), st=st,
                            result=[output], opts=opts)


    def reduce_scatter(self, output_tensors, input_lists, opts=None) -> dist.Work:
        """List form: ``output_tensors[0]`` receives the reduction over ranks of their
        ``input_lists[0][rank]``; every input is checked before anything moves."""
        n = self._size
        name = "reduce_scatter"
        op = reduce_op_name(opts.reduceOp) if opts is not None else "sum"
        err = checks.list_error("output_tensors", output_tensors, 1) or checks.list_error(
            "input_tensors", input_lists, 1)
        err = err or checks.list_error("input_tensors", input_lists[0], n) or check_tensor(
            output_tensors[0], "output_tensors[0]", True)
        err = err or checks.inputs_like_error(input_lists[0], output_tensors[0])
        if err:
            return self._submit(name, None, reduce_op=op, error=err)
        stacked = torch.stack([i.detach().reshape(-1).cpu() for i in input_lists[0]])
        return self.reduce_scatter_single(output_tensors[0], stacked.view(-1), opts)


    def reduce_scatter_single_coalesced(self, outputs, inputs,
                                        opts=None) -> dist.Work:
        err = checks.pairs_error("outputs", outputs, "inputs", inputs)
        if err:
            return self._submit("reduce_scatter_tensor", None, error=err)
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self.barrier()

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.view(-1)
