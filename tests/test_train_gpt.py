"""examples/train_gpt.py: the compiled data-parallel step against eager and against one process.

One 2-rank run (fcoll process group) does every multi-process check, because each process
start costs seconds: for ddp and fsdp, and for compute eager and inductor, the compiled step
(backend="fcoll") gives the same loss and averaged gradients as the same step run eagerly;
``torch._dynamo.explain`` reports no graph break; and 3 compiled ddp steps with batch B per rank
end with the parameters of 3 steps of one process with batch 2B (float64, so the comparison
is tight). The single-process reference runs in the test process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fcoll.testing import run_ranks

import train_gpt as tg  # noqa: E402

B, T, STEPS = 2, 16, 3


def _cfg(vocab: int, dtype=torch.float32) -> "tg.GPTConfig":
    return tg.GPTConfig(vocab_size=vocab, seq_len=T, n_layer=1, n_head=2, d_model=32,
                        dtype=dtype)


def _ranks(rank: int, n: int) -> dict:
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    corpus = tg.Corpus(tg.load_text())
    comm = tg.FcollComm(dist.group.WORLD)
    out: dict = {"mismatch": [], "breaks": {}}
    x, y = tg.get_batch(corpus.train, B, T, seed=1, step=0, rank=rank, world_size=n)
    for parallel in ("ddp", "fsdp"):
        cfg = _cfg(corpus.vocab_size)
        params = tg.init_params(cfg, seed=0)
        shapes = {k: v.shape for k, v in params.items()}
        if parallel == "fsdp":
            params = tg.shard_params(params, rank, n)
        state = tg.init_adamw(params)
        step = tg.make_train_step(cfg, comm, parallel, shapes=shapes)
        if parallel == "ddp":  # fsdp: compile_step's fullgraph=True raises on any break
            # what compile_step compiles: grad_step, on leaves made outside the compiled code
            explain = torch._dynamo.explain(step.grad_step)
            with torch._dynamo.config.patch(trace_autograd_ops=True):
                out["breaks"][parallel] = explain(tg._grad_leaves(params), state, x,
                                                  y).graph_break_count
        ref_loss, ref_grads, _, _ = step(params, state, x, y)
        for compute in ("eager", "inductor"):
            torch._dynamo.reset()
            run = tg.compile_step(step, "fcoll", {"compute": compute})
            loss, grads, _, _ = run(params, state, x, y)
            try:
                torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
                for k in ref_grads:
                    torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6,
                                               msg=lambda m, k=k: f"grad {k}: {m}")
            except AssertionError as e:
                out["mismatch"].append(f"{parallel}/{compute} rank {rank}: {e}")
    out["dynamo_graph_breaks"] = sum(counters["graph_break"].values())

    # 3 compiled ddp steps, float64, batch B per rank
    torch._dynamo.reset()
    cfg = _cfg(corpus.vocab_size, torch.float64)
    params = tg.init_params(cfg, seed=0)
    state = tg.init_adamw(params)
    run = tg.compile_step(tg.make_train_step(cfg, comm, "ddp"), "fcoll")
    for s in range(STEPS):
        x, y = tg.get_batch(corpus.train, B, T, seed=2, step=s, rank=rank, world_size=n)
        _, _, params, state = run(params, state, x, y)
    out["params"] = params
    return out


def test_compiled_step_matches_eager_and_single_process():
    # One Inductor compile thread per rank: 2 ranks on 2 cores gain nothing from a worker pool.
    results = run_ranks(_ranks, 2, backend="fcoll", timeout_s=420,
                        env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    for r in results:
        assert r["mismatch"] == [], "\n".join(r["mismatch"])
        assert r["breaks"] == {"ddp": 0}
        assert r["dynamo_graph_breaks"] == 0
    # both ranks hold the same parameters (ddp), equal to one process with batch 2B
    corpus = tg.Corpus(tg.load_text())
    cfg = _cfg(corpus.vocab_size, torch.float64)
    params = tg.init_params(cfg, seed=0)
    state = tg.init_adamw(params)
    step = tg.make_train_step(cfg, None, "ddp")
    for s in range(STEPS):
        batches = [tg.get_batch(corpus.train, B, T, seed=2, step=s, rank=r, world_size=2)
                   for r in range(2)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        _, _, params, state = step(params, state, x, y)
    moved = 0.0
    for k, v in params.items():
        torch.testing.assert_close(results[0]["params"][k], results[1]["params"][k], rtol=0,
                                   atol=0)
        torch.testing.assert_close(results[0]["params"][k], v, rtol=1e-9, atol=1e-10,
                                   msg=lambda m, k=k: f"param {k}: {m}")
        moved = max(moved, float((v - tg.init_params(cfg, seed=0)[k]).abs().max()))
    assert moved > 1e-4  # the steps did change the parameters


def test_fsdp_shards_round_trip():
    params = tg.init_params(_cfg(11), seed=0)
    shards = [tg.shard_params(params, r, 3) for r in range(3)]
    back = tg.unshard_params(shards, {k: v.shape for k, v in params.items()})
    for k, v in params.items():
        assert shards[0][k].numel() == -(-v.numel() // 3)
        torch.testing.assert_close(back[k], v, rtol=0, atol=0)


def test_batches_are_disjoint_rank_shards():
    data = torch.arange(10_000)
    x0, y0 = tg.get_batch(data, 8, 16, seed=0, step=0, rank=0, world_size=2)
    x1, _ = tg.get_batch(data, 8, 16, seed=0, step=0, rank=1, world_size=2)
    assert bool((x0 < 5_000).all()) and bool((x1 >= 5_000).all())
    torch.testing.assert_close(y0[:, :-1], x0[:, 1:])


def test_tensor_parallel_refuses_heads_that_do_not_divide_over_the_ranks():
    class ThreeRanks:  # all parallelize reads before it refuses
        def size(self) -> int:
            return 3

    cfg = tg.GPTConfig(vocab_size=51, seq_len=16, n_layer=1, n_head=4, d_model=32)
    model = tg.TPGPTModule(cfg, tg.init_params(cfg, 0))
    with pytest.raises(ValueError, match="n_head 4 does not divide by the tensor-parallel size 3"):
        model.parallelize(ThreeRanks())


# ---------------------------------------------------------------------------------------------
# --device cuda and --dist-backend nccl

def test_nccl_refuses_ranks_sharing_a_gpu_and_names_them():
    assert tg.nccl_device_conflict(2, 2) is None and tg.nccl_device_conflict(1, 8) is None
    why = tg.nccl_device_conflict(3, 2)
    assert "ranks 0, 2 on cuda:0" in why and "cuda:1" not in why and "fcoll" in why
    assert "ranks 0, 1 on cuda:0" in tg.nccl_device_conflict(2, 1)
    assert "needs a GPU" in tg.nccl_device_conflict(2, 0)


def test_device_and_backend_arguments():
    args = tg._parse([])
    assert (args.device, args.dist_backend) == ("cpu", "fcoll")
    args = tg._parse(["--device", "cuda", "--dist-backend", "nccl", "--parallel", "fsdp"])
    assert (args.device, args.dist_backend, args.parallel) == ("cuda", "nccl", "fsdp")
    with pytest.raises(SystemExit):
        tg._parse(["--dist-backend", "nccl"])  # nccl has no CPU collectives
    assert tg._setup_device(tg._parse([])) == torch.device("cpu")
    with pytest.raises(SystemExit):
        tg._parse(["--sequence-parallel"])          # only with tensor parallel
    with pytest.raises(SystemExit):
        tg._parse(["--activation-checkpointing"])   # only the nn.Module modes
    args = tg._parse(["--parallel", "fsdp-tp", "--tp", "2", "--sequence-parallel",
                      "--activation-checkpointing"])
    assert (args.parallel, args.tp, args.sequence_parallel) == ("fsdp-tp", 2, True)
    with pytest.raises(SystemExit):
        tg._parse(["--parallel", "tp", "--param-dtype", "bfloat16"])   # only the FSDP modes
    args = tg._parse([])
    assert tg.mp_policy(args.param_dtype, args.reduce_dtype) is None
    args = tg._parse(["--parallel", "simple-fsdp", "--param-dtype", "bfloat16",
                      "--reduce-dtype", "float32"])
    policy = tg.mp_policy(args.param_dtype, args.reduce_dtype)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_adamw_step_counter_lives_on_the_parameters_device():
    params = tg.init_params(_cfg(11), seed=0)
    assert tg.init_adamw(params)["t"].device == torch.device("cpu")
    if torch.cuda.is_available():
        on_gpu = {k: v.cuda() for k, v in params.items()}
        assert tg.init_adamw(on_gpu)["t"].device.type == "cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("parallel,dist_backend,compute", [
    ("ddp", "fcoll", "inductor"), ("fsdp", "fcoll", "inductor"), ("ddp", "gloo", "eager")])
def test_train_gpt_on_cuda_learns(parallel, dist_backend, compute):
    """2 ranks (sharing GPU 0 when there is one): exit 0, no graph break, loss goes down."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "fcoll.launch", "--nproc-per-node", "2",
           "examples/train_gpt.py", "--device", "cuda", "--parallel", parallel,
           "--dist-backend", dist_backend, "--compute", compute, "--steps", "20",
           "--log-every", "20", "--n-layer", "2", "--d-model", "128"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    summary = [line for line in p.stdout.splitlines() if "summary:" in line]
    assert len(summary) == 1 and "graph breaks 0" in summary[0], p.stdout[-4000:]
    assert "cuda:0" in summary[0] and " ms, " in summary[0]
    first, last = (float(v) for v in summary[0].split("val loss ")[1].split(" (")[0].split(" -> "))
    assert last < 0.9 * first, summary[0]


def _torch_modules(rank: int, n: int) -> dict:
    """``--parallel torch-ddp`` / ``torch-fsdp2`` / ``simple-fsdp`` (and simple-fsdp with
    ``--activation-checkpointing``): 3 steps compiled with backend="fcoll" against the same
    wrapped module run eagerly; the collectives that reach fcoll's graphs."""
    corpus = tg.Corpus(tg.load_text())
    cfg = _cfg(corpus.vocab_size)
    batches = [tg.get_batch(corpus.train, B, T, seed=1, step=i, rank=rank, world_size=n)
               for i in range(STEPS)]
    out: dict = {}
    for name in ("torch-ddp", "torch-fsdp2", "simple-fsdp", "simple-fsdp+ac"):
        parallel, ac = name.removesuffix("+ac"), name.endswith("+ac")
        torch._dynamo.reset()
        counts, stop = tg.count_compiled_collectives()
        step = tg.TorchModuleStep(cfg, tg.init_params(cfg, 0), parallel, tg.AdamW(),
                                  torch.device("cpu"), "fcoll", {}, activation_checkpointing=ac)
        compiled = [float(step(x, y)) for x, y in batches]
        stop()
        torch._dynamo.reset()
        ref = tg.TorchModuleStep(cfg, tg.init_params(cfg, 0), parallel, tg.AdamW(),
                                 torch.device("cpu"), "eager", None, activation_checkpointing=ac)
        ref.forward = ref.wrapped   # not compiled at all
        ref.traced_comms = False
        eager = [float(ref(x, y)) for x, y in batches]
        out[name] = {"compiled": compiled, "eager": eager, "collectives": sum(counts.values()),
                         "traced": step.traced_comms}
    return out


@pytest.mark.parametrize("backend", ["fcoll", "gloo"])
def test_pytorch_ddp_fsdp2_and_simple_fsdp_modules_compile_with_fcoll(backend):
    for res in run_ranks(_torch_modules, 2, backend=backend, timeout_s=400):
        for parallel, r in res.items():
            assert r["compiled"] == pytest.approx(r["eager"], rel=1e-4, abs=1e-5), parallel
            if r["traced"]:  # DDP always; FSDP2 where torch can trace its hooks (CUDA, < 2.13)
                assert r["collectives"] > 0, parallel
        assert res["torch-ddp"]["traced"] and res["simple-fsdp"]["traced"]
        assert res["simple-fsdp+ac"]["collectives"] > 0
