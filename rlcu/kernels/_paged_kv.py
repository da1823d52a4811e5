"""The gather both paged attention kernels share: the keys and values of a tile of token positions,
each row found through the sequence's block table. Many loads are in flight at once, and a tile may span
cache blocks of any size (the block size need not suit tl.dot)."""
from rlcu.kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    @triton.jit
    def load_kv_tile(KC, VC, table_row, token, mask, stride_kb, stride_kt, head_offset, d, BLOCK_SIZE: tl.constexpr):
        block = tl.load(table_row + token // BLOCK_SIZE, mask=mask, other=0)
        offs = block[:, None] * stride_kb + (token % BLOCK_SIZE)[:, None] * stride_kt + head_offset + d[None, :]
        return tl.load(KC + offs, mask=mask[:, None], other=0.0), tl.load(VC + offs, mask=mask[:, None], other=0.0)
else:  # pragma: no cover - depends on the environment
    load_kv_tile = None
