"""rope_llama: one thread per (token, head, 8 channels of the first half) and their 8
partners in the second half; fp32 angles and precise sin / cos (positions reach 2^17 and
beyond, where an approximate sine of the raw angle would be off by far more than bf16's
rounding)."""

import cutlass
import cutlass.cute as cute

from generator.families.rope_llama import CHANNELS_PER_THREAD
from generator.kernels.common.entry import element_type

THREADS = 128


class RopeLlama:
    def __init__(self, dtype, head_dim: int):
        self.dtype = dtype
        self.head_dim = head_dim

    @cute.jit
    def launch(self, args, stream):
        tokens, heads, _ = args.mX.shape
        per_row = self.head_dim // 2 // CHANNELS_PER_THREAD
        self.kernel(args).launch(
            grid=[cute.ceil_div(tokens * heads * per_row, THREADS), 1, 1],
            block=[THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, args):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        tokens, heads, _ = args.mX.shape
        half = self.head_dim // 2
        per_row = half // CHANNELS_PER_THREAD
        index = bidx * THREADS + tidx
        group = index % per_row
        head = (index // per_row) % heads
        token = index // (per_row * heads)
        if token < tokens:
            position = cutlass.Float32(token + args.position_offset) * args.inv_rope_scale
            first = cute.make_rmem_tensor((CHANNELS_PER_THREAD,), cutlass.Float32)
            second = cute.make_rmem_tensor((CHANNELS_PER_THREAD,), cutlass.Float32)
            for c in cutlass.range_constexpr(CHANNELS_PER_THREAD):
                i = group * CHANNELS_PER_THREAD + c
                first[c] = args.mX[token, head, i].to(cutlass.Float32)
                second[c] = args.mX[token, head, i + half].to(cutlass.Float32)
            for c in cutlass.range_constexpr(CHANNELS_PER_THREAD):
                i = group * CHANNELS_PER_THREAD + c
                exponent = cutlass.Float32(-2.0 / self.head_dim) * cutlass.Float32(i)
                frequency = cute.math.exp2(exponent * args.log2_theta)
                angle = position * frequency
                cos, sin = cute.math.cos(angle), cute.math.sin(angle)
                args.mY[token, head, i] = (first[c] * cos - second[c] * sin).to(self.dtype)
                args.mY[token, head, i + half] = (second[c] * cos + first[c] * sin).to(self.dtype)


def make_kernel(variant):
    p = variant.params
    return RopeLlama(element_type(p["dtype"]), p["head_dim"])
