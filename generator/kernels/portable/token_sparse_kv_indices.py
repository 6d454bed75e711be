"""token_sparse_kv_indices: each token's key positions as paged-cache slot lists.

One warp per token. Lane l takes positions l, l + 32, ... of the token's row (coalesced
reads and writes); a position p >= 0 becomes the slot
block_table[request, p / PAGE_KEYS] * PAGE_KEYS + p % PAGE_KEYS, a negative one -1, and the
slot is written to both planes (K, V) of each of the token's requests_per_token rows. A
ballot per 32 positions counts the valid ones for seq_lens. Memory-bound: the writes
(2 rpt K words per token) dominate.
"""

import cutlass
import cutlass.cute as cute

from generator.families.token_sparse import PAGE_KEYS

WARPS_PER_CTA = 4


class TokenSparseKvIndices:
    @cute.jit
    def launch(self, args, stream):
        self.kernel(args).launch(
            grid=[cute.ceil_div(args.mPositions.shape[0], WARPS_PER_CTA), 1, 1],
            block=[32 * WARPS_PER_CTA, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, args):
        mPositions, mBlockTable, mBlockTables = args.mPositions, args.mBlockTable, args.mBlockTables
        rows_per_token = args.requests_per_token
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        token = bidx * WARPS_PER_CTA + tidx // 32
        if token < mPositions.shape[0]:
            request = args.mRequests[token]
            first_row = token * rows_per_token
            count = cutlass.Int32(0)
            for step in cutlass.range(mPositions.shape[1] // 32, unroll=4):
                k = step * 32 + lane
                position = mPositions[token, k]
                valid = position >= 0
                slot = cutlass.Int32(-1)
                if valid:
                    page = mBlockTable[request, position // PAGE_KEYS]
                    slot = page * PAGE_KEYS + position % PAGE_KEYS
                count = count + cute.arch.popc(cute.arch.vote_ballot_sync(valid))
                for j in cutlass.range(rows_per_token, unroll=1):
                    mBlockTables[first_row + j, 0, k] = slot
                    mBlockTables[first_row + j, 1, k] = slot
            if lane == 0:
                for j in cutlass.range(rows_per_token, unroll=1):
                    args.mSeqLens[first_row + j] = count


def make_kernel(variant):
    return TokenSparseKvIndices()
