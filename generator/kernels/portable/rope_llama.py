"""rope_llama: one thread per (token, head, 8 channels of the first half) and their 8
partners in the second half. Angles in fp32 (as the reference computes them), reduced to
[-pi, pi] by two FMAs with a two-part 2 pi, then the hardware's sin / cos (absolute error
~2^-21 there, far below bf16's rounding of the result). Positions reach 2^17 and beyond,
where the hardware's sine of the unreduced angle would be wrong."""

import math

import cutlass
import cutlass.cute as cute

from generator.families.rope_llama import CHANNELS_PER_THREAD
from generator.kernels.common.entry import element_type
from generator.kernels.common.thread_items import launch_thread_items, split_item, thread_item


class RopeLlama:
    def __init__(self, dtype, head_dim: int):
        self.dtype = dtype
        self.head_dim = head_dim

    @cute.jit
    def launch(self, args, stream):
        tokens, heads, _ = args.mX.shape
        per_row = self.head_dim // 2 // CHANNELS_PER_THREAD
        launch_thread_items(self.kernel(args), tokens * heads * per_row, stream)

    @cute.kernel
    def kernel(self, args):
        tokens, heads, _ = args.mX.shape
        half = self.head_dim // 2
        per_row = half // CHANNELS_PER_THREAD
        group, head, token = split_item(thread_item(), per_row, heads)
        if token < tokens:
            position = cutlass.Float32(token + args.position_offset) * args.inv_rope_scale
            # 16-byte vectors: channels 8g .. 8g + 7 of each half.
            tiles = (CHANNELS_PER_THREAD,)
            x_row, y_row = args.mX[token, head, None], args.mY[token, head, None]
            gx = [cute.local_tile(x_row, tiles, (group + h * per_row,)) for h in range(2)]
            gy = [cute.local_tile(y_row, tiles, (group + h * per_row,)) for h in range(2)]
            first = cute.make_rmem_tensor(tiles, self.dtype)
            second = cute.make_rmem_tensor(tiles, self.dtype)
            cute.autovec_copy(gx[0], first)
            cute.autovec_copy(gx[1], second)
            out_first = cute.make_rmem_tensor(tiles, self.dtype)
            out_second = cute.make_rmem_tensor(tiles, self.dtype)
            for c in cutlass.range_constexpr(CHANNELS_PER_THREAD):
                i = group * CHANNELS_PER_THREAD + c
                exponent = cutlass.Float32(-2.0 / self.head_dim) * cutlass.Float32(i)
                frequency = cute.math.exp2(exponent * args.log2_theta)
                angle = reduced(position * frequency)
                cos = cute.math.cos(angle, fastmath=True)
                sin = cute.math.sin(angle, fastmath=True)
                a, b = first[c].to(cutlass.Float32), second[c].to(cutlass.Float32)
                out_first[c] = (a * cos - b * sin).to(self.dtype)
                out_second[c] = (b * cos + a * sin).to(self.dtype)
            cute.autovec_copy(out_first, gy[0])
            cute.autovec_copy(out_second, gy[1])


# 2 pi as a sum of two floats: TWO_PI_HI has trailing zero bits, so k * TWO_PI_HI is exact
# for the k a float angle reaches (|k| < 2^12 for angles to 2^15; beyond, the error grows
# as fp32's own rounding of the angle does).
TWO_PI_HI = 6.28125
TWO_PI_LO = 2 * math.pi - TWO_PI_HI


@cute.jit
def reduced(angle):
    """angle - 2 pi k in [-pi, pi] (k = the nearest integer of angle / 2 pi)."""
    turns = cute.math.floor(angle * cutlass.Float32(1 / (2 * math.pi)) + 0.5)
    return (angle - turns * cutlass.Float32(TWO_PI_HI)) - turns * cutlass.Float32(TWO_PI_LO)


def make_kernel(variant):
    p = variant.params
    return RopeLlama(element_type(p["dtype"]), p["head_dim"])
