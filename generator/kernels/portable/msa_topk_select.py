"""msa_topk_select: per (token, query head), 16 block ids from the proxy scores.

One thread per (token, head); the threads of a CTA take consecutive tokens of one head, so
each step over the blocks reads one coalesced row of mScore (Hq, P, S). Memory-bound: each
thread loads BATCH blocks' scores before inserting any, to keep that many loads in flight.
A thread keeps the 16 best middle blocks in registers, sorted by (score descending, id
ascending): a candidate that beats the last one is carried down the list by
compare-exchange (unrolled, so the list stays in registers). Only the first 16 - fb - fe
are kept; blocks are visited in ascending order, so ties go to the lower id. The kept ids
then pass an odd-even sorting network and the row is written as forced-begin ids, kept ids,
forced-end ids, then -1; any block whose score is not above -inf (-inf, NaN) is written as
nothing, leaving its slot to the -1 tail.
"""

import cutlass
import cutlass.cute as cute

from generator.families.msa_topk_select import TOPK

THREADS = 128
BATCH = 8  # scores loaded per thread before any is inserted
NONE = 0x7FFFFFFF  # sorts after every id


class MsaTopkSelect:
    @cute.jit
    def launch(self, args, stream):
        heads, _, tokens = args.mScore.shape
        self.kernel(args).launch(
            grid=[cute.ceil_div(tokens, THREADS), heads, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, args):
        mScore, mOut = args.mScore, args.mOut
        tidx, _, _ = cute.arch.thread_idx()
        bidx, head, _ = cute.arch.block_idx()
        token = bidx * THREADS + tidx
        blocks = mScore.shape[1]
        if token < mScore.shape[2]:
            valid = cutlass.min(cutlass.max(args.mNumValid[token], 0), blocks)
            begin_end = cutlass.min(args.force_begin, valid)  # forced: [0, begin_end)
            end_start = cutlass.max(valid - args.force_end, begin_end)  # forced: [end_start, valid)
            keep = TOPK - args.force_begin - args.force_end
            best = cute.make_rmem_tensor((TOPK,), cutlass.Float32)
            ids = cute.make_rmem_tensor((TOPK,), cutlass.Int32)
            best.fill(-cutlass.Float32.inf)
            ids.fill(NONE)
            batch = cute.make_rmem_tensor((BATCH,), cutlass.Float32)
            for first in cutlass.range(begin_end, end_start, BATCH, unroll=1):
                # All loads of a batch first, so BATCH of them are in flight per thread.
                for j in cutlass.range_constexpr(BATCH):
                    batch[j] = -cutlass.Float32.inf
                    if first + j < end_start:
                        batch[j] = mScore[head, first + j, token]
                for j in cutlass.range_constexpr(BATCH):
                    if batch[j] > best[TOPK - 1]:
                        self.insert(best, ids, batch[j], first + j)
            for j in cutlass.range_constexpr(TOPK):
                if j >= keep:
                    ids[j] = NONE
            self.sort_ascending(ids)
            written = cutlass.Int32(0)
            for block in cutlass.range(0, begin_end, unroll=1):
                if mScore[head, block, token] > -cutlass.Float32.inf:
                    mOut[token, head, written] = block
                    written = written + 1
            for j in cutlass.range_constexpr(TOPK):
                if ids[j] != NONE:
                    mOut[token, head, written] = ids[j]
                    written = written + 1
            for block in cutlass.range(end_start, valid, unroll=1):
                if mScore[head, block, token] > -cutlass.Float32.inf:
                    mOut[token, head, written] = block
                    written = written + 1
            for j in cutlass.range(written, TOPK, unroll=1):
                mOut[token, head, j] = -1

    @cute.jit
    def insert(self, best, ids, score, block):
        """Carry (score, block) down the sorted list: at each slot the larger of the two
        (score, then lower id) stays and the other moves on; the last one drops out."""
        carry_score, carry_id = score, block
        for j in cutlass.range_constexpr(TOPK):
            here_score, here_id = best[j], ids[j]
            take = (carry_score > here_score) | ((carry_score == here_score) & (carry_id < here_id))
            best[j] = cutlass.Float32(cutlass.select_(take, carry_score, here_score))
            ids[j] = cutlass.Int32(cutlass.select_(take, carry_id, here_id))
            carry_score = cutlass.Float32(cutlass.select_(take, here_score, carry_score))
            carry_id = cutlass.Int32(cutlass.select_(take, here_id, carry_id))

    @cute.jit
    def sort_ascending(self, ids):
        """Odd-even transposition sort of the 16 ids (NONE last)."""
        for step in cutlass.range_constexpr(TOPK):
            for j in cutlass.range_constexpr(step % 2, TOPK - 1, 2):
                low, high = ids[j], ids[j + 1]
                ids[j] = cutlass.min(low, high)
                ids[j + 1] = cutlass.max(low, high)


def make_kernel(variant):
    return MsaTopkSelect()
