"""group_union_masks: the union of each token group's keys, and each token's bitmask over it.

One CTA per group of n = T / G consecutive tokens, in shared memory a bit per key of the
sequence (num_keys <= MAX_UNION_KEYS) and, per 32 keys, the union column of the first:

1. mark: every position p in [0, num_keys) of the group's tokens sets bit p (atomic OR;
   repeats are free), so the union is deduplicated and ordered by key with no sort;
2. scan: an exclusive prefix sum of the words' popcounts gives each word its first
   column; key p's column is then base[p / 32] + popc(bits below p in its word), and U,
   the union's size, is the total;
3. union: each set bit writes its key's cache slot to its column of the group's union row;
4. masks: each token's mask row is zeroed over the first ceil(U / 128) tiles of 128
   columns, then each of its positions ORs its column's bit into it (atomic OR in global
   memory, ordered after the zeroing by a CTA barrier).
Rows given as -1 are not written.
"""

import cutlass
import cutlass.cute as cute

from generator.families.token_sparse import MASK_TILE, MAX_UNION_KEYS, PAGE_KEYS
from generator.kernels.common.bitmap_union import add_member, popcount_scan, rank

NUM_THREADS = 256
WORDS = MAX_UNION_KEYS // 32


class GroupUnionMasks:
    @cute.jit
    def launch(self, args, stream):
        self.kernel(args).launch(
            grid=[args.mRequests.shape[0], 1, 1], block=[NUM_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, args):
        mPositions, num_keys = args.mPositions, args.num_keys
        tidx, _, _ = cute.arch.thread_idx()
        group, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sBits = smem.allocate_tensor(cutlass.Int32, cute.make_layout(WORDS), 16)
        sBase = smem.allocate_tensor(cutlass.Int32, cute.make_layout(WORDS), 16)
        sWarpSums = smem.allocate_tensor(cutlass.Int32, cute.make_layout(NUM_THREADS // 32), 16)
        keys_per_token = mPositions.shape[1]
        tokens = mPositions.shape[0] // args.mRequests.shape[0]
        first_token = group * tokens
        words = cute.ceil_div(num_keys, 32)

        for w in cutlass.range(tidx, words, NUM_THREADS, unroll=1):
            sBits[w] = 0
        cute.arch.sync_threads()
        for token in cutlass.range(first_token, first_token + tokens, unroll=1):
            for k in cutlass.range(tidx, keys_per_token, NUM_THREADS, unroll=2):
                p = mPositions[token, k]
                if p >= 0 and p < num_keys:
                    add_member(sBits, p)
        cute.arch.sync_threads()

        union_size = popcount_scan(sBits, sBase, sWarpSums, words, tidx, NUM_THREADS)

        union_row = args.mGroupUnions[group]
        if union_row >= 0:
            request = args.mRequests[group]
            for w in cutlass.range(tidx, words, NUM_THREADS, unroll=1):
                bits = cutlass.Uint32(sBits[w])
                count = cutlass.Int32(cute.arch.popc(bits))
                column = sBase[w] + count
                # Highest bit first (bfind), each taking the next column down.
                for _ in cutlass.range(count, unroll=1):
                    b = cutlass.Int32(cute.arch.bfind(bits))
                    bits = bits ^ (cutlass.Uint32(1) << cutlass.Uint32(b))
                    column = column - 1
                    key = w * 32 + b
                    page = args.mBlockTable[request, key // PAGE_KEYS]
                    args.mUnion[union_row, column] = page * PAGE_KEYS + key % PAGE_KEYS
            if tidx == 0:
                args.mUnionSizes[union_row] = union_size

        mMask = args.mMask
        mask_words = cute.ceil_div(union_size, MASK_TILE) * (MASK_TILE // 32)
        for token in cutlass.range(first_token, first_token + tokens, unroll=1):
            row = args.mQueryRows[token]
            if row >= 0:
                for w in cutlass.range(tidx, mask_words, NUM_THREADS, unroll=1):
                    mMask[row, w] = 0
        cute.arch.sync_threads()
        for token in cutlass.range(first_token, first_token + tokens, unroll=1):
            row = args.mQueryRows[token]
            if row >= 0:
                for k in cutlass.range(tidx, keys_per_token, NUM_THREADS, unroll=2):
                    p = mPositions[token, k]
                    if p >= 0 and p < num_keys:
                        self.set_mask_bit(mMask, row, p, sBits, sBase)

    @cute.jit
    def set_mask_bit(self, mMask, row, p, sBits, sBase):
        """OR the bit of key p's union column into mask row `row`."""
        column = rank(sBits, sBase, p)
        word = mMask.iterator + cute.crd2idx((row, column // 32), mMask.layout)
        cute.arch.atomic_or(word, cutlass.Int32(1) << (column % 32))


def make_kernel(variant):
    return GroupUnionMasks()
