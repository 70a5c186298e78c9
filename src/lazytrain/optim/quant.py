"""Block-wise dynamic 8-bit quantization of AdamW states, and the fused CPU update kernel.

Maps (LazyTrain, arXiv 2608.11919: dynamic quantization, one absmax per block; value = map[code] * absmax):

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
entry in the companded (sqrt / fourth-root) domain, ties to even; the torch reference does the same arithmetic,
and the tests check kernel == reference.

Safety rule for v (why: m != 0 with a dequantized v == 0 gives a step of lr * m / eps, ~1e4 x lr or more):
a nonzero v never rounds to code 0 (it rounds up to the smallest nonzero entry), a block whose
absmax(v) < V_TINY_ABSMAX is stored as all-zero v, and wherever the stored v decodes to 0 the
stored m is set to 0. V_TINY_ABSMAX keeps every nonzero decoded v a normal float32.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from llvmlite import ir as llvm_ir
from numba import carray, cfunc, njit, types
from numba.core.ccallback import CFunc
from numba.extending import intrinsic, overload

from lazytrain.optim import precompile
from lazytrain.optim.parallel import address, fetch_add, num_threads, run_parallel, target_cpu, wide_vectors

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
        k = torch.round(torch.sqrt(xb.abs() * inv[:, None])).to(torch.int32).clamp(max=M_LEVELS)
        codes = torch.where(torch.signbit(xb), 127 - k, 128 + k)  # -0 too, as the kernel
    else:
        absmax = torch.where(absmax < V_TINY_ABSMAX, torch.zeros_like(absmax), absmax)
        amax_s = torch.sqrt(absmax)
        inv = torch.where(amax_s > 0, _f32(V_LEVELS**2) / amax_s, torch.zeros_like(amax_s))
        k = torch.round(torch.sqrt(torch.sqrt(xb) * inv[:, None])).to(torch.int32).clamp(max=V_LEVELS)
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
_ITEMS_PER_THREAD = 8  # work items per thread: small enough to even out a preempted thread

# Constants typed float32/int32: numba widens Python numbers (and int32 arithmetic) to 64 bits,
# which doubles the vector instructions in the loops.
_F0 = np.float32(0.0)
_HALF = np.float32(0.5)
_M_MID = np.float32(127.5)  # signed code c holds k = |c - 127.5| - 0.5, negative below the middle
_M_SQ = np.float32(M_LEVELS**2)
_INV_M_SQ = np.float32(1.0 / M_LEVELS**2)
_V_SQ = np.float32(V_LEVELS**2)
_INV_V_4 = np.float32(1.0 / V_LEVELS**4)
_V_TINY32 = np.float32(V_TINY_ABSMAX)
_I0 = np.int32(0)
_I1 = np.int32(1)
_I128 = np.int32(128)
_I255 = np.int32(255)
_I16 = np.int32(16)
_I31 = np.int32(31)
_IV = np.int32(V_LEVELS)
_HASH_MUL = np.int64(0x9E3779B1)  # bf16.py's counter multiplier


@intrinsic
def _bits(typingctx, x):  # pragma: no cover - compiled
    """The bits of float32 x as int32. For x >= 0 the order of the bits is the order of the floats, so an
    integer max reduction over them vectorizes without the no-NaN fastmath flag."""
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


#: Blocks up to this size keep their scratch on the stack (see _stack_scratch); larger ones on the heap.
STACK_SCRATCH_ELEMS = 4096


@intrinsic
def _stack_scratch(typingctx):  # pragma: no cover - compiled
    """A STACK_SCRATCH_ELEMS-float32 buffer on the kernel's stack frame (one per call site).

    Why: a pointer to the stack frame provably aliases none of the tensors' (which come from integers), so
    the vectorized loops lose most of their per-block runtime overlap checks.
    """
    sig = types.voidptr()

    def codegen(context, builder, signature, args):
        with builder.goto_entry_block():
            buf = builder.alloca(llvm_ir.ArrayType(llvm_ir.FloatType(), STACK_SCRATCH_ELEMS))
        return builder.bitcast(buf, llvm_ir.IntType(8).as_pointer())

    return sig, codegen


# Intel's AVX-512 cores run 512-bit roots and divisions on one slow unit (~10-12 cycles per 16 elements
# each), which bounds the kernel there (Emerald Rapids: docs/benchmarks.md). On Intel two of the four are
# estimated on the vector ports instead: the m code's root as x * rsqrt(x) and the update's division as
# a multiply by rsqrt(d)^2 (LLVM: vrsqrt14ps + one Newton step, ~1e-7 relative). The other two roots
# (sqrt(v) and the v code's) stay exact on the divider, which then runs beside the ports. AMD's Zen 4 was
# measured slower with estimated roots, so Zen keeps exact roots and the division; so does AVX2 code (256-bit
# roots cost the divider half as much, and the estimate is a longer sequence without AVX-512's rsqrt14: 8% slower
# with it on Intel, haswell code, docs/benchmarks.md).
ESTIMATE_ROOTS = "+avx512f" in target_cpu()[1] and not target_cpu()[0].startswith("znver")
_TINY = np.float32(1e-30)  # keeps rsqrt(0) finite: y * rsqrt(y) is ~1e-15 at y = 0


def _fast_rsqrt(builder: llvm_ir.IRBuilder, x: llvm_ir.Value) -> llvm_ir.Value:
    """1 / sqrt(x) with fast flags on these two instructions only: LLVM emits the estimate + Newton step."""
    f32 = llvm_ir.FloatType()
    sqrt = builder.module.declare_intrinsic("llvm.sqrt", [f32])
    inv = builder.fdiv(llvm_ir.Constant(f32, 1.0), builder.call(sqrt, [x], fastmath=("fast",)))
    inv.flags.append("fast")
    return inv


@intrinsic
def _m_code_root(typingctx, y):  # pragma: no cover - compiled
    """sqrt(y) for _TINY <= y <= ~127^2 (the m code), estimated where ESTIMATE_ROOTS says so (see above)."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        if not ESTIMATE_ROOTS:
            return builder.call(builder.module.declare_intrinsic("llvm.sqrt", [llvm_ir.FloatType()]), [args[0]])
        return builder.fmul(args[0], _fast_rsqrt(builder, args[0]))

    return sig, codegen


@intrinsic
def _divide(typingctx, num, den):  # pragma: no cover - compiled
    """num / den for den > 0: num * rsqrt(den)^2 where ESTIMATE_ROOTS says so (see above), else exact."""
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, signature, args):
        if not ESTIMATE_ROOTS:
            return builder.fdiv(args[0], args[1])
        inv = _fast_rsqrt(builder, args[1])
        return builder.fmul(args[0], builder.fmul(inv, inv))

    return sig, codegen


# Rounding to an integer code by one float add: for 0 <= x < 2^22, the float x + 2^23 is the integer
# nearest to x (ties to even) plus 2^23, held in the low mantissa bits; the code is the low byte of the
# sum's bits. With 2^23 + 128 the m code's offset comes free. Saves the convert (one port on Intel).
_ROUND_V = np.float32(2.0**23)
_ROUND_M = np.float32(2.0**23 + M_ZERO_CODE)
_ROUND_V1 = np.int32(0x4B000001)  # bits of 2^23 + 1: the smallest nonzero v code


# ---------------------------------------------------------------- element access of each layout
# The step reads and writes each tensor in the dtype it is kept in, so one pass moves each byte once: fp32 or bf16
# weights (bf16 given as their uint16 bits, written back with stochastic rounding), fp32 or bf16 gradients, and
# optionally a bf16 copy of fp32 weights (the streamed one). Which code a call site gets follows the arrays' types.
_I32 = llvm_ir.IntType(32)
_I16T = llvm_ir.IntType(16)


def _i32(value: int) -> llvm_ir.Constant:
    return llvm_ir.Constant(_I32, value - (1 << 32) if value >= 1 << 31 else value)


@intrinsic
def _widen_bf16(typingctx, bits):  # pragma: no cover - compiled
    """The fp32 value of bf16 bits (exact: the bits shifted up)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.shl(builder.zext(args[0], _I32), _i32(16)), llvm_ir.FloatType())

    return sig, codegen


@intrinsic
def _nearest_bf16(typingctx, x):  # pragma: no cover - compiled
    """x rounded to the nearest bf16, ties to even, NaN to 0x7FC0: torch's fp32 -> bf16 cast (c10's
    round_to_nearest_even), so a copy or a rounded gradient equals `.to(torch.bfloat16)`."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        u = builder.bitcast(args[0], _I32)
        lsb = builder.and_(builder.lshr(u, _i32(16)), _i32(1))
        r = builder.lshr(builder.add(builder.add(u, _i32(0x7FFF)), lsb), _i32(16))
        r = builder.select(builder.fcmp_unordered("uno", args[0], args[0]), _i32(0x7FC0), r)
        return builder.trunc(r, _I16T)

    return sig, codegen


@intrinsic
def _stochastic_bf16(typingctx, x, counter):  # pragma: no cover - compiled
    """x rounded to bf16 stochastically: bf16.py's `_round_bits` for element i under `key`, given its hash input
    counter = i * 0x9E3779B1 + key, in 32-bit lanes (the hash is arithmetic modulo 2^32 there too, so the bits are
    the same). Why the counter: the loop steps it by one add (a vector induction), where i * 0x9E3779B1 would be a
    vector multiply per element (two uops on Intel)."""
    sig = types.uint16(types.float32, types.int64)

    def codegen(context, builder, signature, args):
        h = builder.trunc(args[1], _I32)
        h = builder.xor(h, builder.lshr(h, _i32(16)))
        h = builder.mul(h, _i32(0x7FEB352D))
        h = builder.xor(h, builder.lshr(h, _i32(15)))
        h = builder.mul(h, _i32(0x846CA68B))
        h = builder.xor(h, builder.lshr(h, _i32(16)))
        u = builder.add(builder.bitcast(args[0], _I32), builder.and_(h, _i32(0xFFFF)))
        return builder.trunc(builder.lshr(u, _i32(16)), _I16T)

    return sig, codegen


def _is_bf16(arr: types.Type) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == types.uint16


def load_fp32(p, j):  # pragma: no cover - typed by the overload below
    """fp32 value of element j of an fp32 array, or of a bf16 one given as its uint16 bits (runtime/nf4.py too)."""


@overload(load_fp32, inline="always")
def _load_fp32_impl(p, j):
    if _is_bf16(p):
        return lambda p, j: _widen_bf16(p[j])
    return lambda p, j: p[j]


def _load_grad(g, p, j):  # pragma: no cover - typed by the overload below
    """fp32 gradient j as the optimizer takes it: the gradient in the weights' dtype (what autograd's `.grad` would
    hold: a bf16 weight's fp32 sum rounds to bf16 first), then fp32."""


@overload(_load_grad, inline="always")
def _load_grad_impl(g, p, j):
    if _is_bf16(g):
        return lambda g, p, j: _widen_bf16(g[j])
    if _is_bf16(p):
        return lambda g, p, j: _widen_bf16(_nearest_bf16(g[j]))
    return lambda g, p, j: g[j]


def _store_param(p, j, value, counter):  # pragma: no cover - typed by the overload below
    """Weight j := value (bf16 weights: stochastically rounded with the hash input `counter`: `_stochastic_bf16`)."""


@overload(_store_param, inline="always")
def _store_param_impl(p, j, value, counter):
    if _is_bf16(p):
        def store(p, j, value, counter):
            p[j] = _stochastic_bf16(value, counter)
        return store

    def store(p, j, value, counter):
        p[j] = value
    return store


def _store_copy(c, j, value):  # pragma: no cover - typed by the overload below
    """Copy j := value rounded to the nearest bf16; an int8 array stands for no copy (nothing written)."""


@overload(_store_copy, inline="always")
def _store_copy_impl(c, j, value):
    if _is_bf16(c):
        def store(c, j, value):
            c[j] = _nearest_bf16(value)
        return store
    return lambda c, j, value: None


@njit(cache=True, fastmath=_FASTMATH, error_model="numpy", inline="always")
def _update_blocks(
    b_first, b_last, p, g, copy, key, qm, qv, absmax_m, absmax_v, fm, fs, block_size, beta1, beta2, clip_m, clip_v,
    eps, decay, step_size, inv_bc2_sqrt,
):  # pragma: no cover - compiled
    """Blocks [b_first, b_last) of the fused step: decode, update, requantize; weights, gradients and the copy in
    their own dtypes (the element access above), bf16 weights rounded with `key`.

    fm, fs: scratch of block_size floats (new m and sqrt(new v) of one block, between update and encode).
    clip_m = (1 - beta1) * clip and clip_v = sqrt(1 - beta2) * clip take the clip coefficient and the
    moments' gradient weights into one multiply each (clip before squaring: no fp32 overflow).
    """
    n = p.size
    for b in range(b_first, b_last):
        start = b * block_size
        end = min(n, start + block_size)
        cnt = end - start
        # slices: indexing with the nonnegative loop variable lets LLVM vectorize
        pb, gb, qmb, qvb = p[start:end], g[start:end], qm[start:end], qv[start:end]
        cb = copy[start:end]  # empty where no copy is written
        counter = start * _HASH_MUL + key  # the rounding hash's input of element start + j, stepped with j
        scale_m = absmax_m[b] * (_INV_M_SQ * beta1)  # decodes beta1 * m
        scale_v = absmax_v[b] * (_INV_V_4 * beta2)  # decodes beta2 * v
        # -- decode, AdamW update with the fp32 moments, the clip coefficient fused in
        amax_m_bits = _I0
        amax_s_bits = _I0
        for j in range(cnt):
            t = np.float32(qmb[j]) - _M_MID
            k = abs(t) - _HALF
            b1_m_old = np.copysign(k * k * scale_m, t)
            cv = np.float32(qvb[j])
            c2 = cv * cv
            b2_v_old = c2 * c2 * scale_v
            gj = _load_grad(gb, pb, j)
            mj = b1_m_old + clip_m * gj
            hj = clip_v * gj
            vj = b2_v_old + hj * hj
            sj = np.sqrt(vj)  # >= +0: its bits order like its values
            pj = load_fp32(pb, j) * decay - _divide(step_size * mj, sj * inv_bc2_sqrt + eps)
            _store_param(pb, j, pj, counter)
            counter += _HASH_MUL
            _store_copy(cb, j, pj)
            fm[j] = mj
            fs[j] = sj
            amax_m_bits = max(amax_m_bits, _bits(abs(mj)))
            amax_s_bits = max(amax_s_bits, _bits(sj))
        amax_m = _i2f(amax_m_bits)
        amax_s = _i2f(amax_s_bits)
        amax_v = amax_s * amax_s
        absmax_m[b] = amax_m
        if amax_v < _V_TINY32:  # the whole block stores v = 0, hence m = 0
            absmax_v[b] = _F0
            for j in range(cnt):
                qmb[j] = np.uint8(M_ZERO_CODE)
                qvb[j] = np.uint8(0)
            continue
        absmax_v[b] = amax_v
        inv_m = _M_SQ / amax_m if amax_m > _F0 else _F0
        inv_s = _V_SQ / amax_s  # amax_s == sqrt(amax_v) exactly: fp32 sqrt of a rounded square
        # -- encode: companded (sqrt / fourth root) rounding, see module docstring
        for j in range(cnt):
            sj = fs[j]
            mj = fm[j] if sj > _F0 else _F0  # v decodes to 0 -> m := 0
            ym = abs(mj) * inv_m + _TINY
            codem = _bits(_m_code_root(ym) + _ROUND_M)  # low byte 128 + km; km <= 127 since |mj| <= amax_m
            codem ^= _bits(mj) >> _I31  # 127 - km where the sign bit is set (all bits flipped)
            codev = _bits(np.sqrt(sj * inv_s) + _ROUND_V)  # low byte kv <= 255 since sj <= amax_s
            codev = max(codev, _ROUND_V1) if sj > _F0 else _I0  # nonzero v never rounds to 0
            qmb[j] = np.uint8(codem & _I255)
            qvb[j] = np.uint8(codev & _I255)


#: The layout bits of a step: bf16 weights (stochastic rounding), a bf16 gradient, a bf16 copy written.
P_BF16, G_BF16, COPY_BF16 = 1, 2, 4

#: The 8-bit step's arguments, one record shared by all threads (addresses from ndarray.ctypes.data).
_STEP_ARGS = np.dtype(
    [
        ("next_item", np.int64),  # work counter: first block of the next item (run_parallel)
        ("p", np.int64), ("g", np.int64), ("copy", np.int64), ("qm", np.int64), ("qv", np.int64),
        ("absmax_m", np.int64), ("absmax_v", np.int64),
        ("numel", np.int64), ("block_size", np.int64), ("blocks_per_item", np.int64), ("layout", np.int64),
        ("key", np.int64),
        ("beta1", np.float32), ("beta2", np.float32), ("clip_m", np.float32), ("clip_v", np.float32),
        ("eps", np.float32),
        ("decay", np.float32), ("step_size", np.float32), ("inv_bc2_sqrt", np.float32),
    ],
    align=True,
)  # fmt: skip


@njit(cache=True, fastmath=_FASTMATH, error_model="numpy", inline="always")
def _work(data, p, g, copy, qm, qv, absmax_m, absmax_v, fm, fs):  # pragma: no cover - compiled
    """Take work items (blocks_per_item blocks each) until none are left; one copy of the loops per layout."""
    a = carray(data, 1, _STEP_ARGS)[0]
    nblocks = absmax_m.size
    while True:
        first = fetch_add(data, a.blocks_per_item)
        if first >= nblocks:
            return
        _update_blocks(
            first, min(nblocks, first + a.blocks_per_item), p, g, copy, a.key, qm, qv, absmax_m, absmax_v, fm, fs,
            a.block_size, a.beta1, a.beta2, a.clip_m, a.clip_v, a.eps, a.decay, a.step_size, a.inv_bc2_sqrt,
        )


@njit(cache=True, fastmath=_FASTMATH, error_model="numpy", inline="always")
def _work_layout(data, qm, qv, absmax_m, absmax_v, fm, fs):  # pragma: no cover - compiled
    """`_work` with the weights, gradient and copy typed as the record's layout says."""
    a = carray(data, 1, _STEP_ARGS)[0]
    n = a.numel
    no_copy = np.empty(0, np.int8)
    if a.layout & P_BF16:  # bf16 weights: no copy (they are what streams)
        p16 = carray(address(a.p), n, np.uint16)
        if a.layout & G_BF16:
            _work(data, p16, carray(address(a.g), n, np.uint16), no_copy, qm, qv, absmax_m, absmax_v, fm, fs)
        else:
            _work(data, p16, carray(address(a.g), n, np.float32), no_copy, qm, qv, absmax_m, absmax_v, fm, fs)
        return
    p32 = carray(address(a.p), n, np.float32)
    if a.layout & COPY_BF16:
        copy = carray(address(a.copy), n, np.uint16)
        if a.layout & G_BF16:
            _work(data, p32, carray(address(a.g), n, np.uint16), copy, qm, qv, absmax_m, absmax_v, fm, fs)
        else:
            _work(data, p32, carray(address(a.g), n, np.float32), copy, qm, qv, absmax_m, absmax_v, fm, fs)
    elif a.layout & G_BF16:
        _work(data, p32, carray(address(a.g), n, np.uint16), no_copy, qm, qv, absmax_m, absmax_v, fm, fs)
    else:
        _work(data, p32, carray(address(a.g), n, np.float32), no_copy, qm, qv, absmax_m, absmax_v, fm, fs)


def _adamw8bit_kernel(data):  # pragma: no cover - compiled (cfunc, see _kernels)
    a = carray(data, 1, _STEP_ARGS)[0]
    n, bs = a.numel, a.block_size
    nblocks = (n + bs - 1) // bs
    qm = carray(address(a.qm), n, np.uint8)
    qv = carray(address(a.qv), n, np.uint8)
    absmax_m = carray(address(a.absmax_m), nblocks, np.float32)
    absmax_v = carray(address(a.absmax_v), nblocks, np.float32)
    # scratch for one block: on the stack when it fits (the two call sites below compile to two copies
    # of the loops, the stack one without most overlap checks), else on the heap
    if bs <= STACK_SCRATCH_ELEMS:
        fm = carray(_stack_scratch(), min(bs, STACK_SCRATCH_ELEMS), np.float32)
        fs = carray(_stack_scratch(), min(bs, STACK_SCRATCH_ELEMS), np.float32)
        _work_layout(data, qm, qv, absmax_m, absmax_v, fm, fs)
    else:
        _work_layout(data, qm, qv, absmax_m, absmax_v, np.empty(bs, np.float32), np.empty(bs, np.float32))


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
    rounding_key: int = 0,
    copy: torch.Tensor | None = None,
) -> None:
    """One fused AdamW step on a contiguous tensor with 8-bit states, in place, in one pass over memory.

    p: fp32 weights, or bf16 ones rounded back stochastically with `rounding_key` (bf16.py: each element draws
    the bits of its index in p). g: the gradient, fp32 or bf16 (other dtypes are cast first); for bf16 weights an
    fp32 gradient rounds to bf16 first (as autograd's `.grad` of a bf16 tensor would). copy: a bf16 tensor that
    receives the new fp32 weights rounded to nearest (the streamed copy, as `copy.copy_(p)` would write it).
    Runs on torch.get_num_threads() threads (torch's OpenMP team, see parallel.py) for tensors >=
    PARALLEL_MIN_NUMEL. `step` is the 1-based step count after increment (bias correction as
    torch.optim.AdamW).
    """
    g = g.detach().reshape(-1)
    if g.dtype not in (torch.float32, torch.bfloat16):
        g = g.to(torch.float32)
    g = g.contiguous()  # no copy when contiguous
    n = p.numel()
    nblocks = absmax_m.numel()
    # the kernel reads and writes through raw addresses: check what it will assume
    tensors = [(p, p.dtype, n), (g, g.dtype, n), (qm, torch.uint8, n), (qv, torch.uint8, n),
               (absmax_m, torch.float32, -(-n // block_size)), (absmax_v, torch.float32, -(-n // block_size))]
    if copy is not None:
        tensors.append((copy, torch.bfloat16, n))
    if not (all(t.device.type == "cpu" and t.is_contiguous() and t.dtype == dtype and t.numel() == numel
                for t, dtype, numel in tensors)
            and p.dtype in (torch.float32, torch.bfloat16) and not (copy is not None and p.dtype == torch.bfloat16)):
        raise ValueError(f"adamw8bit_step_: inconsistent host tensors for {n} params in blocks of {block_size}")
    layout = (P_BF16 * (p.dtype == torch.bfloat16) + G_BF16 * (g.dtype == torch.bfloat16)
              + COPY_BF16 * (copy is not None))
    n_threads = 1 if n < PARALLEL_MIN_NUMEL else num_threads()
    bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
    args = np.array(
        [(
            0,
            p.data_ptr(), g.data_ptr(), 0 if copy is None else copy.data_ptr(), qm.data_ptr(), qv.data_ptr(),
            absmax_m.data_ptr(), absmax_v.data_ptr(),
            n, block_size, -(-nblocks // (_ITEMS_PER_THREAD * n_threads)), layout, rounding_key & 0xFFFFFFFF,
            beta1, beta2,
            # in float64: float32(1) - float32(0.999) is off by 1e-5 relative
            (1.0 - beta1) * clip_coef, (1.0 - beta2) ** 0.5 * clip_coef,
            eps, 1.0 - lr * weight_decay, lr / bc1, 1.0 / bc2**0.5,
        )],
        dtype=_STEP_ARGS,
    )  # fmt: skip
    run_parallel(_kernels()[0], args, n_threads)


# ---------------------------------------------------------------- sum of squares (clip norm)
@njit(cache=True, fastmath=_FASTMATH, error_model="numpy", inline="always")
def _sq_sum(x, start, end):  # pragma: no cover - compiled
    """Sum of x[start:end]**2 accumulated in float64: exact to ~1e-12 relative for fp32 input, cannot
    overflow for finite fp32 input, and inf/nan propagate (no nnan/ninf flags)."""
    xs = x[start:end]  # indexing with the nonnegative loop variable lets LLVM vectorize
    acc = 0.0
    for j in range(xs.size):
        v = np.float64(xs[j])
        acc += v * v
    return acc


@njit(cache=True, fastmath=_FASTMATH, error_model="numpy", inline="always")
def _sq_sum_bf16(x, start, end):  # pragma: no cover - compiled
    """`_sq_sum` of bf16 values given as their uint16 bits: each read as its exact fp32 value (the bits shifted
    up), so the sums equal those of an fp32 cast, without the cast."""
    xs = x[start:end]
    acc = 0.0
    for j in range(xs.size):
        v = np.float64(_i2f(np.int32(xs[j]) << _I16))
        acc += v * v
    return acc


#: Arguments of the sum-of-squares kernel: chunks (address, start, end, bf16) of fp32 arrays (bf16: 0) or of
#: uint16 arrays of bf16 bits (bf16: 1), one sum each.
_NORM_ARGS = np.dtype(
    [("next_item", np.int64), ("chunks", np.int64), ("n_chunks", np.int64), ("sums", np.int64)], align=True
)


def _sq_sum_kernel(data):  # pragma: no cover - compiled (cfunc, see _kernels)
    a = carray(data, 1, _NORM_ARGS)[0]
    chunks = carray(address(a.chunks), (a.n_chunks, 4), np.int64)
    sums = carray(address(a.sums), a.n_chunks, np.float64)
    while True:
        i = fetch_add(data, 1)
        if i >= a.n_chunks:
            return
        if chunks[i, 3]:
            sums[i] = _sq_sum_bf16(carray(address(chunks[i, 0]), chunks[i, 2], np.uint16), chunks[i, 1], chunks[i, 2])
        else:
            sums[i] = _sq_sum(carray(address(chunks[i, 0]), chunks[i, 2], np.float32), chunks[i, 1], chunks[i, 2])


def sq_sums_f64(arrays: list[np.ndarray]) -> np.ndarray:
    """Sum of squares of each flat fp32 array (float64, shape (len(arrays),)), on torch's OpenMP threads; a uint16
    array holds bf16 bits and is summed as its fp32 values (exactly what its fp32 cast would give).

    Why not torch._foreach_norm: float64 accumulation (no fp32 overflow, no ~1e-4 rounding on long
    sums), and one pass with the same launch as the 8-bit step. Arrays >= PARALLEL_MIN_NUMEL are
    split into chunks spread over the threads.
    """
    if not all(a.dtype in (np.float32, np.uint16) and a.ndim == 1 and a.flags.c_contiguous for a in arrays):
        raise ValueError("sq_sums_f64 reads flat contiguous float32 (or bf16 as uint16) arrays only")  # raw addresses
    total = sum(a.size for a in arrays)
    n_threads = 1 if total < PARALLEL_MIN_NUMEL else num_threads()
    chunk = max(PARALLEL_MIN_NUMEL, -(-total // (_ITEMS_PER_THREAD * n_threads)))
    rows = [
        (i, a.ctypes.data, start, min(a.size, start + chunk), int(a.dtype == np.uint16))
        for i, a in enumerate(arrays)
        for start in range(0, a.size, chunk)
    ]
    owner = np.array([r[0] for r in rows], dtype=np.int64)
    chunks = np.array([r[1:] for r in rows], dtype=np.int64).reshape(-1, 4)
    sums = np.zeros(len(rows), dtype=np.float64)
    if rows:
        args = np.array([(0, chunks.ctypes.data, len(rows), sums.ctypes.data)], dtype=_NORM_ARGS)
        run_parallel(_kernels()[1], args, n_threads)
    return np.bincount(owner, weights=sums, minlength=len(arrays))


# ---------------------------------------------------------------- compile once
_VOID_PTR_SIG = types.void(types.voidptr)


@cache
def _kernels() -> tuple[CFunc, CFunc]:
    """(8-bit step, sum of squares) as C callbacks; compiled once, later loaded from numba's disk cache."""
    precompile.wait()
    with wide_vectors():
        options = dict(cache=True, fastmath=_FASTMATH, error_model="numpy")
        return cfunc(_VOID_PTR_SIG, **options)(_adamw8bit_kernel), cfunc(_VOID_PTR_SIG, **options)(_sq_sum_kernel)


def compile_kernels() -> None:
    """Into numba's disk cache (optim/precompile.py's child)."""
    _kernels()
