"""msa_topk_select: per (token, query head), 16 block ids from the proxy scores.

Four lanes share a (token, head) row: lane q holds blocks [256 s + 64 q, 256 s + 64 q + 64)
of segment s in registers (the eight tokens of a quarter are consecutive lanes, so each load
instruction reads whole 32-byte sectors of mScore (Hq, P, S)). Blocks outside the middle range
(forced, past the token's valid blocks) and NaN scores count as -inf.

The kernel first finds the threshold, not the ids: the value T of the `keep`-th largest
middle score (keep = 16 - fb - fe). Each lane sorts its scores in groups of 16 with Batcher's
odd-even merge sort (fmax / fmin on values only: two instructions per compare-exchange, no
branches, no ids to carry) and folds each sorted group into its running best 16 (max against
the reversed group, then a bitonic merge); the four lanes' lists are then folded the same way
through two butterfly shuffles. With T known, a block is selected when its score is above T,
or equal to T and among the first `keep - #above` such blocks in ascending order (ties to the
lower id). Each lane marks its blocks in a 64-bit mask; an exclusive prefix over the four
lanes gives each lane its first output slot, and a lane writes its ids in ascending bit
order. Forced blocks whose score is above -inf come first and last; the rest of the row is -1.

The kernel is bound by the integer pipe (fmax / fmin issue at half the rate of
floating-point adds; ncu: that pipe ~90% busy), so everything else is kept off it where it
can be: a load's address is one add on the last one, NaN is looked for by a floating-point
sum, and the selection of a row of one segment is one `>= T` mask, with the general
above / equal masks only in a warp where a row has more ties at T than it takes.

A row of more than 256 blocks is processed in segments: one pass to find T, and a second
that loads each segment again to write the ids (one segment stays in registers).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import dsl_user_op

from generator.families.msa_topk_select import TOPK
from generator.kernels.common.ptx import inline_ptx

TOKENS_PER_WARP = 8  # lanes 8q .. 8q + 7: eight consecutive tokens, quarter q of their rows
QUARTERS = 4
PER_LANE = 64  # blocks of a segment per lane
SEGMENT = QUARTERS * PER_LANE
GROUP = 16  # sorted at a time
WARPS = 4
NEG_INF = -cutlass.Float32.inf
FLT_MAX = 3.4028234663852886e38


def odd_even_merge_sort_pairs(size):
    """(i, j, descending) compare-exchanges of Batcher's odd-even merge sort: they sort
    `size` values (a power of two), largest first; 63 for 16 values (a bitonic sort: 80)."""
    pairs = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k, True))
            k //= 2
        p *= 2
    return pairs


def bitonic_merge_pairs(size):
    """Compare-exchanges that sort a bitonic sequence of `size` values, largest first."""
    pairs = []
    j = size // 2
    while j >= 1:
        pairs += [(i, i + j, True) for i in range(size) if i & j == 0]
        j //= 2
    return pairs


SORT_GROUP = odd_even_merge_sort_pairs(GROUP)
MERGE_BEST = bitonic_merge_pairs(TOPK)


@dsl_user_op
def load_f32(address, *, loc=None, ip=None):
    """The f32 at a global byte address, through the read-only data path, with the L2 asked
    to fetch the whole 128-byte line: a warp's load reads 32 bytes of four lines, and the
    CTAs of the next 96 tokens read the rest of them (MS2 on the H200 813-815 us against
    825-827 without the hint; bench/results/2026-12-04_42abbb6_h200_ms2_l2_hint_ab.md)."""
    operands = [cutlass.Int64(address)]
    return inline_ptx(
        cutlass.Float32, operands, "ld.global.nc.L2::128B.f32 $0, [$1];", "=f,l", loc=loc, ip=ip
    )


@dsl_user_op
def advance(address, stride, *, loc=None, ip=None):
    """address + stride (64-bit + 32-bit), written as a wide multiply-add by 1: ptxas then
    emits IADD3 + IMAD.X (the carry on the multiply-add pipe) where a 64-bit add is
    IADD3 + IADD3.X, both on the integer pipe this kernel is bound by."""
    operands = [cutlass.Int64(address), cutlass.Uint32(stride)]
    return inline_ptx(
        cutlass.Int64, operands, "mad.wide.u32 $0, $2, 1, $1;", "=l,l,r", loc=loc, ip=ip
    )


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
        row = mScore[head, None, token]
        # Segment 0 outside the loop over the others: its first sorted group is copied
        # into best, not folded (a compile-time choice).
        self.scan_segment(
            row, quarter * PER_LANE, blocks, begin_end, end_start, scores, best, group, True
        )
        for segment in cutlass.range(1, segments, unroll=1):
            first = segment * SEGMENT + quarter * PER_LANE
            self.scan_segment(row, first, blocks, begin_end, end_start, scores, best, group, False)
        for step in cutlass.range_constexpr(1, 3):
            for i in cutlass.range_constexpr(TOPK):
                group[i] = cute.arch.shuffle_sync_bfly(best[i], offset=step * TOKENS_PER_WARP)
            self.fold(best, group)

        # The threshold: the keep-th largest middle score (+inf when nothing is kept), how
        # many middle scores are above it, and how many equal to it are taken (none at -inf).
        # best[keep - 1] by a tree of selects on the bits of keep - 1 (15 selects).
        candidates = [best[i] for i in range(TOPK)]
        for bit in cutlass.range_constexpr(4):
            odd = ((keep - 1) >> bit) & 1
            halved = []
            for m in cutlass.range_constexpr(len(candidates) // 2):
                pick = candidates[2 * m]
                if odd != 0:
                    pick = candidates[2 * m + 1]
                halved.append(pick)
            candidates = halved
        threshold = candidates[0]
        if keep <= 0:
            threshold = cutlass.Float32(cutlass.Float32.inf)
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
        # One segment (the scores still in registers): the row's blocks at or above the
        # threshold are its selection unless more of them tie at it than are taken, which
        # the general loop below resolves (a warp takes it if any of its rows needs it).
        general = segments > 1
        if not general:
            at_least = cute.arch.fmax(threshold, -FLT_MAX)  # -inf is never selected
            chosen = cutlass.Uint64(0)
            for j in cutlass.range_constexpr(PER_LANE):
                if scores[j] >= at_least:
                    chosen = chosen | cutlass.Uint64(1 << j)
            count = cutlass.Int32(cute.arch.popc(chosen))
            before = self.exclusive_prefix(count, quarter)
            total = cute.arch.shuffle_sync(before + count, offset=lane % TOKENS_PER_WARP + 24)
            general = cute.arch.vote_any_sync(total != above_total + equal_take)
            if not general:
                self.write_ids(mOut, token, head, writes, quarter * PER_LANE, chosen, slot + before)
                slot = slot + total
        if general:
            slot = self.select_segments(
                mOut, row, token, head, writes, quarter, slot, scores, segments, blocks,
                begin_end, end_start, threshold, equal_take,
            )  # fmt: skip
        for block in cutlass.range(end_start, valid, unroll=1):
            if mScore[head, block, token] > NEG_INF:
                if writes & (quarter == 0):
                    mOut[token, head, slot] = block
                slot = slot + 1
        for j in cutlass.range(slot + quarter, TOPK, QUARTERS, unroll=1):
            if writes:
                mOut[token, head, j] = -1

    @cute.jit
    def scan_segment(
        self, row, first, blocks, begin_end, end_start, scores, best, group,
        is_first: cutlass.Constexpr,
    ):  # fmt: skip
        """Load the lane's 64 blocks from `first` into scores and fold their middle ones
        into best, 16 at a time (the first group of the first segment is copied)."""
        self.load_middle(row, first, blocks, begin_end, end_start, scores)
        for g in cutlass.range_constexpr(PER_LANE // GROUP):
            if (first + g * GROUP < end_start) & (first + (g + 1) * GROUP > begin_end):
                for i in cutlass.range_constexpr(GROUP):
                    group[i] = scores[g * GROUP + i]
                self.sort_descending(group)
                if cutlass.const_expr(is_first and g == 0):
                    for i in cutlass.range_constexpr(TOPK):
                        best[i] = group[i]  # best is all -inf: the fold would copy it
                else:
                    self.fold(best, group)

    @cute.jit
    def select_segments(
        self, mOut, row, token, head, writes, quarter, slot, scores, segments, blocks,
        begin_end, end_start, threshold, equal_take,
    ):  # fmt: skip
        """Write the middle blocks above the threshold and the first equal_take equal to it
        (ascending ids), segment by segment from output slot `slot`; the next free slot."""
        lane = cute.arch.lane_idx()
        equal_seen = cutlass.Int32(0)
        for segment in cutlass.range(segments, unroll=1):
            first = segment * SEGMENT + quarter * PER_LANE
            if segments > 1:
                self.load_middle(row, first, blocks, begin_end, end_start, scores)
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
            self.write_ids(mOut, token, head, writes, first, above, lane_slot)
            slot = slot + (total & 0xFFFF) + cutlass.min(equal_left, total >> 16)
            equal_seen = equal_seen + (total >> 16)
        return slot

    @cute.jit
    def write_ids(self, mOut, token, head, writes, first, chosen, lane_slot):
        """Blocks first + j for the set bits j of `chosen`, ascending, from slot lane_slot
        (a 32-bit half at a time: half the instructions of 64-bit bit tricks)."""
        for half in cutlass.range_constexpr(2):
            bits = cutlass.Uint32(chosen >> (32 * half))
            for _ in cutlass.range(cute.arch.popc(bits), unroll=1):
                lowest = bits & (~bits + 1)
                if writes:
                    mOut[token, head, lane_slot] = (
                        first + 32 * half + 31 - cutlass.Int32(cute.arch.clz(lowest))
                    )
                lane_slot = lane_slot + 1
                bits = bits ^ lowest

    @cute.jit
    def load_middle(self, row, first, blocks, begin_end, end_start, scores):
        """scores[j] = row[first + j] if block first + j is a middle block, else -inf; NaN
        becomes -inf (fmax drops it), which the networks' fmax / fmin need. row: one
        token's scores of every block."""
        # Each load's address one 64-bit add from the last (the DSL's index arithmetic
        # takes ~10 instructions a load, or keeps 64 offsets in registers).
        address = cute.domain_offset((first,), row).iterator.toint()
        stride = cutlass.Uint32(row.stride[0] * 4)  # bytes
        if first + PER_LANE <= blocks:
            for j in cutlass.range_constexpr(PER_LANE):
                scores[j] = load_f32(address)
                address = advance(address, stride)
        else:
            for j in cutlass.range_constexpr(PER_LANE):
                scores[j] = NEG_INF
                if first + j < blocks:
                    scores[j] = load_f32(address)
                address = advance(address, stride)
        # NaN to -inf only in a warp that holds one: the kernel is bound by the integer
        # pipe (fmax / fmin), and a sum (the floating-point pipe) is NaN if a value is NaN
        # (or +inf meets -inf: then the fmax runs for nothing).
        sums = cute.make_rmem_tensor((4,), cutlass.Float32)
        for k in cutlass.range_constexpr(4):
            sums[k] = scores[k]
        for j in cutlass.range_constexpr(4, PER_LANE):
            sums[j % 4] = sums[j % 4] + scores[j]
        total = (sums[0] + sums[1]) + (sums[2] + sums[3])
        if cute.arch.vote_any_sync(total != total):
            for j in cutlass.range_constexpr(PER_LANE):
                scores[j] = cute.arch.fmax(scores[j], NEG_INF)
        # Forced blocks and those past the token's valid ones: only a group of 16 that
        # holds an edge of the middle range is masked element by element.
        for g in cutlass.range_constexpr(PER_LANE // GROUP):
            low = first + g * GROUP
            if (low < begin_end) | (low + GROUP > end_start):
                # Bit i: element i is a middle block (a bit test a value, not two compares).
                below = cutlass.min(cutlass.max(begin_end - low, 0), GROUP)
                upto = cutlass.min(cutlass.max(end_start - low, 0), GROUP)
                middle = ((cutlass.Int32(1) << upto) - 1) & ~((cutlass.Int32(1) << below) - 1)
                for i in cutlass.range_constexpr(GROUP):
                    if middle & (1 << i) == 0:
                        scores[g * GROUP + i] = NEG_INF

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
        """Sort the 16 values, largest first."""
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
