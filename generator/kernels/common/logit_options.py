"""FlashInfer's logit options, applied to one tile's raw scores before the online softmax.

The attention kernels keep scores in raw q.k units and scale them in the exponent
(scale_log2 = sm_scale * log2 e), so every option is written in those units by the runtime
(python/sparseforge/logit_options.py) and applied here in the reference's order
(reference.attention):
    soft cap   s -> cap_out * tanh(s * cap_in)     cap_in = sm_scale / cap, cap_out = cap / sm_scale
    ALiBi      s -> s + slope_h / sm_scale * (key - query - diagonal)
    causal     key > query + diagonal        -> -inf   (bottom-right aligned: diagonal = Sk - Sq)
    mask       bit key % 64 of mMaskBits[kv head, key // 64, query] clear -> -inf
Each option costs its tile work only when its LOGIT_* flag is set (a uniform branch per
tile); causal skips tiles that lie wholly on or below the diagonal of the unit. The soft
cap is tanh.approx (relative error ~2^-11, below bf16's rounding of P).

Per element the options cost one or two instructions: an MMA accumulator gives each thread
the same pattern of columns shifted by a per-thread base (both mma.sync and wgmma), so the
column offsets are compile-time constants (`pattern`, thread 0's coordinates) and only the
base is a register. The mask's words of a tile are loaded by `load_mask_words` where the
kernel can hide their latency (under the tile's S = Q K^T).
"""

import cutlass
import cutlass.cute as cute

from generator.families.block_sparse_fwd import (
    LOGIT_ALIBI,
    LOGIT_CAUSAL,
    LOGIT_MASK,
    LOGIT_SOFT_CAP,
)
from generator.kernels.common.softmax import acc_mn_view


class UnitLogits:
    """The options as the unit of query `head` from row `query0` sees them, for the scores
    of `mma` (a tile_shape accumulator) held by thread `tidx`; `kind`: the variant's
    (LOGIT_KINDS: "scores" compiles the soft cap and ALiBi in)."""

    def __init__(self, args, kv_head, head, query0, mma, tidx, tile_shape, kind: str):
        scores = cute.make_identity_tensor(tile_shape)
        # (row in the unit, key in the tile) of this thread's scores and of thread 0's: the
        # same pattern at base 0.
        coord_mn = acc_mn_view(mma.get_slice(tidx).partition_C(scores))
        pattern_mn = acc_mn_view(mma.get_slice(0).partition_C(scores))
        self.flags = args.logit_flags
        self.diagonal = args.diagonal
        self.cap_in = args.cap_in
        self.cap_out = args.cap_out
        self.slope = args.mAlibi[head]
        self.mask_words = args.mMaskBits[kv_head, None, None]  # (tiles, rows)
        self.last_row = args.mMaskBits.shape[2] - 1
        self.query0 = query0
        self.coord_mn = coord_mn
        self.pattern_mn = pattern_mn
        self.scores = kind == "scores"  # the soft cap and ALiBi are compiled in


@cute.jit
def new_mask_words(logits: UnitLogits):
    """Registers for one tile's mask words: one 64-bit word per row of this thread."""
    return cute.make_rmem_tensor(cute.size(logits.coord_mn, mode=[0]), cutlass.Int64)


@cute.jit
def load_mask_words(logits: UnitLogits, words: cute.Tensor, tile):
    """The mask words of key tile `tile` for this thread's rows (when the mask is in use).
    Rows past the sequence (the last unit's padding) read the last row's."""
    if logits.flags & LOGIT_MASK != 0:
        for r in cutlass.range_constexpr(cute.size(words)):
            row = cutlass.min(logits.query0 + logits.coord_mn[r, 0][0], logits.last_row)
            words[r] = logits.mask_words[tile, row]


@cute.jit
def apply_logit_options(
    logits: UnitLogits,
    acc_s_mn: cute.Tensor,
    words: cute.Tensor,
    tile,
    tile_keys: cutlass.Constexpr,
):
    """Scores of key tile `tile` (keys tile * tile_keys ...) with the options applied; `words`
    from load_mask_words. A function rather than a method: a loop that calls a method of a
    Python object would carry the object."""
    coord, pattern = logits.coord_mn, logits.pattern_mn
    rows = cute.size(acc_s_mn, mode=[0])
    cols = cute.size(acc_s_mn, mode=[1])
    key0 = tile * tile_keys
    column0 = coord[0, 0][1]  # this thread's first key in the tile; the rest: + pattern
    if cutlass.const_expr(logits.scores):
        apply_score_options(logits, acc_s_mn, key0, column0)
    # Causal: nothing to mask where the tile's last key is visible to the unit's first row.
    if (logits.flags & LOGIT_CAUSAL != 0) & (
        key0 + tile_keys - 1 > logits.query0 + logits.diagonal
    ):
        for r in cutlass.range_constexpr(rows):
            limit = logits.query0 + coord[r, 0][0] + logits.diagonal - key0 - column0
            for c in cutlass.range_constexpr(cols):
                if pattern[0, c][1] > limit:
                    acc_s_mn[r, c] = -cutlass.Float32.inf
    if logits.flags & LOGIT_MASK != 0:
        # Rows whose 64 keys are all visible (most tiles of most masks) need nothing.
        partial = cutlass.Boolean(False)
        for r in cutlass.range_constexpr(rows):
            partial = partial | (words[r] != cutlass.Int64(-1))
        if partial:
            for r in cutlass.range_constexpr(rows):
                word = words[r] >> cutlass.Int64(column0)
                for c in cutlass.range_constexpr(cols):
                    if word & (cutlass.Int64(1) << cutlass.Int64(pattern[0, c][1])) == 0:
                        acc_s_mn[r, c] = -cutlass.Float32.inf


@cute.jit
def apply_score_options(logits: UnitLogits, acc_s_mn: cute.Tensor, key0, column0):
    """The soft cap, then ALiBi: the options that change every score (compiled into the
    "scores" variants only)."""
    coord, pattern = logits.coord_mn, logits.pattern_mn
    rows = cute.size(acc_s_mn, mode=[0])
    cols = cute.size(acc_s_mn, mode=[1])
    if logits.flags & LOGIT_SOFT_CAP != 0:
        capped = cute.math.tanh(acc_s_mn.load() * logits.cap_in, fastmath=True)
        acc_s_mn.store(capped * logits.cap_out)
    if logits.flags & LOGIT_ALIBI != 0:
        for r in cutlass.range_constexpr(rows):
            query = logits.query0 + coord[r, 0][0]
            base = logits.slope * cutlass.Float32(key0 + column0 - query - logits.diagonal)
            for c in cutlass.range_constexpr(cols):
                offset = cutlass.Float32(pattern[0, c][1])
                acc_s_mn[r, c] = acc_s_mn[r, c] + (base + logits.slope * offset)
