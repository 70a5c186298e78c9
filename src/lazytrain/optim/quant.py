"""Block-wise dynamic 8-bit quantization of AdamW states, and the fused CPU update kernel.

Maps (paper section 3: dynamic quantization, one absmax per block; value = map[code] * absmax):

- first moment m, signed map: map = sign * (k / 127)^2 for k = 0..127, stored in offset order so the
  256-entry table is sorted: code 128 + k is +(k/127)^2, code 127 - k is -(k/127)^2 (codes 127 and
  128 are -0 and +0; codes 0 and 255 are -1 and +1). Range 6e-5..1 of the block's absmax.
- second moment v, unsigned map: map = (c / 255)^4 for c = 0..255. Range 2e-10..1 of the absmax:
  v spans the square of the gradient's range.

Why power maps rather than bitsandbytes' decimal tree: the entries are dense where AdamW states
sit inside a block (within ~1-2 decades of the absmax; worst-case rounding error 1.4% for m at 0.3
of the absmax, 0.9% for v at 0.7), v reaches further down than the tree (2e-10 vs 3e-7), m less far
(m below 1.6e-5 of its block's absmax rounds to 0; the tree keeps ~1 entry per decade down to 1e-6),
and the codes are computed, not searched:
code = round(127 * sqrt(|m| / absmax)) and round(255 * (v / absmax)^(1/4)), decode is a product.
The kernel loops therefore vectorize (no table search, no gathers). Rounding is to the nearest
entry in the companded (sqrt / fourth-root) domain; the torch reference does the same arithmetic,
and the tests check kernel == reference.

Safety rule for v (why: m != 0 with a dequantized v == 0 gives a step of lr * m / eps, ~1e4 x lr or more):
a nonzero v never rounds to code 0 (it rounds up to the smallest nonzero entry), a block whose
absmax(v) < V_TINY_ABSMAX is stored as all-zero v, and wherever the stored v decodes to 0 the
stored m is set to 0. V_TINY_ABSMAX keeps every nonzero decoded v a normal float32.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import llvmlite.binding as llvm_binding
import numpy as np
import torch
from llvmlite import ir as llvm_ir
from numba import njit, types
from numba.extending import intrinsic

# ---------------------------------------------------------------- maps
M_LEVELS = 127  # magnitude steps of the signed map
V_LEVELS = 255
M_ZERO_CODE = 128
# blocks whose v absmax is below this are stored as v == 0 and m == 0 (decoded v stays normal float32)
V_TINY_ABSMAX = 1e-28

#: The two 256-entry maps (float32, sorted).
_MAG = (np.arange(M_LEVELS + 1, dtype=np.float64) / M_LEVELS) ** 2
SIGNED_MAP = np.concatenate([-_MAG[::-1], _MAG]).astype(np.float32)
UNSIGNED_MAP = ((np.arange(V_LEVELS + 1, dtype=np.float64) / V_LEVELS) ** 4).astype(np.float32)


def check_map(qmap: np.ndarray, signed: bool) -> None:
    """Assert the map invariants the kernel relies on (sorted, 256 entries, holds 0 and the ends)."""
    assert qmap.shape == (256,), qmap.shape
    assert np.all(np.diff(qmap) >= 0), "map must be sorted"
    # the only tie allowed is the signed map's -0/+0 pair
    assert int(np.sum(np.diff(qmap) == 0)) == (1 if signed else 0), "map entries must be distinct"
    assert 0.0 in qmap and qmap[-1] == 1.0, (qmap[0], qmap[-1])
    assert qmap[0] == (-1.0 if signed else 0.0), qmap[0]


check_map(SIGNED_MAP, signed=True)
check_map(UNSIGNED_MAP, signed=False)

_F32 = torch.float32


# ---------------------------------------------------------------- torch reference (tests)
def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat x zero-padded to whole blocks, shape (nblocks, block_size)."""
    n = x.numel()
    nblocks = (n + block_size - 1) // block_size
    return torch.nn.functional.pad(x.reshape(-1).float(), (0, nblocks * block_size - n)).view(nblocks, block_size)


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=_F32)


def quantize_blockwise(x: torch.Tensor, signed: bool, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantizer: flat fp32 x -> (uint8 codes, fp32 absmax per block).

    Unsigned (v): every x > 0 gets a nonzero code; blocks with absmax < V_TINY_ABSMAX store 0.
    """
    n = x.numel()
    xb = _blocks(x, block_size)
    absmax = xb.abs().amax(dim=1)
    if signed:
        inv = torch.where(absmax > 0, _f32(M_LEVELS**2) / absmax, torch.zeros_like(absmax))
        k = (torch.sqrt(xb.abs() * inv[:, None]) + 0.5).to(torch.int32).clamp(max=M_LEVELS)
        codes = torch.where(xb < 0, 127 - k, 128 + k)
    else:
        absmax = torch.where(absmax < V_TINY_ABSMAX, torch.zeros_like(absmax), absmax)
        amax_s = torch.sqrt(absmax)
        inv = torch.where(amax_s > 0, _f32(V_LEVELS**2) / amax_s, torch.zeros_like(amax_s))
        k = (torch.sqrt(torch.sqrt(xb) * inv[:, None]) + 0.5).to(torch.int32).clamp(max=V_LEVELS)
        codes = torch.where((xb > 0) & (inv[:, None] > 0), k.clamp(min=1), torch.zeros_like(k))
    return codes.reshape(-1)[:n].to(torch.uint8), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool, block_size: int) -> torch.Tensor:
    """Reference dequantizer: fp32, flat; the same float operations as the kernel's decode."""
    n = codes.numel()
    c = codes.reshape(-1).to(torch.int32)
    if signed:
        scale = (absmax * _f32(1.0 / M_LEVELS**2)).repeat_interleave(block_size)[:n]
        k = torch.where(c < 128, 127 - c, c - 128).float()
        val = k * k * scale
        return torch.where(c < 128, -val, val)
    scale = (absmax * _f32(1.0 / V_LEVELS**4)).repeat_interleave(block_size)[:n]
    cf = c.float()
    c2 = cf * cf
    return c2 * c2 * scale


def adamw8bit_reference_(
    p: torch.Tensor,
    g: torch.Tensor,
    qm: torch.Tensor,
    qv: torch.Tensor,
    absmax_m: torch.Tensor,
    absmax_v: torch.Tensor,
    *,
    block_size: int,
    clip_coef: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """Plain-torch twin of `adamw8bit_step_` (same math, same rounding rules), in place."""
    pf, gf = p.detach().view(-1), g.reshape(-1).float() * clip_coef
    m = dequantize_blockwise(qm, absmax_m, True, block_size)
    v = dequantize_blockwise(qv, absmax_v, False, block_size)
    m = beta1 * m + (1 - beta1) * gf
    v = beta2 * v + (1 - beta2) * gf * gf
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    pf.mul_(1 - lr * weight_decay)
    pf.sub_((lr / bc1) * m / (v.sqrt() / bc2**0.5 + eps))
    cm, am = quantize_blockwise(m, True, block_size)
    cv, av = quantize_blockwise(v, False, block_size)
    cm = torch.where(cv == 0, torch.full_like(cm, M_ZERO_CODE), cm)  # v decodes to 0 -> m := 0
    qm.copy_(cm)
    qv.copy_(cv)
    absmax_m.copy_(am)
    absmax_v.copy_(av)


# ---------------------------------------------------------------- compiled kernel
# No nnan/ninf: non-finite gradients are filtered before the kernel, but the flags would let LLVM
# delete the guards that keep v > 0 away from code 0. error_model="numpy": no ZeroDivisionError
# branch (it blocks vectorization); every division here has a nonzero divisor.
_FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}
PARALLEL_MIN_NUMEL = 1 << 16  # smaller tensors run on the calling thread only

_F0 = np.float32(0.0)
_HALF = np.float32(0.5)
_M_SQ = np.float32(M_LEVELS**2)
_INV_M_SQ = np.float32(1.0 / M_LEVELS**2)
_V_SQ = np.float32(V_LEVELS**2)
_INV_V_4 = np.float32(1.0 / V_LEVELS**4)
_V_TINY32 = np.float32(V_TINY_ABSMAX)
_I0 = np.int32(0)
_I1 = np.int32(1)
_I127 = np.int32(127)
_I128 = np.int32(128)
_IM = np.int32(M_LEVELS)
_IV = np.int32(V_LEVELS)
_ABS = np.int32(2**31 - 1)


@intrinsic
def _f2i(typingctx, x):  # pragma: no cover - compiled
    """Reinterpret float32 bits as int32: max over the bits of floats >= 0 is their max, and an
    integer max reduction vectorizes without the no-NaN fastmath flag."""
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvm_ir.IntType(32))

    return sig, codegen


@intrinsic
def _i2f(typingctx, x):  # pragma: no cover - compiled
    """Reinterpret int32 bits as float32."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvm_ir.FloatType())

    return sig, codegen


@njit(cache=True, fastmath=_FASTMATH, error_model="numpy", inline="always")
def _update_blocks(
    b_first, b_last, p, g, qm, qv, absmax_m, absmax_v, block_size, clip, beta1, beta2, one_m_b1, one_m_b2, eps,
    decay, step_size, inv_bc2_sqrt,
):  # pragma: no cover - compiled
    """Blocks [b_first, b_last) of the fused step: decode, update, requantize."""
    n = p.size
    fm = np.empty(block_size, np.float32)  # new m of one block, between update and encode
    fs = np.empty(block_size, np.float32)  # sqrt(new v)
    for b in range(b_first, b_last):
        start = b * block_size
        end = min(n, start + block_size)
        cnt = end - start
        # slices: indexing with the nonnegative loop variable lets LLVM vectorize
        pb, gb, qmb, qvb = p[start:end], g[start:end], qm[start:end], qv[start:end]
        scale_m = absmax_m[b] * _INV_M_SQ
        scale_v = absmax_v[b] * _INV_V_4
        # -- decode, AdamW update with the fp32 moments, clip coefficient fused into g
        amax_m_bits = _I0
        amax_s_bits = _I0
        for j in range(cnt):
            cm = np.int32(qmb[j])
            neg = cm < _I128
            k = np.float32((_I127 - cm) if neg else (cm - _I128))
            mag = k * k * scale_m
            m_old = -mag if neg else mag
            cv = np.float32(qvb[j])
            c2 = cv * cv
            v_old = c2 * c2 * scale_v
            gj = gb[j] * clip
            mj = beta1 * m_old + one_m_b1 * gj
            vj = beta2 * v_old + one_m_b2 * (gj * gj)
            sj = np.sqrt(vj)
            pb[j] = pb[j] * decay - step_size * mj / (sj * inv_bc2_sqrt + eps)
            fm[j] = mj
            fs[j] = sj
            amax_m_bits = max(amax_m_bits, _f2i(mj) & _ABS)
            amax_s_bits = max(amax_s_bits, _f2i(sj))
        amax_m = _i2f(amax_m_bits)
        amax_s = _i2f(amax_s_bits)
        amax_v = amax_s * amax_s
        if amax_v < _V_TINY32:
            amax_v = _F0
        absmax_m[b] = amax_m
        absmax_v[b] = amax_v
        inv_m = _M_SQ / amax_m if amax_m > _F0 else _F0
        inv_s = _V_SQ / np.sqrt(amax_v) if amax_v > _F0 else _F0
        # -- encode: companded (sqrt / fourth root) rounding, see module docstring
        for j in range(cnt):
            mj = fm[j]
            sj = fs[j]
            km = min(np.int32(np.sqrt(abs(mj) * inv_m) + _HALF), _IM)
            kv = min(np.int32(np.sqrt(sj * inv_s) + _HALF), _IV)
            kv = max(kv, _I1) if (sj > _F0 and inv_s > _F0) else _I0  # nonzero v never rounds to 0
            codem = (_I127 - km) if mj < _F0 else (_I128 + km)
            qmb[j] = np.uint8(codem if kv != _I0 else _I128)  # v decodes to 0 -> m := 0
            qvb[j] = np.uint8(kv)


@njit(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy")
def _adamw8bit_blocks(
    b_first, b_last, p, g, qm, qv, absmax_m, absmax_v, block_size, clip, beta1, beta2, one_m_b1, one_m_b2, eps,
    decay, step_size, inv_bc2_sqrt,
):  # pragma: no cover - compiled
    """Blocks [b_first, b_last) on the calling thread; nogil, so pool threads run it side by side."""
    _update_blocks(
        b_first, b_last, p, g, qm, qv, absmax_m, absmax_v, block_size, clip, beta1, beta2, one_m_b1, one_m_b2,
        eps, decay, step_size, inv_bc2_sqrt,
    )


def adamw8bit_step_(
    p: torch.Tensor,
    g: torch.Tensor,
    qm: torch.Tensor,
    qv: torch.Tensor,
    absmax_m: torch.Tensor,
    absmax_v: torch.Tensor,
    *,
    block_size: int,
    clip_coef: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """One fused AdamW step on a contiguous fp32 tensor with 8-bit states, in place.

    Runs on torch.get_num_threads() threads (both cores by default) for tensors >= PARALLEL_MIN_NUMEL.
    `step` is the 1-based step count after increment (bias correction as torch.optim.AdamW).
    """
    bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
    f32 = np.float32
    args = (
        p.detach().view(-1).numpy(),
        g.detach().reshape(-1).to(torch.float32).contiguous().numpy(),  # no copy when fp32 and contiguous
        qm.view(-1).numpy(),
        qv.view(-1).numpy(),
        absmax_m.numpy(),
        absmax_v.numpy(),
        int(block_size),
        f32(clip_coef),
        f32(beta1),
        f32(beta2),
        f32(1.0 - beta1),  # from float64: float32(1) - float32(0.999) is off by 1e-5 relative
        f32(1.0 - beta2),
        f32(eps),
        f32(1.0 - lr * weight_decay),
        f32(lr / bc1),
        f32(1.0 / bc2**0.5),
    )
    nblocks = absmax_m.numel()
    n_threads = _num_threads()
    if p.numel() < PARALLEL_MIN_NUMEL or n_threads == 1:
        _first_call_wide(_adamw8bit_blocks, (0, nblocks, *args))
        return
    # Work items of whole blocks, handed out dynamically: a thread preempted by another process
    # delays only its current item. Own pool (not numba's parallel=True): numba's OpenMP pool and
    # torch's bundled libgomp both spin-wait and steal the two cores from each other between calls.
    # _ITEMS_PER_THREAD items per thread: few enough that handing them out (GIL, futures) stays cheap.
    _first_call_wide(_adamw8bit_blocks, (0, 1, *args))  # compile or load from cache, once
    step_blocks = max(1, -(-(nblocks - 1) // (_ITEMS_PER_THREAD * n_threads)))
    items = [(b, min(nblocks, b + step_blocks)) for b in range(1, nblocks, step_blocks)]
    list(_pool(n_threads).map(lambda item: _adamw8bit_blocks(item[0], item[1], *args), items))


_ITEMS_PER_THREAD = 4
_pools: dict[int, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def _num_threads() -> int:
    """Threads for the 8-bit update: torch's intra-op thread count (one knob for all host compute)."""
    return max(1, torch.get_num_threads())


def _pool(n_threads: int) -> ThreadPoolExecutor:
    with _lock:
        if n_threads not in _pools:
            _pools[n_threads] = ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="lazytrain-adamw8bit")
        return _pools[n_threads]


# LLVM's cost model picks 256-bit vectors, interleave 4 for these loops on Zen 4/5; 512-bit vectors,
# interleave 2 take ~20% less CPU per element. The options are global to LLVM, so they are set only
# around the call that compiles (or loads from the on-disk cache) each kernel, then reset to default.
_WIDE_VECTORS = "+avx512f" in llvm_binding.get_host_cpu_features().flatten()
_loaded: set[object] = set()


def _first_call_wide(kernel: object, args: tuple) -> None:
    if kernel in _loaded or not _WIDE_VECTORS:
        kernel(*args)
        return
    with _lock:  # LLVM options are process-wide: one compiling call at a time
        if kernel in _loaded:
            kernel(*args)
            return
        _call_with_wide_vectors(kernel, args)
        _loaded.add(kernel)


def _call_with_wide_vectors(kernel: object, args: tuple) -> None:
    llvm_binding.set_option("", "-force-vector-width=16")
    llvm_binding.set_option("", "-force-vector-interleave=2")
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as err:
        os.dup2(err.fileno(), 2)  # forced width makes LLVM print "remark:" lines for numba's own loops
        try:
            kernel(*args)
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            llvm_binding.set_option("", "-force-vector-width=0")  # 0 = LLVM's default (cost model decides)
            llvm_binding.set_option("", "-force-vector-interleave=0")
            err.seek(0)
            other = [ln for ln in err.read().decode(errors="replace").splitlines() if not ln.startswith("remark:")]
            if other:
                print("\n".join(other), file=sys.stderr)


# ---------------------------------------------------------------- sum of squares (clip norm)
@njit(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy")
def _sq_sum(x, start, end):  # pragma: no cover - compiled
    """Sum of x[start:end]**2 accumulated in float64: exact to ~1e-12 relative for fp32 input, cannot
    overflow for finite fp32 input, and inf/nan propagate (no nnan/ninf flags)."""
    xs = x[start:end]  # indexing with the nonnegative loop variable lets LLVM vectorize
    acc = 0.0
    for j in range(xs.size):
        v = np.float64(xs[j])
        acc += v * v
    return acc


def sq_sums_f64(arrays: list[np.ndarray]) -> np.ndarray:
    """Sum of squares of each flat fp32 array (float64, shape (len(arrays),)) on the 8-bit kernel's pool.

    Why not torch._foreach_norm: it is a torch OpenMP region, after which torch's libgomp workers
    spin-wait and steal cores from the 8-bit kernel's pool for milliseconds (docs/benchmarks.md).
    Tensors >= PARALLEL_MIN_NUMEL are split into chunks spread over the pool; small ones are packed
    together so that one work item covers about the same number of elements.
    """
    out = np.zeros(len(arrays), dtype=np.float64)
    if not arrays:
        return out
    _first_call_wide(_sq_sum, (arrays[0], 0, 0))  # compile or load from cache, once
    total = sum(a.size for a in arrays)
    n_threads = _num_threads()
    if total < PARALLEL_MIN_NUMEL or n_threads == 1:
        for i, a in enumerate(arrays):
            out[i] = _sq_sum(a, 0, a.size)
        return out
    chunk = max(PARALLEL_MIN_NUMEL, -(-total // (_ITEMS_PER_THREAD * n_threads)))
    items: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    cur_n = 0
    for i, a in enumerate(arrays):
        for start in range(0, a.size, chunk):
            end = min(a.size, start + chunk)
            cur.append((i, start, end))
            cur_n += end - start
            if cur_n >= chunk:
                items.append(cur)
                cur, cur_n = [], 0
    if cur:
        items.append(cur)

    def run(item: list[tuple[int, int, int]]) -> list[tuple[int, float]]:
        return [(i, _sq_sum(arrays[i], s, e)) for i, s, e in item]

    for part in _pool(n_threads).map(run, items):
        for i, val in part:
            out[i] += val
    return out
