"""msa_icp_score with warp-level MMA (mma.sync m16n8k32 e4m3, exact products summed in fp32),
every arch: a rank's block maxima of the raw q.k over its shard of FP8 index keys
(generator/families/msa_icp.py has the shard's layout), with the portable proxy scorer's
loop (generator/kernels/portable/msa_proxy_score.py): a CTA owns 64 query rows (16 tokens x
4 heads, q as it lies in memory) and walks the sequence's shard pages up to the last one a
row sees (or a contiguous run of them, split over page_splits CTAs), in 64-row tiles (a
page of 128 rows is two, of 32 rows one with its second half zero-filled), loading the next
tile while the tensor cores multiply the current one. A row sees a page's row i when it
exists and its key, page_size * c + key_base + i * key_step, lies at or before the row's
token's position. The first CTA of the split then writes -inf to the rows' columns below
the fill bound that no page filled.

msa_icp_list_score (lists): no score rows; the thread that stores a row's max keeps the
row's top-16 of the split's pages in shared memory instead and writes it out after the last
page (generator/kernels/common/icp_lists.py), empty for a split with no page.
"""

import cutlass
import cutlass.cute as cute

from generator.families.msa_icp import HEAD_DIM, HEADS, MAX_BLOCKS
from generator.kernels.common.icp_lists import RowLists
from generator.kernels.common.icp_shard import (
    fill_unscored,
    rows_at_or_before,
    scored_pages,
    split_pages,
    store_row_maxima,
)
from generator.kernels.portable.block_sparse_fwd import NUM_THREADS, TILE_N
from generator.kernels.portable.msa_proxy_score import QUERY_ROWS, MsaProxyScoreE4m3


class MsaIcpScoreWarpMma(MsaProxyScoreE4m3):
    def __init__(self, shard_rows: int, lists: bool):
        super().__init__(paged=True)
        self.shard_rows = shard_rows
        self.lists = lists
        self.tiles_per_block = max(1, shard_rows // TILE_N)
        self.tile_rows = min(shard_rows, TILE_N)  # rows of a page one tile holds

    @cute.jit
    def launch(self, args, stream):
        sQ_layout, sK_layout, SharedStorage = self.shared_tiles()
        gmem_load = self.load_copy(self.tile_copy_op())
        tiled_mma = self.tiled_mma()
        rows = HEADS * args.max_seqlen_q
        self.kernel(args, sQ_layout, sK_layout, gmem_load, tiled_mma, SharedStorage).launch(
            grid=[cute.ceil_div(rows, QUERY_ROWS), args.mCuQ.shape[0] - 1, args.page_splits],
            block=[NUM_THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes()
            + (RowLists.smem_bytes(QUERY_ROWS) if self.lists else 0),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        args,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        gmem_load: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        chunk, batch, split = cute.arch.block_idx()
        q_start = args.mCuQ[batch]
        rows_left = HEADS * (args.mCuQ[batch + 1] - q_start) - chunk * QUERY_ROWS
        if rows_left > 0:
            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sK = (storage.sK.get_tensor(sK_layout), storage.sV.get_tensor(sK_layout))
            seqlen_k = args.mSeqLenK[batch]
            rows = cutlass.min(rows_left, QUERY_ROWS)
            first_pos = args.mQOffset[batch] + args.position_shift + chunk * (QUERY_ROWS // HEADS)
            width = MAX_BLOCKS if cutlass.const_expr(self.lists) else args.mOut.shape[1]
            pages = scored_pages(args, seqlen_k, first_pos, rows, width)
            first_page, end_page = split_pages(pages, split, args.page_splits)
            first_row = HEADS * q_start + chunk * QUERY_ROWS
            lists = RowLists.allocate(smem, QUERY_ROWS, first_row, split) if self.lists else None
            # Rows as the proxy scorer's "tokens": the CTA's rows from 4 q_start on (lists:
            # a split with no page opens its rows' lists and writes them out empty).
            tiles = self.tiles_per_block
            self.score_head(
                args, sQ, sK, gmem_load, tiled_mma, tidx, 0, 0, batch, chunk, HEADS * q_start,
                rows_left, seqlen_k, first_pos, first_page * tiles, end_page * tiles,
                cutlass.Int32(1), lists,
            )  # fmt: skip
            if cutlass.const_expr(not self.lists):
                if split == 0:
                    fill_unscored(args, tidx, NUM_THREADS, first_row, rows, pages, seqlen_k)

    @cute.jit
    def row_position(self, first_pos, row):
        return first_pos + row // HEADS

    @cute.jit
    def tile_rows_before(self, args, position, u):
        """How many of tile u's rows hold a key at or before `position` (its first row is
        row (u % tiles_per_block) * 64 of page u // tiles_per_block)."""
        first = (u % self.tiles_per_block) * TILE_N
        return rows_at_or_before(args, position, u // self.tiles_per_block, first, self.tile_rows)

    @cute.jit
    def key_visible(self, args, u, column, tile_keys, row_pos):
        return (column < tile_keys) & (column < self.tile_rows_before(args, row_pos, u))

    @cute.jit
    def page_of(self, args, batch, u):
        """Tile u's page id (-1 for one outside the shard)."""
        page = args.mBlockTable[batch, u // self.tiles_per_block]
        if (page < 0) | (page >= args.mK.shape[0]):
            page = cutlass.Int32(-1)
        return page

    @cute.jit
    def keys_in_tile(self, args, batch, u, seqlen_k):
        keys = self.tile_rows_before(args, seqlen_k - 1, u)
        if self.page_of(args, batch, u) < 0:
            keys = cutlass.Int32(0)
        return keys

    @cute.jit
    def load_key_tile(
        self, args, gmem_load, thr_load, tKsK, tKcK, batch, kv_head, u, seqlen_k, codes, scales
    ):
        """Start loading tile u's rows by cp.async (rows past the sequence or the page zeroed)."""
        page = cutlass.max(self.page_of(args, batch, u), 0)  # -1: no row is loaded
        first = (u % self.tiles_per_block) * TILE_N
        rows = cute.domain_offset((first, 0), args.mK[page, None, None])
        keys_left = self.keys_in_tile(args, batch, u, seqlen_k)
        tile = cute.local_tile(rows, (TILE_N, HEAD_DIM), (0, 0))
        self.load_rows(gmem_load, thr_load.partition_S(tile), tKsK, tKcK, keys_left)

    @cute.jit
    def store_block_max(
        self, args, block_max, tScS_mn, tidx, head, block, first_token, rows_left, first_head,
        lists,
    ):  # fmt: skip
        if cutlass.const_expr(self.lists):
            lists.offer_rows(args, block_max, tScS_mn, tidx, first_token, rows_left, block)
        else:
            store_row_maxima(args, block_max, tScS_mn, tidx, first_token, rows_left, block)


def make_kernel(variant):
    lists = variant.family.name == "msa_icp_list_score"
    return MsaIcpScoreWarpMma(variant.params["shard_rows"], lists)
