"""MSA proxy score with warp-level MMA (mma.sync: m16n8k16 bf16 / fp16, m16n8k32 e4m3), every
arch. The kernel is one class mixed into the 16-bit or the e4m3 attention template, whose
shared-memory tiles, copies, operand loads and GEMM it uses.

One CTA (4 warps, 16 query rows each) owns 64 query rows of one sequence and one query head
(with reduce_heads: every head in turn, the output row keeping the max). It walks the
sequence's 64-key tiles up to the last one any of its rows may see, two per scored 128-key
block, loading the next tile while the tensor cores multiply the current one:
    load Q, K[0]
    for each tile u:  wait K[u]; start K[u + 1]     S = Q K^T
                      keys past the sequence or above a row's position -> -inf
                      block max (per row, over u's block so far); written after its 2nd tile
Blocks past the last visible one, up to the output's width, are written -inf. Keys of a
tile past the sequence end are zero-filled in shared memory (and masked); so is, paged, a
whole block whose page id lies outside the cache (never read; it scores -inf).

NVFP4 q and k (msa_proxy_score_nvfp4) take the same path with fp16 tiles: a tile's codes and
scales are loaded into registers (the next key tile's before the current one's MMAs) and
decoded into shared memory after them, exactly (a code times its e4m3 scale fits fp16), and
the fp32 scores are multiplied by logit_scale before the block max.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from generator.families.msa_proxy_score import BLOCK_KEYS, HEAD_DIM, NVFP4_GROUP, QUERY_ROWS
from generator.kernels.common.entry import element_type
from generator.kernels.common.nvfp4 import decode_chunks, scale_offset_128x4
from generator.kernels.common.proxy_blocks import scored_blocks
from generator.kernels.common.softmax import acc_mn_view, quad_max
from generator.kernels.portable.block_sparse_fwd import (
    NUM_THREADS,
    TILE_M,
    TILE_N,  # keys per MMA tile: two per scored block
    BlockSparseFwdWarpMma,
)
from generator.kernels.portable.sage_fp8_fwd import SageFp8FwdWarpMma

assert QUERY_ROWS == TILE_M  # the block-sparse template's shared tiles and MMA
TILES_PER_BLOCK = BLOCK_KEYS // TILE_N
NEG_INF = -cutlass.Float32.inf


class ProxyScore:
    """The kernel; `paged` (the key layout) is set by the classes below."""

    paged: bool
    nvfp4 = False  # q and k as NVFP4 codes, decoded into shared memory through registers
    tiles_per_block = TILES_PER_BLOCK  # 64-key tiles of a scored block

    def tile_copy_op(self):
        """How tiles reach shared memory: cp.async from global memory."""
        return cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)

    @cute.jit
    def launch(self, args, stream):
        # The attention template's shared tiles: Q, and its K and V tiles as two K buffers.
        sQ_layout, sK_layout, SharedStorage = self.shared_tiles()
        gmem_load = self.load_copy(self.tile_copy_op())
        tiled_mma = self.tiled_mma()
        # With reduce_heads one CTA walks every head of its rows, keeping the max.
        heads = cutlass.Int32(cutlass.select_(args.reduce_heads != 0, 1, args.mQ.shape[1]))
        self.kernel(args, sQ_layout, sK_layout, gmem_load, tiled_mma, SharedStorage).launch(
            grid=[cute.ceil_div(args.max_seqlen_q, QUERY_ROWS), args.mCuQ.shape[0] - 1, heads],
            block=[NUM_THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes(),
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
        chunk, batch, head_z = cute.arch.block_idx()
        q_start = args.mCuQ[batch]
        seqlen_q = args.mCuQ[batch + 1] - q_start
        rows_left = seqlen_q - chunk * QUERY_ROWS
        if rows_left > 0:
            storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sK = (storage.sK.get_tensor(sK_layout), storage.sV.get_tensor(sK_layout))
            seqlen_k, first_pos, blocks = scored_blocks(
                args, self.paged, batch, seqlen_q, chunk * QUERY_ROWS,
                cutlass.min(rows_left, QUERY_ROWS),
            )  # fmt: skip
            tiles = cutlass.min(blocks * TILES_PER_BLOCK, cute.ceil_div(seqlen_k, TILE_N))

            hq = args.mQ.shape[1]
            head_begin, head_end = head_z, head_z + 1
            out_row = head_z
            if args.reduce_heads != 0:
                head_begin, head_end, out_row = cutlass.Int32(0), hq, cutlass.Int32(0)
            for head in cutlass.range(head_begin, head_end, unroll=1):
                kv_head = head // (hq // args.kv_heads)
                first_head = cutlass.Int32(head == head_begin)
                self.score_head(
                    args, sQ, sK, gmem_load, tiled_mma, tidx, head, kv_head, batch, chunk,
                    q_start, rows_left, seqlen_k, first_pos, cutlass.Int32(0), tiles, first_head,
                )  # fmt: skip
            # Blocks no row sees: -inf (the same for every head).
            width = args.mOut.shape[1]
            for i in cutlass.range(tidx, (width - blocks) * QUERY_ROWS, NUM_THREADS, unroll=1):
                row = i % QUERY_ROWS
                if row < rows_left:
                    args.mOut[
                        out_row, blocks + i // QUERY_ROWS, q_start + chunk * QUERY_ROWS + row
                    ] = NEG_INF

    @cute.jit
    def score_head(
        self, args, sQ, sK, gmem_load, tiled_mma, tidx, head, kv_head, batch, chunk,
        q_start, rows_left, seqlen_k, first_pos, first_tile, tiles, first_head, lists=None,
    ):  # fmt: skip
        """The block maxima of one head's 64 rows over 64-key tiles [first_tile, tiles)
        (first_tile a multiple of tiles_per_block). lists: the rows' top-16 lists a
        subclass's store_block_max keeps (generator/kernels/common/icp_lists.py), opened
        first and written out last, or None."""
        d = HEAD_DIM
        thr_load = gmem_load.get_slice(tidx)
        q_rows = cute.domain_offset((q_start, 0), args.mQ[None, head, None])
        tQgQ = thr_load.partition_S(cute.local_tile(q_rows, (QUERY_ROWS, d), (chunk, 0)))
        tQcQ = thr_load.partition_S(cute.make_identity_tensor((QUERY_ROWS, d)))
        tKcK = thr_load.partition_S(cute.make_identity_tensor((TILE_N, d)))
        tKsK = (thr_load.partition_D(sK[0]), thr_load.partition_D(sK[1]))

        thr_mma = tiled_mma.get_slice(tidx)
        ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
        atom = cute.make_copy_atom(ldsm, self.dtype)
        q_operand = self.operand_a(tiled_mma, tidx, atom, sQ)
        k_operands = tuple(self.operand_b(tiled_mma, tidx, atom, s) for s in sK)
        tScS_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((QUERY_ROWS, TILE_N))))
        rows = cute.size(tScS_mn, mode=[0])
        block_max = cute.make_rmem_tensor((rows,), cutlass.Float32)
        block_max.fill(NEG_INF)
        if cutlass.const_expr(lists is not None):
            lists.open_rows(args, tScS_mn, tidx, q_start + chunk * QUERY_ROWS, rows_left)

        # The previous head's last reads of sQ / sK are done and its copies landed.
        cute.arch.cp_async_wait_group(0)
        self.barrier.arrive_and_wait()
        codes = scales = staged = None
        if cutlass.const_expr(self.nvfp4):
            # A tile's codes and scales in registers between their loads and decoding.
            codes = cute.make_rmem_tensor((4,) + tKsK[0].shape[1:], cutlass.Uint8)
            scales = cute.make_rmem_tensor((2,) + tKsK[0].shape[1:], cutlass.Uint8)
            staged = cute.make_fragment_like(tKsK[0])
            q_codes = cute.domain_offset(
                (q_start + chunk * QUERY_ROWS, 0), args.mQ[None, head, None]
            )
            first_row = (q_start + chunk * QUERY_ROWS) * args.mQ.shape[1] + head
            self.fetch_codes(
                q_codes, rows_left, args.mQScale, first_row, args.mQ.shape[1], tQcQ, codes, scales
            )
            self.decode(gmem_load, codes, scales, staged, thr_load.partition_D(sQ))
        else:
            self.load_rows(gmem_load, tQgQ, thr_load.partition_D(sQ), tQcQ, rows_left)
        if tiles > first_tile:
            self.load_key_tile(
                args, gmem_load, thr_load, tKsK[0], tKcK, batch, kv_head, first_tile, seqlen_k,
                codes, scales,
            )  # fmt: skip
            if cutlass.const_expr(self.nvfp4):
                self.decode(gmem_load, codes, scales, staged, tKsK[0])
        cute.arch.cp_async_commit_group()
        for u in cutlass.range(first_tile, tiles, unroll=1):
            buffer = u - first_tile  # tile first_tile is in buffer 0
            cute.arch.cp_async_wait_group(0)
            self.barrier.arrive_and_wait()
            if u + 1 < tiles:
                if buffer % 2 == 1:
                    self.load_key_tile(
                        args, gmem_load, thr_load, tKsK[0], tKcK, batch, kv_head, u + 1,
                        seqlen_k, codes, scales,
                    )  # fmt: skip
                else:
                    self.load_key_tile(
                        args, gmem_load, thr_load, tKsK[1], tKcK, batch, kv_head, u + 1,
                        seqlen_k, codes, scales,
                    )  # fmt: skip
                cute.arch.cp_async_commit_group()
            acc_S = cute.make_rmem_tensor(
                thr_mma.partition_shape_C((QUERY_ROWS, TILE_N)), cutlass.Float32
            )
            acc_S.fill(0.0)
            if buffer % 2 == 0:
                self.gemm_smem(tiled_mma, acc_S, q_operand, k_operands[0])
            else:
                self.gemm_smem(tiled_mma, acc_S, q_operand, k_operands[1])
            if cutlass.const_expr(self.nvfp4):
                # The other buffer's last reader was tile u - 1, before this tile's barrier.
                if u + 1 < tiles:
                    if buffer % 2 == 0:
                        self.decode(gmem_load, codes, scales, staged, tKsK[1])
                    else:
                        self.decode(gmem_load, codes, scales, staged, tKsK[0])
                acc_S.store(acc_S.load() * args.logit_scale)
            acc_S_mn = acc_mn_view(acc_S)
            tile_keys = self.keys_in_tile(args, batch, u, seqlen_k)
            for r in cutlass.range_constexpr(rows):
                row_pos = self.row_position(first_pos, tScS_mn[r, 0][0])
                for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    visible = self.key_visible(args, u, tScS_mn[r, c][1], tile_keys, row_pos)
                    score = cutlass.Float32(cutlass.select_(visible, acc_S_mn[r, c], NEG_INF))
                    block_max[r] = cute.arch.fmax(block_max[r], score)
            if (u % self.tiles_per_block == self.tiles_per_block - 1) | (u + 1 == tiles):
                self.store_block_max(
                    args, block_max, tScS_mn, tidx, head, u // self.tiles_per_block,
                    q_start + chunk * QUERY_ROWS, rows_left, first_head, lists,
                )  # fmt: skip
                block_max.fill(NEG_INF)
        if cutlass.const_expr(lists is not None):
            lists.close_rows(args, tScS_mn, tidx, q_start + chunk * QUERY_ROWS, rows_left)

    @cute.jit
    def row_position(self, first_pos, row):
        """The position of the CTA's query row `row` (one row a token)."""
        return first_pos + row

    @cute.jit
    def key_visible(self, args, u, column, tile_keys, row_pos):
        """Whether key `column` of the u-th tile exists and (causal) lies at or before the
        row's position."""
        visible = column < tile_keys
        if args.causal != 0:
            visible = visible & (u * TILE_N + column <= row_pos)
        return visible

    @cute.jit
    def keys_in_tile(self, args, batch, u, seqlen_k):
        """How many keys the u-th 64-key tile holds (those before the sequence's end): none
        when, paged, its block's page id lies outside the cache (the block is scored -inf,
        never read)."""
        keys = seqlen_k - u * TILE_N
        if cutlass.const_expr(self.paged):
            page = args.mPageTable[batch, u // TILES_PER_BLOCK]
            if (page < 0) | (page * args.kv_heads >= args.mK.shape[0]):
                keys = cutlass.Int32(0)
        return keys

    @cute.jit
    def load_key_tile(
        self, args, gmem_load, thr_load, tKsK, tKcK, batch, kv_head, u, seqlen_k, codes, scales
    ):
        """Start loading the u-th 64-key tile of the sequence: cp.async into tKsK (keys past its
        end zeroed), or for NVFP4 its codes and scales into registers."""
        if cutlass.const_expr(self.paged):
            page = args.mPageTable[batch, u // TILES_PER_BLOCK]
            view = args.mK[page * args.kv_heads + kv_head, None, None]
            first = (u % TILES_PER_BLOCK) * TILE_N
            scale_row = (page * args.kv_heads + kv_head) * BLOCK_KEYS + first
            scale_row_step = 1
        else:
            view = args.mK[None, kv_head, None]
            first = args.mCuK[batch] + u * TILE_N
            scale_row = first * args.kv_heads + kv_head
            scale_row_step = args.kv_heads
        rows = cute.domain_offset((first, 0), view)
        keys_left = self.keys_in_tile(args, batch, u, seqlen_k)
        if cutlass.const_expr(self.nvfp4):
            self.fetch_codes(
                rows, keys_left, args.mKScale, scale_row, scale_row_step, tKcK, codes, scales
            )
        else:
            tile = cute.local_tile(rows, (TILE_N, HEAD_DIM), (0, 0))
            self.load_rows(gmem_load, thr_load.partition_S(tile), tKsK, tKcK, keys_left)

    @cute.jit
    def fetch_codes(self, rows, valid_rows, mScale, first_row, row_step, coords, codes, scales):
        """Load this thread's chunks of a 64-row NVFP4 tile into registers: row r is rows[r]
        (64 bytes of codes), its scales at logical row first_row + r * row_step of mScale;
        rows from valid_rows on are zero. coords: the chunks' (row, channel) in the fp16 tile
        (8 channels: 4 bytes of codes, in one 16-value scale group)."""
        for m in cutlass.range_constexpr(cute.size(coords, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(coords, mode=[2])):
                row, channel = coords[0, m, k][0], coords[0, m, k][1]
                if row < valid_rows:
                    chunk = cute.local_tile(rows[row, None], (4,), (channel // 8,))
                    codes[None, m, k].store(chunk.load())
                    offset = scale_offset_128x4(
                        first_row + row * row_step, channel // NVFP4_GROUP, HEAD_DIM // NVFP4_GROUP
                    )
                    scales[0, m, k] = mScale[offset]
                else:
                    codes[None, m, k].fill(0)
                    scales[0, m, k] = cutlass.Uint8(0)

    @cute.jit
    def decode(self, rows_copy, codes, scales, staged, dst):
        """The loaded codes times their scales, in fp16, into the shared tile partition dst."""
        decode_chunks(codes, scales, staged, self.dtype)
        cute.copy(rows_copy, staged, dst)

    @cute.jit
    def store_block_max(
        self, args, block_max, tScS_mn, tidx, head, block, first_token, rows_left, first_head,
        lists,
    ):  # fmt: skip
        """Each row's max (over the quad's columns), written by the quad's first lane; with
        reduce_heads the max with what the earlier heads wrote."""
        for r in cutlass.range_constexpr(cute.size(block_max)):
            value = quad_max(block_max[r])
            row = tScS_mn[r, 0][0]
            if (tidx % 4 == 0) & (row < rows_left):
                if args.reduce_heads != 0:
                    if first_head == 0:
                        value = cute.arch.fmax(value, args.mOut[0, block, first_token + row])
                    args.mOut[0, block, first_token + row] = value
                else:
                    args.mOut[head, block, first_token + row] = value


class MsaProxyScore16Bit(ProxyScore, BlockSparseFwdWarpMma):
    def __init__(self, dtype, paged: bool):
        BlockSparseFwdWarpMma.__init__(self, dtype, HEAD_DIM)
        self.paged = paged


class MsaProxyScoreE4m3(ProxyScore, SageFp8FwdWarpMma):
    def __init__(self, paged: bool):
        SageFp8FwdWarpMma.__init__(self, HEAD_DIM)
        self.paged = paged


class MsaProxyScoreNvfp4(ProxyScore, BlockSparseFwdWarpMma):
    nvfp4 = True

    def __init__(self, paged: bool):
        BlockSparseFwdWarpMma.__init__(self, cutlass.Float16, HEAD_DIM)
        self.paged = paged

    def tile_copy_op(self):
        return cute.nvgpu.CopyUniversalOp()  # registers to shared memory


def make_kernel(variant):
    p = variant.params
    paged = p["key_layout"] == "paged"
    if variant.family.name == "msa_proxy_score_nvfp4":
        return MsaProxyScoreNvfp4(paged)
    if p["dtype"] == "e4m3":
        return MsaProxyScoreE4m3(paged)
    return MsaProxyScore16Bit(element_type(p["dtype"]), paged)
