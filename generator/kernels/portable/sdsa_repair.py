"""sdsa_repair: indexer_threshold_select's repair mode, a second launch after the select.

One CTA per row. A row fits when its candidates fit their slots (cands <= cap = slots -
top_k) and its candidates plus stored ties reach wanted = min(row_end, top_k). A row that
does not is repaired: the CTA radix-selects the exact wanted-th largest of the row's scores
in float-bit order (generator/kernels/common/radix_select.py; each of its four passes
recomputes the scores as the select computes them, so no score matrix is written), makes
it the row's threshold, zeroes the row's counters and selects the row again. Then fewer
than wanted scores lie above the threshold (<= top_k - 1 <= cap) and the rest of the
wanted ones tie with it, so the row fits. Every row then gets its ranges:
(top_k - min(ties, top_k), top_k + min(cands, cap)).
"""

import cutlass
import cutlass.cute as cute

from generator.families.sdsa import PAGE_KEYS
from generator.kernels.common.entry import element_type
from generator.kernels.common.radix_select import BINS, float_bits, float_of_order_key, radix_select
from generator.kernels.portable.sdsa_scores import KEYS_PER_CTA
from generator.kernels.portable.sdsa_select import TILE_ROWS, SdsaSelect


class SdsaRepair(SdsaSelect):
    def grid(self, args):
        """A CTA per row."""
        return [args.mRowEnds.shape[0], 1, 1]

    @cute.kernel
    def kernel(self, args):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        top_k = args.top_k
        cap = args.mCandidates.shape[1] - top_k
        end = cutlass.min(args.mRowEnds[row], args.max_context)
        wanted = cutlass.min(end, top_k)
        cands = args.mCounters[row, 0]
        ties = args.mCounters[row, 1]
        sQ = self.stage_queries(args, 1, row, 1, tidx)
        smem = cutlass.memory.SmemAllocator()
        sHist = smem.allocate_tensor(cutlass.Int32, cute.make_layout(BINS), 16)
        sState = smem.allocate_tensor(cutlass.Int32, cute.make_layout(2), 16)
        if (cands > cap) | (cands + cutlass.min(ties, top_k) < wanted):
            request = args.mTileRequests[row // TILE_ROWS]
            threshold = cutlass.Float32(float("inf"))  # nothing wanted: nothing above it
            if wanted > 0:
                key, _ = radix_select(
                    lambda i: float_bits(self.score(args, request, i, sQ)),
                    end, wanted, sHist, sState, tidx, KEYS_PER_CTA,
                )  # fmt: skip
                threshold = float_of_order_key(key)
            if tidx == 0:
                args.mThresholds[row] = threshold
                args.mCounters[row, 0] = 0
                args.mCounters[row, 1] = 0
            cute.arch.sync_threads()
            for k in cutlass.range(tidx, end, KEYS_PER_CTA, unroll=1):
                self.classify(args, row, k, self.score(args, request, k, sQ), threshold, cap)
            cute.arch.sync_threads()
            cands = args.mCounters[row, 0]
            ties = args.mCounters[row, 1]
        if tidx == 0:
            args.mRanges[0, row] = top_k - cutlass.min(ties, top_k)
            args.mRanges[1, row] = top_k + cutlass.min(cands, cap)

    @cute.jit
    def score(self, args, request, key, sQ):
        """Key `key` of table row `request` scored with the query in sQ[0]."""
        page = args.mBlockTable[request, key // PAGE_KEYS]
        return self.dot(self.key_values(args, page, key % PAGE_KEYS), sQ, 0)


def make_kernel(variant):
    dtype = variant.params["dtype"]
    return SdsaRepair(element_type(dtype), nvfp4=dtype == "u8")
