"""sdsa_select: the SDSA threshold select, without a score matrix (indexer_threshold_select;
its repair mode is sdsa_repair, launched after this).

A CTA owns 128 keys of one 128-row tile: the queries of the tile's rows that see one of
these keys as fp32 in shared memory (64 KB for all 128), each thread one key of the tile's
table row, dequantized into registers (as sdsa_scores). Keys no row of the tile sees are
not loaded (table entries past a request's keys need not be pages). For each row r of the
tile that sees the key (key < min(row_ends[r], max_context)) the thread scores it and
classifies it against thresholds[r]: a candidate (score > thr) takes the next candidate
number of its row from counters[r, 0] (atomic add) and, if it is below cap = slots -
top_k, slot top_k + n; a tie (neither above nor below: equal or NaN) takes counters[r,
1]'s next number and, below top_k, slot top_k - 1 - n. A pair is (key, the stored value's
bits): score - thr where score <= 2 thr (exact there), else the score.
"""

import cutlass
import cutlass.cute as cute

from generator.families.sdsa import PAGE_KEYS
from generator.kernels.common.entry import element_type
from generator.kernels.common.radix_select import float_bits
from generator.kernels.portable.sdsa_scores import KEYS_PER_CTA, SdsaScores

TILE_ROWS = 128
assert TILE_ROWS == KEYS_PER_CTA  # a thread per row finds the tile's last key


class SdsaSelect(SdsaScores):
    def grid(self, args):
        """A CTA per 128 keys of each 128-row tile."""
        return [cute.ceil_div(args.max_context, KEYS_PER_CTA), args.mTileRequests.shape[0], 1]

    @cute.kernel
    def kernel(self, args):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, tile, _ = cute.arch.block_idx()
        first_row = tile * TILE_ROWS
        key = bidx * KEYS_PER_CTA + tidx
        # The keys any row of the tile sees end at the largest min(row_end, max_context)
        # (thread t reads row t's): table entries past it need not be pages.
        smem = cutlass.memory.SmemAllocator()
        sEnd = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), 16)
        if tidx == 0:
            sEnd[0] = 0
        cute.arch.sync_threads()
        row_end = cutlass.min(args.mRowEnds[first_row + tidx], args.max_context)
        cute.arch.atomic_max(sEnd.iterator, row_end)
        # Only the rows that see some key of this CTA: a decode tile often has a few.
        sQ = self.stage_queries(
            args, TILE_ROWS, first_row, TILE_ROWS, tidx,
            needed=lambda r: args.mRowEnds[first_row + r] > bidx * KEYS_PER_CTA,
        )  # fmt: skip
        if key < sEnd[0]:  # (stage_queries ends with a barrier)
            page = args.mBlockTable[args.mTileRequests[tile], key // PAGE_KEYS]
            values = self.key_values(args, page, key % PAGE_KEYS)
            slots = args.mCandidates.shape[1]
            cap = slots - args.top_k
            for r in cutlass.range(TILE_ROWS, unroll=1):
                row = first_row + r
                if key < args.mRowEnds[row]:
                    score = self.dot(values, sQ, r)
                    self.classify(args, row, key, score, args.mThresholds[row], cap)

    @cute.jit
    def classify(self, args, row, key, score, threshold, cap):
        """Count (and store, while there is room) the pair (key, score) of `row` as a
        candidate or a tie of `threshold`."""
        stored = score
        if score <= 2.0 * threshold:
            stored = score - threshold
        bits = float_bits(stored)
        counters = args.mCounters
        if score > threshold:
            n = cute.arch.atomic_add(
                counters.iterator + cute.crd2idx((row, 0), counters.layout), cutlass.Int32(1)
            )
            if n < cap:
                args.mCandidates[row, args.top_k + n, 0] = key
                args.mCandidates[row, args.top_k + n, 1] = bits
        elif (score == threshold) | (score != score) | (threshold != threshold):
            n = cute.arch.atomic_add(
                counters.iterator + cute.crd2idx((row, 1), counters.layout), cutlass.Int32(1)
            )
            if n < args.top_k:
                args.mCandidates[row, args.top_k - 1 - n, 0] = key
                args.mCandidates[row, args.top_k - 1 - n, 1] = bits


def make_kernel(variant):
    dtype = variant.params["dtype"]
    return SdsaSelect(element_type(dtype), nvfp4=dtype == "u8")
