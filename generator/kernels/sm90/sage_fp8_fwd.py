"""Sage FP8 block-sparse attention forward for Hopper (sm_90a): e4m3 wgmma, bf16 output.

The structure of the 16-bit kernel (block_sparse_fwd.py: one CTA = one warpgroup per 64-row
unit, warp 0 also issues the TMA loads, K/V ring) with e4m3 operands and the Sage scales
(generator/kernels/common/sage_math.py):
    S       = Q8 K8^T (e4m3 wgmma, fp32)        * q_scale[row] * k_scale[key // 16] * sm_scale
    P8      = e4m3(exp2(S - tile max + 8))      per-row scale, in registers
    partial = P8 V8 (e4m3 wgmma, fresh fp32)    V8 is V transposed (K-major, as e4m3 needs)
    O       = O * alpha + partial * beta        fp32 (two-level accumulation)
    out     = bf16(O / l * v_scale[channel])
P V runs in slices of at most 64 channels into one fp32 partial (32 registers). The kernel
is bound by instruction issue (its speed follows its instructions per tile: CONTRIBUTING.md,
Sage FP8) with few eligible warps, so it runs four warpgroups per SM (one per CTA: 128
registers each and a 40 KB ring, five stages at head_dim 128). Against
three CTAs with a producer warp and an 8-stage ring: F1 574/575 vs 569/569, F3 587/582 vs
578/578 TFLOPS (bench/results/2026-11-30_5e9155c+4cta_h200_sage_four_ctas_ab.md).
One unit a CTA, GQA included: units that list the same tiles (a kv head's query heads) share
K/V through the L2. Two or four of them as warpgroups of one CTA on one ring (as the 16-bit
kernel runs GQA) were 5-9% slower on F3: the kernel is issue-bound, not byte-bound, and
warpgroups waiting on one ring run their softmax in step
(bench/results/2026-12-04_1701517_h200_gqa_units_per_cta.md).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from generator.families.sage_fp8_fwd import KEYS_PER_SCALE
from generator.kernels.common.sage_math import (
    add_partial,
    load_channel_scales,
    load_key_scales,
    load_row_scales,
    new_sage_state,
    permuted_key,
    rescale_output,
    sage_softmax_step,
    scores_to_e4m3_operand_in_place,
)
from generator.kernels.common.softmax import acc_mn_view
from generator.kernels.common.tile_list import unit_of_cta
from generator.kernels.sm90.block_sparse_fwd import TILE_M, TILE_N, BlockSparseFwdSm90

CTAS_PER_SM = 4
# Four CTAs of Q (8 KB at head_dim 128) and this ring fit the SM's 228 KB; one more 8 KB
# stage would not.
RING_BYTES = 40 * 1024
# P V runs in column slices of at most 64 channels, each into the same fp32 partial
# accumulator (32 registers): at head_dim 128 a full-width partial (64 registers) does not
# fit the 128 registers of four CTAs per SM (nor paid at three: CONTRIBUTING.md).
PV_SLICE = 64


class SageFp8FwdSm90(BlockSparseFwdSm90):
    def __init__(self, head_dim: int):
        super().__init__(cutlass.Float8E4M3FN, head_dim, 1)
        self.v_major = OperandMajorMode.K
        self.kv_stages = RING_BYTES // (TILE_N * head_dim)  # e4m3: a byte each
        self.ctas_per_sm = CTAS_PER_SM
        self.pv_slice = min(head_dim, PV_SLICE)

    def k_tma_view(self, mK):
        """K for TMA: all heads' keys as one sequence, (keys, D), each 16 keys loaded into
        shared memory in the order e + 2 i + 8 h <- key e + 4 i + 2 h (e < 2, i < 4, h < 2):
        score column 2 i + e + 8 h then holds key 4 i + 2 h + e, so lane i % 4 of a quad
        holds keys 4 i .. 4 i + 3 of every 16, the bytes its e4m3 A operand of P V wants
        (no shuffles: scores_to_e4m3_operand_in_place). One sequence, because the permuted
        keys take four of TMA's five dimensions; the runtime passes K with a head stride that
        is a whole number of 64-key tiles (the template's "heads_in_whole_tiles" layout
        rule, generator/families/sage_fp8_fwd.py)."""
        s = mK.stride[0]
        groups = mK.shape[1] * (mK.stride[1] // (KEYS_PER_SCALE * s))
        keys = ((2, 4, 2), groups), ((s, 4 * s, 2 * s), KEYS_PER_SCALE * s)
        return cute.make_tensor(
            mK.iterator, cute.make_layout((keys[0], self.head_dim), stride=(keys[1], 1))
        )

    @cute.jit
    def launch(self, args, stream):
        """Host side: TMA atoms and layouts from the ABI's tensors, then the launch."""
        mK = args.mK
        (
            qk_mma,
            pv_mma,
            tma_q,
            tma_q_tensor,
            tma_k,
            tma_k_tensor,
            tma_v,
            tma_v_tensor,
            sQ_layout,
            sK_layout,
            sV_layout,
            sO_layout,
            tile_bytes,
        ) = self.operands(args.mQ, mK, args.mVt)
        pv_slice_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            OperandMajorMode.K,
            OperandMajorMode.K,
            cutlass.Float32,
            (1, 1, 1),
            (TILE_M, self.pv_slice),
            warpgroup.OperandSource.RMEM,
        )

        SharedStorage = self.shared_storage(sQ_layout, sK_layout)
        self.kernel(
            qk_mma,
            pv_mma,
            pv_slice_mma,
            tma_q,
            tma_q_tensor,
            tma_k,
            tma_k_tensor,
            tma_v,
            tma_v_tensor,
            args,
            mK.stride[1] // (TILE_N * mK.stride[0]),
            sQ_layout,
            sK_layout,
            sV_layout,
            sO_layout,
            tile_bytes,
            SharedStorage,
        ).launch(**self.launch_config(args.mWork, SharedStorage, stream))

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        pv_slice_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ_tma: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK_tma: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV_tma: cute.Tensor,
        args,
        k_tiles_per_head: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tile_bytes: cutlass.Constexpr,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, warp, wg, bar = self.warpgroup_of_thread()
        # (The kv head count from v_scale: the one-sequence K view has no head mode.)
        head, chunk, kv_head, tile_ids, num_tiles = unit_of_cta(
            args, args.mO, args.mVScale.shape[1], TILE_M, self.warpgroups, wg
        )

        storage, sQ, sK, sV = self.shared_operands(SharedStorage, sQ_layout, sK_layout, sV_layout)
        # The bf16 output tiles (twice sQ's bytes) reuse the K/V ring once every tile is used.
        sO = cute.make_tensor(
            cute.recast_ptr(storage.sKV.data_ptr(), dtype=cutlass.BFloat16), sO_layout
        )
        sO = sO[None, None, wg]
        q_producer, q_consumer, kv_producer, kv_consumer = self.pipelines(storage, tile_bytes)

        # The kv head's tiles of the one-sequence K view (k_tma_view).
        gK = cute.local_tile(mK_tma, (TILE_N, self.head_dim), (None, 0))
        gK = cute.domain_offset((0, 0, kv_head * k_tiles_per_head), gK)
        loads = self.load_partitions(
            tma_q, mQ_tma, tma_k, gK, tma_v, mV_tma, sQ, sK, sV, head, kv_head, chunk
        )
        self.consume_sage(
            qk_mma,
            pv_mma,
            pv_slice_mma,
            sQ,
            sK,
            sV,
            sO,
            q_producer,
            q_consumer,
            kv_producer,
            kv_consumer,
            loads,
            args.mO,
            args.mLSE,
            args.mQScale,
            args.mKScale,
            args.mVScale,
            tile_ids,
            args.mTileLen,
            args.scale_log2,
            head,
            kv_head,
            chunk,
            num_tiles,
            tidx,
            warp,
            wg,
            bar,
        )

    @cute.jit
    def consume_sage(
        self,
        qk_mma,
        pv_mma,
        pv_slice_mma,
        sQ,
        sK,
        sV,
        sO,
        q_producer,
        q_consumer,
        kv_producer,
        kv_consumer,
        loads,
        mO,
        mLSE,
        mQScale,
        mKScale,
        mVScale,
        tile_ids,
        mTileLen,
        scale_log2,
        head,
        kv_head,
        chunk,
        num_tiles,
        tidx,
        warp,
        wg,
        bar,
    ):
        """A warpgroup's work; warp 0 of the CTA also issues the loads.

        Load n of the ring is K of tile n // 2 (n even) or its V (n odd), into stage
        n % kv_stages. Warp 0 issues loads 0 .. kv_stages - 1 up front, then in tile j > 0,
        while the tensor core computes its S, the two loads whose stages tile j - 1
        released (in every warpgroup of the CTA), with tile ids read a tile earlier (no
        global load on warp 0's way to a TMA). F3 +2.4%:
        bench/results/2026-11-30_4df71ca+overlap_h200_sage_loads_under_qk_ab.md.
        """
        d = self.head_dim
        next_ids = cute.make_rmem_tensor(2, cutlass.Int32)
        kv_producer = self.start_ring(
            q_producer, kv_producer, loads, tile_ids, num_tiles, warp, wg, next_ids
        )
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        qk_thr = qk_mma.get_slice(tidx)
        pv_thr = pv_mma.get_slice(tidx)
        slice_thr = pv_slice_mma.get_slice(tidx)
        tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ))
        tSrK = qk_thr.make_fragment_B(qk_thr.partition_B(sK))
        # (values, column slice, k-block, stage): the V^T operand of each slice of P V.
        tOrV = slice_thr.make_fragment_B(slice_thr.partition_B(sV))
        tOrP = cute.make_rmem_tensor(slice_thr.partition_shape_A((TILE_M, TILE_N)), self.dtype)
        acc_S = cute.make_rmem_tensor(qk_thr.partition_shape_C((TILE_M, TILE_N)), cutlass.Float32)
        acc_O = cute.make_rmem_tensor(pv_thr.partition_shape_C((TILE_M, d)), cutlass.Float32)
        acc_PV = cute.make_rmem_tensor(
            slice_thr.partition_shape_C((TILE_M, self.pv_slice)), cutlass.Float32
        )
        acc_O.fill(0.0)
        acc_O_mn = acc_mn_view(acc_O)
        acc_PV_mn = acc_mn_view(acc_PV)
        acc_S_mn = acc_mn_view(acc_S)
        tScS_mn = acc_mn_view(qk_thr.partition_C(cute.make_identity_tensor((TILE_M, TILE_N))))
        rows = cute.size(tScS_mn, mode=[0])
        row_max, row_sum, alpha, beta, row_scale, key_scale = new_sage_state(
            rows, TILE_N // KEYS_PER_SCALE
        )
        load_row_scales(mQScale, head, chunk * TILE_M, tScS_mn, scale_log2, row_scale)

        # A tile's id is read while its predecessor's S is computed, its length and key scales
        # once that predecessor's softmax is done with theirs (same registers, no copies).
        tile_len = cutlass.Int32(0)
        head_scales = mKScale[None, kv_head]
        if num_tiles > 0:
            tile_len = self.load_tile_data(tile_ids[0], mTileLen, head_scales, key_scale)
        q_consumer.wait_and_advance()
        sQ_stage = tSrQ[None, None, None, wg]
        for j in cutlass.range(num_tiles, unroll=1):
            k_handle = kv_consumer.wait_and_advance()
            self.qk(qk_mma, acc_S, sQ_stage, tSrK[None, None, None, k_handle.index])
            # While the tensor core computes S: warp 0's loads, and the next tile's id.
            kv_producer = self.refill_ring(
                kv_producer, loads, tile_ids, num_tiles, warp, j, next_ids
            )
            next_tile = tile_ids[cutlass.min(j + 1, num_tiles - 1)]
            warpgroup.wait_group(0)
            k_handle.release()
            sage_softmax_step(
                acc_S_mn,
                row_scale,
                key_scale,
                tScS_mn,
                tile_len,
                row_max,
                row_sum,
                alpha,
                beta,
                permuted_key,
            )
            scores_to_e4m3_operand_in_place(acc_S_mn, tOrP)
            v_handle = kv_consumer.wait_and_advance()
            if tile_len < TILE_N:
                self.zero_keys_from(sV[None, None, v_handle.index], tile_len, tidx, bar)
            tile_len = self.load_tile_data(next_tile, mTileLen, head_scales, key_scale)
            rescale_output(acc_O_mn, alpha)
            for s in cutlass.range_constexpr(d // self.pv_slice):
                slice_v = tOrV[None, s, None, v_handle.index]  # (values, k-block)
                slice_v = cute.make_tensor(  # as (values, MMA_N = 1, k-block) for pv()
                    slice_v.iterator,
                    cute.make_layout(
                        (slice_v.shape[0], 1, slice_v.shape[1]),
                        stride=(slice_v.stride[0], 0, slice_v.stride[1]),
                    ),
                )
                self.fresh_product(pv_slice_mma, acc_PV, tOrP, slice_v)
                warpgroup.wait_group(0)
                add_partial(acc_O_mn, acc_PV_mn, beta, s * cute.size(acc_PV_mn, mode=[1]))
            v_handle.release()

        # V was quantized per channel: the output columns are scaled back once normalised.
        tOcO_mn = acc_mn_view(pv_thr.partition_C(cute.make_identity_tensor((TILE_M, d))))
        channel_scale = cute.make_fragment_like(acc_O_mn[0, None], cutlass.Float32)
        load_channel_scales(mVScale, kv_head, tOcO_mn, channel_scale)
        # Scores are already in log2 units (scale_log2 is inside row_scale).
        self.finish(
            pv_mma,
            acc_O,
            row_max,
            row_sum,
            cutlass.Float32(1.0),
            sO,
            mO,
            mLSE,
            head,
            chunk,
            tidx,
            bar,
            channel_scale,
        )

    @cute.jit
    def load_tile_data(self, tile, mTileLen, head_scales, key_scale):
        """Valid length of a tile; its key scales into key_scale."""
        load_key_scales(head_scales, tile, key_scale)
        return mTileLen[tile]

    @cute.jit
    def fresh_product(self, mma, acc, tA, tB):
        """Issue acc = A B: the first k-block overwrites acc (no zero fill of the registers,
        which a fill would cost every tile), the others accumulate."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            mma.set(warpgroup.Field.ACCUMULATE, k > 0)
            cute.gemm(mma, acc, tA[None, None, k], tB[None, None, k], acc)
        warpgroup.commit_group()


def make_kernel(variant):
    p = variant.params
    if p["dtype"] != "e4m3" or not SageFp8FwdSm90.can_implement(p["head_dim"]):
        raise ValueError(f"{variant.name}: {p['dtype']} head_dim {p['head_dim']} not supported")
    return SageFp8FwdSm90(p["head_dim"])
