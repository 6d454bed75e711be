"""Planner kernel: the units' launch order, longest tile list first (planner.longest_first),
and the recheck of the block-size tensors plan() read on the host.

One CTA over the whole problem. Work items are the CTAs of the attention kernel: item i =
(item head ih, column c) with count = tile_cnt[ih // items_per_head, c * rows_per_item],
writing units_per_item unit ids (planner.longest_first has the two ways a CTA's units are
chosen). A stable counting sort on descending count:
1. histogram of the counts in shared memory (one atomic per distinct count of a warp:
   match.any groups the lanes holding the same count);
2. an exclusive scan of the histogram taken from the longest count down: each count's first
   position;
3. the items in ascending order, 32 warps of a 1024-item chunk taking turns (a CTA barrier
   each), each lane at its count's next position plus its rank among the lanes of its warp
   with the same count: ties keep ascending item order.
The size check: every element of each size tensor is compared with the value plan() read;
mErrors[0] is `stale_bit` if any differs, else 0 (written either way). Counts must be below
MAX_COUNT (the runtime orders longer lists in torch).
"""

import cutlass
import cutlass.cute as cute

from generator.families.unit_order import MAX_COUNT
from generator.kernels.common.block_scan import exclusive_scan

THREADS = 1024
FULL_MASK = 0xFFFFFFFF


class UnitOrder:
    @cute.jit
    def launch(self, args, stream):
        self.kernel(args).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, args):
        mTileCnt, mWork = args.mTileCnt, args.mWork
        tidx, _, _ = cute.arch.thread_idx()
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        smem = cutlass.memory.SmemAllocator()
        sStart = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_COUNT), 16)
        sWarpSums = smem.allocate_tensor(cutlass.Int32, cute.make_layout(THREADS // 32), 16)
        sStale = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), 4)

        units = mTileCnt.shape[1]
        per_head, per_item, step = args.items_per_head, args.units_per_item, args.rows_per_item
        width = cute.ceil_div(units, step)
        items = mTileCnt.shape[0] * per_head * width
        below = (cutlass.Int32(1) << lane) - 1

        for b in cutlass.range(tidx, MAX_COUNT, THREADS, unroll=1):
            sStart[b] = 0
        if tidx == 0:
            sStale[0] = 0
        cute.arch.sync_threads()

        # 1. Histogram, keyed by MAX_COUNT - 1 - count so that the scan runs longest first;
        # lanes past the items hold key -1.
        for base in cutlass.range(0, items, THREADS, unroll=1):
            key = self.key(mTileCnt, base + tidx, items, per_head, width, step)
            peers = cutlass.Int32(cute.arch.match_sync(FULL_MASK, key))
            if key >= 0 and (peers & below) == 0:
                cute.arch.atomic_add(sStart.iterator + key, cutlass.Int32(cute.arch.popc(peers)))
        self.check_sizes(args.mRowSizes, args.mRowRead, sStale, tidx)
        self.check_sizes(args.mColSizes, args.mColRead, sStale, tidx)
        cute.arch.sync_threads()

        # 2. Each count's first position.
        exclusive_scan(lambda b: sStart[b], sStart, sWarpSums, MAX_COUNT, tidx, THREADS)

        # 3. Positions, warp by warp.
        for base in cutlass.range(0, items, THREADS, unroll=1):
            i = base + tidx
            key = self.key(mTileCnt, i, items, per_head, width, step)
            peers = cutlass.Int32(cute.arch.match_sync(FULL_MASK, key))
            rank = cutlass.Int32(cute.arch.popc(peers & below))
            for turn in cutlass.range(THREADS // 32, unroll=1):
                if turn == warp and key >= 0:
                    at = sStart[key] + rank
                    cute.arch.sync_warp(peers)
                    if rank == cute.arch.popc(peers) - 1:  # the last of its peers moves on
                        sStart[key] = at + 1
                    self.write_units(mWork, i, at, units, per_head, per_item, width, step)
                cute.arch.sync_threads()

        if tidx == 0:
            stale = cutlass.Int32(0)
            if sStale[0] != 0:
                stale = args.stale_bit
            args.mErrors[0] = stale

    @cute.jit
    def key(self, mTileCnt, i, items, per_head, width, step):
        """MAX_COUNT - 1 - item i's count, or -1 past the items."""
        key = cutlass.Int32(-1)
        if i < items:
            item_head = i // width
            column = i - item_head * width
            key = MAX_COUNT - 1 - mTileCnt[item_head // per_head, column * step]
        return key

    @cute.jit
    def write_units(self, mWork, i, at, units, per_head, per_item, width, step):
        """Item i's unit ids h * units + r at positions at * per_item ..: per_item query heads
        of one row (step 1), or per_item consecutive rows of one head, the last row repeated
        past the head's end."""
        item_head = i // width
        column = i - item_head * width
        for e in cutlass.range(per_item, unroll=1):
            head, row = item_head * per_item + e, column
            if step > 1:
                head, row = item_head, cutlass.min(column * step + e, units - 1)
            mWork[at * per_item + e] = head * units + row

    @cute.jit
    def check_sizes(self, mSizes, mRead, sStale, tidx):
        blocks = mSizes.shape[1]
        for e in cutlass.range(tidx, mSizes.shape[0] * blocks, THREADS, unroll=1):
            head = e // blocks
            block = e - head * blocks
            if cutlass.Int64(mSizes[head, block]) != mRead[head, block]:
                sStale[0] = 1


def make_kernel(variant):
    return UnitOrder()
