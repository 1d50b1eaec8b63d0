"""What a training script does around its step, on fcoll's process group: the object
collectives, and ``torch.distributed.checkpoint`` saving and loading sharded state (FSDP2's and
``fcoll.parallel.fully_shard``'s DTensor parameters, an optimizer's state), synchronously and with
``async_save`` on a gloo group while the step's collectives go on on fcoll's group, and a full
state dict on rank 0 broadcast into a sharded model (``broadcast_from_rank0``)."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from fcoll.testing import fcoll_segments, run_ranks


def _objects(rank, world) -> dict:
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "t": torch.arange(3) + rank})
    sent = ["from rank 0", 7] if rank == 0 else [None, None]
    dist.broadcast_object_list(sent, src=0)
    at_root = [None] * world if rank == 0 else None
    dist.gather_object(rank * 10, at_root, dst=0)
    mine = [None]
    dist.scatter_object_list(mine, [f"to {p}" for p in range(world)] if rank == 0 else None,
                             src=0)
    return {"all_gather": [(g["rank"], g["t"].tolist()) for g in gathered], "broadcast": sent,
            "gather": at_root, "scatter": mine[0]}


def _sharded(kind: str, mesh, seed: int) -> torch.nn.Module:
    """A 2-layer model, ``kind`` ``"fsdp2"`` (PyTorch's ``fully_shard``) or ``"simple"``
    (``fcoll.parallel.fully_shard``), parameters from ``seed``."""
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from fcoll.parallel import fully_shard
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _largest_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest elementwise difference of two sharded models' full state."""
    want = {k: v.full_tensor() for k, v in a.state_dict().items()}
    got = {k: v.full_tensor() for k, v in b.state_dict().items()}
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()


def _checkpoints(rank, world, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_state_dict, set_model_state_dict,
                                                         set_state_dict)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    out = {"objects": _objects(rank, world)}
    for kind in ("fsdp2", "simple"):
        model = _sharded(kind, mesh, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train_step(model, opt, x)
        msd, osd = get_state_dict(model, opt)
        path = os.path.join(root, kind)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

        other = _sharded(kind, mesh, seed=1)  # other parameters, and no optimizer state yet
        other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
        _train_step(other, other_opt, x)
        msd, osd = get_state_dict(other, other_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(other, other_opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        out[f"{kind} load"] = _largest_difference(model, other)
        # one more step from the loaded state equals one more step from the saved one
        _train_step(model, opt, x)
        _train_step(other, other_opt, x)
        out[f"{kind} next step"] = _largest_difference(model, other)

        # a full state dict on rank 0 only (a checkpoint saved without sharding), broadcast into
        # a sharded model: every rank then holds rank 0's values
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        target = _sharded(kind, mesh, seed=4)
        set_model_state_dict(target, full, options=StateDictOptions(full_state_dict=True,
                                                                    broadcast_from_rank0=True))
        out[f"{kind} broadcast from rank 0"] = _largest_difference(model, target)

    # asynchronous save on a gloo group of its own, the step's collectives on fcoll's meanwhile
    model = _sharded("fsdp2", mesh, seed=2)
    saving = dcp.async_save({"model": model.state_dict()},
                            checkpoint_id=os.path.join(root, "async"),
                            process_group=dist.new_group(backend="gloo"))
    sums = []
    for i in range(20):
        t = torch.full((1000,), float(rank + i))
        dist.all_reduce(t)
        sums.append(t[0].item())
    saving.result()
    loaded = _sharded("fsdp2", mesh, seed=3)
    state = {"model": loaded.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(root, "async"))
    loaded.load_state_dict(state["model"])
    out["async load"] = _largest_difference(model, loaded)
    out["sums during async save"] = sums
    return out


def test_object_collectives_and_distributed_checkpoints_on_fcoll():
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_checkpoints, 2, args=(root,), timeout_s=180)
    for rank, res in enumerate(results):
        assert res["objects"] == {
            "all_gather": [(0, [0, 1, 2]), (1, [1, 2, 3])],
            "broadcast": ["from rank 0", 7],
            "gather": [0, 10] if rank == 0 else None,
            "scatter": f"to {rank}"}
        for key in ("fsdp2 load", "fsdp2 next step", "fsdp2 broadcast from rank 0",
                    "simple load", "simple next step", "simple broadcast from rank 0",
                    "async load"):
            assert res[key] == 0.0, (rank, key, res[key])
        assert res["sums during async save"] == [float(1 + 2 * i) for i in range(20)]
    assert fcoll_segments() == []
