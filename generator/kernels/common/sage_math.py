"""Pieces shared by the Sage FP8 attention templates (sage_fp8_fwd family).

Scores: S = (q8 . k8) * q_scale[row] * k_scale[key // 16] * sm_scale, kept in the log2
domain (times log2 e) as in common/softmax.py. Each 64-key tile's probabilities are
quantized to e4m3 with a per-row scale, multiplied by V in a fresh fp32 accumulator, and
that partial product is added to O in fp32 ("two-level accumulation"): no long chain of
e4m3 MMAs accumulates in the tensor core, and every tile uses e4m3's full range.

Per row and tile, with m the running max and t the tile's max (log2 units):
    m_new = t if t > m_old + 8 else m_old   (softmax.RESCALE_THRESHOLD)
    P8    = exp2(x - t + 8)            in (0, 256]: the tile's row max is 256
    beta  = exp2(t - m_new - 8)        <= 1, turns P8 back into exp2(x - m_new)
    alpha = exp2(m_old - m_new)        the online-softmax correction, 1 for most tiles
    O     = O * alpha + (P8 V8) * beta,   l = l * alpha + sum(P8) * beta

Register layouts: the fp32 accumulator of S (wgmma m64nNk32 and mma.sync m16n8k32 alike)
gives each thread, per 8-key chunk, keys 2i, 2i+1 (i = lane % 4); the e4m3 A operand wants
keys 4i..4i+3 of each 16. `scores_to_e4m3_operand` moves the bytes with two shuffles and a
byte permute per 32-bit word, so V needs no reordering (portable/sage_fp8_fwd.py). The sm90
template instead
loads each 16 keys of K permuted (`permuted_key`), so that a thread's scores already are the
keys its A operand wants: `scores_to_e4m3_operand_in_place`, no data between lanes.
"""

import cutlass
import cutlass.cute as cute

from generator.kernels.common.softmax import (
    RESCALE_THRESHOLD,
    is_huge,
    mask_columns,
    new_softmax_state,
    row_allreduce,
)

P_EXP2_OFFSET = 8.0  # P8 row max = 2^8 = 256 <= 448, e4m3's largest finite value
NEG_INF = -cutlass.Float32.inf
# The exponent bases' floor: the lowest finite fp32, so that a row whose scores are all hugely
# negative (but finite) keeps its true max as the base, while rows with no valid key yet
# (max -inf) get a finite base and P = exp2(-inf) = 0, never exp2(-inf - -inf) = NaN.
FINITE_FLOOR = -3.4028234663852886e38


def new_sage_state(rows: int, key_groups: int):
    """The Sage softmax's registers: (row max, row sum, alpha, beta, row scales) of `rows`
    rows, and the scales of a tile's `key_groups` key groups."""
    row_max, row_sum = new_softmax_state(rows)
    alpha = cute.make_rmem_tensor(rows, cutlass.Float32)
    beta = cute.make_rmem_tensor(rows, cutlass.Float32)
    row_scale = cute.make_rmem_tensor(rows, cutlass.Float32)
    key_scale = cute.make_rmem_tensor(key_groups, cutlass.Float32)
    return row_max, row_sum, alpha, beta, row_scale, key_scale


@cute.jit
def load_row_scales(mQScale, head, first_row, coord_mn, scale_log2, out):
    """out[r] = q_scale of this thread's row r * sm_scale * log2(e); rows past Sq read 0."""
    for r in cutlass.range_constexpr(cute.size(out)):
        row = first_row + coord_mn[r, 0][0]
        out[r] = cutlass.Float32(0.0)
        if row < mQScale.shape[0]:
            out[r] = mQScale[row, head] * scale_log2


@cute.jit
def load_channel_scales(mVScale, kv_head, coord_mn, out):
    """out[c] = v_scale of this thread's output column c (the softmax_finalize column_scale:
    V was quantized per channel)."""
    for c in cutlass.range_constexpr(cute.size(out)):
        out[c] = mVScale[coord_mn[0, c][1], kv_head]


@cute.jit
def load_key_scales(head_scales, tile, out):
    """out[g] = k_scale of the g-th 16-key group of 64-key tile `tile`, from a kv head's
    k_scale row (mKScale[None, kv_head]): one 16-byte load (the ABI lays k_scale out per
    tile, padded past the sequence end)."""
    cute.autovec_copy(cute.local_tile(head_scales, (cute.size(out),), (tile,)), out)


@cute.jit
def sage_softmax_step(
    acc_s_mn,
    row_scale,
    key_scale,
    coord_mn,
    tile_len,
    row_max,
    row_sum,
    alpha,
    beta,
    key_of_column=None,
    lanes: cutlass.Constexpr = 4,
):
    """Scale and mask one tile's scores, update (row_max, row_sum), leave P8 (as fp32, in
    (0, 256]) in acc_s_mn and each row's alpha and beta (see the module docstring). `lanes`:
    threads that share a row (softmax.row_allreduce).

    Column j of a thread's row lies in the 16-key group j // (columns / groups): j // 4 for
    fragments of four threads a row (8-key chunks, 2 keys each), j // 16 for a thread a row.
    The scale c of a score is row_scale * key_scale of its group; with c >= 0 the row max
    of c * s is the max over groups of c times the group's max of s, so each score costs
    one max and one fused multiply-add (exp2(s * c - base)) instead of a multiply, a max
    and an add. Short tiles (masked keys) and negative sm_scale scale the scores in place
    first and use c = 1: rare. key_of_column: see mask_columns (a permutation within each
    16 keys leaves every column in its 16-key scale group).
    """
    rows = cute.size(row_max)
    groups = cute.size(key_scale)
    per_group = cute.size(acc_s_mn, mode=[1]) // groups
    scale = cute.make_rmem_tensor(
        cute.make_layout((rows, groups), stride=(groups, 1)), cutlass.Float32
    )
    for r in cutlass.range_constexpr(rows):
        for g in cutlass.range_constexpr(groups):
            scale[r, g] = row_scale[r] * key_scale[g]
    if (
        tile_len < cute.size(coord_mn, mode=[1]) * lanes
        or row_scale[0] < 0.0
        or row_scale[rows - 1] < 0.0
    ):
        for r in cutlass.range_constexpr(rows):
            for j in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
                acc_s_mn[r, j] = acc_s_mn[r, j] * scale[r, j // per_group]
            for g in cutlass.range_constexpr(groups):
                scale[r, g] = cutlass.Float32(1.0)
        mask_columns(acc_s_mn, coord_mn, tile_len, key_of_column)
    # Every row's tile max first, then one branch per tile for the rare huge rows: a branch
    # per row between the max and the exponents kept the rows' shuffles and exponents from
    # interleaving (about 3% of F1).
    tile_max = cute.make_rmem_tensor((rows,), cutlass.Float32)
    offset = cute.make_rmem_tensor((rows,), cutlass.Float32)
    any_huge = False
    for r in cutlass.range_constexpr(rows):
        scaled_max = NEG_INF
        for g in cutlass.range_constexpr(groups):
            group_max = acc_s_mn[r, g * per_group]
            for i in cutlass.range_constexpr(1, per_group):
                group_max = cute.arch.fmax(group_max, acc_s_mn[r, g * per_group + i])
            scaled_max = cute.arch.fmax(scaled_max, group_max * scale[r, g])
        tile_max[r] = row_allreduce(scaled_max, cute.arch.fmax, lanes)
        # A row with no valid key so far keeps -inf; finite exponent bases keep NaN out
        # (exp2 of -inf minus a finite base is 0). One FMNMX each, not a compare and select.
        offset[r] = P_EXP2_OFFSET - cute.arch.fmax(tile_max[r], FINITE_FLOOR)
        any_huge = any_huge | is_huge(tile_max[r])
    if any_huge:
        for r in cutlass.range_constexpr(rows):
            if is_huge(tile_max[r]):
                exponents_of_a_huge_row(acc_s_mn, r, scale, per_group, tile_max[r])
                offset[r] = cutlass.Float32(0.0)
    for r in cutlass.range_constexpr(rows):
        new_max = row_max[r]
        if tile_max[r] - row_max[r] > RESCALE_THRESHOLD:  # (row_max + 8 is row_max when huge)
            new_max = tile_max[r]
        new_base = cute.arch.fmax(new_max, FINITE_FLOOR)
        for j in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
            acc_s_mn[r, j] = cute.math.exp2(
                acc_s_mn[r, j] * scale[r, j // per_group] + offset[r], fastmath=True
            )
        alpha[r] = cute.math.exp2(row_max[r] - new_base, fastmath=True)
        beta[r] = cute.math.exp2(tile_max[r] - new_base - P_EXP2_OFFSET, fastmath=True)
        row_sum[r] = (
            row_sum[r] * alpha[r]
            + acc_s_mn[r, None].load().reduce(cute.ReductionOp.ADD, cutlass.Float32.zero, 0)
            * beta[r]
        )
        row_max[r] = new_max


@cute.jit
def exponents_of_a_huge_row(acc_s_mn, r, scale, per_group, tile_max):
    """Row r of a tile whose max is huge (softmax.HUGE_BASE): each score becomes its exponent
    x - t + 8 and its scale 1. The fused exp2(s * c + (8 - t)) would carry fl(s * c)'s
    rounding error (and lose the 8), so the max is subtracted per 16-key group in raw units,
    (s - gmax) * c + (fl(gmax * c) - t + 8): 8 exactly at the tile's max, since t is the
    largest fl(gmax * c) of the row. The fmax with the lowest finite value is the identity
    on a finite product; it keeps the compiler from fusing fl(gmax * c) - t into an FMA
    (which would give the product's rounding error where we want 0)."""
    groups = cute.size(scale, mode=[1])
    for g in cutlass.range_constexpr(groups):
        group_max = FINITE_FLOOR  # finite, so that a masked (-inf) score minus it is -inf
        for i in cutlass.range_constexpr(per_group):
            group_max = cute.arch.fmax(group_max, acc_s_mn[r, g * per_group + i])
        scaled_group_max = cute.arch.fmax(group_max * scale[r, g], FINITE_FLOOR)
        group_offset = (scaled_group_max - tile_max) + P_EXP2_OFFSET
        for i in cutlass.range_constexpr(per_group):
            j = g * per_group + i
            acc_s_mn[r, j] = (acc_s_mn[r, j] - group_max) * scale[r, g] + group_offset
        scale[r, g] = cutlass.Float32(1.0)


@cute.jit
def rescale_output(acc_o_mn, alpha):
    """O rows times alpha; one branch for all of a thread's rows, taken only when a running
    max moved (rarely: RESCALE_THRESHOLD)."""
    moved = alpha[0] != 1.0
    for r in cutlass.range_constexpr(1, cute.size(alpha)):
        moved = moved | (alpha[r] != 1.0)
    if moved:
        for r in cutlass.range_constexpr(cute.size(alpha)):
            acc_o_mn[r, None] = acc_o_mn[r, None].load() * alpha[r]


@cute.jit
def accumulate_tile(acc_o_mn, partial_mn, alpha, beta):
    """O = O * alpha + partial * beta (the second level of the accumulation)."""
    rescale_output(acc_o_mn, alpha)
    add_partial(acc_o_mn, partial_mn, beta, 0)


@cute.jit
def add_partial(acc_o_mn, partial_mn, beta, first_col: cutlass.Constexpr):
    """O[:, first_col:first_col + width] += partial * beta (the partial of a column slice)."""
    for r in cutlass.range_constexpr(cute.size(beta)):
        for c in cutlass.range_constexpr(cute.size(partial_mn, mode=[1])):
            acc_o_mn[r, first_col + c] = acc_o_mn[r, first_col + c] + partial_mn[r, c] * beta[r]


@cute.jit
def e4m3_words(p_mn):
    """P (rows, keys) quantized to e4m3, as (rows, keys / 4) 32-bit words of four keys."""
    rows, keys = cute.size(p_mn, mode=[0]), cute.size(p_mn, mode=[1])
    p8 = cute.make_rmem_tensor(
        cute.make_layout((rows, keys), stride=(keys, 1)), cutlass.Float8E4M3FN
    )
    for r in cutlass.range_constexpr(rows):
        p8[r, None] = p_mn[r, None].load().to(cutlass.Float8E4M3FN)
    return cute.recast_tensor(p8, cutlass.Int32)


def permuted_key(column):
    """The key in score column `column` when each 16 keys are loaded in the order
    e + 2 i + 8 h <- key e + 4 i + 2 h (e < 2, i < 4, h < 2; sm90/sage_fp8_fwd.py k_tma_view)."""
    return (column & ~15) + ((column >> 1) & 3) * 4 + ((column >> 3) & 1) * 2 + (column & 1)


@cute.jit
def scores_to_e4m3_operand_in_place(p_mn, operand_a):
    """Quantize P (fp32 accumulator, (rows, keys) view) into the e4m3 A-operand fragment
    ((4, 2, 2), 1, K / 32) of P V when keys are loaded permuted (permuted_key): a thread's
    word w of row r (its columns 16 w + 2 i + {0, 1} and 16 w + 8 + 2 i + {0, 1}, i = lane
    % 4) then holds keys 16 w + 4 i .. 16 w + 4 i + 3, in order: exactly the bytes of A's
    register (row r, 16-key half w % 2) of k-block w // 2. No data moves between lanes."""
    rows = cute.size(p_mn, mode=[0])
    words = e4m3_words(p_mn)
    out = cute.recast_tensor(operand_a, cutlass.Int32)  # ((1, 2, 2), 1, K / 32)
    for kb in cutlass.range_constexpr(cute.size(operand_a, mode=[2])):
        for v2 in cutlass.range_constexpr(2):
            for r in cutlass.range_constexpr(rows):
                out[(0, r, v2), 0, kb] = words[r, 2 * kb + v2]


@cute.jit
def scores_to_e4m3_operand(p_mn, operand_a):
    """Quantize P (fp32 accumulator, (rows, keys) view) into the e4m3 A-operand fragment
    ((4, 2, 2), 1, K / 32) of P V: byte b of register (v1, v2) of k-block kb holds row v1's
    key 32 kb + 16 v2 + 4 (lane % 4) + b.

    A thread's word w of row r holds its keys of chunks 2w and 2w+1 (keys 8 (2w) + 2i + {0,1}
    and 8 (2w + 1) + 2i + {0,1}). Lane i wants keys 4i..4i+3 of a 16-key group: two from
    lane 2 (i % 2) and two from lane 2 (i % 2) + 1, from chunk i // 2 of that word.
    """
    rows = cute.size(p_mn, mode=[0])
    words = e4m3_words(p_mn)
    out = cute.recast_tensor(operand_a, cutlass.Int32)  # ((1, 2, 2), 1, K / 32)
    lane = cute.arch.lane_idx()
    quad = lane % 4
    first_src = lane - quad + 2 * (quad % 2)
    selector = 0x5410 + (quad // 2) * 0x2222  # bytes {0,1} or {2,3} of each source word
    for kb in cutlass.range_constexpr(cute.size(operand_a, mode=[2])):
        for v2 in cutlass.range_constexpr(2):
            for r in cutlass.range_constexpr(rows):
                word = words[r, 2 * kb + v2]
                x = cute.arch.shuffle_sync(word, first_src)
                y = cute.arch.shuffle_sync(word, first_src + 1)
                out[(0, r, v2), 0, kb] = cutlass.Int32(cute.arch.prmt(x, y, selector))
