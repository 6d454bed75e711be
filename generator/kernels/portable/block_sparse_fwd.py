"""Block-sparse attention forward with warp-level MMA (mma.sync m16n8k16): the portable template.

Runs on every arch we build (sm_90a, sm_100f, sm_120f): cp.async loads, ldmatrix, HMMA.
It is the SM100/SM120 path until their native kernels land, and it is built for sm_90a
too so that the code we ship for Blackwell is run and checked on the H200.

One CTA (4 warps, 16 query rows each) owns one unit: 64 query rows of one query head.
It walks the unit's list of 64-key tiles (generator/families/block_sparse_fwd.py):
    load Q, K[t0]
    for each listed tile t_j:
        wait K[t_j]; start V[t_j]        S = Q K^T
        wait V[t_j]; start K[t_j+1]      online softmax (keys >= tile_len masked)
                                          O += P V
    O /= rowsum; write O and LSE (natural log)
Keys of a tile past its valid length are zero-filled in shared memory and masked to -inf.
A unit with no tiles writes O = 0 and LSE = -inf.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync, warp

from generator.families.block_sparse_fwd import TILE_KEYS, UNIT_ROWS
from generator.kernels.common.entry import element_type
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
NUM_THREADS = 128
COPY_BYTES = 16  # one cp.async / ldmatrix row / output store


class BlockSparseFwdWarpMma:
    def __init__(self, dtype, head_dim: int, logits: str | None = None):
        self.dtype = dtype
        self.logits = logits  # block_sparse_fwd_logits' kind (LOGIT_KINDS), or None
        self.head_dim = head_dim
        self.p_offset = probability_offset(dtype)
        self.barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=NUM_THREADS)

    @staticmethod
    def can_implement(head_dim: int) -> bool:
        return head_dim in (64, 128, 256)

    def smem_layout(self, rows: int, cols: int | None = None):
        """A (rows, cols = head_dim) 16-bit tile of 8 x 64 swizzled atoms: conflict-free
        ldmatrix and 16-byte cp.async."""
        atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        return cute.tile_to_shape(atom, (rows, cols or self.head_dim), (0, 1))

    def shared_tiles(self):
        """The layouts of the Q tile and of a K (or V) tile, and the shared-memory struct of
        the three: sQ, sK, sV."""
        sQ_layout = self.smem_layout(TILE_M)
        sKV_layout = self.smem_layout(TILE_N)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]

        return sQ_layout, sKV_layout, SharedStorage

    def tiled_mma(self):
        """mma.sync m16n8k16 with fp32 accumulators, one warp per 16 of the tile's 64 rows."""
        return cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, cutlass.Float32, (16, 8, 16)),
            (NUM_THREADS // 32, 1, 1),
            permutation_mnk=(TILE_M, 16, 16),
        )

    def load_copy(self, op):
        """`op` over Q / K / V rows: 16 bytes per thread, 64 columns at a time."""
        return self.tiled_copy_16b(op, self.dtype, 64)

    @staticmethod
    def tiled_copy_16b(op, dtype, row_elems: int, num_threads: int = NUM_THREADS):
        """`num_threads` threads, 16 bytes each, over rows of `row_elems` elements."""
        per_copy = COPY_BYTES * 8 // dtype.width
        per_row = row_elems // per_copy
        return cute.make_tiled_copy_tv(
            cute.make_copy_atom(op, dtype, num_bits_per_copy=COPY_BYTES * 8),
            cute.make_layout((num_threads // per_row, per_row), stride=(per_row, 1)),
            cute.make_layout((1, per_copy)),
        )

    @cute.jit
    def launch(self, args, stream):
        """Host side: shared-memory layouts, copies and the MMA, then the launch."""
        sQ_layout, sKV_layout, SharedStorage = self.shared_tiles()
        gmem_load = self.load_copy(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL))
        gmem_store = self.load_copy(cute.nvgpu.CopyUniversalOp())
        tiled_mma = self.tiled_mma()
        self.kernel(
            args,
            sQ_layout,
            sKV_layout,
            gmem_load,
            gmem_store,
            tiled_mma,
            SharedStorage,
        ).launch(
            grid=[args.mWork.shape[0], 1, 1],
            block=[NUM_THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes(),  # 96 KB at head_dim 256: past the 48 KB default
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        args,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        gmem_load: cute.TiledCopy,
        gmem_store: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        head, chunk, kv_head, tile_ids, num_tiles = unit_of_cta(
            args, args.mQ, args.mK.shape[1], TILE_M
        )
        d = self.head_dim
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sVt = cute.composition(sV, cute.make_layout((d, TILE_N), stride=(TILE_N, 1)))

        # Global tiles: Q/O of this unit; all 64-key tiles of this kv head.
        gQ = cute.local_tile(args.mQ[None, head, None], (TILE_M, d), (chunk, 0))
        gO = cute.local_tile(args.mO[None, head, None], (TILE_M, d), (chunk, 0))
        gK = cute.local_tile(args.mK[None, kv_head, None], (TILE_N, d), (None, 0))
        gV = cute.local_tile(args.mV[None, kv_head, None], (TILE_N, d), (None, 0))
        thr_load = gmem_load.get_slice(tidx)
        tQcQ = thr_load.partition_S(cute.make_identity_tensor((TILE_M, d)))  # row within the unit
        q_rows_left = args.mQ.shape[0] - chunk * TILE_M
        logits = None
        if cutlass.const_expr(self.logits is not None):
            logits = UnitLogits(
                args, kv_head, head, chunk * TILE_M, tiled_mma, tidx, (TILE_M, TILE_N), self.logits
            )

        acc_O, row_max, row_sum = self.attend(
            gmem_load,
            tiled_mma,
            tidx,
            thr_load.partition_S(gQ),
            thr_load.partition_D(sQ),
            tQcQ,
            thr_load.partition_S(gK),
            thr_load.partition_D(sK),
            thr_load.partition_S(gV),
            thr_load.partition_D(sV),
            sQ,
            sK,
            sVt,
            tile_ids,
            num_tiles,
            args.mTileLen,
            q_rows_left,
            args.scale_log2,
            logits,
        )

        # Epilogue: O through shared memory (reusing sQ) to 16-byte stores. A unit with no
        # tiles never waited for its Q copy: wait before sQ is overwritten.
        cute.arch.cp_async_wait_group(0)
        sO = cute.make_tensor(sQ.iterator, sQ_layout)
        self.store_output(
            tiled_mma,
            gmem_store,
            acc_O,
            row_max,
            row_sum,
            args.scale_log2,
            sO,
            gO,
            tQcQ,
            q_rows_left,
            args.mLSE,
            chunk,
            head,
            tidx,
        )

    @cute.jit
    def attend(
        self,
        gmem_load,
        tiled_mma,
        tidx,
        tQgQ,
        tQsQ,
        tQcQ,
        tKgK,
        tKsK,
        tVgV,
        tVsV,
        sQ,
        sK,
        sVt,
        tile_ids,
        num_tiles,
        mTileLen,
        q_rows_left,
        scale_log2,
        logits,
    ):
        """The unit's main loop: Q and the first K, then per listed tile S = Q K^T, the online
        softmax and O += P V, with the next K or V loading under each. Returns (O, row max,
        row sum), O not yet normalised."""
        thr_mma = tiled_mma.get_slice(tidx)
        acc_O = cute.make_rmem_tensor(
            thr_mma.partition_shape_C((TILE_M, self.head_dim)), cutlass.Float32
        )
        acc_O.fill(0.0)
        ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
        ldsm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
        q_operand = self.operand_a(tiled_mma, tidx, cute.make_copy_atom(ldsm, self.dtype), sQ)
        k_operand = self.operand_b(tiled_mma, tidx, cute.make_copy_atom(ldsm, self.dtype), sK)
        v_operand = self.operand_b(tiled_mma, tidx, cute.make_copy_atom(ldsm_t, self.dtype), sVt)
        # Coordinates of this thread's score elements: (query row, key column) in the tile.
        tScS_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_M, TILE_N))))

        # Prologue: Q (rows past the sequence are zero) and the first K tile.
        self.load_rows(gmem_load, tQgQ, tQsQ, tQcQ, q_rows_left)
        if num_tiles > 0:
            self.load_listed_k(gmem_load, tKgK, tKsK, tQcQ, tile_ids, mTileLen, 0)
        cute.arch.cp_async_commit_group()

        row_max, row_sum = new_softmax_state(cute.size(tScS_mn, mode=[0]))
        words = None
        if cutlass.const_expr(logits is not None):
            words = new_mask_words(logits)
        for j in cutlass.range(num_tiles, unroll=1):
            tile = tile_ids[j]
            tile_len = mTileLen[tile]
            if cutlass.const_expr(logits is not None):
                load_mask_words(logits, words, tile)
            cute.arch.cp_async_wait_group(0)
            self.barrier.arrive_and_wait()
            self.load_rows(gmem_load, tVgV[None, None, None, tile], tVsV, tQcQ, tile_len)
            cute.arch.cp_async_commit_group()

            acc_S = cute.make_rmem_tensor(
                thr_mma.partition_shape_C((TILE_M, TILE_N)), cutlass.Float32
            )
            acc_S.fill(0.0)
            self.gemm_smem(tiled_mma, acc_S, q_operand, k_operand)

            cute.arch.cp_async_wait_group(0)
            self.barrier.arrive_and_wait()
            if j + 1 < num_tiles:
                self.load_listed_k(gmem_load, tKgK, tKsK, tQcQ, tile_ids, mTileLen, j + 1)
                cute.arch.cp_async_commit_group()

            acc_S_mn = acc_mn_view(acc_S)
            if cutlass.const_expr(logits is not None):
                apply_logit_options(logits, acc_S_mn, words, tile, TILE_N)
            if tile_len < TILE_N:
                mask_columns(acc_S_mn, tScS_mn, tile_len)
            softmax_update(
                row_max, row_sum, scale_log2, acc_S_mn, acc_mn_view(acc_O), self.p_offset
            )

            rP = cute.make_fragment_like(acc_S, self.dtype)
            rP.store(acc_S.load().to(self.dtype))
            self.gemm_rA(tiled_mma, acc_O, self.c_frag_as_a_frag(rP), v_operand)
        return acc_O, row_max, row_sum

    @classmethod
    def operand_a(cls, tiled_mma, tidx, atom, smem):
        """The MMA's A operand read from `smem` by the copy `atom` (an ldmatrix)."""
        thr_mma = tiled_mma.get_slice(tidx)
        fragment = thr_mma.make_fragment_A(thr_mma.partition_A(smem))
        return cls.smem_operand(cute.make_tiled_copy_A(atom, tiled_mma), tidx, smem, fragment)

    @classmethod
    def operand_b(cls, tiled_mma, tidx, atom, smem):
        """The MMA's B operand read from `smem` by the copy `atom` (an ldmatrix)."""
        thr_mma = tiled_mma.get_slice(tidx)
        fragment = thr_mma.make_fragment_B(thr_mma.partition_B(smem))
        return cls.smem_operand(cute.make_tiled_copy_B(atom, tiled_mma), tidx, smem, fragment)

    @staticmethod
    def smem_operand(s2r, tidx, smem, fragment):
        """An MMA operand read from shared memory: (copy, its source partition, the fragment
        as the copy's destination, the fragment)."""
        thr_s2r = s2r.get_slice(tidx)
        return s2r, thr_s2r.partition_S(smem), thr_s2r.retile(fragment), fragment

    @cute.jit
    def store_output(
        self,
        tiled_mma,
        gmem_store,
        acc_O,
        row_max,
        row_sum,
        scale_log2,
        sO,
        gO,
        tOcO,
        rows_left,
        mLSE,
        chunk,
        head,
        tidx,
        column_scale=None,
    ):
        """Normalise O (then scale its columns: softmax_finalize), write LSE, and O (mO's
        dtype) through `sO` with 16-byte stores.

        `tOcO` is `gmem_store`'s partition of the tile's coordinates; rows >= rows_left are
        not written. The caller has waited for every cp.async into the memory under `sO`.
        """
        d = self.head_dim
        out_dtype = gO.element_type
        tOcO_mn = acc_mn_view(
            tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((TILE_M, d)))
        )
        row_lse = cute.make_rmem_tensor(cute.size(row_max), cutlass.Float32)
        softmax_finalize(
            row_max, row_sum, scale_log2, acc_mn_view(acc_O), row_lse, self.p_offset, column_scale
        )
        lane = tidx % 32
        for r in cutlass.range_constexpr(cute.size(row_lse)):
            row = tOcO_mn[r, 0][0]
            if lane % 4 == 0 and row < rows_left:
                mLSE[chunk * TILE_M + row, head] = row_lse[r]

        rO = cute.make_fragment_like(acc_O, out_dtype)
        rO.store(saturated(acc_O.load(), out_dtype).to(out_dtype))
        self.barrier.arrive_and_wait()
        r2s_O = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), out_dtype), tiled_mma
        )
        thr_r2s_O = r2s_O.get_slice(tidx)
        cute.copy(r2s_O, thr_r2s_O.retile(rO), thr_r2s_O.partition_D(sO))
        self.barrier.arrive_and_wait()

        thr_store = gmem_store.get_slice(tidx)
        tOsO = thr_store.partition_S(sO)
        tOgO = thr_store.partition_D(gO)
        tOrO = cute.make_fragment_like(tOgO, out_dtype)
        cute.copy(gmem_store, tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            if tOcO[0, m, 0][0] < rows_left:
                cute.copy(gmem_store, tOrO[None, m, None], tOgO[None, m, None])

    @cute.jit
    def load_listed_k(self, gmem_load, tKgK, tKsK, coord, tile_ids, mTileLen, j):
        """cp.async K of the unit's j-th listed tile (rows past its valid length zeroed)."""
        tile = tile_ids[j]
        self.load_rows(gmem_load, tKgK[None, None, None, tile], tKsK, coord, mTileLen[tile])

    @cute.jit
    def load_rows(self, gmem_load, src, dst, coord, num_rows):
        """cp.async the rows < num_rows of a 64-row tile; zero the others."""
        for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
            if coord[0, m, 0][0] < num_rows:
                cute.copy(gmem_load, src[None, m, None], dst[None, m, None])
            else:
                dst[None, m, None].fill(0)

    @cute.jit
    def gemm_smem(self, tiled_mma, acc, a_operand, b_operand):
        """acc += A B with both operands (smem_operand) read from shared memory one k-block
        ahead."""
        s2r_A, tAsA, tArA_view, tArA = a_operand
        s2r_B, tBsB, tBrB_view, tBrB = b_operand
        num_k = cute.size(tAsA, mode=[2])
        cute.copy(s2r_A, tAsA[None, None, 0], tArA_view[None, None, 0])
        cute.copy(s2r_B, tBsB[None, None, 0], tBrB_view[None, None, 0])
        for k in cutlass.range_constexpr(num_k):
            if cutlass.const_expr(k + 1 < num_k):
                cute.copy(s2r_A, tAsA[None, None, k + 1], tArA_view[None, None, k + 1])
                cute.copy(s2r_B, tBsB[None, None, k + 1], tBrB_view[None, None, k + 1])
            cute.gemm(tiled_mma, acc, tArA[None, None, k], tBrB[None, None, k], acc)

    @cute.jit
    def gemm_rA(self, tiled_mma, acc, tArA, b_operand):
        """acc += A B with A already in registers and B (smem_operand) read from shared memory."""
        s2r_B, tBsB, tBrB_view, tBrB = b_operand
        num_k = cute.size(tArA, mode=[2])
        cute.copy(s2r_B, tBsB[None, None, 0], tBrB_view[None, None, 0])
        for k in cutlass.range_constexpr(num_k):
            if cutlass.const_expr(k + 1 < num_k):
                cute.copy(s2r_B, tBsB[None, None, k + 1], tBrB_view[None, None, k + 1])
            cute.gemm(tiled_mma, acc, tArA[None, None, k], tBrB[None, None, k], acc)

    def c_frag_as_a_frag(self, frag: cute.Tensor) -> cute.Tensor:
        """(4, M, N) accumulator registers as the (8, M, N/2) A operand of the next MMA.

        An m16n8 C tile holds the same elements per thread as half of an m16k16 A tile, so
        two neighbouring N atoms make one K step.
        """
        split = cute.logical_divide(frag.layout, (None, None, 2))
        layout = cute.make_layout(
            ((split.shape[0], split.shape[2][0]), split.shape[1], split.shape[2][1]),
            stride=((split.stride[0], split.stride[2][0]), split.stride[1], split.stride[2][1]),
        )
        return cute.make_tensor(frag.iterator, layout)


def make_kernel(variant):
    p = variant.params
    if not BlockSparseFwdWarpMma.can_implement(p["head_dim"]):
        raise ValueError(f"{variant.name}: head_dim {p['head_dim']} not supported")
    return BlockSparseFwdWarpMma(element_type(p["dtype"]), p["head_dim"], p.get("logits"))
