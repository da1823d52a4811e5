"""What the paged attention kernels share: the gather of the keys and values of a tile of token positions,
each row found through the sequence's block table (many loads in flight at once; a tile may span cache
blocks of any size, so the block size need not suit tl.dot), and the decode kernels' online-softmax step
over such a tile, and its split epilogue."""
from rlcu.kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    @triton.jit
    def load_kv_tile(KC, VC, table_row, token, mask, stride_kb, stride_kt, head_offset, d, BLOCK_SIZE: tl.constexpr):
        block = tl.load(table_row + token // BLOCK_SIZE, mask=mask, other=0)
        offs = block[:, None] * stride_kb + (token % BLOCK_SIZE)[:, None] * stride_kt + head_offset + d[None, :]
        return tl.load(KC + offs, mask=mask[:, None], other=0.0), tl.load(VC + offs, mask=mask[:, None], other=0.0)

    @triton.jit
    def attend_kv_tile(q, acc, m, l, KC, VC, table_row, token, tmask, rows, scale, stride_kb, stride_kt, head_offset, d,
                       BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
        """One online-softmax step of query rows `q` over a tile of tokens (`tmask`: those that exist); rows
        outside `rows` see none of it, and a row that has seen nothing yet keeps m = -inf without NaN."""
        k, v = load_kv_tile(KC, VC, table_row, token, tmask, stride_kb, stride_kt, head_offset, d, BLOCK_SIZE)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        scores = tl.where(rows[:, None] & tmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - shift[:, None])
        alpha = tl.exp(m - shift)
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
    load_kv_tile = attend_kv_tile = finish_split = None
