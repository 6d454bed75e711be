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

Where and how the row is written (a local carrier, or published into the owner's legacy or
tagged receive rows): generator/kernels/common/icp_rows.py.
"""

import cutlass
import cutlass.cute as cute

from generator.families.msa_icp import MAX_BLOCKS, MAX_COLUMNS, TOPK
from generator.kernels.common.block_scan import exclusive_scan
from generator.kernels.common.icp_lists import NOT_CANDIDATE
from generator.kernels.common.icp_rows import claim_row, row_address, set_ready, write_entry
from generator.kernels.common.radix_select import (
    float_bits,
    histogram_words,
    order_key,
    radix_select,
)

THREADS = 256
CTAS = 1021  # a prime: rows at a fixed period spread over the CTAs (as in sdsa_topk)
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
    def select_row(
        self, args, token, head, tidx, sBits, sHist, sState, sRow, sCounts, sBefore, sWarpSums
    ):
        """Row (token, head): rank, then write (every thread)."""
        columns = args.mScore.shape[2]
        nvp = args.mNumValid[token]
        limit = cutlass.min(cutlass.max(nvp, 0), MAX_BLOCKS)
        end_start = nvp - args.force_end
        address = row_address(args, token, head)
        if tidx == 0:
            sRow[0] = 0
            sRow[1] = claim_row(args, address, token, head, args.mErrors.iterator.toint())
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
        generation = sRow[1]
        ties_before = ties_first
        for c in cutlass.range(begin, end, unroll=1):
            key = order_key(sBits[c])
            take = key > threshold
            if key == threshold:
                take = ties_before < ties
                ties_before = ties_before + 1
            if take:
                block = c * args.index_scale + args.index_offset
                write_entry(args, address, slot, float_bits(scores[c]), block, generation)
                slot = slot + 1
        if (tidx >= selected) & (tidx < TOPK):
            write_entry(args, address, tidx, cutlass.Int32(NOT_CANDIDATE), -1, generation)
        cute.arch.sync_threads()
        if tidx == 0:
            set_ready(args, address)


def make_kernel(variant):
    return MsaIcpSelect()
