"""MSA proxy score for Hopper (sm_90a): TMA loads and wgmma, bf16 / fp16 / e4m3 q and k.

Same contract as the portable template (generator/families/msa_proxy_score.py). A CTA owns
128 query rows of one sequence and one query head (with reduce_heads: every head in turn,
the output row keeping the max): two consumer warpgroups of 64 rows each and a producer
warp. The producer TMA-loads the CTA's Q tile, then the sequence's 128-key blocks up to the
last one any of its rows sees into a ring (flat keys at the sequence's offset, paged keys by
page id); each consumer warpgroup multiplies its 64 rows by each block (S = Q K^T, wgmma
m64n128, both operands in shared memory), releases the stage and reduces S to one max per
row, written to out[head, block, token]:
    producer:  Q; then for each block u: wait for a free stage, TMA K[u] into it
    consumers: for each block u: wait K[u]; S = Q K[u]^T; release; max per row -> out
Only blocks that reach past a row's position (causal) or past the sequence's end, and
paged blocks whose page id lies outside the cache (loaded as TMA's zero fill, every key
masked), mask their scores; the rest take the plain row max. Blocks past the last one the
CTA scores, up to the output's width, are written -inf.

The two consumers run out of phase on their own: while one reduces its S, the tensor cores
run the other's MMA. Two CTAs share an SM, each with a small ring, so one CTA's Q load and
its tail overlap the other's blocks.

e4m3 with fp32 sums (accumulate "fp32"): the FP8 wgmma's accumulator keeps fewer bits than
fp32, so the tiles are converted to fp16 (exact: every e4m3 value is an fp16 one) and
multiplied by the 16-bit wgmma. TMA loads the e4m3 tiles into a raw ring; a converter
warpgroup writes each as fp16 into the ring the consumers read:
    producer:  raw Q; raw K[u] into a free raw stage
    converter: wait raw K[u] and a free fp16 stage; convert; release raw; fp16 stage full
One CTA per SM then (the two rings and Q in both forms take 208 KB).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from generator.families.msa_proxy_score import BLOCK_KEYS, HEAD_DIM
from generator.kernels.common.entry import element_type
from generator.kernels.common.proxy_blocks import scored_blocks
from generator.kernels.common.softmax import acc_mn_view, quad_max
from generator.kernels.common.tile_convert import THREADS as CONVERTER_THREADS
from generator.kernels.common.tile_convert import convert_e4m3_tile

WG_ROWS = 64  # query rows of one consumer warpgroup (wgmma M)
CONSUMERS = 2
CTA_ROWS = WG_ROWS * CONSUMERS
CONSUMER_THREADS = 128
# Each of the two CTAs of an SM: its Q tile and a ring of this many bytes (two 32 KB bf16
# blocks, four e4m3 ones) within half the SM's 228 KB.
RING_BYTES = 64 * 1024
CONVERT_STAGES = 3  # fp16 blocks in the converting CTA's ring (32 KB each)
RAW_STAGES = 4  # e4m3 blocks in its raw ring (16 KB each)
NEG_INF = -cutlass.Float32.inf


class MsaProxyScoreSm90:
    def __init__(self, dtype, paged: bool, accumulate: str):
        self.dtype = dtype  # of q and k in memory
        self.paged = paged
        self.convert = dtype == cutlass.Float8E4M3FN and accumulate == "fp32"
        self.mma_dtype = cutlass.Float16 if self.convert else dtype
        consumer_threads = CONSUMERS * CONSUMER_THREADS
        if self.convert:
            self.stages, self.ctas_per_sm = CONVERT_STAGES, 1
            self.converter_warp = consumer_threads // 32
            self.producer_warp = self.converter_warp + CONVERTER_THREADS // 32
        else:
            self.stages = RING_BYTES // (BLOCK_KEYS * HEAD_DIM * dtype.width // 8)
            self.ctas_per_sm = 2
            self.producer_warp = consumer_threads // 32
        self.num_threads = self.producer_warp * 32 + 32
        self.tile_keys = BLOCK_KEYS  # keys of a scored block (the MMA's N)
        self.rows_per_position = 1  # query rows of one token
        self.extra_smem_bytes = 0  # shared memory a subclass allocates after SharedStorage

    @cute.jit
    def launch(self, args, stream):
        mQ, mK = args.mQ, args.mK
        # TMA views: (rows, D, heads) for Q and flat K; paged K as (128, D, pages * Hkv).
        q_view = rows_d_heads(mQ, mQ.shape[0], mQ.shape[1], mQ.stride[0], mQ.stride[1])
        if cutlass.const_expr(self.paged):
            k_view = rows_d_heads(mK, BLOCK_KEYS, mK.shape[0], mK.stride[1], mK.stride[0])
        else:
            k_view = rows_d_heads(mK, mK.shape[0], mK.shape[1], mK.stride[0], mK.stride[1])
        # Heads first, then query tiles from the last (causal: the longest first), then
        # sequences; with reduce_heads one CTA walks every head.
        heads = cutlass.Int32(cutlass.select_(args.reduce_heads != 0, 1, mQ.shape[1]))
        grid = [heads, cute.ceil_div(args.max_seqlen_q, CTA_ROWS), args.mCuQ.shape[0] - 1]
        self.launch_grid(args, q_view, k_view, grid, stream)

    @cute.jit
    def launch_grid(self, args, q_view, k_view, grid, stream):
        """The kernel over `grid`, Q and K loaded by TMA from the (rows, D, heads) views."""
        d = HEAD_DIM
        mma = sm90_utils.make_trivial_tiled_mma(
            self.mma_dtype,
            self.mma_dtype,
            OperandMajorMode.K,
            OperandMajorMode.K,
            cutlass.Float32,
            (1, 1, 1),
            (WG_ROWS, self.tile_keys),
        )
        tile_mnk = (WG_ROWS, self.tile_keys, d)
        # The MMA's operands; converting, TMA fills raw e4m3 tiles of the same shapes.
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, tile_mnk, self.mma_dtype, CONSUMERS
        )
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, tile_mnk, self.mma_dtype, self.stages
        )
        loaded_q, loaded_k = sQ_layout, sK_layout
        if cutlass.const_expr(self.convert):
            loaded_q = sm90_utils.make_smem_layout_a(
                LayoutEnum.ROW_MAJOR, tile_mnk, self.dtype, CONSUMERS
            )
            loaded_k = sm90_utils.make_smem_layout_b(
                LayoutEnum.ROW_MAJOR, tile_mnk, self.dtype, RAW_STAGES
            )
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_q_tensor = cpasync.make_tiled_tma_atom(
            tma_op, q_view, cute.slice_(loaded_q, (None, None, 0)), (WG_ROWS, d)
        )
        tma_k, tma_k_tensor = cpasync.make_tiled_tma_atom(
            tma_op, k_view, cute.slice_(loaded_k, (None, None, 0)), (self.tile_keys, d)
        )
        SharedStorage = self.shared_storage(sQ_layout, sK_layout, loaded_q, loaded_k)
        self.kernel(
            mma, tma_q, tma_q_tensor, tma_k, tma_k_tensor, args, sQ_layout, sK_layout, loaded_q,
            loaded_k, SharedStorage,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes() + self.extra_smem_bytes,
            stream=stream,
            min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=100,
        )  # fmt: skip

    def shared_storage(self, sQ_layout, sK_layout, loaded_q, loaded_k):
        """The CTA's shared memory: barriers, Q and the K ring (and converting, the raw ones)."""
        mma_dtype, raw = self.mma_dtype, self.dtype
        stages = self.stages

        if self.convert:

            @cute.struct
            class Converting:
                barriers: cute.struct.MemRange[cutlass.Int64, 4 * (1 + stages + RAW_STAGES)]
                sQ: cute.struct.Align[cute.struct.MemRange[mma_dtype, cute.cosize(sQ_layout)], 1024]
                sK: cute.struct.Align[cute.struct.MemRange[mma_dtype, cute.cosize(sK_layout)], 1024]
                rawQ: cute.struct.Align[cute.struct.MemRange[raw, cute.cosize(loaded_q)], 1024]
                rawK: cute.struct.Align[cute.struct.MemRange[raw, cute.cosize(loaded_k)], 1024]

            return Converting

        @cute.struct
        class Direct:
            barriers: cute.struct.MemRange[cutlass.Int64, 2 * (1 + stages)]
            sQ: cute.struct.Align[cute.struct.MemRange[mma_dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[mma_dtype, cute.cosize(sK_layout)], 1024]

        return Direct

    @cute.kernel
    def kernel(
        self,
        mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ_tma: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK_tma: cute.Tensor,
        args,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        loaded_q: cute.ComposedLayout,
        loaded_k: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        head_x, chunk_y, batch = cute.arch.block_idx()
        chunk = cute.ceil_div(args.max_seqlen_q, CTA_ROWS) - 1 - chunk_y
        q_start = args.mCuQ[batch]
        rows_left = args.mCuQ[batch + 1] - q_start - chunk * CTA_ROWS
        if rows_left > 0:
            seqlen_k, first_pos, blocks = scored_blocks(
                args, self.paged, batch, args.mCuQ[batch + 1] - q_start, chunk * CTA_ROWS,
                cutlass.min(rows_left, CTA_ROWS),
            )  # fmt: skip
            hq = args.mQ.shape[1]
            head_begin, head_end, out_row = head_x, head_x + 1, head_x
            if args.reduce_heads != 0:
                head_begin, head_end, out_row = cutlass.Int32(0), hq, cutlass.Int32(0)
            first_token = q_start + chunk * CTA_ROWS
            if blocks > 0:
                storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
                self.run_roles(
                    args, mma, tma_q, mQ_tma, tma_k, mK_tma, sQ_layout, sK_layout, loaded_q,
                    loaded_k, storage, tidx, warp, batch, first_token, first_pos, rows_left,
                    seqlen_k, head_begin, head_end, out_row, cutlass.Int32(0), blocks,
                )  # fmt: skip
            # Blocks no row sees: -inf (the same for every head).
            width = args.mOut.shape[1]
            for i in cutlass.range(tidx, (width - blocks) * CTA_ROWS, self.num_threads, unroll=1):
                row = i % CTA_ROWS
                if row < rows_left:
                    args.mOut[out_row, blocks + i // CTA_ROWS, first_token + row] = NEG_INF

    @cute.jit
    def run_roles(
        self, args, mma, tma_q, mQ_tma, tma_k, mK_tma, sQ_layout, sK_layout, loaded_q, loaded_k,
        storage, tidx, warp, batch, first_token, first_pos, rows_left, seqlen_k, head_begin,
        head_end, out_row, first_block, blocks, lists=None,
    ):  # fmt: skip
        """The CTA's pipelines in `storage` (its SharedStorage), then each warp's role: the
        producer, the consumer warpgroups and (converting) the converter, over blocks
        [first_block, blocks) of the rows from first_token (query rows of the Q view) on, per
        head in [begin, end). lists: the rows' top-16 lists a subclass's store keeps
        (generator/kernels/common/icp_lists.py), or None."""
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        rawQ, rawK = sQ, sK  # what TMA fills
        if cutlass.const_expr(self.convert):
            rawQ = storage.rawQ.get_tensor(loaded_q.outer, swizzle=loaded_q.inner)
            rawK = storage.rawK.get_tensor(loaded_k.outer, swizzle=loaded_k.inner)
        pipes = self.pipelines(storage, loaded_q, loaded_k)
        if warp == self.producer_warp:
            self.produce(
                args, tma_q, mQ_tma, tma_k, mK_tma, rawQ, rawK, pipes["load_q"],
                pipes["load_k"], batch, first_token, head_begin, head_end, first_block, blocks,
            )  # fmt: skip
        elif warp < CONSUMERS * CONSUMER_THREADS // 32:
            self.consume(
                args, mma, sQ, sK, pipes["read_q"], pipes["read_k"], tidx, warp // 4, batch,
                first_token, first_pos, rows_left, seqlen_k, head_begin, head_end, out_row,
                first_block, blocks, lists,
            )  # fmt: skip
        elif cutlass.const_expr(self.convert):
            self.convert_tiles(
                pipes["raw_q"], pipes["raw_k"], pipes["fill_q"], pipes["fill_k"], rawQ, rawK,
                sQ, sK, tidx % CONVERTER_THREADS, head_end - head_begin, blocks - first_block,
            )  # fmt: skip

    def pipelines(self, storage, loaded_q, loaded_k) -> dict:
        """The pipelines' ends by role: load_q / load_k (the producer's TMA) and read_q /
        read_k (the consumers); converting, also raw_q / raw_k (the converter reading what TMA
        loaded) and fill_q / fill_k (the converter writing fp16 for the consumers)."""
        barriers = storage.barriers.data_ptr()
        tma = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = CONSUMERS * CONSUMER_THREADS
        # TMA pipelines' readers arrive once a warp; the converter's, once a thread.
        tma_readers = (CONVERTER_THREADS if self.convert else consumers) // 32
        ends = {}
        raw_stages = RAW_STAGES if self.convert else self.stages
        for name, stages, layout, tiles in (
            ("q", 1, loaded_q, CONSUMERS),
            ("k", raw_stages, loaded_k, 1),
        ):
            tile_bytes = cute.size_in_bytes(self.dtype, cute.slice_(layout, (None, None, 0)))
            producer, consumer = pipeline.PipelineTmaAsync.create(
                barrier_storage=barriers,
                num_stages=stages,
                producer_group=tma,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, tma_readers),
                tx_count=tile_bytes * tiles,
            ).make_participants()
            ends["load_" + name] = producer
            ends[("raw_" if self.convert else "read_") + name] = consumer
            barriers = barriers + 2 * stages
        if self.convert:
            for name, stages in (("q", 1), ("k", self.stages)):
                producer, consumer = pipeline.PipelineAsync.create(
                    barrier_storage=barriers,
                    num_stages=stages,
                    producer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, CONVERTER_THREADS
                    ),
                    consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
                ).make_participants()
                ends["fill_" + name], ends["read_" + name] = producer, consumer
                barriers = barriers + 2 * stages
        return ends

    @cute.jit
    def key_tile(self, args, batch, kv_head, u):
        """The TMA coordinate of block u's keys: the kv head's page (paged; -1, all zero fill,
        for a page id outside the cache) or the block's index in the sequence (flat)."""
        if cutlass.const_expr(self.paged):
            page = args.mPageTable[batch, u]
            tile = page * args.kv_heads + kv_head
            if (page < 0) | (page >= args.mK.shape[0] // args.kv_heads):
                tile = cutlass.Int32(-1)
            return tile
        else:
            return u

    @cute.jit
    def produce(
        self, args, tma_q, mQ_tma, tma_k, mK_tma, sQ, sK, q_producer, k_producer, batch,
        first_token, head_begin, head_end, first_block, blocks,
    ):  # fmt: skip
        """The producer warp: per head, the CTA's Q (two 64-row TMA tiles), then its blocks."""
        d = HEAD_DIM
        cpasync.prefetch_descriptor(tma_q)
        cpasync.prefetch_descriptor(tma_k)
        for head in cutlass.range(head_begin, head_end, unroll=1):
            kv_head = self.kv_head_of(args, head)
            gQ = cute.local_tile(
                cute.domain_offset((first_token, 0), mQ_tma[None, None, head]), (WG_ROWS, d),
                (None, 0),
            )  # fmt: skip
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                cute.group_modes(gQ, 0, 2),
            )  # fmt: skip
            if cutlass.const_expr(self.paged):
                gK = mK_tma
            else:
                gK = cute.local_tile(
                    cute.domain_offset((args.mCuK[batch], 0), mK_tma[None, None, kv_head]),
                    (self.tile_keys, d),
                    (None, 0),
                )
            tKsK, tKgK = cpasync.tma_partition(
                tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                cute.group_modes(gK, 0, 2),
            )  # fmt: skip
            handle = q_producer.acquire_and_advance()
            for w in cutlass.range_constexpr(CONSUMERS):
                cute.copy(tma_q, tQgQ[None, w], tQsQ[None, w], tma_bar_ptr=handle.barrier)
            for u in cutlass.range(first_block, blocks, unroll=1):
                handle = k_producer.acquire_and_advance()
                tile = self.key_tile(args, batch, kv_head, u)
                cute.copy(
                    tma_k, tKgK[None, tile], tKsK[None, handle.index], tma_bar_ptr=handle.barrier
                )

    @cute.jit
    def convert_tiles(self, raw_q, raw_k, fill_q, fill_k, rawQ, rawK, sQ, sK, tidx, heads, blocks):
        """The converter warpgroup: per head, Q, then each block's keys, from the raw e4m3
        tiles TMA loaded to the fp16 tiles the consumers multiply. (The pipeline ends come as
        names: a loop carries their state only so.)"""
        for _ in cutlass.range(heads, unroll=1):
            raw = raw_q.wait_and_advance()
            out = fill_q.acquire_and_advance()
            for w in cutlass.range_constexpr(CONSUMERS):
                convert_e4m3_tile(rawQ[None, None, w], sQ[None, None, w], tidx)
            self.hand_over(raw, out)
            for _ in cutlass.range(blocks, unroll=1):
                raw = raw_k.wait_and_advance()
                out = fill_k.acquire_and_advance()
                convert_e4m3_tile(rawK[None, None, raw.index], sK[None, None, out.index], tidx)
                self.hand_over(raw, out)

    @cute.jit
    def hand_over(self, raw, out):
        """The converted tile is the consumers' (its generic-proxy stores made visible to
        their wgmma first); the raw stage is TMA's again."""
        cute.arch.fence_proxy("async.shared", space="cta")
        raw.release()
        out.commit()

    @cute.jit
    def consume(
        self, args, mma, sQ, sK, q_consumer, k_consumer, tidx, wg, batch, first_token,
        first_pos, rows_left, seqlen_k, head_begin, head_end, out_row, first_block, blocks,
        lists,
    ):  # fmt: skip
        """A consumer warpgroup: per head and block, S = Q K^T of its 64 rows, then the row
        maxima (masked where the block reaches past a row or the sequence); with lists, its
        rows' lists opened first and written out last."""
        tidx = tidx % CONSUMER_THREADS
        mma.set(warpgroup.Field.ACCUMULATE, True)
        thr = mma.get_slice(tidx)
        tSrQ = thr.make_fragment_A(thr.partition_A(sQ))[None, None, None, wg]
        tSrK = thr.make_fragment_B(thr.partition_B(sK))
        tile = (WG_ROWS, self.tile_keys)
        acc = cute.make_rmem_tensor(thr.partition_shape_C(tile), cutlass.Float32)
        acc_mn = acc_mn_view(acc)
        tScS_mn = acc_mn_view(thr.partition_C(cute.make_identity_tensor(tile)))
        rows = cute.size(tScS_mn, mode=[0])
        # Position of the warpgroup's first row (rows_per_position query rows a token).
        wg_pos = first_pos + wg * (WG_ROWS // self.rows_per_position)
        wg_rows_left = rows_left - wg * WG_ROWS
        row_max = cute.make_rmem_tensor((rows,), cutlass.Float32)
        if cutlass.const_expr(lists is not None):
            if wg_rows_left > 0:
                lists.open_rows(args, tScS_mn, tidx, first_token + wg * WG_ROWS, wg_rows_left)
        for head in cutlass.range(head_begin, head_end, unroll=1):
            kv_head = self.kv_head_of(args, head)
            q_handle = q_consumer.wait_and_advance()
            for u in cutlass.range(first_block, blocks, unroll=1):
                k_handle = k_consumer.wait_and_advance()
                # A warpgroup past the sequence's rows (decode, the last tile) only releases.
                if wg_rows_left > 0:
                    acc.fill(0.0)
                    warpgroup.fence()
                    for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                        cute.gemm(
                            mma, acc, tSrQ[None, None, k], tSrK[None, None, k, k_handle.index],
                            acc,
                        )  # fmt: skip
                    warpgroup.commit_group()
                    # Under the MMA: which keys of the block the rows may see.
                    keys, masked = self.block_keys(args, batch, kv_head, u, seqlen_k, wg_pos)
                    warpgroup.wait_group(0)
                    k_handle.release()
                    self.row_maxima(args, acc_mn, tScS_mn, row_max, keys, masked, wg_pos, u)
                    self.store(
                        args, row_max, tScS_mn, tidx, out_row, u, first_token + wg * WG_ROWS,
                        wg_rows_left, head != head_begin, lists,
                    )  # fmt: skip
                else:
                    k_handle.release()
            q_handle.release()
        if cutlass.const_expr(lists is not None):
            if wg_rows_left > 0:
                lists.close_rows(args, tScS_mn, tidx, first_token + wg * WG_ROWS, wg_rows_left)

    @cute.jit
    def kv_head_of(self, args, head):
        return head // (args.mQ.shape[1] // args.kv_heads)

    @cute.jit
    def block_keys(self, args, batch, kv_head, u, seqlen_k, wg_pos):
        """(the keys of block u that exist: none past a page id outside the cache, whether a
        row of the warpgroup, from position wg_pos on, sees fewer than them all)."""
        keys = seqlen_k - u * BLOCK_KEYS
        if cutlass.const_expr(self.paged):
            outside = self.key_tile(args, batch, kv_head, u) < 0
            keys = cutlass.select_(outside, cutlass.Int32(0), keys)
        masked = keys < BLOCK_KEYS
        if args.causal != 0:
            masked = masked | (wg_pos < u * BLOCK_KEYS + BLOCK_KEYS - 1)
        return keys, masked

    @cute.jit
    def row_limit(self, args, keys, wg_pos, row, u):
        """How many of block u's keys (a prefix) the warpgroup's row `row` sees."""
        limit = keys
        if args.causal != 0:
            limit = cutlass.min(keys, wg_pos + row - u * BLOCK_KEYS + 1)
        return limit

    @cute.jit
    def row_maxima(self, args, acc_mn, tScS_mn, row_max, keys, masked, wg_pos, u):
        """Each of the thread's rows' max over its columns of block u: the keys past
        row_limit's masked when `masked` (else a plain tree)."""
        if masked:
            for r in cutlass.range_constexpr(cute.size(row_max)):
                limit = self.row_limit(args, keys, wg_pos, tScS_mn[r, 0][0], u)
                row_max[r] = NEG_INF
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    score = cutlass.select_(tScS_mn[r, c][1] < limit, acc_mn[r, c], NEG_INF)
                    row_max[r] = cute.arch.fmax(row_max[r], cutlass.Float32(score))
        else:
            for r in cutlass.range_constexpr(cute.size(row_max)):
                row_max[r] = tree_max(acc_mn, r)

    @cute.jit
    def store(
        self, args, row_max, tScS_mn, tidx, out_row, block, first_token, rows_left,
        not_first_head, lists,
    ):  # fmt: skip
        """Each row's max (over its quad), written by the quad's first lane; with reduce_heads
        the max with what the earlier heads wrote."""
        for r in cutlass.range_constexpr(cute.size(row_max)):
            value = quad_max(row_max[r])
            row = tScS_mn[r, 0][0]
            token = first_token + row
            if (tidx % 4 == 0) & (row < rows_left):
                if args.reduce_heads != 0:
                    if not_first_head:
                        value = cute.arch.fmax(value, args.mOut[0, block, token])
                args.mOut[out_row, block, token] = value


def rows_d_heads(t: cute.Tensor, rows, heads, row_stride, head_stride) -> cute.Tensor:
    """t's rows of HEAD_DIM channels as the (rows, D, heads) view TMA loads tiles of."""
    layout = cute.make_layout((rows, HEAD_DIM, heads), stride=(row_stride, 1, head_stride))
    return cute.make_tensor(t.iterator, layout)


def tree_max(acc_mn: cute.Tensor, r: int):
    """max over row r's columns as a tree (independent max instructions in flight, not one
    chain), traced in Python; fmax ignores NaN, as the contract's max does."""
    n = cute.size(acc_mn, mode=[1])
    vals = [acc_mn[r, c] for c in range(n)]
    while len(vals) > 1:
        vals = [cute.arch.fmax(vals[i], vals[i + 1]) for i in range(0, len(vals) - 1, 2)] + (
            [vals[-1]] if len(vals) % 2 else []
        )
    return vals[0]


def make_kernel(variant):
    p = variant.params
    return MsaProxyScoreSm90(element_type(p["dtype"]), p["key_layout"] == "paged", p["accumulate"])
