"""sdsa_thresholds: each query row's threshold for the SDSA threshold select, from a scored
sample (thresholds_from_sample).

One warp per row: the min of mSampleScores[r, p] over the positions p of mSampleTop[r] (a
position of -1, or past the row, or a NaN score counts as -inf), then the row's counters
set to 0. A row without positions gets +inf.
"""

import cutlass
import cutlass.cute as cute

WARPS = 4
NEG_INF = -cutlass.Float32.inf


class SdsaThresholds:
    @cute.jit
    def launch(self, args, stream):
        self.kernel(args).launch(
            grid=[cute.ceil_div(args.mThresholds.shape[0], WARPS), 1, 1],
            block=[WARPS * 32, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, args):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * WARPS + tidx // 32
        if row < args.mThresholds.shape[0]:
            positions = args.mSampleTop.shape[1]
            width = args.mSampleScores.shape[1]
            lowest = cutlass.Float32(cutlass.Float32.inf)
            for i in cutlass.range(lane, positions, 32, unroll=1):
                p = args.mSampleTop[row, i]
                value = NEG_INF
                if (p >= 0) & (p < width):
                    score = args.mSampleScores[row, p]
                    if score == score:
                        value = score
                lowest = cute.arch.fmin(lowest, value)
            for offset in (16, 8, 4, 2, 1):
                lowest = cute.arch.fmin(
                    lowest, cute.arch.shuffle_sync_bfly(lowest, offset=offset, mask=-1)
                )
            if lane == 0:
                args.mThresholds[row] = lowest
                args.mCounters[row, 0] = 0
                args.mCounters[row, 1] = 0


def make_kernel(variant):
    return SdsaThresholds()
