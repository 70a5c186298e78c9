"""LoRA and freeze tuning through the executor, exactly: loss and every trainable gradient against PEFT's LoRA
(`peft.get_peft_model`) and against transformers with the frozen parameters' `requires_grad_(False)`, for every
family under a plan with every tier; frozen parameters get no gradient and send nothing back."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import tiny_models
import torch
from tiny_models import FAMILIES, Gradients, assert_matches, make_batch, make_model

from lazytrain import EmulatedDevice, Executor, Plan
from lazytrain.errors import LazyTrainError
from lazytrain.runtime.adapters import LoraSettings, add_lora, freeze, linear_names

MIXED = ["gpu", "nvme", "recompute", "cpu", "recompute", "gpu", "gpu"]  # every tier, two recompute segments
KEPT = ["gpu", "recompute", "recompute", "cpu", "gpu", "gpu", "gpu"]  # with the last two layers kept (graphs)


def our_name(peft_name: str) -> str:
    """PEFT's parameter name as `add_lora` names it: no wrapper prefix, no adapter name."""
    return peft_name.removeprefix("base_model.model.").replace(".modules_to_save", "").replace(".default", "")


def targets_of(model: torch.nn.Module) -> tuple[str, ...]:
    """Every linear of the decoder layers (lora_target all); in an MoE model less the MLP projection names, which
    PEFT also maps onto the fused expert tensors (not linears: `add_lora` leaves the experts frozen)."""
    moe = any("experts" in n for n, _ in model.named_modules())
    return tuple(n for n in linear_names(model) if not (moe and n in ("gate_proj", "up_proj", "down_proj")))


def peft_twin(model: torch.nn.Module, rank: int, dropout: float, **extra) -> torch.nn.Module:
    """PEFT's LoRA on a copy of `model` (`targets_of`), with B drawn at random (PEFT starts it at zero, which would
    leave A without a gradient)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout,
                             target_modules=list(targets_of(model)), **extra)
    twin = peft.get_peft_model(copy.deepcopy(model), config)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return twin


def ours_from(twin: torch.nn.Module, model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """`add_lora` on a copy of `model`, with the twin's adapter weights (PEFT's names less the prefix and the
    adapter name are ours)."""
    ours = copy.deepcopy(model)
    add_lora(ours, dataclasses.replace(settings, targets=targets_of(model)))
    theirs = {our_name(n): p for n, p in twin.named_parameters()}
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if p.requires_grad:
                p.copy_(theirs[name])
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == {
        our_name(n) for n, p in twin.named_parameters()
        if p.requires_grad}
    return ours


def run(model: torch.nn.Module, tiers: list[str], ids: torch.Tensor, labels: torch.Tensor,
        kept: int = 0) -> tuple[Executor, float]:
    ex = Executor(model, Plan.from_tiers(model, tiers, kept_layers=kept), EmulatedDevice(), head_chunk_tokens=6)
    loss = float(ex.forward_backward(ids, labels))
    return ex, loss


def reference(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, Gradients]:
    """tiny_models' reference (the model's own forward and backward, and fp32 rounding's size measured against
    float64) with each trainable parameter's gradient under the name `add_lora` gives it."""
    loss, grads = tiny_models.reference(model, input_ids=ids, labels=labels)
    return loss, grads.renamed(our_name)


@pytest.mark.exactness
@pytest.mark.parametrize("kind", FAMILIES)
def test_lora_matches_peft(kind: str) -> None:
    model = make_model(kind)
    twin = peft_twin(model, rank=4, dropout=0.0)
    ours = ours_from(twin, model, LoraSettings(rank=4))
    ids, labels = make_batch(2, 9, seed=5)
    ref_loss, ref_grads = reference(twin, ids, labels)
    ex, loss = run(ours, MIXED, ids, labels)
    assert_matches(ours, loss, ref_loss, ref_grads)
    # only the adapters cross the link back: no gradient of the frozen head or embedding, no boundary-0 d2h
    assert {op.kind for op in ex.program(2, 9).ops if op.lane == "d2h"} == {"grads", "offload"}
    assert ex.last_step.peak_device_bytes == ex.last_step.predicted_peak_device_bytes


@pytest.mark.exactness
@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_lora_dropout_draws_peft_masks(kind: str) -> None:
    """Dropout > 0: the same seed gives PEFT's masks, though the executor runs each layer's forward up to three
    times (forward, recompute, backward): every re-forward replays the first one's draws."""
    model = make_model(kind)
    twin = peft_twin(model, rank=4, dropout=0.3)
    ours = ours_from(twin, model, LoraSettings(rank=4, dropout=0.3))
    twin.train()
    ours.train()
    ids, labels = make_batch(2, 9, seed=6)
    torch.manual_seed(123)
    ref_loss, ref_grads = reference(twin, ids, labels)
    after_ref = torch.rand(1)
    torch.manual_seed(123)
    _, loss = run(ours, MIXED, ids, labels)
    assert torch.equal(torch.rand(1), after_ref)  # the step drew exactly the model's draws
    assert_matches(ours, loss, ref_loss, ref_grads)
    torch.manual_seed(124)  # another seed: other masks, another loss (the test can fail)
    other_model = copy.deepcopy(ours)
    other_model.zero_grad(set_to_none=True)
    _, other = run(other_model, MIXED, ids, labels)
    with pytest.raises(AssertionError):
        assert_matches(other_model, other, ref_loss, ref_grads)


@pytest.mark.exactness
def test_rslora_and_additional_target_match_peft() -> None:
    model = make_model("qwen2")  # q/k/v biases, tied embeddings
    twin = peft_twin(model, rank=2, dropout=0.0, use_rslora=True, modules_to_save=["norm"])
    ours = ours_from(twin, model, LoraSettings(rank=2, rslora=True, additional=("norm",)))
    ids, labels = make_batch(2, 9, seed=8)
    ref_loss, ref_grads = reference(twin, ids, labels)
    _, loss = run(ours, MIXED, ids, labels)
    assert_matches(ours, loss, ref_loss, ref_grads)


@pytest.mark.exactness
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3_moe"])
@pytest.mark.parametrize(("layers", "modules", "extra"), [(2, ("all",), ()), (-1, ("mlp",), ("embed_tokens",)),
                                                          (1, ("self_attn",), ("norm", "lm_head"))])
def test_freeze_tuning_matches_requires_grad_false(kind, layers, modules, extra) -> None:
    model = make_model(kind)
    freeze(model, layers, modules, extra)
    ids, labels = make_batch(2, 9, seed=9)
    ref_loss, ref_grads = reference(model, ids, labels)
    ex, loss = run(model, MIXED, ids, labels)
    assert_matches(model, loss, ref_loss, ref_grads)
    frozen = [j for j, g in enumerate(ex.layer_groups) if not g.grad_numel]
    sent = {op.target for op in ex.program(2, 9).ops if op.kind == "grads"}
    assert frozen and not sent & set(frozen)  # a frozen layer sends no gradient
    assert ex.param_groups()[ex.index_of(frozen[0])] == []  # nor has anything to update


@pytest.mark.exactness
def test_kept_layers_with_lora() -> None:
    model = make_model("llama")
    twin = peft_twin(model, rank=3, dropout=0.0)
    ours = ours_from(twin, model, LoraSettings(rank=3))
    ids, labels = make_batch(2, 9, seed=10)
    ref_loss, ref_grads = reference(twin, ids, labels)
    _, loss = run(ours, KEPT, ids, labels, kept=2)
    assert_matches(ours, loss, ref_loss, ref_grads)


def test_unknown_targets_are_refused_in_one_line() -> None:
    with pytest.raises(LazyTrainError, match=r"lora_target qkv: no such linear module .*choose from .*q_proj"):
        add_lora(make_model("llama"), LoraSettings(targets=("qkv",)))
    with pytest.raises(LazyTrainError, match=r"freeze_trainable_modules attn: not in a decoder layer"):
        freeze(make_model("llama"), 2, ("attn",), ())
    with pytest.raises(LazyTrainError, match=r"freeze_extra_modules head: no such module"):
        freeze(make_model("llama"), 2, ("all",), ("head",))


def test_packing_a_lora_base_keeps_one_copy_of_it() -> None:
    """A LoRA layer is packed by copy (its bf16 base beside fp32 adapters): the tensors the base was loaded in are
    returned to the kernel as each layer is packed, not kept by the emulated device's never-trimmed heap as a
    second copy of the model (its RSS grew by the whole base before: 1.57x of admission on a 350 M model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lazytrain.runtime.adapters import cast_frozen
    from lazytrain.train.peak import rss_bytes

    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4)
    model = LlamaForCausalLM(config)
    add_lora(model, LoraSettings(rank=4))
    cast_frozen(model, torch.bfloat16)
    base_bytes = sum(p.numel() * 2 for p in model.model.layers.parameters() if not p.requires_grad)
    device = EmulatedDevice()  # keeps freed host memory from here on
    before = rss_bytes()
    if before is None:
        pytest.skip("no /proc/self/status here")
    Executor(model, Plan.from_tiers(model, ["gpu"] * 9), device, compute_dtype=torch.bfloat16)
    assert rss_bytes() - before < base_bytes / 2, (rss_bytes() - before, base_bytes)
