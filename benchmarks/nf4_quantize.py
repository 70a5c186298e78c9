"""How fast QLoRA's base is quantized at load (runtime/nf4.py `quantize`): GB of bf16 weights per second, the
compiled kernel against the torch formulation it replaced (tests/test_nf4.py: the same bytes), and what the rate
means for a 70B base (80 layers like one of llama-3.1-70b's: q, o 8192 x 8192; k, v 1024 x 8192; gate, up
28672 x 8192; down 8192 x 28672).

    python benchmarks/nf4_quantize.py [--threads N] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from lazytrain.runtime import nf4

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_nf4 import torch_quantize  # noqa: E402 - the torch formulation the kernel replaced, kept by its test

LAYER_70B = [(8192, 8192), (1024, 8192), (1024, 8192), (8192, 8192), (28672, 8192), (28672, 8192), (8192, 28672)]
LAYERS_70B = 80


def rate_gbps(fn, weights: list[torch.Tensor], repeats: int) -> tuple[float, float]:
    """bf16 GB quantized per second of wall time and per CPU-second of this process (all its threads; on a shared
    machine the wall rate falls with the load, the CPU rate much less), medians of `repeats` passes."""
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        for w in weights:
            fn(w)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return nbytes / statistics.median(wall) / 1e9, nbytes / statistics.median(cpu) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    square = [torch.randn(8192, 8192, generator=gen).mul_(0.02).bfloat16()]
    nf4.quantize(square[0][:1])  # the kernel compiled (or loaded from numba's cache) first
    print(f"cpu {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, {args.threads} threads; "
          f"load {os.getloadavg()[0]:.1f}")
    (old, old_cpu), (new, new_cpu) = (rate_gbps(f, square, args.repeats) for f in (torch_quantize, nf4.quantize))
    assert torch.equal(torch_quantize(square[0]), nf4.quantize(square[0]))
    print(f"8192 x 8192 bf16: torch formulation {old:.3f} GB/s ({old_cpu:.3f} per CPU-second), compiled kernel "
          f"{new:.3f} GB/s ({new_cpu:.3f} per CPU-second): {new / old:.1f}x")
    del square
    layer = [torch.randn(o, i, generator=gen).mul_(0.02).bfloat16() for o, i in LAYER_70B]
    rate, cpu_rate = rate_gbps(nf4.quantize, layer, args.repeats)
    base_gb = LAYERS_70B * sum(o * i for o, i in LAYER_70B) * 2 / 1e9
    print(f"a llama-3.1-70b layer's linears: {rate:.3f} GB/s ({cpu_rate:.3f} per CPU-second); its 80 layers "
          f"({base_gb:.0f} GB of bf16) in {base_gb / rate / 60:.1f} min here, "
          f"{base_gb / cpu_rate / 60:.1f} CPU-minutes ({base_gb / cpu_rate / 60 / os.cpu_count():.1f} min on "
          f"{os.cpu_count()} idle cores)")
    print(f"load {os.getloadavg()[0]:.1f} at the end")

if __name__ == "__main__":
    main()
