"""Block-sparse attention forward for Hopper (sm_90a): TMA loads, wgmma, warp specialization.

Same contract as the portable template (the family ABI in generator/catalog.py): a unit is
64 query rows of one head with its list of 64-key tiles. A CTA owns `units` units that share
one list (units=2: two query heads of a GQA group, or the two halves of a 128-row block), so
each K/V tile it loads serves 64 * units query rows. mWork holds the CTA's units in
consecutive entries; -1 marks an empty second slot (computed on a copy, never written).

CTA = units consumer warpgroups + 1 producer warp:
  warps 4c..4c+3  consumer c: S = Q_c K^T (wgmma, both operands in shared memory), online
                  softmax in fp32 registers, O_c += P V (wgmma, P from registers)
  warp 4*units    producer: TMA of each Q_c once, then K and V of each listed tile by index
Pipelines (mbarriers, cutlass.pipeline.PipelineTmaAsync):
  q   `units` stages, stage c read by consumer c (4 warps arrive)
  kv  ring of kv_stages; K and V of a tile take consecutive stages; every consumer warp
      arrives on release (4 * units)
units=1 runs two CTAs per SM (96 KB of shared memory each): one CTA's softmax overlaps the
other's MMAs. TMA zero-fills key rows past the sequence end; keys past a tile's valid length
are masked to -inf before the softmax. A unit with no tiles writes O = 0 and LSE = -inf.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from generator.kernels.attention_common import (
    acc_mn_view,
    mask_columns,
    new_softmax_state,
    softmax_finalize,
    softmax_update,
)

TILE_M = 64
TILE_N = 64
WARPGROUP = 128


class BlockSparseFwdSm90:
    def __init__(self, dtype, head_dim: int, units: int, stages: int, overlap: bool):
        self.dtype = dtype
        self.head_dim = head_dim
        self.units = units
        self.kv_stages = stages
        self.overlap = overlap
        self.producer_warp = 4 * units
        self.num_threads = WARPGROUP * units + 32
        # As many CTAs per SM as shared memory holds (Q tiles + K/V stages, 16 KB each at D=128).
        tile_kb = TILE_M * 128 * 2 // 1024
        self.ctas_per_sm = min(3, 220 // (tile_kb * (units + stages) + 2))

    @staticmethod
    def can_implement(head_dim: int, units: int, stages: int) -> bool:
        return head_dim in (64, 128) and units in (1, 2) and stages >= 2

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mWork: cute.Tensor,
        mTileIdx: cute.Tensor,
        mTileCnt: cute.Tensor,
        mTileLen: cute.Tensor,
        scale_log2: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        d = self.head_dim
        # TMA views with the head last: Q, K as (seq, D, heads) (K-major operands) and V as
        # (D, seq, heads), the MN-major B operand of O += P V.
        q_view = cute.make_tensor(
            mQ.iterator,
            cute.make_layout((mQ.shape[0], d, mQ.shape[1]), stride=(mQ.stride[0], 1, mQ.stride[1])),
        )
        k_view = cute.make_tensor(
            mK.iterator,
            cute.make_layout((mK.shape[0], d, mK.shape[1]), stride=(mK.stride[0], 1, mK.stride[1])),
        )
        v_view = cute.make_tensor(
            mV.iterator,
            cute.make_layout((d, mV.shape[0], mV.shape[1]), stride=(1, mV.stride[0], mV.stride[1])),
        )

        qk_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (TILE_M, TILE_N),
        )
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN,
            cutlass.Float32, (1, 1, 1), (TILE_M, d), warpgroup.OperandSource.RMEM,
        )
        stages = self.kv_stages
        sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE_M, TILE_N, d), self.dtype, self.units)
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE_M, TILE_N, d), self.dtype, stages)
        sV_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (TILE_M, d, TILE_N), self.dtype, stages)
        # Output staging reuses each consumer's Q stage: 8x64 swizzled rows for 16-byte stores.
        sO_layout = cute.tile_to_shape(
            cute.make_composed_layout(
                cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
            ),
            (TILE_M, d, self.units),
            (0, 1, 2),
        )

        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_q_tensor = cpasync.make_tiled_tma_atom(
            tma_op, q_view, cute.slice_(sQ_layout, (None, None, 0)), (TILE_M, d)
        )
        tma_k, tma_k_tensor = cpasync.make_tiled_tma_atom(
            tma_op, k_view, cute.slice_(sK_layout, (None, None, 0)), (TILE_N, d)
        )
        tma_v, tma_v_tensor = cpasync.make_tiled_tma_atom(
            tma_op, v_view, cute.slice_(sV_layout, (None, None, 0)), (d, TILE_N)
        )
        tile_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0)))

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.units]
            kv_barriers: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]

        self.kernel(
            qk_mma, pv_mma, tma_q, tma_q_tensor, tma_k, tma_k_tensor, tma_v, tma_v_tensor,
            mO, mLSE, mWork, mTileIdx, mTileCnt, mTileLen, scale_log2,
            sQ_layout, sK_layout, sV_layout, sO_layout, tile_bytes, SharedStorage,
        ).launch(
            grid=[mWork.shape[0] // self.units, 1, 1],
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ_tma: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK_tma: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV_tma: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mWork: cute.Tensor,
        mTileIdx: cute.Tensor,
        mTileCnt: cute.Tensor,
        mTileLen: cute.Tensor,
        scale_log2: cutlass.Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tile_bytes: cutlass.Constexpr,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        num_chunks = cute.ceil_div(mO.shape[0], TILE_M)
        group = mO.shape[1] // mK_tma.shape[2]
        # The CTA's units share the first one's list (the planner pairs them that way).
        first = mWork[bidx * self.units]
        kv_head = (first // num_chunks) // group
        list_chunk = first % num_chunks
        num_tiles = mTileCnt[kv_head, list_chunk]

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        # Each output tile reuses its Q stage once S = Q K^T is done. Its swizzle is part of
        # the layout (element units), not of the pointer (byte units, as for the wgmma operands).
        sO = storage.sQ.get_tensor(sO_layout)

        producers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        q_consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, WARPGROUP // 32)
        kv_consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.units * WARPGROUP // 32)
        q_producer, q_consumer = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_barriers.data_ptr(), num_stages=self.units,
            producer_group=producers, consumer_group=q_consumers, tx_count=tile_bytes,
        ).make_participants()
        kv_producer, kv_consumer = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.kv_barriers.data_ptr(), num_stages=self.kv_stages,
            producer_group=producers, consumer_group=kv_consumers, tx_count=tile_bytes,
        ).make_participants()

        if warp == self.producer_warp:
            self.produce(
                tma_q, mQ_tma, tma_k, mK_tma, tma_v, mV_tma, sQ, sK, sV, q_producer, kv_producer,
                mWork, mTileIdx, bidx, num_chunks, kv_head, list_chunk, num_tiles,
            )
        if warp < self.producer_warp:
            consumer = warp // 4
            unit = mWork[bidx * self.units + consumer]
            writes = unit >= 0
            if not writes:
                unit = first
            head = unit // num_chunks
            q_consumer.advance(consumer)
            self.consume(
                qk_mma, pv_mma, sQ, sK, sV, sO[None, None, consumer], q_consumer, kv_consumer,
                mO, mLSE, mTileIdx, mTileLen, scale_log2, head, unit - head * num_chunks,
                kv_head, list_chunk, num_tiles, consumer, writes, tidx % WARPGROUP,
            )

    @cute.jit
    def produce(
        self, tma_q, mQ_tma, tma_k, mK_tma, tma_v, mV_tma, sQ, sK, sV, q_producer, kv_producer,
        mWork, mTileIdx, bidx, num_chunks, kv_head, list_chunk, num_tiles,
    ):
        d = self.head_dim
        gK = cute.local_tile(mK_tma[None, None, kv_head], (TILE_N, d), (None, 0))
        gV = cute.local_tile(mV_tma[None, None, kv_head], (d, TILE_N), (0, None))
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        cpasync.prefetch_descriptor(tma_q)
        cpasync.prefetch_descriptor(tma_k)
        cpasync.prefetch_descriptor(tma_v)

        first = mWork[bidx * self.units]
        for c in cutlass.range_constexpr(self.units):
            unit = mWork[bidx * self.units + c]
            if unit < 0:
                unit = first
            head = unit // num_chunks
            gQ = cute.local_tile(mQ_tma[None, None, head], (TILE_M, d), (unit - head * num_chunks, 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
            )
            handle = q_producer.acquire_and_advance()
            cute.copy(tma_q, tQgQ, tQsQ[None, handle.index], tma_bar_ptr=handle.barrier)
        for j in cutlass.range(num_tiles, unroll=1):
            tile = mTileIdx[kv_head, list_chunk, j]
            handle = kv_producer.acquire_and_advance()
            cute.copy(tma_k, tKgK[None, tile], tKsK[None, handle.index], tma_bar_ptr=handle.barrier)
            handle = kv_producer.acquire_and_advance()
            cute.copy(tma_v, tVgV[None, tile], tVsV[None, handle.index], tma_bar_ptr=handle.barrier)

    @cute.jit
    def consume(
        self, qk_mma, pv_mma, sQ, sK, sV, sO, q_consumer, kv_consumer, mO, mLSE, mTileIdx,
        mTileLen, scale_log2, head, chunk, kv_head, list_chunk, num_tiles, consumer, writes, tidx,
    ):
        d = self.head_dim
        # Both MMAs always accumulate (S is zeroed before each tile). Set once, here: a field set
        # inside a branch would not dominate its uses in later regions.
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        qk_thr = qk_mma.get_slice(tidx)
        pv_thr = pv_mma.get_slice(tidx)
        tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ))
        tSrK = qk_thr.make_fragment_B(qk_thr.partition_B(sK))
        tOrV = pv_thr.make_fragment_B(pv_thr.partition_B(sV))
        acc_O = cute.make_rmem_tensor(pv_thr.partition_shape_C((TILE_M, d)), cutlass.Float32)
        acc_O.fill(0.0)
        tScS_mn = acc_mn_view(qk_thr.partition_C(cute.make_identity_tensor((TILE_M, TILE_N))))
        tOcO_mn = acc_mn_view(pv_thr.partition_C(cute.make_identity_tensor((TILE_M, d))))
        row_max, row_sum = new_softmax_state(cute.size(tScS_mn, mode=[0]))

        q_handle = q_consumer.wait_and_advance()
        sQ_stage = tSrQ[None, None, None, q_handle.index]
        acc_S = cute.make_rmem_tensor(qk_thr.partition_shape_C((TILE_M, TILE_N)), cutlass.Float32)
        if cutlass.const_expr(self.overlap):
            # S of tile j+1 is computed on the tensor cores while tile j's softmax runs.
            acc_S_next = cute.make_rmem_tensor_like(acc_S)
            if num_tiles > 0:
                k_handle = kv_consumer.wait_and_advance()
                self.qk(qk_mma, acc_S, sQ_stage, tSrK[None, None, None, k_handle.index])
                warpgroup.wait_group(0)
                k_handle.release()
            for j in cutlass.range(num_tiles - 1, unroll=1):
                tile_len = mTileLen[mTileIdx[kv_head, list_chunk, j]]
                v_handle = kv_consumer.wait_and_advance()
                k_handle = kv_consumer.wait_and_advance()
                self.qk(qk_mma, acc_S_next, sQ_stage, tSrK[None, None, None, k_handle.index])
                tOrP = self.probabilities(acc_S, acc_O, tScS_mn, tile_len, row_max, row_sum, scale_log2)
                self.pv(pv_mma, acc_O, tOrP, tOrV[None, None, None, v_handle.index])
                warpgroup.wait_group(0)
                k_handle.release()
                v_handle.release()
                acc_S.store(acc_S_next.load())
            if num_tiles > 0:
                tile_len = mTileLen[mTileIdx[kv_head, list_chunk, num_tiles - 1]]
                v_handle = kv_consumer.wait_and_advance()
                tOrP = self.probabilities(acc_S, acc_O, tScS_mn, tile_len, row_max, row_sum, scale_log2)
                self.pv(pv_mma, acc_O, tOrP, tOrV[None, None, None, v_handle.index])
                warpgroup.wait_group(0)
                v_handle.release()
        else:
            for j in cutlass.range(num_tiles, unroll=1):
                tile_len = mTileLen[mTileIdx[kv_head, list_chunk, j]]
                k_handle = kv_consumer.wait_and_advance()
                self.qk(qk_mma, acc_S, sQ_stage, tSrK[None, None, None, k_handle.index])
                warpgroup.wait_group(0)
                k_handle.release()
                tOrP = self.probabilities(acc_S, acc_O, tScS_mn, tile_len, row_max, row_sum, scale_log2)
                v_handle = kv_consumer.wait_and_advance()
                self.pv(pv_mma, acc_O, tOrP, tOrV[None, None, None, v_handle.index])
                warpgroup.wait_group(0)
                v_handle.release()

        # Epilogue: normalise, LSE, O through shared memory (sQ is free now) to 16-byte stores.
        row_lse = cute.make_rmem_tensor(cute.size(row_max), cutlass.Float32)
        softmax_finalize(row_max, row_sum, scale_log2, acc_mn_view(acc_O), row_lse)
        rows_left = mO.shape[0] - chunk * TILE_M
        for r in cutlass.range_constexpr(cute.size(row_lse)):
            row = tOcO_mn[r, 0][0]
            if writes and tidx % 4 == 0 and row < rows_left:
                mLSE[chunk * TILE_M + row, head] = row_lse[r]

        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        pipeline.arrive_and_wait(barrier_id=1 + consumer, num_threads=WARPGROUP)
        r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), pv_mma)
        thr_r2s = r2s.get_slice(tidx)
        cute.copy(r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sO))
        pipeline.arrive_and_wait(barrier_id=1 + consumer, num_threads=WARPGROUP)

        elems = 128 // self.dtype.width
        per_row = d // elems if d < 64 else 64 // elems
        store = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128),
            cute.make_layout((WARPGROUP // per_row, per_row), stride=(per_row, 1)),
            cute.make_layout((1, elems)),
        )
        thr_store = store.get_slice(tidx)
        gO = cute.local_tile(mO[None, head, None], (TILE_M, d), (chunk, 0))
        tOsO = thr_store.partition_S(sO)
        tOgO = thr_store.partition_D(gO)
        tOcO = thr_store.partition_D(cute.make_identity_tensor((TILE_M, d)))
        tOrO = cute.make_fragment_like(tOgO, self.dtype)
        cute.copy(store, tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            if writes and tOcO[0, m, 0][0] < rows_left:
                cute.copy(store, tOrO[None, m, None], tOgO[None, m, None])

    @cute.jit
    def qk(self, qk_mma, acc_S, tSrQ, tSrK):
        """Issue S = Q K^T for one tile (asynchronous: wait_group before reading acc_S)."""
        acc_S.fill(0.0)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
        warpgroup.commit_group()

    @cute.jit
    def pv(self, pv_mma, acc_O, tOrP, tOrV):
        """Issue O += P V for one tile (asynchronous)."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(pv_mma, acc_O, tOrP[None, None, k], tOrV[None, None, k], acc_O)
        warpgroup.commit_group()

    @cute.jit
    def probabilities(self, acc_S, acc_O, tScS_mn, tile_len, row_max, row_sum, scale_log2):
        """Mask, online softmax (rescaling acc_O), and P in the A-operand register layout."""
        acc_S_mn = acc_mn_view(acc_S)
        if tile_len < TILE_N:
            mask_columns(acc_S_mn, tScS_mn, tile_len)
        softmax_update(row_max, row_sum, scale_log2, acc_S_mn, acc_mn_view(acc_O))
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        return cute.make_tensor(rP.iterator, self.c_layout_as_a_layout(rP.layout))

    def c_layout_as_a_layout(self, layout):
        """wgmma accumulator ((2, 2, N/8), M, 1) as the A operand ((2, 2, 2), M, N/16).

        Each 16-key k-block of P V is two neighbouring 8-column groups of S.
        """
        s, d = layout.shape, layout.stride
        return cute.make_layout(
            ((s[0][0], s[0][1], 2), s[1], s[0][2] // 2),
            stride=((d[0][0], d[0][1], d[0][2]), d[1], d[0][2] * 2),
        )


def make_kernel(variant):
    dtype = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[variant.dtype]
    if not BlockSparseFwdSm90.can_implement(variant.head_dim, variant.units, variant.stages):
        raise ValueError(f"sm90_wgmma: {variant} not supported")
    return BlockSparseFwdSm90(dtype, variant.head_dim, variant.units, variant.stages, variant.overlap)
