"""sdsa_scores: the SDSA indexer's FP32 scores q . k (indexer_scores), CUDA cores.

A CTA owns 128 keys of one group (R = rows / groups consecutive query rows, R <= 8, sharing
the table row mRequests[g]); it first writes the group's R queries into shared memory as
fp32 (NVFP4: E2M1 code x e4m3 scale, exact), then each thread loads its key (BF16: 16 loads
of 16 bytes; NVFP4: 4 loads and its 8 scales), dequantizes it into 128 fp32 registers, and
writes its score with each of the R rows, summed in fp32 in channel order. Keys at or past
the group's context are not written.
"""

import cutlass
import cutlass.cute as cute

from generator.families.sdsa import KEY_DIM, NVFP4_GROUP, PAGE_KEYS
from generator.kernels.common.entry import element_type
from generator.kernels.common.nvfp4 import E2M1_FP16_FACTOR, e2m1_pair_as_fp16

KEYS_PER_CTA = 128
MAX_ROWS = 8


class SdsaScores:
    def __init__(self, dtype, nvfp4: bool):
        self.dtype = dtype
        self.nvfp4 = nvfp4

    @cute.jit
    def launch(self, args, stream):
        self.kernel(args).launch(grid=self.grid(args), block=[KEYS_PER_CTA, 1, 1], stream=stream)

    def grid(self, args):
        """A CTA per 128 keys of each group (the select and the repair grid otherwise)."""
        return [cute.ceil_div(args.mScores.shape[1], KEYS_PER_CTA), args.mRequests.shape[0], 1]

    @cute.kernel
    def kernel(self, args):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, group, _ = cute.arch.block_idx()
        context = args.mContext[group]
        first_key = bidx * KEYS_PER_CTA
        if first_key < context:
            rows = args.mScores.shape[0] // args.mRequests.shape[0]
            first_row = group * rows
            sQ = self.stage_queries(args, MAX_ROWS, first_row, rows, tidx)

            key = first_key + tidx
            if key < context:
                page = args.mBlockTable[args.mRequests[group], key // PAGE_KEYS]
                values = self.key_values(args, page, key % PAGE_KEYS)
                for r in cutlass.range(rows, unroll=1):
                    args.mScores[first_row + r, key] = self.dot(values, sQ, r)

    @cute.jit
    def dot(self, values, sQ, r):
        """values . sQ[r], summed in fp32 in channel order (every SDSA kernel scores so: the
        threshold select and its repair see the same bits)."""
        total = cutlass.Float32(0.0)
        for c in cutlass.range_constexpr(KEY_DIM):
            total = total + values[c] * sQ[r, c]
        return total

    @cute.jit
    def stage_queries(self, args, capacity: cutlass.Constexpr, first_row, rows, tidx, needed=None):
        """Query rows first_row .. first_row + rows - 1 as fp32 in shared memory ((capacity,
        128)), for every thread once it returns; with `needed`, only the rows r (0-based)
        where needed(r) holds (the others are left unset)."""
        smem = cutlass.memory.SmemAllocator()
        sQ = smem.allocate_tensor(
            cutlass.Float32, cute.make_layout((capacity, KEY_DIM), stride=(KEY_DIM, 1)), 16
        )
        for i in cutlass.range(tidx, rows * KEY_DIM, KEYS_PER_CTA, unroll=1):
            if cutlass.const_expr(needed is None):
                sQ[i // KEY_DIM, i % KEY_DIM] = self.query_value(
                    args, first_row + i // KEY_DIM, i % KEY_DIM
                )
            elif needed(i // KEY_DIM):
                sQ[i // KEY_DIM, i % KEY_DIM] = self.query_value(
                    args, first_row + i // KEY_DIM, i % KEY_DIM
                )
        cute.arch.sync_threads()
        return sQ

    @cute.jit
    def query_value(self, args, row, c):
        """Query row `row`'s value at channel c as fp32."""
        if cutlass.const_expr(self.nvfp4):
            # Channel c's code moved to the low nibble: its value is the word's low half.
            code = (cutlass.Int32(args.mQuery[row, c // 2]) >> ((c % 2) * 4)) & 0xF
            word = cute.make_rmem_tensor((1,), cutlass.Int32)
            word[0] = e2m1_pair_as_fp16(code)
            value = cute.recast_tensor(word, cutlass.Float16).load().to(cutlass.Float32)[0]
            scale = self.e4m3_value(args.mQueryScales[row, c // NVFP4_GROUP])
            return value * (scale * E2M1_FP16_FACTOR)
        return args.mQuery[row, c].to(cutlass.Float32)

    @cute.jit
    def key_values(self, args, page, slot):
        """The key at (page, slot) as 128 fp32 registers."""
        values = cute.make_rmem_tensor((KEY_DIM,), cutlass.Float32)
        row = args.mKeyCache[page, slot, None]
        if cutlass.const_expr(self.nvfp4):
            for chunk in cutlass.range_constexpr(4):  # 16 bytes: 32 values, 2 scale groups
                raw = cute.local_tile(row, (16,), (chunk,)).load()
                bytes16 = cute.make_rmem_tensor((16,), cutlass.Uint8)
                bytes16.store(raw)
                words = cute.make_rmem_tensor((16,), cutlass.Int32)
                for b in cutlass.range_constexpr(16):
                    words[b] = e2m1_pair_as_fp16(cutlass.Int32(bytes16[b]))
                halves = cute.recast_tensor(words, cutlass.Float16).load().to(cutlass.Float32)
                for g in cutlass.range_constexpr(2):
                    group = chunk * 2 + g
                    step = self.e4m3_value(args.mKeyScales[page, slot, group]) * E2M1_FP16_FACTOR
                    for i in cutlass.range_constexpr(NVFP4_GROUP):
                        values[group * NVFP4_GROUP + i] = halves[g * NVFP4_GROUP + i] * step
        else:
            for chunk in cutlass.range_constexpr(KEY_DIM // 8):
                piece = cute.local_tile(row, (8,), (chunk,)).load().to(cutlass.Float32)
                for i in cutlass.range_constexpr(8):
                    values[chunk * 8 + i] = piece[i]
        return values

    @cute.jit
    def e4m3_value(self, byte):
        """An e4m3 scale byte as fp32 (conversions go in pairs)."""
        pair = cute.make_rmem_tensor((2,), cutlass.Uint8)
        pair[0], pair[1] = byte, cutlass.Uint8(0)
        return cute.recast_tensor(pair, cutlass.Float8E4M3FN).load().to(cutlass.Float32)[0]


def make_kernel(variant):
    dtype = variant.params["dtype"]
    return SdsaScores(element_type(dtype), nvfp4=dtype == "u8")
