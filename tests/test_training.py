"""Training with PyTorch's own engines: DistributedDataParallel, activation checkpointing, channels_last. Each gives
the gradients of a plain single-process float64 step."""

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA
from torch import nn

import deformconv

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPE = torch.float32 if HAS_CUDA else torch.float64  # the GPU runs the Triton kernels (no float64 there)
TOL = dict(atol=1e-5, rtol=1e-5) if HAS_CUDA else dict(atol=1e-10, rtol=1e-10)  # fp32 without TF32 on the GPU


class Net(nn.Module):
    """Two deformable layers (DCNv2, then DCNv1 with 2 offset groups and a stride) between plain convolutions."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.dcn2 = deformconv.ModulatedDeformConv2dPack(8, 8, 3, padding=1)
        self.dcn1 = deformconv.DeformConv2dPack(8, 12, 3, stride=2, padding=1, offset_groups=2)
        self.head = nn.Linear(12, 5)
        torch.manual_seed(3)
        for m in (self.dcn2, self.dcn1):  # offsets that move the samples
            nn.init.normal_(m.conv_offset.weight, std=0.1)

    def forward(self, x, checkpointed=False):
        x = F.relu(self.stem(x))
        for layer in (self.dcn2, self.dcn1):
            x = F.relu(torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x))
        return self.head(x.mean((2, 3)))


def _data(n=4):
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, 3, 11, 13, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


def _grads(net, x, y, **kw):
    net.zero_grad(set_to_none=True)
    F.cross_entropy(net(x, **kw), y).backward()
    return {name: p.grad.detach().clone() for name, p in net.named_parameters()}


def _reference_grads(device="cpu", dtype=torch.float64):
    torch.manual_seed(0)
    net = Net().to(device, dtype)
    x, y = _data()
    return net, _grads(net, x.to(device, dtype), y.to(device))


def _no_tf32():
    """fp32 without TF32 in the Triton kernels, cuBLAS and cuDNN alike (the kernels follow cuDNN's flag)."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def _ddp_worker(rank, world, backend, init_file, out_dir):
    import torch.distributed as dist

    # gloo: the CPU in float64; nccl: one GPU a rank, the Triton kernels in float32
    device, dtype = ("cpu", torch.float64) if backend == "gloo" else (f"cuda:{rank}", torch.float32)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        _no_tf32()
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        net = Net().to(device, dtype)
        ddp = nn.parallel.DistributedDataParallel(net, device_ids=[rank] if backend == "nccl" else None)
        x, y = _data()
        share = x.shape[0] // world
        sl = slice(rank * share, (rank + 1) * share)
        F.cross_entropy(ddp(x[sl].to(device, dtype)), y[sl].to(device)).backward()  # DDP averages over the ranks
        torch.save({name: p.grad.cpu() for name, p in net.named_parameters()}, os.path.join(out_dir, f"rank{rank}.pt"))
        # DDP's reducer holds the backend's work and its tensors: released here, with both ranks past their last
        # collective, rather than by gloo's threads during the interpreter's exit (a worker aborted there once under
        # CI's load: "terminate called without an active exception"; pytorch#179291 describes that exit)
        dist.barrier()
        del ddp
    finally:
        dist.destroy_process_group()


def _check_ddp(backend, tmp_path, tol):
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(2, backend, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    if backend == "nccl":
        _no_tf32()
        _, want = _reference_grads("cuda", torch.float32)
    else:
        _, want = _reference_grads()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name].cpu(), **tol, msg=lambda m: f"{rank} {name}: {m}")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")
def test_distributed_data_parallel_two_processes_match_one(tmp_path):
    """Two gloo processes on the CPU, each with half the batch: after DDP's all-reduce every rank holds the
    single-process gradient of the whole batch."""
    _check_ddp("gloo", tmp_path, dict(atol=1e-10, rtol=1e-10))


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_nccl_available()
                         and torch.cuda.device_count() >= 2), reason="needs NCCL and two CUDA GPUs")
def test_distributed_data_parallel_nccl_two_gpus_match_one(tmp_path, monkeypatch):
    """Two NCCL processes, a GPU each, half the batch each, the Triton kernels in float32: every rank holds the
    gradient of one process on one GPU with the whole batch, to float32's tolerance (the sums run in another order)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    _check_ddp("nccl", tmp_path, TOL)


@pytest.mark.parametrize("how", ["checkpointed", "channels_last", "checkpointed+channels_last"])
def test_checkpointing_and_channels_last_give_the_same_gradients(how, monkeypatch):
    """Activation checkpointing (non-reentrant: the layers' forward is run again in the backward) and a channels_last
    model and input give the plain step's gradients (float64 on the CPU; on a GPU the Triton kernels in float32,
    against their own plain step, without TF32 in the kernels or cuDNN)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    net = Net().to(DEVICE, DTYPE)
    x, y = _data()
    x, y = x.to(DEVICE, DTYPE), y.to(DEVICE)
    want = _grads(net, x, y)
    if "channels_last" in how:
        net = net.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    got = _grads(net, x, y, checkpointed="checkpointed" in how)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m: f"{name}: {m}")
