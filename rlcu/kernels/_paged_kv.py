"""What the paged attention kernels share: the gather of the keys and values of a tile of token positions,
each row found through the sequence's block table (many loads in flight at once; a tile may span cache
blocks of any size, so the block size need not suit tl.dot; an FP8 cache as pairs, `kv_operands`), the scores'
soft cap, and the decode kernels' online-softmax step over such a tile, and its split epilogue."""
import functools

import torch

from rlcu.kernels._triton import HAS_TRITON, tl, triton


def kv_operands(k_cache: torch.Tensor, v_cache: torch.Tensor, q_dtype: torch.dtype):
    """(K, V, E4M3_PAIRS): the caches as the decode kernels take them. An FP8 cache under a 16-bit query goes as
    int16 views, two e4m3 values an element, which `load_kv_tile` widens to fp16 in registers: read as FP8,
    Triton stages the tile in shared memory and widens it there a byte load at a time, for the values' transpose
    in P @ V (on the H200 172.9 against 166.8 us at 512 sequences, 28.8 against 27.4 at 64: docs/benchmarks.md).
    Strides are then in int16 elements. E4M3_PAIRS is 2 on a GPU that converts e4m3 itself (sm_89 and later: one
    PTX conversion a pair, `widen_e4m3_pairs`), 1 under the CPU interpreter, which runs no PTX, and on older GPUs,
    0 otherwise: an fp32 query keeps the FP8 read and its fp32 dot."""
    if k_cache.element_size() == 1 and q_dtype != torch.float32:
        return k_cache.view(torch.int16), v_cache.view(torch.int16), 2 if converts_e4m3(k_cache.device) else 1
    return k_cache, v_cache, 0


def converts_e4m3(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(device.index) >= (8, 9)


@functools.cache  # asked at every decode launch, once a layer in eager decode
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


if HAS_TRITON:
    @triton.jit
    def widen_e4m3_pairs(x, PTX: tl.constexpr):
        """int16 [N, M], two e4m3 values each (the lower byte first) -> fp16 [N, 2M], exactly. PTX: one
        cvt.rn.f16x2.e4m3x2 a pair, already packed as the dot's operands are (`converts_e4m3`); split into bytes
        as Triton does it otherwise, each is converted alone and re-packed with byte permutes: compiled for sm_90 by
        Triton 3.6, the decode kernel has 1,957 instructions against 2,517 (the bf16 one 1,491, for as many bytes)."""
        if PTX:
            lo, hi = tl.inline_asm_elementwise("{ .reg .b32 r; cvt.rn.f16x2.e4m3x2 r, $2; mov.b32 {$0, $1}, r; }",
                                               "=h,=h,h", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        else:
            lo = (x & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
            hi = ((x >> 8) & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        return tl.reshape(tl.join(lo, hi), [x.shape[0], 2 * x.shape[1]])

    @triton.jit
    def load_kv_tile(KC, VC, table_row, token, mask, stride_kb, stride_kt, head_offset, d, BLOCK_SIZE: tl.constexpr,
                     E4M3_PAIRS: tl.constexpr):
        block = tl.load(table_row + token // BLOCK_SIZE, mask=mask, other=0)
        row = block[:, None] * stride_kb + (token % BLOCK_SIZE)[:, None] * stride_kt + head_offset
        if E4M3_PAIRS:  # kv_operands
            offs = row + tl.arange(0, d.shape[0] // 2)[None, :]
            k = widen_e4m3_pairs(tl.load(KC + offs, mask=mask[:, None], other=0), E4M3_PAIRS == 2)
            v = widen_e4m3_pairs(tl.load(VC + offs, mask=mask[:, None], other=0), E4M3_PAIRS == 2)
        else:
            offs = row + d[None, :]
            k = tl.load(KC + offs, mask=mask[:, None], other=0.0)
            v = tl.load(VC + offs, mask=mask[:, None], other=0.0)
        return k, v

    @triton.jit
    def soft_cap(x, CAP: tl.constexpr):
        """CAP * tanh(x / CAP) in fp32 (Gemma 2's scores, `rlcu/kernels/sdpa.py`). The interpreter has no libdevice
        tanh: (1 - e) / (1 + e) with e = exp(-2|u|), and near 0, where 1 - e would cancel, tanh's series (its
        first left-out term is below 2e-10 there)."""
        u = x / CAP
        a = tl.abs(u)
        e = tl.exp(-2.0 * a)
        t = (1.0 - e) / (1.0 + e)
        u2 = u * u
        series = u * (1.0 - u2 * (0.3333333333333333 - u2 * (0.13333333333333333 - u2 * 0.05396825396825397)))
        return CAP * tl.where(a < 0.125, series, tl.where(u < 0, -t, t))

    @triton.jit
    def attend_kv_tile(q, acc, m, l, KC, VC, table_row, token, tmask, rows, scale, stride_kb, stride_kt, head_offset, d,
                       BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, E4M3_PAIRS: tl.constexpr,
                       SOFTCAP: tl.constexpr):
        """One online-softmax step of query rows `q` over a tile of tokens (`tmask`: those that exist); rows
        outside `rows` see none of it, and a row that has seen nothing yet keeps m = -inf without NaN.
        With E4M3_PAIRS (kv_operands) both dots take fp16, which holds every e4m3 value; q is scaled first so
        that fp16's range (65,504) holds it too. SOFTCAP > 0: the scores soft-capped at it (`soft_cap`)."""
        k, v = load_kv_tile(KC, VC, table_row, token, tmask, stride_kb, stride_kt, head_offset, d, BLOCK_SIZE,
                            E4M3_PAIRS)
        if E4M3_PAIRS:
            scores = tl.dot((q * scale).to(tl.float16), tl.trans(k))
        else:
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        if SOFTCAP > 0:
            scores = soft_cap(scores, SOFTCAP)
        scores = tl.where(rows[:, None] & tmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - shift[:, None])
        alpha = tl.exp(m - shift)
        if E4M3_PAIRS:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        return acc, m_new, l * alpha + tl.sum(p, 1)

    @triton.jit
    def finish_split(acc, m, l):
        """A split's normalised output and log-sum-exp; a split that saw no token (past the end of a short
        sequence, or of the shared tiles) gives 0 and -inf, so the combine weighs it 0."""
        empty = l == 0.0
        out = acc / tl.where(empty, 1.0, l)[:, None]
        return out, tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l)))
else:  # pragma: no cover - depends on the environment
    widen_e4m3_pairs = load_kv_tile = soft_cap = attend_kv_tile = finish_split = None
