"""sdsa_topk: each row's exact top-K keys from the candidates and ties the threshold select
stored in its range of slots (top_k_from_candidates).

One CTA per row. With at most K pairs in [ranges[0, r], ranges[1, r]) the row's keys are
copied in slot order and the rest of its K columns set to -1. Otherwise a radix select
(generator/kernels/common/radix_select.py) finds the K-th largest stored value in the
float-bit order (a positive NaN above +inf); the keys above it take the first columns and
the tied ones the rest, up to K, each position from a shared-memory counter (so their order
is unspecified).
"""

import cutlass
import cutlass.cute as cute

from generator.kernels.common.radix_select import BINS, order_key, radix_select

THREADS = 256


class SdsaTopK:
    @cute.jit
    def launch(self, args, stream):
        self.kernel(args).launch(
            grid=[args.mTopKeys.shape[0], 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, args):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sHist = smem.allocate_tensor(cutlass.Int32, cute.make_layout(BINS), 16)
        sState = smem.allocate_tensor(cutlass.Int32, cute.make_layout(4), 16)
        k = args.mTopKeys.shape[1]
        first = args.mRanges[0, row]
        count = args.mRanges[1, row] - first
        if count <= k:
            for i in cutlass.range(tidx, k, THREADS, unroll=1):
                key = cutlass.Int32(-1)
                if i < count:
                    key = args.mCandidates[row, first + i, 0]
                args.mTopKeys[row, i] = key
        else:
            values = args.mCandidates[row, None, 1]
            prefix, wanted = radix_select(
                lambda i, step: [(cutlass.Boolean(True), values[first + i])],
                count,
                k,
                sHist,
                sState,
                tidx,
                THREADS,
            )
            # prefix is the K-th value; `wanted` of its ties fill the last columns.
            if tidx == 0:
                sState[2] = 0  # keys above written
                sState[3] = 0  # ties written
            cute.arch.sync_threads()
            above_total = k - wanted
            for i in cutlass.range(tidx, count, THREADS, unroll=1):
                u = order_key(args.mCandidates[row, first + i, 1])
                if u > prefix:
                    at = cute.arch.atomic_add(sState.iterator + 2, cutlass.Int32(1))
                    args.mTopKeys[row, at] = args.mCandidates[row, first + i, 0]
                elif u == prefix:
                    at = cute.arch.atomic_add(sState.iterator + 3, cutlass.Int32(1))
                    if at < wanted:
                        args.mTopKeys[row, above_total + at] = args.mCandidates[row, first + i, 0]


def make_kernel(variant):
    return SdsaTopK()
