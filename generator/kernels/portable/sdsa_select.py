"""sdsa_select on tensor cores: the SDSA threshold select without a score matrix
(indexer_threshold_select; its repair mode is sdsa_repair, launched after this).

A CTA (4 warps) owns 128 keys of one 128-row tile, each warp 32 of them as four 8-key MMA
tiles, loaded once into registers as sdsa_scores loads them (those below the end of what
any row sees: table entries past a request's keys need not be pages). The tile's live
rows (those that see some key of the CTA; a decode tile often has a few of 128) are listed
once in shared memory (a thread per row; their order is free); the warps walk them 16 at a
time as the MMA's rows, each row's 32 channels straight from global memory into the A
fragments. Every score (row, key) with key < min(row_end, max_context) is classified
against the row's threshold (classify: candidates and ties counted by atomics, stored
while there is room), with the bits sdsa_scores computes for it.
"""

import cutlass
import cutlass.cute as cute

from generator.kernels.common.entry import element_type
from generator.kernels.common.radix_select import float_bits
from generator.kernels.portable.sdsa_scores import (
    K_STEPS,
    KEYS_PER_CTA,
    TILE_KEYS,
    TILES,
    SdsaScores,
)

TILE_ROWS = 128
MMA_ROWS = 16
assert TILE_ROWS == KEYS_PER_CTA  # a thread per row lists the live rows


class SdsaSelect(SdsaScores):
    def grid(self, args):
        """A CTA per 128 keys of each 128-row tile."""
        return [cute.ceil_div(args.max_context, KEYS_PER_CTA), args.mTileRequests.shape[0], 1]

    @cute.kernel
    def kernel(self, args, atom):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, tile, _ = cute.arch.block_idx()
        lane = tidx % 32
        g = lane // 4
        q = lane % 4
        first_row = tile * TILE_ROWS
        cta_first_key = bidx * KEYS_PER_CTA
        # sLive: the live rows, then their count and the end of the keys any of them sees
        # (table entries past it need not be pages).
        smem = cutlass.memory.SmemAllocator()
        sLive = smem.allocate_tensor(cutlass.Int32, cute.make_layout(TILE_ROWS + 2), 16)
        if tidx == 0:
            sLive[TILE_ROWS] = 0
            sLive[TILE_ROWS + 1] = 0
        cute.arch.sync_threads()
        row_end = cutlass.min(args.mRowEnds[first_row + tidx], args.max_context)
        if row_end > cta_first_key:
            sLive[cute.arch.atomic_add(sLive.iterator + TILE_ROWS, cutlass.Int32(1))] = tidx
            cute.arch.atomic_max(sLive.iterator + TILE_ROWS + 1, row_end)
        cute.arch.sync_threads()
        live = sLive[TILE_ROWS]
        keys_end = sLive[TILE_ROWS + 1]
        first_key = cta_first_key + (tidx // 32) * (TILES * TILE_KEYS)
        if first_key < keys_end:  # the same for the whole warp
            request = args.mTileRequests[tile]
            keys = self.load_keys(args, request, first_key, keys_end, g, q)
            cap = args.mCandidates.shape[1] - args.top_k
            for m in cutlass.range(cute.ceil_div(live, MMA_ROWS), unroll=1):
                # MMA rows g and g + 8: live rows 16m + g and 16m + g + 8 (-1: none).
                a_frags = cute.make_rmem_tensor((8 * K_STEPS,), self.mma_dtype)
                a_frags.fill(0.0)
                row_of = cute.make_rmem_tensor((2,), cutlass.Int32)
                for half in cutlass.range_constexpr(2):
                    row_of[half] = -1
                    j = m * MMA_ROWS + g + 8 * half
                    if j < live:
                        row_of[half] = first_row + sLive[j]
                        self.place_query(args, row_of[half], q, a_frags, half)
                for t in cutlass.range_constexpr(TILES):
                    acc = self.tile_scores(atom, a_frags, keys[t, None])
                    for half in cutlass.range_constexpr(2):
                        row = row_of[half]
                        if row >= 0:
                            threshold = args.mThresholds[row]
                            end = cutlass.min(args.mRowEnds[row], args.max_context)
                            for c in cutlass.range_constexpr(2):
                                key = first_key + t * TILE_KEYS + 2 * q + c
                                if key < end:
                                    score = acc[2 * half + c, 0, 0] * self.score_factor
                                    classify(args, row, key, score, threshold, cap)


@cute.jit
def classify(args, row, key, score, threshold, cap):
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
