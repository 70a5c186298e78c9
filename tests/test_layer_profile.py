"""benchmarks/layer_profile.py: layer times measured in isolation (benchmarks/calibrate.py's prediction)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import transformers

from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from layer_profile import profiled_cost  # noqa: E402 - a benchmark's module

RNG = random.Random(20261202)


@pytest.mark.parametrize("path", ["executor", "modules"])
def test_profiled_cost_times_a_real_tiny_model(path: str, monkeypatch) -> None:
    spec_cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256}
    torch.manual_seed(RNG.randrange(2**31))
    config = transformers.AutoConfig.for_model(**spec_cfg)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config)
    if path == "modules":  # a model the executor's helpers refuse: time its own modules

        def refuse(_model):
            raise LazyTrainError("not supported")

        monkeypatch.setattr("lazytrain.runtime.hf.find_parts", refuse)
    cost = profiled_cost(model, HardwareSpec.load("emulated"), Workload(2, 32, "fp32"), repeats=1)
    assert all(t > 0 for t in cost.forward_s + cost.backward_s) and cost.head_s > 0
    assert cost.forward_s[0] == cost.forward_s[1]  # same shape: measured once
    assert cost.backward_s[0] == cost.backward_s[1] != cost.forward_s[0]
    assert all(p.grad is None for p in model.parameters())  # profiling leaves no gradients behind
