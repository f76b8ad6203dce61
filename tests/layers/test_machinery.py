"""PyTorch machinery around μMoE layers: torch.func, autocast, compile, DDP, FSDP2."""

import gc
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from mumoe_tn import MuMoE
from mumoe_tn.layers import MuMoEMLP

DTYPE = torch.float64


def test_torch_func_transforms():
    torch.manual_seed(0)
    layer = MuMoE(6, 4, (5, 3), "tr", 3, gate_norm="layer", dtype=DTYPE)
    x = torch.randn(8, 6, dtype=DTYPE)
    params = dict(layer.named_parameters())
    buffers = dict(layer.named_buffers())
    torch.testing.assert_close(torch.func.functional_call(layer, (params, buffers), (x,)), layer(x))

    def loss(p):
        return torch.func.functional_call(layer, (p, buffers), (x,)).pow(2).mean()

    grads = torch.func.grad(loss)(params)
    layer(x).pow(2).mean().backward()
    for name, param in layer.named_parameters():
        torch.testing.assert_close(grads[name], param.grad)
    batched = torch.func.vmap(layer)(x.reshape(2, 4, 6))
    torch.testing.assert_close(batched.reshape(8, 4), layer(x))
    jacobian = torch.func.jacrev(lambda v: layer(v[None])[0])(x[0])
    assert jacobian.shape == (4, 6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_error_bound_at_large_n(dtype):
    torch.manual_seed(0)
    layer = MuMoE(64, 48, 4096, "tr", 16).eval()
    x = torch.randn(256, 64)
    reference = layer(x)
    try:
        with torch.autocast("cpu", dtype=dtype):
            y = layer(x)
    except RuntimeError as error:  # pragma: no cover - depends on the build
        pytest.skip(f"CPU autocast to {dtype} unsupported here: {error}")
    assert layer.last_coefficients[0].dtype == torch.float32
    # 8 (bf16) or 11 (fp16) mantissa bits per rounded step, four contraction steps:
    # a 3 % (bf16) / 0.5 % (fp16) relative bound on the whole output.
    bound = 0.03 if dtype == torch.bfloat16 else 0.005
    error = (y.float() - reference).norm() / reference.norm()
    assert error < bound, error


def test_compile_mlp_block_fullgraph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), MuMoEMLP(16, 32, 16, (4, 4), "cp", 8))
    x = torch.randn(2, 5, 16)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(compiled(x), eager)
    # tracing the library's own code raises no warning (e.g. dynamo's about an lru_cache wrapper)
    assert [str(w.message) for w in caught if "mumoe_tn" in str(w.message)] == []
    compiled(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_compile_with_changing_batch_sizes():
    torch.manual_seed(0)
    layer = MuMoE(16, 8, (4, 4), "tr", 4)
    compiled = torch.compile(layer, fullgraph=True)
    for batch in (8, 13, 20, 3, 64):  # the second shape makes dynamo mark the batch dynamic
        x = torch.randn(batch, 2, 16)
        torch.testing.assert_close(compiled(x), layer(x))


def _make_model():
    torch.manual_seed(0)
    # LayerNorm gates: each token is normalised on its own, so data-parallel training is exact.
    return nn.Sequential(
        MuMoE(8, 16, (4, 2), "cp", 4, gate_norm="layer", dtype=DTYPE),
        nn.GELU(),
        MuMoE(16, 3, 4, "tr", 4, gate_norm="layer", dtype=DTYPE),
    )


def _train(model, x, y, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()


def _leave():
    """Leave the group once every rank is done, after the job's objects are gone.

    A wrapped model still alive when the group is destroyed can abort the process at exit (gloo's
    threads outlive the group), so the workers train in a function whose objects die on return.
    """
    gc.collect()
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


def _ddp_train(rank, world, data):
    x, y = data
    shard = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    model = nn.parallel.DistributedDataParallel(_make_model())
    _train(model, x[shard], y[shard])
    return {name: value.detach().clone() for name, value in model.module.state_dict().items()}


def _ddp_worker(rank, world, init_file, data, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    state = _ddp_train(rank, world, data)
    if rank == 0:
        torch.save(state, out)
    _leave()


def test_ddp_gloo_matches_single_process(tmp_path):
    torch.manual_seed(1)
    data = (torch.randn(16, 8, dtype=DTYPE), torch.randn(16, 3, dtype=DTYPE))
    single = _make_model()
    _train(single, *data)
    out = tmp_path / "ddp.pt"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), data, str(out)), nprocs=2, join=True)
    trained = torch.load(out, weights_only=True)
    for name, value in single.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-10, atol=1e-12)


def _fsdp2_train(rank, world, data):
    from torch.distributed.fsdp import fully_shard

    x, y = data
    shard = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    model = _make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer)  # each μMoE layer's cores are sharded across the two processes
    fully_shard(model)
    _train(model, x[shard], y[shard])
    return {name: value.full_tensor() for name, value in model.state_dict().items()}


def _fsdp2_worker(rank, world, init_file, data, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    state = _fsdp2_train(rank, world, data)
    if rank == 0:
        torch.save(state, out)
    _leave()


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_fsdp2_fully_shard_gloo_matches_single_process(tmp_path):
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")
    torch.manual_seed(1)
    data = (torch.randn(16, 8, dtype=DTYPE), torch.randn(16, 3, dtype=DTYPE))
    single = _make_model()
    _train(single, *data)
    out = tmp_path / "fsdp2.pt"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    mp.spawn(_fsdp2_worker, args=(2, str(tmp_path / "init"), data, str(out)), nprocs=2, join=True)
    trained = torch.load(out, weights_only=True)
    assert sorted(trained) == sorted(single.state_dict())
    for name, value in single.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-10, atol=1e-12)


def test_batchnorm_gates_convert_to_sync_batchnorm():
    # BatchNorm gates see only their replica's batch under DDP; SyncBatchNorm (CUDA) restores
    # the single-process statistics.
    layer = MuMoE(8, 4, (4, 2), "cp", 4)
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(layer)
    norms = [m for m in converted.modules() if isinstance(m, nn.SyncBatchNorm)]
    assert len(norms) == 2 and not norms[0].affine
