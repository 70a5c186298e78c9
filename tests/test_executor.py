"""Executor vs the model's own transformers forward/backward: loss and every gradient, under every plan shape."""

from __future__ import annotations

import copy
import functools
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import VOCAB, assert_matches, make_batch, make_model, reference

from lazytrain import EmulatedDevice, Executor, Plan
from lazytrain.config import load_job_config
from lazytrain.errors import LazyTrainError
from lazytrain.plan.schedule import build_program
from lazytrain.train.optimizer import build_optimizer, optimizer_step, step_param_groups

NUM_LAYERS = 6


def _step_exposed(ex: Executor, opt: torch.optim.Optimizer, index: int) -> None:
    """A deferred update reading `.grad`s: `step_param_groups` on the group its gradients are exposed for."""
    with ex.group_grads(index):
        step_param_groups(opt, [index])


def megatrain(num_layers: int, interval: int) -> list[str]:
    return ["gpu" if i % interval == 0 or i == num_layers else "recompute" for i in range(num_layers + 1)]


PLANS = {
    "keep-all": ["gpu"] * (NUM_LAYERS + 1),
    "recompute-all": ["gpu"] + ["recompute"] * (NUM_LAYERS - 1) + ["gpu"],
    "megatrain-2": megatrain(NUM_LAYERS, 2),
    "megatrain-3": megatrain(NUM_LAYERS, 3),
    "all-cpu": ["gpu"] + ["cpu"] * (NUM_LAYERS - 1) + ["gpu"],
    "mix-nvme": ["gpu", "nvme", "recompute", "cpu", "gpu", "nvme", "gpu"],
}


@pytest.mark.exactness
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("plan_name", list(PLANS))
def test_loss_and_grads_match_transformers(kind: str, plan_name: str) -> None:
    model = make_model(kind)
    ids, labels = make_batch()
    ref_loss, ref_grads = reference(model, input_ids=ids, labels=labels)
    ex = Executor(model, Plan.from_tiers(model, PLANS[plan_name]), EmulatedDevice(), head_chunk_tokens=7)
    loss = ex.forward_backward(ids, labels)
    assert_matches(model, loss, ref_loss, ref_grads)
    stats = ex.last_step
    assert stats.peak_device_bytes <= stats.predicted_peak_device_bytes
    assert stats.peak_device_bytes >= 0.9 * stats.predicted_peak_device_bytes


@pytest.mark.exactness
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inner=st.lists(st.sampled_from(["gpu", "cpu", "nvme", "recompute"]), min_size=NUM_LAYERS - 1,
                      max_size=NUM_LAYERS - 1),
       kind=st.sampled_from(["llama", "qwen2", "qwen3", "mistral"]),
       seq_len=st.sampled_from([5, 9, 13]), batch=st.sampled_from([1, 3]))
def test_random_tier_lists_match(inner, kind, seq_len, batch) -> None:
    model = make_model(kind)
    ids, labels = make_batch(batch, seq_len, seed=seq_len)
    ref_loss, ref_grads = reference(model, input_ids=ids, labels=labels)
    tiers = ["gpu", *inner, "gpu"]
    ex = Executor(model, Plan.from_tiers(model, tiers), EmulatedDevice(), head_chunk_tokens=4)
    assert_matches(model, ex.forward_backward(ids, labels), ref_loss, ref_grads)
    assert ex.last_step.peak_device_bytes <= ex.last_step.predicted_peak_device_bytes


@pytest.mark.exactness
def test_sdpa_attention_matches() -> None:
    model = make_model("llama", attn="sdpa")
    ids, labels = make_batch()
    ref_loss, ref_grads = reference(model, input_ids=ids, labels=labels)
    ex = Executor(model, Plan.from_tiers(model, PLANS["megatrain-3"]), EmulatedDevice())
    assert_matches(model, ex.forward_backward(ids, labels), ref_loss, ref_grads)


@pytest.mark.exactness
def test_chunk_with_no_labels_and_all_ignored() -> None:
    model = make_model("llama")
    ids, labels = make_batch(2, 9)
    labels[0, :] = -100  # a whole chunk (head_chunk_tokens=9) ignored
    ref_loss, ref_grads = reference(model, input_ids=ids, labels=labels)
    ex = Executor(model, Plan.from_tiers(model, PLANS["all-cpu"]), EmulatedDevice(), head_chunk_tokens=9)
    assert_matches(model, ex.forward_backward(ids, labels), ref_loss, ref_grads)
    model.zero_grad(set_to_none=True)
    labels[:] = -100  # every token ignored: NaN, exactly as the model's own loss
    assert torch.isnan(ex.forward_backward(ids, labels))


@pytest.mark.exactness
def test_gradients_accumulate_like_autograd() -> None:
    model = make_model("qwen2")
    batches = [make_batch(3, 7, seed=s) for s in (1, 2)]
    ref = copy.deepcopy(model)
    for ids, labels in batches:
        (ref(input_ids=ids, labels=labels).loss * 0.5).backward()
    ex = Executor(model, Plan.from_tiers(model, PLANS["mix-nvme"]), EmulatedDevice())
    for i, (ids, labels) in enumerate(batches):  # one step of two micro-batches
        ex.forward_backward(ids, labels, loss_scale=0.5, last_micro_batch=i == 1)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert float((p.grad - q.grad).norm() / q.grad.norm()) <= 1e-5, name
    ids, labels = batches[0]  # the next step's gradient starts afresh
    ex.forward_backward(ids, labels)
    ref.zero_grad(set_to_none=True)
    ref(input_ids=ids, labels=labels).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert float((p.grad - q.grad).norm() / q.grad.norm()) <= 1e-5, name


@pytest.mark.exactness
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_update_runs_in_forward_order_before_each_groups_weights(kind: str, dtype: torch.dtype) -> None:
    """The update handed to defer_update runs on the next step's optimizer lane, group by group in forward order
    (a tied head first: it owns the embedding), each before its group's forward weights are streamed: the
    parameters and losses equal one AdamW step after each backward, bit for bit."""
    model = make_model(kind)
    serial = copy.deepcopy(model)
    ids, labels = make_batch()
    serial_ex = Executor(serial, Plan.from_tiers(serial, PLANS["megatrain-2"]), EmulatedDevice(), compute_dtype=dtype)
    serial_opt = torch.optim.AdamW([{"params": g} for g in serial_ex.param_groups()], lr=1e-2, fused=True)
    ex = Executor(model, Plan.from_tiers(model, PLANS["megatrain-2"]), EmulatedDevice(), compute_dtype=dtype)
    opt = torch.optim.AdamW([{"params": g} for g in ex.param_groups()], lr=1e-2, fused=True)
    seen: list[int] = []

    def update(index: int) -> None:
        seen.append(index)
        time.sleep(0.01)  # slow: the forward must wait for it
        with ex.group_grads(index):  # `.grad` in the masters' dtype
            step_param_groups(opt, [index])
        for p in opt.param_groups[index]["params"]:
            p.grad = None

    for _ in range(3):
        expected = serial_ex.forward_backward(ids, labels)
        serial_opt.zero_grad(set_to_none=True)
        for index in range(len(serial_ex.param_groups())):  # bf16 gradients of fp32 masters: cast group by group
            with serial_ex.group_grads(index):
                serial_opt.step()
            serial_opt.zero_grad(set_to_none=True)
        assert torch.equal(ex.forward_backward(ids, labels), expected)
        ex.defer_update(update)
    ex.drain()
    names = ex.group_names()
    order = [names.index("head"), *range(names.index("layer.0"), names.index("head"))] if kind == "qwen2" \
        else list(range(len(names)))
    assert seen == order * 3
    assert sum(1 for lane, name, *_ in ex.last_step.timeline if name.startswith("update")) == len(names)
    for p, q in zip(model.parameters(), serial.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.exactness
def test_bf16_compute_tracks_fp32() -> None:
    model = make_model("llama")
    ids, labels = make_batch()
    ref_loss, ref_grads = reference(model, input_ids=ids, labels=labels)
    ex = Executor(model, Plan.from_tiers(model, PLANS["mix-nvme"]), EmulatedDevice(),
                  compute_dtype=torch.bfloat16)
    loss = ex.forward_backward(ids, labels)
    assert abs(float(loss) - ref_loss) < 0.02 * ref_loss
    names = {id(p): n for n, p in model.named_parameters()}
    for index in range(len(ex.param_groups())):  # bf16 gradients, cast for the fp32 masters group by group
        with ex.group_grads(index) as params:
            for p in params:
                name = names[id(p)]
                assert p.dtype == torch.float32 and p.grad.dtype == torch.float32  # fp32 master and grads
                assert float((p.grad - ref_grads[name]).norm() / ref_grads[name].norm()) < 0.1, name
    with torch.no_grad():  # an update of the fp32 master weights reaches the streamed bf16 copy
        model.lm_head.weight.mul_(0.0)
    model.zero_grad()
    assert abs(float(ex.forward_backward(ids, labels)) - torch.log(torch.tensor(float(VOCAB)))) < 1e-2


@pytest.mark.exactness
def test_bf16_streams_weights_updated_in_place_by_fused_adamw() -> None:
    """Fused AdamW writes the fp32 master in place without bumping version counters; the next step
    must still stream the updated weights, not the stale bf16 copy."""
    model = make_model("llama")
    ids, labels = make_batch()
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * (NUM_LAYERS + 1)), EmulatedDevice(),
                  compute_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    before = [p.detach().clone() for p in model.parameters()]
    ex.forward_backward(ids, labels)
    for index in range(len(ex.param_groups())):
        with ex.group_grads(index) as params:
            opt.step()
        for p in params:
            p.grad = None
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))  # all updated
    ex.forward_backward(ids, labels)
    for group in ex.layer_groups:
        for slot, p in zip(group.slots, group.params, strict=True):
            streamed = group.buffer[slot.offset:slot.offset + slot.numel].view(slot.shape)
            assert torch.equal(streamed, p.detach().to(torch.bfloat16)), f"{group.name}.{slot.name} is stale"


@pytest.mark.exactness
def test_grad_norm_is_taken_as_gradients_land() -> None:
    model = make_model("qwen2")  # tied embeddings: the head group completes at the embedding backward
    ids, labels = make_batch()
    ex = Executor(model, Plan.from_tiers(model, PLANS["mix-nvme"]), EmulatedDevice())
    ex.forward_backward(ids, labels, loss_scale=0.5, last_micro_batch=False)
    assert ex.last_step.grad_norm is None  # gradients not final on an accumulating micro-batch
    ex.forward_backward(ids, labels, loss_scale=0.5)
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert abs(ex.last_step.grad_norm - float(expected)) <= 1e-5 * float(expected)


def test_over_the_cap_raises_out_of_memory() -> None:
    model = make_model("llama")
    ids, labels = make_batch()
    plan = Plan.from_tiers(model, PLANS["keep-all"])
    peak = Executor(model, plan, EmulatedDevice()).predicted_peak_bytes(3, 11)
    ex = Executor(model, plan, EmulatedDevice(capacity_bytes=peak - 1))
    with pytest.raises(torch.OutOfMemoryError, match="out of memory.*bytes"):
        ex.forward_backward(ids, labels)
    assert ex.device.used_bytes == 0  # the failed step returned every byte
    ok = Executor(model, plan, EmulatedDevice(capacity_bytes=peak))
    ok.forward_backward(ids, labels)
    assert ok.last_step.peak_device_bytes == peak


def test_failed_step_removes_its_spill_files(tmp_path) -> None:
    model = make_model("llama")
    ids, labels = make_batch()
    plan = Plan.from_tiers(model, PLANS["mix-nvme"])
    peak = Executor(model, plan, EmulatedDevice()).predicted_peak_bytes(3, 11)
    ex = Executor(model, plan, EmulatedDevice(capacity_bytes=peak - 1, nvme_dir=tmp_path))
    with pytest.raises(torch.OutOfMemoryError):
        ex.forward_backward(ids, labels)
    assert ex.store.peak_nvme_bytes > 0  # it failed after spilling (the peak is in the backward)
    assert list(tmp_path.iterdir()) == [] and ex.device.used_bytes == 0


def test_offloading_lowers_the_peak() -> None:
    model = make_model("llama", num_layers=8)
    ex = Executor(model, Plan.from_tiers(model, ["gpu"] * 9), EmulatedDevice())
    sizes = ex.memory_sizes(3, 11)
    keep = build_program(["gpu"] * 9, sizes).device_peak_bytes()
    offload = build_program(["gpu"] + ["cpu"] * 7 + ["gpu"], sizes).device_peak_bytes()
    assert keep - offload >= 4 * sizes.boundary_bytes[0]


def test_plan_for_another_model_is_refused() -> None:
    model = make_model("llama")
    other = make_model("llama", num_layers=NUM_LAYERS - 1)
    with pytest.raises(LazyTrainError, match="plan was made for model"):
        Executor(model, Plan.from_tiers(other, ["gpu"] * NUM_LAYERS), EmulatedDevice())


def test_plan_for_another_workload_is_refused() -> None:
    from lazytrain import Workload

    model = make_model("llama")
    ids, labels = make_batch(3, 11)
    plan = Plan.from_tiers(model, PLANS["keep-all"], workload=Workload(3, 11, "fp32"))
    ex = Executor(model, plan, EmulatedDevice())
    ex.forward_backward(ids, labels)
    with pytest.raises(LazyTrainError, match="plan was made for"):
        ex.forward_backward(*make_batch(3, 9))
    with pytest.raises(LazyTrainError, match="plan was made for"):
        Executor(model, plan, EmulatedDevice(), compute_dtype=torch.bfloat16).forward_backward(ids, labels)


def test_missing_nvme_dir_is_reported_before_the_step(tmp_path) -> None:
    model = make_model("llama")
    plan = Plan.from_tiers(model, PLANS["mix-nvme"])
    with pytest.raises(LazyTrainError, match="does not exist"):
        Executor(model, plan, EmulatedDevice(nvme_dir=tmp_path / "missing"))
    Executor(model, Plan.from_tiers(model, PLANS["all-cpu"]), EmulatedDevice(nvme_dir=tmp_path / "missing"))


def test_nvme_files_are_removed_after_the_step(tmp_path) -> None:
    model = make_model("mistral")
    ids, labels = make_batch()
    ex = Executor(model, Plan.from_tiers(model, PLANS["mix-nvme"]), EmulatedDevice(nvme_dir=tmp_path))
    ex.forward_backward(ids, labels)
    assert list(tmp_path.iterdir()) == []
    assert ex.last_step.peak_nvme_bytes == 2 * 3 * 11 * 32 * 4


def test_a_full_nvme_disk_is_refused_before_the_step(tmp_path, monkeypatch) -> None:
    import shutil

    import lazytrain.runtime.device as device

    model = make_model("llama")
    ids, labels = make_batch()
    ex = Executor(model, Plan.from_tiers(model, PLANS["mix-nvme"]), EmulatedDevice(nvme_dir=tmp_path))
    need = 2 * 3 * 11 * 32 * 4  # two nvme boundaries of batch 3 x 11 tokens x hidden 32, fp32
    free = need - 1 - int(torch.randint(0, need // 2, ()))
    monkeypatch.setattr(device.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 * need, 0, free))
    from lazytrain.units import format_bytes

    with pytest.raises(LazyTrainError, match=rf"spills {format_bytes(need)} there but the disk has "
                                             rf"{format_bytes(free)} free \(short by {format_bytes(need - free)}\)"):
        ex.forward_backward(ids, labels)
    assert all(p.grad is None for p in model.parameters()) and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(device.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 * need, 0, need))
    ex.forward_backward(ids, labels)  # exactly enough


def test_a_disk_full_during_the_step_leaves_no_spill_file(tmp_path, monkeypatch) -> None:
    """The first spill file is /dev/full: the write fails with ENOSPC part-way, like a full disk."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    import os

    import lazytrain.runtime.store as store

    model = make_model("llama")
    ids, labels = make_batch()
    ex = Executor(model, Plan.from_tiers(model, PLANS["mix-nvme"]), EmulatedDevice(nvme_dir=tmp_path))
    real_open = store.open_spill_file
    opened = []
    monkeypatch.setattr(store, "open_spill_file",
                        lambda d: real_open(d) if opened else opened.append(1) or os.open("/dev/full", os.O_RDWR))
    with pytest.raises(LazyTrainError, match="cannot write an NVMe spill file in .*: No space left on device; free"):
        ex.forward_backward(ids, labels)
    assert list(tmp_path.iterdir()) == [] and ex.device.used_bytes == 0
    ex.forward_backward(ids, labels)  # the next step runs: nothing of the failed one is left behind


def test_throttled_links_stall_and_are_measured() -> None:
    model = make_model("llama")
    ids, labels = make_batch()
    fast = Executor(model, Plan.from_tiers(model, PLANS["all-cpu"]), EmulatedDevice())
    fast.forward_backward(ids, labels)
    model.zero_grad()
    slow = EmulatedDevice(h2d_gbps=0.001)  # 1 MB/s: a 28 KB layer takes ~28 ms per crossing
    ex = Executor(model, Plan.from_tiers(model, PLANS["all-cpu"]), slow)
    ex.forward_backward(ids, labels)
    stats = ex.last_step
    h2d_s = stats.link_bytes["h2d"] / 1e6
    compute_s = sum(stats.forward_s) + sum(stats.backward_s) + stats.head_s
    assert stats.link_bytes["h2d"] == fast.last_step.link_bytes["h2d"]
    assert stats.link_busy_s["h2d"] >= 0.95 * h2d_s
    assert stats.wall_s >= h2d_s  # the h2d link is the bottleneck ...
    assert stats.stall_s["h2d"] >= 0.8 * (h2d_s - compute_s)  # ... compute measurably waits on it ...
    assert stats.wall_s >= compute_s + stats.exposed_s  # ... and every second is compute or a stall
    assert fast.last_step.stall_s["h2d"] < stats.stall_s["h2d"]


def test_device_peak_equals_the_simulators() -> None:
    """The arena's measured peak is the simulator's predicted gpu peak for the same plan and cost model."""
    pytest.importorskip("lazytrain.plan.sim")
    from lazytrain import CostModel, HardwareSpec, ModelSpec, Workload
    from lazytrain.plan.sim import simulate

    for kind in ("llama", "qwen2"):
        model = make_model(kind, attn="sdpa")  # SDPA: no mask tensor (the cost model counts none)
        ids, labels = make_batch()
        cost = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"), Workload(3, 11, "fp32"))
        for name, tiers in PLANS.items():
            plan = Plan.from_tiers(model, tiers)
            ex = Executor(model, plan, EmulatedDevice(), cost=cost, head_chunk_tokens=cost.head_chunk_tokens)
            ex.forward_backward(ids, labels)
            predicted = simulate(plan, cost).peak_bytes["gpu"]
            assert ex.last_step.peak_device_bytes == predicted, (kind, name)  # to the byte (the arena allocates
            # the program's sizes: this checks the executor follows the program; true bytes: test_live_bytes.py)


# ---- kept layers: the last K layers keep their graph and weights from forward to backward ------------------
KEPT = {  # K -> tiers whose boundaries L-K..L are gpu (the rest mixed)
    1: ["gpu", "recompute", "cpu", "nvme", "recompute", "gpu", "gpu"],
    3: ["gpu", "cpu", "recompute", "gpu", "gpu", "gpu", "gpu"],
    NUM_LAYERS: ["gpu"] * (NUM_LAYERS + 1),
}


@pytest.mark.exactness
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])  # qwen2: a tied head
@pytest.mark.parametrize("kept", list(KEPT))
def test_kept_layers_match_transformers(kind: str, kept: int, tmp_path) -> None:
    """K = 1, some, L kept layers (K = 0 is every test above): loss and every gradient as transformers; a kept
    layer's backward runs through its graph (no re-forward), its weights are streamed once."""
    model = make_model(kind)
    ids, labels = make_batch()
    ref_loss, ref_grads = reference(model, input_ids=ids, labels=labels)
    plan = Plan.from_tiers(model, KEPT[kept], kept_layers=kept)
    ex = Executor(model, plan, EmulatedDevice(nvme_dir=tmp_path), head_chunk_tokens=7)
    assert_matches(model, ex.forward_backward(ids, labels), ref_loss, ref_grads)
    program = ex.program(3, 11)
    L = NUM_LAYERS
    backward = [op for op in program.ops if op.lane == "compute" and op.name.startswith("B")]
    assert [op.kind for op in backward] == ["backprop"] * kept + ["backward"] * (L - kept)
    streamed = [op.target for op in program.ops if op.kind == "weights"]
    assert all(streamed.count(j) == 1 for j in range(L - kept, L))  # once, for the forward
    assert ex.last_step.peak_device_bytes == ex.last_step.predicted_peak_device_bytes
    assert all(s > 0 for s in ex.last_step.backward_s) and all(s > 0 for s in ex.last_step.forward_s)


@pytest.mark.exactness
@pytest.mark.parametrize("kept", [1, NUM_LAYERS])
def test_kept_layers_are_bitwise_the_streamed_step(kept: int) -> None:
    """Keeping a graph changes where the forward's tensors live, not the math: bf16 loss and gradients equal the
    K = 0 step's bit for bit, over two micro-batches (gradient accumulation) and a deferred (overlapped) update."""
    results = []
    for k in (0, kept):
        model = make_model("qwen2")
        ex = Executor(model, Plan.from_tiers(model, KEPT[kept], kept_layers=k), EmulatedDevice(),
                      compute_dtype=torch.bfloat16)
        opt = torch.optim.AdamW([{"params": g} for g in ex.param_groups()], lr=1e-2)
        losses = []
        for step in range(2):
            for micro in range(2):
                ids, labels = make_batch(3, 7, seed=10 * step + micro)
                losses.append(ex.forward_backward(ids, labels, loss_scale=0.5, last_micro_batch=micro == 1))
            ex.defer_update(functools.partial(_step_exposed, ex, opt))
        grads = [g.clone() for index in range(len(ex.param_groups())) for g in ex.gradients(index)]
        ex.drain()
        results.append((losses, grads, [p.detach().clone() for p in model.parameters()]))
    (losses0, grads0, params0), (losses1, grads1, params1) = results
    assert all(torch.equal(a, b) for a, b in zip(losses0, losses1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params0, params1, strict=True))


def test_kept_layers_need_gpu_boundaries() -> None:
    model = make_model("llama")
    with pytest.raises(LazyTrainError, match="must be 'gpu'"):
        Plan.from_tiers(model, KEPT[1], kept_layers=2)
    with pytest.raises(LazyTrainError, match="kept_layers must be"):
        Plan.from_tiers(model, KEPT[NUM_LAYERS], kept_layers=NUM_LAYERS + 1)


@pytest.mark.exactness
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: a tied head (its group owns the embedding)
@pytest.mark.parametrize("kept", [1, 3])
def test_kept_layers_serial_optimizer_steps_like_adamw(kind: str, kept: int, tmp_path) -> None:
    """Serial mode (the trainer's `optimizer_step` after the backward) with K kept layers, three steps of two
    micro-batches: each step's loss, global norm and every gradient as transformers' at the same parameters (a
    kept layer's gradient or a stale kept graph would be off by its whole size), and the parameters as
    torch.optim.AdamW stepping those same gradients after clip_grads_with_norm_. Not AdamW on transformers'
    gradients: Adam divides each gradient by its own RMS, so an element whose gradient is near rounding noise
    moves by up to lr either way, and which elements those are depends on the CPU's summation order."""
    model = make_model(kind)
    ref = copy.deepcopy(model)
    cfg = load_job_config({"optimizer": "adamw", "optimizer_mode": "serial", "learning_rate": 1e-2,
                           "weight_decay": 0.1, "max_grad_norm": 1.0})
    opt = build_optimizer(cfg, model)
    decay = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    params = dict(model.named_parameters())
    ref_groups = [{"params": [q for n, q in ref.named_parameters() if (id(params[n]) in decay) == d],
                   "weight_decay": 0.1 if d else 0.0} for d in (True, False)]
    o = cfg.optim
    ref_opt = torch.optim.AdamW(ref_groups, lr=1e-2, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_epsilon)
    ex = Executor(model, Plan.from_tiers(model, KEPT[kept], kept_layers=kept), EmulatedDevice(nvme_dir=tmp_path),
                  head_chunk_tokens=7)
    clipped = 0
    for step in range(3):
        micro = [make_batch(3, 11, seed=100 + 10 * step + m) for m in range(2)]
        tokens = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)  # shifted: the loss's targets
        loss = sum(float(ex.forward_backward(ids, labels, num_tokens=tokens, last_micro_batch=m == 1))
                   for m, (ids, labels) in enumerate(micro))

        with torch.no_grad():  # transformers at LazyTrain's parameters: this step's rounding, not the last ones'
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                q.copy_(p)
        ref.zero_grad(set_to_none=True)
        ref_loss = 0.0
        for ids, labels in micro:  # the step's token mean, summed over its micro-batches
            logits = ref(input_ids=ids).logits[:, :-1].flatten(0, 1)
            part = torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), reduction="sum") / tokens
            part.backward()
            ref_loss += float(part.detach())
        assert_matches(model, loss, ref_loss, {n: q.grad for n, q in ref.named_parameters()})
        ref_norm = float(torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()]))
        grad_norm = ex.last_step.grad_norm
        assert grad_norm == pytest.approx(ref_norm, rel=1e-5), step  # each gradient within 1e-5: so is their norm

        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            q.grad = p.grad.clone()  # AdamW on LazyTrain's own gradients, clipped by its own norm
        torch.nn.utils.clip_grads_with_norm_(ref.parameters(), 1.0, torch.tensor(grad_norm))
        ref_opt.step()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert optimizer_step(cfg, opt, ex, grad_norm=grad_norm) == grad_norm
        clipped += grad_norm > 1.0
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            err = float((p - q).detach().abs().max())
            # the same AdamW arithmetic, fused there and foreach here: a few fp32 ulps of |p| and of the step
            # lr * |m_hat / sqrt(v_hat)|, which Cauchy-Schwarz bounds by 1.01 * lr over the first 3 steps
            bound = 4 * torch.finfo(torch.float32).eps * (float(before[name].abs().max()) + 1e-2)
            assert err <= bound, f"step {step} {name}: max |param - AdamW's| {err:.2e} > {bound:.2e}"
            assert float((p - before[name]).detach().abs().max()) > 1e-3, name  # the step moved it (by ~lr)
        assert all(p.grad is None for p in model.parameters())  # dropped after the step
    assert clipped > 0  # the clip is exercised
    assert [op.kind for op in ex.program(3, 11).ops if op.name.startswith("B")][:kept] == ["backprop"] * kept
