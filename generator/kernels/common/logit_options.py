"""FlashInfer's logit options, applied to one tile's raw scores before the online softmax.

The attention kernels keep scores in raw q.k units and scale them in the exponent
(scale_log2 = sm_scale * log2 e), so every option is written in those units by the runtime
(python/sparseforge/families/block_sparse_fwd.py) and applied here in the reference's order
(reference.attention):
    soft cap   s -> cap_out * tanh(s * cap_in)     cap_in = sm_scale / cap, cap_out = cap / sm_scale
    ALiBi      s -> s + slope_h / sm_scale * (key - query - diagonal)
    causal     key > query + diagonal        -> -inf   (bottom-right aligned: diagonal = Sk - Sq)
    mask       bit key % 32 of mMaskBits[kv head, query, key // 32] clear -> -inf
Each option costs its tile work only when its LOGIT_* flag is set (a uniform branch per
tile); causal skips tiles that lie wholly on or below the diagonal of the unit.
The soft cap is tanh.approx (relative error ~2^-11, below bf16's rounding of P).
"""

import cutlass
import cutlass.cute as cute

from generator.families.block_sparse_fwd import (
    LOGIT_ALIBI,
    LOGIT_CAUSAL,
    LOGIT_MASK,
    LOGIT_SOFT_CAP,
)


class UnitLogits:
    """The options as the unit of query `head` from row `query0` sees them."""

    def __init__(self, args, kv_head, head, query0):
        self.flags = args.logit_flags
        self.diagonal = args.diagonal
        self.cap_in = args.cap_in
        self.cap_out = args.cap_out
        self.slope = args.mAlibi[head]
        self.mask_rows = args.mMaskBits[kv_head, None, None]
        self.num_rows = args.mMaskBits.shape[1]
        self.query0 = query0


@cute.jit
def apply_logit_options(
    logits: UnitLogits,
    acc_s_mn: cute.Tensor,
    coord_mn: cute.Tensor,
    tile,
    tile_keys: cutlass.Constexpr,
):
    """Scores of key tile `tile` (keys tile * tile_keys ...) with the options applied;
    coord_mn: (row in the unit, key in the tile) of each score. A function rather than a
    method: a loop that calls a method of a Python object would carry the object."""
    key0 = tile * tile_keys
    rows = cute.size(acc_s_mn, mode=[0])
    cols = cute.size(acc_s_mn, mode=[1])
    if logits.flags & LOGIT_SOFT_CAP != 0:
        capped = cute.math.tanh(acc_s_mn.load() * logits.cap_in, fastmath=True)
        acc_s_mn.store(capped * logits.cap_out)
    if logits.flags & LOGIT_ALIBI != 0:
        for r in cutlass.range_constexpr(rows):
            query = logits.query0 + coord_mn[r, 0][0]
            base = logits.slope * cutlass.Float32(key0 - query - logits.diagonal)
            for c in cutlass.range_constexpr(cols):
                column = cutlass.Float32(coord_mn[0, c][1])
                acc_s_mn[r, c] = acc_s_mn[r, c] + (base + logits.slope * column)
    # Causal: nothing to mask where the tile's last key is visible to the unit's first row.
    if (logits.flags & LOGIT_CAUSAL != 0) & (
        key0 + tile_keys - 1 > logits.query0 + logits.diagonal
    ):
        for r in cutlass.range_constexpr(rows):
            limit = logits.query0 + coord_mn[r, 0][0] + logits.diagonal - key0
            for c in cutlass.range_constexpr(cols):
                if coord_mn[0, c][1] > limit:
                    acc_s_mn[r, c] = -cutlass.Float32.inf
    if logits.flags & LOGIT_MASK != 0:
        words_per_tile = tile_keys // 32
        for r in cutlass.range_constexpr(rows):
            # Rows past the sequence (the last unit's padding) read the last row's bits.
            query = cutlass.min(logits.query0 + coord_mn[r, 0][0], logits.num_rows - 1)
            words = cute.make_rmem_tensor(words_per_tile, cutlass.Int32)
            for w in cutlass.range_constexpr(words_per_tile):
                words[w] = logits.mask_rows[query, tile * words_per_tile + w]
            for c in cutlass.range_constexpr(cols):
                key = coord_mn[0, c][1]
                word = words[0]
                for w in cutlass.range_constexpr(1, words_per_tile):
                    if key >= 32 * w:
                        word = words[w]
                if (word >> (key % 32)) & 1 == 0:
                    acc_s_mn[r, c] = -cutlass.Float32.inf
