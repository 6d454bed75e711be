"""msa_icp_select: a rank's top-16 blocks of each (token, head) row of its scores, written as a
carrier row (generator/families/msa_icp.py has the row format and where rows go).

A CTA per row (up to CTAS of them, each then walking rows at that stride). The row's columns
go to shared memory as ranking bits: the score's float bits (-0 as +0), 0x7FFFFFFF (above
every float in radix_select's order) for a forced candidate, and -inf's bits for a column that
is no candidate (NaN, -inf, a block at or past min(nvp, 8192)), counted as it goes. With more
than 16 candidates a radix select finds the 16th largest ranking value and how many of its
ties are taken; the ties taken are the first ones in column order (the lower ids: a column's
id grows with it). Each thread then owns a run of consecutive columns: two prefix sums over
the threads' counts give every tie its place among the ties and every selected column its
slot, so the ids come out ascending without a sort. The score words are re-read from global
memory (the raw bits, a forced block's included).

Publishing (legacy rows), one thread first waits until the owner has cleared the row's flag
(its last merge of this slot set is done); after the row's words, a barrier and a release
store set the flag. Tagged rows have no flag: each word carries the row's generation, one
more than the last (mGenerations).
"""

import cutlass
import cutlass.cute as cute

from generator.families.msa_icp import (
    CARRIER_WORDS,
    LOCAL,
    MAX_BLOCKS,
    MAX_COLUMNS,
    PUBLISH,
    PUBLISH_TAGGED,
    TAGGED_WORDS,
    TOPK,
)
from generator.kernels.common.block_scan import exclusive_scan
from generator.kernels.common.radix_select import (
    float_bits,
    histogram_words,
    order_key,
    radix_select,
)
from generator.kernels.common.signals import (
    store_b32,
    store_relaxed_b64,
    store_release_b32,
    wait_for_flag,
)

THREADS = 256
CTAS = 1021  # a prime: rows at a fixed period spread over the CTAs (as in sdsa_topk)
NOT_CANDIDATE = -8388608  # -inf's bits as an Int32 (0xFF800000)
FORCED = 0x7FFFFFFF  # a positive NaN's bits: above +inf in the order radix_select ranks by


class MsaIcpSelect:
    @cute.jit
    def launch(self, args, stream):
        tokens, heads, _ = args.mScore.shape
        self.kernel(args).launch(
            grid=[cutlass.min(tokens * heads, CTAS), 1, 1],
            block=[THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, args):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        tokens, heads, _ = args.mScore.shape
        smem = cutlass.memory.SmemAllocator()
        sBits = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_COLUMNS), 16)
        sHist = smem.allocate_tensor(cutlass.Int32, cute.make_layout(histogram_words(1)), 16)
        sState = smem.allocate_tensor(cutlass.Int32, cute.make_layout(2), 16)
        # [0]: candidates counted, [1]: the row's generation (tagged)
        sRow = smem.allocate_tensor(cutlass.Int32, cute.make_layout(2), 16)
        sCounts = smem.allocate_tensor(cutlass.Int32, cute.make_layout(THREADS), 16)
        sBefore = smem.allocate_tensor(cutlass.Int32, cute.make_layout(THREADS), 16)
        sWarpSums = smem.allocate_tensor(cutlass.Int32, cute.make_layout(32), 16)
        for row in cutlass.range(bidx, tokens * heads, grid, unroll=1):
            self.select_row(
                args, row // heads, row % heads, tidx, sBits, sHist, sState, sRow, sCounts,
                sBefore, sWarpSums,
            )  # fmt: skip

    @cute.jit
    def row_address(self, args, token, head):
        """The byte address of row (token, head) (generator/families/msa_icp.py)."""
        row_bytes = cutlass.Int64(CARRIER_WORDS * 4)
        if args.mode == PUBLISH_TAGGED:
            row_bytes = cutlass.Int64(TAGGED_WORDS * 8)
        owner = head // args.heads_per_owner
        index = cutlass.Int64(args.row_offset) + cutlass.Int64(
            (head % args.heads_per_owner) * args.head_rows + token
        )
        address = args.mBases[owner] + index * row_bytes
        if args.mode == LOCAL:
            address = args.mCarrier[head, token, None].iterator.toint()
        return address

    @cute.jit
    def select_row(
        self, args, token, head, tidx, sBits, sHist, sState, sRow, sCounts, sBefore, sWarpSums
    ):
        """Row (token, head): rank, then write (every thread)."""
        columns = args.mScore.shape[2]
        nvp = args.mNumValid[token]
        limit = cutlass.min(cutlass.max(nvp, 0), MAX_BLOCKS)
        end_start = nvp - args.force_end
        address = self.row_address(args, token, head)
        errors = args.mErrors.iterator.toint()
        if tidx == 0:
            sRow[0] = 0
            if args.mode == PUBLISH:
                # The owner's merge of this slot set's last use has read the row.
                wait_for_flag(address + 4 * 2 * TOPK, cutlass.Int32(0), args.spin_limit, errors)
            if args.mode == PUBLISH_TAGGED:
                generation = args.mGenerations[head, token] + 1
                args.mGenerations[head, token] = generation
                sRow[1] = generation
        cute.arch.sync_threads()
        scores = args.mScore[token, head, None]
        candidates = cutlass.Int32(0)
        for c in cutlass.range(tidx, columns, THREADS, unroll=1):
            block = c * args.index_scale + args.index_offset
            score = scores[c]
            bits = float_bits(score + cutlass.Float32(0.0))  # -0 ranks as +0
            forced = (block < args.force_begin) | ((block >= end_start) & (block < nvp))
            if forced:
                bits = cutlass.Int32(FORCED)
            # NaN fails the comparison: no candidate.
            candidate = (block >= 0) & (block < limit) & (score > -cutlass.Float32.inf)
            if candidate:
                candidates = candidates + 1
            else:
                bits = cutlass.Int32(NOT_CANDIDATE)
            sBits[c] = bits
        cute.arch.atomic_add(sRow.iterator, candidates)
        cute.arch.sync_threads()
        total = sRow[0]
        # The 16th largest ranking key and how many of its ties are taken; with 16 or fewer
        # candidates every one is taken (every candidate's key is above -inf's).
        threshold = order_key(cutlass.Int32(NOT_CANDIDATE))
        ties = cutlass.Int32(0)
        if total > TOPK:
            threshold, ties = radix_select(
                lambda i, step: [(sBits[i] != NOT_CANDIDATE, sBits[i])],
                columns,
                TOPK,
                sHist,
                sState,
                tidx,
                THREADS,
            )
        # A run of consecutive columns a thread: its ties first, then its selected columns.
        per_thread = cute.ceil_div(columns, THREADS)
        begin = cutlass.min(tidx * per_thread, columns)
        end = cutlass.min(begin + per_thread, columns)
        own_ties = cutlass.Int32(0)
        for c in cutlass.range(begin, end, unroll=1):
            if order_key(sBits[c]) == threshold:
                own_ties = own_ties + 1
        sCounts[tidx] = own_ties
        cute.arch.sync_threads()
        exclusive_scan(lambda i: sCounts[i], sBefore, sWarpSums, THREADS, tidx, THREADS)
        ties_first = sBefore[tidx]  # the ties in the columns before the run
        ties_before = ties_first
        taken = cutlass.Int32(0)
        for c in cutlass.range(begin, end, unroll=1):
            key = order_key(sBits[c])
            if key > threshold:
                taken = taken + 1
            elif key == threshold:
                if ties_before < ties:
                    taken = taken + 1
                ties_before = ties_before + 1
        cute.arch.sync_threads()  # sCounts and sBefore are read; write them again
        sCounts[tidx] = taken
        cute.arch.sync_threads()
        selected = exclusive_scan(lambda i: sCounts[i], sBefore, sWarpSums, THREADS, tidx, THREADS)
        slot = sBefore[tidx]
        generation = cutlass.Int64(sRow[1]) << cutlass.Int64(32)
        ties_before = ties_first
        for c in cutlass.range(begin, end, unroll=1):
            key = order_key(sBits[c])
            take = key > threshold
            if key == threshold:
                take = ties_before < ties
                ties_before = ties_before + 1
            if take:
                block = c * args.index_scale + args.index_offset
                self.write_entry(args, address, slot, float_bits(scores[c]), block, generation)
                slot = slot + 1
        if (tidx >= selected) & (tidx < TOPK):
            self.write_entry(args, address, tidx, cutlass.Int32(NOT_CANDIDATE), -1, generation)
        cute.arch.sync_threads()
        if tidx == 0:
            if args.mode == LOCAL:
                store_b32(address + 4 * 2 * TOPK, cutlass.Int32(1))
            if args.mode == PUBLISH:
                store_release_b32(address + 4 * 2 * TOPK, cutlass.Int32(1))

    @cute.jit
    def write_entry(self, args, address, slot, score_bits, block, generation):
        """Slot `slot` of the row: its score word and its id."""
        if args.mode == PUBLISH_TAGGED:
            low = cutlass.Int64(0xFFFFFFFF)
            store_relaxed_b64(address + 8 * slot, generation | (cutlass.Int64(score_bits) & low))
            store_relaxed_b64(
                address + 8 * (TOPK + slot), generation | (cutlass.Int64(block) & low)
            )
        else:
            store_b32(address + 4 * slot, score_bits)
            store_b32(address + 4 * (TOPK + slot), cutlass.Int32(block))


def make_kernel(variant):
    return MsaIcpSelect()
