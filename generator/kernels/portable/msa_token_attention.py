"""MSA sparse attention, one token a CTA (the decode kernel): mma.sync m16n8k16, every arch.

A CTA (4 warps) owns one token's G <= 16 query heads of one kv head: 16 rows, one MMA tile
(heads from G on are zero rows, never stored). Each of the token's usable blocks is split
alike over the warps: warp w scores keys 32w .. 32w + 31 of it (a step) and keeps its own
online softmax over its steps, with its own ring of STAGES shared-memory stages that
cp.async fills STAGES - 1 steps ahead and that only the warp synchronises on (one stage for
16-bit K/V: a step is loaded, then used; the other warps of the SM overlap it). The warps meet
once, at the end, to merge their rows by their lse. Unlike the union tile (a CTA of 64 // G
tokens walking the union of their blocks, every row masked to its own), nothing is loaded
or multiplied for a block a row does not see, so per-token selections cost their own
blocks only; decode, whose tokens draw their blocks independently, runs here.

A lane (g = lane / 4, c = lane % 4) reads keys and values straight from the stages into MMA
operands, in orders chosen so that its reads are whole 4/8/16-byte words:
  S = Q K^T   the MMA's k dimension (the 128 channels) is permuted alike for Q and K, so the
              lane's K operand is channels 32c .. 32c + 31 of a key (K_LANE_BYTES
              contiguous bytes); its key in n-tile t is key_row(t, g).
  O = P V     S's accumulator is P's A operand as it is (n-tiles 2h, 2h + 1 = k16 chunk
              h); key_row puts keys 16h + 4c .. 16h + 4c + 3 in the lane's four k slots,
              and the output channels are permuted: n-tile j, column n is channel 16n + j.
              So the lane's V operand is channels 16g .. 16g + 15 of four consecutive keys
              (one NVFP4 scale group; their four V scales one word of the 4x4 swizzle),
              paired across keys by byte permutes; its output row part is channels
              32c .. 32c + 31, stored contiguously.
K/V in q's dtype are used as stored, with MMAs in q's dtype. e4m3 and NVFP4 K/V go to fp16
MMAs (bf16 q scaled into fp16's range by a power of two, query_operand): e4m3 converts in
pairs (exact); NVFP4 codes become fp16 by bit placement (e2m1_word_pairs) times their
scale x 2^-7 (value x scale / 2^7, exact), the 2^7 folded back into the softmax scale and
the output scale.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from generator.families.msa_sparse_attention import BLOCK_KEYS, HEAD_DIM, KV_FORMAT, MAX_TOPK
from generator.kernels.common.entry import element_type
from generator.kernels.common.msa_sequence import sequence_keys
from generator.kernels.common.nvfp4 import FP16_DIVISOR_LOG2, e2m1_word_pairs, fp16_scale_pair
from generator.kernels.common.ptx import e4m3_pair_as_f16x2, f16x2_broadcast, mul_f16x2
from generator.kernels.common.softmax import (
    LN_2,
    LOG2_E,
    new_softmax_state,
    probability_offset,
    quad_sum,
    saturated,
    softmax_finalize,
    softmax_update,
    temperature_update,
)
from generator.kernels.common.tile_convert import into_fp16_range, warp_finite_max

WARPS = 4
STEP_KEYS = BLOCK_KEYS // WARPS  # keys of one block a warp scores: 32
ROWS = 16  # one token's query heads of one kv head (<= 16)
S_TILES = STEP_KEYS // 8  # n-tiles of S a step: 4
P_CHUNKS = STEP_KEYS // 16  # k16 chunks of P V a step: 2
O_TILES = HEAD_DIM // 8  # n-tiles of O: 16
K_STEPS = HEAD_DIM // 16  # k-steps of Q K^T: 8
ROW_BYTES = {"16bit": 2 * HEAD_DIM, "e4m3": HEAD_DIM, "nvfp4": HEAD_DIM // 2}
SCALE_BYTES = STEP_KEYS * 8  # a step's NVFP4 scales of K (or V): 8 a key
NVFP4_FACTOR = 2.0**FP16_DIVISOR_LOG2  # decoded NVFP4 K and V are value / 2^7
O_PITCH = HEAD_DIM + 4  # fp32 words of a merge row (padded against bank conflicts)
NEG_INF = -cutlass.Float32.inf


def key_row(t: int, g):
    """The step row (0 .. 31) of n-tile t, column g of S: keys 16h + 4(g // 2) + 2e + g % 2
    for t = 2h + e, so that P's k slots 2c, 2c + 1, 2c + 8, 2c + 9 of chunk h are keys
    16h + 4c .. 16h + 4c + 3."""
    return 16 * (t // 2) + 4 * (g // 2) + 2 * (t % 2) + g % 2


class MsaTokenAttention:
    def __init__(
        self, dtype, kv_format: str, stages: int, ctas_per_sm: int = 1,
        query_in_shared: bool = False,
    ):  # fmt: skip
        self.dtype = dtype
        self.ctas_per_sm = ctas_per_sm  # > 1: registers capped for that many CTAs an SM
        # The query operand (32 registers a thread) read from shared memory at each MMA
        # instead of held, for the register cap of more CTAs an SM.
        self.query_in_shared = query_in_shared
        self.kv_format = kv_format
        self.raw_type = {"16bit": dtype, "e4m3": cutlass.Float8E4M3FN, "nvfp4": cutlass.Uint8}[
            kv_format
        ]
        self.row_bytes = ROW_BYTES[kv_format]
        self.elem_bytes = 2 if kv_format == "16bit" else 1
        self.nvfp4 = kv_format == "nvfp4"
        self.stages = stages
        # A stage: K rows, V rows (STEP_KEYS each), then NVFP4's K and V scale rows.
        self.scale_bytes = SCALE_BYTES if self.nvfp4 else 0
        self.stage_bytes = 2 * STEP_KEYS * self.row_bytes + 2 * self.scale_bytes
        self.value_factor = NVFP4_FACTOR if self.nvfp4 else 1.0
        # The MMAs run in fp16 for e4m3 and NVFP4 K/V (exact in fp16: a conversion a pair
        # instead of bf16's four; P with fp16's finer mantissa, and their magnitudes cannot
        # overflow the fp32 sums, so P needs no offset; bf16 q is scaled by a power of two
        # into fp16's range, query_operand), in q's dtype for 16-bit K/V.
        self.mma_dtype = dtype if kv_format == "16bit" else cutlass.Float16
        self.p_offset = probability_offset(self.mma_dtype)
        self.ring_bytes = WARPS * stages * self.stage_bytes
        self.query_bytes = K_STEPS * 32 * 16 if query_in_shared else 16
        # The merge reuses the rings: every warp's rows in fp32.
        assert WARPS * ROWS * O_PITCH * 4 <= self.ring_bytes

    def shared_storage(self):
        @cute.struct
        class SharedStorage:
            ring: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.ring_bytes], 128]
            # Per warp, its steps' (block, page), in order.
            steps: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, WARPS * MAX_TOPK * 2], 16]
            # Per warp and row: lse and temperature lse (natural log).
            lse: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, WARPS * ROWS * 2], 16]
            # With query_in_shared: the lanes' query operands, k-step by k-step (QUERY_BYTES).
            query: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.query_bytes], 16]

        return SharedStorage

    @cute.jit
    def launch(self, args, stream):
        SharedStorage = self.shared_storage()
        atom = cute.make_mma_atom(warp.MmaF16BF16Op(self.mma_dtype, cutlass.Float32, (16, 8, 16)))
        config = dict(
            grid=[args.mQ.shape[0], args.mK.shape[1], args.splits],
            block=[WARPS * 32, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )
        if cutlass.const_expr(self.ctas_per_sm > 1):
            config.update(min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=100)
        self.kernel(args, atom, SharedStorage).launch(**config)

    @cute.kernel
    def kernel(self, args, atom, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        token, kv_head, split = cute.arch.block_idx()
        # With hand_off, the wgmma union tile launched before this kernel ran the row unless
        # it handed it here.
        runs = cutlass.Boolean(True)
        if args.hand_off > 0.0:
            runs = args.mHandOff[token, kv_head] != 0
        if runs:
            self.attend_token(args, atom, SharedStorage, tidx, token, kv_head, split)

    @cute.jit
    def attend_token(
        self, args, atom, SharedStorage: cutlass.Constexpr, tidx, token, kv_head, split
    ):  # fmt: skip
        """One token's G heads of one kv head (this split's share of its steps)."""
        warp_idx = tidx // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        seq = sequence_of(args.mCuQ, token, lane)
        seqlen_k, key_start, blocks = sequence_keys(args, seq)
        q_start = args.mCuQ[seq]
        position = seqlen_k - (args.mCuQ[seq + 1] - q_start) + token - q_start
        if args.has_q_offset != 0:
            position = args.mQOffset[seq] + token - q_start
        key_end = seqlen_k
        if args.causal != 0:
            key_end = cutlass.min(seqlen_k, position + 1)
        sSteps = storage.steps.get_tensor(
            cute.make_layout((WARPS, MAX_TOPK, 2), stride=(MAX_TOPK * 2, 2, 1))
        )
        steps = self.list_steps(
            args, sSteps, seq, kv_head, token, split, warp_idx, lane, blocks, key_end
        )
        query, query_factor = self.query_operand(args, token, kv_head, g, c)
        if cutlass.const_expr(self.query_in_shared):
            # Every warp's operands are the same: warp 0's, 16 bytes a lane and k-step.
            shared_query = storage.query.data_ptr().toint()
            if warp_idx == 0:
                for s in cutlass.range_constexpr(K_STEPS):
                    dst = cute.make_tensor(
                        smem_ptr(self.mma_dtype, shared_query + (s * 32 + lane) * 16),
                        cute.make_layout(8),
                    )
                    dst.store(cute.make_tensor(query.iterator + 8 * s, cute.make_layout(8)).load())
            cute.arch.sync_threads()
            query = shared_query
        acc_O = cute.make_rmem_tensor((4 * O_TILES,), cutlass.Float32)
        acc_O.fill(0.0)
        row_max, row_sum = new_softmax_state(2)
        t_max, t_sum = new_softmax_state(2)
        with_temperature = (args.want_lse != 0) & (args.temperature != 1.0)
        scale_log2 = args.scale_log2 * self.value_factor * query_factor
        ring = storage.ring.data_ptr().toint() + warp_idx * (self.stages * self.stage_bytes)
        page_rows = (seqlen_k, key_start, kv_head)
        offsets = self.lane_chunks(lane)

        for m in cutlass.range_constexpr(self.stages - 1):
            if m < steps:
                self.load_step(
                    args, sSteps[warp_idx, m, None], page_rows, ring, m, warp_idx, lane, offsets
                )
            cute.arch.cp_async_commit_group()
        for m in cutlass.range(steps, unroll=1):
            ahead = m + self.stages - 1
            if ahead < steps:
                stage = ahead % self.stages
                self.load_step(
                    args, sSteps[warp_idx, ahead, None], page_rows, ring, stage, warp_idx, lane,
                    offsets,
                )  # fmt: skip
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(self.stages - 1)
            cute.arch.sync_warp()  # every lane's copies of step m landed
            first_key = sSteps[warp_idx, m, 0] * BLOCK_KEYS + warp_idx * STEP_KEYS
            base = ring + (m % self.stages) * self.stage_bytes
            acc_S = self.scores(atom, query, base, lane, g, c)
            limit = key_end - first_key
            if limit < STEP_KEYS:
                for t in cutlass.range_constexpr(S_TILES):
                    for x in cutlass.range_constexpr(2):
                        if 16 * (t // 2) + 4 * c + 2 * (t % 2) + x >= limit:
                            acc_S[4 * t + x] = NEG_INF
                            acc_S[4 * t + 2 + x] = NEG_INF
            acc_S_mn = row_view(acc_S, S_TILES)
            if with_temperature:
                temperature_update(t_max, t_sum, scale_log2 * args.temperature, acc_S_mn)
            softmax_update(
                row_max, row_sum, scale_log2, acc_S_mn, row_view(acc_O, O_TILES), self.p_offset
            )
            self.add_pv(atom, acc_S, acc_O, base, seqlen_k - first_key, g, c)
            cute.arch.sync_warp()  # every lane is done with the stage the next load refills
        cute.arch.cp_async_wait_group(0)

        lse = cute.make_rmem_tensor((2,), cutlass.Float32)
        softmax_finalize(row_max, row_sum, scale_log2, row_view(acc_O, O_TILES), lse, self.p_offset)
        lse_t = cute.make_rmem_tensor((2,), cutlass.Float32)
        for r in cutlass.range_constexpr(2):
            lse_t[r] = lse[r]
            if with_temperature:
                total = quad_sum(t_sum[r])
                lse_t[r] = NEG_INF
                if total > 0.0:
                    lse_t[r] = (
                        t_max[r] * scale_log2 * args.temperature
                        + cute.math.log2(total, fastmath=True)
                    ) * LN_2
        self.merge_and_store(
            args, storage, acc_O, lse, lse_t, token, kv_head, split, tidx, warp_idx, g, c
        )

    @cute.jit
    def list_steps(self, args, sSteps, seq, kv_head, token, split, warp_idx, lane, blocks, key_end):
        """The warp's steps into sSteps[warp_idx]: lane i looks at the token's slot i. Usable
        blocks (an id of the sequence's blocks, once, whose page, when paged, lies inside
        the cache; -1, repeats, ids past the sequence and pages outside are skipped: raising
        would need a host synchronisation) are split in listed order over the splits (grid
        z); of this split's share, the blocks whose keys 32w .. 32w + 31 start before
        key_end are the warp's steps. Returns their count."""
        topk = args.mIdx.shape[2]
        block = cutlass.Int32(-1)
        page = cutlass.Int32(0)
        usable = False
        if lane < topk:
            block = args.mIdx[kv_head, token, lane]
            usable = (block >= 0) & (block < blocks)
            if args.paged != 0:
                if usable:
                    page = args.mPageTable[seq, block]
                    usable = (page >= 0) & (page < args.mK.shape[0])
        below = cute.arch.lanemask_lt()
        usable_lanes = cute.arch.vote_ballot_sync(usable)
        same = cute.arch.match_sync(-1, block)  # lanes holding the same id
        first = usable & ((same & usable_lanes & below) == 0)
        firsts = cute.arch.vote_ballot_sync(first)
        rank = cute.arch.popc(firsts & below)
        share = cute.ceil_div(cute.arch.popc(firsts), args.splits)
        mine = first & (rank >= split * share) & (rank < (split + 1) * share)
        mine = mine & (block * BLOCK_KEYS + warp_idx * STEP_KEYS < key_end)
        chosen = cute.arch.vote_ballot_sync(mine)
        if mine:
            place = cute.arch.popc(chosen & below)
            sSteps[warp_idx, place, 0] = block
            sSteps[warp_idx, place, 1] = page
        cute.arch.sync_warp()
        return cutlass.Int32(cute.arch.popc(chosen))

    @cute.jit
    def query_operand(self, args, token, kv_head, g, c):
        """Rows g and g + 8 (heads kv_head x G + row; zero from G on), channels 32c .. 32c +
        31, as the A operands of the 8 k-steps: (8 x 8,) in mma_dtype, the channels of k-step
        s in key_channels(s) order; and the factor the scores are to be multiplied by. bf16 q
        for fp16 MMAs is multiplied by the power of two that puts its largest finite
        magnitude (over the token's rows) in [2^14, 2^15), exact unless a value falls 2^24
        below it, and the factor is its inverse (1 otherwise)."""
        rows = cute.make_rmem_tensor((2, HEAD_DIM // 4), self.dtype)
        for r in cutlass.range_constexpr(2):
            if g + 8 * r < args.group:
                src = args.mQ[token, kv_head * args.group + g + 8 * r, None]
                rows[r, None].store(cute.local_tile(src, (HEAD_DIM // 4,), (c,)).load())
            else:
                rows[r, None].fill(0.0)
        factor = cutlass.Float32(1.0)
        operands = rows
        if cutlass.const_expr(self.dtype != self.mma_dtype):
            values = rows.load().to(cutlass.Float32)
            scaled, factor = into_fp16_range(values, warp_finite_max(values))
            operands = cute.make_rmem_tensor((2, HEAD_DIM // 4), self.mma_dtype)
            operands.store(scaled)
        query = cute.make_rmem_tensor((8 * K_STEPS,), self.mma_dtype)
        for s in cutlass.range_constexpr(K_STEPS):
            d = self.key_channels(s)
            for i in cutlass.range_constexpr(2):  # a0 a1 | a4 a5: row g; a2 a3 | a6 a7: g + 8
                for r in cutlass.range_constexpr(2):
                    query[8 * s + 4 * i + 2 * r] = operands[r, d[2 * i]]
                    query[8 * s + 4 * i + 2 * r + 1] = operands[r, d[2 * i + 1]]
        return query, factor

    def key_channels(self, s: int):
        """The lane's channels (of its 32) in k slots 2c, 2c + 1, 2c + 8, 2c + 9 of k-step s:
        as stored (16-bit, e4m3: 4s .. 4s + 3), or e2m1_word_pairs' pairing (NVFP4: of
        the word of channels 8w .. 8w + 7, w = s // 2, codes k and k + 4)."""
        if self.nvfp4:
            w, h = s // 2, s % 2
            first = 8 * w + 2 * h
            return (first, first + 4, first + 1, first + 5)
        return (4 * s, 4 * s + 1, 4 * s + 2, 4 * s + 3)

    # Shared memory: stage rows are row_bytes long, in 16-byte chunks placed by `chunk_at`
    # so that the lanes of one shared load hit distinct banks (K: 8 lanes of one phase read
    # keys key_row(t, 2p), key_row(t, 2p + 1) at chunks of c; V: keys 16h + 4c + i at
    # chunks of g).
    def row_at(self, row):
        if self.nvfp4:  # 64-byte rows: keys 4c + i of odd c in the other half of the banks
            return row ^ ((row >> 2) & 1)
        return row

    def chunk_at(self, row, chunk):
        if self.row_bytes == 256:
            return chunk ^ (
                ((row ^ (row >> 2)) & 1) | ((chunk >> 3) & 1) << 1 | ((row >> 3) & 1) << 2
            )
        if self.row_bytes == 128:
            return chunk ^ ((row & 1) | ((row >> 2) & 3) << 1)
        return chunk ^ (((row >> 3) & 1) << 1)

    def byte_at(self, region, row, chunk):
        return region + self.row_at(row) * self.row_bytes + self.chunk_at(row, chunk) * 16

    def lane_chunks(self, lane):
        """The stage offsets of the 16-byte chunks a lane copies of a step's K rows (V's are
        STEP_KEYS x row_bytes further): chunk lane % chunks of rows lane // chunks + i x
        (32 // chunks), i < chunks; computed once (the swizzle is the same every step)."""
        chunks = self.row_bytes // 16
        offsets = cute.make_rmem_tensor((chunks,), cutlass.Int32)
        for i in range(chunks):
            offsets[i] = self.byte_at(0, lane // chunks + i * (32 // chunks), lane % chunks)
        return offsets

    @cute.jit
    def load_step(self, args, step, page_rows, ring, stage, warp_idx, lane, offsets):
        """cp.async the step's K and V rows (and NVFP4 scale rows) into stage `stage` of the
        warp's ring (`offsets`: lane_chunks); rows past the sequence are zero instead (never
        read from memory)."""
        seqlen_k, key_start, kv_head = page_rows
        first_key = step[0] * BLOCK_KEYS + warp_idx * STEP_KEYS
        page = step[1]
        page_row = warp_idx * STEP_KEYS
        if args.paged == 0:
            page = 0
            page_row = key_start + first_key
        base = ring + stage * self.stage_bytes
        if first_key + STEP_KEYS <= seqlen_k:  # the same for the whole warp
            self.copy_rows(args, page, kv_head, page_row, base, lane, offsets, STEP_KEYS, True)
        else:
            rows = seqlen_k - first_key
            self.copy_rows(args, page, kv_head, page_row, base, lane, offsets, rows, False)
        if cutlass.const_expr(self.nvfp4):
            # The step's scale rows are 256 contiguous bytes for K and for V (the V scales'
            # 4x4 swizzle stays within each 4 rows): lanes 0-15 copy K's, 16-31 V's.
            scale_copy = cute.make_copy_atom(
                cpasync.CopyG2SOp(), cutlass.Uint8, num_bits_per_copy=128
            )
            mScale = args.mKScale if lane < 16 else args.mVScale
            rows = cute.local_tile(mScale[page, kv_head, None, None], (STEP_KEYS, 8), (warp_idx, 0))
            src = cute.make_tensor(rows.iterator, cute.make_layout(SCALE_BYTES))
            dst = cute.make_tensor(
                smem_ptr(cutlass.Uint8, base + 2 * STEP_KEYS * self.row_bytes + lane * 16),
                cute.make_layout(16),
            )
            cute.copy(scale_copy, cute.local_tile(src, (16,), (lane % 16,)), dst)

    @cute.jit
    def copy_rows(
        self, args, page, kv_head, page_row, base, lane, offsets, rows,
        all_inside: cutlass.Constexpr,
    ):  # fmt: skip
        """The lane's chunks of the step's K and V rows; unless all_inside, rows from `rows`
        on are zero-filled instead of copied."""
        chunk_values = 16 // self.elem_bytes
        chunks = self.row_bytes // 16
        data_copy = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            self.raw_type,
            num_bits_per_copy=128,
        )
        first_row = lane // chunks
        for x in cutlass.range_constexpr(2):
            mX = args.mK if x == 0 else args.mV
            lane_row = cute.local_tile(
                mX[page, kv_head, page_row + first_row, None], (chunk_values,), (lane % chunks,)
            )
            # Bytes between the lane's rows (the ABI's strides are multiples of 16 bytes).
            row_step = cutlass.Int64((32 // chunks) * mX.stride[2] * self.elem_bytes)
            address = lane_row.iterator.toint()
            for i in cutlass.range_constexpr(chunks):
                src = cute.make_tensor(
                    cute.make_ptr(
                        self.raw_type, address + i * row_step, cute.AddressSpace.gmem,
                        assumed_align=16,
                    ),
                    lane_row.layout,
                )  # fmt: skip
                dst = cute.make_tensor(
                    smem_ptr(self.raw_type, base + x * STEP_KEYS * self.row_bytes + offsets[i]),
                    cute.make_layout(chunk_values),
                )
                if cutlass.const_expr(all_inside):
                    cute.copy(data_copy, src, dst)
                elif first_row + i * (32 // chunks) < rows:
                    cute.copy(data_copy, src, dst)
                else:
                    dst.fill(0)

    @cute.jit
    def scores(self, atom, query, base, lane, g, c):
        """S of the step's 32 keys: (4 x S_TILES,) fp32, n-tile t's accumulator at 4t.
        `query`: the query operand's registers, or with query_in_shared its shared-memory
        address."""
        acc_S = cute.make_rmem_tensor((4 * S_TILES,), cutlass.Float32)
        acc_S.fill(0.0)
        for t in cutlass.range_constexpr(S_TILES):
            keys = self.key_operand(base, key_row(t, g), c)
            acc = cute.make_tensor(acc_S.iterator + 4 * t, cute.make_layout((4, 1, 1)))
            for s in cutlass.range_constexpr(K_STEPS):
                if cutlass.const_expr(self.query_in_shared):
                    a = cute.make_rmem_tensor((8, 1), self.mma_dtype)
                    src = smem_ptr(self.mma_dtype, query + (s * 32 + lane) * 16)
                    a.store(cute.make_tensor(src, cute.make_layout((8, 1))).load())
                else:
                    a = cute.make_tensor(query.iterator + 8 * s, cute.make_layout((8, 1)))
                b = cute.make_tensor(keys.iterator + 4 * s, cute.make_layout((4, 1)))
                cute.gemm(atom, acc, a, b, acc)
        return acc_S

    @cute.jit
    def key_operand(self, base, row, c):
        """Channels 32c .. 32c + 31 of step row `row` of K as the B operands of the 8
        k-steps: (4 x K_STEPS,) in mma_dtype (key_channels order)."""
        lane_bytes = self.row_bytes // 4
        words = load_words(
            [
                self.byte_at(base, row, lane_bytes // 16 * c + j)
                for j in range(max(1, lane_bytes // 16))
            ],
            lane_bytes // 4,
        )
        keys = cute.make_rmem_tensor((4 * K_STEPS,), self.mma_dtype)
        out = cute.recast_tensor(keys, cutlass.Int32)  # (2 x K_STEPS,): 16-bit pairs
        if cutlass.const_expr(self.kv_format == "16bit"):
            for i in cutlass.range_constexpr(2 * K_STEPS):
                out[i] = words[i]
        elif cutlass.const_expr(self.kv_format == "e4m3"):
            for s in cutlass.range_constexpr(K_STEPS):
                for h in cutlass.range_constexpr(2):
                    out[2 * s + h] = e4m3_pair_as_f16x2(words[s], h == 1)
        else:
            scales = cutlass.Uint32(
                load_shared(cutlass.Uint16, base + 2 * STEP_KEYS * self.row_bytes + row * 8 + 2 * c)
            )
            steps = fp16_scale_pair(scales)  # groups 2c, 2c + 1: channels 0-15, 16-31
            for w in cutlass.range_constexpr(K_STEPS // 2):
                step = f16x2_broadcast(steps, w >= 2)
                pairs = e2m1_word_pairs(cutlass.Uint32(words[w]))
                for k in cutlass.range_constexpr(4):  # k-step 2w + k // 2, register k % 2
                    out[4 * w + k] = mul_f16x2(pairs[k], step)
        return keys

    @cute.jit
    def add_pv(self, atom, acc_S, acc_O, base, valid, g, c):
        """O += P V over the step's two k16 chunks; `valid`: the step's rows inside the
        sequence (NVFP4: the scales of rows past it are zero, their codes are)."""
        for h in cutlass.range_constexpr(P_CHUNKS):
            p = cute.make_rmem_tensor((8, 1), self.mma_dtype)
            p.store(
                cute.make_tensor(acc_S.iterator + 8 * h, cute.make_layout((8, 1)))
                .load()
                .to(self.mma_dtype)
            )
            values = self.value_operand(base, h, valid, g, c)
            for j in cutlass.range_constexpr(O_TILES):
                acc = cute.make_tensor(acc_O.iterator + 4 * j, cute.make_layout((4, 1, 1)))
                b = cute.make_tensor(values.iterator + 4 * j, cute.make_layout((4, 1)))
                cute.gemm(atom, acc, p, b, acc)

    @cute.jit
    def value_operand(self, base, h, valid, g, c):
        """Channels 16g .. 16g + 15 of keys 16h + 4c + i (i < 4) of the step's V as the B
        operands of the 16 output n-tiles: (4 x O_TILES,) in mma_dtype; n-tile j gets
        channel 16g + j of keys (i = 0, 1) and (2, 3)."""
        lane_bytes = self.row_bytes // 8
        region = base + STEP_KEYS * self.row_bytes
        rows = []
        for i in cutlass.range_constexpr(4):
            row = 16 * h + 4 * c + i
            if cutlass.const_expr(lane_bytes >= 16):
                addresses = [
                    self.byte_at(region, row, lane_bytes // 16 * g + j)
                    for j in range(lane_bytes // 16)
                ]
            else:  # NVFP4: 8 bytes, half of a chunk
                addresses = [self.byte_at(region, row, g // 2) + 8 * (g % 2)]
            rows.append(load_words(addresses, lane_bytes // 4))
        values = cute.make_rmem_tensor((4 * O_TILES,), self.mma_dtype)
        out = cute.recast_tensor(values, cutlass.Int32)  # (2 x O_TILES,): b0 b1 of n-tile j at 2j
        for pair in cutlass.range_constexpr(2):  # keys (0, 1) -> b0, (2, 3) -> b1
            first, second = rows[2 * pair], rows[2 * pair + 1]
            if cutlass.const_expr(self.kv_format == "16bit"):
                for j in cutlass.range_constexpr(O_TILES):
                    selector = 0x5410 if j % 2 == 0 else 0x7632
                    out[2 * j + pair] = cutlass.Int32(
                        cute.arch.prmt(first[j // 2], second[j // 2], selector)
                    )
            elif cutlass.const_expr(self.kv_format == "e4m3"):
                for j in cutlass.range_constexpr(0, O_TILES, 2):
                    selector = 0x5140 if j % 4 == 0 else 0x7362
                    both = cutlass.Int32(cute.arch.prmt(first[j // 4], second[j // 4], selector))
                    out[2 * j + pair] = e4m3_pair_as_f16x2(both, False)
                    out[2 * (j + 1) + pair] = e4m3_pair_as_f16x2(both, True)
            else:
                scales = cutlass.Uint32(
                    load_shared(
                        cutlass.Uint32,
                        base
                        + 2 * STEP_KEYS * self.row_bytes
                        + SCALE_BYTES
                        + (16 * h + 4 * c) * 8
                        + 4 * g,
                    )
                )
                if valid < STEP_KEYS:
                    inside = cutlass.max(valid - 16 * h - 4 * c, 0)
                    if inside < 4:
                        scales = cutlass.Uint32(scales & ((cutlass.Uint32(1) << (8 * inside)) - 1))
                step = fp16_scale_pair(scales >> (16 * pair))
                for j in cutlass.range_constexpr(0, O_TILES, 4):
                    selector = 0x5410 if j % 8 == 0 else 0x7632
                    both = cutlass.Uint32(cute.arch.prmt(first[j // 8], second[j // 8], selector))
                    pairs = e2m1_word_pairs(both)
                    for k in cutlass.range_constexpr(4):
                        out[2 * (j + k) + pair] = mul_f16x2(pairs[k], step)
        return values

    @cute.jit
    def merge_and_store(
        self, args, storage, acc_O, lse, lse_t, token, kv_head, split, tidx, warp_idx, g, c
    ):  # fmt: skip
        """The warps' normalized rows merged by their lse (weights exp(lse_w - lse)) through
        shared memory, then stored: O (times out_scale, saturated to q's dtype) and the
        lse when asked, or with splits the fp32 O and lse for msa_attention_combine."""
        sLse = storage.lse.get_tensor(cute.make_layout((WARPS, ROWS, 2), stride=(ROWS * 2, 2, 1)))
        if c == 0:
            for r in cutlass.range_constexpr(2):
                sLse[warp_idx, g + 8 * r, 0] = lse[r]
                sLse[warp_idx, g + 8 * r, 1] = lse_t[r]
        cute.arch.sync_threads()  # every warp's lse written, and its ring no longer read
        sO = cute.make_tensor(
            smem_ptr(cutlass.Float32, storage.ring.data_ptr().toint()),
            cute.make_layout((WARPS, ROWS, O_PITCH), stride=(ROWS * O_PITCH, O_PITCH, 1)),
        )
        acc_O_mn = row_view(acc_O, O_TILES)
        for r in cutlass.range_constexpr(2):
            row = g + 8 * r
            top = merged_top(sLse, row, 0)
            weight = cutlass.Float32(0.0)
            if lse[r] > NEG_INF:
                weight = cute.math.exp2((lse[r] - top) * LOG2_E, fastmath=True)
            for j in cutlass.range_constexpr(O_TILES):
                for x in cutlass.range_constexpr(2):
                    sO[warp_idx, row, 16 * (2 * c + x) + j] = acc_O_mn[r, (x, j)] * weight
        cute.arch.sync_threads()
        # Thread t: row t // 8, channels 16 (t % 8) .. + 15.
        row = tidx // 8
        part = tidx % 8
        if row < args.group:
            head = kv_head * args.group + row
            sums = cute.make_rmem_tensor((16,), cutlass.Float32)
            sums.fill(0.0)
            for w in cutlass.range_constexpr(WARPS):
                sums.store(sums.load() + cute.local_tile(sO[w, row, None], (16,), (part,)).load())
            top = merged_top(sLse, row, 0)
            total = merged_total(sLse, row, 0, top)
            scale = cutlass.Float32(0.0)
            if total > 0.0:
                scale = args.out_scale * self.value_factor / total
            result = sums.load() * scale
            if args.splits > 1:
                dst = args.mOSplit[split, token, head, None]
                cute.local_tile(dst, (16,), (part,)).store(result)
                if part == 0:
                    for x in cutlass.range_constexpr(2):
                        top_x = merged_top(sLse, row, x)
                        args.mLSESplit[split, x, token, head] = merged_lse(
                            top_x, merged_total(sLse, row, x, top_x)
                        )
            else:
                out = cute.make_rmem_tensor((16,), self.dtype)
                out.store(saturated(result, self.dtype).to(self.dtype))
                cute.local_tile(args.mO[token, head, None], (16,), (part,)).store(out.load())
                if (args.want_lse != 0) & (part == 0):
                    args.mLSE[token, head] = merged_lse(top, total)
                    top_t = merged_top(sLse, row, 1)
                    args.mLSET[token, head] = merged_lse(top_t, merged_total(sLse, row, 1, top_t))


@cute.jit
def merged_top(sLse, row, x):
    """The largest of the warps' lse (x = 0) or temperature lse (x = 1) of a row."""
    top = sLse[0, row, x]
    for w in cutlass.range_constexpr(1, WARPS):
        top = cute.arch.fmax(top, sLse[w, row, x])
    return top


@cute.jit
def merged_total(sLse, row, x, top):
    """sum over the warps of exp(lse_w - top); 0 when no warp saw a key."""
    total = cutlass.Float32(0.0)
    for w in cutlass.range_constexpr(WARPS):
        value = sLse[w, row, x]
        if value > NEG_INF:
            total = total + cute.math.exp2((value - top) * LOG2_E, fastmath=True)
    return total


@cute.jit
def merged_lse(top, total):
    lse = cutlass.Float32(NEG_INF)
    if total > 0.0:
        lse = top + cute.math.log2(total, fastmath=True) * LN_2
    return lse


@cute.jit
def sequence_of(mCuQ, token, lane):
    """The sequence holding `token`: the number of sequences b with cu_seqlens_q[b + 1] <=
    token, found by the warp 32 ways at a time (the bounds [lo, hi] on it shrink 32-fold a
    round; no per-sequence loop)."""
    lo = cutlass.Int32(0)
    hi = mCuQ.shape[0] - 1
    for _ in cutlass.range(4, unroll=1):  # with the last round: up to 32^5 sequences
        if hi - lo >= 32:
            stride = cute.ceil_div(hi - lo, 32)
            b = lo + (lane + 1) * stride - 1
            ended = False
            if b < hi:
                ended = mCuQ[b + 1] <= token
            lo = lo + cute.arch.popc(cute.arch.vote_ballot_sync(ended)) * stride
            hi = cutlass.min(hi, lo + stride - 1)
    b = lo + lane
    ended = False
    if b < hi:
        ended = mCuQ[b + 1] <= token
    return lo + cutlass.Int32(cute.arch.popc(cute.arch.vote_ballot_sync(ended)))


def row_view(acc, tiles: int):
    """An accumulator of `tiles` m16n8 tiles (4 values each at 4t) as (2 rows, (2, tiles))
    columns: the (rows, columns) view softmax_update takes."""
    return cute.make_tensor(acc.iterator, cute.make_layout((2, (2, tiles)), stride=(2, (1, 4))))


def smem_ptr(dtype, address, align: int = 16):
    """A shared-memory pointer of `dtype` at a byte address aligned to `align` bytes."""
    return cute.make_ptr(dtype, address, cute.AddressSpace.smem, assumed_align=align)


@cute.jit
def load_words(addresses, count: cutlass.Constexpr):
    """`count` 32-bit words from shared memory: 4 from each 16-byte aligned address (or 2
    from one 8-byte aligned address when count is 2), one vector load each."""
    words = cute.make_rmem_tensor((count,), cutlass.Int32)
    per = 4 if count >= 4 else count
    for i in cutlass.range_constexpr(count // per):
        src = cute.make_tensor(
            smem_ptr(cutlass.Int32, addresses[i], 4 * per),
            cute.make_layout(per),
        )
        cute.make_tensor(words.iterator + per * i, cute.make_layout(per)).store(src.load())
    return words


@cute.jit
def load_shared(dtype: cutlass.Constexpr, address):
    """One value of `dtype` (aligned to its size) from a shared-memory byte address."""
    src = cute.make_tensor(smem_ptr(dtype, address, dtype.width // 8), cute.make_layout(1))
    return src[0]


# Stages a warp's ring holds, by K/V format: shared memory per CTA 4 x stages x stage_bytes
# (16-bit: 16 KB a stage; e4m3: 8 KB; NVFP4: 4.5 KB; SM120 allows 99 KB a CTA). 16-bit: one
# stage, so that two CTAs fit an SM (their registers allow two): more warps in flight beat a
# warp's own prefetch (MP1 forced onto this kernel 15.1 ms against 21.7 with three stages
# and one CTA, MD1 272-300 us against 308-352 in the same rounds). e4m3: two stages and
# registers capped for 3 CTAs an SM (168, 32 bytes of stack) against three stages and 2 CTAs
# (220 registers): MP1 per-token 10.80-10.82 ms against 11.85, MD1 162.1-162.5 us against
# 163.2-163.3 (bench/results/2026-12-04_241565b_h200_msa_token_stages_ab.md). NVFP4:
# registers capped for 3 CTAs (168, no spills; else 195 and 2 CTAs): the kernel's decoding
# keeps the issue slots busy, and a third CTA's warps fill their stalls; two stages change
# nothing and a cap for 4 (128 registers, 112 bytes of stack) loses 8-11%.
# The query operand in shared memory: e4m3 sheds its spills at 168 registers (32 / 56 bytes of
# stack before): MD1 154.7-154.9 us against 160.2-160.3, MP1 per-token 9.97-9.99 ms against
# 10.80-10.81; NVFP4 unchanged at 3 CTAs (162 registers) and 5% slower at 4 CTAs (128
# registers, 64 bytes of stack), so it keeps its operand in registers
# (bench/results/2026-12-04_c8cd538_h200_msa_token_query_in_shared_ab.md).
STAGES = {"16bit": 1, "e4m3": 2, "nvfp4": 3}
CTAS_PER_SM = {"16bit": 1, "e4m3": 3, "nvfp4": 3}
QUERY_IN_SHARED = {"16bit": False, "e4m3": True, "nvfp4": False}


def make_kernel(variant):
    kv_format = KV_FORMAT[variant.family.name]
    return MsaTokenAttention(
        element_type(variant.params["dtype"]), kv_format, STAGES[kv_format],
        CTAS_PER_SM[kv_format], QUERY_IN_SHARED[kv_format],
    )  # fmt: skip
