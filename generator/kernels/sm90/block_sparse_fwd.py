"""Block-sparse attention forward for Hopper (sm_90a): TMA loads, wgmma, consumer
warpgroups of which warp 0 also issues the loads (no producer warp).

Same contract as the portable template (generator/families/block_sparse_fwd.py): a unit is
64 query rows of one head, run by one warpgroup that walks the unit's list of 64-key tiles.
A CTA has `warpgroups` consumer warpgroups, one unit each; their units list the same tiles
(the planner groups them: GQA heads of one kv head, 64-row units of one row block), so they
read one K/V ring, loaded once.

One warpgroup per CTA (any plan), three CTAs per SM (64 KB of shared memory each):
  S = Q K^T (wgmma, both operands in shared memory), online softmax in fp32 registers,
  O += P V (wgmma, P from registers); S of tile j+1 is issued right behind P V of tile j.
  Warp 0 also issues the TMA loads: Q once, then K and V of each listed tile by its index,
  each as soon as the consumers have released its stage.
  Without a producer warp a CTA may use 168 registers at three per SM (65536 / 384), all of
  which this schedule uses (head_dim 128); with a fifth warp the cap is 136, where ptxas
  serializes every wgmma (CONTRIBUTING.md). Interleaved A/B against the producer-warp version:
  W1 501/500 vs 484/491, W3 523/533 vs 505/527, W5 524 vs 514 TFLOPS
  (bench/results/2026-11-30_producerless_h200_bench_ab.md).
head_dim 256: one CTA per SM of one or two warpgroups (O alone takes 128 registers per
  thread); two share a ring of 4 stages.
Two or four warpgroups per CTA (consume_shared), four warpgroups per SM at 128 registers:
  a 160 KB ring per SM and no S(j+1) behind P V(j) (it needs ~138 registers). W3 with four:
  587 TFLOPS against 520 for 2-CTA clusters sharing tiles by multicast, W5 with two: 545
  against 518 (bench/results/2026-11-30_19c5b7a+w4_h200_shared_ring_interleaved_ab.md).
Pipelines (mbarriers, cutlass.pipeline.PipelineTmaAsync):
  q   1 stage, a tile per warpgroup; producers: warp 0 of each warpgroup (an elected arrive
      + the TMA bytes of its tile); consumers: every warp
  kv  kv_stages ring; K and V of a tile take consecutive stages; producer: warp 0 of the CTA
TMA zero-fills key rows past the sequence end; keys past a tile's valid length are masked
to -inf before the softmax and their V rows zeroed in shared memory. A unit with no tiles
writes O = 0 and LSE = -inf.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from generator.families.block_sparse_fwd import TILE_KEYS, UNIT_ROWS
from generator.kernels.common.entry import element_type, unit_launch_options
from generator.kernels.common.logit_options import (
    UnitLogits,
    apply_logit_options,
    load_mask_words,
    new_mask_words,
)
from generator.kernels.common.softmax import (
    acc_mn_view,
    mask_columns,
    new_softmax_state,
    probability_offset,
    saturated,
    softmax_finalize,
    softmax_update,
)
from generator.kernels.common.tile_list import unit_of_cta

TILE_M = UNIT_ROWS
TILE_N = TILE_KEYS
KV_STAGES = 3  # K, V, K in flight per CTA; 3 CTAs per SM (see the module docstring)
CTAS_PER_SM = 3
CONSUMER_THREADS = 128
# Warpgroups sharing one ring: four per SM (128 registers each), CTAs that hold this much
# ring per SM between them.
SHARED_RING_BYTES_PER_SM = 160 * 1024
# head_dim 256, two warpgroups: Q tiles and K/V ring within this (of 227 KB per CTA).
D256_SMEM_BYTES = 192 * 1024


class BlockSparseFwdSm90:
    def __init__(self, dtype, head_dim: int, warpgroups: int = 1, logits: str | None = None):
        self.dtype = dtype
        # S = Q K^T's operand type and the Q tiles (one a warpgroup): q's dtype here; a
        # subclass may multiply in another (the MSA tile: e4m3 Q in two parts against FP8 K).
        self.qk_type = dtype
        self.q_stages = warpgroups
        self.logits = logits  # block_sparse_fwd_logits' kind (LOGIT_KINDS), or None
        self.head_dim = head_dim
        self.warpgroups = warpgroups
        self.p_offset = probability_offset(dtype)
        self.num_threads = CONSUMER_THREADS * warpgroups  # warp 0 also issues the loads
        self.v_major = OperandMajorMode.MN
        self.kv_stages = KV_STAGES
        self.ctas_per_sm = CTAS_PER_SM
        tile_bytes = TILE_N * head_dim * dtype.width // 8
        if head_dim == 256:
            # One CTA per SM: a 64 x 256 fp32 O takes 128 registers per thread. Two
            # warpgroups share a ring of what shared memory is left beside their Q tiles.
            self.ctas_per_sm = 1
            if warpgroups > 1:
                q_bytes = warpgroups * TILE_M * head_dim * dtype.width // 8
                self.kv_stages = (D256_SMEM_BYTES - q_bytes) // tile_bytes
        elif warpgroups > 1:
            self.ctas_per_sm = 4 // warpgroups
            ring_bytes = SHARED_RING_BYTES_PER_SM // self.ctas_per_sm
            self.kv_stages = ring_bytes // tile_bytes

    @staticmethod
    def can_implement(head_dim: int) -> bool:
        return head_dim in (64, 128, 256)

    @cute.jit
    def launch(self, args, stream):
        """Host side: TMA atoms and layouts from the ABI's tensors, then the launch."""
        mV = args.mV
        v_view = cute.make_tensor(
            mV.iterator,
            cute.make_layout(
                (self.head_dim, mV.shape[0], mV.shape[1]), stride=(1, mV.stride[0], mV.stride[1])
            ),
        )
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
        ) = self.operands(args.mQ, args.mK, v_view)

        SharedStorage = self.shared_storage(sQ_layout, sK_layout)
        self.kernel(
            qk_mma,
            pv_mma,
            tma_q,
            tma_q_tensor,
            tma_k,
            tma_k_tensor,
            tma_v,
            tma_v_tensor,
            args,
            sQ_layout,
            sK_layout,
            sV_layout,
            sO_layout,
            tile_bytes,
            SharedStorage,
        ).launch(**self.launch_config(args.mWork, SharedStorage, stream))

    def shared_storage(self, sQ_layout, sK_layout):
        """The CTA's shared memory: the Q and K/V pipelines' barriers, the Q tiles and the
        K/V ring."""

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            kv_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]

        return SharedStorage

    def launch_config(self, mWork, SharedStorage, stream) -> dict:
        """One CTA per `warpgroups` entries of mWork."""
        return unit_launch_options(
            mWork, self.warpgroups, self.num_threads, self.ctas_per_sm, SharedStorage, stream
        )

    def operands(self, mQ, mK, v_view):
        """MMAs, shared-memory layouts and TMA atoms (trace time).

        TMA views have the head last: Q, K as (seq, D, heads), the K-major operands of
        S = Q K^T; `v_view` is V as (D, seq, heads), the B operand of O += P V, whose major
        mode is `self.v_major` (MN for 16-bit V in its natural layout, K for e4m3).
        """
        d = self.head_dim
        q_view = cute.make_tensor(
            mQ.iterator,
            cute.make_layout((mQ.shape[0], d, mQ.shape[1]), stride=(mQ.stride[0], 1, mQ.stride[1])),
        )
        k_view = self.k_tma_view(mK)
        qk_mma, pv_mma = self.mmas()
        sQ_layout, sK_layout, sV_layout, sO_layout = self.smem_layouts()
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
        return (
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
        )

    def mmas(self):
        """S = Q K^T (both operands K-major in shared memory) and O += P V (P from registers,
        V of major mode `self.v_major`), fp32 accumulators, one warpgroup's 64 rows."""
        d = self.head_dim
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            self.qk_type,
            self.qk_type,
            OperandMajorMode.K,
            OperandMajorMode.K,
            cutlass.Float32,
            (1, 1, 1),
            (TILE_M, TILE_N),
        )
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            OperandMajorMode.K,
            self.v_major,
            cutlass.Float32,
            (1, 1, 1),
            (TILE_M, d),
            warpgroup.OperandSource.RMEM,
        )
        return qk_mma, pv_mma

    def smem_layouts(self):
        """Shared-memory layouts: the warpgroups' Q tiles, the K and V ring (kv_stages tiles)
        and the output staging tiles."""
        d = self.head_dim
        v_enum = (
            LayoutEnum.ROW_MAJOR if self.v_major == OperandMajorMode.K else LayoutEnum.COL_MAJOR
        )
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (TILE_M, TILE_N, d), self.qk_type, self.q_stages
        )
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (TILE_M, TILE_N, d), self.dtype, self.kv_stages
        )
        sV_layout = sm90_utils.make_smem_layout_b(
            v_enum, (TILE_M, d, TILE_N), self.dtype, self.kv_stages
        )
        # Output staging, one tile per warpgroup: plain 8x64 swizzled rows (16-bit) for
        # 16-byte global stores.
        sO_layout = cute.tile_to_shape(
            cute.make_composed_layout(
                cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
            ),
            (TILE_M, d, self.warpgroups),
            (0, 1, 2),
        )
        return sQ_layout, sK_layout, sV_layout, sO_layout

    def k_tma_view(self, mK):
        """K as TMA loads it: (seq, D, heads), the K-major B operand of S = Q K^T."""
        return cute.make_tensor(
            mK.iterator,
            cute.make_layout(
                (mK.shape[0], self.head_dim, mK.shape[1]), stride=(mK.stride[0], 1, mK.stride[1])
            ),
        )

    def shared_operands(self, SharedStorage, sQ_layout, sK_layout, sV_layout):
        """The shared storage and its Q tile and K/V ring (K and V stages share the bytes)."""
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        return storage, sQ, sK, sV

    def pipelines(self, storage, tile_bytes):
        """Q (one stage, a tile per warpgroup, each loaded by its warp 0) and the K/V ring
        (loaded by warp 0 of the CTA; a stage is refilled once every warp released it)."""
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_threads // 32)
        q_producer, q_consumer = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_barriers.data_ptr(),
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.warpgroups),
            consumer_group=consumer_warps,
            tx_count=tile_bytes,
        ).make_participants()
        kv_producer, kv_consumer = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.kv_barriers.data_ptr(),
            num_stages=self.kv_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=consumer_warps,
            tx_count=tile_bytes,
        ).make_participants()
        return q_producer, q_consumer, kv_producer, kv_consumer

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
        args,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tile_bytes: cutlass.Constexpr,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, warp, wg, bar = self.warpgroup_of_thread()
        head, chunk, kv_head, tile_ids, num_tiles = unit_of_cta(
            args, args.mO, mK_tma.shape[2], TILE_M, self.warpgroups, wg
        )

        storage, sQ, sK, sV = self.shared_operands(SharedStorage, sQ_layout, sK_layout, sV_layout)
        # A warpgroup's output tile reuses its sQ bytes once S = Q K^T is done. Its swizzle is
        # part of the layout (element units), not of the pointer (byte units, as for wgmma).
        sO = storage.sQ.get_tensor(sO_layout)[None, None, wg]
        q_producer, q_consumer, kv_producer, kv_consumer = self.pipelines(storage, tile_bytes)

        gK = cute.local_tile(mK_tma[None, None, kv_head], (TILE_N, self.head_dim), (None, 0))
        logits = None
        if cutlass.const_expr(self.logits is not None):
            logits = UnitLogits(
                args, kv_head, head, chunk * TILE_M, qk_mma, tidx, (TILE_M, TILE_N), self.logits
            )
        loads = self.load_partitions(
            tma_q, mQ_tma, tma_k, gK, tma_v, mV_tma, sQ, sK, sV, head, kv_head, chunk
        )
        work = (
            qk_mma,
            pv_mma,
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
            logits,
        )
        if cutlass.const_expr(self.warpgroups == 1):
            self.consume(*work)
        else:
            self.consume_shared(*work)

    def warpgroup_of_thread(self):
        """(thread index in its warpgroup, warp index in the CTA, warpgroup, the warpgroup's
        named barrier)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if cutlass.const_expr(self.warpgroups == 1):
            return tidx, warp, 0, pipeline.NamedBarrier(barrier_id=1, num_threads=CONSUMER_THREADS)
        wg = warp // 4
        bar = pipeline.NamedBarrier(barrier_id=1 + wg, num_threads=CONSUMER_THREADS)
        return tidx % CONSUMER_THREADS, warp, wg, bar

    @cute.jit
    def load_partitions(
        self, tma_q, mQ_tma, tma_k, gK, tma_v, mV_tma, sQ, sK, sV, head, kv_head, chunk
    ):
        """(atom, global source, shared destination) of this warpgroup's Q tile and of K and V
        by tile id (gK: the kv head's K tiles, (TILE_N, D, tile)); Q's destination is indexed
        by warpgroup."""
        d = self.head_dim
        gQ = cute.local_tile(mQ_tma[None, None, head], (TILE_M, d), (chunk, 0))
        gV = cute.local_tile(mV_tma[None, None, kv_head], (d, TILE_N), (0, None))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        return (tma_q, tQgQ, tQsQ), (tma_k, tKgK, tKsK), (tma_v, tVgV, tVsV)

    @cute.jit
    def load_q(self, q_producer, q_load, wg):
        """Warp 0 of each warpgroup: its Q tile (the stage completes with every tile)."""
        atom, src, dst = q_load
        cpasync.prefetch_descriptor(atom)
        handle = q_producer.acquire()
        cute.copy(atom, src, dst[None, wg], tma_bar_ptr=handle.barrier)

    @cute.jit
    def ring_load(self, kv_producer, k_load, v_load, n, tile):
        """Issue load n of the ring (K of `tile` for even n, V for odd) into its stage."""
        if n % 2 == 0:
            self.load_tile(kv_producer, k_load, tile)
        else:
            self.load_tile(kv_producer, v_load, tile)

    @cute.jit
    def read_load_ids(self, tile_ids, num_tiles, first, ids):
        """Tile ids of loads first and first + 1 (clamped to the list, whose entries past
        its end are not used; the list must not be empty: its "last entry" would lie
        before the row). A predicated read instead of the clamp cost F1 6%:
        bench/results/2026-12-01_37d12d3_vs_592542c_h200_tile_id_reads_ab.md."""
        for i in cutlass.range_constexpr(2):
            ids[i] = tile_ids[cutlass.min((first + i) // 2, num_tiles - 1)]

    @cute.jit
    def start_ring(self, q_producer, kv_producer, loads, tile_ids, num_tiles, warp, wg, next_ids):
        """Ring loops: each warpgroup's Q; warp 0 fills the ring (loads 0 .. kv_stages - 1, load
        n being K of tile n // 2 for even n, else its V, into stage n % kv_stages) and reads
        the tile ids of the next two loads. Returns the producer (callers rebind it: its state
        advanced here)."""
        q_load, k_load, v_load = loads
        if warp % 4 == 0:
            self.load_q(q_producer, q_load, wg)
        if warp == 0:
            cpasync.prefetch_descriptor(k_load[0])
            cpasync.prefetch_descriptor(v_load[0])
            for n in cutlass.range(cutlass.min(2 * num_tiles, self.kv_stages), unroll=1):
                self.ring_load(kv_producer, k_load, v_load, n, tile_ids[n // 2])
                kv_producer.advance()
            if num_tiles > 0:  # an empty list has no ids to read (refill_ring never runs)
                self.read_load_ids(tile_ids, num_tiles, self.kv_stages, next_ids)
        return kv_producer

    @cute.jit
    def refill_ring(self, kv_producer, loads, tile_ids, num_tiles, warp, j, next_ids):
        """Ring loops, tile j > 0, warp 0: the two loads whose stages tile j - 1 released (in
        every warpgroup), with the ids read a tile earlier; then the next two ids. Returns the
        producer (rebind it in the loop, or the loop does not carry its state)."""
        _, k_load, v_load = loads
        if warp == 0:
            if j > 0:
                first = 2 * j - 2 + self.kv_stages
                for i in cutlass.range_constexpr(2):
                    if first + i < 2 * num_tiles:
                        self.ring_load(kv_producer, k_load, v_load, first + i, next_ids[i])
                        kv_producer.advance()
                self.read_load_ids(tile_ids, num_tiles, 2 * j + self.kv_stages, next_ids)
        return kv_producer

    @cute.jit
    def fragments(self, qk_mma, pv_mma, sQ, sK, sV, tidx):
        """The 16-bit loops' operand fragments, accumulators and softmax state; both MMAs
        always accumulate (S is zeroed before each tile), set once here, where it dominates
        every later use."""
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        qk_thr = qk_mma.get_slice(tidx)
        pv_thr = pv_mma.get_slice(tidx)
        tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ))
        tSrK = qk_thr.make_fragment_B(qk_thr.partition_B(sK))
        tOrV = pv_thr.make_fragment_B(pv_thr.partition_B(sV))
        acc_S = cute.make_rmem_tensor(qk_thr.partition_shape_C((TILE_M, TILE_N)), cutlass.Float32)
        acc_O = cute.make_rmem_tensor(
            pv_thr.partition_shape_C((TILE_M, self.head_dim)), cutlass.Float32
        )
        acc_O.fill(0.0)
        tScS_mn = acc_mn_view(qk_thr.partition_C(cute.make_identity_tensor((TILE_M, TILE_N))))
        row_max, row_sum = new_softmax_state(cute.size(tScS_mn, mode=[0]))
        return tSrQ, tSrK, tOrV, acc_S, acc_O, tScS_mn, row_max, row_sum

    @cute.jit
    def load_tile(self, kv_producer, kv_load, tile):
        """K or V of one tile into the ring's current stage (every partner's, by multicast)."""
        atom, src, dst = kv_load
        handle = kv_producer.acquire()
        cute.copy(atom, src[None, tile], dst[None, handle.index], tma_bar_ptr=handle.barrier)

    @cute.jit
    def consume(
        self,
        qk_mma,
        pv_mma,
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
        logits,
    ):
        """The warpgroup's work; warp 0 also issues the loads, each as soon as its stage is free.

        Load n of the ring is K of tile n // 2 (n even) or its V (n odd), into stage n % 3.
        S of tile j+1 is issued right behind P V of tile j: one wait covers both MMAs.
        """
        q_load, k_load, v_load = loads
        loader = warp == 0
        tSrQ, tSrK, tOrV, acc_S, acc_O, tScS_mn, row_max, row_sum = self.fragments(
            qk_mma, pv_mma, sQ, sK, sV, tidx
        )

        if loader:
            cpasync.prefetch_descriptor(k_load[0])
            cpasync.prefetch_descriptor(v_load[0])
            self.load_q(q_producer, q_load, wg)
            if num_tiles > 0:  # loads 0, 1: K and V of tile 0
                tile = tile_ids[0]
                self.load_tile(kv_producer, k_load, tile)
                kv_producer.advance()
                self.load_tile(kv_producer, v_load, tile)
                kv_producer.advance()
            if num_tiles > 1:  # load 2: K of tile 1
                self.load_tile(kv_producer, k_load, tile_ids[1])
                kv_producer.advance()

        q_consumer.wait_and_advance()
        sQ_stage = tSrQ[None, None, None, wg]
        if num_tiles > 0:
            k_handle = kv_consumer.wait_and_advance()
            self.qk(qk_mma, acc_S, sQ_stage, tSrK[None, None, None, k_handle.index])
            warpgroup.wait_group(0)
            k_handle.release()
        if loader:
            if num_tiles > 1:  # load 3: V of tile 1, into K of tile 0's stage
                self.load_tile(kv_producer, v_load, tile_ids[1])
                kv_producer.advance()
        tile = cutlass.Int32(0)
        tile_len = cutlass.Int32(0)
        words = None
        if cutlass.const_expr(logits is not None):
            words = new_mask_words(logits)
        if num_tiles > 0:
            tile = tile_ids[0]
            tile_len = mTileLen[tile]
            if cutlass.const_expr(logits is not None):
                load_mask_words(logits, words, tile)
        for j in cutlass.range(num_tiles - 1, unroll=1):
            v_handle = self.softmax_then_pv(
                pv_mma,
                acc_S,
                acc_O,
                tScS_mn,
                row_max,
                row_sum,
                scale_log2,
                tOrV,
                sV,
                kv_consumer,
                tile_len,
                tidx,
                bar,
                logits,
                words,
                tile,
            )
            k_handle = kv_consumer.wait_and_advance()
            self.qk(qk_mma, acc_S, sQ_stage, tSrK[None, None, None, k_handle.index])
            # Under the two MMAs: the next tile's length, and (warp 0) the id of the tile it
            # loads next (ptxas may wait for a load right after it: CONTRIBUTING.md).
            tile = tile_ids[j + 1]
            tile_len = mTileLen[tile]
            if cutlass.const_expr(logits is not None):
                load_mask_words(logits, words, tile)
            next_tile = cutlass.Int32(0)
            if loader:
                next_tile = tile_ids[cutlass.min(j + 2, num_tiles - 1)]
            warpgroup.wait_group(0)
            v_handle.release()
            k_handle.release()
            if loader:
                if j + 2 < num_tiles:  # loads 2j+4, 2j+5 into the two stages just released
                    self.load_tile(kv_producer, k_load, next_tile)
                    kv_producer.advance()
                    self.load_tile(kv_producer, v_load, next_tile)
                    kv_producer.advance()
        if num_tiles > 0:
            self.softmax_then_pv(
                pv_mma, acc_S, acc_O, tScS_mn, row_max, row_sum, scale_log2, tOrV, sV,
                kv_consumer, tile_len, tidx, bar, logits, words, tile, drain=True,
            )  # fmt: skip

        self.finish(
            pv_mma, acc_O, row_max, row_sum, scale_log2, sO, mO, mLSE, head, chunk, tidx, bar
        )

    @cute.jit
    def consume_shared(
        self,
        qk_mma,
        pv_mma,
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
        logits,
    ):
        """One warpgroup's work when several share the ring (their units list the same tiles).

        Load n of the ring is K of tile n // 2 (n even) or its V (n odd), into stage
        n % kv_stages. Warp 0 of the CTA issues loads 0 .. kv_stages - 1 up front, then in
        tile j > 0, while the tensor core computes its S, the two loads whose stages every
        warpgroup released in tile j - 1. At 128 registers (two CTAs of 8 warps per SM) S of
        the next tile is not issued behind P V (ptxas would serialize the wgmmas).
        """
        next_ids = cute.make_rmem_tensor(2, cutlass.Int32)
        kv_producer = self.start_ring(
            q_producer, kv_producer, loads, tile_ids, num_tiles, warp, wg, next_ids
        )
        tSrQ, tSrK, tOrV, acc_S, acc_O, tScS_mn, row_max, row_sum = self.fragments(
            qk_mma, pv_mma, sQ, sK, sV, tidx
        )
        next_tile = cutlass.Int32(0)
        next_len = cutlass.Int32(0)
        words = None
        if cutlass.const_expr(logits is not None):
            words = new_mask_words(logits)
        if num_tiles > 0:
            next_tile = tile_ids[0]
            next_len = mTileLen[next_tile]
        q_consumer.wait_and_advance()
        sQ_stage = tSrQ[None, None, None, wg]
        for j in cutlass.range(num_tiles, unroll=1):
            tile = next_tile
            tile_len = next_len
            k_handle = kv_consumer.wait_and_advance()
            self.qk(qk_mma, acc_S, sQ_stage, tSrK[None, None, None, k_handle.index])
            if cutlass.const_expr(logits is not None):
                load_mask_words(logits, words, tile)
            kv_producer = self.refill_ring(
                kv_producer, loads, tile_ids, num_tiles, warp, j, next_ids
            )
            next_tile = tile_ids[cutlass.min(j + 1, num_tiles - 1)]
            next_len = mTileLen[next_tile]
            warpgroup.wait_group(0)
            k_handle.release()
            self.softmax_then_pv(
                pv_mma, acc_S, acc_O, tScS_mn, row_max, row_sum, scale_log2, tOrV, sV,
                kv_consumer, tile_len, tidx, bar, logits, words, tile, drain=True,
            )  # fmt: skip
        self.finish(
            pv_mma, acc_O, row_max, row_sum, scale_log2, sO, mO, mLSE, head, chunk, tidx, bar
        )

    @cute.jit
    def softmax_then_pv(
        self,
        pv_mma,
        acc_S,
        acc_O,
        tScS_mn,
        row_max,
        row_sum,
        scale_log2,
        tOrV,
        sV,
        kv_consumer,
        tile_len,
        tidx,
        bar,
        logits,
        words,
        tile,
        drain: cutlass.Constexpr = False,
    ):
        """Softmax of the tile in acc_S, then issue its O += P V; returns V's stage handle, or
        with drain, waits for every MMA issued and releases V's stage."""
        tOrP = self.probabilities(
            acc_S, acc_O, tScS_mn, tile_len, row_max, row_sum, scale_log2, logits, words, tile
        )
        return self.pv_staged(
            pv_mma, acc_O, tOrP, tOrV, sV, kv_consumer, tile_len, tidx, bar, drain
        )

    @cute.jit
    def pv_staged(
        self, pv_mma, acc_O, tOrP, tOrV, sV, kv_consumer, valid_keys, tidx, bar,
        drain: cutlass.Constexpr,
    ):  # fmt: skip
        """Issue O += P V with the ring's next stage as V (its keys from valid_keys on zeroed
        first); returns V's stage handle, or with drain waits for every MMA issued and
        releases V's stage."""
        v_handle = kv_consumer.wait_and_advance()
        if valid_keys < TILE_N:
            self.zero_keys_from(sV[None, None, v_handle.index], valid_keys, tidx, bar)
        self.pv(pv_mma, acc_O, tOrP, tOrV[None, None, None, v_handle.index])
        if cutlass.const_expr(drain):
            warpgroup.wait_group(0)
            v_handle.release()
        return v_handle

    @cute.jit
    def finish(
        self,
        pv_mma,
        acc_O,
        row_max,
        row_sum,
        scale_log2,
        sO,
        mO,
        mLSE,
        head,
        chunk,
        tidx,
        bar,
        column_scale=None,
    ):
        """Epilogue: normalise (then scale columns: softmax_finalize), LSE, O through shared
        memory (free by now) to 16-byte stores."""
        d = self.head_dim
        out_dtype = mO.element_type
        tOcO_mn = acc_mn_view(
            pv_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((TILE_M, d)))
        )
        row_lse = cute.make_rmem_tensor(cute.size(row_max), cutlass.Float32)
        softmax_finalize(
            row_max, row_sum, scale_log2, acc_mn_view(acc_O), row_lse, self.p_offset, column_scale
        )
        rows_left = mO.shape[0] - chunk * TILE_M
        for r in cutlass.range_constexpr(cute.size(row_lse)):
            row = tOcO_mn[r, 0][0]
            if tidx % 4 == 0 and row < rows_left:
                mLSE[chunk * TILE_M + row, head] = row_lse[r]

        tOrO, tOcO, store = self.stage_output(pv_mma, acc_O, sO, out_dtype, tidx, bar)
        gO = cute.local_tile(mO[None, head, None], (TILE_M, d), (chunk, 0))
        tOgO = store.get_slice(tidx).partition_D(gO)
        for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            if tOcO[0, m, 0][0] < rows_left:
                cute.copy(store, tOrO[None, m, None], tOgO[None, m, None])

    @cute.jit
    def stage_output(self, pv_mma, acc_O, sO, out_dtype, tidx, bar):
        """acc_O (saturated to out_dtype) through the staging tile sO (free by now) into
        registers as 16-byte row chunks: returns them, their (row, column) coordinates and
        the copy that stores them (tiled over the 64 x D tile)."""
        d = self.head_dim
        rO = cute.make_fragment_like(acc_O, out_dtype)
        rO.store(saturated(acc_O.load(), out_dtype).to(out_dtype))
        bar.arrive_and_wait()
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), out_dtype), pv_mma
        )
        thr_r2s = r2s.get_slice(tidx)
        cute.copy(r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sO))
        bar.arrive_and_wait()

        store = self.rows_copy(out_dtype)
        thr_store = store.get_slice(tidx)
        tOsO = thr_store.partition_S(sO)
        tOcO = thr_store.partition_D(cute.make_identity_tensor((TILE_M, d)))
        tOrO = cute.make_fragment_like(tOsO, out_dtype)
        cute.copy(store, tOsO, tOrO)
        return tOrO, tOcO, store

    def rows_copy(self, dtype):
        """16-byte copies of a warpgroup's 64 x D tile in row chunks, a row's 64 columns (the
        staging swizzle's atom width; all D when smaller) over per_row threads."""
        elems = 128 // dtype.width
        per_row = self.head_dim // elems if self.head_dim < 64 else 64 // elems
        return cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128),
            cute.make_layout((CONSUMER_THREADS // per_row, per_row), stride=(per_row, 1)),
            cute.make_layout((1, elems)),
        )

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
    def zero_keys_from(self, sV_stage, first_key, tidx, bar):
        """Zero V rows first_key..63 of a staged tile (keys past a tile's valid length).

        Their probabilities are 0, but 0 * inf or 0 * NaN from padding would still poison O.
        TMA zero-fills only rows past the tensor's end; kv_block_lens can cut a tile short
        inside it. Rare path: only tiles shorter than 64 keys.
        """
        d = self.head_dim
        for i in cutlass.range_constexpr(d * TILE_N // CONSUMER_THREADS):
            flat = tidx + i * CONSUMER_THREADS
            key = flat // d
            if key >= first_key:
                sV_stage[flat - key * d, key] = self.dtype(0.0)
        # Generic-proxy stores, read next by wgmma (async proxy), by all four warps.
        cute.arch.fence_proxy("async.shared", space="cta")
        bar.arrive_and_wait()

    @cute.jit
    def probabilities(
        self, acc_S, acc_O, tScS_mn, tile_len, row_max, row_sum, scale_log2, logits, words, tile
    ):
        """Logit options (if any), mask, online softmax (rescaling acc_O), and P in the
        A-operand register layout."""
        acc_S_mn = acc_mn_view(acc_S)
        if cutlass.const_expr(logits is not None):
            apply_logit_options(logits, acc_S_mn, words, tile, TILE_N)
        if tile_len < TILE_N:
            mask_columns(acc_S_mn, tScS_mn, tile_len)
        softmax_update(row_max, row_sum, scale_log2, acc_S_mn, acc_mn_view(acc_O), self.p_offset)
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
    p = variant.params
    if not BlockSparseFwdSm90.can_implement(p["head_dim"]):
        raise ValueError(f"{variant.name}: head_dim {p['head_dim']} not supported")
    return BlockSparseFwdSm90(
        element_type(p["dtype"]), p["head_dim"], p["warpgroups"], p.get("logits")
    )
