"""nvfp4_kv_write: new tokens' K and V quantized into packed NVFP4 pages at their slots.

One thread per (token, kv head, group of 16 channels), for K and then V. The rounding is the
reference's (sparseforge.reference.nvfp4_quantize), step for step in fp32:
    scale = e4m3(min(amax / 6 / global, 448))     cvt.rn.satfinite: nearest, ties to even
    code  = E2M1 nearest to x / (scale * global)  ties to the even code, 6 beyond 5;
                                                  0 where that step is 0
with a NaN in the group making its scale NaN and its codes 0, as the reference's amax does.
The 16 codes go to 8 bytes (the even element in the low nibble), the scale to its byte
(V scales at their 4x4-swizzled place). A negative slot writes nothing.
"""

import cutlass
import cutlass.cute as cute

from generator.families.nvfp4_kv_write import (
    GROUP,
    HEAD_DIM,
    K_DATA,
    K_SCALES,
    PAGE_TOKENS,
    V_DATA,
    V_SCALES,
)

THREADS = 128
GROUPS = HEAD_DIM // GROUP
E4M3_MAX = 448.0
# E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: the code is the number of these midpoints a
# magnitude passes; at a midpoint it moves up only to an even code (strict > before an odd
# code, >= before an even one).
MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


class Nvfp4KvWrite:
    @cute.jit
    def launch(self, args, stream):
        tokens, heads, _ = args.mK.shape
        self.kernel(args).launch(
            grid=[cute.ceil_div(tokens * heads * GROUPS, THREADS), 1, 1],
            block=[THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, args):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        tokens, heads, _ = args.mK.shape
        index = bidx * THREADS + tidx
        group = index % GROUPS
        head = (index // GROUPS) % heads
        token = index // (GROUPS * heads)
        if token < tokens:
            slot = args.mSlots[token]
            if slot >= 0:
                page, row = slot // PAGE_TOKENS, slot % PAGE_TOKENS
                data = head * PAGE_TOKENS * 64 + row * 64 + group * 8
                k_scale = heads * K_SCALES + head * PAGE_TOKENS * 8 + row * 8 + group
                # V scales: (row, group) stored at row (row // 4) * 4 + group // 2, column
                # (group % 2) * 4 + row % 4.
                v_row = row // 4 * 4 + group // 2
                v_scale = heads * V_SCALES + head * PAGE_TOKENS * 8 + v_row * 8
                v_scale = v_scale + group % 2 * 4 + row % 4
                self.write_group(
                    args.mK, args.mPages, token, head, group, page, args.k_global_scale,
                    heads * K_DATA + data, k_scale,
                )  # fmt: skip
                self.write_group(
                    args.mV, args.mPages, token, head, group, page, args.v_global_scale,
                    heads * V_DATA + data, v_scale,
                )  # fmt: skip

    @cute.jit
    def write_group(
        self, mX, mPages, token, head, group, page, global_scale, data_byte, scale_byte
    ):
        """Quantize mX[token, head, 16 group : 16 group + 16] and write its 8 code bytes at
        data_byte and its scale at scale_byte of the page."""
        x = cute.make_rmem_tensor((GROUP,), cutlass.Float32)
        for i in cutlass.range_constexpr(GROUP):
            x[i] = mX[token, head, group * GROUP + i].to(cutlass.Float32)
        amax = abs(x[0])
        has_nan = x[0] != x[0]
        for i in cutlass.range_constexpr(1, GROUP):
            amax = cute.arch.fmax(amax, abs(x[i]))  # (fmax drops NaN: has_nan keeps it)
            has_nan = has_nan | (x[i] != x[i])
        ideal = amax / 6.0 / global_scale
        if ideal > E4M3_MAX:
            ideal = cutlass.Float32(E4M3_MAX)
        if has_nan:
            ideal = cutlass.Float32(cutlass.Float32.nan)
        # e4m3 conversions go in pairs (cvt.rn.satfinite.e4m3x2.f32).
        pair = cute.make_rmem_tensor((2,), cutlass.Float32)
        pair[0], pair[1] = ideal, cutlass.Float32(0.0)
        codes8 = cute.make_rmem_tensor((2,), cutlass.Float8E4M3FN)
        codes8.store(pair.load().to(cutlass.Float8E4M3FN))
        pair.store(codes8.load().to(cutlass.Float32))
        step = pair[0] * global_scale
        for b in cutlass.range_constexpr(GROUP // 2):
            low = self.e2m1(x[2 * b], step)
            high = self.e2m1(x[2 * b + 1], step)
            mPages[page, data_byte + b] = cutlass.Uint8(low | (high << 4))
        mPages[page, scale_byte] = cute.recast_tensor(codes8, cutlass.Uint8)[0]

    @cute.jit
    def e2m1(self, value, step):
        """The E2M1 code (sign in bit 3) nearest to value / step; 0 when step is not > 0."""
        ratio = cutlass.Float32(0.0)
        if step > 0.0:
            ratio = value / step
        magnitude = abs(ratio)
        code = cutlass.Int32(0)
        for m in cutlass.range_constexpr(len(MIDPOINTS)):
            midpoint, up_to_even = MIDPOINTS[m]
            if cutlass.const_expr(up_to_even):
                code = code + cutlass.Int32(magnitude >= midpoint)
            else:
                code = code + cutlass.Int32(magnitude > midpoint)
        return code + cutlass.Int32(ratio < 0.0) * 8


def make_kernel(variant):
    return Nvfp4KvWrite()
