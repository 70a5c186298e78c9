"""QLoRA through the executor, exactly: with the decoder layers' frozen linears streamed as NF4 bytes and
dequantized on the device, the loss and every adapter gradient under a plan with every tier equal PEFT's LoRA on the
same transformers model whose base linears hold the dequantized weights; and a layer crosses the link in about a
quarter of its bf16 bytes."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from test_adapters import MIXED, peft_twin, reference, run
from test_adapters import ours_from as adapted
from tiny_models import assert_matches, make_batch, make_model

from lazytrain.costmodel.trainable import nf4_bytes
from lazytrain.runtime import nf4
from lazytrain.runtime.adapters import LoraSettings, add_lora, cast_frozen, decoder_layers
from lazytrain.runtime.store import WeightGroup


def dequantized_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose decoder linears hold their NF4 round trip (what the quantized base computes with)."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for m in decoder_layers(twin).modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(nf4.dequantize(nf4.quantize(m.weight), tuple(m.weight.shape), torch.float32))
    return twin


@pytest.mark.exactness
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q, k, v with biases (kept as they are)
def test_qlora_matches_peft_on_the_dequantized_base(kind: str) -> None:
    model = make_model(kind)
    twin = peft_twin(dequantized_twin(model), rank=4, dropout=0.0)
    ours = adapted(twin, model, LoraSettings(rank=4))
    count, _ = nf4.quantize_base(ours, torch.float32)
    assert count == 7 * len(decoder_layers(ours))  # every projection of every layer, the LoRA bases included
    assert not any(isinstance(m, torch.nn.Linear) and not m.weight.requires_grad
                   for m in decoder_layers(ours).modules())
    ids, labels = make_batch(2, 9, seed=5)
    ref_loss, ref_grads = reference(twin, ids, labels)
    ex, loss = run(ours, MIXED, ids, labels)
    assert_matches(ours, loss, ref_loss, ref_grads)
    # the test can fail: the unquantized base gives another loss and other gradients
    other_loss, other_grads = reference(peft_twin(model, rank=4, dropout=0.0), ids, labels)
    with pytest.raises(AssertionError):
        assert_matches(ours, loss, other_loss, other_grads)


def test_a_quantized_layer_streams_a_quarter_of_its_bf16_bytes() -> None:
    model = make_model("llama", num_layers=2)
    ours = copy.deepcopy(model)
    add_lora(ours, LoraSettings(rank=4))
    nf4.quantize_base(ours, torch.bfloat16)
    cast_frozen(ours, torch.bfloat16)  # as the trainer does: the norms in bf16, the NF4 bytes untouched
    layer, plain = decoder_layers(ours)[0], decoder_layers(model)[0]
    linear = sum(m.weight.numel() for m in plain.modules() if isinstance(m, torch.nn.Linear))
    frozen_bytes = sum(p.numel() * p.element_size() for p in layer.parameters() if not p.requires_grad)
    norms = sum(p.numel() for n, p in plain.named_parameters() if "norm" in n) * 2
    expected = sum(nf4_bytes(m.weight.numel()) for m in plain.modules() if isinstance(m, torch.nn.Linear))
    assert frozen_bytes == expected + norms
    assert expected < 0.27 * 2 * linear  # ~0.52 of 2 bytes per weight, plus each linear's 4-byte padding


def test_the_nf4_bytes_survive_packing_into_a_bf16_group() -> None:
    """The bytes travel as bf16 elements (some of them NaN patterns): packing and copying move bits, not values."""
    model = make_model("llama", num_layers=1)
    add_lora(model, LoraSettings(rank=4))
    nf4.quantize_base(model, torch.bfloat16)
    cast_frozen(model, torch.bfloat16)
    layer = decoder_layers(model)[0]
    before = {n: p.detach().view(torch.uint8).clone() for n, p in layer.named_parameters() if not p.requires_grad}
    group = WeightGroup("layer0", list(layer.named_parameters()), torch.bfloat16,
                        lambda shape, dtype: torch.empty(shape, dtype=dtype))
    slot = torch.empty_like(group.buffer).copy_(group.buffer)  # the h2d of the emulated device: a copy
    views = group.views(slot)
    assert all(torch.equal(views[n].view(torch.uint8), b) for n, b in before.items())
    lin = layer.self_attn.q_proj.base_layer
    assert torch.equal(nf4.dequantize(views["self_attn.q_proj.base_layer.packed"], (32, 32), torch.float32),
                       lin.dequantized())


def test_the_base_is_read_from_its_file_one_linear_at_a_time_as_it_is_quantized(tmp_path, monkeypatch) -> None:
    """build_model with quantization_bit 4 leaves every decoder linear's weight in the model's file until its turn
    (the process never holds the whole base in bf16 beside its NF4 bytes), and the NF4 bytes are those of the
    weights in the file."""
    from test_finetune import _model_dir

    from lazytrain.config import load_job_config
    from lazytrain.runtime.weights import deferred, resolve_model
    from lazytrain.train.build import build_model

    model_dir = _model_dir(tmp_path / "model", "llama")
    stored = {n: p.detach().clone() for n, p in
              transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters()}
    job = load_job_config(dict(model=str(model_dir), finetuning_type="lora", lora_rank=4, quantization_bit=4,
                               dtype="fp32", dataset="zen"))
    seen: list[int] = []  # at each quantization, the base weights still in the model's file
    built: list[torch.nn.Module] = []
    real, real_quantize_base = nf4.quantize, nf4.quantize_base

    def quantize(weight: torch.Tensor) -> torch.Tensor:
        seen.append(sum(deferred(p) for p in built[0].parameters()))
        return real(weight)

    def quantize_base(model, dtype):
        built.append(model)
        return real_quantize_base(model, dtype)

    monkeypatch.setattr(nf4, "quantize", quantize)
    monkeypatch.setattr("lazytrain.train.build.quantize_base", quantize_base)
    model = build_model(job, resolve_model(str(model_dir)))
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nf4.Nf4Linear)]
    assert len(linears) == 2 * 7 and seen == list(range(len(linears), 0, -1))  # one read per quantization
    assert not any(deferred(p) for p in model.parameters())
    for name, m in linears:
        key = name.removesuffix(".base_layer") + ".weight"
        assert torch.equal(m.packed.view(torch.uint8), real(stored[key]).view(torch.uint8)), name
