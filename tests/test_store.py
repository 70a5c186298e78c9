"""Host stores: packed aligned layer buffers, gradient accumulation, NVMe spill files with checksums."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from lazytrain.errors import LazyTrainError
from lazytrain.runtime.store import ALIGN_BYTES, ActivationStore, WeightGroup


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def small_layer(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3, bias=False))


def test_fp32_group_packs_and_aliases_parameters() -> None:
    layer = small_layer()
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    group = WeightGroup("layer.0", list(layer.named_parameters()), torch.float32, host_empty)
    assert group.buffer.data_ptr() % ALIGN_BYTES == 0
    assert group.numel == sum(p.numel() for p in layer.parameters())
    for name, view in group.views(group.buffer).items():
        assert torch.equal(view, before[name])
    with torch.no_grad():  # an optimizer's in-place update lands in the streamed buffer directly
        layer[0].weight.add_(1.0)
    assert torch.equal(group.views(group.buffer)["0.weight"], before["0.weight"] + 1)
    assert not group.pack()
    layer[0].weight.data = torch.zeros(5, 7)  # replaced storage: re-packed
    assert group.pack()
    assert torch.equal(group.views(group.buffer)["0.weight"], torch.zeros(5, 7))


def test_bf16_group_repacks_when_master_changes() -> None:
    layer = small_layer()
    group = WeightGroup("layer.0", list(layer.named_parameters()), torch.bfloat16, host_empty)
    assert layer[0].weight.dtype == torch.float32  # fp32 master stays
    with torch.no_grad():
        layer[2].weight.mul_(2)
    assert group.pack()  # a bf16 copy is always refreshed: in-place fused updates leave no trace to test
    torch.testing.assert_close(group.views(group.buffer)["2.weight"].float(), layer[2].weight.detach(),
                               rtol=1e-2, atol=1e-2)


def test_gradients_stay_where_they_land_or_sum_in_fp32() -> None:
    layer = small_layer()
    group = WeightGroup("layer.0", list(layer.named_parameters()), torch.bfloat16, host_empty)
    first, second = (torch.randn(group.numel).to(torch.bfloat16) for _ in range(2))
    group.landing.copy_(first)
    group.land(first=True, last=True)  # one micro-batch: the landing buffer is the gradient, no fp32 copy
    assert group.grad is group.landing and group.accum is None
    assert all(p.grad is None for p in layer.parameters())  # bf16 gradient, fp32 masters: cast on demand
    cast = torch.empty(group.numel)
    group.expose(lambda numel, dtype: cast[:numel].view(dtype))
    for name, p in layer.named_parameters():
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, group.views(first)[name].float())
    group.release()
    assert all(p.grad is None for p in layer.parameters())
    group.land(first=True, last=False)  # two micro-batches: summed in fp32, exactly as autograd's fp32 .grad
    group.landing.copy_(second)
    group.land(first=False, last=True)
    assert group.grad is group.accum and group.accum.dtype == torch.float32
    for name, p in layer.named_parameters():  # fp32 sum: `.grad` is a view of it
        assert torch.equal(p.grad, group.views(first)[name].float() + group.views(second)[name].float())


def test_nvme_roundtrip_checksum_and_cleanup(tmp_path) -> None:
    store = ActivationStore(tmp_path, host_empty)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 8).to(dtype)
        store.write(4, x)
        back = torch.empty_like(x)
        store.read(4, back)
        assert torch.equal(back, x)
        store.remove(4)
    store.write(2, torch.randn(64))
    assert list(tmp_path.iterdir()) == []  # spill files have no name: nothing to delete, nothing left behind
    fd = store.fileno(2)
    byte = os.pread(fd, 1, 10)
    os.pwrite(fd, bytes([byte[0] ^ 0xFF]), 10)  # flip one byte on "disk"
    with pytest.raises(LazyTrainError, match="corrupt"):
        store.read(2, torch.empty(64))
    store.end_step()
    assert store.nvme_bytes_in_use == 0 and list(tmp_path.iterdir()) == []


def test_host_buffers_are_recycled() -> None:
    store = ActivationStore(".", host_empty)
    a = store.host_buffer(3, (2, 4), torch.float32)
    assert store.host_buffer(3, (2, 4), torch.float32) is a
    assert store.host_buffer(3, (2, 5), torch.float32) is not a
