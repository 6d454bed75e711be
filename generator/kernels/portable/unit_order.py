"""Planner kernel: the units' launch order, longest tile list first (planner.longest_first),
and the recheck of the block-size tensors plan() read on the host.

One CTA over the whole problem. Work items are the CTAs of the attention kernel: item i =
(item head ih, column c) with count = tile_cnt[ih // items_per_head, c * rows_per_item],
writing units_per_item unit ids (planner.longest_first has the two ways a CTA's units are
chosen). A stable counting sort on descending count, keyed by MAX_COUNT - 1 - count:
1. a histogram of the keys in shared memory (one atomic a warp where its lanes hold one
   key, as they mostly do; else one a lane);
2. exclusive scans of the histogram: each key's first position, and each present key's
   dense id d < D (D: the distinct keys);
3. the items split into S = min(32, TABLE // D) consecutive segments: a (D, S) table of
   each key's items in each segment (every thread, as in 1), then each present key's row
   turned into the position of its first item in each segment (the key's first position
   plus its items in the segments before);
4. warp s walks segment s in order, a lane at its key's next position in the segment plus
   its rank among the lanes of its step with the same key (a vote, or match.any where the
   lanes' keys differ): ties keep item order, with no barrier between steps (the segments
   are independent).
Every pass loads LOADS keys a thread before it uses the first: the loads' latency, not the
work, is what a pass over W1's 16384 units costs.
The size check: every element of each size tensor is compared with the value plan() read;
mErrors[0] is `stale_bit` if any differs, else 0 (written either way). Counts must be below
MAX_COUNT (the runtime orders longer lists in torch).
"""

import cutlass
import cutlass.cute as cute

from generator.families.unit_order import MAX_COUNT
from generator.kernels.common.block_scan import exclusive_scan

THREADS = 1024
WARPS = THREADS // 32
TABLE = 3 * MAX_COUNT  # entries of the (D, S) table of per-segment positions: S >= 3
LOADS = 4  # keys a thread loads before using the first
FULL_MASK = 0xFFFFFFFF
# sStart, sDense, sTable, sWarpSums and sStale (16-byte aligned): past the 48 KB default,
# within SM120's 99 KB
SMEM_BYTES = 4 * (2 * MAX_COUNT + TABLE + WARPS) + 16


class UnitOrder:
    @cute.jit
    def launch(self, args, stream):
        self.kernel(args).launch(
            grid=[1, 1, 1], block=[THREADS, 1, 1], smem=SMEM_BYTES, stream=stream
        )

    @cute.kernel
    def kernel(self, args):
        mTileCnt = args.mTileCnt
        tidx, _, _ = cute.arch.thread_idx()
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        smem = cutlass.memory.SmemAllocator()
        sStart = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_COUNT), 16)
        sDense = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_COUNT), 16)
        sTable = smem.allocate_tensor(cutlass.Int32, cute.make_layout(TABLE), 16)
        sWarpSums = smem.allocate_tensor(cutlass.Int32, cute.make_layout(WARPS), 16)
        sStale = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), 4)

        units = mTileCnt.shape[1]
        per_head, step = args.items_per_head, args.rows_per_item
        width = cute.ceil_div(units, step)
        items = mTileCnt.shape[0] * per_head * width
        below = (cutlass.Int32(1) << lane) - 1
        shape = (items, per_head, width, step)

        for b in cutlass.range(tidx, MAX_COUNT, THREADS, unroll=1):
            sStart[b] = 0
        if tidx == 0:
            sStale[0] = 0
        cute.arch.sync_threads()

        # 1. Histogram (lanes past the items hold key -1).
        for base in cutlass.range(0, items, THREADS * LOADS, unroll=1):
            keys = self.keys(mTileCnt, base + tidx, THREADS, items, shape)
            for k in cutlass.range_constexpr(LOADS):
                self.add_to(sStart, keys[k], lane)
        self.check_sizes(args.mRowSizes, args.mRowRead, sStale, tidx)
        self.check_sizes(args.mColSizes, args.mColRead, sStale, tidx)
        cute.arch.sync_threads()

        # 2. Dense ids of the present keys, then each key's first position.
        distinct = exclusive_scan(
            lambda k: cutlass.Int32(sStart[k] > 0), sDense, sWarpSums, MAX_COUNT, tidx, THREADS
        )
        exclusive_scan(lambda k: sStart[k], sStart, sWarpSums, MAX_COUNT, tidx, THREADS)

        # 3. Per-segment counts (every thread, item by item), then per-segment positions.
        segments = cutlass.min(TABLE // cutlass.max(distinct, 1), WARPS)
        length = cute.ceil_div(items, segments)
        for e in cutlass.range(tidx, distinct * segments, THREADS, unroll=1):
            sTable[e] = 0
        cute.arch.sync_threads()
        for base in cutlass.range(0, items, THREADS * LOADS, unroll=1):
            keys = self.keys(mTileCnt, base + tidx, THREADS, items, shape)
            for k in cutlass.range_constexpr(LOADS):
                entry = cutlass.Int32(-1)
                if keys[k] >= 0:
                    entry = sDense[keys[k]] * segments + (base + tidx + k * THREADS) // length
                self.add_to(sTable, entry, lane)
        cute.arch.sync_threads()
        for key in cutlass.range(tidx, MAX_COUNT, THREADS, unroll=1):
            dense = sDense[key]
            next_dense = distinct
            if key + 1 < MAX_COUNT:
                next_dense = sDense[key + 1]
            if next_dense > dense:  # the key is present
                position = sStart[key]
                for segment in cutlass.range(segments, unroll=1):
                    count = sTable[dense * segments + segment]
                    sTable[dense * segments + segment] = position
                    position = position + count
        cute.arch.sync_threads()

        # 4. Positions, each warp through its segment, LOADS steps of keys loaded at once.
        if warp < segments:
            first = warp * length
            last = cutlass.min(first + length, items)
            for base in cutlass.range(first, last, 32 * LOADS, unroll=1):
                keys = self.keys(mTileCnt, base + lane, 32, last, shape)
                for k in cutlass.range_constexpr(LOADS):
                    key = keys[k]
                    peers = self.peers(key)
                    rank = cutlass.Int32(cute.arch.popc(peers & below))
                    entry = cutlass.Int32(0)
                    at = cutlass.Int32(0)
                    if key >= 0:
                        entry = sDense[key] * segments + warp
                        at = sTable[entry] + rank
                    cute.arch.sync_warp()  # all peers have read before the last one writes
                    if key >= 0:
                        if rank == cute.arch.popc(peers) - 1:
                            sTable[entry] = at + 1
                        self.write_units(
                            args.mWork, base + lane + k * 32, at, units, args.units_per_item, shape
                        )
                    cute.arch.sync_warp()

        if tidx == 0:
            stale = cutlass.Int32(0)
            if sStale[0] != 0:
                stale = args.stale_bit
            args.mErrors[0] = stale

    @cute.jit
    def keys(self, mTileCnt, i, stride, end, shape):
        """The keys of items i, i + stride, .. (LOADS of them; -1 from `end` on), loaded
        before any is used: the loads overlap."""
        items, per_head, width, step = shape
        keys = []
        for k in cutlass.range_constexpr(LOADS):
            item = i + k * stride
            key = cutlass.Int32(-1)
            if item < end:
                item_head = item // width
                column = item - item_head * width
                key = MAX_COUNT - 1 - mTileCnt[item_head // per_head, column * step]
            keys.append(key)
        return keys

    @cute.jit
    def warp_uniform(self, value):
        """True in every lane when all the warp's lanes hold lane 0's value."""
        return cute.arch.vote_all_sync(value == cute.arch.shuffle_sync(value, 0))

    @cute.jit
    def peers(self, key):
        """The lanes holding this lane's key. match.any is slow, and the warps of a plan
        mostly hold one count: a vote answers those."""
        peers = cutlass.Int32(-1)  # every lane
        if not self.warp_uniform(key):
            peers = cutlass.Int32(cute.arch.match_sync(FULL_MASK, key))
        return peers

    @cute.jit
    def add_to(self, sCounts, entry, lane):
        """sCounts[entry] += 1 for each lane with entry >= 0: one atomic where the warp holds
        one entry, else one a lane (few collide when entries differ)."""
        if self.warp_uniform(entry):
            if lane == 0 and entry >= 0:
                cute.arch.atomic_add(sCounts.iterator + entry, cutlass.Int32(32))
        elif entry >= 0:
            cute.arch.atomic_add(sCounts.iterator + entry, cutlass.Int32(1))

    @cute.jit
    def write_units(self, mWork, i, at, units, per_item, shape):
        """Item i's unit ids h * units + r at positions at * per_item ..: per_item query heads
        of one row (step 1), or per_item consecutive rows of one head, the last row repeated
        past the head's end."""
        _, _, width, step = shape
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
