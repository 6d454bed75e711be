"""MSA sparse attention on Hopper (sm_90a): the union tile on wgmma, K and V tiles
TMA-gathered by page; K/V in q's dtype or e4m3.

Same contract as the portable union tile (generator/kernels/portable/msa_sparse_attention.py)
for G = 16 query heads per kv head: a CTA of one warpgroup owns 64 rows, 4 consecutive
tokens of one sequence times the 16 heads of one kv head (row r is token r // 16, head
r % 16), and streams the union of its tokens' blocks once (common/msa_union.py), each row
masked to its own token's blocks, its causal limit and the sequence's end. A union block is
two 64-key tiles, each loaded by TMA at (its page, kv head, row 0 or 64) of the paged cache,
or at (its first key) of the flat one. Q comes through registers (its rows are 16 heads of
4 tokens, not one TMA box), written into the swizzled Q tile with 16-byte stores. Three
CTAs an SM (168 registers), warp 0 also issuing the loads.

K/V in q's dtype: the block-sparse kernel's loop (sm90/block_sparse_fwd.py): S = Q K^T and
  O += P V on wgmma, S of tile j+1 issued right behind P V of tile j, a ring of 3 stages of
  64-key tiles (K and V of a tile in consecutive stages). V rows past the sequence are
  zeroed in shared memory (a page's tail, or the next sequence's keys when flat), so a NaN
  there cannot reach O through a zero probability.
FP8 / NVFP4 K/V: TMA fills a ring of 2 raw stages (K and V of a tile as stored, 8 KB each
  for e4m3, one tile ahead); per tile the warpgroup converts them into one fp16 K and one V
  tile (exact: every e4m3 value is an fp16 one, one conversion a pair; NVFP4 values are
  formed as value x scale / 2^7, one multiply a pair, decode_chunks; rows past the sequence
  written as zeros), releases the raw stages to the next tile's loads, then S = Q K^T,
  softmax, O += P V, each waited for: the conversion needs the fp16 tiles free, so CTAs
  overlap each other's steps, not their own. The MMAs run in fp16 whatever q's dtype (bf16
  tiles would cost a conversion through fp32 and a pack a pair): bf16 q enters the fp16 Q
  tile divided by the power of two that puts its warpgroup's largest magnitude in
  [2^14, 2^15) (store_q). That factor, NVFP4's 2^7, k_scale and v_scale fold into the
  softmax and output scales.
FP8 K/V at one or two warpgroups a CTA (split_q): only V is converted. S = Q K^T runs on
  e4m3 wgmma with K as the raw ring holds it, Q entering as two e4m3 tiles, hi = e4m3(x)
  and lo = e4m3(x - hi) of each row x divided by its own power of two (its largest
  magnitude into [2^7, 2^8); split_into_e4m3), both MMA chains into one accumulator: two
  e4m3 MMAs take the tensor time of one fp16 MMA, and hi + lo carries the 8 significant
  bits of bf16 q. Each row of S is multiplied back by its factor before the softmax. S of a
  tile is issued as soon as its raw K lands and runs while the warps convert its V; the one
  fp16 stage (V's) frees K's: at one warpgroup four CTAs an SM instead of three (128
  registers, a few spilled), at two a raw ring one tile deeper.
Two or four warpgroups a CTA (`warpgroups` W): 4W tokens, warpgroup w owning the rows of
  tokens 4w .. 4w + 3, one union and one ring for all. FP8 / NVFP4 K/V: each warpgroup
  converts 64 / W of every tile's 64 rows and all multiply their own rows by the whole
  converted tile, so a tile is converted once for 64W rows. Per 64 rows and 64-key tile the
  SM's shared memory then moves ~80 KB (W = 2) or ~64 KB (W = 4) for FP8 K/V converted
  whole instead of ~112 (raw TMA writes 16, conversion 48 and the MMAs' reads 48, the first
  two shared by the CTA's warpgroups; split_q converts V alone); a raw ring of K and V 2 or
  3 tiles ahead. At W = 4 (one CTA an SM, no other CTA to fill the tensor pipe while this
  one converts) two converted buffers: a warpgroup converts its share of tile j + 1 while
  its P V of tile j runs, one barrier a tile. 16-bit K/V: the ring of the block-sparse
  kernel's shared loop (64 and 56 KB instead of 80; half or a quarter of the L2 bytes), S of
  a tile not issued behind P V. 4 / W CTAs an SM (128 registers).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from generator.families.msa_sparse_attention import (
    BLOCK_KEYS,
    HEAD_DIM,
    KV_FORMAT,
    MAX_BLOCKS,
    MAX_TOPK,
    NVFP4_GROUP,
    TILE_ROWS,
    WGMMA_GROUP,
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
    token_tile_of_cta,
)
from generator.kernels.common.nvfp4 import FP16_DIVISOR_LOG2
from generator.kernels.common.ptx import opaque_int32
from generator.kernels.common.softmax import (
    acc_mn_view,
    new_softmax_state,
    softmax_update,
    temperature_update,
)
from generator.kernels.common.tile_convert import (
    convert_e4m3_tile,
    convert_nvfp4_tile,
    into_fp16_range,
    split_into_e4m3,
    warp_finite_max,
)
from generator.kernels.sm90.block_sparse_fwd import (
    CONSUMER_THREADS,
    TILE_M,
    TILE_N,
    BlockSparseFwdSm90,
)

assert TILE_M == TILE_ROWS
WG_TOKENS = TILE_ROWS // WGMMA_GROUP  # tokens of a warpgroup's 64 rows
HALVES = BLOCK_KEYS // TILE_N  # 64-key tiles a block
WORDS = MAX_BLOCKS // 32
# FP8 / NVFP4: raw K and V of one tile ahead at one warpgroup a CTA (three CTAs an SM: 72 KB
# each), of two tiles ahead at two (two CTAs an SM), of three at four (one CTA an SM); FP8
# single-buffered (split_q) adjusts these in MsaUnionTileSm90.
RAW_STAGES = {1: 2, 2: 4, 4: 6}
# 16-bit K/V at two or four warpgroups a CTA: the SM's CTAs hold this much ring between them
# (4 or 8 stages of 16 KB a CTA, beside 32 or 64 KB of Q tiles).
SHARED_RING_BYTES_PER_SM = 128 * 1024
SCALE_BYTES = HEAD_DIM // NVFP4_GROUP  # NVFP4 scale bytes of a row
SMEM_PER_SM = 228 * 1024


class MsaUnionTileSm90(BlockSparseFwdSm90):
    def __init__(self, dtype, kv_format: str, warpgroups: int = 1):
        self.converted = kv_format != "16bit"
        assert warpgroups in RAW_STAGES
        # The MMAs' type: fp16 for converted K/V (see the module's docstring), else q's.
        super().__init__(cutlass.Float16 if self.converted else dtype, HEAD_DIM, warpgroups)
        self.tokens = warpgroups * WG_TOKENS  # of a CTA
        self.union_capacity = self.tokens * MAX_TOPK
        self.io_dtype = dtype  # q's and the output's
        self.kv_format = kv_format
        # NVFP4 tiles hold value x scale / 2^7 (decode_chunks in fp16): the factor their
        # products are multiplied back by.
        self.value_divisor_log2 = FP16_DIVISOR_LOG2 if kv_format == "nvfp4" else 0
        self.value_factor = 2.0**self.value_divisor_log2
        # Raw rows as stored: e4m3 a byte a value, NVFP4 two codes a byte (16-bit: unused).
        self.raw_type = cutlass.Uint8 if kv_format == "nvfp4" else cutlass.Float8E4M3FN
        self.raw_width = HEAD_DIM // 2 if kv_format == "nvfp4" else HEAD_DIM
        if warpgroups > 1:  # 16-bit: the CTA's ring (see SHARED_RING_BYTES_PER_SM)
            tile_bytes = TILE_N * HEAD_DIM * 2
            self.kv_stages = SHARED_RING_BYTES_PER_SM // self.ctas_per_sm // tile_bytes
        self.ring_stages = self.kv_stages
        # FP8 / NVFP4 at one CTA an SM (W = 4): tile j + 1 converted under tile j's P V.
        self.double_buffered = self.converted and self.ctas_per_sm == 1
        if self.converted:
            # The converted K tile (stage 0) and V tile (stage 1), and double-buffered
            # those of odd tiles (stages 2 and 3).
            self.kv_stages = 4 if self.double_buffered else 2
            self.ring_stages = RAW_STAGES[warpgroups]
        # FP8 K/V single-buffered: S = Q K^T on e4m3 wgmma, K as the raw ring holds it and Q
        # as two e4m3 parts (store_q_split); only V is converted.
        self.split_q = kv_format == "e4m3" and not self.double_buffered
        if self.split_q:
            # Two e4m3 Q tiles a warpgroup (its parts hi and lo: stages 2w, 2w + 1; the bytes
            # of its fp16 one).
            self.qk_type = cutlass.Float8E4M3FN
            self.q_stages = 2 * warpgroups
            # One fp16 stage (V's). The bytes of K's: at one warpgroup a fourth CTA an SM, at
            # two a raw tile more in the ring. MP1 on an H100, FP8 K/V, two interleaved rounds
            # (bench/results/2026-12-05_h100_msa_fp8_overlap.md), ms, chunked / s13 / s12:
            # W1 4.84-4.85 / 6.58-6.64 / 6.84-6.86 -> 4.65-4.73 / 5.64-5.66 / 6.60-6.61 (of
            # which S under V's conversion at three CTAs: 4.79-4.83 / 5.81 / 6.81), W2
            # 4.50-4.51 / 6.67-6.68 / 8.72-8.78 -> 4.42-4.46 / 6.56-6.62 / 8.59-8.64.
            self.kv_stages = 1
            if warpgroups > 1:
                self.ring_stages = RAW_STAGES[warpgroups] + 2
            else:
                self.ctas_per_sm = 4

    @cute.jit
    def launch(self, args, stream):
        d = self.head_dim
        mK, mV = args.mK, args.mV
        qk_mma, pv_mma = self.mmas()
        sQ_layout, sK_layout, sV_layout, sO_layout = self.smem_layouts()
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        # The raw e4m3 ring (16-bit K/V: unused, one byte): K and V tiles as stored, rows of
        # 128 bytes.
        raw_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (TILE_M, TILE_N, self.raw_width), self.raw_type, self.ring_stages
        )
        # NVFP4 scales of a tile: its rows' 8 bytes as 32 rows of 16 (TMA's least box width).
        scale_layout = cute.make_layout(
            (TILE_N // 2, 2 * SCALE_BYTES, self.ring_stages),
            stride=(2 * SCALE_BYTES, 1, TILE_N * SCALE_BYTES),
        )
        raw_size = 1
        scale_size = 1
        # TMA views of the (pages, Hkv, rows, X) cache: rows first, as (rows, X, Hkv, pages);
        # 16-bit V as (D, rows, Hkv, pages), the MN-major B operand of O += P V.
        if cutlass.const_expr(self.converted):
            raw_tile = cute.slice_(raw_layout, (None, None, 0))
            box = (TILE_N, self.raw_width)
            tma_k, tma_k_tensor = cpasync.make_tiled_tma_atom(
                tma_op, rows_view(mK, self.raw_width), raw_tile, box
            )
            tma_v, tma_v_tensor = cpasync.make_tiled_tma_atom(
                tma_op, rows_view(mV, self.raw_width), raw_tile, box
            )
            tile_bytes = cute.size_in_bytes(self.raw_type, raw_tile)
            raw_size = cute.cosize(raw_layout)
        else:
            v_view = cute.make_tensor(
                mV.iterator,
                cute.make_layout(
                    (d, mV.shape[2], mV.shape[1], mV.shape[0]),
                    stride=(1, mV.stride[2], mV.stride[1], mV.stride[0]),
                ),
            )
            tma_k, tma_k_tensor = cpasync.make_tiled_tma_atom(
                tma_op, rows_view(mK, d), cute.slice_(sK_layout, (None, None, 0)), (TILE_N, d)
            )
            tma_v, tma_v_tensor = cpasync.make_tiled_tma_atom(
                tma_op, v_view, cute.slice_(sV_layout, (None, None, 0)), (d, TILE_N)
            )
            tile_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0)))
        # The scale loads (other formats: K's and V's atoms again, never used).
        tma_ks, tma_ks_tensor, tma_vs, tma_vs_tensor = tma_k, tma_k_tensor, tma_v, tma_v_tensor
        if cutlass.const_expr(self.kv_format == "nvfp4"):
            scale_tile = cute.slice_(scale_layout, (None, None, 0))
            box = (TILE_N // 2, 2 * SCALE_BYTES)
            tma_ks, tma_ks_tensor = cpasync.make_tiled_tma_atom(
                tma_op, scale_rows_view(args.mKScale), scale_tile, box
            )
            tma_vs, tma_vs_tensor = cpasync.make_tiled_tma_atom(
                tma_op, scale_rows_view(args.mVScale), scale_tile, box
            )
            tile_bytes = tile_bytes + TILE_N * SCALE_BYTES
            scale_size = cute.cosize(scale_layout)

        warps = self.num_threads // 32
        capacity = self.union_capacity
        rows = TILE_M * self.warpgroups if self.split_q else 1  # (sRowFactor: split_q's)

        @cute.struct
        class SharedStorage:
            ring_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.ring_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.qk_type, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sRaw: cute.struct.Align[cute.struct.MemRange[self.raw_type, raw_size], 1024]
            sRawScale: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, scale_size], 128]
            sBits: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, WORDS], 16]
            sBase: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, WORDS], 16]
            sWarpSums: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, warps], 16]
            sQMax: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, warps], 16]
            sIds: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, capacity], 16]
            sPages: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, capacity], 16]
            sMask: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 2 * capacity], 16]
            sRowFactor: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, rows], 16]

        # The CTAs an SM that the register cap assumes must fit its shared memory (228 KB,
        # 1 KB of it reserved per CTA) too.
        smem_bytes = SharedStorage.size_in_bytes()
        assert self.ctas_per_sm * (smem_bytes + 1024) <= SMEM_PER_SM, smem_bytes
        tiles_bound = args.mQ.shape[0] // self.tokens + args.mCuQ.shape[0] - 1
        self.kernel(
            qk_mma, pv_mma, tma_k, tma_k_tensor, tma_v, tma_v_tensor, tma_ks, tma_ks_tensor,
            tma_vs, tma_vs_tensor, args, sQ_layout, sK_layout, sV_layout, sO_layout, raw_layout,
            scale_layout, tile_bytes, SharedStorage,
        ).launch(
            grid=[tiles_bound, mK.shape[1], 1],
            block=[self.num_threads, 1, 1],
            smem=smem_bytes,
            stream=stream,
            min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=100,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_k: cute.CopyAtom,
        mK_tma: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV_tma: cute.Tensor,
        tma_ks: cute.CopyAtom,
        mKS_tma: cute.Tensor,
        tma_vs: cute.CopyAtom,
        mVS_tma: cute.Tensor,
        args,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        raw_layout: cute.ComposedLayout,
        scale_layout: cute.Layout,
        tile_bytes: cutlass.Constexpr,
        SharedStorage: cutlass.Constexpr,
    ):
        cta, kv_head, _ = cute.arch.block_idx()
        seq, chunk = token_tile_of_cta(args.mCuQ, cta, self.tokens)
        runs = seq >= 0
        if args.hand_in != 0:
            # Only the tokens the tile of more warpgroups launched before handed off: its
            # tiles are whole groups of this one's (both align to the sequence's start).
            if runs:
                runs = args.mHandOff[args.mCuQ[seq] + chunk * self.tokens, kv_head] != 0
        if runs:
            loads = (tma_k, mK_tma, tma_v, mV_tma, tma_ks, mKS_tma, tma_vs, mVS_tma)
            self.attend_tile(
                qk_mma, pv_mma, loads, args, sQ_layout, sK_layout, sV_layout, sO_layout,
                raw_layout, scale_layout, tile_bytes, SharedStorage, kv_head, seq, chunk,
            )  # fmt: skip

    @cute.jit
    def attend_tile(
        self, qk_mma, pv_mma, loads, args, sQ_layout, sK_layout, sV_layout, sO_layout,
        raw_layout, scale_layout, tile_bytes, SharedStorage, kv_head, seq, chunk,
    ):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # Warpgroup wg owns the CTA's rows 64 wg .. 64 wg + 63: tokens 4 wg .. 4 wg + 3.
        wg = 0
        wg_tidx = tidx
        if cutlass.const_expr(self.warpgroups > 1):
            wg = warp // 4
            wg_tidx = tidx % CONSUMER_THREADS
        bar = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_threads)
        loader = warp == 0
        q_start = args.mCuQ[seq]
        seqlen_q = args.mCuQ[seq + 1] - q_start
        first_token = q_start + chunk * self.tokens
        tokens = cutlass.min(self.tokens, seqlen_q - chunk * self.tokens)
        seqlen_k, key_start, blocks = sequence_keys(args, seq)
        blocks = cutlass.min(blocks, MAX_BLOCKS)
        first_pos = seqlen_k - seqlen_q + chunk * self.tokens  # position of token 0
        if args.has_q_offset != 0:
            first_pos = args.mQOffset[seq] + chunk * self.tokens

        storage, sQ, sK, sV = self.shared_operands(SharedStorage, sQ_layout, sK_layout, sV_layout)
        warps = self.num_threads // 32
        ring_producer, ring_consumer = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ring_barriers.data_ptr(),
            num_stages=self.ring_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, warps),
            tx_count=tile_bytes,
        ).make_participants()
        sIds = storage.sIds.get_tensor(cute.make_layout(self.union_capacity))
        sPages = storage.sPages.get_tensor(cute.make_layout(self.union_capacity))
        sMask = storage.sMask.get_tensor(cute.make_layout(2 * self.union_capacity))
        num_union = block_union(
            args, storage.sBits.get_tensor(cute.make_layout(WORDS)),
            storage.sBase.get_tensor(cute.make_layout(WORDS)),
            storage.sWarpSums.get_tensor(cute.make_layout(warps)), sIds, sMask, tidx, seq,
            kv_head, first_token, tokens, blocks, self.num_threads,
        )  # fmt: skip
        keep = self.keeps_tile(args, num_union, first_token, tokens, kv_head, tidx)
        if keep:
            # Where each union block lies, for the loads: its page (flat: the one "page").
            for i in cutlass.range(tidx, num_union, self.num_threads, unroll=1):
                sPages[i] = 0
                if args.paged != 0:
                    sPages[i] = args.mPageTable[seq, sIds[i]]
            cute.arch.sync_threads()

            tiles = num_union * HALVES
            place = (sIds, sPages, key_start, kv_head)
            sRaw = storage.sRaw.get_tensor(raw_layout.outer, swizzle=raw_layout.inner)
            tSrQ, tSrK, tOrV, acc_S, acc_O, tScS_mn, row_max, row_sum = self.fragments(
                qk_mma, pv_mma, sQ, sRaw if self.split_q else sK, sV, wg_tidx
            )
            row_token, key_end = row_limits(
                args, tScS_mn, WGMMA_GROUP, tokens, seqlen_k, first_pos, wg * WG_TOKENS
            )
            t_max, t_sum = new_softmax_state(cute.size(row_max))  # the temperature lse's
            with_temperature = (args.want_lse != 0) & (args.temperature != 1.0)
            state = (row_max, row_sum, t_max, t_sum, with_temperature)
            masks = (sIds, sMask, row_token, key_end, tScS_mn, seqlen_k)
            wg_first_token = first_token + wg * WG_TOKENS
            wg_tokens = tokens - wg * WG_TOKENS
            if cutlass.const_expr(self.split_q):
                # This warpgroup's Q parts (hi, lo) and its rows' factors.
                q_stage = (tSrQ[None, None, None, 2 * wg], tSrQ[None, None, None, 2 * wg + 1])
                q_rows = (
                    (sQ[None, None, 2 * wg], sQ[None, None, 2 * wg + 1]), kv_head, wg_first_token,
                    wg_tokens, cute.make_tensor(
                        storage.sRowFactor.data_ptr() + TILE_M * wg, cute.make_layout(TILE_M)
                    ),
                )  # fmt: skip
            else:
                # This warpgroup's Q rows and its warps' entries of sQMax.
                q_stage = tSrQ[None, None, None, wg]
                q_rows = (
                    sQ[None, None, wg], kv_head, wg_first_token, wg_tokens,
                    cute.make_tensor(storage.sQMax.data_ptr() + 4 * wg, cute.make_layout(4)),
                )  # fmt: skip
            operands = (qk_mma, pv_mma, acc_S, acc_O, q_stage, tSrK, tOrV)
            if cutlass.const_expr(self.converted):
                sScale = storage.sRawScale.get_tensor(scale_layout)
                scale_log2 = self.stream_converted(
                    args, operands, state, masks, place, q_rows, tiles, loads, sRaw, sScale, sK, sV,
                    ring_producer, ring_consumer, wg_tidx, wg, loader, bar,
                )  # fmt: skip
            elif cutlass.const_expr(self.warpgroups == 1):
                scale_log2 = self.stream_16bit(
                    args, operands, state, masks, place, q_rows, tiles, loads, sK, sV,
                    ring_producer, ring_consumer, tidx, loader, bar,
                )  # fmt: skip
            else:
                scale_log2 = self.stream_16bit_shared(
                    args, operands, state, masks, place, q_rows, tiles, loads, sK, sV,
                    ring_producer, ring_consumer, wg_tidx, loader, bar,
                )  # fmt: skip

            rows = cute.size(row_max)
            row_lse = cute.make_rmem_tensor((rows,), cutlass.Float32)
            row_lse_t = cute.make_rmem_tensor((rows,), cutlass.Float32)
            out_scale = args.out_scale * self.value_factor
            finalize_rows(
                args, acc_O, state, row_lse, row_lse_t, self.p_offset, scale_log2, out_scale
            )
            self.store_rows(
                args, pv_mma, acc_O, row_lse, row_lse_t, storage, sO_layout, wg_tidx, wg, bar,
                kv_head, wg_first_token, wg_tokens,
            )  # fmt: skip

    @cute.jit
    def keeps_tile(self, args, num_union, first_token, tokens, kv_head, tidx):
        """Whether this CTA runs its tile: always without hand_off; with it, only when the
        union has at most hand_off x topk blocks (else the one-token kernel launched next
        runs its tokens, each over its own blocks). Marks its tokens in mHandOff."""
        keep = cutlass.Boolean(True)
        if args.hand_off > 0.0:
            topk = args.mIdx.shape[2]
            keep = cutlass.Float32(num_union) <= args.hand_off * cutlass.Float32(topk)
            handed = cutlass.Int32(1)
            if keep:
                handed = cutlass.Int32(0)
            for t in cutlass.range(tidx, tokens, self.num_threads, unroll=1):
                args.mHandOff[first_token + t, kv_head] = handed
        return keep

    @cute.jit
    def stream_16bit(
        self, args, operands, state, masks, place, q_rows, tiles, loads, sK, sV, kv_producer,
        kv_consumer, tidx, loader, bar,
    ):  # fmt: skip
        """K/V in q's dtype: the ring's load n is K of tile n // 2 (n even) or its V (n odd);
        S of tile j+1 is issued right behind P V of tile j, one wait covering both. Returns
        the softmax's scale (log2 units)."""
        qk_mma, pv_mma, acc_S, acc_O, sQ_stage, tSrK, tOrV = operands
        tma_k, mK_tma, tma_v, mV_tma = loads[:4]
        if loader:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            if tiles > 0:  # loads 0, 1: K and V of tile 0
                self.load_kv(kv_producer, tma_k, mK_tma, sK, args, place, 0, True)
                kv_producer.advance()
                self.load_kv(kv_producer, tma_v, mV_tma, sV, args, place, 0, False)
                kv_producer.advance()
            if tiles > 1:  # load 2: K of tile 1
                self.load_kv(kv_producer, tma_k, mK_tma, sK, args, place, 1, True)
                kv_producer.advance()
        self.store_q(args, *q_rows, tidx)
        if tiles > 0:
            k_handle = kv_consumer.wait_and_advance()
            self.qk(qk_mma, acc_S, sQ_stage, tSrK[None, None, None, k_handle.index])
            warpgroup.wait_group(0)
            k_handle.release()
        if loader:
            if tiles > 1:  # load 3: V of tile 1, into K of tile 0's stage
                self.load_kv(kv_producer, tma_v, mV_tma, sV, args, place, 1, False)
                kv_producer.advance()
        for j in cutlass.range(tiles - 1, unroll=1):
            v_handle = self.scores_then_pv(
                args, pv_mma, acc_S, acc_O, state, masks, tOrV, sV, kv_consumer, j, tidx, bar,
                args.scale_log2,
            )  # fmt: skip
            k_handle = kv_consumer.wait_and_advance()
            self.qk(qk_mma, acc_S, sQ_stage, tSrK[None, None, None, k_handle.index])
            warpgroup.wait_group(0)
            v_handle.release()
            k_handle.release()
            if loader:
                if j + 2 < tiles:  # loads 2j+4, 2j+5 into the two stages just released
                    self.load_kv(kv_producer, tma_k, mK_tma, sK, args, place, j + 2, True)
                    kv_producer.advance()
                    self.load_kv(kv_producer, tma_v, mV_tma, sV, args, place, j + 2, False)
                    kv_producer.advance()
        if tiles > 0:
            self.scores_then_pv(
                args, pv_mma, acc_S, acc_O, state, masks, tOrV, sV, kv_consumer, tiles - 1,
                tidx, bar, args.scale_log2, drain=True,
            )  # fmt: skip
        return args.scale_log2

    @cute.jit
    def stream_16bit_shared(
        self, args, operands, state, masks, place, q_rows, tiles, loads, sK, sV, kv_producer,
        kv_consumer, tidx, loader, bar,
    ):  # fmt: skip
        """16-bit K/V, the CTA's warpgroups on one ring (load n is K of tile n // 2 for even
        n, else its V): each warpgroup waits for K, computes S and its rows' probabilities,
        then waits for V and adds P V, each MMA waited for (at 128 registers S of the next
        tile is not issued behind P V). In tile j warp 0 refills, under S, the two stages
        every warpgroup released in tile j - 1. tidx: the thread's index in its warpgroup.
        Returns the softmax's scale (log2 units)."""
        qk_mma, pv_mma, acc_S, acc_O, sQ_stage, tSrK, tOrV = operands
        tma_k, mK_tma, tma_v, mV_tma = loads[:4]
        if loader:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            for u in cutlass.range_constexpr(self.kv_stages // 2):
                if u < tiles:
                    self.load_kv(kv_producer, tma_k, mK_tma, sK, args, place, u, True)
                    kv_producer.advance()
                    self.load_kv(kv_producer, tma_v, mV_tma, sV, args, place, u, False)
                    kv_producer.advance()
        self.store_q(args, *q_rows, tidx)
        ahead = self.kv_stages // 2  # tiles in the ring
        for j in cutlass.range(tiles, unroll=1):
            k_handle = kv_consumer.wait_and_advance()
            self.qk(qk_mma, acc_S, sQ_stage, tSrK[None, None, None, k_handle.index])
            if loader:
                if (j > 0) & (j - 1 + ahead < tiles):  # tile j - 1's stages, released
                    u = j - 1 + ahead
                    self.load_kv(kv_producer, tma_k, mK_tma, sK, args, place, u, True)
                    kv_producer.advance()
                    self.load_kv(kv_producer, tma_v, mV_tma, sV, args, place, u, False)
                    kv_producer.advance()
            warpgroup.wait_group(0)
            k_handle.release()
            self.scores_then_pv(
                args, pv_mma, acc_S, acc_O, state, masks, tOrV, sV, kv_consumer, j, tidx, bar,
                args.scale_log2, drain=True,
            )  # fmt: skip
        return args.scale_log2

    @cute.jit
    def stream_converted(
        self, args, operands, state, masks, place, q_rows, tiles, loads, sRaw, sScale, sK, sV,
        raw_producer, raw_consumer, tidx, wg, loader, bar,
    ):  # fmt: skip
        """FP8 / NVFP4 K/V: the raw ring's load n is K of tile n // 2 (n even) or its V (n
        odd), ring_stages / 2 tiles ahead; each tile is converted into an fp16 K tile and V
        tile (sK / sV stages 0 and 1, or with double_buffered 2 and 3 for odd tiles), each
        warpgroup its share of the rows, then every warpgroup multiplies its own rows by
        both. Single-buffered, the CTA converts a tile, then multiplies it; double-buffered,
        a warpgroup converts its share of tile j + 1 while its P V of tile j runs (one
        barrier a tile). tidx: the thread's index in its warpgroup `wg`. Returns the
        softmax's scale (log2 units: q's power of two and NVFP4's 2^7 folded in)."""
        qk_mma, pv_mma, acc_S, acc_O, sQ_stage, tSrK, tOrV = operands
        tma_k, _, tma_v, _, tma_ks, _, tma_vs, _ = loads
        ahead = self.ring_stages // 2  # tiles in the raw ring
        if loader:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            if cutlass.const_expr(self.kv_format == "nvfp4"):
                cpasync.prefetch_descriptor(tma_ks)
                cpasync.prefetch_descriptor(tma_vs)
            for u in cutlass.range_constexpr(ahead):
                if u < tiles:
                    raw_producer = self.load_raw_tile(
                        raw_producer, loads, sRaw, sScale, args, place, u
                    )
        sIds, seqlen_k = masks[0], masks[5]
        if cutlass.const_expr(self.split_q):
            row_factor = self.store_q_split(args, *q_rows, masks[4], tidx)
            v_stage = sV[None, None, 0]  # (D, keys), D contiguous: converted as rows
            v_rows = cute.make_tensor(v_stage.iterator, cute.select(v_stage.layout, mode=[1, 0]))
            for j in cutlass.range(tiles, unroll=1):
                valid_rows = seqlen_k - first_key_of(sIds, j, TILE_N)
                row = tidx
                if cutlass.const_expr(self.warpgroups > 1):
                    row = opaque_int32(tidx)  # (see convert_tile)
                bar.arrive_and_wait()  # every warp is done with tile j - 1's 16-bit V
                k_raw = raw_consumer.wait_and_advance()
                # S of the raw K runs while the warps convert V.
                self.qk_split(qk_mma, acc_S, sQ_stage, tSrK[None, None, None, k_raw.index])
                v_raw = raw_consumer.wait_and_advance()
                self.convert(sRaw, sScale, v_raw.index, v_rows, row, wg, valid_rows, True)
                v_raw.release()
                # The converted V (generic-proxy stores of every warp) to wgmma.
                cute.arch.fence_proxy("async.shared", space="cta")
                bar.arrive_and_wait()
                warpgroup.wait_group(0)
                k_raw.release()
                if loader:
                    if j + ahead < tiles:  # into tile j's stages (K's once every warp is done)
                        raw_producer = self.load_raw_tile(
                            raw_producer, loads, sRaw, sScale, args, place, j + ahead
                        )
                scale_rows(acc_S, row_factor)
                tOrP = self.own_block_probabilities(
                    args, acc_S, acc_O, state, masks, j, args.scale_log2
                )
                self.pv(pv_mma, acc_O, tOrP, tOrV[None, None, None, 0])
                warpgroup.wait_group(0)
            return args.scale_log2
        q_factor = self.store_q(args, *q_rows, tidx)
        scale_log2 = args.scale_log2 * q_factor * self.value_factor
        convert_args = (args, place, loads, sRaw, sScale, sK, sV, tidx, wg, loader)
        if cutlass.const_expr(not self.double_buffered):
            for j in cutlass.range(tiles, unroll=1):
                valid_rows = seqlen_k - first_key_of(sIds, j, TILE_N)
                bar.arrive_and_wait()  # every warp is done with tile j - 1's 16-bit K and V
                raw_producer, raw_consumer = self.convert_tile(
                    *convert_args, raw_producer, raw_consumer, tiles, j, valid_rows, 0
                )
                # The converted tiles (generic-proxy stores of every warp) to wgmma.
                cute.arch.fence_proxy("async.shared", space="cta")
                bar.arrive_and_wait()
                self.qk(qk_mma, acc_S, sQ_stage, tSrK[None, None, None, 0])
                warpgroup.wait_group(0)
                tOrP = self.own_block_probabilities(args, acc_S, acc_O, state, masks, j, scale_log2)
                self.pv(pv_mma, acc_O, tOrP, tOrV[None, None, None, 1])
                warpgroup.wait_group(0)
        else:
            if tiles > 0:
                valid_rows = seqlen_k - first_key_of(sIds, 0, TILE_N)
                raw_producer, raw_consumer = self.convert_tile(
                    *convert_args, raw_producer, raw_consumer, tiles, 0, valid_rows, 0
                )
            cute.arch.fence_proxy("async.shared", space="cta")
            bar.arrive_and_wait()
            for j in cutlass.range(tiles, unroll=1):
                buffer = j % 2
                self.qk(qk_mma, acc_S, sQ_stage, tSrK[None, None, None, 2 * buffer])
                warpgroup.wait_group(0)
                tOrP = self.own_block_probabilities(args, acc_S, acc_O, state, masks, j, scale_log2)
                self.pv(pv_mma, acc_O, tOrP, tOrV[None, None, None, 2 * buffer + 1])
                # Tile j + 1 into the other buffer, whose tile j - 1 every warpgroup's P V
                # read before the last barrier.
                if j + 1 < tiles:
                    valid_rows = seqlen_k - first_key_of(sIds, j + 1, TILE_N)
                    raw_producer, raw_consumer = self.convert_tile(
                        *convert_args, raw_producer, raw_consumer, tiles, j + 1, valid_rows,
                        1 - buffer,
                    )  # fmt: skip
                warpgroup.wait_group(0)
                cute.arch.fence_proxy("async.shared", space="cta")
                bar.arrive_and_wait()
        return scale_log2

    @cute.jit
    def convert_tile(
        self, args, place, loads, sRaw, sScale, sK, sV, tidx, wg, loader, raw_producer,
        raw_consumer, tiles, u, valid_rows, buffer,
    ):  # fmt: skip
        """The CTA's tile u (its keys valid up to valid_rows) from the raw ring into the fp16
        K and V stages 2 x buffer and 2 x buffer + 1 (this warpgroup's share), its raw
        stages released and refilled (warp 0) with tile u + ring_stages / 2. Returns the
        ring's ends (rebind them: a loop carries only what it rebinds)."""
        ahead = self.ring_stages // 2
        k_tile = sK[None, None, 2 * buffer]
        v_stage = sV[None, None, 2 * buffer + 1]  # (D, keys), D contiguous: converted as rows
        v_rows = cute.make_tensor(v_stage.iterator, cute.select(v_stage.layout, mode=[1, 0]))
        row = tidx
        if cutlass.const_expr(self.warpgroups > 1):
            # The tiles' addresses recomputed each tile: held across the loop, the
            # warpgroups' share of them spilled (the accumulators take 96 of 128 registers).
            row = opaque_int32(tidx)
        k_raw = raw_consumer.wait_and_advance()
        self.convert(sRaw, sScale, k_raw.index, k_tile, row, wg, valid_rows, False)
        k_raw.release()
        v_raw = raw_consumer.wait_and_advance()
        self.convert(sRaw, sScale, v_raw.index, v_rows, row, wg, valid_rows, True)
        v_raw.release()
        if loader:
            if u + ahead < tiles:  # tile u + ahead into the stages just released
                raw_producer = self.load_raw_tile(
                    raw_producer, loads, sRaw, sScale, args, place, u + ahead
                )
        return raw_producer, raw_consumer

    @cute.jit
    def load_raw_tile(self, producer, loads, sRaw, sScale, args, place, u):
        """TMA-load raw tile u into the ring's next two stages, K then V. Returns the ring's
        producer end (rebind it)."""
        for x in cutlass.range_constexpr(2):
            self.load_raw(producer, loads, sRaw, sScale, args, place, u, x == 1)
            producer.advance()
        return producer

    @cute.jit
    def convert(self, sRaw, sScale, stage, dst, tidx, wg, valid_rows, is_v: cutlass.Constexpr):
        """Warpgroup wg's share of the raw tile in `stage` (and of its NVFP4 scales, V's in
        the 4x4 swizzle) into dst: rows wg x 64 / warpgroups on (tidx: the thread's index in
        its warpgroup)."""
        rows = TILE_N // self.warpgroups
        src = sRaw[None, None, stage]
        valid = valid_rows
        if cutlass.const_expr(self.warpgroups > 1):
            src = cute.local_tile(src, (rows, self.raw_width), (wg, 0))
            dst = cute.local_tile(dst, (rows, HEAD_DIM), (wg, 0))
            valid = valid_rows - wg * rows
        if cutlass.const_expr(self.kv_format == "nvfp4"):
            # A share's scales are contiguous: rows x 8 bytes, linear or 4-row swizzled.
            scales = cute.make_tensor(
                sScale[None, None, stage].iterator + wg * rows * SCALE_BYTES,
                cute.make_layout(rows * SCALE_BYTES),
            )
            convert_nvfp4_tile(
                src, scales, dst, tidx, valid, is_v, self.value_divisor_log2
            )  # fmt: skip
        else:
            convert_e4m3_tile(src, dst, tidx, valid)

    @cute.jit
    def load_raw(self, producer, loads, sRaw, sScale, args, place, u, is_v: cutlass.Constexpr):
        """TMA-load K's (or V's) raw tile u, and its NVFP4 scale rows, into the ring's
        current stage (one barrier for both)."""
        tma_k, mK_tma, tma_v, mV_tma, tma_ks, mKS_tma, tma_vs, mVS_tma = loads
        handle = producer.acquire()
        src, dst = self.tile_partitions(
            tma_v if is_v else tma_k, mV_tma if is_v else mK_tma, sRaw, args, place, u, True
        )
        cute.copy(
            tma_v if is_v else tma_k, src, dst[None, handle.index], tma_bar_ptr=handle.barrier
        )
        if cutlass.const_expr(self.kv_format == "nvfp4"):
            sIds, sPages, _, kv_head = place
            g = cute.local_tile(
                cute.domain_offset(
                    ((u % HALVES) * (TILE_N // 2), 0),
                    (mVS_tma if is_v else mKS_tma)[None, None, kv_head, sPages[u // HALVES]],
                ),
                (TILE_N // 2, 2 * SCALE_BYTES),
                (None, 0),
            )
            atom = tma_vs if is_v else tma_ks
            tSs, tSg = cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(sScale, 0, 2),
                cute.group_modes(g, 0, 2),
            )  # fmt: skip
            cute.copy(atom, tSg[None, 0], tSs[None, handle.index], tma_bar_ptr=handle.barrier)

    @cute.jit
    def load_kv(self, producer, atom, mX_tma, sX, args, place, u, rows_first: cutlass.Constexpr):
        """TMA-load K or V of union tile u (in q's dtype) into the ring's current stage."""
        src, dst = self.tile_partitions(atom, mX_tma, sX, args, place, u, rows_first)
        handle = producer.acquire()
        cute.copy(atom, src, dst[None, handle.index], tma_bar_ptr=handle.barrier)

    @cute.jit
    def tile_partitions(self, atom, mX_tma, sX, args, place, u, rows_first: cutlass.Constexpr):
        """(TMA source, staged destinations) of union tile u: rows (u % 2) * 64 on of its
        block's page, or (flat) from the block's first key. mX_tma is a rows-first view
        (rows, X, Hkv, pages), or with rows_first False the (D, rows, Hkv, pages) one."""
        sIds, sPages, key_start, kv_head = place
        width = cute.size(sX, mode=[1]) if rows_first else cute.size(sX, mode=[0])
        j = u // HALVES
        row = (u % HALVES) * TILE_N
        if args.paged == 0:
            row = row + key_start + sIds[j] * BLOCK_KEYS
        page = sPages[j]
        if cutlass.const_expr(rows_first):
            g = cute.local_tile(
                cute.domain_offset((row, 0), mX_tma[None, None, kv_head, page]),
                (TILE_N, width),
                (None, 0),
            )
        else:
            g = cute.local_tile(
                cute.domain_offset((0, row), mX_tma[None, None, kv_head, page]),
                (width, TILE_N),
                (0, None),
            )
        tXsX, tXgX = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(g, 0, 2)
        )
        return tXgX[None, 0], tXsX

    @cute.jit
    def store_q(self, args, sQ, kv_head, first_token, tokens, sQMax, tidx):
        """The 64 Q rows (zero past the tile's tokens) into the Q tile by 16-byte stores, made
        visible to wgmma (the async proxy) for the whole warpgroup. sQ: the tile as wgmma
        reads it (its swizzle on the pointer, in bytes: sQ_layout's inner swizzle is not one
        of element offsets). Returns the factor the scores are to be multiplied by: 1, or
        for bf16 q in the fp16 tile the power of two the rows were divided by (the largest
        finite magnitude of the CTA's rows into [2^14, 2^15), into_fp16_range; the warps
        meet in sQMax)."""
        rows_copy = self.rows_copy(self.dtype)
        thr = rows_copy.get_slice(tidx)
        tQsQ = thr.partition_D(sQ)
        tQcQ = thr.partition_D(cute.make_identity_tensor((TILE_M, self.head_dim)))
        rQ = cute.make_fragment_like(tQsQ)
        rows = cute.make_fragment_like(tQsQ, self.io_dtype)
        load_q_rows(args, rows, tQcQ, kv_head, first_token, tokens)
        factor = cutlass.Float32(1.0)
        if cutlass.const_expr(self.io_dtype != self.dtype):
            values = rows.load().to(cutlass.Float32)
            top = warp_finite_max(values)
            if tidx % 32 == 0:
                sQMax[tidx // 32] = top
            cute.arch.sync_threads()
            for w in cutlass.range_constexpr(CONSUMER_THREADS // 32):
                top = cute.arch.fmax(top, sQMax[w])
            scaled, factor = into_fp16_range(values, top)
            rQ.store(scaled)
        else:
            rQ.store(rows.load())
        cute.copy(rows_copy, rQ, tQsQ)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        return factor

    @cute.jit
    def store_q_split(
        self, args, sQ_parts, kv_head, first_token, tokens, sRowFactor, tScS_mn, tidx
    ):
        """The 64 Q rows (zero past the tile's tokens) as two e4m3 tiles, hi and lo
        (split_into_e4m3, each row divided by its own power of two: a warpgroup's rows are 16
        heads whose magnitudes may differ by orders), by 8-byte stores, made visible to
        wgmma for the whole warpgroup. Returns the factors of the thread's rows of S
        (tScS_mn's rows), which their scores are to be multiplied by."""
        sHi, sLo = sQ_parts
        per_row = 8  # threads a row, 8 values each: 16-byte loads of 16-bit q
        parts_copy = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.qk_type, num_bits_per_copy=64),
            cute.make_layout((CONSUMER_THREADS // per_row, per_row), stride=(per_row, 1)),
            cute.make_layout((1, 8)),
        )
        thr = parts_copy.get_slice(tidx)
        tHsH = thr.partition_D(sHi)
        tLsL = thr.partition_D(sLo)
        tQcQ = thr.partition_D(cute.make_identity_tensor((TILE_M, HEAD_DIM)))
        rows = cute.make_fragment_like(tHsH, self.io_dtype)
        load_q_rows(args, rows, tQcQ, kv_head, first_token, tokens)
        rHi = cute.make_fragment_like(tHsH)
        rLo = cute.make_fragment_like(tLsL)
        for m in cutlass.range_constexpr(cute.size(tQcQ, mode=[1])):
            values = rows[None, m, None].load().to(cutlass.Float32)
            hi, lo, factor = split_into_e4m3(values, warp_finite_max(values, per_row))
            rHi[None, m, None].store(hi)
            rLo[None, m, None].store(lo)
            if tidx % per_row == 0:
                sRowFactor[tQcQ[0, m, 0][0]] = factor
        cute.copy(parts_copy, rHi, tHsH)
        cute.copy(parts_copy, rLo, tLsL)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        factors = cute.make_rmem_tensor((cute.size(tScS_mn, mode=[0]),), cutlass.Float32)
        for r in cutlass.range_constexpr(cute.size(factors)):
            factors[r] = sRowFactor[tScS_mn[r, 0][0]]
        return factors

    @cute.jit
    def qk_split(self, qk_mma, acc_S, q_parts, tSrK):
        """Issue S = (Q_hi + Q_lo) K^T for one tile, both parts into one accumulator
        (asynchronous: wait_group before reading acc_S)."""
        acc_S.fill(0.0)
        warpgroup.fence()
        for p in cutlass.range_constexpr(2):
            tSrQ = q_parts[p]
            for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
        warpgroup.commit_group()

    @cute.jit
    def own_block_probabilities(self, args, acc_S, acc_O, state, masks, u, scale_log2):
        """Tile u's scores in acc_S: each row keeps its token's blocks before its key_end;
        online softmax at scale_log2 (rescaling acc_O; and the temperature lse's sums); P in
        the A-operand layout of O += P V."""
        sIds, sMask, row_token, key_end, tScS_mn, _ = masks
        row_max, row_sum, t_max, t_sum, with_temperature = state
        acc_S_mn = acc_mn_view(acc_S)
        mask_to_own_blocks(
            acc_S_mn, tScS_mn, sMask, u // HALVES, first_key_of(sIds, u, TILE_N), row_token,
            key_end, TILE_N,
        )  # fmt: skip
        if with_temperature:
            temperature_update(t_max, t_sum, scale_log2 * args.temperature, acc_S_mn)
        softmax_update(row_max, row_sum, scale_log2, acc_S_mn, acc_mn_view(acc_O), self.p_offset)
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        return cute.make_tensor(rP.iterator, self.c_layout_as_a_layout(rP.layout))

    @cute.jit
    def scores_then_pv(
        self, args, pv_mma, acc_S, acc_O, state, masks, tOrV, sV, kv_consumer, u, tidx, bar,
        scale_log2, drain: cutlass.Constexpr = False,
    ):  # fmt: skip
        """16-bit K/V: tile u's probabilities, then issue O += P V (V rows past the sequence
        zeroed first). Returns V's stage handle, or with drain waits for every MMA issued and
        releases V's stage."""
        sIds, seqlen_k = masks[0], masks[5]
        tOrP = self.own_block_probabilities(args, acc_S, acc_O, state, masks, u, scale_log2)
        valid_keys = seqlen_k - first_key_of(sIds, u, TILE_N)
        return self.pv_staged(
            pv_mma, acc_O, tOrP, tOrV, sV, kv_consumer, valid_keys, tidx, bar, drain
        )

    @cute.jit
    def store_rows(
        self, args, pv_mma, acc_O, row_lse, row_lse_t, storage, sO_layout, tidx, wg, bar,
        kv_head, first_token, tokens,
    ):  # fmt: skip
        """Warpgroup wg's rows (its tokens from first_token; tidx: the thread's index in the
        warpgroup): lse and temperature lse (when asked), then O through shared memory (its
        Q tile, free by now) to each row's (token, head) by 16-byte stores."""
        tOcO_mn = acc_mn_view(
            pv_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((TILE_M, HEAD_DIM)))
        )
        if args.want_lse != 0:
            for r in cutlass.range_constexpr(cute.size(row_lse)):
                row = tOcO_mn[r, 0][0]
                if (tidx % 4 == 0) & (row // WGMMA_GROUP < tokens):
                    token = first_token + row // WGMMA_GROUP
                    head = kv_head * WGMMA_GROUP + row % WGMMA_GROUP
                    args.mLSE[token, head] = row_lse[r]
                    args.mLSET[token, head] = row_lse_t[r]
        sO = storage.sQ.get_tensor(sO_layout, dtype=self.io_dtype)[None, None, wg]
        tOrO, tOcO, _ = self.stage_output(pv_mma, acc_O, sO, self.io_dtype, tidx, bar)
        for m in cutlass.range_constexpr(cute.size(tOcO, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(tOcO, mode=[2])):
                row, col = tOcO[0, m, k][0], tOcO[0, m, k][1]
                if row // WGMMA_GROUP < tokens:
                    dst = row_chunk(args.mO, first_token, kv_head, row, col)
                    dst.store(chunk8(tOrO, m, k).load())


@cute.jit
def scale_rows(acc_S, factors):
    """Each row of S (acc_mn_view's) times its factor."""
    acc_S_mn = acc_mn_view(acc_S)
    for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            acc_S_mn[r, c] = acc_S_mn[r, c] * factors[r]


@cute.jit
def load_q_rows(args, rows, tQcQ, kv_head, first_token, tokens):
    """A thread's Q chunks of a warpgroup's rows copy (8 values each, at tQcQ's (row,
    column) coordinates) into the fragment `rows`, zero past the tile's tokens."""
    for m in cutlass.range_constexpr(cute.size(tQcQ, mode=[1])):
        for k in cutlass.range_constexpr(cute.size(tQcQ, mode=[2])):
            row, col = tQcQ[0, m, k][0], tQcQ[0, m, k][1]
            if row // WGMMA_GROUP < tokens:
                src = row_chunk(args.mQ, first_token, kv_head, row, col)
                chunk8(rows, m, k).store(src.load())
            else:
                chunk8(rows, m, k).fill(0)


def row_chunk(mX: cute.Tensor, first_token, kv_head, row, col):
    """Columns col .. col + 7 of a CTA row (token first_token + row // 16, head row % 16 of
    kv_head) in a (total_q, Hq, D) tensor."""
    token = first_token + row // WGMMA_GROUP
    head = kv_head * WGMMA_GROUP + row % WGMMA_GROUP
    return cute.local_tile(mX[token, head, None], (8,), (col // 8,))


def rows_view(mX: cute.Tensor, d: int) -> cute.Tensor:
    """The (pages, Hkv, rows, D) cache as TMA loads its row tiles: (rows, D, Hkv, pages)."""
    return cute.make_tensor(
        mX.iterator,
        cute.make_layout(
            (mX.shape[2], d, mX.shape[1], mX.shape[0]),
            stride=(mX.stride[2], 1, mX.stride[1], mX.stride[0]),
        ),
    )


def scale_rows_view(mS: cute.Tensor) -> cute.Tensor:
    """NVFP4 scales (pages, Hkv, rows, 8), each (page, head)'s rows contiguous, as TMA loads
    them: pairs of rows, (rows / 2, 16 bytes, Hkv, pages)."""
    return cute.make_tensor(
        mS.iterator,
        cute.make_layout(
            (mS.shape[2] // 2, 2 * SCALE_BYTES, mS.shape[1], mS.shape[0]),
            stride=(2 * SCALE_BYTES, 1, mS.stride[1], mS.stride[0]),
        ),
    )


def make_kernel(variant):
    kv_format = KV_FORMAT[variant.family.name]
    p = variant.params
    return MsaUnionTileSm90(element_type(p["dtype"]), kv_format, p.get("warpgroups", 1))
