"""msa_icp_list_merge: a (token, head) row's top-16 of the list scorer's S <= 4 lists, written
as the select would write the row (generator/families/msa_icp.py; where and how:
generator/kernels/common/icp_rows.py).

A warp per row: its S x 16 candidates, two a lane (candidate i: entry i % 16 of list i //
16), each as its ranking key (generator/kernels/common/icp_lists.py). The splits' pages are
disjoint, so no id repeats. A key is selected when fewer than 16 rank above it, and goes to
the slot of the count of selected ids below it (ascending, without a sort); slots past the
selected count get (-inf, -1). The score words come from the keys: the bits the list scorer
stored, -0 as +0.
"""

import cutlass
import cutlass.cute as cute

from generator.families.msa_icp import MAX_BLOCKS, MAX_LIST_SPLITS, TOPK
from generator.kernels.common.icp_lists import (
    NOT_CANDIDATE,
    ascending_slot,
    key_block,
    key_score_bits,
    ranking_key,
    top16_of_keys,
    warp_keys,
)
from generator.kernels.common.icp_rows import claim_row, row_address, set_ready, write_entry
from generator.kernels.common.radix_select import float_of_bits
from generator.kernels.common.warp_rows import launch_warp_rows, warp_row

CANDIDATES = MAX_LIST_SPLITS * TOPK
PER_LANE = CANDIDATES // 32


class MsaIcpListMerge:
    @cute.jit
    def launch(self, args, stream):
        launch_warp_rows(self.kernel(args), args.mLists.shape[1] * args.mLists.shape[2], stream)

    @cute.kernel
    def kernel(self, args):
        row, lane, warp = warp_row()
        _, heads, tokens, _ = args.mLists.shape
        sKeys = warp_keys(CANDIDATES, warp)
        if row < tokens * heads:
            self.merge_row(args, row // heads, row % heads, lane, sKeys)

    @cute.jit
    def merge_row(self, args, token, head, lane, sKeys):
        splits = args.mLists.shape[0]
        nvp = args.mNumValid[token]
        limit = cutlass.min(cutlass.max(nvp, 0), MAX_BLOCKS)
        address = row_address(args, token, head)
        generation = cutlass.Int32(0)
        if lane == 0:
            generation = claim_row(args, address, token, head, args.mErrors.iterator.toint())
        generation = cute.arch.shuffle_sync(generation, 0)
        cute.arch.sync_warp()  # the row is free (PUBLISH) before any lane writes it
        keys = cute.make_rmem_tensor((PER_LANE,), cutlass.Uint64)
        for k in cutlass.range_constexpr(PER_LANE):
            i = lane + 32 * k
            keys[k] = cutlass.Uint64(0)
            if i < splits * TOPK:
                words = args.mLists[i // TOPK, head, token, None]
                keys[k] = ranking_key(
                    float_of_bits(words[i % TOPK]), words[TOPK + i % TOPK], limit,
                    nvp - args.force_end, nvp, args.force_begin,
                )  # fmt: skip
            sKeys[i] = keys[k]
        cute.arch.sync_warp()
        selected = top16_of_keys(keys, sKeys, CANDIDATES, lane)
        for k in cutlass.range_constexpr(PER_LANE):
            own = keys[k]
            if own != cutlass.Uint64(0):
                write_entry(
                    args, address, ascending_slot(own, sKeys, CANDIDATES), key_score_bits(own),
                    key_block(own), generation,
                )  # fmt: skip
        if (lane >= selected) & (lane < TOPK):
            write_entry(args, address, lane, cutlass.Int32(NOT_CANDIDATE), -1, generation)
        # Every word of the row is written (bar.warp.sync orders the lanes' stores before
        # lane 0's release of the flag).
        cute.arch.sync_warp()
        if lane == 0:
            set_ready(args, address)


def make_kernel(variant):
    return MsaIcpListMerge()
