"""benchmarks/gpu.py imports everywhere and, without CUDA, refuses in one line with exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the benchmark itself")
def test_gpu_benchmark_refuses_cleanly_without_cuda(tmp_path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1 and "CUDA" in proc.stderr
    assert not out.exists()
