"""HardwareSpec: presets, overrides from keywords and YAML/JSON files, bad input, profile()."""

from __future__ import annotations

import json
import math
import random

import pytest
from checks import one_line

from lazytrain.costmodel.hardware import PRESETS, HardwareSpec
from lazytrain.errors import LazyTrainError

RNG = random.Random(20261202)


def test_presets_load_with_the_papers_h800_numbers() -> None:
    for name in ("h800", "rtx3090", "h100", "h200", "emulated"):
        hw = HardwareSpec.load(name)
        assert hw.name == name and hw.matmul_tflops > 0 and hw.host_mem_gbps > 0
    h800 = HardwareSpec.load("H800")  # case-insensitive
    assert (h800.h2d_gbps, h800.d2h_gbps, h800.nvme_read_gbps, h800.nvme_write_gbps) == (12.0, 12.0, 2.83, 3.35)
    assert h800.gpu_mem_bytes == 80 * 2**30
    assert HardwareSpec.load("rtx3090").gpu_mem_bytes == 24 * 2**30


def test_keyword_overrides_replace_only_the_named_fields() -> None:
    rate = RNG.uniform(1, 50)
    hw = HardwareSpec.load("h800", h2d_gbps=rate, d2h_gbps=math.inf)
    assert hw.h2d_gbps == rate and math.isinf(hw.d2h_gbps)
    assert hw.nvme_read_gbps == PRESETS["h800"]["nvme_read_gbps"]
    with pytest.raises(LazyTrainError, match="unknown field.*h2d_gbs"):
        HardwareSpec.load("h800", h2d_gbs=3.0)


def test_yaml_file_with_base_and_json_file_with_every_field(tmp_path) -> None:
    rate = round(RNG.uniform(100, 900), 3)
    yaml_file = tmp_path / "box.yaml"
    yaml_file.write_text(f"base: h800\nmatmul_tflops: {rate}\ngpu_mem_bytes: 40GiB\nnvme_read_gbps: inf\n")
    hw = HardwareSpec.load(yaml_file)
    assert hw.name == "box" and hw.matmul_tflops == rate and hw.gpu_mem_bytes == 40 * 2**30
    assert math.isinf(hw.nvme_read_gbps) and hw.h2d_gbps == 12.0
    full = {**PRESETS["rtx3090"], "name": "x", "host_mem_gbps": 23.7}
    json_file = tmp_path / "full.json"
    json_file.write_text(json.dumps(full))
    assert HardwareSpec.load(json_file).host_mem_gbps == 23.7
    # a file can itself be overridden by keyword
    assert HardwareSpec.load(json_file, h2d_gbps=1.5).h2d_gbps == 1.5


@pytest.mark.parametrize("text, match", [
    ("matmul_tflops: 100\n", "missing"),  # no base, fields missing
    ("base: h999\n", "not a preset"),
    ("base: h800\nwarp_speed: 9\n", "unknown field"),
    ("base: h800\nh2d_gbps: -3\n", "h2d_gbps must be > 0"),
    ("base: h800\nmatmul_tflops: fast\n", "matmul_tflops: cannot read"),
    ("- just\n- a list\n", "expected a mapping"),
    ("base: [unclosed\n", "cannot read it"),
])
def test_bad_hardware_files_give_one_line_errors(tmp_path, text: str, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(LazyTrainError, match=match) as err:
        HardwareSpec.load(path)
    one_line(str(err.value))


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(LazyTrainError, match="h800.*rtx3090"):
        HardwareSpec.load("a100-9000")


def test_zero_and_nan_rates_are_refused() -> None:
    with pytest.raises(LazyTrainError, match="matmul_tflops"):
        HardwareSpec.load("h800", matmul_tflops=0)
    with pytest.raises(LazyTrainError, match="d2h_gbps"):
        HardwareSpec.load("h800", d2h_gbps=float("nan"))
    assert HardwareSpec.load("h800", layer_overhead_s=0.0).layer_overhead_s == 0.0


def test_profile_measures_positive_rates_and_caps_links_at_memcpy() -> None:
    pytest.importorskip("torch")
    hw = HardwareSpec.profile(seconds=0.05)
    assert hw.name == "emulated-profiled"
    assert 1e-4 < hw.matmul_tflops < 100  # a CPU: between 0.1 GFLOPS and 100 TFLOPS
    assert hw.host_mem_gbps > 0 and hw.grad_accumulate_gbps > 0
    assert hw.h2d_gbps <= PRESETS["emulated"]["h2d_gbps"]
    assert HardwareSpec.profile(seconds=0.01, h2d_gbps=0.5).h2d_gbps == 0.5


def test_available_host_memory_is_capped_by_a_cgroup_limit(monkeypatch) -> None:
    import os
    from pathlib import Path

    import lazytrain.costmodel.hardware as hardware

    free = hardware.available_host_memory_bytes()
    if free is None:
        pytest.skip("this OS reports no available memory")
    assert 0 < free <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = int(free * random.uniform(0.1, 0.9))
    v2 = "/sys/fs/cgroup/memory.max"

    class CgroupPath(type(Path())):  # a container limited to `limit` bytes (cgroup v2)
        def read_text(self, *args, **kwargs) -> str:
            return f"{limit}\n" if str(self) == v2 else super().read_text(*args, **kwargs)

    monkeypatch.setattr(hardware, "Path", CgroupPath)
    assert hardware.available_host_memory_bytes() == limit


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_is_bf16_unless_the_emulated_device_has_no_native_bf16(monkeypatch, native):
    from lazytrain.costmodel import hardware

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    assert hardware.resolve_dtype("auto", emulated=False) == "bf16"  # a GPU computes in bf16 either way
    assert hardware.resolve_dtype("auto", emulated=True) == ("bf16" if native else "fp32")
    for explicit in ("bf16", "fp32", "fp16"):
        assert hardware.resolve_dtype(explicit, emulated=True) == explicit
