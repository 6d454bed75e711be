"""sdsa_select on tensor cores: the SDSA threshold select without a score matrix
(indexer_threshold_select; its repair mode is sdsa_repair, launched after this).

A CTA (4 warps) owns 512 keys of one 128-row tile, each warp 4 chunks of 32 as two 16-key
MMA tiles, loaded into registers as sdsa_scores loads them (those below the end of what
any row sees: table entries past a request's keys need not be pages); NVFP4 keys from the
CTA's pages staged in shared memory as sdsa_scores stages them (once, read again for each
group of rows), their table entries loaded beside the row ends. The tile's live
rows (those that see some key of the CTA; a decode tile often has a few of 128) are listed
once in shared memory (a thread per row; their order is free); the warps walk them 8 at a
time as the MMA's columns (the keys loaded again for each 8), each row's 32 channels a lane
straight from global memory into the B values. Every score (row, key) with key <
min(row_end, max_context) is classified against the row's threshold, with the bits
sdsa_scores computes for it. A lane keeps its first LANE_SLOTS candidates of a row and group
in registers; once the warp has scored its keys for the group, the lanes of a row take their
slots with one global atomic (a warp-wide sum of their counts) and store them (a lane's
candidates past LANE_SLOTS, rare, take theirs one atomic each as they are found). The warps
share nothing after the live-row list: no barrier, and no shared memory but the pages. Ties
(rare) are counted and stored as they are found (add_tie).
"""

import cutlass
import cutlass.cute as cute

from generator.families.sdsa import PAGE_KEYS
from generator.kernels.common.entry import element_type
from generator.kernels.common.ptx import opaque_int32
from generator.kernels.common.radix_select import float_bits
from generator.kernels.portable.sdsa_scores import (
    KEYS_PER_CTA,
    WARP_KEYS,
    WARPS,
    SdsaScores,
    allocate_pages,
    cta_page,
    init_page_barrier,
    scale_pages_aligned,
)

TILE_ROWS = 128
MMA_ROWS = 8  # query rows a step: the MMA's columns
# Candidates a lane keeps a row (of its two) and group in registers: it scores 16 keys of a
# row a CTA, of which SD2's rows find ~0.6 (2,560 in 65,536 keys), more than 2 once in ~40
# (the rest take an atomic each). 2 rather than 4 lets the NVFP4 select run 6 CTAs an SM.
LANE_SLOTS = 2
assert TILE_ROWS == WARPS * 32  # a thread per row lists the live rows


class SdsaSelect(SdsaScores):
    def grid(self, args):
        """A CTA per 512 keys of each 128-row tile."""
        return [cute.ceil_div(args.max_context, KEYS_PER_CTA), args.mTileRequests.shape[0], 1]

    @cute.kernel
    def kernel(self, args, atom):
        self.select(args, atom, staged=False)

    @cute.kernel
    def kernel_staged(self, args, atom):
        """kernel() for NVFP4 keys with the CTA's pages staged in shared memory, as
        sdsa_scores stages them."""
        self.select(args, atom, staged=True)

    @cute.jit
    def select(self, args, atom, staged: cutlass.Constexpr):
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
        request = args.mTileRequests[tile]
        if cutlass.const_expr(staged):
            sCodes, sScales, sBarrier = allocate_pages(smem)
            scales_by_bulk = cutlass.Int32(scale_pages_aligned(args.mKeyScales))
            # Loaded beside the row ends, before the end of the keys is known.
            last_key = args.mBlockTable.shape[1] * PAGE_KEYS - 1
            page = cta_page(args, request, cta_first_key, last_key, tidx)
            if tidx == 0:
                init_page_barrier(sBarrier, scales_by_bulk)
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
        if cutlass.const_expr(staged):
            if (tidx < 32) & (cta_first_key < keys_end):
                self.stage_pages(
                    args, page, cta_first_key, keys_end, sCodes, sScales, sBarrier, lane,
                    scales_by_bulk,
                )  # fmt: skip
        warp_key = cta_first_key + (tidx // 32) * WARP_KEYS
        # A group of 8 live rows at a time, the warp's keys loaded again for each (a decode
        # tile has one group). Keys kept over the groups and queries reloaded per chunk held
        # 166 registers (3 CTAs an SM).
        for m in cutlass.range(cute.ceil_div(live, MMA_ROWS), unroll=1):
            if warp_key < keys_end:  # the same for the whole warp: its MMAs run converged
                group = self.row_group(args, sLive, first_row, live, m, g, q)
                # kept[r, i]: the lane's candidate i of its row r as (key, stored bits).
                kept = cute.make_rmem_tensor((2, LANE_SLOTS, 2), cutlass.Int32)
                counts = cute.make_rmem_tensor((2,), cutlass.Int32)
                counts.fill(0)

                def classify_chunk(keys, first_key, group=group, kept=kept, counts=counts):
                    self.classify_group(atom, args, keys, first_key, group, g, q, kept, counts)

                if cutlass.const_expr(staged):
                    # The chunks as a loop: unrolled, with nothing between them but register
                    # writes, their reads were scheduled ahead together and spilled (with 4
                    # slots a lane: 153 spill instructions under the cap of 80 registers, 71
                    # under 96).
                    self.for_each_staged_chunk(
                        sCodes, sScales, sBarrier, cta_first_key, warp_key, keys_end, g, q,
                        classify_chunk, unrolled=False,
                    )  # fmt: skip
                else:
                    # The key loads' inputs made opaque per group: else what is computed
                    # from them, the same for every group, is hoisted out of the loop and
                    # held across it (168 registers against 128).
                    request_m, warp_key_m, end_m, g_m, q_m = (
                        opaque_int32(v) for v in (request, warp_key, keys_end, g, q)
                    )
                    self.for_each_chunk(
                        args, request_m, warp_key_m, end_m, g_m, q_m, classify_chunk
                    )
                self.store_kept(args, group, kept, counts, lane)

    @cute.jit
    def store_kept(self, args, group, kept, counts, lane):
        """The lanes' kept candidates into their rows' slots: the 8 lanes of a row (lane % 4
        alike) sum their counts across the warp, the row's last lane takes the slots for all
        with one global atomic (the count includes those past the room, as add_candidate's
        do), and each lane stores its own while there is room."""
        _, row_of, _, _ = group
        cap = args.mCandidates.shape[1] - args.top_k
        row_last_lane = 28 + lane % 4
        for r in cutlass.range_constexpr(2):
            n = counts[r]
            upto = n  # this lane's count and those of the row's lanes below it
            for step in cutlass.range_constexpr(3):
                below = cute.arch.shuffle_sync_up(upto, offset=4 << step)
                if lane >= 4 << step:
                    upto = upto + below
            total = cute.arch.shuffle_sync(upto, row_last_lane)
            first = cutlass.Int32(0)
            if (lane >= 28) & (total > 0):
                first = count_pairs(args, row_of[r], 0, total)
            first = cute.arch.shuffle_sync(first, row_last_lane) + upto - n
            for i in cutlass.range_constexpr(LANE_SLOTS):
                if (i < n) & (first + i < cap):
                    slot = args.top_k + first + i
                    args.mCandidates[row_of[r], slot, 0] = kept[r, i, 0]
                    args.mCandidates[row_of[r], slot, 1] = kept[r, i, 1]

    @cute.jit
    def row_group(self, args, sLive, first_row, live, m, g, q):
        """Live rows 8m .. 8m + 7 as the MMA's columns: (the B values of column g, live row
        8m + column_row(g), or the last live row where there is none: its scores are never
        used; this lane's rows, live rows 8m + lane_row(q, r), -1: none; their thresholds;
        their ends)."""
        column = first_row + sLive[cutlass.min(m * MMA_ROWS + column_row(g), live - 1)]
        query = self.query_operand(args, column, q)
        row_of = cute.make_rmem_tensor((2,), cutlass.Int32)
        threshold = cute.make_rmem_tensor((2,), cutlass.Float32)
        end = cute.make_rmem_tensor((2,), cutlass.Int32)
        for r in cutlass.range_constexpr(2):
            row_of[r] = -1
            j = m * MMA_ROWS + lane_row(q, r)
            if j < live:
                row_of[r] = first_row + sLive[j]
                threshold[r] = args.mThresholds[row_of[r]]
                end[r] = cutlass.min(args.mRowEnds[row_of[r]], args.max_context)
        return query, row_of, threshold, end

    @cute.jit
    def classify_group(self, atom, args, keys, first_key, group, g, q, kept, counts):
        """Every score of the warp's 32 keys from first_key against a row_group, classified
        (keys below each row's end): candidates kept (the lane's first LANE_SLOTS of a row;
        later ones stored at once by add_candidate), ties counted and stored (add_tie)."""
        query, row_of, threshold, end = group
        # scores[r, s]: row r's score of key slot_key(first_key, s, g).
        scores = cute.make_rmem_tensor((2, 4), cutlass.Float32)
        for t in cutlass.range_constexpr(WARP_KEYS // 16):
            acc = self.tile_scores(atom, keys, t, query)
            for r in cutlass.range_constexpr(2):
                for h in cutlass.range_constexpr(2):
                    scores[r, 2 * t + h] = acc[2 * h + r, 0, 0] * self.score_factor
        for r in cutlass.range_constexpr(2):
            if row_of[r] >= 0:
                for s in cutlass.range_constexpr(4):
                    key = slot_key(first_key, s, g)
                    score = scores[r, s]
                    if (key < end[r]) & candidate_or_tie(score, threshold[r]):
                        if score > threshold[r]:
                            keep(args, row_of[r], key, score, threshold[r], kept, counts, r)
                        else:
                            add_tie(args, row_of[r], key, score, threshold[r])


def lane_row(q, r: int):
    """The group's row (of 8) in the accumulator column 2q + r, which lane q holds: rows
    0..3 in the even columns, so that with up to 4 live rows (decode) every lane's second
    column is empty and the warp skips classifying it."""
    return 4 * r + q


def column_row(c):
    """The group's row in MMA column c (the inverse of lane_row)."""
    return 4 * (c % 2) + c // 2


def slot_key(first_key, s: int, g):
    """The key of a lane's score slot s (of 4) in its warp's 32 keys from first_key: the
    MMA's rows g and g + 8 of each 16-key tile."""
    return first_key + 16 * (s // 2) + 8 * (s % 2) + g


@cute.jit
def keep(args, row, key, score, threshold, kept, counts, r: int):
    """Candidate (key, score) of the lane's row r (`row`) into its next kept slot, or, with
    none left, into the row's slots at once (add_candidate)."""
    n = counts[r]
    if n < LANE_SLOTS:
        bits = float_bits(stored_value(score, threshold))
        for i in cutlass.range_constexpr(LANE_SLOTS):
            if n == i:  # registers: no dynamic index
                kept[r, i, 0] = key
                kept[r, i, 1] = bits
        counts[r] = n + 1
    else:
        add_candidate(args, row, key, score, threshold)


@cute.jit
def classify(args, row, key, score, threshold, valid=True):
    """Count (and store, while there is room) the pair (key, score) of `row` as a
    candidate or a tie of `threshold`, if `valid`. A valid score below the threshold or
    an invalid one (nearly all) costs one test and branch: the rest is behind it."""
    if valid & candidate_or_tie(score, threshold):
        if score > threshold:
            add_candidate(args, row, key, score, threshold)
        else:
            add_tie(args, row, key, score, threshold)


@cute.jit
def add_candidate(args, row, key, score, threshold):
    """Count the pair (key, score) of `row` as a candidate (above `threshold`) and store it
    while there is room."""
    n = count_pairs(args, row, 0, cutlass.Int32(1))
    if n < args.mCandidates.shape[1] - args.top_k:
        store_pair(args, row, args.top_k + n, key, score, threshold)


@cute.jit
def candidate_or_tie(score, threshold):
    """Whether score is above threshold or ties it (equal, or NaN on either side): one
    FSETP.GEU (greater, equal or unordered)."""
    return (score >= threshold) | (score != score) | (threshold != threshold)


@cute.jit
def add_tie(args, row, key, score, threshold):
    """Count the pair (key, score) of `row` as a tie of `threshold` (equal, or NaN on
    either side) and store it while there is room."""
    n = count_pairs(args, row, 1, cutlass.Int32(1))
    if n < args.top_k:
        store_pair(args, row, args.top_k - 1 - n, key, score, threshold)


@cute.jit
def count_pairs(args, row, column, n):
    """Add n to `row`'s count of candidates (column 0) or of ties (column 1); returns the
    count before (the first of the slots they take)."""
    return cute.arch.atomic_add(
        args.mCounters.iterator + cute.crd2idx((row, column), args.mCounters.layout), n
    )


@cute.jit
def store_pair(args, row, slot, key, score, threshold):
    """Candidate slot `slot` of `row` := (key, the stored value's bits)."""
    args.mCandidates[row, slot, 0] = key
    args.mCandidates[row, slot, 1] = float_bits(stored_value(score, threshold))


@cute.jit
def stored_value(score, threshold):
    """What a candidate slot keeps of a score: score - threshold where score <= 2 threshold,
    else score."""
    stored = score
    if score <= 2.0 * threshold:
        stored = score - threshold
    return stored


# NVFP4: CTAs an SM the registers are capped for, by arch: as many as the staged pages' 37.4
# KB a CTA let shared memory hold (SM120's 100 KB: two, whose registers need no cap).
NVFP4_SELECT_CTAS_PER_SM = {"sm_90a": 6, "sm_100f": 6, "sm_120f": 2}


def make_kernel(variant):
    dtype = variant.params["dtype"]
    nvfp4 = dtype == "u8"
    # NVFP4: the CTA's pages staged in shared memory (as sdsa_scores stages them), the
    # registers capped for NVFP4_SELECT_CTAS_PER_SM (80 on SM90 / SM100, no spills). BF16
    # keys hold two chunks' 16-bit operands (2 CTAs an SM).
    if nvfp4:
        ctas = NVFP4_SELECT_CTAS_PER_SM[variant.arch]
        return SdsaSelect(element_type(dtype), nvfp4, ctas_per_sm=ctas, staged=True)
    return SdsaSelect(element_type(dtype), nvfp4)
