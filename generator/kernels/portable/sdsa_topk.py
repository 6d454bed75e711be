"""sdsa_topk: each row's exact top-K keys from the candidates and ties the threshold select
stored in its range of slots (top_k_from_candidates).

One CTA per row. With at most K pairs in [ranges[0, r], ranges[1, r]) the row's keys are
copied in slot order and the rest of its K columns set to -1. Otherwise a radix select
finds the K-th largest stored value in the float-bit order (negative values: every bit
inverted; others: the sign bit set, so a positive NaN ranks above +inf): four passes of an
8-bit histogram in shared memory over the pairs whose higher bits match the prefix so far.
Then the keys above that value take the first columns and the tied ones the rest, up to K,
each position from a shared-memory counter (so their order is unspecified).
"""

import cutlass
import cutlass.cute as cute

THREADS = 256
BINS = 256


@cute.jit
def order_key(bits):
    """The stored value's float bits (Int32) as an unsigned order key (Uint32)."""
    u = cutlass.Uint32(bits)
    flip = cutlass.Uint32(0x80000000)
    if bits < 0:
        flip = cutlass.Uint32(0xFFFFFFFF)
    return u ^ flip


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
            prefix = cutlass.Uint32(0)
            wanted = k  # rank of the K-th value among the pairs matching the prefix
            for step in cutlass.range_constexpr(4):
                shift = 24 - 8 * step
                for b in cutlass.range(tidx, BINS, THREADS, unroll=1):
                    sHist[b] = 0
                cute.arch.sync_threads()
                for i in cutlass.range(tidx, count, THREADS, unroll=1):
                    u = order_key(args.mCandidates[row, first + i, 1])
                    matches = True
                    if cutlass.const_expr(step > 0):
                        matches = (u >> cutlass.Uint32(shift + 8)) == (
                            prefix >> cutlass.Uint32(shift + 8)
                        )
                    if matches:
                        digit = cutlass.Int32((u >> cutlass.Uint32(shift)) & cutlass.Uint32(0xFF))
                        cute.arch.atomic_add(sHist.iterator + digit, cutlass.Int32(1))
                cute.arch.sync_threads()
                if tidx == 0:
                    # From the top bin down, the bin where the count reaches `wanted`.
                    above = cutlass.Int32(0)
                    chosen = cutlass.Int32(0)
                    found = cutlass.Int32(0)
                    for j in cutlass.range(BINS, unroll=1):
                        b = BINS - 1 - j
                        if found == 0:
                            if above + sHist[b] >= wanted:
                                chosen = b
                                found = cutlass.Int32(1)
                            else:
                                above = above + sHist[b]
                    sState[0] = chosen
                    sState[1] = wanted - above
                cute.arch.sync_threads()
                prefix = prefix | (cutlass.Uint32(sState[0]) << cutlass.Uint32(shift))
                wanted = sState[1]
                cute.arch.sync_threads()
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
