"""msa_icp_score for Hopper (sm_90a): a rank's block maxima of the raw q.k over its shard of
FP8 index keys (generator/families/msa_icp.py has the shard's layout), with the proxy
scorer's pipeline (generator/kernels/sm90/msa_proxy_score.py): a producer warp TMA-loads a
CTA's 128 query rows (32 tokens x 4 heads, q as it lies in memory) and then the shard pages
of the sequence up to the last one a row sees into a ring; two consumer warpgroups multiply
their 64 rows by each page (FP8 wgmma m64nR, R = the shard's rows per page) and reduce S to
one max per row, the rows a page holds past a row's position or the sequence masked.

A page's rows are keys page_size * c + key_base + i * key_step, i < R: the row count a token
sees is a prefix of them, so the masking is the proxy's with that count. With page_splits >
1 the pages of a row tile are split into contiguous runs over that many CTAs (a decode batch
has one row tile a request: fewer CTAs than SMs otherwise); their columns are disjoint. The
first CTA then writes -inf to the rows' columns below the fill bound that no page filled
(the causal tail and, with global block ids for P256, the blocks of the other ranks).

msa_icp_list_score (lists): no score rows; each consumer thread that stores a row's max keeps
the row's top-16 of the split's pages in shared memory instead and writes it out after the
last page (generator/kernels/common/icp_lists.py); a split with no page writes empty lists.
"""

import cutlass
import cutlass.cute as cute

from generator.families.msa_icp import HEAD_DIM, HEADS, MAX_BLOCKS
from generator.kernels.common.icp_lists import RowLists, write_empty_lists
from generator.kernels.common.icp_shard import (
    fill_unscored,
    rows_at_or_before,
    scored_pages,
    split_pages,
    store_row_maxima,
)
from generator.kernels.sm90.msa_proxy_score import (
    CTA_ROWS,
    RING_BYTES,
    MsaProxyScoreSm90,
    rows_d_heads,
)

MAX_STAGES = 8


class MsaIcpScoreSm90(MsaProxyScoreSm90):
    def __init__(self, shard_rows: int, lists: bool):
        super().__init__(cutlass.Float8E4M3FN, paged=True, accumulate="fp8")
        self.tile_keys = shard_rows
        self.rows_per_position = HEADS
        self.stages = min(MAX_STAGES, RING_BYTES // (shard_rows * HEAD_DIM))
        self.lists = lists
        if lists:
            self.extra_smem_bytes = RowLists.smem_bytes(CTA_ROWS)

    @cute.jit
    def launch(self, args, stream):
        mQ, mK = args.mQ, args.mK
        q_view = rows_d_heads(mQ, mQ.shape[0], 1, mQ.stride[0], mQ.stride[1])
        k_view = rows_d_heads(mK, self.tile_keys, mK.shape[0], mK.stride[1], mK.stride[0])
        rows = HEADS * args.max_seqlen_q
        grid = [args.page_splits, cute.ceil_div(rows, CTA_ROWS), args.mCuQ.shape[0] - 1]
        self.launch_grid(args, q_view, k_view, grid, stream)

    @cute.kernel
    def kernel(
        self,
        mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ_tma: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK_tma: cute.Tensor,
        args,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        loaded_q: cute.ComposedLayout,
        loaded_k: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        split, chunk_y, batch = cute.arch.block_idx()
        chunk = cute.ceil_div(HEADS * args.max_seqlen_q, CTA_ROWS) - 1 - chunk_y
        q_start = args.mCuQ[batch]
        rows_left = HEADS * (args.mCuQ[batch + 1] - q_start) - chunk * CTA_ROWS
        if rows_left > 0:
            rows = cutlass.min(rows_left, CTA_ROWS)
            seqlen_k = args.mSeqLenK[batch]
            first_pos = args.mQOffset[batch] + args.position_shift + chunk * (CTA_ROWS // HEADS)
            width = MAX_BLOCKS if cutlass.const_expr(self.lists) else args.mOut.shape[1]
            pages = scored_pages(args, seqlen_k, first_pos, rows, width)
            first_row = HEADS * q_start + chunk * CTA_ROWS
            first_page, end_page = split_pages(pages, split, args.page_splits)
            if end_page > first_page:
                smem = cutlass.memory.SmemAllocator()
                storage = smem.allocate(SharedStorage)
                lists = RowLists.allocate(smem, CTA_ROWS, first_row, split) if self.lists else None
                self.run_roles(
                    args, mma, tma_q, mQ_tma, tma_k, mK_tma, sQ_layout, sK_layout, loaded_q,
                    loaded_k, storage, tidx, warp, batch, first_row, first_pos, rows_left,
                    seqlen_k, cutlass.Int32(0), cutlass.Int32(1), cutlass.Int32(0), first_page,
                    end_page, lists,
                )  # fmt: skip
            elif cutlass.const_expr(self.lists):
                write_empty_lists(args, first_row, rows, split, tidx, self.num_threads)
            if cutlass.const_expr(not self.lists):
                if split == 0:
                    fill_unscored(args, tidx, self.num_threads, first_row, rows, pages, seqlen_k)

    @cute.jit
    def kv_head_of(self, args, head):
        return 0

    @cute.jit
    def key_tile(self, args, batch, kv_head, u):
        """Page u's id (-1, all zero fill, for an id outside the shard)."""
        page = args.mBlockTable[batch, u]
        if (page < 0) | (page >= args.mK.shape[0]):
            page = cutlass.Int32(-1)
        return page

    @cute.jit
    def rows_before(self, args, position, u):
        """How many of page u's rows hold a key at or before `position`."""
        return rows_at_or_before(args, position, u, 0, self.tile_keys)

    @cute.jit
    def block_keys(self, args, batch, kv_head, u, seqlen_k, wg_pos):
        keys = self.rows_before(args, seqlen_k - 1, u)
        if self.key_tile(args, batch, kv_head, u) < 0:
            keys = cutlass.Int32(0)
        last_key = args.page_size * u + args.key_base + (self.tile_keys - 1) * args.key_step
        return keys, (keys < self.tile_keys) | (wg_pos < last_key)

    @cute.jit
    def row_limit(self, args, keys, wg_pos, row, u):
        return cutlass.min(keys, self.rows_before(args, wg_pos + row // HEADS, u))

    @cute.jit
    def store(
        self, args, row_max, tScS_mn, tidx, out_row, block, first_token, rows_left,
        not_first_head, lists,
    ):  # fmt: skip
        if cutlass.const_expr(self.lists):
            lists.offer_rows(args, row_max, tScS_mn, tidx, first_token, rows_left, block)
        else:
            store_row_maxima(args, row_max, tScS_mn, tidx, first_token, rows_left, block)


def make_kernel(variant):
    lists = variant.family.name == "msa_icp_list_score"
    return MsaIcpScoreSm90(variant.params["shard_rows"], lists)
