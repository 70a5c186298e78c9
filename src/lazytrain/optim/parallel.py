"""Run the optimizer's compiled kernels on torch's own OpenMP threads.

Why not a Python thread pool or numba's `parallel=True`: after every parallel op torch's OpenMP
workers spin-wait for milliseconds (libgomp's default), and a second pool of threads then competes
with them for the same cores. On 2 cores that cost the 8-bit step a third of its speed right after
any torch op (docs/benchmarks.md). Handing the kernel to the same OpenMP runtime through its
`GOMP_parallel` entry point (libgomp's, which LLVM's and Intel's runtimes also export) makes the
spinning workers pick the kernel up instead: one pool for all host compute.

A kernel is a numba `cfunc` taking one `void*`: a numpy record whose first field is an int64 work
counter. Every thread of the team runs the kernel; each one takes work items with `fetch_add` on
that counter until none are left, so a thread that gets preempted delays only its current item.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import llvmlite.binding as llvm_binding
import numba
import numpy as np
import torch
from llvmlite import ir as llvm_ir
from numba import types
from numba.core.ccallback import CFunc
from numba.extending import intrinsic


# ---------------------------------------------------------------- kernel-side helpers
@intrinsic
def fetch_add(typingctx, counter, increment):  # pragma: no cover - compiled
    """Atomically add `increment` to the int64 at `counter` (a void*), return the value before."""
    sig = types.int64(types.voidptr, types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.bitcast(args[0], llvm_ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", ptr, args[1], "monotonic")

    return sig, codegen


@intrinsic
def address(typingctx, addr):  # pragma: no cover - compiled
    """An int64 address (a record field filled from `ndarray.ctypes.data`) as a void* for `numba.carray`."""
    sig = types.voidptr(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], llvm_ir.IntType(8).as_pointer())

    return sig, codegen


# ---------------------------------------------------------------- launching
def num_threads() -> int:
    """Threads for the optimizer kernels: torch's intra-op thread count (one knob for all host compute)."""
    return max(1, torch.get_num_threads())


def run_parallel(kernel: CFunc, args: np.ndarray, n_threads: int) -> None:
    """Run `kernel(args)` on `n_threads` threads at once (the calling thread is one of them), then return.

    `args` is a one-element record array whose first field is the int64 work counter `next_item`
    (0 on entry). The GIL is released while the kernel runs.
    """
    assert args.dtype.names[0] == "next_item" and args["next_item"][0] == 0, args.dtype
    data = args.ctypes.data
    if n_threads <= 1:
        kernel.ctypes(data)
        return
    gomp_parallel = _gomp_parallel()
    if gomp_parallel is not None:
        gomp_parallel(kernel.address, data, n_threads, 0)
        return
    # torch without an OpenMP runtime: a plain pool, the calling thread working alongside it
    helpers = [_pool(n_threads - 1).submit(kernel.ctypes, data) for _ in range(n_threads - 1)]
    kernel.ctypes(data)
    for h in helpers:
        h.result()


@cache
def _pool(n_workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="lazytrain-optim")


@cache
def _gomp_parallel() -> ctypes._CFuncPtr | None:
    """`GOMP_parallel(fn, data, num_threads, flags)` of the OpenMP runtime torch runs on, or None."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    for path in _openmp_runtime_paths():
        try:
            fn = ctypes.CDLL(path).GOMP_parallel
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        fn.restype = None
        return fn
    return None


def _openmp_runtime_paths() -> list[str]:
    """OpenMP runtimes loaded in this process (torch's first), else the ones shipped inside torch."""
    names = ("libgomp", "libomp", "libiomp5")
    torch_dir = os.path.dirname(torch.__file__)  # wheels keep it in torch/lib/ or torch.libs/ beside it
    try:
        with open("/proc/self/maps") as maps:
            loaded = {line.split()[-1] for line in maps if "/lib" in line and "omp" in line}
    except OSError:  # not Linux
        loaded = set()
    loaded = {p for p in loaded if os.path.basename(p).startswith(names)}
    shipped = glob.glob(os.path.join(torch_dir, "lib", "lib*omp*"))
    return sorted(loaded, key=lambda p: not p.startswith((torch_dir + "/", torch_dir + ".libs/"))) + sorted(shipped)


# ---------------------------------------------------------------- compiling
def target_cpu() -> tuple[str, str]:
    """(LLVM CPU name, feature string) numba compiles for: NUMBA_CPU_NAME / NUMBA_CPU_FEATURES where set (another
    CPU's code on this one, e.g. `NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=+avx2` for an AVX2-only CPU), else
    this host's. The kernels' code choices below follow it, so an emulated CPU gets the code it would get."""
    name = numba.config.CPU_NAME or llvm_binding.get_host_cpu_name()
    features = numba.config.CPU_FEATURES
    return name, llvm_binding.get_host_cpu_features().flatten() if features is None else features


# LLVM's cost model picks 256-bit vectors, interleave 4 for these loops on Zen 4/5; 512-bit vectors,
# interleave 2 take ~20% less CPU per element. The options are global to LLVM, so they are set only
# around the calls that compile (or load from numba's on-disk cache) the kernels, then reset.
_WIDE_VECTORS = "+avx512f" in target_cpu()[1]
_lock = threading.Lock()


@contextlib.contextmanager
def wide_vectors() -> Iterator[None]:
    """Compile the numba functions created inside with 512-bit vectors where the CPU has AVX-512."""
    if not _WIDE_VECTORS:
        yield
        return
    with _lock:  # LLVM options are process-wide: one compile at a time
        llvm_binding.set_option("", "-force-vector-width=16")
        llvm_binding.set_option("", "-force-vector-interleave=2")
        sys.stderr.flush()
        saved_fd = os.dup(2)
        with tempfile.TemporaryFile(mode="w+b") as err:
            os.dup2(err.fileno(), 2)  # forced width makes LLVM print "remark:" lines for numba's own loops
            try:
                yield
            finally:
                os.dup2(saved_fd, 2)
                os.close(saved_fd)
                llvm_binding.set_option("", "-force-vector-width=0")  # 0 = LLVM's default (cost model decides)
                llvm_binding.set_option("", "-force-vector-interleave=0")
                err.seek(0)
                text = err.read().decode(errors="replace").splitlines()
                other = [ln for ln in text if not ln.startswith("remark:")]
                if other:
                    print("\n".join(other), file=sys.stderr)
