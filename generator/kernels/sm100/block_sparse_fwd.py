"""Block-sparse attention forward for SM100 (sm_100f: B200, B300) on tcgen05: the fifth-
generation tensor cores, accumulators in tensor memory (TMEM), operands from shared memory
or TMEM, issued by one thread.

Same contract as the other templates (generator/families/block_sparse_fwd.py). A CTA runs a
128-row MMA tile: two 64-row units that list the same tiles (the planner groups them, as for
the sm90 template's warpgroups) stacked, or one unit loaded into both halves (the second
half's results are dropped: a 64-row tcgen05 MMA would put the rows in other TMEM lanes
than the one-row-a-thread softmax below reads).

Warp roles (192 threads):
  warps 0-3  softmax and epilogue: thread t owns row t of the tile, which is TMEM lane t,
             so its row max and sum need no shuffles;
  warp 4     MMA: one thread issues S(j) = Q K(j)^T into one of two S buffers in TMEM and
             O += P(j) V(j) with P(j) read from TMEM (tcgen05's A-from-TMEM form);
  warp 5     loads: Q once, then K and V tiles by TMA into a ring, in the order the MMA
             thread takes them: K(0), then K(j + 1) before V(j).
The MMA thread issues S(j + 1) before it waits for P(j), so the tensor core computes the
next scores while the softmax of the current tile runs.

Per tile j, the softmax threads: wait for S(j), load their row (64 fp32 values), mask keys
past the tile's valid length, update max and sum (common/softmax.py's rules: the max moves
only when it grows by more than RESCALE_THRESHOLD), wait until P V(j - 1) is done (the one P
buffer is free and O is final up to j - 1), rescale O's rows in TMEM if a row of the warp
moved its max, store P(j) as 16-bit values into TMEM and signal the MMA thread. Keys past a
tile's valid length also have their V rows zeroed in shared memory (0 x inf or NaN would
poison O; TMA zero-fills only rows past the tensor's end). After the last tile: normalise,
write LSE, and store O a row a thread. A unit with no tiles writes O = 0 and LSE = -inf.

TMEM columns: O (head_dim), S twice (64 each), P (32: two 16-bit values a column).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import TmemAllocator

from generator.families.block_sparse_fwd import TILE_KEYS, UNIT_ROWS
from generator.kernels.common.entry import element_type, unit_launch_options
from generator.kernels.common.softmax import (
    mask_columns,
    new_softmax_state,
    probability_offset,
    saturated,
    softmax_finalize,
    softmax_update,
)
from generator.kernels.common.tile_list import stacked_units_of_cta
from generator.kernels.common.tma_views import seq_d_heads

TILE_M = 128  # rows of the MMA tile: two units
SOFTMAX_WARPS = 4
MMA_WARP = 4
LOAD_WARP = 5
NUM_THREADS = 32 * (SOFTMAX_WARPS + 2)
S_BUFFERS = 2
OUT_CHUNK = 32  # O columns a thread moves between TMEM and registers at a time
SMEM_BYTES = 227 * 1024
MAX_STAGES = 8


def tmem_columns(head_dim: int, o_buffers: int, p_width: int) -> tuple[int, int, int, int]:
    """(first O buffer, first S buffer, P, columns to allocate: a power of two) of
    `o_buffers` O buffers, two S buffers and P of `p_width`-bit values (32-bit columns)."""
    s_col = o_buffers * head_dim
    p_col = s_col + S_BUFFERS * TILE_KEYS
    used = p_col + TILE_KEYS * p_width // 32
    alloc = 32
    while alloc < used:
        alloc *= 2
    return 0, s_col, p_col, alloc


class BlockSparseFwdTcgen05:
    # O in TMEM: one accumulator over all tiles (Sage's subclass: two, one tile's P V each).
    O_BUFFERS = 1
    # V as the P V MMA's B operand: the head dimension contiguous (Sage: V^T, keys contiguous).
    V_MAJOR = OperandMajorMode.MN

    def __init__(self, dtype, head_dim: int, units: int):
        self.dtype = dtype
        self.head_dim = head_dim
        self.units = units
        self.mma_k = 256 // dtype.width  # K of one MMA instruction: 32 bytes
        self.o_col, self.s_col, self.p_col, self.tmem_alloc = tmem_columns(
            head_dim, self.O_BUFFERS, dtype.width
        )
        tile_bytes = TILE_KEYS * head_dim * dtype.width // 8
        q_bytes = TILE_M * head_dim * dtype.width // 8
        self.kv_stages = min(MAX_STAGES, (SMEM_BYTES - 1024 - q_bytes) // tile_bytes)
        self.tile_bytes = tile_bytes
        self.unit_bytes = UNIT_ROWS * head_dim * dtype.width // 8
        self.p_offset = probability_offset(dtype)

    @staticmethod
    def can_implement(head_dim: int, units: int) -> bool:
        return head_dim in (64, 128, 256) and units in (1, 2)

    def tiled_mmas(self):
        """(S = Q K^T: both operands from shared memory, K-major; O += P V: P from TMEM,
        V from shared memory, V_MAJOR)."""
        d = self.head_dim
        qk = sm100_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            OperandMajorMode.K,
            OperandMajorMode.K,
            cutlass.Float32,
            tcgen05.CtaGroup.ONE,
            (TILE_M, TILE_KEYS),
        )
        pv = sm100_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            OperandMajorMode.K,
            self.V_MAJOR,
            cutlass.Float32,
            tcgen05.CtaGroup.ONE,
            (TILE_M, d),
            tcgen05.OperandSource.TMEM,
        )
        return qk, pv

    def tilers(self):
        """MMA tiles (M, N, K) of S = Q K^T and O = P V."""
        return (TILE_M, TILE_KEYS, self.head_dim), (TILE_M, self.head_dim, TILE_KEYS)

    @cute.jit
    def launch(self, args, stream):
        """Host side: MMAs, shared-memory layouts, TMA atoms, the launch."""
        qk_mma, pv_mma = self.tiled_mmas()
        qk_tiler, pv_tiler = self.tilers()
        d = self.head_dim
        q_layout = sm100_utils.make_smem_layout_a(qk_mma, qk_tiler, self.dtype, 1)
        k_layout = sm100_utils.make_smem_layout_b(qk_mma, qk_tiler, self.dtype, self.kv_stages)
        v_layout = sm100_utils.make_smem_layout_b(pv_mma, pv_tiler, self.dtype, self.kv_stages)
        p_layout = sm100_utils.make_smem_layout_a(pv_mma, pv_tiler, self.dtype, 1)

        tma_op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        # Q: a unit's 64 rows into one half of the tile (rows, D) view of the A layout.
        q_half = cute.composition(
            cute.slice_(q_layout, (None, None, None, 0)), self.rows_by_k(UNIT_ROWS)
        )
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(
            tma_op, seq_d_heads(args.mQ, self.head_dim), q_half, (UNIT_ROWS, d)
        )
        tma_k, mK_tma = cute.nvgpu.make_tiled_tma_atom_B(
            tma_op,
            seq_d_heads(args.mK, self.head_dim),
            cute.slice_(k_layout, (None, None, None, 0)),
            qk_tiler,
            qk_mma,
        )
        tma_v, mV_tma = cute.nvgpu.make_tiled_tma_atom_B(
            tma_op,
            self.v_tensor(args),
            cute.slice_(v_layout, (None, None, None, 0)),
            pv_tiler,
            pv_mma,
        )
        SharedStorage = self.shared_storage(q_layout, k_layout)
        self.kernel(
            qk_mma,
            pv_mma,
            tma_q,
            mQ_tma,
            tma_k,
            mK_tma,
            tma_v,
            mV_tma,
            args,
            q_layout,
            k_layout,
            v_layout,
            p_layout,
            SharedStorage,
        ).launch(
            **unit_launch_options(args.mWork, self.units, NUM_THREADS, 1, SharedStorage, stream)
        )

    def rows_by_k(self, rows: int):
        """(rows, D) -> the A layout's ((128, K), 1, D / K) domain (K = mma_k),
        colexicographic: row r, column k at r + 128 (k % K) + 128 K (k // K)."""
        d, k = self.head_dim, self.mma_k
        return cute.make_layout((rows, (k, d // k)), stride=(1, (TILE_M, TILE_M * k)))

    def keys_by_channel(self):
        """(64 keys, D) -> the P V MMA's B layout's ((D, K), 1, 64 / K) domain (K = mma_k),
        colexicographic: key j, channel c at c + D (j % K) + D K (j // K)."""
        d, k = self.head_dim, self.mma_k
        return cute.make_layout(((k, TILE_KEYS // k), d), stride=((d, d * k), 1))

    def v_tensor(self, args):
        """V (seq, heads, D) as (D, seq, heads): the P V MMA's (N, K) B operand."""
        m = args.mV
        return cute.make_tensor(
            m.iterator,
            cute.make_layout(
                (self.head_dim, m.shape[0], m.shape[1]), stride=(1, m.stride[0], m.stride[1])
            ),
        )

    def shared_storage(self, q_layout, kv_layout):
        """Barriers of the five pipelines, the TMEM address, the Q tile and the K/V ring (K
        and V stages are two views of the same bytes)."""

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            kv_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            s_barriers: cute.struct.MemRange[cutlass.Int64, 2 * S_BUFFERS]
            p_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_address: cutlass.Int32
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]

        return SharedStorage

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
        q_layout: cute.ComposedLayout,
        k_layout: cute.ComposedLayout,
        v_layout: cute.ComposedLayout,
        p_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        heads, chunks, kv_head, tile_ids, num_tiles = stacked_units_of_cta(
            args, args.mO, mK_tma.shape[2], UNIT_ROWS, self.units
        )

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sKV.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sKV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        # V as integers of its width, for zeroing keys past a short tile (zero bits are 0.0;
        # 8-bit floats have no scalar stores). Made here, with the swizzle: a pointer recast
        # to another type drops it.
        bits = cutlass.Uint8 if self.dtype.width == 8 else cutlass.Uint16
        sV_bits = storage.sKV.get_tensor(v_layout.outer, swizzle=v_layout.inner, dtype=bits)

        all_threads = pipeline.NamedBarrier(barrier_id=1, num_threads=NUM_THREADS)
        tmem = TmemAllocator(storage.tmem_address.ptr, barrier_for_retrieve=all_threads)
        tmem.allocate(self.tmem_alloc)
        q_pipe, kv_pipe, s_pipe, p_pipe = self.pipelines(storage)

        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(cutlass.Float32)
        qk_tiler, pv_tiler = self.tilers()
        tStS = qk_mma.make_fragment_C(qk_mma.partition_shape_C(qk_tiler[:2]))
        tStS = cute.make_tensor(tmem_ptr + self.s_col, tStS.layout)
        tOtO = pv_mma.make_fragment_C(pv_mma.partition_shape_C(pv_tiler[:2]))
        tOtO = cute.make_tensor(tmem_ptr + self.o_col, tOtO.layout)

        if warp_idx == LOAD_WARP:
            self.load(
                tma_q, mQ_tma, tma_k, mK_tma, tma_v, mV_tma, qk_mma, pv_mma, sQ, sK, sV,
                q_layout, q_pipe, kv_pipe, heads, chunks, kv_head, tile_ids, num_tiles,
            )  # fmt: skip
        tmem.relinquish_alloc_permit()
        if warp_idx < SOFTMAX_WARPS:
            self.softmax(
                qk_mma, pv_mma, tStS, tOtO, sV_bits, storage, s_pipe, p_pipe, args, heads, chunks,
                kv_head, tile_ids, num_tiles, tidx,
            )  # fmt: skip
        # The MMA warp last: its MMAs' accumulate flags are set inside its branch, which
        # would leave the tiled MMAs' values unusable after it.
        if warp_idx == MMA_WARP:
            self.mma(
                qk_mma, pv_mma, sQ, sK, sV, tStS, tOtO, p_layout, tmem_ptr, q_pipe, kv_pipe,
                s_pipe, p_pipe, num_tiles,
            )  # fmt: skip
        # Every warp is done with TMEM (the MMAs' last use completed before the softmax
        # threads' final wait) before it is freed.
        all_threads.arrive_and_wait()
        if warp_idx == 0:
            tmem.free(tmem_ptr, self.tmem_alloc)

    def pipelines(self, storage):
        """(Q, K/V ring, S, P) pipelines: TMA -> MMA for Q and the ring, MMA -> softmax
        threads for the S buffers, softmax threads -> MMA for P (its release, when P V is
        done, also tells the softmax threads that O is up to date)."""
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        rows = pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * SOFTMAX_WARPS)
        q_pipe = pipeline.PipelineTmaUmma.create(
            num_stages=1,
            producer_group=one,
            consumer_group=one,
            tx_count=2 * self.unit_bytes,
            barrier_storage=storage.q_barriers.data_ptr(),
        )
        kv_pipe = pipeline.PipelineTmaUmma.create(
            num_stages=self.kv_stages,
            producer_group=one,
            consumer_group=one,
            tx_count=self.tile_bytes,
            barrier_storage=storage.kv_barriers.data_ptr(),
        )
        s_pipe = pipeline.PipelineUmmaAsync.create(
            num_stages=S_BUFFERS,
            producer_group=one,
            consumer_group=rows,
            barrier_storage=storage.s_barriers.data_ptr(),
        )
        p_pipe = pipeline.PipelineAsyncUmma.create(
            num_stages=1,
            producer_group=rows,
            consumer_group=one,
            barrier_storage=storage.p_barriers.data_ptr(),
        )
        return q_pipe, kv_pipe, s_pipe, p_pipe

    @cute.jit
    def load(
        self, tma_q, mQ_tma, tma_k, mK_tma, tma_v, mV_tma, qk_mma, pv_mma, sQ, sK, sV,
        q_layout, q_pipe, kv_pipe, heads, chunks, kv_head, tile_ids, num_tiles,
    ):  # fmt: skip
        """Warp 5: Q (each unit into its half; one unit into both), then the ring's loads in
        the MMA thread's order: K(0), then K(j + 1), V(j) for each j, then V(last)."""
        d = self.head_dim
        cpasync.prefetch_descriptor(tma_q)
        cpasync.prefetch_descriptor(tma_k)
        cpasync.prefetch_descriptor(tma_v)
        q_producer = q_pipe.make_participants()[0]
        kv_producer = kv_pipe.make_participants()[0]
        sQ_rows = cute.composition(sQ[None, None, None, 0], self.rows_by_k(TILE_M))
        # A unit without tiles loads nothing (no MMA would wait for it before the CTA exits).
        if num_tiles > 0:
            handle = q_producer.acquire()
            for half in cutlass.range_constexpr(2):
                u = half if self.units == 2 else 0
                gQ = cute.local_tile(mQ_tma[None, None, heads[u]], (UNIT_ROWS, d), (chunks[u], 0))
                sQ_half = cute.local_tile(sQ_rows, (UNIT_ROWS, d), (half, 0))
                dst, src = cpasync.tma_partition(
                    tma_q, 0, cute.make_layout(1), cute.group_modes(sQ_half, 0, 2),
                    cute.group_modes(gQ, 0, 2),
                )  # fmt: skip
                cute.copy(tma_q, src, dst, tma_bar_ptr=handle.barrier)

        k_src, k_dst = self.ring_partition(
            tma_k, qk_mma, mK_tma[None, None, kv_head], (TILE_KEYS, d), (None, 0), sK
        )
        v_src, v_dst = self.ring_partition(
            tma_v, pv_mma, mV_tma[None, None, kv_head], (d, TILE_KEYS), (0, None), sV
        )
        for n in cutlass.range(2 * num_tiles, unroll=1):
            is_k, tile = self.ring_entry(n, num_tiles)
            handle = kv_producer.acquire_and_advance()
            if is_k:
                cute.copy(
                    tma_k, k_src[None, tile_ids[tile]], k_dst[None, handle.index],
                    tma_bar_ptr=handle.barrier,
                )  # fmt: skip
            else:
                cute.copy(
                    tma_v, v_src[None, tile_ids[tile]], v_dst[None, handle.index],
                    tma_bar_ptr=handle.barrier,
                )  # fmt: skip

    @cute.jit
    def ring_entry(self, n, num_tiles):
        """(K?, list position) of load n of the ring: K(0); then K(j + 1), V(j) for
        j = 0, 1, ...; the last is V(num_tiles - 1)."""
        is_k = n == 0
        tile = cutlass.Int32(0)
        if n > 0:
            j = (n - 1) // 2
            is_k = ((n - 1) % 2 == 0) & (j + 1 < num_tiles)
            tile = j
            if is_k:
                tile = j + 1
        return is_k, tile

    @staticmethod
    def v_load_index(j, num_tiles):
        """The ring load that brings V(j) (ring_entry's inverse)."""
        return cutlass.min(2 * j + 2, 2 * num_tiles - 1)

    @cute.jit
    def ring_partition(self, atom, tiled_mma, m_head, tile_shape, tile_coord, s_ring):
        """(TMA source by tile id, destination by ring stage) of K or V: `m_head` cut into
        `tile_shape` tiles along the mode `tile_coord` leaves None, partitioned as the MMA's
        B operand."""
        tiles = cute.local_tile(m_head, tile_shape, tile_coord)
        thr_mma = tiled_mma.get_slice(0)
        dst, src = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(s_ring, 0, 3),
            cute.group_modes(thr_mma.partition_B(tiles), 0, 3),
        )  # fmt: skip
        return src, dst

    @cute.jit
    def mma(
        self, qk_mma, pv_mma, sQ, sK, sV, tStS, tOtO, p_layout, tmem_ptr, q_pipe, kv_pipe,
        s_pipe, p_pipe, num_tiles,
    ):  # fmt: skip
        """Warp 4: S(0); then for each j: S(j + 1) into the other S buffer, wait for P(j),
        O += P(j) V(j). Each ring stage is released (a tcgen05 commit) once the MMAs that
        read it are done."""
        q_consumer = q_pipe.make_participants()[1]
        kv_consumer = kv_pipe.make_participants()[1]
        s_producer = s_pipe.make_participants()[0]
        p_consumer = p_pipe.make_participants()[1]
        tSrQ = qk_mma.make_fragment_A(sQ)
        tSrK = qk_mma.make_fragment_B(sK)
        tOrV = pv_mma.make_fragment_B(sV)
        # P as the P V MMA's A operand in TMEM (16-bit values, two a column).
        tOrP = pv_mma.make_fragment_A(cute.make_tensor(tStS.iterator, p_layout.outer))
        tOrP = tOrP[None, None, None, 0]
        tOrP = cute.make_tensor(
            cute.recast_ptr(tmem_ptr + self.p_col, dtype=tOrP.element_type), tOrP.layout
        )
        s_stride = TILE_KEYS  # TMEM columns between the two S buffers

        if num_tiles > 0:
            q_consumer.wait_and_advance()
            qk_mma, kv_consumer, s_producer = self.issue_scores(
                qk_mma, tSrQ, tSrK, tStS, kv_consumer, s_producer, s_stride
            )
        for j in cutlass.range(num_tiles, unroll=1):
            if j + 1 < num_tiles:
                qk_mma, kv_consumer, s_producer = self.issue_scores(
                    qk_mma, tSrQ, tSrK, tStS, kv_consumer, s_producer, s_stride
                )
            p_handle = p_consumer.wait_and_advance()
            v_handle = kv_consumer.wait_and_advance()
            tOtO_j = self.pv_target(tOtO, j)
            pv_mma.set(tcgen05.Field.ACCUMULATE, self.pv_accumulates(j))
            for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                if cutlass.const_expr(k > 0):
                    pv_mma.set(tcgen05.Field.ACCUMULATE, True)
                cute.gemm(
                    pv_mma, tOtO_j, tOrP[None, None, k], tOrV[None, None, k, v_handle.index],
                    tOtO_j,
                )  # fmt: skip
            v_handle.release()
            p_handle.release()

    def pv_target(self, tOtO, j):
        """The TMEM accumulator of P V(j): O itself."""
        return tOtO

    def pv_accumulates(self, j):
        """Whether P V(j) adds to its accumulator: from the second tile on."""
        return j > 0

    @cute.jit
    def issue_scores(self, qk_mma, tSrQ, tSrK, tStS, kv_consumer, s_producer, s_stride):
        """S = Q K^T of the ring's next (K) stage into the next free S buffer. Returns the
        ring consumer and the S producer (rebind them: their states advance)."""
        k_handle = kv_consumer.wait_and_advance()
        s_handle = s_producer.acquire_and_advance()
        tStS_i = cute.make_tensor(tStS.iterator + s_handle.index * s_stride, tStS.layout)
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            qk_mma.set(tcgen05.Field.ACCUMULATE, cutlass.const_expr(k > 0))
            cute.gemm(
                qk_mma, tStS_i, tSrQ[None, None, k, 0], tSrK[None, None, k, k_handle.index],
                tStS_i,
            )  # fmt: skip
        s_handle.commit()
        k_handle.release()
        return qk_mma, kv_consumer, s_producer

    @cute.jit
    def softmax(
        self, qk_mma, pv_mma, tStS, tOtO, sV_bits, storage, s_pipe, p_pipe, args, heads, chunks,
        kv_head, tile_ids, num_tiles, tidx,
    ):  # fmt: skip
        """Warps 0-3, thread t = row t (module docstring)."""
        s_consumer = s_pipe.make_participants()[1]
        p_producer = p_pipe.make_participants()[0]
        s_load, tScS, p_store, tStP, p_shape = self.score_copies(qk_mma, tStS, tidx)
        o_load, o_store, tOtO_chunks, chunk_shape = self.output_copies(pv_mma, tOtO, tidx)

        row_max, row_sum = new_softmax_state(1)
        correction = cute.make_rmem_tensor(1, cutlass.Float32)
        next_len = cutlass.Int32(0)
        if num_tiles > 0:
            next_len = args.mTileLen[tile_ids[0]]
        for j in cutlass.range(num_tiles, unroll=1):
            tile_len = next_len
            next_len = args.mTileLen[tile_ids[cutlass.min(j + 1, num_tiles - 1)]]
            s_handle = s_consumer.wait_and_advance()
            rS = self.load_scores(s_load, tStS, tScS, s_handle.index)
            s_handle.release()
            # A 32x32b load gives the thread its row's columns in order: register c = key c.
            rS_mn = cute.make_tensor(rS.iterator, cute.make_layout((1, TILE_KEYS)))
            if tile_len < TILE_KEYS:
                mask_columns(rS_mn, cute.make_identity_tensor((1, TILE_KEYS)), tile_len)
                self.zero_keys_from(sV_bits, storage, j, num_tiles, tile_len, tidx)
            softmax_update(
                row_max, row_sum, args.scale_log2, rS_mn, None, self.p_offset, lanes=1,
                corrections=correction,
            )  # fmt: skip
            rP = self.probabilities(rS, p_shape)

            p_handle = p_producer.acquire_and_advance()  # P V(j - 1) is done
            # tcgen05.ld / st are warp-wide: the warp rescales its 32 rows if any moved (not
            # at the first tile: P V(0) overwrites O).
            if j > 0:
                if cute.arch.vote_any_sync(correction[0] != 1.0):
                    self.rescale_output(o_load, o_store, tOtO_chunks, chunk_shape, correction[0])
            cute.copy(p_store, rP, p_store.partition_D(tStP))
            cute.arch.fence_view_async_tmem_store()
            p_handle.commit()

        if num_tiles > 0:
            p_producer.acquire()  # the last P V is done
        self.epilogue(
            o_load, tOtO_chunks, chunk_shape, row_max, row_sum, args, heads, chunks, num_tiles, tidx
        )

    def score_copies(self, qk_mma, tStS, tidx):
        """(S load: TMEM -> registers, S's register coordinates, P store: registers -> TMEM,
        P's TMEM columns as 32-bit words, the register shape of P's words) of this thread's
        row."""
        s_load = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(TILE_KEYS)), cutlass.Float32),
            tStS,
        ).get_slice(tidx)
        # Register shapes come from coordinate tensors partitioned as the MMA's C.
        cS = qk_mma.get_slice(0).partition_C(cute.make_identity_tensor((TILE_M, TILE_KEYS)))
        tScS = s_load.partition_D(cS)
        # P's columns as 32-bit words: (128, 64 x width / 32).
        words = TILE_KEYS * self.dtype.width // 32
        tStP = cute.make_tensor(
            tStS.iterator + (self.p_col - self.s_col),
            cute.composition(tStS.layout, cute.make_layout((TILE_M, words))),
        )
        p_store = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(words)), cutlass.Float32),
            tStP,
        ).get_slice(tidx)
        p_shape = p_store.partition_S(
            cute.make_tensor(cS.iterator, cute.composition(cS.layout, tStP.layout))
        ).shape
        return s_load, tScS, p_store, tStP, p_shape

    @cute.jit
    def load_scores(self, s_load, tStS, tScS, buffer):
        """This thread's row of S buffer `buffer` (TMEM) in registers."""
        rS = cute.make_rmem_tensor(tScS.shape, cutlass.Float32)
        src = cute.make_tensor(tStS.iterator + buffer * TILE_KEYS, tStS.layout)
        cute.copy(s_load, s_load.partition_S(src), rS)
        cute.arch.fence_view_async_tmem_load()
        return rS

    @cute.jit
    def probabilities(self, rS, p_shape):
        """The row's probabilities (rS) in the operand type, packed in 32-bit words as the P
        store takes them (column c: keys c * 32 / width ..., the first in the low bits)."""
        rP = cute.make_rmem_tensor(p_shape, cutlass.Float32)
        packed = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=self.dtype), rS.layout)
        packed.store(rS.load().to(self.dtype))
        return rP

    def output_copies(self, pv_mma, tOtO, tidx):
        """(TMEM -> register copy, register -> TMEM copy, O cut in OUT_CHUNK-column chunks,
        the register shape of a chunk) for this thread's row of O."""
        tiler = ((TILE_M, OUT_CHUNK),)
        chunks = cute.zipped_divide(tOtO, tiler)
        load = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(OUT_CHUNK)), cutlass.Float32),
            chunks[None, 0],
        ).get_slice(tidx)
        store = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(OUT_CHUNK)), cutlass.Float32),
            chunks[None, 0],
        ).get_slice(tidx)
        cO = pv_mma.get_slice(0).partition_C(cute.make_identity_tensor((TILE_M, self.head_dim)))
        chunk_shape = load.partition_D(cute.zipped_divide(cO, tiler))[None, None, 0].shape
        return load, store, chunks, chunk_shape

    @cute.jit
    def rescale_output(self, o_load, o_store, tOtO_chunks, chunk_shape, factor):
        """This thread's row of O (in TMEM) times `factor`, chunk by chunk."""
        src = o_load.partition_S(tOtO_chunks)
        dst = o_store.partition_D(tOtO_chunks)
        for c in cutlass.range_constexpr(self.head_dim // OUT_CHUNK):
            rO = cute.make_rmem_tensor(chunk_shape, cutlass.Float32)
            cute.copy(o_load, src[None, None, c], rO)
            cute.arch.fence_view_async_tmem_load()
            rO.store(rO.load() * factor)
            cute.copy(o_store, rO, dst[None, None, c])

    @cute.jit
    def zero_keys_from(self, sV_bits, storage, j, num_tiles, first_key, tidx):
        """Zero keys first_key..63 of V(j) in its ring stage, once its load has landed (rare:
        tiles shorter than 64 keys). The MMA reads the stage only after this thread's P
        commit, which follows the fence that orders these stores before the async proxy."""
        n = self.v_load_index(j, num_tiles)
        stage = n % self.kv_stages
        cute.arch.mbarrier_wait(storage.kv_barriers.data_ptr() + stage, (n // self.kv_stages) % 2)
        d = self.head_dim
        # V's stage as (key, channel).
        sV_keys = cute.composition(sV_bits[None, None, None, stage], self.keys_by_channel())
        for i in cutlass.range_constexpr(d * TILE_KEYS // (32 * SOFTMAX_WARPS)):
            flat = tidx + i * 32 * SOFTMAX_WARPS
            key = flat // d
            if key >= first_key:
                sV_keys[key, flat - key * d] = sV_bits.element_type(0)
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def epilogue(
        self, o_load, tOtO_chunks, chunk_shape, row_max, row_sum, args, heads, chunks,
        num_tiles, tidx,
    ):  # fmt: skip
        """Normalise this thread's row, write its LSE and its O (16-byte stores)."""
        mO, mLSE = args.mO, args.mLSE
        lse = cute.make_rmem_tensor(1, cutlass.Float32)
        inverse = cute.make_rmem_tensor(1, cutlass.Float32)
        softmax_finalize(
            row_max, row_sum, args.scale_log2, None, lse, self.p_offset, lanes=1,
            inverses=inverse,
        )  # fmt: skip
        head, q_row, writes = self.row_of_thread(heads, chunks, mO.shape[0], tidx)
        src = o_load.partition_S(tOtO_chunks)
        for c in cutlass.range_constexpr(self.head_dim // OUT_CHUNK):
            rO = cute.make_rmem_tensor(chunk_shape, cutlass.Float32)
            if num_tiles > 0:
                cute.copy(o_load, src[None, None, c], rO)
                cute.arch.fence_view_async_tmem_load()
                rO.store(rO.load() * inverse[0])
            else:
                rO.fill(0.0)
            if writes:
                self.write_output(mO, q_row, head, c, rO.load())
        if writes:
            mLSE[q_row, head] = lse[0]

    @cute.jit
    def row_of_thread(self, heads, chunks, num_rows, tidx):
        """(head, query row, whether to write it) of this thread's row: rows 64.. are the
        second unit's, or with one unit a copy of the first's rows whose results are
        dropped."""
        half = tidx // UNIT_ROWS
        head = heads[0]
        q_row = chunks[0] * UNIT_ROWS + tidx - half * UNIT_ROWS
        if cutlass.const_expr(self.units == 2):
            if half == 1:
                head = heads[1]
                q_row = chunks[1] * UNIT_ROWS + tidx - UNIT_ROWS
        writes = q_row < num_rows
        if cutlass.const_expr(self.units == 1):
            writes = writes & (half == 0)
        return head, q_row, writes

    @cute.jit
    def write_output(self, mO, q_row, head, c, values):
        """OUT_CHUNK output columns from column c * OUT_CHUNK of a row (fp32 values, saturated
        into mO's type)."""
        out_dtype = mO.element_type
        out = cute.make_rmem_tensor(OUT_CHUNK, out_dtype)
        out.store(saturated(values, out_dtype).to(out_dtype))
        gO = cute.local_tile(mO[q_row, head, None], (OUT_CHUNK,), (c,))
        cute.autovec_copy(out, cute.make_tensor(gO.iterator, out.layout))


def make_kernel(variant):
    p = variant.params
    units = p.get("warpgroups", 1)
    if not BlockSparseFwdTcgen05.can_implement(p["head_dim"], units):
        raise ValueError(f"{variant.name}: head_dim {p['head_dim']} x {units} units not supported")
    return BlockSparseFwdTcgen05(element_type(p["dtype"]), p["head_dim"], units)
