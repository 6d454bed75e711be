"""sdsa_scores: the SDSA indexer's FP32 scores q . k (indexer_scores) with
warp-level MMA (mma.sync m16n8k16, fp32 accumulators), every arch.

Keys are the MMA's rows and query rows its columns: a warp scores 32 keys at a time as two
16-key tiles against up to 8 query rows (a group's R = rows / groups <= 8 rows sharing the
table row mRequests[g]). Lane (g = lane / 4, q = lane % 4) holds keys g + 8j (j < 4) of
the warp's 32 (tile j / 2, MMA row g + 8 (j % 2)) and query row g (column g); the MMA's k
dimension, the 128 channels, is permuted the same way for both operands (a dot product
does not care): in k-step s the lane's k slots 2q, 2q + 1, 2q + 8, 2q + 9 are channels
32q + 4s + 0..3. So each lane's operands are channels 32q .. 32q + 31 of its keys and of
its query row, loaded into registers (BF16: 64 contiguous bytes a key; NVFP4: 16 bytes
and two scales), from global memory or, for sdsa_scores' NVFP4 keys, from the pages staged
in shared memory (below); lane (g, q) gets the scores of rows 2q, 2q + 1 for keys g and
g + 8 of each tile. With keys as rows, all of A
is key data and a 16-key tile takes one MMA a k-step (as query rows, a tile of 8 keys took
one, its A mostly zero rows).

A CTA (4 warps) of sdsa_scores owns 512 keys of one group, a warp 4 chunks of 32, decoding
its query once. BF16 keys: the next chunk's loads issued before this one's decode and stores.
NVFP4 keys: the CTA's 8 pages (32 KB of codes, 4 KB of scales) are staged in shared memory
(stage_pages: bulk copies by the TMA unit, an mbarrier for each chunk's two pages), and each
warp reads a chunk from there (staged_warp_keys) as soon as its pages have landed; without
registers held for loads in flight (68 against 120) the kernel runs 6 CTAs an SM, and the
loads of a CTA are issued by 8 lanes.

NVFP4 keys and queries are decoded into fp16 as value x scale / 2^7 (E2M1 codes a
32-bit word at a time placed in fp16 bits by e2m1_word_pairs, times their e4m3 scale x 2^7;
within each 16-channel scale group the channels land in that helper's order, the same for
both operands): exact, since every such product has at most 6 significant bits and lies
between 2^-17 and 21 in magnitude; the MMA's products are then exact and the sums fp32,
and the scores are scaled back by 2^14. BF16 keys and queries go to a bf16 MMA as they are.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from generator.families.sdsa import KEY_DIM, PAGE_KEYS
from generator.kernels.common.entry import element_type
from generator.kernels.common.nvfp4 import FP16_DIVISOR_LOG2, e2m1_word_pairs, fp16_scale_pair
from generator.kernels.common.ptx import (
    bulk_copy_g2s,
    f16x2_broadcast,
    load_u16,
    mul_f16x2,
)

WARPS = 4
WARP_KEYS = 32  # scored by a warp at a time: keys g + 8j (j < 4) a lane
assert PAGE_KEYS % WARP_KEYS == 0  # a warp's keys share a page (fetch_warp_keys)
CHUNKS = 4  # of WARP_KEYS keys a warp, in sdsa_scores
KEYS_PER_CTA = WARPS * WARP_KEYS * CHUNKS
# sdsa_scores with NVFP4 keys stages its pages in shared memory (36 KB a CTA: 6 CTAs an SM);
# the cap keeps its registers (68) from growing past what 5 CTAs allow. BF16 keys (170
# registers, one chunk ahead) would spill hundreds of bytes under any cap that adds a CTA.
NVFP4_CTAS_PER_SM = 5
CTA_PAGES = KEYS_PER_CTA // PAGE_KEYS
CHUNK_PAGES = CTA_PAGES // CHUNKS  # the pages of chunk c (of every warp): 2c, 2c + 1
assert WARPS * WARP_KEYS == CHUNK_PAGES * PAGE_KEYS
CODE_BYTES = PAGE_KEYS * KEY_DIM // 2  # a page's NVFP4 codes
SCALE_BYTES = PAGE_KEYS * KEY_DIM // 16  # and its e4m3 scales
K_STEPS = KEY_DIM // 16
CHANNELS = KEY_DIM // 4  # per thread: 32q .. 32q + 31


class SdsaScores:
    warps = WARPS  # per CTA
    cluster = 1  # CTAs per cluster

    def __init__(self, dtype, nvfp4: bool, ctas_per_sm: int = 1, staged: bool = False):
        self.nvfp4 = nvfp4
        self.staged = staged  # NVFP4: the CTA's pages read from shared memory (kernel_staged)
        self.ctas_per_sm = ctas_per_sm  # > 1: registers capped for that many CTAs an SM
        self.mma_dtype = cutlass.Float16 if nvfp4 else dtype
        # The MMA of NVFP4 operands (each scaled by 2^-7) gives q . k / 2^14.
        self.score_factor = 2.0 ** (2 * FP16_DIVISOR_LOG2) if nvfp4 else 1.0

    @cute.jit
    def launch(self, args, stream):
        atom = cute.make_mma_atom(warp.MmaF16BF16Op(self.mma_dtype, cutlass.Float32, (16, 8, 16)))
        config = dict(grid=self.grid(args), block=[self.warps * 32, 1, 1], stream=stream)
        if cutlass.const_expr(self.ctas_per_sm > 1):
            config.update(min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=100)
        if cutlass.const_expr(self.cluster > 1):
            config["cluster"] = [self.cluster, 1, 1]
        if cutlass.const_expr(self.staged):
            self.kernel_staged(args, atom).launch(**config)
        else:
            self.kernel(args, atom).launch(**config)

    def grid(self, args):
        """A CTA per 512 keys of each group (the select and the repair grid otherwise)."""
        return [cute.ceil_div(args.mScores.shape[1], KEYS_PER_CTA), args.mRequests.shape[0], 1]

    @cute.kernel
    def kernel(self, args, atom):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, group, _ = cute.arch.block_idx()
        lane = tidx % 32
        g = lane // 4
        q = lane % 4
        context = args.mContext[group]
        cta_key = bidx * KEYS_PER_CTA + (tidx // 32) * WARP_KEYS
        if cta_key < context:  # the same for the whole warp: its MMAs run converged
            request = args.mRequests[group]
            rows, query, outputs = self.group_rows(args, group, g, q)
            self.for_each_chunk(
                args, request, cta_key, context, g, q,
                lambda keys, first_key: self.store_scores(
                    atom, keys, first_key, query, outputs, rows, context, g, q
                ),
            )  # fmt: skip

    @cute.kernel
    def kernel_staged(self, args, atom):
        """kernel() for NVFP4 keys with the CTA's pages staged in shared memory: warp 0
        stages them, then each warp scores its chunks from there."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, group, _ = cute.arch.block_idx()
        lane = tidx % 32
        g = lane // 4
        q = lane % 4
        sCodes, sScales, sBarrier = allocate_pages(cutlass.memory.SmemAllocator())
        scales_by_bulk = cutlass.Int32(scale_pages_aligned(args.mKeyScales))
        # The context, the request and lane p's table entry (page p of the CTA's) are loaded
        # together, before the context is known: behind it they made a chain of four round
        # trips before the first bulk copy.
        context = args.mContext[group]
        request = args.mRequests[group]
        cta_first_key = bidx * KEYS_PER_CTA
        page = cta_page(args, request, cta_first_key, args.mScores.shape[1] - 1, tidx)
        if tidx == 0:
            init_page_barrier(sBarrier, scales_by_bulk)
        cute.arch.sync_threads()
        if cta_first_key < context:
            if tidx < 32:
                self.stage_pages(
                    args, page, cta_first_key, context, sCodes, sScales, sBarrier, lane,
                    scales_by_bulk,
                )  # fmt: skip
            warp_key = cta_first_key + (tidx // 32) * WARP_KEYS
            if warp_key < context:
                rows, query, outputs = self.group_rows(args, group, g, q)
                self.for_each_staged_chunk(
                    sCodes, sScales, sBarrier, cta_first_key, warp_key, context, g, q,
                    lambda keys, first_key: self.store_scores(
                        atom, keys, first_key, query, outputs, rows, context, g, q
                    ),
                )  # fmt: skip

    @cute.jit
    def group_rows(self, args, group, g, q):
        """(rows a group, the B values of column g, this thread's output rows): column g is
        query row g (clamped: columns past `rows` are computed, not stored); the thread's
        accumulator columns are rows 2q and 2q + 1 (those below `rows`)."""
        rows = args.mScores.shape[0] // args.mRequests.shape[0]
        first_row = group * rows
        query = self.query_operand(args, first_row + cutlass.min(g, rows - 1), q)
        outputs = [
            args.mScores[first_row + cutlass.min(2 * q + r, rows - 1), None] for r in range(2)
        ]
        return rows, query, outputs

    @cute.jit
    def stage_pages(
        self, args, page, cta_first_key, end, sCodes, sScales, sBarrier, lane, scales_by_bulk
    ):
        """Warp 0: the CTA's pages below `end` (codes and scales) into sCodes / sScales,
        chunk c's (pages 2c, 2c + 1) complete when sBarrier[c]'s phase 0 is; `page`: lane
        p's, the CTA's page p (where it is below `end`). Lane p copies page p by bulk copies
        (its scales too when scales_by_bulk, else the lanes copy the scales two bytes at a
        time and arrive once each on every barrier). Slots past the last page are left as
        they are: their keys are past `end` and their scores never stored (each key is its
        own MMA row)."""
        pages = cutlass.min(CTA_PAGES, cute.ceil_div(end - cta_first_key, PAGE_KEYS))
        if lane < CHUNKS:
            # Every barrier completes, those of chunks without pages at once.
            chunk_pages = cutlass.max(cutlass.min(pages - lane * CHUNK_PAGES, CHUNK_PAGES), 0)
            transferred = chunk_pages * (CODE_BYTES + SCALE_BYTES * scales_by_bulk)
            cute.arch.mbarrier_arrive_and_expect_tx(sBarrier.iterator + lane, transferred)
        if lane < pages:
            barrier = (sBarrier.iterator + lane // CHUNK_PAGES).toint()
            bulk_copy_g2s(
                sCodes[lane, None, None].iterator.toint(),
                args.mKeyCache[page, None, None].iterator.toint(), CODE_BYTES, barrier,
            )  # fmt: skip
            if scales_by_bulk == 1:
                bulk_copy_g2s(
                    sScales[lane, None, None].iterator.toint(),
                    args.mKeyScales[page, None, None].iterator.toint(), SCALE_BYTES, barrier,
                )  # fmt: skip
        if scales_by_bulk == 0:
            halves = cute.recast_tensor(sScales, cutlass.Uint16)  # (pages, 64, 4)
            for slot in cutlass.range(pages, unroll=1):
                source = cute.arch.shuffle_sync(page, slot)
                for i in cutlass.range_constexpr(SCALE_BYTES // 2 // 32):
                    half = i * 32 + lane  # of the page's 256 two-byte pieces
                    address = cute.domain_offset(
                        (half // 4, 2 * (half % 4)), args.mKeyScales[source, None, None]
                    ).iterator.toint()
                    halves[slot, half // 4, half % 4] = load_u16(address)
            for c in cutlass.range_constexpr(CHUNKS):
                cute.arch.mbarrier_arrive(sBarrier.iterator + c)

    @cute.jit
    def for_each_staged_chunk(
        self, sCodes, sScales, sBarrier, cta_first_key, warp_key, end, g, q, body,
        unrolled: cutlass.Constexpr = True,
    ):  # fmt: skip
        """for_each_chunk on the pages stage_pages copies: body(keys, first_key) for the
        warp's chunks that start below `end`, each once its pages have arrived; `unrolled`:
        the chunks' code laid out one after the other (else a loop)."""
        if cutlass.const_expr(unrolled):
            for c in cutlass.range_constexpr(CHUNKS):
                self.staged_chunk(
                    sCodes, sScales, sBarrier, cta_first_key, warp_key, c, end, g, q, body
                )
        else:
            for c in cutlass.range(CHUNKS, unroll=1):
                self.staged_chunk(
                    sCodes, sScales, sBarrier, cta_first_key, warp_key, c, end, g, q, body
                )

    @cute.jit
    def staged_chunk(self, sCodes, sScales, sBarrier, cta_first_key, warp_key, c, end, g, q, body):
        """for_each_staged_chunk's chunk c (its pages: 2c, 2c + 1)."""
        first_key = warp_key + c * WARPS * WARP_KEYS
        if first_key < end:
            cute.arch.mbarrier_wait(sBarrier.iterator + c, 0)
            fetched = self.staged_warp_keys(sCodes, sScales, first_key - cta_first_key, g, q)
            body(self.decode_warp_keys(fetched), first_key)

    @cute.jit
    def staged_warp_keys(self, sCodes, sScales, first_key, g, q):
        """fetch_warp_keys' registers from the staged pages: keys first_key + g + 8j (j < 4)
        of the CTA's (first_key counted from the CTA's first key)."""
        raw = cute.make_rmem_tensor(
            cute.make_layout((4, CHANNELS // 2), stride=(CHANNELS // 2, 1)), cutlass.Uint8
        )
        scale_pairs = cute.make_rmem_tensor(cute.make_layout((4, 2), stride=(2, 1)), cutlass.Uint8)
        for j in cutlass.range_constexpr(4):
            key = first_key + 8 * j + g
            slot, row = key // PAGE_KEYS, key % PAGE_KEYS
            raw[j, None].store(
                cute.local_tile(sCodes[slot, row, None], (CHANNELS // 2,), (q,)).load()
            )
            scale_pairs[j, None].store(cute.local_tile(sScales[slot, row, None], (2,), (q,)).load())
        return raw, scale_pairs

    @cute.jit
    def store_scores(self, atom, keys, first_key, query, outputs, rows, context, g, q):
        """The scores of the warp's 32 keys from first_key against the group's rows, those
        of keys below `context` stored (outputs[r]: row 2q + r of the group)."""
        for t in cutlass.range_constexpr(WARP_KEYS // 16):
            acc = self.tile_scores(atom, keys, t, query)
            for j in cutlass.range_constexpr(2):
                key = first_key + 16 * t + 8 * j + g
                for r in cutlass.range_constexpr(2):
                    if (2 * q + r < rows) & (key < context):
                        outputs[r][key] = acc[2 * j + r, 0, 0] * self.score_factor

    @cute.jit
    def for_each_chunk(self, args, request, warp_key, end, g, q, body):
        """body(keys, first_key) for the warp's CHUNKS chunks of 32 keys from warp_key
        (WARPS x 32 apart) that start below `end`, keys as load_keys gives them; the loads
        of the next chunk are issued before a chunk's decode and body (whose stores the
        compiler may not move loads across)."""
        fetched = []
        for c in cutlass.range_constexpr(CHUNKS):
            for f in cutlass.range_constexpr(len(fetched), min(c + 2, CHUNKS)):
                fetched.append(
                    self.fetch_warp_keys(args, request, warp_key + f * WARPS * WARP_KEYS, end, g, q)
                )
            first_key = warp_key + c * WARPS * WARP_KEYS
            if first_key < end:
                body(self.decode_warp_keys(fetched[c]), first_key)

    @cute.jit
    def fetch_warp_keys(self, args, request, first_key, end, g, q):
        """The loads of keys first_key + g + 8j (j < 4) of table row `request`, channels
        32q .. 32q + 31 each: (values or codes, scale pairs), a row per key. Keys at or past
        `end` read key end - 1 instead (their scores are never stored): no branches, and
        every table entry read is one of the request's pages."""
        last = end - 1
        # The warp's 32 keys share a page (first_key is a multiple of 32 and below end, or
        # every key is clamped to `last`): one table lookup.
        page = args.mBlockTable[request, cutlass.min(first_key, last) // PAGE_KEYS]
        raw = cute.make_rmem_tensor(
            cute.make_layout((4, CHANNELS), stride=(CHANNELS, 1)), self.mma_dtype
        )
        scale_pairs = raw  # unused for BF16
        if cutlass.const_expr(self.nvfp4):
            raw = cute.make_rmem_tensor(
                cute.make_layout((4, CHANNELS // 2), stride=(CHANNELS // 2, 1)), cutlass.Uint8
            )
            scale_pairs = cute.make_rmem_tensor(
                cute.make_layout((4, 2), stride=(2, 1)), cutlass.Uint8
            )
        for j in cutlass.range_constexpr(4):
            key = cutlass.min(first_key + 8 * j + g, last)
            self.load_channels(
                args.mKeyCache[page, None, None], args.mKeyScales[page, None, None],
                key % PAGE_KEYS, q, raw[j, None], scale_pairs[j, None],
            )  # fmt: skip
        return raw, scale_pairs

    @cute.jit
    def load_keys(self, args, request, first_key, end, g, q):
        """Keys first_key + g + 8j (j < 4) of table row `request` as MMA values (4,
        CHANNELS), keys at or past `end` as key end - 1 (fetch_warp_keys)."""
        return self.decode_warp_keys(self.fetch_warp_keys(args, request, first_key, end, g, q))

    @cute.jit
    def decode_warp_keys(self, fetched):
        """fetch_warp_keys' registers as MMA values, (4, CHANNELS) row-major."""
        raw, scale_pairs = fetched
        keys = raw
        if cutlass.const_expr(self.nvfp4):
            keys = cute.make_rmem_tensor(
                cute.make_layout((4, CHANNELS), stride=(CHANNELS, 1)), self.mma_dtype
            )
            for j in cutlass.range_constexpr(4):
                self.decode(raw[j, None], scale_pairs[j, None], keys[j, None])
        return keys

    @cute.jit
    def tile_scores(self, atom, keys, t, query):
        """The m16n8 accumulator of keys 2t and 2t + 1 (MMA rows g and g + 8) against the
        query rows (columns): A a0 a1 a4 a5 from key 2t, a2 a3 a6 a7 from key 2t + 1,
        channels 4s .. 4s + 3 in k-step s; B the query's, a view."""
        acc = cute.make_rmem_tensor((4, 1, 1), cutlass.Float32)
        acc.fill(0.0)
        for s in cutlass.range_constexpr(K_STEPS):
            a = cute.make_rmem_tensor((8, 1), self.mma_dtype)
            for i in cutlass.range_constexpr(4):
                a[i + 2 * (i // 2)] = keys[2 * t, 4 * s + i]
                a[i + 2 * (i // 2) + 2] = keys[2 * t + 1, 4 * s + i]
            b = cute.make_tensor(query.iterator + 4 * s, cute.make_layout((4, 1)))
            cute.gemm(atom, acc, a, b, acc)
        return acc

    @cute.jit
    def query_operand(self, args, row, q):
        """Query row `row` as this lane's B values of the 8 k-steps (channels 4s .. 4s + 3
        of its 32 in k-step s): (CHANNELS,) of the MMA dtype."""
        query = cute.make_rmem_tensor((CHANNELS,), self.mma_dtype)
        self.channels(args.mQuery, args.mQueryScales, row, q, query)
        return query

    @cute.jit
    def channels(self, data, scales, row, q, dst):
        """Channels 32q .. 32q + 31 of data[row] into dst (the MMA dtype): BF16 as they are,
        NVFP4 as value x scale / 2^14."""
        if cutlass.const_expr(self.nvfp4):
            codes = cute.make_rmem_tensor((CHANNELS // 2,), cutlass.Uint8)
            scale_pair = cute.make_rmem_tensor((2,), cutlass.Uint8)
            self.load_channels(data, scales, row, q, codes, scale_pair)
            self.decode(codes, scale_pair, dst)
        else:
            self.load_channels(data, scales, row, q, dst, dst)

    @cute.jit
    def load_channels(self, data, scales, row, q, raw, scale_pair):
        """Channels 32q .. 32q + 31 of data[row] as stored: BF16 values into raw; NVFP4
        codes (16 bytes) into raw and their two scales (groups 2q, 2q + 1) into scale_pair."""
        if cutlass.const_expr(self.nvfp4):
            raw.store(cute.local_tile(data[row, None], (CHANNELS // 2,), (q,)).load())
            # One 2-byte load: the scales start at an even address (sdsa.py checks it) and
            # a row of 8 at a multiple of 8 bytes from it.
            address = cute.domain_offset((row, 2 * q), scales).iterator.toint()
            cute.recast_tensor(scale_pair, cutlass.Uint16)[0] = load_u16(address)
        else:
            raw.store(cute.local_tile(data[row, None], (CHANNELS,), (q,)).load())

    @cute.jit
    def decode(self, codes, scale_pair, dst):
        """NVFP4 codes of 32 channels and their two e4m3 scales into dst as fp16
        value x scale / 2^7, in the order e2m1_word_pairs gives (of the channels 8w ..
        8w + 7, pairs (k, k + 4): queries and keys are decoded alike, so the dot product is
        unchanged; each 16-channel scale group stays in its 16 slots): bit placement, masks
        and byte permutes, one conversion (the scales) a key."""
        code_words = cute.recast_tensor(codes, cutlass.Uint32)
        scales = fp16_scale_pair(cute.recast_tensor(scale_pair, cutlass.Uint16)[0])
        out = cute.recast_tensor(dst, cutlass.Int32)  # (16,): fp16 pairs
        for w in cutlass.range_constexpr(CHANNELS // 8):
            step = f16x2_broadcast(scales, w >= CHANNELS // 16)  # group 2q or 2q + 1
            pairs = e2m1_word_pairs(code_words[w])
            for i in cutlass.range_constexpr(4):
                out[4 * w + i] = mul_f16x2(pairs[i], step)


def allocate_pages(smem):
    """Shared memory for a CTA's staged pages: (sCodes (CTA_PAGES, 64, 64), sScales
    (CTA_PAGES, 64, 8), sBarrier: an mbarrier a chunk, completed by its pages' copies)."""
    sCodes = smem.allocate_tensor(
        cutlass.Uint8,
        cute.make_layout((CTA_PAGES, PAGE_KEYS, KEY_DIM // 2), stride=(CODE_BYTES, 64, 1)),
        128,
    )
    sScales = smem.allocate_tensor(
        cutlass.Uint8,
        cute.make_layout((CTA_PAGES, PAGE_KEYS, 8), stride=(SCALE_BYTES, 8, 1)),
        16,
    )
    sBarrier = smem.allocate_tensor(cutlass.Int64, cute.make_layout(CHUNKS), 8)
    return sCodes, sScales, sBarrier


@cute.jit
def init_page_barrier(sBarrier, scales_by_bulk):
    """sBarrier for stage_pages (one thread): each one arrival with the bulk copies' bytes,
    and one a lane of warp 0 when the scale pages are not 16-byte aligned (bulk copies need
    it; the contract allows 8-byte page strides and even addresses: the lanes copy them)."""
    for c in cutlass.range_constexpr(CHUNKS):
        cute.arch.mbarrier_init(sBarrier.iterator + c, 1 + 32 * (1 - scales_by_bulk))
    cute.arch.mbarrier_init_fence()


@cute.jit
def cta_page(args, request, cta_first_key, last_key, tidx):
    """Lane p of warp 0: the table entry of the CTA's page p in table row `request`, loaded
    before anyone knows which pages are used (0 elsewhere). Every entry read lies in the
    table: the key clamped to last_key (the last the kernel may see), the request into the
    table's rows (a row that sees no key may name any, and a table may have no rows when no
    row sees a key); only the entries of pages below the end of the keys are used."""
    page = cutlass.Int32(0)
    if (tidx < 32) & (args.mBlockTable.shape[0] > 0):
        row = cutlass.max(cutlass.min(request, args.mBlockTable.shape[0] - 1), 0)
        key = cutlass.min(cta_first_key + tidx * PAGE_KEYS, last_key)
        page = args.mBlockTable[row, key // PAGE_KEYS]
    return page


@cute.jit
def scale_pages_aligned(scales):
    """Whether every page of `scales` starts at a multiple of 16 bytes (bulk-copyable)."""
    return (scales.iterator.toint() % 16 == 0) & (scales.layout.stride[0] % 16 == 0)


def make_kernel(variant):
    dtype = variant.params["dtype"]
    nvfp4 = dtype == "u8"
    if nvfp4:
        return SdsaScores(element_type(dtype), nvfp4, ctas_per_sm=NVFP4_CTAS_PER_SM, staged=True)
    return SdsaScores(element_type(dtype), nvfp4)
