"""sdsa_repair: indexer_threshold_select's repair mode, a second launch after the select.

One CTA (16 warps: a lone repaired row is the launch's tail, and its speed is the loads
one CTA keeps in flight) per row. A row fits when its candidates fit their slots (cands <=
cap = slots - top_k) and its candidates plus stored ties reach wanted = min(row_end, top_k).
A row that does not is repaired: the CTA radix-selects the exact wanted-th largest of the
row's scores in float-bit order (generator/kernels/common/radix_select.py), makes it the
row's threshold, zeroes the row's counters and selects the row again. Then fewer than
wanted scores lie above the threshold (<= top_k - 1 <= cap) and the rest of the wanted ones
tie with it, so the row fits. Every row then gets its ranges: (top_k - min(ties, top_k),
top_k + min(cands, cap)).

The scores are computed 512 keys at a time on tensor cores, exactly as sdsa_scores and
sdsa_select compute them, and no score matrix is written: the first radix pass keeps the
scores of the row's first CACHED_KEYS keys in shared memory (what the arch's shared memory
holds), and the three other passes and the reselect read those back and recompute only the
keys beyond (a 65,536-key row on SM90: 2 reads of its keys instead of 5).
"""

import cutlass
import cutlass.cute as cute

from generator.kernels.common.entry import element_type
from generator.kernels.common.radix_select import BINS, float_bits, float_of_order_key, radix_select
from generator.kernels.portable.sdsa_scores import (
    K_STEPS,
    TILE_KEYS,
    TILES,
    SdsaScores,
)
from generator.kernels.portable.sdsa_select import TILE_ROWS, classify

WARPS = 16
CHUNK_KEYS = WARPS * TILES * TILE_KEYS  # scored per step, a thread per key
# Scores kept on chip, by arch: what its shared memory per CTA holds beside the histogram
# (227 KB on SM90 / SM100, 99 KB on SM120), a multiple of CHUNK_KEYS.
CACHED_KEYS = {"sm_90a": 48 * 1024, "sm_100a": 48 * 1024, "sm_120a": 20 * 1024}


class SdsaRepair(SdsaScores):
    warps = WARPS

    def __init__(self, dtype, nvfp4: bool, cached_keys: int):
        super().__init__(dtype, nvfp4)
        assert cached_keys % CHUNK_KEYS == 0
        self.cached_keys = cached_keys

    def grid(self, args):
        """A CTA per row."""
        return [args.mRowEnds.shape[0], 1, 1]

    @cute.kernel
    def kernel(self, args, atom):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        g = lane // 4
        q = lane % 4
        top_k = args.top_k
        cap = args.mCandidates.shape[1] - top_k
        end = cutlass.min(args.mRowEnds[row], args.max_context)
        wanted = cutlass.min(end, top_k)
        cands = args.mCounters[row, 0]
        ties = args.mCounters[row, 1]
        smem = cutlass.memory.SmemAllocator()
        sHist = smem.allocate_tensor(cutlass.Int32, cute.make_layout(BINS), 16)
        sState = smem.allocate_tensor(cutlass.Int32, cute.make_layout(2), 16)
        sScores = smem.allocate_tensor(cutlass.Float32, cute.make_layout(self.cached_keys), 16)
        if (cands > cap) | (cands + cutlass.min(ties, top_k) < wanted):
            request = args.mTileRequests[row // TILE_ROWS]
            # The row is MMA row 0 (lanes g == 0 hold its scores); the other rows are zero.
            a_frags = cute.make_rmem_tensor((8 * K_STEPS,), self.mma_dtype)
            a_frags.fill(0.0)
            if g == 0:
                self.place_query(args, row, q, a_frags, 0)
            # Every thread walks all chunks of CHUNK_KEYS keys: the warps' MMAs run converged.
            count = cute.ceil_div(end, CHUNK_KEYS) * CHUNK_KEYS
            threshold = cutlass.Float32(float("inf"))  # nothing wanted: nothing above it
            if wanted > 0:
                key, _ = radix_select(
                    lambda i, step: [
                        (ok, float_bits(score))
                        for ok, _, score in self.chunk_scores(
                            atom, args, a_frags, request, i - tidx, end, g, q, tidx, sScores,
                            cache_filled=step > 0,
                        )
                    ],
                    count, wanted, sHist, sState, tidx, CHUNK_KEYS,
                )  # fmt: skip
                threshold = float_of_order_key(key)
            if tidx == 0:
                args.mThresholds[row] = threshold
                args.mCounters[row, 0] = 0
                args.mCounters[row, 1] = 0
            cute.arch.sync_threads()
            for i in cutlass.range(tidx, count, CHUNK_KEYS, unroll=1):
                triples = self.chunk_scores(
                    atom, args, a_frags, request, i - tidx, end, g, q, tidx, sScores,
                    cache_filled=True,
                )  # fmt: skip
                for v in cutlass.range_constexpr(len(triples)):
                    ok, key, score = triples[v]
                    if ok:
                        classify(args, row, key, score, threshold, cap)
            cute.arch.sync_threads()
            cands = args.mCounters[row, 0]
            ties = args.mCounters[row, 1]
        if tidx == 0:
            args.mRanges[0, row] = top_k - cutlass.min(ties, top_k)
            args.mRanges[1, row] = top_k + cutlass.min(cands, cap)

    @cute.jit
    def chunk_scores(
        self, atom, args, a_frags, request, chunk_key, end, g, q, tidx, sScores,
        cache_filled: cutlass.Constexpr,
    ):  # fmt: skip
        """This thread's (valid, key, score) triples of the CHUNK_KEYS keys from chunk_key: its
        warp's 32 keys through the MMA, valid for MMA row 0 (g == 0) and keys < end. A chunk
        below cached_keys is read from sScores once cache_filled, else computed and kept."""
        first_key = chunk_key + (tidx // 32) * (TILES * TILE_KEYS)
        cached = chunk_key + CHUNK_KEYS <= self.cached_keys  # the same for the whole CTA
        scores = cute.make_rmem_tensor((2 * TILES,), cutlass.Float32)
        if cutlass.const_expr(cache_filled):
            if cached:
                # Each thread reads back the entries it wrote: no barrier needed.
                for t in cutlass.range_constexpr(TILES):
                    for c in cutlass.range_constexpr(2):
                        scores[2 * t + c] = sScores[first_key + t * TILE_KEYS + 2 * q + c]
            else:
                self.mma_scores(atom, args, a_frags, request, first_key, end, g, q, scores)
        else:
            self.mma_scores(atom, args, a_frags, request, first_key, end, g, q, scores)
            if cached & (g == 0):
                for t in cutlass.range_constexpr(TILES):
                    for c in cutlass.range_constexpr(2):
                        sScores[first_key + t * TILE_KEYS + 2 * q + c] = scores[2 * t + c]
        triples = []
        for t in cutlass.range_constexpr(TILES):
            for c in cutlass.range_constexpr(2):
                key = first_key + t * TILE_KEYS + 2 * q + c
                triples.append(((g == 0) & (key < end), key, scores[2 * t + c]))
        return triples

    @cute.jit
    def mma_scores(self, atom, args, a_frags, request, first_key, end, g, q, scores):
        """The scores of MMA row 0 against the warp's 32 keys from first_key, lanes g == 0
        holding keys first_key + 8t + 2q + c as scores[2t + c] (the other lanes: rows that
        are zero)."""
        keys = self.load_keys(args, request, first_key, end, g, q)
        for t in cutlass.range_constexpr(TILES):
            acc = self.tile_scores(atom, a_frags, keys[t, None])
            for c in cutlass.range_constexpr(2):
                scores[2 * t + c] = acc[c, 0, 0] * self.score_factor


def make_kernel(variant):
    dtype = variant.params["dtype"]
    return SdsaRepair(
        element_type(dtype), nvfp4=dtype == "u8", cached_keys=CACHED_KEYS[variant.arch]
    )
