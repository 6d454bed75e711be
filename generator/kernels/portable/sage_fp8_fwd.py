"""Sage FP8 block-sparse attention forward with warp-level e4m3 MMA: the portable template.

mma.sync m16n8k32 e4m3 -> fp32 is native on sm_120f (SASS QMMA). sm_90a and sm_100f accept
the same PTX and emulate it with fp16 HMMA (correct, slow): the sm_90a build is there so the
code shipped for SM120 runs and is checked on the H200.

Same units, tiles and math as the sm90 template (generator/kernels/common/sage_math.py):
    S       = Q8 K8^T (e4m3 mma.sync, fp32)     * q_scale[row] * k_scale[key // 16] * sm_scale
    P8      = e4m3(exp2(S - tile max + 8))      per-row scale, in registers
    partial = P8 V8 (e4m3 mma.sync, fresh fp32) V8 is V transposed (K-major, as e4m3 needs)
    O       = O * alpha + partial * beta        fp32 (two-level accumulation)
    out     = bf16(O / l * v_scale[channel])

CTA = 4 warps (128 threads), 16 query rows per warp; one CTA owns one unit (64 query rows
of one head) and walks its list of 64-key tiles as the 16-bit portable template does:
    cp.async Q, K[t0]
    for each listed tile t_j:
        wait K[t_j]; barrier; cp.async V^T[t_j]     S = Q K^T (ldmatrix, one k-block ahead)
        wait V^T[t_j]; barrier; cp.async K[t_j+1]   Sage softmax, P8 into the A operand
                                                     partial = P8 V^T; O = O alpha + partial beta
    O *= v_scale; O /= l; LSE; O (bf16) through shared memory to 16-byte stores
Each barrier orders the reads of one buffer (K by S = Q K^T, V^T by P V) before the next
cp.async into it. Shared memory (e4m3, 8 x 64-byte swizzled atoms): Q and K (64 x D each,
contiguous: the bf16 output tile reuses both) and V^T (D x 64, keys contiguous): 12 KB
(D = 64) or 24 KB (D = 128). Registers on sm_120f (ptxas, no launch bounds): 168 at D = 64
(3 CTAs per SM), 254 at D = 128 (2 CTAs per SM: O and the per-tile P V accumulator are 64
fp32 registers each), no spills. Not yet timed on an SM120 GPU.

Tails: Q rows past Sq and K rows >= tile_len are zeroed in shared memory instead of loaded;
V^T keys >= tile_len are zeroed too (0 * NaN from padding would poison O), and the 16-key
chunk that tile_len cuts is copied byte by byte so that no key past the tile (possibly past
the end of the sequence) is read. Scores of keys >= tile_len are masked to -inf; rows past
Sq are not written; a unit with no tiles writes O = 0 and LSE = -inf.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from generator.families.sage_fp8_fwd import KEYS_PER_SCALE
from generator.kernels.common.sage_math import (
    accumulate_tile,
    load_channel_scales,
    load_key_scales,
    load_row_scales,
    new_sage_state,
    sage_softmax_step,
    scores_to_e4m3_operand,
)
from generator.kernels.common.softmax import acc_mn_view
from generator.kernels.common.tile_list import unit_of_cta
from generator.kernels.portable.block_sparse_fwd import (
    COPY_BYTES,
    NUM_THREADS,
    TILE_M,
    TILE_N,
    BlockSparseFwdWarpMma,
)


class SageFp8FwdWarpMma(BlockSparseFwdWarpMma):
    def __init__(self, head_dim: int):
        super().__init__(cutlass.Float8E4M3FN, head_dim)
        self.out_dtype = cutlass.BFloat16

    @cute.jit
    def launch(self, args, stream):
        """Host side: shared-memory layouts, copies and the MMA, then the launch."""
        d = self.head_dim
        sQK_layout = self.smem_layout(TILE_M)
        sVt_layout = self.smem_layout(d, TILE_N)
        # bf16 output staging: the 16-bit template's tiles, over sQ and sK.
        sO_layout = BlockSparseFwdWarpMma.smem_layout(self, TILE_M)

        @cute.struct
        class SharedStorage:
            sQK: cute.struct.Align[
                cute.struct.MemRange[self.dtype, 2 * cute.cosize(sQK_layout)], 1024
            ]
            sVt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sVt_layout)], 1024]

        # Q, K: a thread per 16 bytes of a D-byte row. V^T: 64-byte rows (one per channel).
        load_qk = self.load_copy(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL))
        load_vt = self.tiled_copy_16b(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype, TILE_N
        )
        store_o = self.tiled_copy_16b(cute.nvgpu.CopyUniversalOp(), self.out_dtype, 64)
        tiled_mma = self.tiled_mma()
        self.kernel(
            args,
            sQK_layout,
            sVt_layout,
            sO_layout,
            load_qk,
            load_vt,
            store_o,
            tiled_mma,
            SharedStorage,
        ).launch(grid=[args.mWork.shape[0], 1, 1], block=[NUM_THREADS, 1, 1], stream=stream)

    def smem_layout(self, rows: int, cols: int | None = None):
        """A (rows, cols = head_dim) e4m3 tile of 8 rows x 64 bytes; Swizzle<2,4,3> spreads
        the 16-byte units of 8 consecutive rows over all 8 units of a 128-byte line:
        conflict-free ldmatrix and cp.async."""
        atom = cute.make_composed_layout(
            cute.make_swizzle(2, 4, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        return cute.tile_to_shape(atom, (rows, cols or self.head_dim), (0, 1))

    def load_copy(self, op):
        """`op` over Q / K rows: a thread per 16 bytes of a D-byte row."""
        return self.tiled_copy_16b(op, self.dtype, self.head_dim)

    def tiled_mma(self):
        """mma.sync m16n8k32 e4m3 with fp32 accumulators."""
        return cute.make_tiled_mma(
            warp.MmaFP8Op(self.dtype, cutlass.Float32, (16, 8, 32)),
            (NUM_THREADS // 32, 1, 1),
            permutation_mnk=(TILE_M, 16, 32),  # 16 columns of B: one ldmatrix.x4 per k-block
        )

    @cute.kernel
    def kernel(
        self,
        args,
        sQK_layout: cute.ComposedLayout,
        sVt_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        load_qk: cute.TiledCopy,
        load_vt: cute.TiledCopy,
        store_o: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        d = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        head, chunk, kv_head, tile_ids, num_tiles = unit_of_cta(
            args, args.mQ, args.mK.shape[1], TILE_M
        )

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = cute.make_tensor(storage.sQK.data_ptr(), sQK_layout)
        sK = cute.make_tensor(storage.sQK.data_ptr() + cute.cosize(sQK_layout), sQK_layout)
        sVt = storage.sVt.get_tensor(sVt_layout)
        # bf16 64 x D is exactly sQ and sK's bytes; written once both are no longer read.
        sO = cute.make_tensor(
            cute.recast_ptr(storage.sQK.data_ptr(), dtype=self.out_dtype), sO_layout
        )

        gQ = cute.local_tile(args.mQ[None, head, None], (TILE_M, d), (chunk, 0))
        gK = cute.local_tile(args.mK[None, kv_head, None], (TILE_N, d), (None, 0))
        gVt = cute.local_tile(args.mVt[None, None, kv_head], (d, TILE_N), (0, None))
        # Byte views of V^T for the tile_len cut (see load_vt_tile).
        gVt_bytes = cute.local_tile(
            cute.recast_tensor(args.mVt, cutlass.Uint8)[None, None, kv_head], (d, TILE_N), (0, None)
        )
        sVt_bytes = cute.make_tensor(
            cute.recast_ptr(storage.sVt.data_ptr(), dtype=cutlass.Uint8), sVt_layout
        )
        thr_qk = load_qk.get_slice(tidx)
        thr_vt = load_vt.get_slice(tidx)
        q_load = (
            thr_qk.partition_S(gQ),
            thr_qk.partition_D(sQ),
            thr_qk.partition_S(cute.make_identity_tensor((TILE_M, d))),
        )
        k_load = (thr_qk.partition_S(gK), thr_qk.partition_D(sK))
        vt_load = (
            thr_vt.partition_S(gVt),
            thr_vt.partition_D(sVt),
            thr_vt.partition_S(cute.make_identity_tensor((d, TILE_N))),
            gVt_bytes,
            sVt_bytes,
        )
        q_rows_left = args.mQ.shape[0] - chunk * TILE_M

        acc_O, row_max, row_sum = self.attend_sage(
            args,
            load_qk,
            load_vt,
            tiled_mma,
            tidx,
            q_load,
            k_load,
            vt_load,
            sQ,
            sK,
            sVt,
            head,
            kv_head,
            chunk,
            tile_ids,
            num_tiles,
            q_rows_left,
        )

        # A unit with no tiles never waited for its Q copy: wait before sO (over sQ) is written.
        cute.arch.cp_async_wait_group(0)
        self.store_sage_output(
            args, tiled_mma, store_o, acc_O, row_max, row_sum, sO, head, kv_head, chunk, tidx
        )

    @cute.jit
    def store_sage_output(
        self, args, tiled_mma, store_o, acc_O, row_max, row_sum, sO, head, kv_head, chunk, tidx
    ):
        """The unit's O (bf16, scaled back per channel) and LSE through the staging tile sO
        (store_output: it waits for every warp before writing sO)."""
        d = self.head_dim
        # V was quantized per channel: the output columns are scaled back once normalised.
        tOcO_mn = acc_mn_view(
            tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((TILE_M, d)))
        )
        channel_scale = cute.make_fragment_like(acc_mn_view(acc_O)[0, None], cutlass.Float32)
        load_channel_scales(args.mVScale, kv_head, tOcO_mn, channel_scale)
        # Scores are already in log2 units (scale_log2 is inside row_scale).
        tOcO = store_o.get_slice(tidx).partition_D(cute.make_identity_tensor((TILE_M, d)))
        gO = cute.local_tile(args.mO[None, head, None], (TILE_M, d), (chunk, 0))
        self.store_output(
            tiled_mma,
            store_o,
            acc_O,
            row_max,
            row_sum,
            cutlass.Float32(1.0),
            sO,
            gO,
            tOcO,
            args.mQ.shape[0] - chunk * TILE_M,
            args.mLSE,
            chunk,
            head,
            tidx,
            channel_scale,
        )

    @cute.jit
    def attend_sage(
        self,
        args,
        load_qk,
        load_vt,
        tiled_mma,
        tidx,
        q_load,
        k_load,
        vt_load,
        sQ,
        sK,
        sVt,
        head,
        kv_head,
        chunk,
        tile_ids,
        num_tiles,
        q_rows_left,
    ):
        """The unit's main loop (module docstring). Returns (O, row max, row sum), O neither
        normalised nor scaled by v_scale."""
        tQgQ, tQsQ, tQcQ = q_load
        tKgK, tKsK = k_load
        tVgV, tVsV, tVcV, gVt_bytes, sVt_bytes = vt_load
        tOrP, acc_S, acc_O, acc_PV, tScS_mn, state = self.sage_registers(tiled_mma, tidx)
        row_max, row_sum, alpha, beta, row_scale, key_scale = state
        acc_S_mn = acc_mn_view(acc_S)
        ldsm = self.ldmatrix_atom()
        q_operand = self.operand_a(tiled_mma, tidx, ldsm, sQ)
        k_operand = self.operand_b(tiled_mma, tidx, ldsm, sK)
        vt_operand = self.operand_b(tiled_mma, tidx, ldsm, sVt)

        # Prologue: Q (rows past the sequence are zero) and the first K tile.
        self.load_rows(load_qk, tQgQ, tQsQ, tQcQ, q_rows_left)
        if num_tiles > 0:
            self.load_listed_k(load_qk, tKgK, tKsK, tQcQ, tile_ids, args.mTileLen, 0)
        cute.arch.cp_async_commit_group()
        load_row_scales(args.mQScale, head, chunk * TILE_M, tScS_mn, args.scale_log2, row_scale)

        for j in cutlass.range(num_tiles, unroll=1):
            tile = tile_ids[j]
            tile_len = args.mTileLen[tile]
            load_key_scales(args.mKScale[None, kv_head], tile, key_scale)
            # K[t_j] (and Q) landed; every warp is done reading V^T[t_j-1].
            cute.arch.cp_async_wait_group(0)
            self.barrier.arrive_and_wait()
            self.load_vt_tile(
                load_vt,
                tVgV[None, None, None, tile],
                tVsV,
                tVcV,
                gVt_bytes[None, None, tile],
                sVt_bytes,
                tile_len,
            )
            cute.arch.cp_async_commit_group()

            acc_S.fill(0.0)
            self.gemm_smem(tiled_mma, acc_S, q_operand, k_operand)

            # V^T[t_j] landed; every warp is done reading K[t_j].
            cute.arch.cp_async_wait_group(0)
            self.barrier.arrive_and_wait()
            if j + 1 < num_tiles:
                self.load_listed_k(load_qk, tKgK, tKsK, tQcQ, tile_ids, args.mTileLen, j + 1)
                cute.arch.cp_async_commit_group()

            sage_softmax_step(
                acc_S_mn, row_scale, key_scale, tScS_mn, tile_len, row_max, row_sum, alpha, beta
            )
            scores_to_e4m3_operand(acc_S_mn, tOrP)
            acc_PV.fill(0.0)
            self.gemm_rA(tiled_mma, acc_PV, tOrP, vt_operand)
            accumulate_tile(acc_mn_view(acc_O), acc_mn_view(acc_PV), alpha, beta)
        return acc_O, row_max, row_sum

    def ldmatrix_atom(self):
        """ldmatrix (non-transposed): 4 consecutive bytes along K per register, for A and
        for both K-major B operands (K, and V^T)."""
        return cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )

    @cute.jit
    def sage_registers(self, tiled_mma, tidx):
        """(P8, S, O, the tile's P V, S's coordinates, (row max, row sum, alpha, beta, row
        scale, key scale)): a unit's fragments and Sage softmax state, O zeroed."""
        d = self.head_dim
        thr_mma = tiled_mma.get_slice(tidx)
        # P8 as the A operand of P V: a compact ((4, 2, 2), 1, TILE_N / 32) e4m3 fragment, the
        # layout scores_to_e4m3_operand fills.
        tOrP = cute.make_rmem_tensor(thr_mma.partition_shape_A((TILE_M, TILE_N)), self.dtype)
        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, TILE_N)), cutlass.Float32)
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, d)), cutlass.Float32)
        acc_PV = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, d)), cutlass.Float32)
        acc_O.fill(0.0)
        tScS_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_M, TILE_N))))
        rows = cute.size(tScS_mn, mode=[0])
        state = new_sage_state(rows, TILE_N // KEYS_PER_SCALE)
        return tOrP, acc_S, acc_O, acc_PV, tScS_mn, state

    @cute.jit
    def load_vt_tile(self, load_vt, src, dst, coord, src_bytes, dst_bytes, tile_len):
        """V^T tile (D x 64 keys): cp.async the 16-key chunks below tile_len, zero the rest.

        A thread's chunks all start at the same key. The chunk that tile_len cuts is zeroed,
        then its valid keys are copied one byte at a time through the (D, 64) byte views
        (rare: tiles shorter than 64 keys), so no key at or past tile_len is read from global
        memory: it may lie past the end of the sequence.
        """
        first_key = coord[0, 0, 0][1]
        if first_key + COPY_BYTES <= tile_len:
            for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
                cute.copy(load_vt, src[None, m, None], dst[None, m, None])
        else:
            for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
                dst[None, m, None].fill(0)
            if first_key < tile_len:
                for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
                    channel = coord[0, m, 0][0]
                    for key in cutlass.range(first_key, tile_len, unroll=1):
                        dst_bytes[channel, key] = src_bytes[channel, key]


def make_kernel(variant):
    p = variant.params
    if p["dtype"] != "e4m3" or not SageFp8FwdWarpMma.can_implement(p["head_dim"]):
        raise ValueError(f"{variant.name}: {p['dtype']} head_dim {p['head_dim']} not supported")
    return SageFp8FwdWarpMma(p["head_dim"])
