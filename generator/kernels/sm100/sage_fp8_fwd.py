"""Sage FP8 block-sparse attention forward for SM100 (sm_100f) on tcgen05: e4m3 q, k and V^T
(kind::f8f6f4 MMAs), bf16 output, the sage_fp8_fwd family's contract.

The schedule of the 16-bit template (sm100/block_sparse_fwd.py: one MMA warp, one load warp,
four softmax warps of a row a thread, S double-buffered in TMEM, P handed to the P V MMA
through TMEM) with the Sage math of common/sage_math.py: scores scaled by q_scale x
k_scale x sm_scale, each tile's P8 = exp2(x - t + 8) quantized to e4m3, and the two-level
accumulation: P V(j) goes into a fresh TMEM accumulator (two, alternating), which the softmax
threads fold into O in registers, O = O alpha(j) + P V(j) beta(j), one tile behind (while
the tensor core computes P V(j + 1)). V^T tiles (keys contiguous) are the K-major B operand.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import OperandMajorMode

from generator.families.block_sparse_fwd import TILE_KEYS
from generator.families.sage_quantize import KEYS_PER_SCALE
from generator.kernels.common.sage_math import load_key_scales, new_sage_state, sage_softmax_step
from generator.kernels.common.softmax import softmax_finalize
from generator.kernels.sm100.block_sparse_fwd import OUT_CHUNK, BlockSparseFwdTcgen05


class SageFp8FwdTcgen05(BlockSparseFwdTcgen05):
    O_BUFFERS = 2  # P V of tiles j and j + 1
    V_MAJOR = OperandMajorMode.K  # V^T: keys contiguous

    def __init__(self, head_dim: int, units: int):
        super().__init__(cutlass.Float8E4M3FN, head_dim, units)
        self.p_offset = 0.0  # P8's 2^8 is undone by beta (sage_math)

    @staticmethod
    def can_implement(head_dim: int, units: int) -> bool:
        return head_dim in (64, 128) and units in (1, 2)

    def v_tensor(self, args):
        """V^T (D, seq, heads), keys contiguous: the P V MMA's K-major B operand as is."""
        return args.mVt

    def pv_target(self, tOtO, j):
        """P V(j) into accumulator j % 2 (the softmax threads fold j - 1's meanwhile)."""
        return cute.make_tensor(tOtO.iterator + (j % 2) * self.head_dim, tOtO.layout)

    def pv_accumulates(self, j):
        return False

    @cute.jit
    def softmax(
        self, qk_mma, pv_mma, tStS, tOtO, sV_bits, storage, s_pipe, p_pipe, args, heads, chunks,
        kv_head, tile_ids, num_tiles, tidx,
    ):  # fmt: skip
        """Warps 0-3, thread t = row t: the Sage softmax of each tile, P8 into TMEM, the
        previous tile's P V folded into O (registers)."""
        d = self.head_dim
        s_consumer = s_pipe.make_participants()[1]
        p_producer = p_pipe.make_participants()[0]
        s_load, tScS, p_store, tStP, p_shape = self.score_copies(qk_mma, tStS, tidx)
        o_load, _, tOtO_chunks, chunk_shape = self.output_copies(pv_mma, tOtO, tidx)
        head, q_row, writes = self.row_of_thread(heads, chunks, args.mO.shape[0], tidx)

        row_max, row_sum, alpha, beta, row_scale, key_scale = new_sage_state(
            1, TILE_KEYS // KEYS_PER_SCALE
        )
        row_scale[0] = cutlass.Float32(0.0)
        if q_row < args.mQScale.shape[0]:
            row_scale[0] = args.mQScale[q_row, head] * args.scale_log2
        # O, a row a thread: (OUT_CHUNK, D / OUT_CHUNK), column c * OUT_CHUNK + i at (i, c).
        acc_O = cute.make_rmem_tensor((OUT_CHUNK, d // OUT_CHUNK), cutlass.Float32)
        acc_O.fill(0.0)
        folded_alpha = cute.make_rmem_tensor(1, cutlass.Float32)
        folded_beta = cute.make_rmem_tensor(1, cutlass.Float32)
        for j in cutlass.range(num_tiles, unroll=1):
            tile = tile_ids[j]
            tile_len = args.mTileLen[tile]
            load_key_scales(args.mKScale[None, kv_head], tile, key_scale)
            s_handle = s_consumer.wait_and_advance()
            rS = self.load_scores(s_load, tStS, tScS, s_handle.index)
            s_handle.release()
            # A 32x32b load gives the thread its row's columns in order: register c = key c.
            rS_mn = cute.make_tensor(rS.iterator, cute.make_layout((1, TILE_KEYS)))
            if tile_len < TILE_KEYS:
                self.zero_keys_from(sV_bits, storage, j, num_tiles, tile_len, tidx)
            sage_softmax_step(
                rS_mn, row_scale, key_scale, cute.make_identity_tensor((1, TILE_KEYS)),
                tile_len, row_max, row_sum, alpha, beta, lanes=1,
            )  # fmt: skip
            rP = self.probabilities(rS, p_shape)

            p_handle = p_producer.acquire_and_advance()  # P V(j - 1) is done
            cute.copy(p_store, rP, p_store.partition_D(tStP))
            cute.arch.fence_view_async_tmem_store()
            p_handle.commit()
            if j > 0:
                self.fold(o_load, tOtO, tOtO_chunks, chunk_shape, j - 1, acc_O, folded_alpha,
                          folded_beta)  # fmt: skip
            folded_alpha[0] = alpha[0]
            folded_beta[0] = beta[0]

        if num_tiles > 0:
            p_producer.acquire()  # the last P V is done
            self.fold(o_load, tOtO, tOtO_chunks, chunk_shape, num_tiles - 1, acc_O,
                      folded_alpha, folded_beta)  # fmt: skip

        # Normalise (scores are already in log2 units: scale 1), scale the channels back (V
        # was quantized per channel), write O and LSE.
        lse = cute.make_rmem_tensor(1, cutlass.Float32)
        inverse = cute.make_rmem_tensor(1, cutlass.Float32)
        softmax_finalize(
            row_max, row_sum, cutlass.Float32(1.0), None, lse, 0.0, lanes=1, inverses=inverse
        )
        if writes:
            channel = cute.make_rmem_tensor(OUT_CHUNK, cutlass.Float32)
            for c in cutlass.range_constexpr(d // OUT_CHUNK):
                for i in cutlass.range_constexpr(OUT_CHUNK):
                    channel[i] = args.mVScale[c * OUT_CHUNK + i, kv_head]
                values = acc_O[None, c].load() * inverse[0] * channel.load()
                self.write_output(args.mO, q_row, head, c, values)
            args.mLSE[q_row, head] = lse[0]

    @cute.jit
    def fold(self, o_load, tOtO, tOtO_chunks, chunk_shape, j, acc_O, alpha, beta):
        """O = O alpha + P V(j) beta, P V(j) read from its TMEM accumulator (j % 2) a chunk
        at a time."""
        if alpha[0] != 1.0:
            acc_O.store(acc_O.load() * alpha[0])
        buffer = cute.make_tensor(tOtO.iterator + (j % 2) * self.head_dim, tOtO_chunks.layout)
        src = o_load.partition_S(buffer)
        for c in cutlass.range_constexpr(self.head_dim // OUT_CHUNK):
            partial = cute.make_rmem_tensor(chunk_shape, cutlass.Float32)
            cute.copy(o_load, src[None, None, c], partial)
            cute.arch.fence_view_async_tmem_load()
            flat = cute.make_tensor(partial.iterator, cute.make_layout(OUT_CHUNK))
            acc_O[None, c].store(acc_O[None, c].load() + flat.load() * beta[0])


def make_kernel(variant):
    p = variant.params
    units = p.get("warpgroups", 1)
    if p["dtype"] != "e4m3" or not SageFp8FwdTcgen05.can_implement(p["head_dim"], units):
        raise ValueError(f"{variant.name}: {p['dtype']} head_dim {p['head_dim']} not supported")
    return SageFp8FwdTcgen05(p["head_dim"], units)
