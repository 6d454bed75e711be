"""sdsa_topk: each row's exact top-K keys from the candidates and ties the threshold select
stored in its range of slots (top_k_from_candidates). The rows are a (T, R) grid (tiles and
rows of each, any strides), row r of the launch being (r // R, r % R).

A CTA per row (up to CTAS of them, each then walking several rows). With at most K pairs in
[ranges[0, r], ranges[1, r]) the row's keys are copied in slot order and the rest of its K
columns set to -1. Otherwise a radix select
(generator/kernels/common/radix_select.py) finds the K-th largest stored value in the
float-bit order (a positive NaN above +inf); the keys above it take the first columns and
the tied ones the rest, up to K, each position from a shared-memory counter (so their order
is unspecified).
"""

import cutlass
import cutlass.cute as cute

from generator.kernels.common.ptx import store_int32x4_broadcast
from generator.kernels.common.radix_select import histogram_words, order_key, radix_select

THREADS = 256
# CTAs of the launch at most. A decode batch gives each request a 128-row tile of which one
# row (or a few) has candidates, so a CTA per row spent most of the launch starting up for
# empty rows (82 us for 16,384 rows). Instead CTA b walks rows b, b + CTAS, ...: a prime
# stride, so that rows at a fixed period (a tile's first rows) spread over the CTAs rather
# than all landing on a few (with 1024, CTA 0 took every 1024th row: all tiles' first rows).
CTAS = 1021
# Candidate pairs a thread loads before counting (or placing) any of them: one at a time,
# each radix pass waited on a round trip to L2 for every pair of the thread's share.
BATCH = 4


class SdsaTopK:
    @cute.jit
    def launch(self, args, stream):
        rows = args.mTopKeys.shape[0] * args.mTopKeys.shape[1]
        self.kernel(args).launch(
            grid=[cutlass.min(rows, CTAS), 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, args):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        rows = args.mTopKeys.shape[0] * args.mTopKeys.shape[1]
        smem = cutlass.memory.SmemAllocator()
        sHist = smem.allocate_tensor(cutlass.Int32, cute.make_layout(histogram_words(1)), 16)
        sState = smem.allocate_tensor(cutlass.Int32, cute.make_layout(4), 16)
        # The ranges of THREADS of the CTA's rows at a time, loaded together (a thread a
        # row), so that an empty row costs its stores, not a round trip for its range.
        sRanges = smem.allocate_tensor(
            cutlass.Int32, cute.make_layout((2, THREADS), stride=(THREADS, 1)), 16
        )
        own = cute.ceil_div(rows - bidx, grid)
        for batch in cutlass.range(0, own, THREADS, unroll=1):
            if batch + tidx < own:
                row = grid_row(args, bidx + (batch + tidx) * grid)
                sRanges[0, tidx] = args.mRanges[(0, *row)]
                sRanges[1, tidx] = args.mRanges[(1, *row)]
            cute.arch.sync_threads()
            for i in cutlass.range(cutlass.min(own - batch, THREADS), unroll=1):
                first = sRanges[0, i]
                self.top_k_of_row(
                    args, grid_row(args, bidx + (batch + i) * grid), first,
                    sRanges[1, i] - first, tidx, sHist, sState,
                )  # fmt: skip
            cute.arch.sync_threads()  # sRanges is the next batch's

    @cute.jit
    def top_k_of_row(self, args, row, first, count, tidx, sHist, sState):
        """Row `row`'s (grid coordinates) top-K from its `count` pairs from slot `first`
        (every thread)."""
        k = args.mTopKeys.shape[2]
        candidates = args.mCandidates[row[0], row[1], None, None]
        top_keys = args.mTopKeys[row[0], row[1], None]
        start = top_keys.iterator.toint()
        if count == 0 and k % 4 == 0 and start % 16 == 0:
            # Most rows of a decode batch are empty: their -1s four to a store (the
            # scalar loop below costs ~17 instructions an id, this ~10 a vector).
            for i in cutlass.range(tidx, k // 4, THREADS, unroll=4):
                store_int32x4_broadcast(start + 16 * i, -1)
        elif count <= k:
            # The row's addresses once (per element they cost ~20 instructions of 64-bit
            # arithmetic: the fill of empty rows was bound by issue).
            keys = cute.make_tensor(
                candidates[first, None].iterator, cute.make_layout(count, stride=2)
            )
            out = cute.make_tensor(top_keys.iterator, cute.make_layout(k))
            for i in cutlass.range(tidx, k, THREADS, unroll=4):
                key = cutlass.Int32(-1)
                if i < count:
                    key = keys[i]
                out[i] = key
        else:
            values = candidates[None, 1]
            last = first + count - 1
            prefix, wanted = radix_select(
                lambda i, step: [(cutlass.Boolean(True), values[cutlass.min(first + i, last)])],
                count, k, sHist, sState, tidx, THREADS, batch=BATCH,
            )  # fmt: skip
            # prefix is the K-th value; `wanted` of its ties fill the last columns.
            if tidx == 0:
                sState[2] = 0  # keys above written
                sState[3] = 0  # ties written
            cute.arch.sync_threads()
            above_total = k - wanted
            for i in cutlass.range(tidx, count, THREADS * BATCH, unroll=1):
                # BATCH pairs loaded before any is placed (as radix_select counts them).
                pairs = cute.make_rmem_tensor((BATCH, 2), cutlass.Int32)
                for b in cutlass.range_constexpr(BATCH):
                    slot = cutlass.min(first + i + b * THREADS, last)
                    pairs[b, 0] = candidates[slot, 0]
                    pairs[b, 1] = candidates[slot, 1]
                for b in cutlass.range_constexpr(BATCH):
                    if i + b * THREADS < count:
                        u = order_key(pairs[b, 1])
                        if u > prefix:
                            at = cute.arch.atomic_add(sState.iterator + 2, cutlass.Int32(1))
                            top_keys[at] = pairs[b, 0]
                        elif u == prefix:
                            at = cute.arch.atomic_add(sState.iterator + 3, cutlass.Int32(1))
                            if at < wanted:
                                top_keys[above_total + at] = pairs[b, 0]
            # The counters and histogram are the next row's.
            cute.arch.sync_threads()


@cute.jit
def grid_row(args, r):
    """Row r of the launch as its (tile, row) coordinates in the (T, R) grid."""
    per_tile = args.mTopKeys.shape[1]
    tile = r // per_tile
    return tile, r - tile * per_tile


def make_kernel(variant):
    return SdsaTopK()
