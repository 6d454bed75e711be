"""The union tile of the MSA attention kernels (msa_sparse_attention's ABI): a CTA owns
consecutive tokens of one sequence times the G query heads of one kv head (row r is token
r // G, head r % G) and streams the union of its tokens' blocks once, each row masked to
its own token's blocks. The portable (mma.sync) and sm_90a (wgmma) templates share these.
"""

import cutlass
import cutlass.cute as cute

from generator.families.msa_sparse_attention import BLOCK_KEYS
from generator.kernels.common.bitmap_union import add_member, popcount_scan, rank
from generator.kernels.common.softmax import LN_2, acc_mn_view, quad_sum, softmax_finalize

NEG_INF = -cutlass.Float32.inf


@cute.jit
def token_tile_of_cta(mCuQ, cta, tokens_per_cta):
    """(sequence, token tile in it) of CTA `cta`: the tiles of the sequences in order
    (sequence -1 past the last tile; the grid bounds the tiles by total_q / T + B)."""
    seq = cutlass.Int32(-1)
    chunk = cutlass.Int32(0)
    tiles_before = cutlass.Int32(0)
    for b in cutlass.range(mCuQ.shape[0] - 1, unroll=1):
        tiles = cute.ceil_div(mCuQ[b + 1] - mCuQ[b], tokens_per_cta)
        if (seq < 0) & (cta < tiles_before + tiles):
            seq = b
            chunk = cta - tiles_before
        tiles_before = tiles_before + tiles
    return seq, chunk


@cute.jit
def usable(args, seq, block, blocks):
    """Whether a listed block is attended: an id of the sequence's blocks whose page id,
    when paged, lies inside the cache. A -1, an id past the sequence or a page id outside
    the cache is skipped (raising would need a host synchronisation; reading it would
    leave the cache)."""
    ok = (block >= 0) & (block < blocks)
    if args.paged != 0:
        if ok:
            page = args.mPageTable[seq, block]
            ok = (page >= 0) & (page < args.mK.shape[0])
    return ok


@cute.jit
def block_union(
    args, sBits, sBase, sWarpSums, sIds, sMask, tidx, seq, kv_head, first_token, tokens,
    blocks, num_threads: cutlass.Constexpr,
):  # fmt: skip
    """The union of the tile's tokens' usable blocks: its ascending ids into sIds and each
    block's token mask into sMask (two words a block: bit t of word t // 32 = token t
    selected it); returns its size. sBits / sBase: a word per 32 of the sequence's blocks;
    sWarpSums: a word per warp."""
    topk = args.mIdx.shape[2]
    words = cute.ceil_div(blocks, 32)
    for w in cutlass.range(tidx, words, num_threads, unroll=1):
        sBits[w] = 0
    for w in cutlass.range(tidx, 2 * tokens * topk, num_threads, unroll=1):
        sMask[w] = 0
    cute.arch.sync_threads()
    for e in cutlass.range(tidx, tokens * topk, num_threads, unroll=1):
        block = args.mIdx[kv_head, first_token + e // topk, e % topk]
        if usable(args, seq, block, blocks):
            add_member(sBits, block)
    cute.arch.sync_threads()
    num_union = popcount_scan(sBits, sBase, sWarpSums, words, tidx, num_threads)
    for e in cutlass.range(tidx, tokens * topk, num_threads, unroll=1):
        token = e // topk
        block = args.mIdx[kv_head, first_token + token, e % topk]
        if usable(args, seq, block, blocks):
            place = rank(sBits, sBase, block)
            sIds[place] = block
            bit = cutlass.Int32(1) << (token % 32)
            cute.arch.atomic_or(sMask.iterator + 2 * place + token // 32, bit)
    cute.arch.sync_threads()
    return num_union


@cute.jit
def row_limits(args, tScS_mn, group, tokens, seqlen_k, first_pos, first_token=0):
    """Per row of this thread (tScS_mn: the accumulator's coordinates as (rows, columns),
    row r being the tile's token first_token + r // group): its token, and the end of the
    keys it may see (the sequence's, or with causal its own position + 1; 0 for rows past
    the tile's tokens)."""
    rows = cute.size(tScS_mn, mode=[0])
    row_token = cute.make_rmem_tensor((rows,), cutlass.Int32)
    key_end = cute.make_rmem_tensor((rows,), cutlass.Int32)
    for r in cutlass.range_constexpr(rows):
        row_token[r] = first_token + tScS_mn[r, 0][0] // group
        key_end[r] = seqlen_k
        if args.causal != 0:
            key_end[r] = cutlass.min(seqlen_k, first_pos + row_token[r] + 1)
        if row_token[r] >= tokens:
            key_end[r] = 0
    return row_token, key_end


@cute.jit
def tokens_of_rows(first_row, rows: int, group, tokens):
    """The tokens of rows first_row .. first_row + rows - 1 (row r is token r // group),
    those below `tokens`, as the two words of a block's token mask in sMask."""
    first = first_row // group
    last = cutlass.min((first_row + rows - 1) // group, tokens - 1)
    words = []
    for w in cutlass.range_constexpr(2):
        lo = cutlass.max(first, 32 * w)
        hi = cutlass.min(last, 32 * w + 31)
        word = cutlass.Int32(0)
        if lo <= hi:
            # hi - lo + 1 low bits (all 32: 2 << 31 wraps to 0, minus 1 is every bit).
            word = ((cutlass.Int32(2) << (hi - lo)) - 1) << (lo - 32 * w)
        words.append(word)
    return words[0], words[1]


def selects_block(sMask, j, token_words):
    """Whether any token of token_words (tokens_of_rows) selected union block j."""
    return ((sMask[2 * j] & token_words[0]) | (sMask[2 * j + 1] & token_words[1])) != 0


@cute.jit
def mask_to_own_blocks(
    acc_S_mn, tScS_mn, sMask, j, first_key, row_token, key_end, full: cutlass.Constexpr = 0
):
    """Scores of union block j's keys from first_key (a tile of acc_S_mn's columns): -inf
    where the row's token did not select the block, and from the row's key_end on. With
    `full` (the tile's width), a row that keeps every key skips the compares."""
    for r in cutlass.range_constexpr(cute.size(row_token)):
        token = row_token[r]
        selected = (sMask[2 * j + token // 32] >> (token % 32)) & 1
        limit = key_end[r] - first_key
        if selected == 0:
            limit = 0
        if cutlass.const_expr(full == 0):
            mask_row_from(acc_S_mn, tScS_mn, r, limit)
        elif limit < full:
            mask_row_from(acc_S_mn, tScS_mn, r, limit)


@cute.jit
def mask_row_from(acc_S_mn, tScS_mn, r, limit):
    """Row r's scores of the columns from `limit` on: -inf."""
    for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
        if tScS_mn[r, c][1] >= limit:
            acc_S_mn[r, c] = NEG_INF


def first_key_of(sIds, u, tile_keys: int):
    """The first key (in the sequence) of the union's tile u of `tile_keys` keys."""
    halves = BLOCK_KEYS // tile_keys
    return sIds[u // halves] * BLOCK_KEYS + (u % halves) * tile_keys


@cute.jit
def finalize_rows(
    args, acc_O, state, row_lse, row_lse_t, p_offset: cutlass.Constexpr, scale_log2, out_scale
):  # fmt: skip
    """O / rowsum x out_scale in acc_O; each row's lse and temperature lse (the lse when
    no temperature is asked), natural log, of scores at scale_log2 (the softmax's scale,
    log2 units). state: (row max, row sum, temperature max, temperature sum, whether the
    temperature lse is asked)."""
    row_max, row_sum, t_max, t_sum, with_temperature = state
    softmax_finalize(row_max, row_sum, scale_log2, acc_mn_view(acc_O), row_lse, p_offset)
    acc_O.store(acc_O.load() * out_scale)
    for r in cutlass.range_constexpr(cute.size(row_lse)):
        row_lse_t[r] = row_lse[r]
        if with_temperature:
            total = quad_sum(t_sum[r])
            row_lse_t[r] = NEG_INF
            if total > 0.0:
                log_total = cute.math.log2(total, fastmath=True)
                row_lse_t[r] = (t_max[r] * scale_log2 * args.temperature + log_total) * LN_2


def chunk8(fragment, m, k):
    """The 8 values (one 16-byte shared-memory chunk) of a row-copy fragment at (m, k)."""
    return cute.make_tensor(fragment[None, m, k].iterator, cute.make_layout(8))
