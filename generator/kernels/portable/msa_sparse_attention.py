"""MSA sparse attention with warp-level MMA (mma.sync m16n8k16), every arch: the union tile.

One CTA (4 warps, 16 rows each) owns 64 rows of one kv head: T = 64 // G consecutive tokens
of one sequence times the G query heads that share the kv head (row r is token r // G, head
r % G), so a block that several of the tokens select is loaded once for all of them. A
CTA finds its (sequence, token tile) from cu_seqlens_q (the grid bounds their number by
total_q / T + B: no host synchronisation).

1. union: the tokens' block ids mark a bitmap over the sequence's blocks (-1, repeats, ids
   past the sequence and, paged, blocks whose page id lies outside the cache drop out); a
   popcount scan ranks them, giving the ascending list of the union's blocks and, per
   block, a 64-bit mask of the tokens that selected it.
2. Q: the 64 rows through registers into shared memory (rows past the tile's tokens zero).
3. per 64-key half of each union block (with `splits` > 1, grid z: only this CTA's
   contiguous share of them): S = Q K^T; a row keeps the keys of blocks its token
   selected, inside the sequence and, with causal, at positions <= its own; online softmax
   (and the temperature lse's running sum when asked); O += P V. A warp skips the MMAs and
   softmax of a block that none of its rows' tokens selected (at G = 16 a warp is one
   token; decode: one token's G heads fill 16 rows, the other warps skip all). Loads
   run one tile ahead, by cp.async, into two buffers:
       K/V in q's dtype: straight into the two K/V tile buffers;
       FP8 / NVFP4: the raw tiles (codes, and NVFP4's scale rows) into two small raw
       buffers (16-byte chunks XOR-swizzled by row against bank conflicts), then decoded
       from there into the one K/V tile (e4m3 -> q's dtype exactly; NVFP4: e2m1 code x its
       e4m3 group scale, exact in bf16 and fp16). Per-tensor and global scales fold into
       the softmax scale and the output scale.
       copy tile[0]
       for each tile u:  wait; barrier   copy tile[u + 1] (other buffer)
                         (FP8 / NVFP4: decode raw[u] -> K, V tiles; barrier)
                         S = Q K[u]^T; mask; softmax; O += P V[u]
4. O / rowsum x out_scale through shared memory to the rows' own addresses; lse (natural
   log). With splits, each CTA writes its rows' O and lse in fp32 instead and
   msa_attention_combine merges them.
Keys past the sequence are zero in shared memory (and masked), so a NaN cannot come from
memory no row may read.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from generator.families.msa_sparse_attention import (
    BLOCK_KEYS,
    HEAD_DIM,
    KV_FORMAT,
    MAX_BLOCKS,
    MAX_TOPK,
    NVFP4_GROUP,
    TILE_ROWS,
)
from generator.kernels.common.entry import element_type
from generator.kernels.common.msa_sequence import sequence_keys
from generator.kernels.common.msa_union import (
    block_union,
    chunk8,
    finalize_rows,
    first_key_of,
    mask_to_own_blocks,
    row_limits,
    selects_block,
    token_tile_of_cta,
    tokens_of_rows,
)
from generator.kernels.common.nvfp4 import decode_chunks
from generator.kernels.common.softmax import (
    acc_mn_view,
    new_softmax_state,
    saturated,
    softmax_update,
    temperature_update,
)
from generator.kernels.portable.block_sparse_fwd import (
    NUM_THREADS,
    TILE_M,
    TILE_N,
    BlockSparseFwdWarpMma,
)

assert TILE_ROWS == TILE_M
HALVES = BLOCK_KEYS // TILE_N  # 64-key tiles per block
WORDS = MAX_BLOCKS // 32
UNION_CAPACITY = TILE_ROWS * MAX_TOPK  # tokens of a CTA (<= 64) x topk
# FP8 / NVFP4: elements of one 16-byte shared-memory chunk (8 values of q's dtype) as stored:
RAW_ELEMENTS = {"e4m3": 8, "nvfp4": 4}  # nvfp4: 4 bytes of two codes each


class MsaSparseAttention(BlockSparseFwdWarpMma):
    def __init__(self, dtype, kv_format: str):
        super().__init__(dtype, HEAD_DIM)
        self.kv_format = kv_format
        self.raw_type = {"16bit": dtype, "e4m3": cutlass.Float8E4M3FN, "nvfp4": cutlass.Uint8}[
            kv_format
        ]
        # K/V in q's dtype go to shared memory by cp.async, a tile ahead into a second
        # buffer; FP8 and NVFP4 K/V go by cp.async, a tile ahead, into two buffers of raw
        # tiles (codes and scales as stored), each decoded from there into the one K and V
        # tile the MMAs read.
        self.stages = 2 if kv_format == "16bit" else 1
        self.row_bytes = {"16bit": 0, "e4m3": HEAD_DIM, "nvfp4": HEAD_DIM // 2}[kv_format]
        self.scale_bytes = HEAD_DIM // NVFP4_GROUP if kv_format == "nvfp4" else 0

    def shared_storage(self, sQ_layout, sKV_layout):
        kv_size = self.stages * cute.cosize(sKV_layout)
        # Raw tiles: two stages of (K, V) x 64 rows; at least one byte each (unused for 16-bit).
        raw_size = max(1, 2 * 2 * TILE_N * self.row_bytes)
        scale_size = max(1, 2 * 2 * TILE_N * self.scale_bytes)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, kv_size], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, kv_size], 1024]
            sRaw: cute.struct.Align[cute.struct.MemRange[self.raw_type, raw_size], 128]
            sRawScale: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, scale_size], 128]
            sBits: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, WORDS], 16]
            sBase: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, WORDS], 16]
            sWarpSums: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 4], 16]
            sIds: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, UNION_CAPACITY], 16]
            # Two words per union block: bit t of word t // 32 = token t selected it.
            sMask: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 2 * UNION_CAPACITY], 16]

        return SharedStorage

    @cute.jit
    def launch(self, args, stream):
        sQ_layout, sKV_layout, _ = self.shared_tiles()
        SharedStorage = self.shared_storage(sQ_layout, sKV_layout)
        rows_copy = self.load_copy(cute.nvgpu.CopyUniversalOp())
        tiled_mma = self.tiled_mma()
        tokens_per_cta = TILE_ROWS // args.group
        tiles_bound = args.mQ.shape[0] // tokens_per_cta + args.mCuQ.shape[0] - 1
        self.kernel(args, sQ_layout, sKV_layout, rows_copy, tiled_mma, SharedStorage).launch(
            grid=[tiles_bound, args.mK.shape[1], args.splits],
            block=[NUM_THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        args,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        rows_copy: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, kv_head, split = cute.arch.block_idx()
        group = args.group
        tokens_per_cta = TILE_ROWS // group
        seq, chunk = token_tile_of_cta(args.mCuQ, cta, tokens_per_cta)
        if seq >= 0:
            self.attend_tile(
                args, sQ_layout, sKV_layout, rows_copy, tiled_mma, SharedStorage, tidx,
                kv_head, seq, chunk, split,
            )  # fmt: skip

    @cute.jit
    def attend_tile(
        self, args, sQ_layout, sKV_layout, rows_copy, tiled_mma, SharedStorage, tidx,
        kv_head, seq, chunk, split,
    ):  # fmt: skip
        group = args.group
        tokens_per_cta = TILE_ROWS // group
        q_start = args.mCuQ[seq]
        seqlen_q = args.mCuQ[seq + 1] - q_start
        first_token = q_start + chunk * tokens_per_cta
        tokens = cutlass.min(tokens_per_cta, seqlen_q - chunk * tokens_per_cta)
        seqlen_k, key_start, blocks = sequence_keys(args, seq)
        blocks = cutlass.min(blocks, MAX_BLOCKS)
        first_pos = seqlen_k - seqlen_q + chunk * tokens_per_cta  # position of token 0
        if args.has_q_offset != 0:
            first_pos = args.mQOffset[seq] + chunk * tokens_per_cta

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sVt = cute.composition(sV, cute.make_layout((HEAD_DIM, TILE_N), stride=(TILE_N, 1)))
        sBits = storage.sBits.get_tensor(cute.make_layout(WORDS))
        sIds = storage.sIds.get_tensor(cute.make_layout(UNION_CAPACITY))
        sMask = storage.sMask.get_tensor(cute.make_layout(2 * UNION_CAPACITY))
        num_union = block_union(
            args, sBits, storage.sBase.get_tensor(cute.make_layout(WORDS)),
            storage.sWarpSums.get_tensor(cute.make_layout(4)), sIds, sMask, tidx, seq, kv_head,
            first_token, tokens, blocks, NUM_THREADS,
        )  # fmt: skip

        # Rows of this thread's 16-byte chunks of a (64, 128) tile: Q / O rows, K / V keys.
        thr_rows = rows_copy.get_slice(tidx)
        tXcX = thr_rows.partition_S(cute.make_identity_tensor((TILE_M, HEAD_DIM)))
        tQsQ = thr_rows.partition_D(sQ)
        tKsK = thr_rows.partition_D(sK)
        tVsV = thr_rows.partition_D(sV)
        rQ = cute.make_fragment_like(tQsQ)
        for m in cutlass.range_constexpr(cute.size(tXcX, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(tXcX, mode=[2])):
                row, col = tXcX[0, m, k][0], tXcX[0, m, k][1]
                token = row // group
                if token < tokens:
                    src = args.mQ[first_token + token, kv_head * group + row % group, None]
                    chunk8(rQ, m, k).store(cute.local_tile(src, (8,), (col // 8,)).load())
                else:
                    chunk8(rQ, m, k).fill(0)
        cute.copy(rows_copy, rQ, tQsQ)

        thr_mma = tiled_mma.get_slice(tidx)
        acc_O = cute.make_rmem_tensor(
            thr_mma.partition_shape_C((TILE_M, HEAD_DIM)), cutlass.Float32
        )
        acc_O.fill(0.0)
        ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
        ldsm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
        q_operand = self.operand_a(tiled_mma, tidx, cute.make_copy_atom(ldsm, self.dtype), sQ)
        k_operand = self.operand_b(tiled_mma, tidx, cute.make_copy_atom(ldsm, self.dtype), sK)
        v_operand = self.operand_b(tiled_mma, tidx, cute.make_copy_atom(ldsm_t, self.dtype), sVt)
        tScS_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_M, TILE_N))))
        rows = cute.size(tScS_mn, mode=[0])
        row_token, key_end = row_limits(args, tScS_mn, group, tokens, seqlen_k, first_pos)

        row_max, row_sum = new_softmax_state(rows)
        t_max, t_sum = new_softmax_state(rows)  # the temperature lse's
        with_temperature = (args.want_lse != 0) & (args.temperature != 1.0)
        state = (row_max, row_sum, t_max, t_sum, with_temperature)
        # This split's share of the union's 64-key tiles: [first_tile, first_tile + tiles).
        all_tiles = num_union * HALVES
        share = cute.ceil_div(all_tiles, args.splits)
        first_tile = cutlass.min(split * share, all_tiles)
        tiles = cutlass.min(all_tiles - first_tile, share)
        masks = (sIds, sMask, row_token, key_end, tScS_mn)
        # A warp skips the MMAs and softmax of a block none of its rows' tokens selected
        # (their scores would all be masked): with G = 16 a warp is one token, so per-token
        # selections cost it its own blocks, not the union's; a warp whose rows are all past
        # the tile's tokens (decode: G heads of one token fill 16 of the 64 rows) skips
        # every block. Loads and decodes are shared, so every warp still does those.
        warp_tokens = tokens_of_rows((tidx // 32) * (TILE_M // 4), TILE_M // 4, group, tokens)
        fetch_args = (seq, kv_head, sIds, seqlen_k, key_start)
        if cutlass.const_expr(self.stages == 2):
            # Two buffers: tile u + 1's cp.async copies run under tile u's MMAs and softmax.
            sK2 = cute.make_tensor(sK.iterator + cute.cosize(sKV_layout), sKV_layout)
            sV2 = cute.make_tensor(sV.iterator + cute.cosize(sKV_layout), sKV_layout)
            sVt2 = cute.composition(sV2, cute.make_layout((HEAD_DIM, TILE_N), stride=(TILE_N, 1)))
            ldsm_k = cute.make_copy_atom(ldsm, self.dtype)
            ldsm_v = cute.make_copy_atom(ldsm_t, self.dtype)
            k_operands = (k_operand, self.operand_b(tiled_mma, tidx, ldsm_k, sK2))
            v_operands = (v_operand, self.operand_b(tiled_mma, tidx, ldsm_v, sVt2))
            kv_dst = ((tKsK, tVsV), (thr_rows.partition_D(sK2), thr_rows.partition_D(sV2)))
            async_copy = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                self.dtype,
                num_bits_per_copy=128,
            )
            if tiles > 0:
                self.copy_tile_async(args, async_copy, kv_dst[0], tXcX, fetch_args, first_tile)
            cute.arch.cp_async_commit_group()
            for i in cutlass.range(tiles, unroll=1):
                u = first_tile + i  # the union's tile; i picks the buffer
                cute.arch.cp_async_wait_group(0)
                # Tile u landed for every thread, and every warp is done with tile u - 1's
                # buffer, which tile u + 1 now fills.
                self.barrier.arrive_and_wait()
                if i + 1 < tiles:
                    if i % 2 == 0:
                        self.copy_tile_async(args, async_copy, kv_dst[1], tXcX, fetch_args, u + 1)
                    else:
                        self.copy_tile_async(args, async_copy, kv_dst[0], tXcX, fetch_args, u + 1)
                cute.arch.cp_async_commit_group()
                if selects_block(sMask, u // HALVES, warp_tokens):
                    acc_S = cute.make_rmem_tensor(
                        thr_mma.partition_shape_C((TILE_M, TILE_N)), cutlass.Float32
                    )
                    acc_S.fill(0.0)
                    if i % 2 == 0:
                        self.gemm_smem(tiled_mma, acc_S, q_operand, k_operands[0])
                        self.attend_scores(
                            args, tiled_mma, acc_S, acc_O, v_operands[0], u, masks, state
                        )
                    else:
                        self.gemm_smem(tiled_mma, acc_S, q_operand, k_operands[1])
                        self.attend_scores(
                            args, tiled_mma, acc_S, acc_O, v_operands[1], u, masks, state
                        )
        else:
            # raw[stage][x]: tile rows of K (x = 0) or V (x = 1) as stored, and their scales.
            raw_tiles = self.raw_buffers(storage.sRaw.data_ptr(), self.row_bytes)
            raw_scales = self.raw_buffers(storage.sRawScale.data_ptr(), self.scale_bytes)
            raw_shape = (RAW_ELEMENTS[self.kv_format],) + tKsK.shape[1:]
            raw = cute.make_rmem_tensor(raw_shape, self.raw_type)
            scales = cute.make_rmem_tensor((2,) + tKsK.shape[1:], cutlass.Uint8)
            rKV = cute.make_fragment_like(tKsK)
            if tiles > 0:
                self.copy_raw_async(args, raw_tiles[0], raw_scales[0], tidx, fetch_args, first_tile)
            cute.arch.cp_async_commit_group()
            for i in cutlass.range(tiles, unroll=1):
                u = first_tile + i  # the union's tile; i picks the raw stage
                cute.arch.cp_async_wait_group(0)
                # Raw tile u landed for every thread; every warp is done with tile u - 1 (its
                # raw stage, which tile u + 1 now fills, and the K and V tiles).
                self.barrier.arrive_and_wait()
                if i + 1 < tiles:
                    if i % 2 == 0:
                        self.copy_raw_async(
                            args, raw_tiles[1], raw_scales[1], tidx, fetch_args, u + 1
                        )
                    else:
                        self.copy_raw_async(
                            args, raw_tiles[0], raw_scales[0], tidx, fetch_args, u + 1
                        )
                cute.arch.cp_async_commit_group()
                first_key = first_key_of(sIds, u, TILE_N)
                valid_rows = seqlen_k - first_key
                for x in cutlass.range_constexpr(2):
                    if i % 2 == 0:
                        self.read_raw(
                            raw, scales, tXcX, x == 1, raw_tiles[0][x], raw_scales[0][x], valid_rows
                        )
                    else:
                        self.read_raw(
                            raw, scales, tXcX, x == 1, raw_tiles[1][x], raw_scales[1][x], valid_rows
                        )
                    self.dequantize(raw, scales, rKV)
                    cute.copy(rows_copy, rKV, tKsK if x == 0 else tVsV)
                self.barrier.arrive_and_wait()
                if selects_block(sMask, u // HALVES, warp_tokens):
                    acc_S = cute.make_rmem_tensor(
                        thr_mma.partition_shape_C((TILE_M, TILE_N)), cutlass.Float32
                    )
                    acc_S.fill(0.0)
                    self.gemm_smem(tiled_mma, acc_S, q_operand, k_operand)
                    self.attend_scores(args, tiled_mma, acc_S, acc_O, v_operand, u, masks, state)

        row_lse = cute.make_rmem_tensor((rows,), cutlass.Float32)
        row_lse_t = cute.make_rmem_tensor((rows,), cutlass.Float32)
        finalize_rows(
            args, acc_O, state, row_lse, row_lse_t, self.p_offset, args.scale_log2, args.out_scale
        )
        if args.splits > 1:
            self.store_split(
                args, tiled_mma, acc_O, row_lse, row_lse_t, tidx, kv_head, first_token, tokens,
                split,
            )  # fmt: skip
        else:
            self.store_rows(
                args, tiled_mma, rows_copy, acc_O, row_lse, row_lse_t, sQ, sQ_layout, tXcX,
                tidx, kv_head, first_token, tokens,
            )  # fmt: skip

    @staticmethod
    def raw_buffers(base, width: int):
        """Two stages of (K, V) raw tiles of 64 rows x `width` bytes (at least one) in shared
        memory from `base`, each stage's K then V."""
        width = max(1, width)
        layout = cute.make_layout((TILE_N, width), stride=(width, 1))
        return tuple(
            tuple(
                cute.make_tensor(base + (2 * stage + x) * TILE_N * width, layout) for x in range(2)
            )
            for stage in range(2)
        )

    @cute.jit
    def attend_scores(self, args, tiled_mma, acc_S, acc_O, v_operand, u, masks, state):
        """Tile u's scores: each row keeps the keys of its token's blocks before its key_end;
        online softmax (and the temperature lse's sums); O += P V."""
        sIds, sMask, row_token, key_end, tScS_mn = masks
        row_max, row_sum, t_max, t_sum, with_temperature = state
        acc_S_mn = acc_mn_view(acc_S)
        first_key = first_key_of(sIds, u, TILE_N)
        mask_to_own_blocks(acc_S_mn, tScS_mn, sMask, u // HALVES, first_key, row_token, key_end)
        if with_temperature:
            temperature_update(t_max, t_sum, args.scale_log2 * args.temperature, acc_S_mn)
        softmax_update(
            row_max, row_sum, args.scale_log2, acc_S_mn, acc_mn_view(acc_O), self.p_offset
        )
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        self.gemm_rA(tiled_mma, acc_O, self.c_frag_as_a_frag(rP), v_operand)

    @cute.jit
    def locate_tile(self, args, fetch_args, u):
        """Where tile u of the union lies: (its first key in the sequence, its page, the row
        of that key in the page); flat K/V are one "page" from the sequence's first key."""
        seq, kv_head, sIds, seqlen_k, key_start = fetch_args
        block = sIds[u // HALVES]
        first_key = block * BLOCK_KEYS + (u % HALVES) * TILE_N
        page = cutlass.Int32(0)
        page_row = (u % HALVES) * TILE_N
        if args.paged != 0:
            page = args.mPageTable[seq, block]
        else:
            page_row = key_start + first_key
        return first_key, page, page_row

    @cute.jit
    def copy_tile_async(self, args, async_copy, kv_dst, tXcX, fetch_args, u):
        """cp.async this thread's chunks of tile u's K and V (in q's dtype) into the shared
        tiles kv_dst = (K partition, V partition); keys past the sequence: zero."""
        seq, kv_head, sIds, seqlen_k, key_start = fetch_args
        first_key, page, page_row = self.locate_tile(args, fetch_args, u)
        for x in cutlass.range_constexpr(2):
            mX = args.mK if x == 0 else args.mV
            for m in cutlass.range_constexpr(cute.size(tXcX, mode=[1])):
                for k in cutlass.range_constexpr(cute.size(tXcX, mode=[2])):
                    row, col = tXcX[0, m, k][0], tXcX[0, m, k][1]
                    dst = kv_dst[x][None, m, k]
                    if first_key + row < seqlen_k:
                        src = mX[page, kv_head, page_row + row, None]
                        cute.copy(async_copy, cute.local_tile(src, (8,), (col // 8,)), dst)
                    else:
                        dst.fill(0)

    @cute.jit
    def copy_raw_async(self, args, tiles, scale_tiles, tidx, fetch_args, u):
        """cp.async tile u's K and V rows as stored (and their NVFP4 scale rows) into the raw
        tiles (K, V) and scale tiles; rows past the sequence: zero."""
        seq, kv_head, sIds, seqlen_k, key_start = fetch_args
        first_key, page, page_row = self.locate_tile(args, fetch_args, u)
        chunks_per_row = self.row_bytes // 16
        data_copy = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            self.raw_type,
            num_bits_per_copy=128,
        )
        for x in cutlass.range_constexpr(2):
            mX = args.mK if x == 0 else args.mV
            for i in cutlass.range_constexpr(TILE_N * chunks_per_row // NUM_THREADS):
                c = tidx + i * NUM_THREADS
                row, chunk = c // chunks_per_row, c % chunks_per_row
                dst = cute.local_tile(tiles[x][row, None], (16,), (chunk ^ self.swizzle(row),))
                if first_key + row < seqlen_k:
                    src = mX[page, kv_head, page_row + row, None]
                    cute.copy(data_copy, cute.local_tile(src, (16,), (chunk,)), dst)
                else:
                    dst.fill(0)
        if cutlass.const_expr(self.kv_format == "nvfp4"):
            # A tile's scale rows are 512 contiguous bytes (rows of 8): 32 chunks of 16 bytes,
            # K's on threads 0-31, V's on 32-63. Paged only: the page holds every row, and
            # read_raw zeroes the scales of rows past the sequence.
            scale_copy = cute.make_copy_atom(
                cpasync.CopyG2SOp(), cutlass.Uint8, num_bits_per_copy=128
            )
            chunks = TILE_N * self.scale_bytes // 16
            for x in cutlass.range_constexpr(2):
                if tidx // chunks == x:
                    mScale = args.mKScale if x == 0 else args.mVScale
                    rows = cute.local_tile(
                        mScale[page, kv_head, None, None],
                        (TILE_N, self.scale_bytes),
                        (u % HALVES, 0),
                    )
                    src_rows = cute.make_tensor(
                        rows.iterator, cute.make_layout(TILE_N * self.scale_bytes)
                    )
                    dst_rows = cute.make_tensor(
                        scale_tiles[x].iterator, cute.make_layout(TILE_N * self.scale_bytes)
                    )
                    chunk = tidx % chunks
                    cute.copy(
                        scale_copy,
                        cute.local_tile(src_rows, (16,), (chunk,)),
                        cute.local_tile(dst_rows, (16,), (chunk,)),
                    )

    def swizzle(self, row):
        """The XOR on the 16-byte chunk index of a raw tile's row: the four rows a warp reads
        at once (8 lanes a row, 4 or 8 bytes each) land in different banks (FP8 rows of 128
        bytes: odd rows in the other half of the banks; NVFP4 rows of 64: rows 2, 3 of
        every 4 in the other quarter)."""
        if cutlass.const_expr(self.kv_format == "e4m3"):
            return (row & 1) << 2
        return ((row >> 1) & 1) << 1

    @cute.jit
    def read_raw(self, raw, scales, tXcX, is_v, tile, scale_tile, valid_rows):
        """This thread's chunks of a raw tile (stored swizzled: swizzle) and their scales, from
        shared memory into registers; scales of rows from valid_rows on are zero (their codes
        are). V scales are read through the 4x4 swizzle of their rows: (row, group) stored at
        ((row // 4) * 4 + group // 2, (group % 2) * 4 + row % 4) of the tile."""
        for m in cutlass.range_constexpr(cute.size(tXcX, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(tXcX, mode=[2])):
                row, col = tXcX[0, m, k][0], tXcX[0, m, k][1]
                # col // 8: the chunk's index in units of raw.shape[0] bytes, 16 // raw.shape[0]
                # of them in a 16-byte chunk of the row.
                place = (col // 8) ^ (self.swizzle(row) * (16 // raw.shape[0]))
                chunk = cute.local_tile(tile[row, None], (raw.shape[0],), (place,))
                raw[None, m, k].store(chunk.load())
                if cutlass.const_expr(self.kv_format == "nvfp4"):
                    group = col // NVFP4_GROUP
                    scales[0, m, k] = cutlass.Uint8(0)
                    if row < valid_rows:
                        if cutlass.const_expr(is_v):
                            scales[0, m, k] = scale_tile[
                                row - row % 4 + group // 2, group % 2 * 4 + row % 4
                            ]
                        else:
                            scales[0, m, k] = scale_tile[row, group]

    @cute.jit
    def dequantize(self, raw, scales, rKV):
        """The read chunks in q's dtype, into rKV (a 16-byte chunk of the shared tile each)."""
        if cutlass.const_expr(self.kv_format == "e4m3"):
            rKV.store(raw.load().to(cutlass.Float32).to(self.dtype))
        else:
            decode_chunks(raw, scales, rKV, self.dtype)

    @cute.jit
    def store_split(
        self, args, tiled_mma, acc_O, row_lse, row_lse_t, tidx, kv_head, first_token, tokens,
        split,
    ):  # fmt: skip
        """This split's rows in fp32 (O, lse, temperature lse) for msa_attention_combine:
        straight from the accumulators (two adjacent columns a store)."""
        group = args.group
        thr_mma = tiled_mma.get_slice(tidx)
        tOcO_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_M, HEAD_DIM))))
        acc_O_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_lse)):
            row = tOcO_mn[r, 0][0]
            token = row // group
            if token < tokens:
                head = kv_head * group + row % group
                dst = args.mOSplit[split, first_token + token, head, None]
                for c in cutlass.range_constexpr(0, cute.size(acc_O_mn, mode=[1]), 2):
                    col = tOcO_mn[r, c][1]
                    pair = cute.local_tile(dst, (2,), (col // 2,))
                    pair[0] = acc_O_mn[r, c]
                    pair[1] = acc_O_mn[r, c + 1]
                if tidx % 4 == 0:
                    args.mLSESplit[split, 0, first_token + token, head] = row_lse[r]
                    args.mLSESplit[split, 1, first_token + token, head] = row_lse_t[r]

    @cute.jit
    def store_rows(
        self, args, tiled_mma, rows_copy, acc_O, row_lse, row_lse_t, sQ, sQ_layout, tXcX,
        tidx, kv_head, first_token, tokens,
    ):  # fmt: skip
        """O (saturated to q's dtype) through shared memory to each row's (token, head); lse
        and the temperature lse when asked."""
        group = args.group
        self.barrier.arrive_and_wait()  # every warp is done with sQ (and wrote its Q rows)
        thr_mma = tiled_mma.get_slice(tidx)
        tOcO_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_M, HEAD_DIM))))
        if args.want_lse != 0:
            for r in cutlass.range_constexpr(cute.size(row_lse)):
                row = tOcO_mn[r, 0][0]
                if (tidx % 4 == 0) & (row // group < tokens):
                    head = kv_head * group + row % group
                    args.mLSE[first_token + row // group, head] = row_lse[r]
                    args.mLSET[first_token + row // group, head] = row_lse_t[r]

        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(saturated(acc_O.load(), self.dtype).to(self.dtype))
        sO = cute.make_tensor(sQ.iterator, sQ_layout)
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), tiled_mma
        )
        thr_r2s = r2s.get_slice(tidx)
        cute.copy(r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sO))
        self.barrier.arrive_and_wait()
        thr_rows = rows_copy.get_slice(tidx)
        tOsO = thr_rows.partition_S(sO)
        rOut = cute.make_fragment_like(tOsO)
        cute.copy(rows_copy, tOsO, rOut)
        for m in cutlass.range_constexpr(cute.size(tXcX, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(tXcX, mode=[2])):
                row, col = tXcX[0, m, k][0], tXcX[0, m, k][1]
                token = row // group
                if token < tokens:
                    dst = args.mO[first_token + token, kv_head * group + row % group, None]
                    cute.local_tile(dst, (8,), (col // 8,)).store(chunk8(rOut, m, k).load())


def make_kernel(variant):
    kv_format = KV_FORMAT[variant.family.name]
    return MsaSparseAttention(element_type(variant.params["dtype"]), kv_format)
