"""sdsa_repair: indexer_threshold_select's repair mode, a second launch after the select.

A cluster of CTAs per 512 rows (16 CTAs on SM90, 8 on SM100; 1 on SM120, whose clusters
are of 1), 16 warps each: a thread a row finds the rows that need repair (most fit: a
cluster a row would launch thousands of CTAs that exit at once), then the cluster repairs
them one after the other. A lone repaired row is the launch's tail, and its time is the
instructions its CTAs issue (one CTA an SM; the profiler found its SMs issuing at ~0.34
an issue slot, the other SMs idle), so its keys are split over the cluster (CTA r takes
chunks r, r + peers, ...). A row fits when its candidates fit their slots (cands <= cap =
slots - top_k) and its candidates plus stored ties reach wanted = min(row_end, top_k). A
row that does not is repaired: the cluster radix-selects the exact wanted-th largest of
the row's scores in float-bit order (generator/kernels/common/radix_select.py; the
histograms summed through distributed shared memory), makes it the row's threshold, zeroes
the row's counters and selects the row again. Then fewer than wanted scores lie above the
threshold (<= top_k - 1 <= cap) and the rest of the wanted ones tie with it, so the row
fits. Every row then gets its ranges: (top_k - min(ties, top_k), top_k + min(cands, cap)).

The scores are computed 512 keys at a time on tensor cores, exactly as sdsa_scores and
sdsa_select compute them, and no score matrix is written: before the radix passes each CTA
scores its first CACHED_KEYS keys into its shared memory (fill_cache: FILL_BATCH chunks'
loads issued before their scoring), and the four passes and the reselect read those back,
a key a thread (the MMA leaves a row's scores in a quarter of the lanes), and recompute
only the keys beyond (a row of up to 131,072 keys on SM90 / SM100 is read once; on SM120,
20 Ki keys of it).
"""

import cutlass
import cutlass.cute as cute

from generator.kernels.common.block_scan import exclusive_scan
from generator.kernels.common.entry import element_type
from generator.kernels.common.radix_select import (
    float_bits,
    float_of_order_key,
    histogram_words,
    radix_select,
)
from generator.kernels.portable.sdsa_scores import WARP_KEYS, SdsaScores
from generator.kernels.portable.sdsa_select import TILE_ROWS, classify

WARPS = 16
CHUNK_KEYS = WARPS * WARP_KEYS  # scored per step, a thread per key
ROWS_PER_CLUSTER = WARPS * 32  # a thread each finds whether it needs repair (and lists it)
# CTAs per row (a cluster), by arch: SM90 takes clusters of 16 (non-portable; the DSL
# allows them on every kernel), SM120 runs clusters of 1.
PEERS = {"sm_90a": 16, "sm_100f": 8, "sm_120f": 1}
# Scores kept on chip per CTA, by arch (a multiple of CHUNK_KEYS): the cluster's 16 x 32 KB
# (SM90) or 8 x 64 KB (SM100) hold a 131,072-key row; SM120's one CTA what its 99 KB allow.
CACHED_KEYS = {"sm_90a": 8 * 1024, "sm_100f": 16 * 1024, "sm_120f": 20 * 1024}
# Chunks of WARP_KEYS keys a warp fetches before scoring them into the cache, by key format:
# NVFP4 keys take 18 registers a chunk as fetched, BF16 keys 64 (one at a time).
FILL_BATCH = {"nvfp4": 4, "bf16": 1}


class SdsaRepair(SdsaScores):
    warps = WARPS

    def __init__(self, dtype, nvfp4: bool, peers: int, cached_keys: int):
        super().__init__(dtype, nvfp4)
        assert cached_keys % CHUNK_KEYS == 0
        self.cluster = peers
        self.cached_keys = cached_keys
        self.fill_batch = FILL_BATCH["nvfp4" if nvfp4 else "bf16"]

    def grid(self, args):
        """A cluster per ROWS_PER_CLUSTER rows."""
        return [cute.ceil_div(args.mRowEnds.shape[0], ROWS_PER_CLUSTER) * self.cluster, 1, 1]

    @cute.kernel
    def kernel(self, args, atom):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        peers = self.cluster
        rank = bidx % peers  # in the cluster (clusters run along x)
        first_row = bidx // peers * ROWS_PER_CLUSTER
        rows = cutlass.min(args.mRowEnds.shape[0] - first_row, ROWS_PER_CLUSTER)
        smem = cutlass.memory.SmemAllocator()
        sHist = smem.allocate_tensor(cutlass.Int32, cute.make_layout(histogram_words(peers)), 16)
        sState = smem.allocate_tensor(cutlass.Int32, cute.make_layout(2), 16)
        sScores = smem.allocate_tensor(cutlass.Float32, cute.make_layout(self.cached_keys), 16)
        sRepair = smem.allocate_tensor(cutlass.Int32, cute.make_layout(ROWS_PER_CLUSTER), 16)
        sRows = smem.allocate_tensor(cutlass.Int32, cute.make_layout(ROWS_PER_CLUSTER), 16)
        sWarpSums = smem.allocate_tensor(cutlass.Int32, cute.make_layout(WARPS), 16)
        # A thread a row: a row that fits gets its ranges now, the others are marked. Every
        # CTA of the cluster reads the same counters, so all mark the same rows.
        repair = 0
        if tidx < rows:
            row = first_row + tidx
            if self.fits(args, row):
                if rank == 0:
                    self.write_ranges(args, row)
            else:
                repair = 1
        # The rows to repair listed in row order (a scan of the flags), so that the walk
        # below costs what the repaired rows cost: testing all 512 flags one after the
        # other took ~50 us a wave of clusters when every row fit.
        sRepair[tidx] = repair
        repairs = exclusive_scan(
            lambda i: sRepair[i], sRepair, sWarpSums, ROWS_PER_CLUSTER, tidx, ROWS_PER_CLUSTER
        )
        if repair != 0:
            sRows[sRepair[tidx]] = tidx
        # (Every CTA has read the counters before any row's reset in repair_row, and every
        # CTA lists the same rows: they read the same counters.)
        self.cluster_sync()
        for i in cutlass.range(repairs, unroll=1):
            self.repair_row(args, atom, first_row + sRows[i], rank, tidx, sHist, sState, sScores)

    @cute.jit
    def fits(self, args, row):
        """Whether the row's candidates fit their slots and, with its stored ties, reach
        the wanted count."""
        top_k = args.top_k
        cands = args.mCounters[row, 0]
        ties = args.mCounters[row, 1]
        wanted = cutlass.min(cutlass.min(args.mRowEnds[row], args.max_context), top_k)
        cap = args.mCandidates.shape[1] - top_k
        return (cands <= cap) & (cands + cutlass.min(ties, top_k) >= wanted)

    @cute.jit
    def write_ranges(self, args, row):
        """The row's [first, end) candidate slots from its counters."""
        top_k = args.top_k
        cap = args.mCandidates.shape[1] - top_k
        args.mRanges[0, row] = top_k - cutlass.min(args.mCounters[row, 1], top_k)
        args.mRanges[1, row] = top_k + cutlass.min(args.mCounters[row, 0], cap)

    @cute.jit
    def repair_row(self, args, atom, row, rank, tidx, sHist, sState, sScores):
        """The row's exact threshold, the row selected again, and its ranges: every thread of
        the cluster calls it (it synchronises the cluster)."""
        peers = self.cluster
        lane = tidx % 32
        g = lane // 4
        q = lane % 4
        top_k = args.top_k
        end = cutlass.min(args.mRowEnds[row], args.max_context)
        wanted = cutlass.min(end, top_k)
        request = args.mTileRequests[row // TILE_ROWS]
        # The row is every MMA column (lanes q == 0 keep its scores).
        query = self.query_operand(args, row, q)
        # Every thread walks all its CTA's chunks of CHUNK_KEYS keys: the warps' MMAs run
        # converged, and every CTA of the cluster makes as many steps.
        count = cute.ceil_div(end, CHUNK_KEYS * peers) * (CHUNK_KEYS * peers)
        threshold = cutlass.Float32(float("inf"))  # nothing wanted: nothing above it
        # Chunks from `kept` on are beyond the CTAs' caches: their scores are computed in
        # every pass (in loops of their own: radix_select's split).
        kept = self.cached_keys * peers
        first = tidx + rank * CHUNK_KEYS
        # Filled whenever the row sees a key: the reselect below reads the cache even when
        # nothing is wanted (top_k = 0).
        self.fill_cache(
            atom, args, query, request, first, cutlass.min(count, kept), end, g, q, tidx,
            sScores,
        )  # fmt: skip
        if wanted > 0:
            key, _ = radix_select(
                lambda i, step, cached: [
                    (ok, float_bits(score))
                    for ok, _, score in self.chunk_scores(
                        atom, args, query, request, i - tidx, end, g, q, tidx, sScores, cached
                    )
                ],
                count, wanted, sHist, sState, tidx, CHUNK_KEYS, peers, rank, split=kept,
            )  # fmt: skip
            threshold = float_of_order_key(key)
        if (tidx == 0) & (rank == 0):
            args.mThresholds[row] = threshold
            args.mCounters[row, 0] = 0
            args.mCounters[row, 1] = 0
        self.cluster_sync()
        for cached, start, stop in (
            (True, first, cutlass.min(count, kept)),
            (False, first + kept, count),
        ):
            for i in cutlass.range(start, stop, CHUNK_KEYS * peers, unroll=1):
                triples = self.chunk_scores(
                    atom, args, query, request, i - tidx, end, g, q, tidx, sScores, cached
                )  # fmt: skip
                for v in cutlass.range_constexpr(len(triples)):
                    ok, key, score = triples[v]
                    classify(args, row, key, score, threshold, ok)
        self.cluster_sync()
        if (tidx == 0) & (rank == 0):
            self.write_ranges(args, row)

    @cute.jit
    def cluster_sync(self):
        """A barrier of the row's CTAs (with release / acquire: the counters' reset and
        atomics before it are seen after it)."""
        if cutlass.const_expr(self.cluster > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

    @cute.jit
    def fill_cache(self, atom, args, query, request, start, stop, end, g, q, tidx, sScores):
        """The scores of this thread's cached chunks (i = start, start + CHUNK_KEYS x peers,
        ... < stop; the keys of chunk i - tidx) into sScores in key order, where chunk_scores
        reads them back a key a thread: fill_batch chunks' loads issued, then their scoring.
        Every thread makes as many steps (stop is a multiple of the stride), and the keys of
        chunks past the row's end are its last key (fetch_warp_keys)."""
        stride = CHUNK_KEYS * self.cluster
        warp_key = (tidx // 32) * WARP_KEYS
        for i in cutlass.range(start, stop, stride * self.fill_batch, unroll=1):
            fetched = [
                self.fetch_warp_keys(args, request, i + b * stride - tidx + warp_key, end, g, q)
                for b in range(self.fill_batch)
            ]
            for b in cutlass.range_constexpr(self.fill_batch):
                # Chunks past `stop` (the batch's tail) are scored, not kept: a branch around
                # them let the compiler move their loads after the chunks before.
                chunk_key = i + b * stride - tidx
                keeps = (q == 0) & (i + b * stride < stop)
                keys = self.decode_warp_keys(fetched[b])
                slot = self.cache_base(chunk_key) + warp_key + g
                for t in cutlass.range_constexpr(WARP_KEYS // 16):
                    acc = self.tile_scores(atom, keys, t, query)
                    if keeps:
                        for h in cutlass.range_constexpr(2):
                            sScores[slot + 8 * (2 * t + h)] = acc[2 * h, 0, 0] * self.score_factor

    def cache_base(self, chunk_key):
        """sScores' entry of the chunk's first key (key chunk_key + k at cache_base + k): the
        chunk's place among this CTA's (every peers-th chunk of the row)."""
        return chunk_key // (CHUNK_KEYS * self.cluster) * CHUNK_KEYS

    @cute.jit
    def chunk_scores(
        self, atom, args, query, request, chunk_key, end, g, q, tidx, sScores,
        cached: cutlass.Constexpr,
    ):  # fmt: skip
        """This thread's (valid, key, score) triples of the CHUNK_KEYS keys from chunk_key
        (valid: keys < end). A `cached` chunk (below cached_keys x peers) is read from
        sScores, which fill_cache wrote in key order, one key a thread (key chunk_key +
        tidx; a barrier since fill_cache): every thread of the CTA takes a share, where the
        scores as the MMA leaves them sit in a quarter of the lanes. The others are computed
        through the MMA: the warp's 32 keys, held by lanes q == 0."""
        if cutlass.const_expr(cached):
            key = chunk_key + tidx
            return [(key < end, key, sScores[self.cache_base(chunk_key) + tidx])]
        first_key = chunk_key + (tidx // 32) * WARP_KEYS
        scores = cute.make_rmem_tensor((4,), cutlass.Float32)  # key g + 8j: scores[j]
        self.mma_scores(atom, args, query, request, first_key, end, g, q, scores)
        triples = []
        for j in cutlass.range_constexpr(4):
            key = first_key + 8 * j + g
            triples.append(((q == 0) & (key < end), key, scores[j]))
        return triples

    @cute.jit
    def mma_scores(self, atom, args, query, request, first_key, end, g, q, scores):
        """The row's scores against the warp's 32 keys from first_key: key first_key + g +
        8j as scores[j] (every lane; the lanes of one g hold the same)."""
        keys = self.load_keys(args, request, first_key, end, g, q)
        for t in cutlass.range_constexpr(WARP_KEYS // 16):
            acc = self.tile_scores(atom, keys, t, query)
            for h in cutlass.range_constexpr(2):
                scores[2 * t + h] = acc[2 * h, 0, 0] * self.score_factor


def make_kernel(variant):
    dtype = variant.params["dtype"]
    return SdsaRepair(
        element_type(dtype), nvfp4=dtype == "u8", peers=PEERS[variant.arch],
        cached_keys=CACHED_KEYS[variant.arch],
    )  # fmt: skip
