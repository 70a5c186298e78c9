"""The same executor on a CUDA GPU: exact fp32 gradients, bf16 training precision, the arena's cap and peak."""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain import CudaDevice, Executor, Plan

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PLANS = ["keep-all", "megatrain-3", "mix-nvme"]


def _setup(kind: str = "llama"):
    from test_executor import PLANS as ALL
    from test_executor import make_batch, make_model

    model = make_model(kind, attn="sdpa")
    ids, labels = make_batch(3, 11)
    return model, ids, labels, ALL


def _reference_on_gpu(model, ids, labels):
    ref = copy.deepcopy(model).cuda()
    out = ref(input_ids=ids.cuda(), labels=labels.cuda())
    out.loss.backward()
    return float(out.loss), {n: p.grad.cpu() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("plan_name", PLANS)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_cuda_fp32_matches_transformers(kind: str, plan_name: str, tmp_path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model, ids, labels, plans = _setup(kind)
    ref_loss, ref_grads = _reference_on_gpu(model, ids, labels)
    ex = Executor(model, Plan.from_tiers(model, plans[plan_name]), CudaDevice(nvme_dir=tmp_path))
    loss = float(ex.forward_backward(ids, labels))
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for name, p in model.named_parameters():
        err = float((p.grad - ref_grads[name]).norm() / ref_grads[name].norm())
        assert err <= 1e-5, f"{name}: {err:.2e}"
    stats = ex.last_step
    assert 0.9 * stats.predicted_peak_device_bytes <= stats.peak_device_bytes <= stats.predicted_peak_device_bytes
    assert list(tmp_path.iterdir()) == []


def test_cuda_bf16_and_cap(tmp_path) -> None:
    """bf16 compute against transformers' fp32 forward + backward on the GPU, at a bf16 tolerance (the emulated
    device's test_executor.py::test_bf16_compute_tracks_fp32 holds the same bounds): the loss within 2%, every
    gradient (cast for its fp32 master, group by group) within 10% of the reference's norm; then the cap."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model, ids, labels, plans = _setup()
    ref_loss, ref_grads = _reference_on_gpu(model, ids, labels)
    plan = Plan.from_tiers(model, plans["mix-nvme"])
    ex = Executor(model, plan, CudaDevice(nvme_dir=tmp_path), compute_dtype=torch.bfloat16)
    loss = float(ex.forward_backward(ids, labels))
    assert abs(loss - ref_loss) < 0.02 * ref_loss, (loss, ref_loss)
    names = {id(p): n for n, p in model.named_parameters()}
    checked = set()
    for index in range(len(ex.param_groups())):
        with ex.group_grads(index) as params:
            for p in params:
                name = names[id(p)]
                assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name  # fp32 masters and grads
                grad = p.grad.detach().cpu()
                err = float((grad - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-30))
                assert err < 0.1, f"{name}: relative error {err:.2e} in bf16"
                checked.add(name)
    assert checked == set(names.values())
    peak = ex.last_step.predicted_peak_device_bytes
    tight = Executor(model, plan, CudaDevice(capacity_bytes=peak - 1, nvme_dir=tmp_path),
                     compute_dtype=torch.bfloat16)
    with pytest.raises(torch.OutOfMemoryError):
        tight.forward_backward(ids, labels)
