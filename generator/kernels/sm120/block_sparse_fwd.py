"""Block-sparse attention forward for SM120 (sm_120f): TMA loads into a K/V ring, warp-level
MMA (mma.sync m16n8k16) from 128-byte-swizzled shared memory. Built for sm_90a and sm_100f
too: TMA and mma.sync exist on every arch we build, so the H200 runs and checks it, and it is
the SM100 path until a tcgen05 kernel lands.

Same contract as the other templates (generator/families/block_sparse_fwd.py). A CTA runs
`units` (1 or 2) units that list the same tiles (the planner groups them, as for the sm90
template's warpgroups), stacked as 64 * units query rows over one K/V ring. Each warp owns
ROWS_PER_WARP of those rows (16-row MMA atoms spread over the stack, one per unit at two
units): the K and V fragments a warp reads by ldmatrix serve all its rows, so more rows a
warp read shared memory less per FLOP. 32 rows for head_dim <= 128 (S, P and O take ~230
registers: two or four warps a CTA), 16 at head_dim 256 (O alone takes 128).

Loads (warp 0, no producer warp: a fifth warp would cut every warp's registers by a fifth,
with nothing to hand back on SM120's 64K-register SMs):
  Q of every unit once; then load n of the ring is K of listed tile n // 2 (n even) or its V
  (n odd), into stage n % kv_stages; loads 0 .. kv_stages - 1 up front, then each stage
  refilled once every warp released it:
    tile j: wait K[j]; S = Q K^T; release K[j]; refill V[j-1]'s stage
            mask, online softmax; refill K[j]'s stage
            wait V[j]; O += P V; release V[j]
  Refilling K[j]'s stage after the softmax (not at its release) lets the other warps release
  it first; warp 0 then rarely waits.
TMA zero-fills key rows past the sequence end; keys past a tile's valid length are masked to
-inf before the softmax and their V rows zeroed in shared memory (0 * NaN would poison O). A
unit with no tiles writes O = 0 and LSE = -inf.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.tensor_utils import LayoutEnum

from generator.families.block_sparse_fwd import TILE_KEYS, UNIT_ROWS
from generator.kernels.common.entry import element_type, unit_launch_options
from generator.kernels.common.softmax import (
    acc_mn_view,
    mask_columns,
    new_softmax_state,
    probability_offset,
    saturated,
    softmax_finalize,
    softmax_update,
)
from generator.kernels.common.tile_list import stacked_units_of_cta
from generator.kernels.common.tma_views import seq_d_heads
from generator.kernels.portable.block_sparse_fwd import BlockSparseFwdWarpMma

TILE_N = TILE_KEYS
# Shared memory a CTA may use, by arch: 227 KB per block on sm_90a / sm_100f, 99 KB on
# sm_120f (and 228 / 100 KB per SM; 1 KB of each CTA's is the system's).
SMEM_PER_SM = {"sm_90a": 227 * 1024, "sm_100f": 227 * 1024, "sm_120f": 99 * 1024}
WARPS_PER_SM = 8  # two per SM sub-partition: one's softmax under the other's MMAs
MAX_STAGES = 6


# Query rows a warp owns, by head_dim (module docstring).
ROWS_PER_WARP = {64: 32, 128: 32, 256: 16}


def ring_shape(arch: str, warps: int, q_bytes: int, tile_bytes: int):
    """(CTAs per SM, K/V stages) of a CTA of `warps` warps with `q_bytes` of Q tiles and a
    ring of `tile_bytes` stages: the most CTAs up to WARPS_PER_SM warps per SM whose shared
    memory still holds the Q tiles and a ring of at least two stages."""
    for ctas in range(max(1, WARPS_PER_SM // warps), 0, -1):
        stages = (SMEM_PER_SM[arch] // ctas - 1024 - q_bytes) // tile_bytes
        if stages >= 2:
            return ctas, min(stages, MAX_STAGES)
    raise ValueError(f"{q_bytes} bytes of Q tiles and a ring of two do not fit {arch}")


class BlockSparseFwdTmaWarpMma:
    def __init__(self, dtype, head_dim: int, units: int, arch: str):
        self.dtype = dtype
        self.head_dim = head_dim
        self.units = units
        self.rows = units * UNIT_ROWS
        self.warps = self.rows // ROWS_PER_WARP[head_dim]
        self.num_threads = 32 * self.warps
        self.ctas_per_sm, self.kv_stages = ring_shape(
            arch,
            self.warps,
            q_bytes=self.rows * head_dim * dtype.width // 8,
            tile_bytes=TILE_N * head_dim * dtype.width // 8,
        )
        self.p_offset = probability_offset(dtype)
        # ldmatrix operands, the P V register trick and the 16-byte row copies
        self.warp_mma = BlockSparseFwdWarpMma(dtype, head_dim)

    @staticmethod
    def can_implement(head_dim: int, units: int) -> bool:
        return head_dim in (64, 128) and units in (1, 2) or (head_dim, units) == (256, 1)

    def tiled_mma(self):
        """mma.sync m16n8k16, fp32 accumulators; warp w owns the 16-row atoms at rows
        16 w + 16 * warps * i of the stacked tile."""
        return cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, cutlass.Float32, (16, 8, 16)),
            (self.warps, 1, 1),
            permutation_mnk=(16 * self.warps, 16, 16),
        )

    def smem_layouts(self):
        """(TMA layouts, ldmatrix layouts) of the Q tiles (64, D, units) and of the K/V ring
        (64, D, kv_stages). Both describe the same bytes, rows of D elements in 8 x 64 atoms
        with the 128-byte swizzle: TMA takes it in byte units (a swizzled pointer), ldmatrix
        in element units (Swizzle(3, 3, 3) on 16-bit elements is the same XOR)."""
        d = self.head_dim
        tma_q = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (UNIT_ROWS, TILE_N, d), self.dtype, self.units
        )
        tma_kv = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (UNIT_ROWS, TILE_N, d), self.dtype, self.kv_stages
        )
        atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        ldsm_q = cute.tile_to_shape(atom, (UNIT_ROWS, d, self.units), (0, 1, 2))
        ldsm_kv = cute.tile_to_shape(atom, (TILE_N, d, self.kv_stages), (0, 1, 2))
        return tma_q, tma_kv, ldsm_q, ldsm_kv

    @cute.jit
    def launch(self, args, stream):
        """Host side: TMA atoms over (seq, D, heads) views, shared memory, the launch."""
        tma_q_layout, tma_kv_layout, ldsm_q, ldsm_kv = self.smem_layouts()
        d = self.head_dim
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        atoms = [
            cpasync.make_tiled_tma_atom(
                tma_op,
                seq_d_heads(m, self.head_dim),
                cute.slice_(layout, (None, None, 0)),
                (rows, d),
            )
            for m, layout, rows in (
                (args.mQ, tma_q_layout, UNIT_ROWS),
                (args.mK, tma_kv_layout, TILE_N),
                (args.mV, tma_kv_layout, TILE_N),
            )
        ]
        tile_bytes = cute.size_in_bytes(self.dtype, cute.slice_(tma_kv_layout, (None, None, 0)))
        SharedStorage = self.shared_storage(ldsm_q, ldsm_kv)
        (tma_q, mQ_tma), (tma_k, mK_tma), (tma_v, mV_tma) = atoms
        self.kernel(
            tma_q,
            mQ_tma,
            tma_k,
            mK_tma,
            tma_v,
            mV_tma,
            args,
            tma_q_layout,
            tma_kv_layout,
            ldsm_q,
            ldsm_kv,
            tile_bytes,
            SharedStorage,
        ).launch(**self.launch_options(args.mWork, SharedStorage, stream))

    def shared_storage(self, q_layout, kv_layout):
        """The shared-memory struct: the two pipelines' barriers, the Q tiles and the ring."""

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            kv_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]

        return SharedStorage

    def launch_options(self, mWork, SharedStorage, stream) -> dict:
        """One CTA per `units` entries of mWork, at ctas_per_sm CTAs per SM."""
        return unit_launch_options(
            mWork, self.units, self.num_threads, self.ctas_per_sm, SharedStorage, stream
        )

    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        mQ_tma: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK_tma: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV_tma: cute.Tensor,
        args,
        tma_q_layout: cute.ComposedLayout,
        tma_kv_layout: cute.ComposedLayout,
        ldsm_q: cute.ComposedLayout,
        ldsm_kv: cute.ComposedLayout,
        tile_bytes: cutlass.Constexpr,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bar = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_threads)
        d = self.head_dim
        # Every unit's (head, chunk); the tile list is the same for all of them.
        heads, chunks, kv_head, tile_ids, num_tiles = stacked_units_of_cta(
            args, args.mO, mK_tma.shape[2], UNIT_ROWS, self.units
        )

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ_tma = storage.sQ.get_tensor(tma_q_layout.outer, swizzle=tma_q_layout.inner)
        sKV_tma = storage.sKV.get_tensor(tma_kv_layout.outer, swizzle=tma_kv_layout.inner)
        sQ = storage.sQ.get_tensor(ldsm_q)
        sKV = storage.sKV.get_tensor(ldsm_kv)
        # The units' Q tiles as one (64 * units, D) operand: row r of unit u is row 64 u + r.
        sQ_rows = cute.composition(
            sQ,
            cute.make_layout(((UNIT_ROWS, self.units), d), stride=((1, UNIT_ROWS * d), UNIT_ROWS)),
        )

        q_producer, q_consumer, kv_producer, kv_consumer = self.pipelines(
            storage, self.units * UNIT_ROWS * d * self.dtype.width // 8, tile_bytes
        )
        # TMA partitions: Q by unit, K and V by tile id, the ring by stage.
        k_load = self.ring_partition(tma_k, mK_tma, sKV_tma, kv_head, (TILE_N, d), (None, 0))
        v_load = self.ring_partition(tma_v, mV_tma, sKV_tma, kv_head, (TILE_N, d), (None, 0))
        q_loads = []
        for u in cutlass.range_constexpr(self.units):
            gQ = cute.local_tile(mQ_tma[None, None, heads[u]], (UNIT_ROWS, d), (chunks[u], 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_q, 0, cute.make_layout(1), cute.group_modes(sQ_tma, 0, 2),
                cute.group_modes(gQ, 0, 2),
            )  # fmt: skip
            q_loads.append((tQgQ, tQsQ[None, u]))
        kv_producer = self.start_loads(
            warp_idx, tma_q, q_loads, q_producer, kv_producer, k_load, v_load, tile_ids, num_tiles
        )

        tiled_mma = self.tiled_mma()
        acc_O, row_max, row_sum = self.attend(
            tiled_mma,
            sQ_rows,
            sKV,
            q_consumer,
            kv_producer,
            kv_consumer,
            k_load,
            v_load,
            tile_ids,
            num_tiles,
            args.mTileLen,
            args.scale_log2,
            tidx,
            warp_idx,
            bar,
        )
        self.finish(tiled_mma, acc_O, row_max, row_sum, args, sQ, sQ_rows, heads, chunks, tidx, bar)

    def pipelines(self, storage, q_bytes: int, tile_bytes: int):
        """(Q producer, Q consumer, ring producer, ring consumer): Q one stage, the ring
        kv_stages; one producer thread (of warp 0), every warp a consumer."""
        warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.warps)
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        q_producer, q_consumer = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_barriers.data_ptr(),
            num_stages=1,
            producer_group=one,
            consumer_group=warps,
            tx_count=q_bytes,
        ).make_participants()
        kv_producer, kv_consumer = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.kv_barriers.data_ptr(),
            num_stages=self.kv_stages,
            producer_group=one,
            consumer_group=warps,
            tx_count=tile_bytes,
        ).make_participants()
        return q_producer, q_consumer, kv_producer, kv_consumer

    @cute.jit
    def ring_partition(self, atom, m_tma, s_tma, kv_head, tile_shape, tile_coord):
        """(atom, the kv head's tiles by tile id, the ring by stage) of one TMA load: `m_tma`
        (.., .., kv heads) cut into `tile_shape` tiles along the mode `tile_coord` leaves
        None."""
        tiles = cute.local_tile(m_tma[None, None, kv_head], tile_shape, tile_coord)
        dst, src = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(s_tma, 0, 2),
            cute.group_modes(tiles, 0, 2),
        )  # fmt: skip
        return atom, src, dst

    @cute.jit
    def start_loads(
        self, warp_idx, tma_q, q_loads, q_producer, kv_producer, k_load, v_load, tile_ids,
        num_tiles,
    ):  # fmt: skip
        """Warp 0: the Q tiles (`q_loads`: (source, destination) pairs, one stage), then loads
        0 .. kv_stages - 1 of the ring. Returns the ring producer (rebind it)."""
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(k_load[0])
            cpasync.prefetch_descriptor(v_load[0])
            handle = q_producer.acquire()
            for i in cutlass.range_constexpr(len(q_loads)):
                cute.copy(tma_q, q_loads[i][0], q_loads[i][1], tma_bar_ptr=handle.barrier)
            for n in cutlass.range(cutlass.min(2 * num_tiles, self.kv_stages), unroll=1):
                self.ring_load(kv_producer, k_load, v_load, n, tile_ids[n // 2])
                kv_producer.advance()
        return kv_producer

    @cute.jit
    def ring_load(self, kv_producer, k_load, v_load, n, tile):
        """Issue load n of the ring (K of `tile` for even n, V for odd) into its stage."""
        handle = kv_producer.acquire()
        if n % 2 == 0:
            self.copy_tile(k_load, tile, handle)
        else:
            self.copy_tile(v_load, tile, handle)

    @cute.jit
    def copy_tile(self, load, tile, handle):
        """One TMA copy of K or V of `tile` into the stage of `handle`. (The atom is chosen
        outside: a run-time choice between two TMA atoms does not compile.)"""
        atom, src, dst = load
        cute.copy(atom, src[None, tile], dst[None, handle.index], tma_bar_ptr=handle.barrier)

    @cute.jit
    def refill(self, kv_producer, k_load, v_load, tile_ids, num_tiles, warp_idx, n):
        """Warp 0: load n of the ring, if the list has it and it is not one of the first
        kv_stages (issued up front); the stage it takes held load n - kv_stages. Returns the
        producer (rebind it: its state may advance)."""
        if warp_idx == 0:
            if n >= self.kv_stages and n < 2 * num_tiles:
                self.ring_load(kv_producer, k_load, v_load, n, tile_ids[n // 2])
                kv_producer.advance()
        return kv_producer

    @cute.jit
    def attend(
        self,
        tiled_mma,
        sQ_rows,
        sKV,
        q_consumer,
        kv_producer,
        kv_consumer,
        k_load,
        v_load,
        tile_ids,
        num_tiles,
        mTileLen,
        scale_log2,
        tidx,
        warp_idx,
        bar,
    ):
        """The main loop (module docstring). Returns (O, row max, row sum), O not yet
        normalised."""
        d = self.head_dim
        thr_mma = tiled_mma.get_slice(tidx)
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.rows, d)), cutlass.Float32)
        acc_O.fill(0.0)
        ldsm = cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        ldsm_t = cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype
        )
        tScS_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.rows, TILE_N))))
        row_max, row_sum = new_softmax_state(cute.size(tScS_mn, mode=[0]))
        q_operand = self.warp_mma.operand_a(tiled_mma, tidx, ldsm, sQ_rows)
        keys_by_column = cute.make_layout((d, TILE_N), stride=(TILE_N, 1))

        q_consumer.wait_and_advance()
        next_len = cutlass.Int32(0)
        if num_tiles > 0:
            next_len = mTileLen[tile_ids[0]]
        for j in cutlass.range(num_tiles, unroll=1):
            tile_len = next_len
            k_handle = kv_consumer.wait_and_advance()
            acc_S = cute.make_rmem_tensor(
                thr_mma.partition_shape_C((self.rows, TILE_N)), cutlass.Float32
            )
            acc_S.fill(0.0)
            k_operand = self.warp_mma.operand_b(
                tiled_mma, tidx, ldsm, sKV[None, None, k_handle.index]
            )
            self.warp_mma.gemm_smem(tiled_mma, acc_S, q_operand, k_operand)
            k_handle.release()
            kv_producer = self.refill(  # into V of tile j - 1's stage
                kv_producer, k_load, v_load, tile_ids, num_tiles, warp_idx,
                2 * j - 1 + self.kv_stages,
            )  # fmt: skip
            next_len = mTileLen[tile_ids[cutlass.min(j + 1, num_tiles - 1)]]

            acc_S_mn = acc_mn_view(acc_S)
            if tile_len < TILE_N:
                mask_columns(acc_S_mn, tScS_mn, tile_len)
            softmax_update(
                row_max, row_sum, scale_log2, acc_S_mn, acc_mn_view(acc_O), self.p_offset
            )
            rP = cute.make_fragment_like(acc_S, self.dtype)
            rP.store(acc_S.load().to(self.dtype))
            kv_producer = self.refill(
                kv_producer, k_load, v_load, tile_ids, num_tiles, warp_idx, 2 * j + self.kv_stages
            )

            v_handle = kv_consumer.wait_and_advance()
            sV = sKV[None, None, v_handle.index]
            if tile_len < TILE_N:
                self.zero_keys_from(sV, tile_len, tidx, bar, self.dtype(0.0))
            v_operand = self.warp_mma.operand_b(
                tiled_mma, tidx, ldsm_t, cute.composition(sV, keys_by_column)
            )
            self.warp_mma.gemm_rA(tiled_mma, acc_O, self.warp_mma.c_frag_as_a_frag(rP), v_operand)
            v_handle.release()
        return acc_O, row_max, row_sum

    @cute.jit
    def zero_keys_from(self, sV_stage, first_key, tidx, bar, zero):
        """Zero the keys first_key..63 of a staged V tile (`sV_stage` indexed (key, channel);
        `zero` of its element type): keys past a tile's valid length have probability 0, but
        0 * inf or 0 * NaN would still poison O, and TMA zero-fills only rows past the
        tensor's end. Rare path: tiles shorter than 64 keys."""
        d = self.head_dim
        # Every warp's reads of this stage's previous tile come first (they were ordered
        # only through the ring's mbarriers and the TMA write).
        bar.arrive_and_wait()
        for i in cutlass.range_constexpr(d * TILE_N // self.num_threads):
            flat = tidx + i * self.num_threads
            key = flat // d
            if key >= first_key:
                sV_stage[key, flat - key * d] = zero
        # The next TMA write into this stage (async proxy) must come after these stores.
        cute.arch.fence_proxy("async.shared", space="cta")
        bar.arrive_and_wait()

    @cute.jit
    def finish(
        self, tiled_mma, acc_O, row_max, row_sum, args, sQ, sQ_rows, heads, chunks, tidx, bar
    ):
        """Normalise, write LSE, and O (mO's dtype: the inputs') through the Q tiles' shared
        memory to 16-byte row stores."""
        d = self.head_dim
        mO, mLSE = args.mO, args.mLSE
        out_dtype = mO.element_type
        thr_mma = tiled_mma.get_slice(tidx)
        tOcO_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.rows, d))))
        row_lse = cute.make_rmem_tensor(cute.size(row_max), cutlass.Float32)
        softmax_finalize(
            row_max, row_sum, args.scale_log2, acc_mn_view(acc_O), row_lse, self.p_offset
        )
        num_rows = mO.shape[0]
        for r in cutlass.range_constexpr(cute.size(row_lse)):
            row = tOcO_mn[r, 0][0]
            head = heads[0]
            q_row = chunks[0] * UNIT_ROWS + row
            if cutlass.const_expr(self.units == 2):
                if row >= UNIT_ROWS:
                    head = heads[1]
                    q_row = chunks[1] * UNIT_ROWS + row - UNIT_ROWS
            if tidx % 4 == 0 and q_row < num_rows:
                mLSE[q_row, head] = row_lse[r]

        rO = cute.make_fragment_like(acc_O, out_dtype)
        rO.store(saturated(acc_O.load(), out_dtype).to(out_dtype))
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), out_dtype), tiled_mma
        )
        thr_r2s = r2s.get_slice(tidx)
        bar.arrive_and_wait()  # every warp is done with the Q tiles
        cute.copy(r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sQ_rows))
        bar.arrive_and_wait()

        store = BlockSparseFwdWarpMma.tiled_copy_16b(
            cute.nvgpu.CopyUniversalOp(), out_dtype, 64, self.num_threads
        )
        thr_store = store.get_slice(tidx)
        tOcO = thr_store.partition_S(cute.make_identity_tensor((UNIT_ROWS, d)))
        for u in cutlass.range_constexpr(self.units):
            gO = cute.local_tile(mO[None, heads[u], None], (UNIT_ROWS, d), (chunks[u], 0))
            tOsO = thr_store.partition_S(sQ[None, None, u])
            tOgO = thr_store.partition_D(gO)
            tOrO = cute.make_fragment_like(tOgO, out_dtype)
            cute.copy(store, tOsO, tOrO)
            rows_left = num_rows - chunks[u] * UNIT_ROWS
            for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
                if tOcO[0, m, 0][0] < rows_left:
                    cute.copy(store, tOrO[None, m, None], tOgO[None, m, None])


def make_kernel(variant):
    p = variant.params
    units = p.get("warpgroups", 1)
    if not BlockSparseFwdTmaWarpMma.can_implement(p["head_dim"], units):
        raise ValueError(f"{variant.name}: head_dim {p['head_dim']} x {units} units not supported")
    return BlockSparseFwdTmaWarpMma(element_type(p["dtype"]), p["head_dim"], units, variant.arch)
