"""Planner kernel: compact each row of a tile mask into its list of tile ids.

One warp per row (kv head, 64-row unit), 32 tiles per step: each lane reads one flag, a
ballot gives the warp the step's flags, and a lane's rank among the listed lanes before it
(popc of the ballot below its lane) is where it writes its tile id. The row's count is the
sum of the ballots' popcounts. Replaces a prefix sum plus a search over every (kv head, unit,
tile) in torch (see CONTRIBUTING.md, plan() timings).
"""

import cutlass
import cutlass.cute as cute

from generator.kernels.common.warp_rows import launch_warp_rows, warp_row


class TileCompact:
    @cute.jit
    def launch(self, args, stream):
        launch_warp_rows(self.kernel(args), args.mListed.shape[0] * args.mListed.shape[1], stream)

    @cute.kernel
    def kernel(self, args):
        mListed, mTileIdx, mTileCnt = args.mListed, args.mTileIdx, args.mTileCnt
        row, lane, _ = warp_row()
        units, tiles = mListed.shape[1], mListed.shape[2]
        if row < mListed.shape[0] * units:
            head = row // units
            unit = row - head * units
            below = (cutlass.Int32(1) << lane) - 1  # lanes before this one
            count = cutlass.Int32(0)
            for step in cutlass.range(cute.ceil_div(tiles, 32), unroll=1):
                tile = step * 32 + lane
                listed = cutlass.Boolean(False)
                if tile < tiles:
                    listed = mListed[head, unit, tile] != 0
                ballot = cute.arch.vote_ballot_sync(listed)
                if listed:
                    mTileIdx[head, unit, count + cute.arch.popc(ballot & below)] = tile
                count = count + cute.arch.popc(ballot)
            if lane == 0:
                mTileCnt[head, unit] = count


def make_kernel(variant):
    return TileCompact()
