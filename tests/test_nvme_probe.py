"""The NVMe probe (runtime/nvme_probe.py): the disk under nvme_dir timed as the state files use it, remembered per
disk and directory, and what `lazytrain train` plans with on CUDA."""

from __future__ import annotations

import dataclasses

import pytest

from lazytrain.config import load_job_config
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.runtime import nvme_probe
from lazytrain.train import planning


def test_the_probe_times_both_directions_alone_and_at_once_and_remembers_them(tmp_path, monkeypatch):
    moved = {"write": 0, "read": 0}
    real_submit = nvme_probe.StateFiles._submit

    def submit(self, group, buffer, write):
        moved["write" if write else "read"] += self.layouts[group].padded_data_bytes
        return real_submit(self, group, buffer, write)

    monkeypatch.setattr(nvme_probe.StateFiles, "_submit", submit)
    size = 8 << 20
    rates = nvme_probe.probe_nvme(tmp_path, seconds=0.3, probe_bytes=size)
    for field in ("read_gbps", "write_gbps", "mixed_read_gbps", "mixed_write_gbps"):
        assert getattr(rates, field) > 0, rates
    # each timed pass moves the whole file: at least two timed and one untimed pass per direction, plus the mixed
    assert moved["write"] >= 6 * size and moved["read"] >= 5 * size, moved
    assert rates.seconds >= 0.3 and list(tmp_path.iterdir()) == []  # nameless files: nothing left behind
    assert nvme_probe.cached_rates(tmp_path) == rates  # per directory (and device, request size and depth)
    (tmp_path / "other").mkdir()
    assert nvme_probe.cached_rates(tmp_path / "other") is None


@pytest.mark.parametrize("kind, probe, throttle", [("cuda", True, 0.5), ("cpu", True, float("inf")),
                                                   ("cpu", True, 0.5), ("cuda", False, 0.5)])
def test_on_cuda_the_plan_uses_the_measured_rates_of_both_directions_at_once(tmp_path, monkeypatch, capsys, kind,
                                                                            probe, throttle):
    measured = nvme_probe.NvmeRates(read_gbps=3.1, write_gbps=2.2, mixed_read_gbps=1.9, mixed_write_gbps=1.1,
                                    direct=True, seconds=3.0)
    calls = []
    monkeypatch.setattr(planning, "probe_nvme", lambda d, s: calls.append((d, s)) or measured)
    monkeypatch.setattr(planning, "cached_rates", lambda d: None)
    job = load_job_config({"optimizer_offload": "nvme", "nvme_dir": str(tmp_path), "nvme_probe": probe,
                           "nvme_probe_s": 2.5, "nvme_write_gbps": throttle})
    preset = HardwareSpec.load("rtx3090")
    got = planning.disk_rates(job, preset, kind)
    if not probe or (kind == "cpu" and throttle < float("inf")):  # a throttled emulated link: the throttle's rate
        assert got == preset and calls == []
        return
    assert calls == [(str(tmp_path), 2.5)]
    assert "read 3.10 GB/s, write 2.20 GB/s, both at once read 1.90 + write 1.10 GB/s" in capsys.readouterr().out
    if kind == "cpu":  # the emulated device's links are its throttle
        assert got == preset
    else:
        # each direction alone, and the slower one beside the other as the rate both keep at once
        assert got == dataclasses.replace(preset, nvme_read_gbps=3.1, nvme_write_gbps=2.2, nvme_mixed_gbps=1.1,
                                          nvme_state_read_gbps=None, nvme_state_write_gbps=None)
