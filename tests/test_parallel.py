"""``fcoll.parallel.fully_shard`` (SimpleFSDP) and tensor parallel (``parallelize_module``) on
``examples/train_gpt.py``'s GPT: loss and gradients compiled with ``backend="fcoll"`` and
``backend="inductor"`` equal the eager single-process model's, 2 ranks, on fcoll's process
group and on gloo. The model is tiny and uneven (``d_model`` 33, vocab 51: dims not divisible
by the world size). Tensor parallel also with sequence parallel, FSDP + TP on a 2-D mesh
(4 ranks), and mixed precision (``mp_policy``) against PyTorch's FSDP2 with the same policy."""

from __future__ import annotations

import pytest
import torch

from fcoll.testing import fcoll_segments, run_ranks

BACKENDS = ["fcoll", "gloo"]


def _cfg(tg, d_model: int, n_head: int):
    return tg.GPTConfig(vocab_size=51, seq_len=16, n_layer=2, n_head=n_head, d_model=d_model)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 51, (2, 16), generator=g), torch.randint(0, 51, (2, 16), generator=g)


def _data_parallel_reference(make, seeds, mine: int) -> tuple[float, dict]:
    """What data parallel over ``seeds``' batches computes, with unsharded eager models from
    ``make()``: the loss on batch ``mine`` and every gradient averaged over the batches."""
    grads, loss_of_mine = [], None
    for seed in seeds:
        ref = make()
        loss = ref(*_batch(seed))
        loss.backward()
        loss_of_mine = loss.item() if seed == mine else loss_of_mine
        grads.append({k: p.grad for k, p in ref.named_parameters()})
    return loss_of_mine, {k: sum(g[k] for g in grads) / len(grads) for k in grads[0]}


def _simple_fsdp(rank: int, world: int) -> dict:
    import train_gpt as tg
    from torch.distributed.tensor import DTensor

    from fcoll.parallel import fully_shard, is_fully_sharded

    cfg = _cfg(tg, 33, 3)
    params = tg.init_params(cfg, 0)
    x, y = _batch(rank)
    ref_loss, ref_grads = _data_parallel_reference(lambda: tg.GPTModule(cfg, params),
                                                   range(world), rank)
    out: dict = {}
    for backend in ("eager", "fcoll", "inductor"):
        torch._dynamo.reset()
        m = tg.GPTModule(cfg, params)
        for block in m.blocks:
            fully_shard(block)
        fully_shard(m)
        out["sharded"] = all(isinstance(p, DTensor) for p in m.parameters()) and \
            is_fully_sharded(m) and is_fully_sharded(m.blocks[0])
        f = m if backend == "eager" else torch.compile(m, backend=backend)
        loss = f(x, y)
        loss.backward()
        out[backend] = (abs(loss.item() - ref_loss),
                        max((p.grad.full_tensor() - ref_grads[k]).abs().max().item()
                            for k, p in m.named_parameters()))
    return out


def _two_mesh_sizes(rank: int, world: int) -> dict:
    """Two SimpleFSDP models in one process, over every rank and over a mesh of this rank
    alone, compiled one after the other without a Dynamo reset (a float gradient factor made
    the second compile fail in Dynamo: "lift_tracked_freevar_to_input"): each one's gradients
    against its data-parallel reference."""
    import train_gpt as tg
    from torch.distributed.device_mesh import init_device_mesh

    from fcoll.parallel import fully_shard

    cfg = _cfg(tg, 33, 3)
    params = tg.init_params(cfg, 0)
    torch._dynamo.reset()
    out = {}
    solo = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "solo"))["solo"]
    for name, mesh, seeds in (("all", None, range(world)), ("solo", solo, [rank])):
        m = tg.GPTModule(cfg, params)
        for block in m.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
        loss = torch.compile(m, backend="fcoll")(*_batch(rank))
        loss.backward()
        ref_loss, ref_grads = _data_parallel_reference(lambda: tg.GPTModule(cfg, params), seeds,
                                                       rank)
        out[name] = (abs(loss.item() - ref_loss),
                     max((p.grad.full_tensor() - ref_grads[k]).abs().max().item()
                         for k, p in m.named_parameters()))
    return out


def _uneven_eval_after_a_peer_compiled(rank: int, world: int, cache_dir: str) -> float:
    """An uneven SimpleFSDP model (``d_model`` 33 over 2 ranks: local shapes 17 and 16)
    compiled by Inductor for a ``no_grad`` forward, rank 0 compiling only once rank 1's
    compile has returned (its artifacts written to the shared, fresh cache directory; the
    store says when): DTensor's AOTAutograd cache key holds the global shape only, so on torch
    2.13 rank 0 used to load rank 1's artifact ("assert_size_stride ... expected size
    17==16"). Returns the loss's error against the eager unsharded model."""
    import datetime
    import os

    import torch.distributed as dist
    from torch._inductor.compile_fx import compile_fx

    import train_gpt as tg

    from fcoll.parallel import fully_shard

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == cache_dir
    cfg = _cfg(tg, 33, 3)
    params = tg.init_params(cfg, 0)
    m = tg.GPTModule(cfg, params)
    for block in m.blocks:
        fully_shard(block)
    fully_shard(m)
    store = dist.distributed_c10d._get_default_store()

    def inductor(gm, example_inputs):   # backend="inductor", telling the peer when it is done
        compiled = compile_fx(gm, example_inputs)
        store.set(f"compiled-{rank}", "1")
        return compiled

    if rank == 0:   # rank 1 compiles before its forward's first all_gather
        store.wait(["compiled-1"], datetime.timedelta(seconds=300))
    with torch.no_grad():
        loss = torch.compile(m, backend=inductor)(*_batch(0))
        want = tg.GPTModule(cfg, params)(*_batch(0))
    return abs(loss.item() - want.item())


def test_uneven_shards_never_load_a_peers_compiled_artifact(tmp_path):
    """On fcoll's group only: the caches' keys do not depend on the process group."""
    cache = str(tmp_path / "inductor-cache")
    for err in run_ranks(_uneven_eval_after_a_peer_compiled, 2, args=(cache,),
                         env={"TORCHINDUCTOR_CACHE_DIR": cache}, timeout_s=600,
                         pg_timeout_s=300):   # rank 1's forward waits for rank 0's compile
        assert err <= 1e-5, err


def _tensor_parallel(rank: int, world: int) -> dict:
    """Tensor parallel without and with sequence parallel: every parameter's gradient against
    the unparallelized model's (the same module class, so names match)."""
    import train_gpt as tg
    from torch.distributed.device_mesh import init_device_mesh

    cfg = _cfg(tg, 32, 4)
    params = tg.init_params(cfg, 0)
    x, y = _batch(0)                          # one batch for the whole tensor-parallel group
    ref = tg.TPGPTModule(cfg, params)
    ref_loss = ref(x, y)
    ref_loss.backward()
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    for sequence_parallel in (False, True):
        for backend in ("eager", "fcoll", "inductor"):
            torch._dynamo.reset()
            m = tg.TPGPTModule(cfg, params).parallelize(mesh, sequence_parallel)
            f = m if backend == "eager" else torch.compile(m, backend=backend)
            loss = f(x, y)
            loss.backward()
            grads = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                     for k, p in m.named_parameters()}
            out[backend, sequence_parallel] = (
                abs(loss.item() - ref_loss.item()),
                max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads))
    return out


def _fsdp_with_activation_checkpointing(rank: int, world: int) -> dict:
    """torchtitan's order: every block wrapped in ``checkpoint_wrapper`` (full activation
    checkpointing), then ``fully_shard`` on each block and the root. The blocks' attention
    (``scaled_dot_product_attention``, a random op) is recomputed inside the region, which on
    torch 2.13 makes PyTorch's partitioners save the parameters' ``DeviceMesh`` among the
    tensors (``aot_eager`` and Inductor fail); fcoll's backend orders them as the runtime reads
    them (``fcoll.compile.backend._saved_opaque_after_tensors``)."""
    import train_gpt as tg
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fcoll.parallel import fully_shard

    cfg = _cfg(tg, 33, 3)
    params = tg.init_params(cfg, 0)
    x, y = _batch(rank)
    ref_loss, ref_grads = _data_parallel_reference(lambda: tg.GPTModule(cfg, params),
                                                   range(world), rank)
    out: dict = {}
    for compute in ("eager", "inductor"):
        torch._dynamo.reset()
        m = tg.GPTModule(cfg, params)
        m.blocks = torch.nn.ModuleList(checkpoint_wrapper(b) for b in m.blocks)
        for block in m.blocks:
            fully_shard(block)
        fully_shard(m)
        loss = torch.compile(m, backend="fcoll", options={"compute": compute})(x, y)
        loss.backward()
        out[compute] = (abs(loss.item() - ref_loss), max(
            (p.grad.full_tensor() - ref_grads[k.replace("_checkpoint_wrapped_module.", "")])
            .abs().max().item() for k, p in m.named_parameters()))
    return out


def _regional_compile(rank: int, world: int) -> dict:
    """torchtitan's regional compile: every block checkpointed, compiled on its own
    (``block.compile(fullgraph=True)``), then ``fully_shard`` on each block and the root, with
    fcoll's SimpleFSDP (the collectives in the blocks' graphs) and with PyTorch's FSDP2 (its
    hooks run eagerly, the collectives on the process group; its modules are traced
    unspecialized, so the blocks' differing layer index becomes a SymInt on the second block).
    ``{fsdp: (loss error, worst gradient error)}`` against data parallel."""
    import train_gpt as tg
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from fcoll.parallel import fully_shard

    cfg = _cfg(tg, 33, 3)
    params = tg.init_params(cfg, 0)
    x, y = _batch(rank)
    ref_loss, ref_grads = _data_parallel_reference(lambda: tg.GPTModule(cfg, params),
                                                   range(world), rank)
    out = {}
    for name, shard in (("simple-fsdp", fully_shard), ("fsdp2", fsdp2_fully_shard)):
        torch._dynamo.reset()
        m = tg.GPTModule(cfg, params)
        m.blocks = torch.nn.ModuleList(checkpoint_wrapper(b) for b in m.blocks)
        for block in m.blocks:
            block.compile(backend="fcoll", fullgraph=True)
            shard(block)
        shard(m)
        loss = m(x, y)
        loss.backward()
        out[name] = (abs(loss.item() - ref_loss), max(
            (p.grad.full_tensor() - ref_grads[k.replace("_checkpoint_wrapped_module.", "")])
            .abs().max().item() for k, p in m.named_parameters()))
    return out


class _TiedLM(torch.nn.Module):
    """An embedding and an output head sharing one weight (GPT-2's tying) and a 0-dim
    parameter (a logit scale), ``[B, T] -> loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(51, 12)
        self.mix = torch.nn.Linear(12, 12)
        self.head = torch.nn.Linear(12, 51, bias=False)
        self.head.weight = self.emb.weight
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.emb(x)))) * self.scale
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _tied_weights(rank: int, world: int) -> dict:
    """Tied weights stay tied: ``fully_shard`` on the head, then on the root (the shared
    weight registered in two modules and met in two calls); one parameter, whose gradient is
    the sum of both uses, averaged over the ranks. The 0-dim parameter is replicated (before,
    DTensor's "Expected tensor.dim() > 0" assertion); its gradient's all_reduce and the
    backward's re-gather of the uneven tied weight (51 rows: padded on rank 1 only) go out in
    one order on both ranks (before, rank 1 issued the all_reduce first: RankMismatchError)."""
    from fcoll.parallel import fully_shard

    torch.manual_seed(0)
    state = {k: v.clone() for k, v in _TiedLM().state_dict().items()}

    def model() -> _TiedLM:
        m = _TiedLM()
        m.load_state_dict(state)
        return m

    x, y = _batch(rank)
    _, ref_grads = _data_parallel_reference(model, range(world), rank)
    out: dict = {}
    for backend in ("eager", "fcoll"):
        torch._dynamo.reset()
        m = model()
        fully_shard(m.head)
        fully_shard(m)
        out["tied"] = (m.emb._parameters["weight"] is m.head._parameters["weight"],
                       len(list(m.parameters())))
        f = m if backend == "eager" else torch.compile(m, backend=backend)
        f(x, y).backward()
        out[backend] = max((p.grad.full_tensor() - ref_grads[k]).abs().max().item()
                           for k, p in m.named_parameters())
    return out


def _mixed_precision(rank: int, world: int) -> dict:
    """``mp_policy`` means what it means to FSDP2: the GPT with bfloat16 parameters for the
    all_gather and the compute and float32 for the gradients' reduction, eager and compiled
    with fcoll's backend, against PyTorch's ``fully_shard`` (FSDP2) with the same policy, run
    eagerly on the same group; the all_gathers in fcoll's graphs are bfloat16 and the
    reduce_scatters float32; a unit's ``output_dtype`` and ``cast_forward_inputs`` against
    FSDP2's."""
    import train_gpt as tg
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2

    from fcoll.compile.backend import register_compile_listener
    from fcoll.parallel import fully_shard

    cfg = _cfg(tg, 33, 3)
    params = tg.init_params(cfg, 0)
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    x, y = _batch(rank)
    dtypes: dict[str, set] = {"all_gather": set(), "reduce_scatter": set()}

    def listen(record) -> None:
        for n in record.before.graph.nodes:
            kind = next((k for k in dtypes if k in str(n.target)), None)
            if kind is not None:
                dtypes[kind].add(n.args[0].meta["val"].dtype)

    handle = register_compile_listener(listen)
    grads, out = {}, {}
    for name in ("fsdp2", "fsdp2-group-alloc", "eager", "fcoll"):
        torch._dynamo.reset()
        m = tg.GPTModule(cfg, params)
        shard = fsdp2 if name.startswith("fsdp2") else fully_shard
        for block in m.blocks:
            shard(block, mesh=mesh, mp_policy=mp)
        shard(m, mesh=mesh, mp_policy=mp)
        if name == "fsdp2-group-alloc":  # buffers asked of the group (_get_backend): torch.empty
            for unit in (*m.blocks, m):
                unit.set_allocate_memory_from_process_group_for_comm(True)
        loss = (m if name != "fcoll" else torch.compile(m, backend="fcoll"))(x, y)
        loss.backward()
        grads[name] = {k: p.grad.full_tensor() for k, p in m.named_parameters()}
        out[f"{name}-dtypes"] = {(p.dtype, p.grad.dtype) for p in m.parameters()}
        if name != "fsdp2":
            out[name] = max((g - grads["fsdp2"][k]).abs().max().item()
                            for k, g in grads[name].items())
    handle.remove()
    out["collective-dtypes"] = dtypes
    outputs = {}
    for shard in (fsdp2, fully_shard):
        block = tg.GPTBlock(cfg, 0, params)
        shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, output_dtype=torch.float64))
        outputs[shard] = block(torch.randn(2, 16, 33, generator=torch.Generator().manual_seed(1)))
    out["output"] = (outputs[fully_shard].dtype,
                     (outputs[fully_shard] - outputs[fsdp2]).abs().max().item())
    out["refused"] = [_refusal(lambda: fully_shard(tg.GPTBlock(cfg, 0, params), mesh=mesh,
                                                   mp_policy=bad))
                      for bad in ({"param_dtype": torch.bfloat16},
                                  MixedPrecisionPolicy(reduce_dtype=torch.int32))]
    return out


def _fsdp2_arguments(rank: int, world: int) -> dict:
    """FSDP2's other arguments: ``fully_shard([...])`` on the blocks, a ``shard_placement_fn``
    splitting dim 1 where it divides evenly, and ``ignored_params`` (left as a plain
    parameter whose gradient is not reduced); loss gradients eager and compiled against the
    unsharded model's (averaged over the ranks' batches; the ignored one: this rank's own)."""
    import train_gpt as tg
    from torch.distributed.tensor import DTensor, Shard

    from fcoll.parallel import fully_shard

    cfg = _cfg(tg, 32, 4)
    params = tg.init_params(cfg, 0)
    _, mean = _data_parallel_reference(lambda: tg.GPTModule(cfg, params), range(world), rank)
    _, own = _data_parallel_reference(lambda: tg.GPTModule(cfg, params), [rank], rank)

    def dim_1(p):
        return Shard(1) if p.dim() == 2 and p.shape[1] % world == 0 else None

    out: dict = {}
    for backend in ("eager", "fcoll"):
        torch._dynamo.reset()
        m = tg.GPTModule(cfg, params)
        ignored = m.blocks[0].p["fc_w"]
        units = fully_shard(list(m.blocks), shard_placement_fn=dim_1, ignored_params={ignored})
        fully_shard(m, shard_placement_fn=dim_1)
        out["units"] = units == list(m.blocks)
        out["placements"] = sorted({str(p.placements) for p in m.parameters()
                                    if isinstance(p, DTensor)})
        out["ignored"] = m.blocks[0].p["fc_w"] is ignored
        (m if backend == "eager" else torch.compile(m, backend="fcoll"))(*_batch(rank)).backward()
        out[backend] = max((p.grad.full_tensor() - mean[k]).abs().max().item()
                           if isinstance(p, DTensor) else (p.grad - own[k]).abs().max().item()
                           for k, p in m.named_parameters())
    # a refused placement is found before any parameter is replaced
    block = torch.nn.Sequential(torch.nn.LayerNorm(3), torch.nn.Linear(3, 4))
    out["refused"] = [_refusal(lambda fn=fn: fully_shard(block, shard_placement_fn=fn)) for fn in (
        lambda p: Shard(2),                                         # no such dimension
        lambda p: Shard(-1) if p.dim() == 2 else None,              # 3 columns over 2 ranks
        lambda p: "Shard(1)")]                                      # not a Shard
    out["untouched"] = not any(isinstance(p, DTensor) for p in block.parameters())
    return out


def _sequence_parallel_batch_of_one(rank: int, world: int) -> tuple[float, float]:
    """Tensor + sequence parallel on a batch of one sequence, compiled with ``backend="fcoll"``
    (its bucketed all_gathers along the sequence dim once returned strided outputs, and a
    traced ``view`` failed). Returns the loss's and the gradients' largest error against the
    unparallelized model."""
    import train_gpt as tg
    from torch.distributed.device_mesh import init_device_mesh

    cfg = _cfg(tg, 32, 4)
    params = tg.init_params(cfg, 0)
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randint(0, 51, (1, 16), generator=g) for _ in range(2))
    ref = tg.TPGPTModule(cfg, params)
    ref_loss = ref(x, y)
    ref_loss.backward()
    torch._dynamo.reset()
    m = tg.TPGPTModule(cfg, params).parallelize(init_device_mesh("cpu", (world,)), True)
    loss = torch.compile(m, backend="fcoll")(x, y)
    loss.backward()
    refs = dict(ref.named_parameters())
    return (abs(loss.item() - ref_loss.item()),
            max(((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                 - refs[k].grad).abs().max().item() for k, p in m.named_parameters()))


def _both(rank: int, world: int, checkpointing: bool) -> dict:
    out = {"simple-fsdp": _simple_fsdp(rank, world), "tp": _tensor_parallel(rank, world),
           "tied": _tied_weights(rank, world), "mixed": _mixed_precision(rank, world)}
    if checkpointing:
        out["two-meshes"] = _two_mesh_sizes(rank, world)
        out["simple-fsdp-ac"] = _fsdp_with_activation_checkpointing(rank, world)
        out["regional"] = _regional_compile(rank, world)
        out["fsdp2-arguments"] = _fsdp2_arguments(rank, world)
        out["sp-batch-1"] = _sequence_parallel_batch_of_one(rank, world)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_simple_fsdp_and_tensor_parallel_compiled_equal_eager(backend):
    """One spawn per process group for all (each compile dominates the run time); the
    checkpointed SimpleFSDP (a partition-step fix, the same on any group) and its blocks
    compiled one by one (an example fix), FSDP2's other
    arguments, two mesh sizes in one process (a Dynamo fix) and sequence parallel on a batch
    of one (a bucketing fix) on fcoll's only."""
    for res in run_ranks(_both, 2, backend=backend, args=(backend == "fcoll",), timeout_s=900):
        fsdp, tp = res["simple-fsdp"], res["tp"]
        assert fsdp["sharded"]
        assert fsdp["eager"] == (0.0, 0.0)      # the same math, gathered: bit for bit
        for name in ("fcoll", "inductor"):
            assert fsdp[name][0] <= 1e-5 and fsdp[name][1] <= 1e-6, (name, fsdp)
        if "sp-batch-1" in res:
            assert res["sp-batch-1"][0] <= 1e-5 and res["sp-batch-1"][1] <= 1e-6, res
        for name, errors in res.get("two-meshes", {}).items():
            assert errors[0] <= 1e-5 and errors[1] <= 1e-6, (name, res["two-meshes"])
        tied = res["tied"]
        assert tied["tied"] == (True, 4), tied    # emb/head weight, mix weight, bias, scale
        assert tied["eager"] <= 1e-6 and tied["fcoll"] <= 1e-6, tied
        mixed = res["mixed"]
        assert mixed["eager"] == 0.0 and mixed["fcoll"] <= 1e-6, mixed  # FSDP2's, bit for bit
        assert mixed["fsdp2-group-alloc"] == 0.0, mixed  # FSDP2 allocating through the group
        for name in ("fsdp2", "eager", "fcoll"):
            assert mixed[f"{name}-dtypes"] == {(torch.float32, torch.float32)}, mixed
        assert mixed["collective-dtypes"] == {"all_gather": {torch.bfloat16},
                                              "reduce_scatter": {torch.float32}}, mixed
        assert mixed["output"] == (torch.float64, 0.0), mixed
        assert "must be a torch.distributed.fsdp.MixedPrecisionPolicy, got dict" in \
            mixed["refused"][0] and "mp_policy.reduce_dtype must be a floating-point" in \
            mixed["refused"][1], mixed["refused"]
        if "fsdp2-arguments" in res:
            args = res["fsdp2-arguments"]
            assert args["units"] and args["ignored"], args
            assert args["placements"] == ["(Shard(dim=0),)", "(Shard(dim=1),)"], args
            assert args["eager"] <= 1e-6 and args["fcoll"] <= 1e-6, args
            assert "has no dimension 2" in args["refused"][0], args["refused"]
            assert "does not divide evenly over 2 ranks" in args["refused"][1], args["refused"]
            assert "expected Shard(dim) or None" in args["refused"][2], args["refused"]
            assert args["untouched"], args
        for name, errors in res.get("regional", {}).items():
            assert max(errors) <= 1e-5, (name, res["regional"])
        for compute, errors in res.get("simple-fsdp-ac", {}).items():
            assert max(errors) <= 1e-5, (compute, res["simple-fsdp-ac"])
        assert len(tp) == 6
        for key, errors in tp.items():
            assert max(errors) <= 1e-5, (key, tp)
    assert fcoll_segments() == []


def _refusal(make) -> str:
    try:
        make()
    except ValueError as e:
        return str(e)
    return "no error"


def _fsdp_with_tensor_parallel(rank: int, world: int, variants: tuple[str, ...]) -> dict:
    """2-D: tensor parallel over ``mesh["tp"]``, then ``fully_shard`` over ``mesh["dp"]``; each
    dp group trains on its own batch. The reference is the unsharded model on each dp batch,
    gradients averaged over the two batches (what data parallel means)."""
    import train_gpt as tg
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2
    from torch.distributed.tensor import DTensor

    from fcoll.parallel import fully_shard

    cfg = _cfg(tg, 32, 4)
    params = tg.init_params(cfg, 0)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_coordinate()[0]
    ref_loss, ref_grads = _data_parallel_reference(lambda: tg.TPGPTModule(cfg, params),
                                                   range(2), dp)
    ref_params = dict(tg.TPGPTModule(cfg, params).named_parameters())

    def sharded(sequence_parallel: bool):
        m = tg.TPGPTModule(cfg, params).parallelize(mesh["tp"], sequence_parallel)
        for block in m.blocks:
            fully_shard(block, mesh=mesh["dp"])
        return fully_shard(m, mesh=mesh["dp"])

    out: dict = {"refused": [
        # a tensor-parallel mesh that is not a slice of the fully_shard mesh's root
        _refusal(lambda: fully_shard(tg.TPGPTModule(cfg, params).parallelize(
            init_device_mesh("cpu", (world,))), mesh=mesh["dp"])),
        # sharding again over the dimension tensor parallel already uses
        _refusal(lambda: fully_shard(tg.TPGPTModule(cfg, params).parallelize(mesh["tp"]),
                                     mesh=mesh["tp"])),
    ]}
    x, y = _batch(dp)
    for backend in variants:
        torch._dynamo.reset()
        m = sharded(sequence_parallel=backend.endswith("-sequence-parallel"))
        q = m.blocks[0].q._parameters["weight"]
        out["placements"] = (q.device_mesh.mesh_dim_names,
                             [(type(p).__name__, p.dim) for p in q.placements])
        out["all_2d"] = all(isinstance(p, DTensor) and p.device_mesh.ndim == 2
                            for k, p in m.named_parameters() if ".q." in k or ".fc2." in k)
        # the stored 2-D DTensors describe the model's parameters (FSDP2's placements)
        out["layout"] = max((p.full_tensor() - ref_params[k]).abs().max().item()
                            for k, p in m.named_parameters())
        f = m if backend == "eager" else torch.compile(m, backend=backend.split("-")[0])
        loss = f(x, y)
        loss.backward()
        out[backend] = (abs(loss.item() - ref_loss),
                        max((p.grad.full_tensor() - ref_grads[k]).abs().max().item()
                            for k, p in m.named_parameters()))
    # mixed precision through the 2-D read (bfloat16 all_gather over dp, then tensor
    # parallel's collectives in bfloat16), eager, against FSDP2 + TP with the same policy
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    grads = {}
    for shard in (fsdp2, fully_shard):
        m = tg.TPGPTModule(cfg, params).parallelize(mesh["tp"], sequence_parallel=True)
        for block in m.blocks:
            shard(block, mesh=mesh["dp"], mp_policy=mp)
        shard(m, mesh=mesh["dp"], mp_policy=mp)(x, y).backward()
        grads[shard] = {k: p.grad.full_tensor() for k, p in m.named_parameters()}
    out["mixed"] = max((g - grads[fsdp2][k]).abs().max().item()
                       for k, g in grads[fully_shard].items())
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_shard_with_tensor_parallel_2d_trains_as_data_parallel(backend):
    """FSDP + TP on a (dp 2, tp 2) mesh, torchtitan's usual layout (and with sequence parallel,
    whose layer norms are ``Replicate`` DTensors on tp): tensor-parallel parameters
    are sharded again over dp (before, ``fully_shard`` skipped every DTensor parameter, so their
    gradients were never averaged over dp: each dp replica drifted apart). Loss and gradients
    eager and compiled equal the unsharded model's averaged over the dp batches: fcoll's
    backend on both groups, with sequence parallel on fcoll's, PyTorch's Inductor on gloo."""
    variants = ("eager", "fcoll") + (("fcoll-sequence-parallel",) if backend == "fcoll" else
                                      ("inductor",))
    for res in run_ranks(_fsdp_with_tensor_parallel, 4, backend=backend, args=(variants,),
                         timeout_s=900):
        assert res["all_2d"]
        assert res["placements"] == (("dp", "tp"), [("_StridedShard", 0), ("Shard", 0)])
        assert res["layout"] == 0.0
        assert "not slices of one device mesh" in res["refused"][0], res["refused"]
        assert "already sharded over the fully_shard mesh dimension 'tp'" in res["refused"][1], \
            res["refused"]
        for name in variants:
            assert res[name][0] <= 1e-5 and res[name][1] <= 1e-5, (name, res)
        assert res["mixed"] == 0.0, res     # FSDP2 + TP's, bit for bit
    assert fcoll_segments() == []


def _hsdp(rank: int, world: int) -> dict:
    """HSDP: ``fully_shard`` with a (replicate 2, shard 2) mesh, each rank its own batch; the
    reference is the unsharded model with gradients averaged over the four batches."""
    import train_gpt as tg
    from torch.distributed.device_mesh import init_device_mesh

    from fcoll.parallel import fully_shard

    cfg = _cfg(tg, 33, 3)
    params = tg.init_params(cfg, 0)
    ref_loss, ref_grads = _data_parallel_reference(lambda: tg.GPTModule(cfg, params),
                                                   range(world), rank)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    x, y = _batch(rank)
    out: dict = {}
    for backend in ("eager", "fcoll"):
        torch._dynamo.reset()
        m = tg.GPTModule(cfg, params)
        for block in m.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
        out["placements"] = [type(p).__name__ for p in m.blocks[0].p._parameters["fc_w"].placements]
        f = m if backend == "eager" else torch.compile(m, backend=backend)
        loss = f(x, y)
        loss.backward()
        out[backend] = (abs(loss.item() - ref_loss),
                        max((p.grad.full_tensor() - ref_grads[k]).abs().max().item()
                            for k, p in m.named_parameters()))
    return out


def test_fully_shard_with_a_2d_mesh_is_hsdp():
    """As FSDP2 with a 2-D mesh: replicated over dim 0, sharded over dim 1 (before, a 2-D mesh
    was refused); the gradients are the average over every rank's batch."""
    for res in run_ranks(_hsdp, 4, backend="fcoll", timeout_s=600):
        assert res["placements"] == ["Replicate", "Shard"]
        for name in ("eager", "fcoll"):
            assert res[name][0] <= 1e-5 and res[name][1] <= 1e-5, (name, res)
    assert fcoll_segments() == []


def _mean_on_three_ranks(rank: int, world: int) -> dict:
    """Eager gradients of fcoll's ``fully_shard`` against FSDP2's on 3 ranks (1/3 is not
    exact in any float), per ``(param_dtype, reduce_dtype)``: the largest difference relative
    to the largest gradient."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2

    from fcoll.parallel import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(16, 48, generator=torch.Generator().manual_seed(rank))
    out = {}
    for dtypes in [(torch.bfloat16, torch.float32), (None, None)]:
        grads = {}
        for shard in (fsdp2, fully_shard):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 8))
            mp = MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1])
            for unit in (m[0], m[2], m):
                shard(unit, mesh=mesh, mp_policy=mp)
            m(x).float().pow(2).mean().backward()
            grads[shard] = [p.grad.full_tensor() for p in m.parameters()]
        out[str(dtypes)] = max(((a - b).abs().max() / b.abs().max()).item()
                               for a, b in zip(grads[fully_shard], grads[fsdp2]))
    return out


def test_fully_shard_takes_the_mean_as_fsdp2_does_on_three_ranks():
    """The division by the world size is of the reduced shard in the stored dtype, as FSDP2's
    ``avg`` with a float32 reduction: bfloat16 parameters with float32 gradients are FSDP2's
    bit for bit (dividing the bfloat16 gradient before the reduction was 1.8e-3 off)."""
    for res in run_ranks(_mean_on_three_ranks, 3, backend="gloo", timeout_s=300):
        assert res[str((torch.bfloat16, torch.float32))] == 0.0, res
        assert res[str((None, None))] <= 1e-6, res
