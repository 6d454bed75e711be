"""msa_icp_merge: an owner's top-16 of each (token, owned head) from the W ranks' carrier rows
of one slot set (generator/families/msa_icp.py has the row formats and the ranking).

A warp per (token, head): its W x 16 candidates, two a lane (candidate i: rank i // 16's
entry i % 16). Each becomes one 64-bit ranking key, forced << 63 | order_key(score) << 31 |
(2^31 - 1 - id), 0 for no candidate, so that a larger key ranks first and exact score ties go
to the lower id. The keys meet in shared memory; three passes over them, each lane counting
for its own two: a duplicate id keeps only its largest key (the first of equal ones), a
surviving key is selected when fewer than 16 survivors rank above it, and a selected id's
output slot is the number of selected ids below it (ascending, without a sort).

Reading the rows: READ (prefill carriers after the caller's all-to-all) takes them as they
are; WAIT (legacy decode rows) has lane r poll rank r's ready flag until it is set, and
clears it once the warp has its words; WAIT_TAGGED polls each 64-bit word until it carries
the row's next generation (mExpected + 1). Rows are read at system scope, past the L1, whose
lines may hold an earlier use of the slot set.
"""

import cutlass
import cutlass.cute as cute

from generator.families.msa_icp import MAX_BLOCKS, MAX_WORLD, READ, TOPK, WAIT, WAIT_TAGGED
from generator.kernels.common.icp_lists import (
    ID_BITS,
    ascending_slot,
    key_block,
    ranking_key,
    top16_of_keys,
    warp_keys,
)
from generator.kernels.common.radix_select import float_of_bits
from generator.kernels.common.signals import (
    count_error_and_trap,
    load_relaxed_b32,
    load_relaxed_b64,
    store_release_b32,
    wait_for_flag,
)
from generator.kernels.common.warp_rows import launch_warp_rows, warp_row

PER_LANE = MAX_WORLD * TOPK // 32  # candidates a lane holds
CANDIDATES = MAX_WORLD * TOPK


class MsaIcpMerge:
    @cute.jit
    def launch(self, args, stream):
        launch_warp_rows(self.kernel(args), args.mOut.shape[0] * args.mOut.shape[1], stream)

    @cute.kernel
    def kernel(self, args):
        row, lane, warp = warp_row()
        tokens, heads, _ = args.mOut.shape
        sKeys = warp_keys(CANDIDATES, warp)
        if row < tokens * heads:
            self.merge_row(args, row // heads, row % heads, lane, sKeys)

    @cute.jit
    def merge_row(self, args, token, head, lane, sKeys):
        world = args.mRows.shape[0]
        nvp = args.mNumValid[token]
        limit = cutlass.min(cutlass.max(nvp, 0), MAX_BLOCKS)
        end_start = nvp - args.local_blocks
        errors = args.mErrors.iterator.toint()
        generation = cutlass.Int32(0)
        if args.mode == WAIT_TAGGED:
            generation = args.mExpected[head, token] + 1
        if args.mode == WAIT:
            if lane < world:
                wait_for_flag(
                    self.word_address(args, lane, head, token, 2 * TOPK), cutlass.Int32(1),
                    args.spin_limit, errors,
                )  # fmt: skip
            cute.arch.sync_warp()
        keys = cute.make_rmem_tensor((PER_LANE,), cutlass.Uint64)
        for k in cutlass.range_constexpr(PER_LANE):
            i = lane + 32 * k
            keys[k] = cutlass.Uint64(0)
            if i < world * TOPK:
                score_bits, block = self.read_entry(
                    args, i // TOPK, head, token, i % TOPK, generation, errors
                )
                keys[k] = ranking_key(
                    float_of_bits(score_bits), block, limit, end_start, nvp, args.init_blocks
                )
            sKeys[i] = keys[k]
        cute.arch.sync_warp()
        if args.mode == WAIT:
            # Every lane has its words (its keys are computed from them): the rows are the
            # ranks' again.
            if lane < world:
                store_release_b32(
                    self.word_address(args, lane, head, token, 2 * TOPK), cutlass.Int32(0)
                )
        if args.mode == WAIT_TAGGED:
            if lane == 0:
                args.mExpected[head, token] = generation
        # A duplicate id keeps its largest key (the first of equal ones).
        dropped = cute.make_rmem_tensor((PER_LANE,), cutlass.Int32)
        for k in cutlass.range_constexpr(PER_LANE):
            i = lane + 32 * k
            own = keys[k]
            beaten = cutlass.Int32(0)
            for j in cutlass.range(CANDIDATES, unroll=8):
                other = sKeys[j]
                same = ((other & ID_BITS) == (own & ID_BITS)) & (other != cutlass.Uint64(0))
                if same & ((other > own) | ((other == own) & (j < i))):
                    beaten = cutlass.Int32(1)
            dropped[k] = beaten
        cute.arch.sync_warp()
        for k in cutlass.range_constexpr(PER_LANE):
            if dropped[k] != 0:
                keys[k] = cutlass.Uint64(0)
            sKeys[lane + 32 * k] = keys[k]
        cute.arch.sync_warp()
        # Selected: fewer than 16 survivors rank above.
        selected = top16_of_keys(keys, sKeys, CANDIDATES, lane)
        # Ascending ids: a selected id's slot is the count of selected ids below it.
        out = args.mOut[token, head, None]
        for k in cutlass.range_constexpr(PER_LANE):
            own = keys[k]
            if own != cutlass.Uint64(0):
                out[ascending_slot(own, sKeys, CANDIDATES)] = key_block(own)
        if (lane >= selected) & (lane < TOPK):
            value = cutlass.Int32(-1)
            if (lane == 0) & (args.prefill != 0) & (nvp <= 0):
                value = cutlass.Int32(0)  # a prefill token with no candidate: [0, -1, ...]
            out[lane] = value

    @cute.jit
    def word_address(self, args, rank, head, token, word):
        """The byte address of 32-bit word `word` of rank `rank`'s row (token, head)."""
        rows = args.mRows
        offset = (
            cutlass.Int64(rank) * cutlass.Int64(rows.stride[0])
            + cutlass.Int64(head) * cutlass.Int64(rows.stride[1])
            + cutlass.Int64(token) * cutlass.Int64(rows.stride[2])
            + cutlass.Int64(word)
        )
        return rows.iterator.toint() + offset * 4

    @cute.jit
    def read_entry(self, args, rank, head, token, entry, generation, errors):
        """(score bits, block id) of entry `entry` of rank `rank`'s row (token, head); tagged,
        once both words carry `generation` (after spin_limit polls: an error, a trap)."""
        score_bits = cutlass.Int32(0)
        block = cutlass.Int32(-1)
        if args.mode == WAIT_TAGGED:
            score_at = self.word_address(args, rank, head, token, 2 * entry)
            block_at = self.word_address(args, rank, head, token, 2 * (TOPK + entry))
            score_word = load_relaxed_b64(score_at)
            block_word = load_relaxed_b64(block_at)
            polls = cutlass.Int32(0)
            while (
                (cutlass.Int32(score_word >> 32) != generation)
                | (cutlass.Int32(block_word >> 32) != generation)
            ) & (polls < args.spin_limit):
                polls = polls + 1
                score_word = load_relaxed_b64(score_at)
                block_word = load_relaxed_b64(block_at)
            if polls >= args.spin_limit:
                count_error_and_trap(errors)
            score_bits = cutlass.Int32(score_word)
            block = cutlass.Int32(block_word)
        elif args.mode == READ:
            score_bits = args.mRows[rank, head, token, entry]
            block = args.mRows[rank, head, token, TOPK + entry]
        else:
            score_bits = load_relaxed_b32(self.word_address(args, rank, head, token, entry))
            block = load_relaxed_b32(self.word_address(args, rank, head, token, TOPK + entry))
        return score_bits, block


def make_kernel(variant):
    return MsaIcpMerge()
