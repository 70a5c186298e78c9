"""Model loading and config validation: exact loads, and every bad model a one-line error (exit 2 from the CLI).

Fault injection on real files: truncated, empty and corrupt safetensors, shapes that disagree with the config,
a missing tensor or shard, NaN weights, a directory without weights, a hub id not in the cache, a config
transformers reads differently from LazyTrain (the multimodal-wrapper case), and invalid shape keys.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from checks import raises_one_line
from safetensors.torch import load_file, save_file
from tiny_models import FAMILIES, make_model
from torch.utils._python_dispatch import TorchDispatchMode

from lazytrain.cli import main
from lazytrain.costmodel.model import MAX_LAYERS, PRESET_DIR, ModelSpec
from lazytrain.runtime.weights import built_spec, load_model, resolve_model

RNG = random.Random(20261203)
TRAIN = ["--corpus", "zen", "--batch-size", "2", "--seq-len", "16", "--steps", "1", "--eval-batches", "0",
         "--no-progress", "--device", "cpu"]


def _config(model_type: str = "llama", **over: object) -> transformers.PretrainedConfig:
    heads = RNG.choice([2, 4])
    dims = dict(vocab_size=RNG.randrange(260, 400), hidden_size=heads * RNG.choice([8, 16]),
                intermediate_size=RNG.randrange(40, 90), num_hidden_layers=RNG.randrange(2, 4),
                num_attention_heads=heads, num_key_value_heads=RNG.choice([1, 2]), max_position_embeddings=64)
    return transformers.AutoConfig.for_model(model_type, **{**dims, **over})


def _save(path: Path, config: transformers.PretrainedConfig, shard: str | None = None) -> torch.nn.Module:
    torch.manual_seed(RNG.randrange(2**31))
    model = transformers.AutoModelForCausalLM.from_config(config)
    for p in model.parameters():  # fresh values everywhere (norm gains start at 1, biases at 0)
        p.data.normal_(0, 0.1)
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)
    return model


def _load(path: Path, init: str = "auto") -> torch.nn.Module:
    return load_model(resolve_model(str(path)), init=init)


# ---- exact loads ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type, shard, tied", [("llama", None, False), ("qwen2", "40KB", True),
                                                     ("qwen3", "40KB", False), ("mistral", None, True)])
def test_loaded_model_equals_from_pretrained(tmp_path, model_type, shard, tied):
    config = _config(model_type, tie_word_embeddings=tied)
    saved = _save(tmp_path, config, shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    model = _load(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.config._attn_implementation == "sdpa" and model.training
    for (name, p), q in zip(model.named_parameters(), saved.parameters(), strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, q), name
    for (name, b), r in zip(model.named_buffers(), reference.buffers(), strict=True):
        assert torch.equal(b, r), name  # rotary frequencies recomputed, not left uninitialised
    ids = torch.randint(0, config.vocab_size, (2, RNG.randrange(5, 20)))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["tiny-gpt-oss", "tiny-qwen3.6"])
def test_moe_and_hybrid_presets_load_exactly(tmp_path, preset):
    """GPT-OSS (MoE, sinks; no sdpa: left to transformers' choice) and Qwen3.5 (linear attention) as saved by
    transformers: the keys map 1:1."""
    raw = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    saved = _save(tmp_path, transformers.AutoConfig.for_model(**{k: v for k, v in raw.items() if k[0] != "_"}))
    model = _load(tmp_path)
    for (name, p), q in zip(model.named_parameters(), saved.parameters(), strict=True):
        assert torch.equal(p, q), name
    ids = torch.randint(0, raw["vocab_size"], (2, RNG.randrange(5, 20)))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, saved(ids).logits, rtol=0, atol=0)


def _moe_config(model_type: str) -> transformers.PretrainedConfig:
    """A tiny MoE config with more than ten experts (so natural key order, 2 before 10, matters)."""
    experts = dict(num_experts=RNG.randrange(11, 14), num_experts_per_tok=2, moe_intermediate_size=RNG.choice([8, 12]))
    if model_type == "qwen3_moe":
        return _config("qwen3_moe", head_dim=8, mlp_only_layers=[1], **experts)
    return _config("qwen3_5_moe_text", num_hidden_layers=3, head_dim=8, linear_num_key_heads=2,
                   linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                   layer_types=["linear_attention", "linear_attention", "full_attention"],
                   shared_expert_intermediate_size=16, **experts)


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The legacy hub layout of fused expert tensors: `experts.<i>.{gate,up,down}_proj.weight`, one per expert."""
    out = {}
    for key, value in state.items():
        prefix, fused = key.rpartition(".experts.")[0], key.rpartition(".experts.")[2]
        if fused == "gate_up_proj":
            gate, up = value.chunk(2, dim=1)
            for i in range(value.shape[0]):
                out[f"{prefix}.experts.{i}.gate_proj.weight"] = gate[i].clone()
                out[f"{prefix}.experts.{i}.up_proj.weight"] = up[i].clone()
        elif fused == "down_proj":
            for i in range(value.shape[0]):
                out[f"{prefix}.experts.{i}.down_proj.weight"] = value[i].clone()
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe"])
@pytest.mark.parametrize("layout", ["per-expert", "per-expert sharded", "fused"])
def test_per_expert_checkpoints_are_fused_as_transformers_does(tmp_path, model_type, layout):
    """Hub MoE checkpoints store one tensor per expert where transformers 5 builds one fused tensor per layer;
    the loader converts them with transformers' own conversion mapping, one fused parameter at a time."""
    saved = _save(tmp_path, _moe_config(model_type), shard="24KB" if layout.endswith("sharded") else None)
    fused = {k: v.contiguous() for k, v in saved.state_dict().items() if k != "lm_head.weight" or
             not saved.config.tie_word_embeddings}
    assert any(".experts.gate_up_proj" in k for k in fused)
    if layout == "per-expert":  # written by hand from the fused tensors (what a hub checkpoint stores)
        save_file(_per_expert(fused), tmp_path / "model.safetensors", metadata={"format": "pt"})
    elif layout == "fused":
        save_file(fused, tmp_path / "model.safetensors", metadata={"format": "pt"})
    else:  # save_pretrained's own layout, experts spread over shards
        stored = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
        assert "model.layers.0.mlp.experts.10.up_proj.weight" in stored
        assert len({stored[k] for k in stored if ".layers.0.mlp.experts." in k}) > 1
    model = _load(tmp_path)
    for (name, p), q in zip(model.named_parameters(), saved.parameters(), strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, q), name
    ids = torch.randint(0, saved.config.vocab_size, (2, RNG.randrange(5, 20)))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, saved(ids).logits, rtol=0, atol=0)


def test_a_per_expert_checkpoint_with_an_expert_missing_or_non_finite_is_one_line(tmp_path):
    saved = _save(tmp_path, _moe_config("qwen3_moe"))
    state = _per_expert({k: v.contiguous() for k, v in saved.state_dict().items()})
    expert = RNG.choice(sorted(k for k in state if ".experts." in k and k.endswith("up_proj.weight")))
    broken = dict(state)
    del broken[expert]
    save_file(broken, tmp_path / "model.safetensors", metadata={"format": "pt"})
    raises_one_line(lambda: _load(tmp_path), expert.rpartition(".experts.")[0] + ".experts.gate_up_proj",
                    "do not belong to this config")
    state[expert].view(-1)[RNG.randrange(state[expert].numel())] = float("nan")
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    raises_one_line(lambda: _load(tmp_path), "experts.gate_up_proj", "non-finite")


def test_bf16_weights_become_fp32_parameters(tmp_path):
    saved = _save(tmp_path, _config())
    saved.to(torch.bfloat16).save_pretrained(tmp_path)
    model = _load(tmp_path)
    for p, q in zip(model.parameters(), saved.parameters(), strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, q.float())


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_bf16_masters_load_straight_in_bf16(tmp_path, stored):
    """master_weights bf16: each tensor becomes a bf16 parameter as it is read (no fp32 model on the way), the
    values the fp32 load rounds to."""
    saved = _save(tmp_path, _config())
    saved.to(stored).save_pretrained(tmp_path)
    model = load_model(resolve_model(str(tmp_path)), dtype=torch.bfloat16)
    for p, q in zip(model.parameters(), _load(tmp_path).parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q.to(torch.bfloat16))


def test_deferred_masters_are_read_from_the_file_only_when_asked(tmp_path, monkeypatch):
    """Masters bound for the NVMe state files stay in the model's file: placeholders until `host_value` reads
    one (as the fp32 load has it), each read checked finite."""
    from lazytrain.runtime import weights

    _save(tmp_path, _config(), shard="40KB")
    reference = dict(_load(tmp_path).named_parameters())
    embedding = "model.embed_tokens.weight"
    read: list[str] = []
    real = weights._mapped_tensor
    monkeypatch.setattr(weights, "_mapped_tensor", lambda path, key, name: read.append(key) or real(path, key, name))
    model = load_model(resolve_model(str(tmp_path)), defer=lambda m: {n for n, _ in m.named_parameters()} - {embedding})
    assert embedding in read and all(k == embedding or k not in reference for k in read), read
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert weights.held_elsewhere(p) == (name != embedding), name
        assert torch.equal(weights.host_value(p), reference[name]), name
    # a non-finite value in a deferred tensor: refused when it is read, naming it
    key = RNG.choice(sorted(set(reference) - {embedding}))
    shard = next(f for f in tmp_path.glob("model-*.safetensors") if key in load_file(f))
    state = load_file(shard)
    state[key].view(-1)[RNG.randrange(state[key].numel())] = float("nan")
    save_file(state, shard, metadata={"format": "pt"})
    raises_one_line(lambda: weights.host_value(params[key]), key, "non-finite")


def test_init_random_builds_from_the_config_alone(tmp_path):
    config = _config()
    config.save_pretrained(tmp_path)
    raises_one_line(lambda: _load(tmp_path), "has no model.safetensors", "init: random")
    model = _load(tmp_path, init="random")
    assert sum(p.numel() for p in model.parameters()) == ModelSpec.from_config(config).num_params
    _load(tmp_path / "config.json")  # a config.json names a shape: random init without asking



@pytest.mark.parametrize("kind", FAMILIES)
def test_random_init_in_bf16_is_built_in_bf16_with_fp32s_values(tmp_path, kind):
    """No fp32 model on the way to bf16 masters (a 14B model's would be 55 GiB beside its 27.5 GiB bf16 copy): the
    tensors made while building are bf16 but the rotary frequencies, and hold fp32's seeded init rounded."""
    config = make_model(kind, num_layers=3).config
    config.save_pretrained(tmp_path)
    made: list[torch.Tensor] = []

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made.extend(t for t in (out if isinstance(out, tuple | list) else [out]) if isinstance(t, torch.Tensor))
            return out

    with Made():
        model = load_model(resolve_model(str(tmp_path)), init="random", seed=5, dtype=torch.bfloat16)
    fp32 = sum(t.numel() for t in made if t.dtype == torch.float32 and not t.is_meta)
    buffers = sum(b.numel() for b in model.buffers() if b.dtype == torch.float32)
    assert fp32 <= 2 * buffers + 1000, f"{fp32:,} fp32 elements made for a model of " \
                                       f"{sum(p.numel() for p in model.parameters()):,} parameters"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    reference = load_model(resolve_model(str(tmp_path)), init="random", seed=5, dtype=torch.float32)
    computed_in_bf16 = {"A_log"}  # Qwen3.5's log(uniform) is taken in the parameter's dtype
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        if name.rsplit(".", 1)[-1] in computed_in_bf16:  # one bf16 rounding of log's value apart
            torch.testing.assert_close(p.float(), q.bfloat16().float(), rtol=2 ** -7, atol=0)
        else:
            assert torch.equal(p, q.bfloat16()), name

# ---- broken weight files ----------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage header"])
def test_damaged_safetensors_are_one_line_errors(tmp_path, damage):
    _save(tmp_path, _config())
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[:RNG.randrange(len(data) // 2, len(data) - 1)], "empty": b"",
                         "garbage header": b"\xff" * 8 + data[8:]}[damage])
    raises_one_line(lambda: _load(tmp_path), "model.safetensors", "truncated or corrupt")


def test_shape_mismatch_names_the_tensor(tmp_path):
    config = _config()
    _save(tmp_path, config)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["intermediate_size"] += 8
    (tmp_path / "config.json").write_text(json.dumps(raw))
    raises_one_line(lambda: _load(tmp_path), "mlp", "has shape", "do not belong to this config")


def test_missing_tensor_is_refused_not_random_initialised(tmp_path):
    _save(tmp_path, _config())
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    dropped = RNG.choice(sorted(k for k in state if ".layers." in k))
    del state[dropped]
    save_file(state, weights, metadata={"format": "pt"})
    raises_one_line(lambda: _load(tmp_path), dropped, "missing from its weights")


def test_missing_shard_is_refused(tmp_path):
    _save(tmp_path, _config(), shard="40KB")
    shard = RNG.choice(sorted(tmp_path.glob("model-*.safetensors")))
    shard.unlink()
    raises_one_line(lambda: _load(tmp_path), shard.name, "missing")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_at_load(tmp_path, bad):
    _save(tmp_path, _config())
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    key = RNG.choice(sorted(state))
    flat = state[key].view(-1)
    flat[RNG.randrange(flat.numel())] = bad
    save_file(state, weights, metadata={"format": "pt"})
    raises_one_line(lambda: _load(tmp_path), key, "non-finite")


def test_huge_but_finite_weights_load(tmp_path):
    """Values whose sum overflows fp32 are still finite: loaded, not refused."""
    _save(tmp_path, _config())
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    key = RNG.choice(sorted(state))
    state[key].view(-1)[:2] = 3e38
    save_file(state, weights, metadata={"format": "pt"})
    assert torch.equal(dict(_load(tmp_path).named_parameters())[key], state[key])


def test_pickle_only_directory_says_safetensors(tmp_path):
    _config().save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    raises_one_line(lambda: _load(tmp_path), "safetensors")


# ---- the hub cache, offline -----------------------------------------------------------------------
def test_hub_id_from_the_cache_only(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    raises_one_line(lambda: resolve_model("someone/not-cached"), "not in the local Hugging Face cache",
                    "hf download someone/not-cached")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny"
    snapshot = repo / "snapshots" / commit
    saved = _save(snapshot, _config())
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    source = resolve_model("someone/tiny")
    assert source.kind == "hub" and source.directory == snapshot
    model = load_model(source)
    for p, q in zip(model.parameters(), saved.parameters(), strict=True):
        assert torch.equal(p, q)


# ---- admission counts what transformers builds -----------------------------------------------------
def test_a_config_transformers_reads_differently_is_refused_naming_both_counts(tmp_path, capsys):
    """model_type qwen3_5 with flat text keys: transformers builds its default 9 B text model, not these shapes."""
    flat = {"model_type": "qwen3_5", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    small = ModelSpec.from_config(flat).num_params
    text = raises_one_line(lambda: built_spec(resolve_model(str(tmp_path)).config), f"{small:,}",
                           "transformers builds Qwen3_5ForCausalLM")
    assert int(text.split("with ")[1].split(" parameters")[0].replace(",", "")) > 1e9
    for argv in (["plan", "--model", str(tmp_path), "--batch-size", "1"],
                 ["train", "--model", str(tmp_path / "config.json"), "--output-dir", str(tmp_path / "run"), *TRAIN]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and f"{small:,}" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---- one config validator for plan and train ---------------------------------------------------------
BAD_KEYS = {
    "num_key_value_heads": 0,
    "hidden_size": 64.5,
    "num_attention_heads": 5,  # divides neither the hidden size nor by the kv heads
    "intermediate_size": 10**30,  # overflows a float's exact range
    "num_hidden_layers": MAX_LAYERS + 1,
    "vocab_size": True,
    "rms_norm_eps": -1,  # was transformers' StrictDataclassFieldValidationError, a traceback
}


@pytest.mark.parametrize("key", list(BAD_KEYS))
def test_invalid_shapes_are_refused_by_plan_and_train_naming_the_key(tmp_path, capsys, key):
    raw = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, key: BAD_KEYS[key]}
    raises_one_line(lambda: ModelSpec.from_config(raw), key)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for argv in (["plan", "--model", str(tmp_path / "config.json"), "--batch-size", "1"],
                 ["train", "--model", str(tmp_path / "config.json"), "--output-dir", str(tmp_path / "run"), *TRAIN]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and key in err, err


def test_a_field_only_transformers_validates_is_one_line(tmp_path, capsys):
    """transformers' configs validate their own fields (huggingface_hub's StrictDataclassError, not a ValueError):
    `initializer_range: "wide"` is one line naming the field, not a traceback."""
    raw = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "initializer_range": "wide"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["plan", "--model", str(tmp_path), "--batch-size", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "initializer_range" in err, err


def test_train_cli_damaged_weights_exit_2_without_a_traceback(tmp_path):
    """A subprocess, as a user runs it: one `error:` line on stderr, exit 2, nothing written."""
    _save(tmp_path / "model", _config(vocab_size=300))
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "lazytrain.cli", "train", "--model", str(tmp_path / "model"),
                           "--output-dir", str(out), *TRAIN], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout and not (out / "metrics.jsonl").exists()
