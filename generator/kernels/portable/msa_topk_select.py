"""msa_topk_select: per (token, query head), 16 block ids from the proxy scores.

Four lanes share a (token, head) row: lane q holds blocks [256 s + 64 q, 256 s + 64 q + 64)
of segment s in registers (the eight tokens of a quarter are consecutive lanes, so each load
instruction reads whole 32-byte sectors of mScore (Hq, P, S)). Blocks outside the middle range
(forced, past the token's valid blocks) and NaN scores count as -inf.

The kernel first finds the threshold, not the ids: the value T of the `keep`-th largest
middle score (keep = 16 - fb - fe). Each lane sorts its scores in groups of 16 with a bitonic
network of fmax / fmin (values only: two instructions per compare-exchange, no branches, no
ids to carry) and folds each sorted group into its running best 16 (max against the reversed
group, then a bitonic merge); the four lanes' lists are then folded the same way through two
butterfly shuffles. With T known, a block is selected when its score is above T, or equal to
T and among the first `keep - #above` such blocks in ascending order (ties to the lower id).
Each lane marks its blocks in two 64-bit masks; an exclusive prefix over the four lanes gives
each lane its first output slot, and a lane writes its ids in ascending bit order. Forced
blocks whose score is above -inf come first and last; the rest of the row is -1.

A row of more than 256 blocks is processed in segments: one pass to find T, and a second
that loads each segment again to write the ids (one segment stays in registers).
"""

import cutlass
import cutlass.cute as cute

from generator.families.msa_topk_select import TOPK

TOKENS_PER_WARP = 8  # lanes 8q .. 8q + 7: eight consecutive tokens, quarter q of their rows
QUARTERS = 4
PER_LANE = 64  # blocks of a segment per lane
SEGMENT = QUARTERS * PER_LANE
GROUP = 16  # sorted at a time
WARPS = 4
NEG_INF = -cutlass.Float32.inf


def bitonic_sort_pairs(size):
    """(i, j, descending) compare-exchanges that sort `size` values, largest first."""
    pairs = []
    k = 2
    while k <= size:
        j = k // 2
        while j >= 1:
            pairs += [(i, i ^ j, (i & k) == 0) for i in range(size) if i ^ j > i]
            j //= 2
        k *= 2
    return pairs


def bitonic_merge_pairs(size):
    """Compare-exchanges that sort a bitonic sequence of `size` values, largest first."""
    pairs = []
    j = size // 2
    while j >= 1:
        pairs += [(i, i + j, True) for i in range(size) if i & j == 0]
        j //= 2
    return pairs


SORT_GROUP = bitonic_sort_pairs(GROUP)
MERGE_BEST = bitonic_merge_pairs(TOPK)


class MsaTopkSelect:
    @cute.jit
    def launch(self, args, stream):
        heads, _, tokens = args.mScore.shape
        per_cta = WARPS * TOKENS_PER_WARP
        self.kernel(args).launch(
            grid=[cute.ceil_div(tokens, per_cta), heads, 1],
            block=[WARPS * 32, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, args):
        mScore, mOut = args.mScore, args.mOut
        tidx, _, _ = cute.arch.thread_idx()
        bidx, head, _ = cute.arch.block_idx()
        lane = tidx % 32
        quarter = lane // TOKENS_PER_WARP
        token = (bidx * WARPS + tidx // 32) * TOKENS_PER_WARP + lane % TOKENS_PER_WARP
        tokens, blocks = mScore.shape[2], mScore.shape[1]
        writes = token < tokens
        # Lanes past the last token read its row (every lane takes part in the shuffles).
        token = cutlass.min(token, tokens - 1)
        valid = cutlass.min(cutlass.max(args.mNumValid[token], 0), blocks)
        begin_end = cutlass.min(args.force_begin, valid)  # forced: [0, begin_end)
        end_start = cutlass.max(valid - args.force_end, begin_end)  # forced: [end_start, valid)
        keep = TOPK - args.force_begin - args.force_end
        segments = cute.ceil_div(blocks, SEGMENT)

        scores = cute.make_rmem_tensor((PER_LANE,), cutlass.Float32)
        best = cute.make_rmem_tensor((TOPK,), cutlass.Float32)
        group = cute.make_rmem_tensor((GROUP,), cutlass.Float32)
        best.fill(NEG_INF)
        for segment in cutlass.range(segments, unroll=1):
            first = segment * SEGMENT + quarter * PER_LANE
            self.load_middle(mScore, head, token, first, begin_end, end_start, scores)
            for g in cutlass.range_constexpr(PER_LANE // GROUP):
                if (first + g * GROUP < end_start) & (first + (g + 1) * GROUP > begin_end):
                    for i in cutlass.range_constexpr(GROUP):
                        group[i] = scores[g * GROUP + i]
                    self.sort_descending(group)
                    self.fold(best, group)
        for step in cutlass.range_constexpr(1, 3):
            for i in cutlass.range_constexpr(TOPK):
                group[i] = cute.arch.shuffle_sync_bfly(best[i], offset=step * TOKENS_PER_WARP)
            self.fold(best, group)

        # The threshold: the keep-th largest middle score (+inf when nothing is kept), how
        # many middle scores are above it, and how many equal to it are taken (none at -inf).
        threshold = cutlass.Float32(cutlass.Float32.inf)
        for i in cutlass.range_constexpr(TOPK):
            if keep == i + 1:
                threshold = best[i]
        above_total = cutlass.Int32(0)
        for i in cutlass.range_constexpr(TOPK):
            above_total = above_total + cutlass.Int32(best[i] > threshold)
        equal_take = cutlass.max(keep - above_total, 0)
        if threshold == NEG_INF:
            equal_take = cutlass.Int32(0)

        # Forced-begin blocks (lane 0 of the row writes them; every lane counts them).
        slot = cutlass.Int32(0)
        for block in cutlass.range(begin_end, unroll=1):
            if mScore[head, block, token] > NEG_INF:
                if writes & (quarter == 0):
                    mOut[token, head, slot] = block
                slot = slot + 1
        equal_seen = cutlass.Int32(0)
        for segment in cutlass.range(segments, unroll=1):
            first = segment * SEGMENT + quarter * PER_LANE
            if segments > 1:
                self.load_middle(mScore, head, token, first, begin_end, end_start, scores)
            above = cutlass.Uint64(0)
            equal = cutlass.Uint64(0)
            for j in cutlass.range_constexpr(PER_LANE):
                above = above | (cutlass.Uint64(scores[j] > threshold) << j)
                equal = equal | (cutlass.Uint64(scores[j] == threshold) << j)
            # Counts of this lane and of the lanes before it in the row (above in the low
            # 16 bits, equal in the high ones: each at most 256).
            counts = cutlass.Int32(cute.arch.popc(above)) + (
                cutlass.Int32(cute.arch.popc(equal)) << 16
            )
            before = self.exclusive_prefix(counts, quarter)
            total = cute.arch.shuffle_sync(before + counts, offset=lane % TOKENS_PER_WARP + 24)
            equal_left = cutlass.max(equal_take - equal_seen, 0)
            equal_before = before >> 16
            mine = cutlass.min(cutlass.max(equal_left - equal_before, 0), counts >> 16)
            for _ in cutlass.range(mine, unroll=1):
                lowest = equal & (~equal + 1)
                above = above | lowest
                equal = equal ^ lowest
            lane_slot = slot + (before & 0xFFFF) + cutlass.min(equal_left, equal_before)
            for _ in cutlass.range(cute.arch.popc(above), unroll=1):
                lowest = above & (~above + 1)
                bit_index = 63 - cutlass.Int32(cute.arch.clz(lowest))
                if writes:
                    mOut[token, head, lane_slot] = first + bit_index
                lane_slot = lane_slot + 1
                above = above ^ lowest
            slot = slot + (total & 0xFFFF) + cutlass.min(equal_left, total >> 16)
            equal_seen = equal_seen + (total >> 16)
        for block in cutlass.range(end_start, valid, unroll=1):
            if mScore[head, block, token] > NEG_INF:
                if writes & (quarter == 0):
                    mOut[token, head, slot] = block
                slot = slot + 1
        for j in cutlass.range(slot + quarter, TOPK, QUARTERS, unroll=1):
            if writes:
                mOut[token, head, j] = -1

    @cute.jit
    def load_middle(self, mScore, head, token, first, begin_end, end_start, scores):
        """scores[j] = score of block first + j if it is a middle block, else -inf; NaN
        becomes -inf (fmax drops it), which the networks' fmax / fmin need."""
        for j in cutlass.range_constexpr(PER_LANE):
            scores[j] = NEG_INF
            if (first + j >= begin_end) & (first + j < end_start):
                scores[j] = cute.arch.fmax(mScore[head, first + j, token], NEG_INF)

    @cute.jit
    def exclusive_prefix(self, value, quarter):
        """Sum of `value` over the lanes of the row's earlier quarters (8 lanes apart)."""
        inclusive = value
        for step in (1, 2):
            lower = cute.arch.shuffle_sync_up(inclusive, offset=step * TOKENS_PER_WARP)
            if quarter >= step:
                inclusive = inclusive + lower
        return inclusive - value

    @cute.jit
    def sort_descending(self, x):
        """Bitonic sort of the 16 values, largest first."""
        for p in cutlass.range_constexpr(len(SORT_GROUP)):
            self.compare_exchange(x, *SORT_GROUP[p])

    @cute.jit
    def fold(self, best, group):
        """best = the 16 largest of best and group (both sorted, largest first): the
        elementwise max against the reversed group is bitonic and holds them; merge it."""
        for i in cutlass.range_constexpr(TOPK):
            best[i] = cute.arch.fmax(best[i], group[TOPK - 1 - i])
        for p in cutlass.range_constexpr(len(MERGE_BEST)):
            self.compare_exchange(best, *MERGE_BEST[p])

    @cute.jit
    def compare_exchange(self, x, i, j, descending: cutlass.Constexpr):
        low, high = cute.arch.fmin(x[i], x[j]), cute.arch.fmax(x[i], x[j])
        if cutlass.const_expr(descending):
            x[i], x[j] = high, low
        else:
            x[i], x[j] = low, high


def make_kernel(variant):
    return MsaTopkSelect()
