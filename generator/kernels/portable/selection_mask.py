"""Planner kernel: each row of direct selections (a row block of a head: topk column-block
ids, the first q2k_num of them used) as a row of the block mask, and the error bits of the
selections (sparsity.selection_block_mask's, bit for bit).

A warp per row, 4 a CTA. The row's columns are bits of a shared-memory bitmap: the lanes
take the used entries 32 at a time and set their bits with an atomic OR, whose old value
says whether the column was selected before (a duplicate); an entry outside [0, NB) sets
nothing and flags the range. Then the lanes write the row's NB mask bytes from the bitmap,
and lane 0 ORs the row's error bits into mErrors.
"""

import cutlass
import cutlass.cute as cute

from generator.families.selection_mask import MAX_COLUMNS
from generator.kernels.common.warp_rows import WARPS_PER_CTA, launch_warp_rows, warp_row

WORDS = MAX_COLUMNS // 32  # of a warp's bitmap


class SelectionMask:
    @cute.jit
    def launch(self, args, stream):
        rows = args.mIndices.shape[0] * args.mIndices.shape[1]
        launch_warp_rows(self.kernel(args), rows, stream)

    @cute.kernel
    def kernel(self, args):
        mIndices, mMask = args.mIndices, args.mMask
        row, lane, warp = warp_row()
        smem = cutlass.memory.SmemAllocator()
        sBits = smem.allocate_tensor(cutlass.Int32, cute.make_layout((WORDS, WARPS_PER_CTA)), 16)
        row_blocks, topk = mIndices.shape[1], mIndices.shape[2]
        columns = mMask.shape[2]
        if row < mIndices.shape[0] * row_blocks:
            head = row // row_blocks
            block = row - head * row_blocks
            for w in cutlass.range(lane, cute.ceil_div(columns, 32), 32, unroll=1):
                sBits[w, warp] = 0
            cute.arch.sync_warp()

            used = topk
            errors = cutlass.Int32(0)
            if args.has_counts != 0:
                used = args.mCounts[head, block]
                if used < 0 or used > topk:
                    errors = args.err_count
            for j in cutlass.range(lane, topk, 32, unroll=1):
                if j < used:
                    column = mIndices[head, block, j]
                    if column < 0 or column >= columns:
                        errors = errors | args.err_range
                    else:
                        bit = cutlass.Int32(1) << (column % 32)
                        word = sBits.iterator + (column // 32) + warp * WORDS
                        before = cute.arch.atomic_or(word, bit)
                        if (before & bit) != 0:
                            errors = errors | args.err_duplicate
            cute.arch.sync_warp()

            for c in cutlass.range(lane, columns, 32, unroll=1):
                mMask[head, block, c] = cutlass.Uint8((sBits[c // 32, warp] >> (c % 32)) & 1)
            # Lane 0's flags are the row's: a warp-wide OR of every lane's.
            for shift in cutlass.range_constexpr(5):
                errors = errors | cute.arch.shuffle_sync_bfly(errors, 1 << shift)
            if lane == 0 and errors != 0:
                cute.arch.atomic_or(args.mErrors.iterator, errors)


def make_kernel(variant):
    return SelectionMask()
