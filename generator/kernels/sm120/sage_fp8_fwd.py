"""Sage FP8 block-sparse attention forward for SM120 (sm_120f): TMA loads into a K / V^T ring,
warp-level e4m3 MMA (mma.sync m16n8k32, native QMMA on sm_120f). Built for sm_90a and sm_100f
too, where the same PTX is emulated through fp16 HMMA (correct, slow): the H200 runs and checks
it.

The math and the warps are the portable Sage template's (generator/kernels/portable/
sage_fp8_fwd.py, common/sage_math.py): one unit (64 query rows of one head) a CTA, four warps
of 16 rows (the per-tile P V accumulator beside O leaves no registers for 32). The loads are
the bf16 TMA template's (generator/kernels/sm120/block_sparse_fwd.py): warp 0 loads Q, then
load n of the ring is K of listed tile n // 2 (n even) or its V^T (n odd, V transposed in
global memory: keys contiguous), each refilled once every warp released its stage.
Shared memory: e4m3 rows of 64 bytes in 8-row atoms with the 64-byte swizzle (Swizzle(2, 4, 3)
on bytes, the same for TMA and ldmatrix): Q (64 x D), the ring's stages (64 x D for K, D x 64
for V^T: equal bytes). The bf16 output tile is staged over the ring once every warp is done.

Tails: TMA zero-fills Q rows and keys past the sequence; scores of keys >= tile_len are masked
to -inf and those keys zeroed in the staged V^T (0 * NaN would poison O); rows past Sq are not
written; a unit with no tiles writes O = 0 and LSE = -inf.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from generator.kernels.common.sage_math import (
    accumulate_tile,
    load_key_scales,
    load_row_scales,
    sage_softmax_step,
    scores_to_e4m3_operand,
)
from generator.kernels.common.softmax import acc_mn_view
from generator.kernels.common.tile_list import unit_of_cta
from generator.kernels.common.tma_views import seq_d_heads
from generator.kernels.portable.block_sparse_fwd import TILE_M, TILE_N, BlockSparseFwdWarpMma
from generator.kernels.portable.sage_fp8_fwd import SageFp8FwdWarpMma
from generator.kernels.sm120.block_sparse_fwd import BlockSparseFwdTmaWarpMma, ring_shape

WARPS = 4


class SageFp8FwdTmaWarpMma(BlockSparseFwdTmaWarpMma):
    def __init__(self, head_dim: int, arch: str):
        self.dtype = cutlass.Float8E4M3FN
        self.out_dtype = cutlass.BFloat16
        self.head_dim = head_dim
        self.units = 1
        self.rows = TILE_M
        self.warps = WARPS
        self.num_threads = 32 * WARPS
        tile_bytes = TILE_N * head_dim  # K (64 x D) and V^T (D x 64), one byte an element
        self.ctas_per_sm, self.kv_stages = ring_shape(arch, WARPS, tile_bytes, tile_bytes)
        # ldmatrix operands, the e4m3 MMA, the Sage epilogue
        self.warp_mma = SageFp8FwdWarpMma(head_dim)

    @staticmethod
    def can_implement(head_dim: int) -> bool:
        return head_dim in (64, 128)

    def smem_layouts(self):
        """Q (64, D, 1), the ring as K stages (64, D, kv_stages) and as V^T stages (D, 64,
        kv_stages), and the bf16 output tile (64, D) over the ring."""
        d = self.head_dim
        atom = cute.make_composed_layout(
            cute.make_swizzle(2, 4, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        q = cute.tile_to_shape(atom, (TILE_M, d, 1), (0, 1, 2))
        k = cute.tile_to_shape(atom, (TILE_N, d, self.kv_stages), (0, 1, 2))
        vt = cute.tile_to_shape(atom, (d, TILE_N, self.kv_stages), (0, 1, 2))
        out = BlockSparseFwdWarpMma.smem_layout(self.warp_mma, TILE_M)
        return q, k, vt, out

    @cute.jit
    def launch(self, args, stream):
        """Host side: TMA atoms (Q and K as (seq, D, heads), V^T as it is: (D, seq, heads)),
        shared memory, the launch."""
        q_layout, k_layout, vt_layout, out_layout = self.smem_layouts()
        d = self.head_dim
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(
            tma_op, seq_d_heads(args.mQ, d), cute.slice_(q_layout, (None, None, 0)), (TILE_M, d)
        )
        tma_k, mK_tma = cpasync.make_tiled_tma_atom(
            tma_op, seq_d_heads(args.mK, d), cute.slice_(k_layout, (None, None, 0)), (TILE_N, d)
        )
        tma_v, mVt_tma = cpasync.make_tiled_tma_atom(
            tma_op, args.mVt, cute.slice_(vt_layout, (None, None, 0)), (d, TILE_N)
        )
        SharedStorage = self.shared_storage(q_layout, k_layout)
        self.kernel(
            tma_q,
            mQ_tma,
            tma_k,
            mK_tma,
            tma_v,
            mVt_tma,
            args,
            q_layout,
            k_layout,
            vt_layout,
            out_layout,
            SharedStorage,
        ).launch(**self.launch_options(args.mWork, SharedStorage, stream))

    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        mQ_tma: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK_tma: cute.Tensor,
        tma_v: cute.CopyAtom,
        mVt_tma: cute.Tensor,
        args,
        q_layout: cute.ComposedLayout,
        k_layout: cute.ComposedLayout,
        vt_layout: cute.ComposedLayout,
        out_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bar = self.warp_mma.barrier  # the CTA's 128 threads, as store_output uses it
        d = self.head_dim
        head, chunk, kv_head, tile_ids, num_tiles = unit_of_cta(
            args, args.mO, mK_tma.shape[2], TILE_M
        )

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        # One byte an element: the layouts' swizzle is in bytes for ldmatrix (the layout) and
        # for TMA (the pointer) alike.
        sQ = storage.sQ.get_tensor(q_layout)
        sK = storage.sKV.get_tensor(k_layout)
        sVt = storage.sKV.get_tensor(vt_layout)
        sQ_tma, sK_tma, sVt_tma = (
            memory.get_tensor(layout.outer, swizzle=layout.inner)
            for memory, layout in (
                (storage.sQ, q_layout),
                (storage.sKV, k_layout),
                (storage.sKV, vt_layout),
            )
        )
        sO = cute.make_tensor(
            cute.recast_ptr(storage.sKV.data_ptr(), dtype=self.out_dtype), out_layout
        )
        q_producer, q_consumer, kv_producer, kv_consumer = self.pipelines(
            storage, TILE_M * d, TILE_N * d
        )
        k_load = self.ring_partition(tma_k, mK_tma, sK_tma, kv_head, (TILE_N, d), (None, 0))
        v_load = self.ring_partition(tma_v, mVt_tma, sVt_tma, kv_head, (d, TILE_N), (0, None))
        gQ = cute.local_tile(mQ_tma[None, None, head], (TILE_M, d), (chunk, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, cute.make_layout(1), cute.group_modes(sQ_tma, 0, 2),
            cute.group_modes(gQ, 0, 2),
        )  # fmt: skip
        kv_producer = self.start_loads(
            warp_idx,
            tma_q,
            [(tQgQ, tQsQ[None, 0])],
            q_producer,
            kv_producer,
            k_load,
            v_load,
            tile_ids,
            num_tiles,
        )

        tiled_mma = self.warp_mma.tiled_mma()
        acc_O, row_max, row_sum = self.attend_sage(
            args,
            tiled_mma,
            sQ[None, None, 0],
            sK,
            sVt,
            q_consumer,
            kv_producer,
            kv_consumer,
            k_load,
            v_load,
            head,
            kv_head,
            chunk,
            tile_ids,
            num_tiles,
            tidx,
            warp_idx,
            bar,
        )

        store_o = BlockSparseFwdWarpMma.tiled_copy_16b(
            cute.nvgpu.CopyUniversalOp(), self.out_dtype, 64
        )
        # store_output waits for every warp before it writes sO over the ring (the last V^T
        # reads).
        self.warp_mma.store_sage_output(
            args, tiled_mma, store_o, acc_O, row_max, row_sum, sO, head, kv_head, chunk, tidx
        )

    @cute.jit
    def attend_sage(
        self,
        args,
        tiled_mma,
        sQ,
        sK,
        sVt,
        q_consumer,
        kv_producer,
        kv_consumer,
        k_load,
        v_load,
        head,
        kv_head,
        chunk,
        tile_ids,
        num_tiles,
        tidx,
        warp_idx,
        bar,
    ):
        """The main loop: the bf16 TMA template's schedule with the Sage math of the portable
        template. Returns (O, row max, row sum), O neither normalised nor scaled by v_scale."""
        d = self.head_dim
        ldsm = self.warp_mma.ldmatrix_atom()
        q_operand = self.warp_mma.operand_a(tiled_mma, tidx, ldsm, sQ)
        tOrP, acc_S, acc_O, acc_PV, tScS_mn, state = self.warp_mma.sage_registers(tiled_mma, tidx)
        row_max, row_sum, alpha, beta, row_scale, key_scale = state
        acc_S_mn = acc_mn_view(acc_S)
        load_row_scales(args.mQScale, head, chunk * TILE_M, tScS_mn, args.scale_log2, row_scale)
        # V^T stages as (key, channel), for zeroing keys past a short tile (bytes: e4m3 has no
        # scalar stores).
        vt_bytes = cute.make_tensor(cute.recast_ptr(sVt.iterator, dtype=cutlass.Uint8), sVt.layout)
        keys_first = cute.make_layout((TILE_N, d), stride=(d, 1))

        q_consumer.wait_and_advance()
        for j in cutlass.range(num_tiles, unroll=1):
            tile = tile_ids[j]
            tile_len = args.mTileLen[tile]
            load_key_scales(args.mKScale[None, kv_head], tile, key_scale)
            k_handle = kv_consumer.wait_and_advance()
            acc_S.fill(0.0)
            k_operand = self.warp_mma.operand_b(
                tiled_mma, tidx, ldsm, sK[None, None, k_handle.index]
            )
            self.warp_mma.gemm_smem(tiled_mma, acc_S, q_operand, k_operand)
            k_handle.release()
            kv_producer = self.refill(  # into V^T of tile j - 1's stage
                kv_producer, k_load, v_load, tile_ids, num_tiles, warp_idx,
                2 * j - 1 + self.kv_stages,
            )  # fmt: skip

            sage_softmax_step(
                acc_S_mn, row_scale, key_scale, tScS_mn, tile_len, row_max, row_sum, alpha, beta
            )
            scores_to_e4m3_operand(acc_S_mn, tOrP)
            kv_producer = self.refill(
                kv_producer, k_load, v_load, tile_ids, num_tiles, warp_idx, 2 * j + self.kv_stages
            )

            v_handle = kv_consumer.wait_and_advance()
            if tile_len < TILE_N:
                self.zero_keys_from(
                    cute.composition(vt_bytes[None, None, v_handle.index], keys_first),
                    tile_len,
                    tidx,
                    bar,
                    cutlass.Uint8(0),
                )
            vt_operand = self.warp_mma.operand_b(
                tiled_mma, tidx, ldsm, sVt[None, None, v_handle.index]
            )
            acc_PV.fill(0.0)
            self.warp_mma.gemm_rA(tiled_mma, acc_PV, tOrP, vt_operand)
            v_handle.release()
            accumulate_tile(acc_mn_view(acc_O), acc_mn_view(acc_PV), alpha, beta)
        return acc_O, row_max, row_sum


def make_kernel(variant):
    p = variant.params
    if p["dtype"] != "e4m3" or not SageFp8FwdTmaWarpMma.can_implement(p["head_dim"]):
        raise ValueError(f"{variant.name}: {p['dtype']} head_dim {p['head_dim']} not supported")
    return SageFp8FwdTmaWarpMma(p["head_dim"], variant.arch)
