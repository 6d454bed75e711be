"""Sage FP8 quantizer: q, k, v of an attention call to e4m3 codes with fp32 scales, for the
sage_fp8_fwd kernels. Two launches; the public function and the output contract are in
python/sparseforge/sage.py, the torch reference in python/sparseforge/reference.py, the
family specs in generator/families/sage_quantize.py.

Numerics (every arch): for a set of values x (a q row, a 16-token group of k after
smoothing, a channel of v) with a = max(max |x|, AMAX_MIN) and scale candidate c
(scale_step: grow = (16 + c) / 16, shrink = 16 / (16 + c); c = 0 for v and without search),
    scale = (a / 448) * grow          codes = e4m3_satfinite(x * ((448 / a) * shrink))
The divisions are IEEE (div.rn), each product is one rounding and the conversion rounds to
nearest even, so a torch reference doing the same fp32 operations reproduces every code and
scale bit for bit, given c. AMAX_MIN keeps all-zero sets finite: a positive scale and codes
0. q rows and k groups pick c with search_scale_steps when scale_steps > 1. Non-finite inputs
(NaN, +-inf) count as 0 in every amax, sum and search and get the code NaN: they reach only
the rows that attend to them, never another row's scale.

The k mean and the v amax run over all Sk tokens, so the tokens of each kv head are cut into
P chunks of `chunk_tokens` tokens (a multiple of CHUNK_MULTIPLE, so whole launch-2 tiles;
chosen by the host, python/sparseforge/sage.py chunk_tokens). Each CTA has one role on one
tensor: a CTA that quantized both the k and the v of its chunk needed 255 registers per thread.

  launch 1  SageQuantizeStats   grid: 2 Hkv P stats CTAs (k, v alternating), then q CTAs
    k stats CTA (kv head, chunk): column sums of k over the chunk  -> mPartial[h, p, 0, :]
    v stats CTA (kv head, chunk): column maxima of |v|             -> mPartial[h, p, 1, :]
        Fixed summation order: the result does not depend on scheduling.
    q CTA (head, 64 rows at D = 128, 128 at D = 64): each row's amax -> q_scale, its codes.
  launch 2  SageQuantizeKV      grid: (1 + K_PARTS) Hkv P CTAs: per chunk one v CTA, then
    K_PARTS k CTAs that take a quarter of its tiles each (the scale search makes k the long
    role; with one k CTA per chunk the F1 shapes had 512 long CTAs for 396 resident slots).
    Each CTA first combines its head's P partials of its statistic in chunk order (every CTA
    of a head gets the same bits): the k mean or the v inverse scale per channel, in shared
    memory; the chunk's first CTA of each role writes k_mean or v_scale. Then per tile of
    16384 / D tokens:
    v CTA: thread = (8 channels, 16 tokens): 16 loads of 16 bytes, then per channel one
        16-byte store of its 16 codes into the transposed buffer (Hkv, D, Sk_pad); codes of
        tokens past Sk are masked to 0, which writes the zero padding up to Sk_pad.
    k CTA: warp = 16-token groups; the warp's max |k - mean| per group -> k_scale; 8-byte
        code stores.

Threads move 8 elements (16 bytes) of one token row at a time, D / 8 threads per row, so a
warp's load covers whole rows; each thread keeps 8 (q, k codes) or 16 (stats, v codes) loads
in flight. Loads are unconditional: rows past the end read the last row (which leaves a max
unchanged) and are left out of sums and stores. Zero-filled predicated loads instead made
the compiler hold every row in fp32 (165 registers in launch 1, now 98; launch 2 has 162,
3 CTAs per SM). Traffic: launch 1 reads q, v (and k when smooth_k) and writes q8; launch 2
reads k and v again and writes k8 and the transposed v. Scales and partials are a few KB;
each launch-2 CTA re-reads its head's partials from L2 (4 P D bytes, against 3 chunk_tokens
D bytes of its own traffic: under 1/12 unless the host shrinks chunks for a small problem).

H200, commit b3e2e17 (bench/results/2026-11-29_b3e2e17_h200_bench_sage.md, both launches):
0.450 ms = 3.9 TB/s at (Hq, Hkv, S, D) = (32, 32, 32768, 128), 0.219 ms = 3.4 TB/s at
(32, 8, 32768, 128). (A persistent launch 2 was tried while this was written and measured no
faster; that run was not kept.)
"""

import cutlass
import cutlass.cute as cute

from generator.families.sage_quantize import AMAX_MIN, CHUNK_MULTIPLE, KEYS_PER_SCALE
from generator.kernels.common.entry import element_type

NUM_THREADS = 128
VEC = 8  # elements per 16-byte load of bf16 / fp16
GROUP = KEYS_PER_SCALE  # tokens per k scale, and tokens per thread in a v tile
FP8_MAX = 448.0  # largest finite e4m3 value
NAN = float("nan")
STATS_ROWS = 16  # token rows per thread in flight in a stats CTA
Q_ROWS_PER_CTA = 64  # token rows per q CTA
Q_VECS = 4  # 16-byte vectors of a q row per lane (quantize_q)
K_LOADS = 8  # k loads per thread in flight in a launch-2 k CTA
K_PARTS = 4  # launch-2 k CTAs per chunk (each a quarter of its tiles): short CTAs, short tail
SEARCH_CHAINS = 4  # independent partial sums per lane in squared_misses
STAT_K_SUM, STAT_V_MAX = 0, 1  # index of the statistic in mPartial[h, p, :, :]


@cute.jit
def fp8_scales(amax: cutlass.Float32):
    """(scale, inverse scale) of a set with this amax; both divisions IEEE."""
    a = cute.arch.fmax(amax, cutlass.Float32(AMAX_MIN))
    return a / FP8_MAX, cutlass.Float32(FP8_MAX) / a


@cute.jit
def finite_or(v, fill):
    """v (a TensorSSA) with its non-finite elements (NaN, +-inf) replaced by `fill`."""
    return cute.where(abs(v) < cutlass.Float32.inf, v, fill)


@cute.jit
def abs_max(x: cute.Tensor):
    """max |x| over the finite elements of a register fragment (0 for all zeros)."""
    return abs(finite_or(x.load(), 0.0)).reduce(cute.ReductionOp.MAX, cutlass.Float32(0.0), 0)


@cute.jit
def lanes_reduce(val: cutlass.Float32, lanes: cutlass.Constexpr, op: cutlass.Constexpr):
    """Max (op "max") or sum (op "sum") over aligned groups of `lanes` consecutive lanes
    (butterfly: all of them get it, bit for bit: each step adds the same two values)."""
    offset = lanes // 2
    while cutlass.const_expr(offset >= 1):
        other = cute.arch.shuffle_sync_bfly(val, offset=offset, mask=-1, mask_and_clamp=31)
        if cutlass.const_expr(op == "max"):
            val = cute.arch.fmax(val, other)
        else:
            val = val + other
        offset //= 2
    return val


@cute.jit
def scale_step(c):
    """(grow, shrink) of scale candidate c: (16 + c) / 16 (exact) and 16 / (16 + c) (IEEE
    division): scale (amax / 448) * grow, inverse scale (448 / amax) * shrink; candidate 0
    is the amax scale (grow = shrink = 1). reference.scale_step_factors in torch."""
    steps = cutlass.Float32(c + 16)
    return steps * cutlass.Float32(1.0 / 16.0), cutlass.Float32(16.0) / steps


@cute.jit
def search_scale_steps(y0: cute.Tensor, best_step: cute.Tensor, lanes: cutlass.Constexpr, steps):
    """best_step[s] = the scale candidate c < steps whose codes round set s least: the
    smallest sum over the set of (y - e4m3(y))^2 * grow^2, y = y0 * shrink (the squared
    error in units of (amax / 448)^2), the first of equals. y0 (2, n / 2, sets) f16: this lane's
    part of each set at the amax scale (x * 448 / amax), layout pairs_layout(n, sets); a
    set spans `lanes` lanes.

    Why: e4m3 rounds each element by up to 1/16 of it, and where a set's values fall on the
    e4m3 grid changes with the scale: the best of 16 scales rounds a 128-element q row with
    ~20% less squared error (CONTRIBUTING.md, Sage FP8). The criterion is computed in f16
    (f16x2 instructions, 2-3 per element and candidate) only to rank the candidates; the
    codes are then made from x in fp32 at the chosen scale.
    """
    best = cute.make_rmem_tensor(best_step.layout, cutlass.Float32)
    best.fill(float("inf"))
    best_step.fill(0)
    if steps > 1:  # 1: no search, every set keeps candidate 0
        for c in cutlass.range(steps, unroll=1):
            grow, shrink = scale_step(c)
            shrink16 = cutlass.Float16(shrink)
            for s in cutlass.range_constexpr(cute.size(best_step)):
                sq = squared_misses(y0[None, None, s], shrink16)
                err = lanes_reduce(cutlass.Float32(sq[0]) + cutlass.Float32(sq[1]), lanes, "sum")
                err = err * (grow * grow)
                if err < best[s]:
                    best[s] = err
                    best_step[s] = c


@cute.jit
def squared_misses(y0: cute.Tensor, shrink16: cutlass.Float16):
    """(2,) f16: sums of (y - e4m3(y))^2 over this lane's pairs y = y0 * shrink16 (f16x2
    instructions; y0 (2, n / 2))."""
    # SEARCH_CHAINS independent sums: one chain of dependent HFMA2s stalled the warps (ncu).
    acc = cute.make_rmem_tensor((2, SEARCH_CHAINS), cutlass.Float16)
    acc.fill(0.0)
    for k in cutlass.range_constexpr(cute.size(y0, mode=[1])):
        y = y0[None, k].load() * shrink16
        miss = y - y.to(cutlass.Float8E4M3FN).to(cutlass.Float16)
        chain = k % SEARCH_CHAINS
        acc[None, chain].store(acc[None, chain].load() + miss * miss)
    width = SEARCH_CHAINS // 2
    while cutlass.const_expr(width >= 1):
        for w in cutlass.range_constexpr(width):
            acc[None, w].store(acc[None, w].load() + acc[None, w + width].load())
        width //= 2
    return acc[None, 0]


@cute.jit
def to_pairs(x: cute.Tensor, inv: cutlass.Float32, pairs: cute.Tensor):
    """pairs (2, n / 2) f16 = x (n) fp32 * inv, converted two at a time; non-finite elements
    of x count as 0 (the search ranks the scales of the finite ones)."""
    xp = cute.make_tensor(x.iterator, cute.make_layout((2, cute.size(x) // 2), stride=(1, 2)))
    for k in cutlass.range_constexpr(cute.size(x) // 2):
        pairs[None, k].store((finite_or(xp[None, k].load(), 0.0) * inv).to(cutlass.Float16))


def pairs_layout(n: int, sets: int):
    """(2, n / 2, sets): the f16 elements of search_scale_steps, pairs adjacent."""
    return cute.make_layout((2, n // 2, sets), stride=(1, 2, n))


@cute.jit
def to_codes(x: cute.Tensor, inv: cutlass.Float32, codes: cute.Tensor):
    """codes = e4m3(x * inv), saturating (cvt.rn.satfinite), and NaN where x is not finite:
    an inf or NaN input stays visible to exactly the rows that read its code."""
    v = x.load()
    codes.store(cute.where(abs(v) < cutlass.Float32.inf, v * inv, NAN).to(cutlass.Float8E4M3FN))


def row_vector(m: cute.Tensor, head, token, group):
    """Elements 8 group .. 8 group + 7 of m[head, token, :] (16-byte aligned)."""
    return cute.local_tile(m[head, token, None], (VEC,), (group,))


class _Geometry:
    """The thread layout both launches share: D / 8 threads per token row."""

    def __init__(self, dtype, head_dim: int):
        self.dtype = dtype
        self.head_dim = head_dim
        self.threads_per_row = head_dim // VEC  # 16 or 8
        self.rows_per_step = NUM_THREADS // self.threads_per_row  # 8 or 16
        self.q_rows = Q_ROWS_PER_CTA
        self.q_lanes = self.threads_per_row // Q_VECS  # lanes per q row: 4 or 2
        self.kv_tile = GROUP * self.rows_per_step  # tokens per launch-2 tile: 128 or 256
        self.rows_per_warp = 32 // self.threads_per_row  # 2 or 4
        self.groups_per_warp = self.kv_tile // GROUP // (NUM_THREADS // 32)  # 2 or 4

    @staticmethod
    def can_implement(head_dim: int) -> bool:
        return head_dim in (64, 128)


class SageQuantizeStats(_Geometry):
    """Launch 1: chunk column statistics of k and v, and q quantized (module docstring)."""

    @cute.jit
    def launch(self, args, stream):
        # Stats CTAs first: they are the long ones, so they start in the first wave.
        num_stats = 2 * args.mK.shape[0] * args.mPartial.shape[1]
        num_q = args.mQ.shape[0] * cute.ceil_div(args.mQ.shape[1], self.q_rows)
        self.kernel(args).launch(
            grid=[num_stats + num_q, 1, 1], block=[NUM_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, args):
        mQ, mK, mV, mQ8, mQScale, mPartial = (
            args.mQ,
            args.mK,
            args.mV,
            args.mQ8,
            args.mQScale,
            args.mPartial,
        )
        chunk_tokens, smooth_k, scale_steps = args.chunk_tokens, args.smooth_k, args.scale_steps
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_chunks = mPartial.shape[1]
        num_stats = 2 * mK.shape[0] * num_chunks
        # (row slot, channel): each thread's result, combined over the slots at the end.
        smem = cutlass.memory.SmemAllocator()
        sSlots = smem.allocate_tensor(
            cutlass.Float32,
            cute.make_layout((self.rows_per_step, self.head_dim), stride=(self.head_dim, 1)),
            16,
        )
        if bidx < num_stats:
            unit = bidx // 2
            head = unit // num_chunks
            chunk = unit - head * num_chunks
            first = chunk * chunk_tokens
            end = cutlass.min(first + chunk_tokens, mK.shape[1])
            if bidx % 2 == 1:
                self.column_stats(mV, mPartial, sSlots, head, chunk, first, end, tidx, STAT_V_MAX)
            elif smooth_k != 0:
                self.column_stats(mK, mPartial, sSlots, head, chunk, first, end, tidx, STAT_K_SUM)
        else:
            q_tiles = cute.ceil_div(mQ.shape[1], self.q_rows)
            unit = bidx - num_stats
            head = unit // q_tiles
            first_row = (unit - head * q_tiles) * self.q_rows
            self.quantize_q(mQ, mQ8, mQScale, head, first_row, tidx, scale_steps)

    @cute.jit
    def column_stats(
        self, mX, mPartial, sSlots, head, chunk, first, end, tidx, stat: cutlass.Constexpr
    ):
        """mPartial[head, chunk, stat, :] = per channel, the sum of x (STAT_K_SUM) or max |x|
        (STAT_V_MAX) over tokens first .. end - 1.

        Thread (slot r, channel group cg) walks rows first + r, + rows_per_step, ...,
        STATS_ROWS at a time; the slots are then combined through shared memory, in order.
        """
        cg = tidx % self.threads_per_row
        slot = tidx // self.threads_per_row
        acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        acc.fill(0.0)
        rows_per_iter = STATS_ROWS * self.rows_per_step
        full_iters = (end - first) // rows_per_iter
        for it in cutlass.range(full_iters, unroll=1):
            row = first + it * rows_per_iter + slot
            self.stats_rows(mX, acc, head, row, end, cg, stat, False)
        if first + full_iters * rows_per_iter < end:
            row = first + full_iters * rows_per_iter + slot
            self.stats_rows(mX, acc, head, row, end, cg, stat, True)
        cute.autovec_copy(acc, cute.local_tile(sSlots[slot, None], (VEC,), (cg,)))
        cute.arch.sync_threads()
        if tidx < self.head_dim:
            total = sSlots[0, tidx]
            for s in cutlass.range_constexpr(1, self.rows_per_step):
                if cutlass.const_expr(stat == STAT_V_MAX):
                    total = cute.arch.fmax(total, sSlots[s, tidx])
                else:
                    total = total + sSlots[s, tidx]
            mPartial[head, chunk, stat, tidx] = total

    @cute.jit
    def stats_rows(
        self,
        mX,
        acc,
        head,
        first_token,
        end,
        cg,
        stat: cutlass.Constexpr,
        masked: cutlass.Constexpr,
    ):
        """acc (8 channels) += / max= rows first_token + i * rows_per_step, i < STATS_ROWS.

        Loads are unconditional (no zero-filled registers, which made the compiler hold every
        row in fp32): a masked pass reads rows past `end` from row end - 1 and leaves them
        out of the sums (a repeated row does not change a max).
        """
        rX = cute.make_rmem_tensor(cute.make_layout((STATS_ROWS, VEC), stride=(VEC, 1)), self.dtype)
        for u in cutlass.range_constexpr(STATS_ROWS):
            token = first_token + u * self.rows_per_step
            if cutlass.const_expr(masked):
                token = cutlass.min(token, end - 1)
            cute.autovec_copy(row_vector(mX, head, token, cg), rX[u, None])
        x = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        for u in cutlass.range_constexpr(STATS_ROWS):
            # Non-finite elements count as 0: one inf or NaN must not reach other rows'
            # scales through the k mean or the v channel max.
            x.store(finite_or(rX[u, None].load().to(cutlass.Float32), 0.0))
            if cutlass.const_expr(stat == STAT_V_MAX):
                for j in cutlass.range_constexpr(VEC):
                    acc[j] = cute.arch.fmax(acc[j], abs(x[j]))
            elif cutlass.const_expr(masked):
                if first_token + u * self.rows_per_step < end:
                    acc.store(acc.load() + x.load())
            else:
                acc.store(acc.load() + x.load())

    @cute.jit
    def quantize_q(self, mQ, mQ8, mQScale, head, first_row, tidx, scale_steps):
        """Rows first_row .. first_row + q_rows - 1 of q[head]: each row's amax over its
        lanes, its scale candidate, then its codes and its scale.

        A row spans q_lanes lanes of Q_VECS 16-byte vectors each (vector cg + q_lanes i,
        so a warp load covers 64 contiguous bytes per row): the scale search sums 32
        elements per lane before its shuffles (8 per lane cost 1.6x the instructions).
        """
        cg = tidx % self.q_lanes
        slot = tidx // self.q_lanes
        rows_step = NUM_THREADS // self.q_lanes
        rows = self.q_rows // rows_step  # per thread
        # Rows past Sq load row Sq - 1 (unconditional loads) and are not stored.
        rQ = cute.make_rmem_tensor(
            cute.make_layout((Q_VECS, VEC, rows), stride=(VEC, 1, Q_VECS * VEC)), self.dtype
        )
        for s in cutlass.range_constexpr(rows):
            row = cutlass.min(first_row + s * rows_step + slot, mQ.shape[1] - 1)
            for i in cutlass.range_constexpr(Q_VECS):
                vector = row_vector(mQ, head, row, cg + self.q_lanes * i)
                cute.autovec_copy(vector, rQ[i, None, s])
        row_layout = cute.make_layout((Q_VECS, VEC), stride=(VEC, 1))
        x = cute.make_rmem_tensor(row_layout, cutlass.Float32)
        codes = cute.make_rmem_tensor(x.layout, cutlass.Float8E4M3FN)
        amax = cute.make_rmem_tensor((rows,), cutlass.Float32)
        y0 = cute.make_rmem_tensor(pairs_layout(Q_VECS * VEC, rows), cutlass.Float16)
        for s in cutlass.range_constexpr(rows):
            x.store(rQ[None, None, s].load().to(cutlass.Float32))
            amax[s] = lanes_reduce(abs_max(x), self.q_lanes, "max")
            to_pairs(x, fp8_scales(amax[s])[1], y0[None, None, s])
        step = cute.make_rmem_tensor((rows,), cutlass.Int32)
        search_scale_steps(y0, step, self.q_lanes, scale_steps)
        for s in cutlass.range_constexpr(rows):
            row = first_row + s * rows_step + slot
            scale0, inv0 = fp8_scales(amax[s])
            grow, shrink = scale_step(step[s])
            x.store(rQ[None, None, s].load().to(cutlass.Float32))
            to_codes(x, inv0 * shrink, codes)
            if row < mQ.shape[1]:
                for i in cutlass.range_constexpr(Q_VECS):
                    cute.autovec_copy(
                        codes[i, None], row_vector(mQ8, head, row, cg + self.q_lanes * i)
                    )
                if cg == 0:
                    mQScale[head, row] = scale0 * grow


class SageQuantizeKV(_Geometry):
    """Launch 2: the k or the v codes and scales of one chunk of one kv head per CTA."""

    @cute.jit
    def launch(self, args, stream):
        self.kernel(args).launch(
            grid=[(1 + K_PARTS) * args.mK.shape[0] * args.mPartial.shape[1], 1, 1],
            block=[NUM_THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, args):
        mK, mV, mPartial, mK8, mKScale = args.mK, args.mV, args.mPartial, args.mK8, args.mKScale
        mVt, mVScale, mKMean = args.mVt, args.mVScale, args.mKMean
        chunk_tokens, smooth_k, scale_steps = args.chunk_tokens, args.smooth_k, args.scale_steps
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_chunks = mPartial.shape[1]
        unit = bidx // (1 + K_PARTS)
        role = bidx - unit * (1 + K_PARTS)  # 0: v, 1 + p: part p of k
        head = unit // num_chunks
        chunk = unit - head * num_chunks
        seq_k = mK.shape[1]
        first = chunk * chunk_tokens
        num_tiles = cute.ceil_div(cutlass.min(first + chunk_tokens, seq_k) - first, self.kv_tile)
        smem = cutlass.memory.SmemAllocator()
        sChannel = smem.allocate_tensor(cutlass.Float32, cute.make_layout(self.head_dim), 16)
        if role == 0:
            # v: sChannel = 448 / amax per channel.
            if tidx < self.head_dim:
                peak = cutlass.Float32(0.0)
                for p in cutlass.range(num_chunks, unroll=8):
                    peak = cute.arch.fmax(peak, mPartial[head, p, STAT_V_MAX, tidx])
                scale, inv = fp8_scales(peak)
                sChannel[tidx] = inv
                if chunk == 0:
                    mVScale[head, tidx] = scale
            cute.arch.sync_threads()
            # Thread: channels 8 cg .. 8 cg + 7 of the 16-token block `block` of each tile.
            cg = tidx % self.threads_per_row
            block = tidx // self.threads_per_row
            v_inv = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            cute.autovec_copy(cute.local_tile(sChannel, (VEC,), (cg,)), v_inv)
            for tile in cutlass.range(num_tiles, unroll=1):
                t0 = first + tile * self.kv_tile
                self.quantize_v(mV, mVt, v_inv, head, t0 + block * GROUP, cg)
        else:
            # k: sChannel = the mean per channel (0 without smoothing: k is quantized as is).
            if tidx < self.head_dim:
                mean = cutlass.Float32(0.0)
                if smooth_k != 0:
                    total = cutlass.Float32(0.0)
                    for p in cutlass.range(num_chunks, unroll=8):
                        total = total + mPartial[head, p, STAT_K_SUM, tidx]
                    mean = total / cutlass.Float32(seq_k)
                sChannel[tidx] = mean
                if chunk == 0 and role == 1:
                    mKMean[head, tidx] = mean
            cute.arch.sync_threads()
            # Lane = (row of a warp step, channel group); a warp owns groups_per_warp groups.
            lane = tidx % 32
            cg = lane % self.threads_per_row
            k_row = lane // self.threads_per_row
            k_mean = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            cute.autovec_copy(cute.local_tile(sChannel, (VEC,), (cg,)), k_mean)
            warp_first = (tidx // 32) * self.groups_per_warp * GROUP
            part_tiles = cute.ceil_div(num_tiles, K_PARTS)
            first_tile = (role - 1) * part_tiles
            for tile in cutlass.range(
                first_tile, cutlass.min(first_tile + part_tiles, num_tiles), unroll=1
            ):
                t0 = first + tile * self.kv_tile
                self.quantize_k(
                    mK, mK8, mKScale, k_mean, head, t0 + warp_first, k_row, cg, lane, scale_steps
                )

    @cute.jit
    def quantize_v(self, mV, mVt, v_inv, head, first_token, cg):
        """Tokens first_token .. +15, channels 8 cg .. 8 cg + 7: one 16-byte store per channel
        into Vt[head, channel, first_token:first_token + 16].

        Tokens past Sk load token Sk - 1 (unconditional loads) and their codes are masked
        to 0: the block that holds Sk writes the zero padding up to Sk_pad.
        """
        seq_k = mV.shape[1]
        if first_token < seq_k:
            rV = cute.make_rmem_tensor(cute.make_layout((GROUP, VEC), stride=(VEC, 1)), self.dtype)
            for i in cutlass.range_constexpr(GROUP):
                token = cutlass.min(first_token + i, seq_k - 1)
                cute.autovec_copy(row_vector(mV, head, token, cg), rV[i, None])
            # Byte masks of the valid tokens, 4 per 32-bit word of codes.
            keep = cute.make_rmem_tensor((GROUP // 4,), cutlass.Int32)
            for w in cutlass.range_constexpr(GROUP // 4):
                valid_bits = 8 * cutlass.max(cutlass.min(seq_k - first_token - 4 * w, 4), 0)
                keep[w] = cutlass.Int32((cutlass.Int64(1) << valid_bits) - 1)
            x = cute.make_rmem_tensor((GROUP,), cutlass.Float32)
            codes = cute.make_rmem_tensor((GROUP,), cutlass.Float8E4M3FN)
            words = cute.recast_tensor(codes, cutlass.Int32)
            block = first_token // GROUP
            for j in cutlass.range_constexpr(VEC):
                x.store(rV[None, j].load().to(cutlass.Float32))
                to_codes(x, v_inv[j], codes)
                for w in cutlass.range_constexpr(GROUP // 4):
                    words[w] = words[w] & keep[w]
                channel = mVt[head, cg * VEC + j, None]
                cute.autovec_copy(codes, cute.local_tile(channel, (GROUP,), (block,)))

    @cute.jit
    def quantize_k(self, mK, mK8, mKScale, k_mean, head, first_token, k_row, cg, lane, scale_steps):
        """The warp's groups_per_warp groups of 16 tokens from first_token on: codes of
        k - mean with one scale per group.

        Rows past Sk load row Sk - 1 (unconditional loads): in the group that holds Sk that
        repeats one of its rows, which leaves its max unchanged; nothing past Sk is stored.
        K_LOADS loads per thread at a time (one group at D = 128, two at D = 64): holding all
        the warp's groups as fp32 would double the registers.
        """
        seq_k = mK.shape[1]
        steps = GROUP // self.rows_per_warp  # loads per thread per group
        batch = K_LOADS // steps  # groups per batch
        rK = cute.make_rmem_tensor(
            cute.make_layout((batch, steps, VEC), stride=(steps * VEC, VEC, 1)), self.dtype
        )
        d = cute.make_rmem_tensor(cute.make_layout((steps, VEC), stride=(VEC, 1)), cutlass.Float32)
        codes = cute.make_rmem_tensor((VEC,), cutlass.Float8E4M3FN)
        y0 = cute.make_rmem_tensor(pairs_layout(steps * VEC, 1), cutlass.Float16)  # the group
        y0_rows = cute.make_tensor(y0.iterator, pairs_layout(VEC, steps))  # its token rows
        step = cute.make_rmem_tensor((1,), cutlass.Int32)
        for b in cutlass.range_constexpr(self.groups_per_warp // batch):
            for g in cutlass.range_constexpr(batch):
                for i in cutlass.range_constexpr(steps):
                    token = first_token + (b * batch + g) * GROUP + i * self.rows_per_warp + k_row
                    cute.autovec_copy(
                        row_vector(mK, head, cutlass.min(token, seq_k - 1), cg), rK[g, i, None]
                    )
            for g in cutlass.range_constexpr(batch):
                group_first = first_token + (b * batch + g) * GROUP
                amax = cutlass.Float32(0.0)
                for i in cutlass.range_constexpr(steps):
                    d[i, None].store(rK[g, i, None].load().to(cutlass.Float32) - k_mean.load())
                    amax = cute.arch.fmax(amax, abs_max(d[i, None]))
                scale0, inv0 = fp8_scales(lanes_reduce(amax, 32, "max"))
                for i in cutlass.range_constexpr(steps):
                    # A row past Sk repeats a row: zero, it adds nothing to the search's sums.
                    past_end = group_first + i * self.rows_per_warp + k_row >= seq_k
                    to_pairs(d[i, None], inv0, y0_rows[None, None, i])
                    if past_end:
                        y0_rows[None, None, i].fill(0.0)
                search_scale_steps(y0, step, 32, scale_steps)
                grow, shrink = scale_step(step[0])
                for i in cutlass.range_constexpr(steps):
                    token = group_first + i * self.rows_per_warp + k_row
                    to_codes(d[i, None], inv0 * shrink, codes)
                    if token < seq_k:
                        cute.autovec_copy(codes, row_vector(mK8, head, token, cg))
                if lane == 0 and group_first < seq_k:
                    mKScale[head, group_first // GROUP] = scale0 * grow


def make_kernel(variant):
    p = variant.params
    template = {"sage_quantize_stats": SageQuantizeStats, "sage_quantize_kv": SageQuantizeKV}
    kernel = template[variant.family.name](element_type(p["dtype"]), p["head_dim"])
    if not kernel.can_implement(p["head_dim"]) or CHUNK_MULTIPLE % kernel.kv_tile:
        raise ValueError(f"{variant.name}: head_dim {p['head_dim']} not supported")
    return kernel
