"""sdsa_scores: the SDSA indexer's FP32 scores q . k (indexer_scores) with
warp-level MMA (mma.sync m16n8k16, fp32 accumulators), every arch.

A CTA (4 warps) owns 128 keys of one group (R = rows / groups <= 8 consecutive query rows
sharing the table row mRequests[g]); each warp 32 of them, as four 8-key MMA tiles. The
MMA's 16 rows are the group's rows (the rest zero); its k dimension, the 128 channels, is
permuted the same way for both operands (a dot product does not care): in k-step s,
thread lane (g = lane / 4, q = lane % 4) holds the k slots 2q, 2q+1, 2q+8, 2q+9, and they
are channels 32q + 4s + 0..3. So each thread's operands are channels 32q .. 32q + 31 of
one key (B: key g of the tile) and of one query row (A: row g), loaded straight from
global memory into registers (BF16: 64 contiguous bytes; NVFP4: 16 bytes and two scales),
no shared memory. Thread lane gets the scores of row g for keys 2q and 2q + 1 of each tile.

NVFP4 keys and queries are decoded into fp16 as value x scale / 2^6 (E2M1 codes a
32-bit word at a time into e4m3 bytes via e2m1_word_as_e4m3, converted to fp16 in pairs,
times their e4m3 scale; within each 16-channel scale group the channels land in that
helper's order, the same for both operands): exact, since every such product has at most
6 significant bits and lies between 2^-16 and 42 in magnitude; the MMA's products are then
exact and the sums fp32, and the scores are scaled back by 2^12. BF16 keys and queries go
to a bf16 MMA as they are.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from generator.families.sdsa import KEY_DIM, PAGE_KEYS
from generator.kernels.common.entry import element_type
from generator.kernels.common.nvfp4 import E2M1_E4M3_FACTOR, e2m1_word_as_e4m3
from generator.kernels.common.ptx import load_u16

WARPS = 4
TILE_KEYS = 8  # the MMA's n
TILES = 4  # per warp
KEYS_PER_WARP = TILES * TILE_KEYS
KEYS_PER_CTA = WARPS * KEYS_PER_WARP
assert PAGE_KEYS % KEYS_PER_WARP == 0  # a warp's keys share a page (fetch_keys)
K_STEPS = KEY_DIM // 16
CHANNELS = KEY_DIM // 4  # per thread: 32q .. 32q + 31


class SdsaScores:
    warps = WARPS  # per CTA
    cluster = 1  # CTAs per cluster

    def __init__(self, dtype, nvfp4: bool):
        self.nvfp4 = nvfp4
        self.mma_dtype = cutlass.Float16 if nvfp4 else dtype
        # The MMA of NVFP4 operands (each scaled by 2^-6) gives q . k / 2^12.
        self.score_factor = E2M1_E4M3_FACTOR * E2M1_E4M3_FACTOR if nvfp4 else 1.0

    @cute.jit
    def launch(self, args, stream):
        atom = cute.make_mma_atom(warp.MmaF16BF16Op(self.mma_dtype, cutlass.Float32, (16, 8, 16)))
        config = dict(grid=self.grid(args), block=[self.warps * 32, 1, 1], stream=stream)
        if cutlass.const_expr(self.cluster > 1):
            config["cluster"] = [self.cluster, 1, 1]
        self.kernel(args, atom).launch(**config)

    def grid(self, args):
        """A CTA per 128 keys of each group (the select and the repair grid otherwise)."""
        return [cute.ceil_div(args.mScores.shape[1], KEYS_PER_CTA), args.mRequests.shape[0], 1]

    @cute.kernel
    def kernel(self, args, atom):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, group, _ = cute.arch.block_idx()
        lane = tidx % 32
        g = lane // 4
        q = lane % 4
        context = args.mContext[group]
        first_key = bidx * KEYS_PER_CTA + (tidx // 32) * (TILES * TILE_KEYS)
        if first_key < context:  # the same for the whole warp: its MMAs run converged
            rows = args.mScores.shape[0] // args.mRequests.shape[0]
            first_row = group * rows
            request = args.mRequests[group]
            # The keys' loads first, so the query's load and decode overlap them.
            raw, scale_pairs = self.fetch_keys(args, request, first_key, context, g, q)
            a_frags = cute.make_rmem_tensor((8 * K_STEPS,), self.mma_dtype)
            a_frags.fill(0.0)  # rows g + 8: never a query
            if g < rows:
                self.place_query(args, first_row + g, q, a_frags, 0)
            keys = self.decode_keys(raw, scale_pairs)
            for t in cutlass.range_constexpr(TILES):
                acc = self.tile_scores(atom, a_frags, keys[t, None])
                if g < rows:
                    for j in cutlass.range_constexpr(2):
                        key = first_key + t * TILE_KEYS + 2 * q + j
                        if key < context:
                            args.mScores[first_row + g, key] = acc[j, 0, 0] * self.score_factor

    @cute.jit
    def place_query(self, args, row, q, a_frags, half: cutlass.Constexpr):
        """Query row `row`'s channels 32q .. 32q + 31 into the A fragments of the 8 k-steps
        (8 values each): as a0 a1 a4 a5 (MMA row g, half 0) or a2 a3 a6 a7 (row g + 8,
        half 1), channels 4s .. 4s + 3 in k-step s."""
        query = cute.make_rmem_tensor((CHANNELS,), self.mma_dtype)
        self.channels(args.mQuery, args.mQueryScales, row, q, query)
        for s in cutlass.range_constexpr(K_STEPS):
            for i in cutlass.range_constexpr(4):
                a_frags[8 * s + i + 2 * (i // 2) + 2 * half] = query[4 * s + i]

    @cute.jit
    def load_keys(self, args, request, first_key, end, g, q):
        """Keys first_key + 8t + g (t < TILES) of table row `request`, those below `end`,
        channels 32q .. 32q + 31 each ((TILES, CHANNELS), zero past `end`)."""
        return self.decode_keys(*self.fetch_keys(args, request, first_key, end, g, q))

    @cute.jit
    def fetch_keys(self, args, request, first_key, end, g, q):
        """load_keys' loads, all issued before any decode or MMA (NVFP4: decoding each key
        as it lands would wait out one memory round trip per tile): (values or codes, scale
        pairs), row-major per tile."""
        raw = cute.make_rmem_tensor(
            cute.make_layout((TILES, CHANNELS), stride=(CHANNELS, 1)), self.mma_dtype
        )
        scale_pairs = raw  # unused for BF16
        if cutlass.const_expr(self.nvfp4):
            raw = cute.make_rmem_tensor(
                cute.make_layout((TILES, CHANNELS // 2), stride=(CHANNELS // 2, 1)),
                cutlass.Uint8,
            )
            scale_pairs = cute.make_rmem_tensor(
                cute.make_layout((TILES, 2), stride=(2, 1)), cutlass.Uint8
            )
            scale_pairs.fill(0)
        raw.fill(0)
        # The warp's keys share a page (every caller's first_key is a multiple of
        # KEYS_PER_WARP, and first_key < end): one table lookup, not one a key.
        page = args.mBlockTable[request, first_key // PAGE_KEYS]
        for t in cutlass.range_constexpr(TILES):
            key = first_key + t * TILE_KEYS + g
            if key < end:
                self.load_channels(
                    args.mKeyCache[page, None, None], args.mKeyScales[page, None, None],
                    key % PAGE_KEYS, q, raw[t, None], scale_pairs[t, None],
                )  # fmt: skip
        return raw, scale_pairs

    @cute.jit
    def decode_keys(self, raw, scale_pairs):
        """fetch_keys' registers as MMA operands ((TILES, CHANNELS) row-major: tile t's
        channels contiguous, as tile_scores reads them)."""
        keys = raw
        if cutlass.const_expr(self.nvfp4):
            keys = cute.make_rmem_tensor(
                cute.make_layout((TILES, CHANNELS), stride=(CHANNELS, 1)), self.mma_dtype
            )
            for t in cutlass.range_constexpr(TILES):
                self.decode(raw[t, None], scale_pairs[t, None], keys[t, None])
        return keys

    @cute.jit
    def tile_scores(self, atom, a_frags, keys):
        """The m16n8 accumulator of one tile over the 8 k-steps: A from a_frags, B the
        tile's key channels 4s .. 4s + 3 in k-step s (module docstring), both as views."""
        acc = cute.make_rmem_tensor((4, 1, 1), cutlass.Float32)
        acc.fill(0.0)
        for s in cutlass.range_constexpr(K_STEPS):
            a = cute.make_tensor(a_frags.iterator + 8 * s, cute.make_layout((8, 1)))
            b = cute.make_tensor(keys.iterator + 4 * s, cute.make_layout((4, 1)))
            cute.gemm(atom, acc, a, b, acc)
        return acc

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
        value x scale / 2^6, in the order e2m1_word_as_e4m3 gives (of the channels 8w ..
        8w + 7, the even ones then the odd ones: queries and keys are decoded alike, so the
        dot product is unchanged; each 16-channel scale group stays in its 16 slots)."""
        code_words = cute.recast_tensor(codes, cutlass.Int32)
        words = cute.make_rmem_tensor((CHANNELS // 4,), cutlass.Int32)
        for w in cutlass.range_constexpr(CHANNELS // 8):
            words[2 * w], words[2 * w + 1] = e2m1_word_as_e4m3(code_words[w])
        values = cute.recast_tensor(words, cutlass.Float8E4M3FN).load().to(cutlass.Float16)
        step = cute.recast_tensor(scale_pair, cutlass.Float8E4M3FN).load().to(cutlass.Float16)
        for i in cutlass.range_constexpr(CHANNELS):
            dst[i] = values[i] * step[i // 16]


def make_kernel(variant):
    dtype = variant.params["dtype"]
    return SdsaScores(element_type(dtype), nvfp4=dtype == "u8")
