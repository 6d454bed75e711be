"""NVFP4 for the kernels: the rounding of those that quantize to it, the reference's step for step
(sparseforge.reference.nvfp4_quantize), in fp32:
    scale = e4m3(min(amax / 6 / global, 448))     cvt.rn.satfinite: nearest, ties to even
    code  = E2M1 nearest to x / (scale * global)  ties to the even code, 6 beyond 5;
                                                  0 where that step is 0
with a NaN in the group making its scale NaN and its codes 0, as the reference's amax does;
and the decoding of those that read it (e2m1_high_bytes and the pairs built on them,
fp16_scale_pair, decode_chunks) and the cuBLAS 128x4 tiled scale layout (scale_offset_128x4).
"""

import cutlass
import cutlass.cute as cute

from generator.kernels.common.ptx import e4m3_pair_as_f16x2, mul_f16x2

GROUP = 16  # values per scale
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


@cute.jit
def group_scale(x, global_scale):
    """(the e4m3 scale's byte, the step x is divided by: scale x global) of the 16 values in
    the register tensor x."""
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
    return cute.recast_tensor(codes8, cutlass.Uint8)[0], pair[0] * global_scale


@cute.jit
def e2m1_code(value, step):
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


def quantize_group(x, global_scale, write_byte):
    """Quantize the 16 values of the register tensor x: write_byte(i, code byte) for the 8
    code bytes (the even element in the low nibble); returns the scale's byte. (Traced
    inline by the calling kernel: write_byte is a Python function.)"""
    scale_byte, step = group_scale(x, global_scale)
    for b in range(GROUP // 2):
        low = e2m1_code(x[2 * b], step)
        high = e2m1_code(x[2 * b + 1], step)
        write_byte(b, cutlass.Uint8(low | (high << 4)))
    return scale_byte


# An E2M1 code (sign s, exponent e1 e0, mantissa m) placed in the fp16 bits as s.00e1e0.m0..
# reads as its value / 2^14, subnormal (e = 0: m x 2^-15) or normal alike: the high byte of
# the fp16 holds the code's bits (magnitude in bits 1..3, sign in bit 7), the low byte is 0.
E2M1_FP16_FACTOR = 2.0**14
HIGH_BYTES = cutlass.Uint32(0xFF00FF00)  # the high bytes of two fp16 in a word
# decode_chunks' values in fp16 are value x scale / 2^7: in [2^-17, 21] (scales 2^-9 .. 448),
# at most 6 significant bits, so exact in fp16's subnormals and normals alike.
FP16_DIVISOR_LOG2 = 7


@cute.jit
def e2m1_high_bytes(word):
    """The fp16 high bytes (E2M1_FP16_FACTOR's placement) of the eight E2M1 codes of a
    32-bit word (Uint32, code i in bits 4i .. 4i + 3): (codes 0, 2, 4, 6; codes 1, 3, 5, 7)
    as two words, a byte each; 7 operations for the eight."""
    even = ((word << 1) & 0x0E0E0E0E) | ((word << 4) & 0x80808080)
    odd = ((word >> 3) & 0x0E0E0E0E) | (word & 0x80808080)
    return even, odd


@cute.jit
def e2m1_word_pairs(word):
    """The eight E2M1 codes of a 32-bit word (Uint32) as four fp16 pairs, pair k (k < 4) =
    codes k and k + 4 (code k in the low half), each its value / 2^14: one byte permute or
    one mask a pair on e2m1_high_bytes (15 operations for four pairs with their scale
    multiplies, against 19 for two shifts and two and-ors a pair)."""
    even, odd = e2m1_high_bytes(word)
    # Selector 0x2404: bytes 0 and 2 into the high bytes of the halves, zeros below them.
    return (
        cutlass.Uint32(cute.arch.prmt(even, 0, 0x2404)),
        cutlass.Uint32(cute.arch.prmt(odd, 0, 0x2404)),
        even & HIGH_BYTES,
        odd & HIGH_BYTES,
    )


@cute.jit
def e2m1_word_as_fp16(word):
    """The eight E2M1 codes of a 32-bit word (Uint32) in order as four fp16 pairs, pair b =
    codes 2b and 2b + 1 (byte b; code 2b in the low half), each its value / 2^14: a byte
    permute and a mask a pair on e2m1_high_bytes."""
    even, odd = e2m1_high_bytes(word)
    # Even byte b into byte 1, odd byte b into byte 3 (bytes 0 and 2 masked off).
    return tuple(
        cutlass.Uint32(cute.arch.prmt(even, odd, ((4 + b) << 12) | ((4 + b) << 8) | (b << 4) | b))
        & HIGH_BYTES
        for b in range(4)
    )


@cute.jit
def fp16_scale_pair(bytes2):
    """Two e4m3 scales (bytes 0, 1 of a word) as the two fp16 multipliers (a word) of decoded
    E2M1 values (e2m1_word_pairs' value / 2^14) giving value x scale / 2^FP16_DIVISOR_LOG2:
    scale x 2^7 (448 x 2^7 < 65504; exact)."""
    factor = cute.make_rmem_tensor((2,), cutlass.Float16)
    factor.fill(E2M1_FP16_FACTOR / 2.0**FP16_DIVISOR_LOG2)
    halves = e4m3_pair_as_f16x2(bytes2, False)
    return mul_f16x2(halves, cute.recast_tensor(factor, cutlass.Int32)[0])


@cute.jit
def decode_chunks(raw, scales, dst, dtype: cutlass.Constexpr, divisor_log2: cutlass.Constexpr = 0):
    """For every (m, k): the 8 values of dst[None, m, k] (one 16-byte shared-memory chunk of a
    row-copy fragment, in dtype) = the E2M1 codes of the 4 bytes raw[None, m, k] (the even
    element in each low nibble) times the e4m3 scale whose byte is scales[0, m, k], divided
    by 2^divisor_log2. scales is (2, M, K): its row 1 is scratch (e4m3 converts in pairs).
    Exact in bf16 and fp16 (a code has 2 significant bits, a scale 4). In fp16 with
    divisor_log2 = FP16_DIVISOR_LOG2 the products are formed in fp16, one multiply a pair
    of values by scale x 2^7; otherwise in fp32."""
    for i in cutlass.range_constexpr(cute.size(scales, mode=[1])):
        for j in cutlass.range_constexpr(cute.size(scales, mode=[2])):
            scales[1, i, j] = scales[0, i, j]
    steps = cute.make_rmem_tensor(scales.shape, cutlass.Float32)
    steps.store(cute.recast_tensor(scales, cutlass.Float8E4M3FN).load().to(cutlass.Float32))
    in_fp16 = dtype == cutlass.Float16 and divisor_log2 == FP16_DIVISOR_LOG2
    assert in_fp16 or divisor_log2 == 0, "decode_chunks: divisor 2^7 with fp16 only"
    halves = cute.make_rmem_tensor((4,), cutlass.Uint32)
    multiplier = cute.make_rmem_tensor((2,), cutlass.Float32)
    both = cute.make_rmem_tensor((2,), cutlass.Float16)  # the multiplier in both halves
    words = cute.recast_tensor(raw, cutlass.Uint32)  # (1, M, K): the 4 bytes of (m, k)
    for m in cutlass.range_constexpr(cute.size(raw, mode=[1])):
        for k in cutlass.range_constexpr(cute.size(raw, mode=[2])):
            pairs = e2m1_word_as_fp16(words[0, m, k])
            # The fp16 bits of e2m1_word_as_fp16 are the values / 2^14.
            factor = steps[0, m, k] * (E2M1_FP16_FACTOR / 2.0**divisor_log2)
            chunk = cute.make_tensor(dst[None, m, k].iterator, cute.make_layout(8))
            if cutlass.const_expr(in_fp16):
                multiplier.fill(factor)  # scale x 2^7 <= 57344: exact in fp16
                both.store(multiplier.load().to(cutlass.Float16))
                out = cute.recast_tensor(chunk, cutlass.Int32)
                for b in cutlass.range_constexpr(4):
                    out[b] = mul_f16x2(pairs[b], cute.recast_tensor(both, cutlass.Int32)[0])
            else:
                for b in cutlass.range_constexpr(4):
                    halves[b] = pairs[b]
                values = cute.recast_tensor(halves, cutlass.Float16).load().to(cutlass.Float32)
                chunk.store((values * factor).to(dtype))


@cute.jit
def scale_offset_128x4(row, group, groups_per_row: cutlass.Constexpr):
    """Byte offset of the scale of (logical row, 16-value group) in the cuBLAS 128x4 tiled
    layout: 512-byte tiles of 128 rows x 4 groups, (r, g) of a tile at (r % 32) * 16 +
    (r // 32) * 4 + g; a 128-row band's tiles follow each other (groups_per_row / 4 of
    them, rounded up), then the next band's."""
    tiles_per_band = (groups_per_row + 3) // 4
    band, r = row // 128, row % 128
    return (band * tiles_per_band + group // 4) * 512 + (r % 32) * 16 + (r // 32) * 4 + group % 4
