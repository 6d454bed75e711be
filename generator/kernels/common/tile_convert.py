"""FP8 (e4m3) and NVFP4 tiles in shared memory converted to the 16-bit tiles a 16-bit MMA
reads, exactly (an e4m3 value, and an E2M1 code times its e4m3 scale, is a bf16 and an fp16
value): the sm_90a kernels that multiply quantized data in exact fp32 sums
(msa_proxy_score's converter warpgroup, the MSA wgmma union tile); and bf16 values brought
into fp16's range by a power of two, for the kernels that multiply bf16 q by such tiles in
fp16 (into_fp16_range).

A warpgroup converts a (rows, 128) tile: thread t takes 8 consecutive values of a row (a
16-byte store) in rows t // 16 + 8i, columns 8 (t % 16) on. The destination may carry any
swizzle, and may be a transposed view of an MN-major operand (its rows the contiguous mode).
"""

import cutlass
import cutlass.cute as cute

from generator.kernels.common.nvfp4 import GROUP, decode_chunks

THREADS = 128  # a warpgroup converts a tile


def row_chunks(dtype, values: int = 8):
    """The warpgroup's copy of a (rows, 16 x values) tile of dtype: `values` consecutive
    values of a row a thread, 16 threads a row."""
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=values * dtype.width
        ),
        cute.make_layout((THREADS // 16, 16), stride=(16, 1)),
        cute.make_layout((1, values)),
    )


@cute.jit
def convert_e4m3_tile(src: cute.Tensor, dst: cute.Tensor, tidx, valid_rows=None):
    """src (e4m3) into dst (fp16 or bf16), both (rows, 128) tiles: 8-byte reads, 16-byte
    writes. With valid_rows, rows from valid_rows on are written as zeros (what they hold
    is not data)."""
    read = row_chunks(src.element_type)
    write = row_chunks(dst.element_type)
    tSs = read.get_slice(tidx).partition_S(src)
    tDd = write.get_slice(tidx).partition_D(dst)
    raw = cute.make_fragment_like(tSs)
    cute.copy(read, tSs, raw)
    converted = cute.make_fragment_like(tDd)
    if cutlass.const_expr(dst.element_type == cutlass.Float16):
        converted.store(raw.load().to(cutlass.Float16))
    else:
        converted.store(raw.load().to(cutlass.Float32).to(dst.element_type))
    if cutlass.const_expr(valid_rows is not None):
        tDc = write.get_slice(tidx).partition_D(cute.make_identity_tensor(rows_and_columns(dst)))
        for m in cutlass.range_constexpr(cute.size(tDc, mode=[1])):
            if tDc[0, m, 0][0] >= valid_rows:
                converted[None, m, None].fill(0)
    cute.copy(write, converted, tDd)


@cute.jit
def convert_nvfp4_tile(
    codes: cute.Tensor, scales: cute.Tensor, dst: cute.Tensor, tidx, valid_rows,
    swizzled_scales: cutlass.Constexpr, divisor_log2: cutlass.Constexpr = 0,
):  # fmt: skip
    """codes (rows, 64 bytes: two E2M1 codes a byte, the even element in the low nibble) with
    their e4m3 scales (one byte per 16 values, rows x 8 bytes in a flat tensor: linear, or
    with swizzled_scales in the 4x4 swizzle of V scales, (row, group) at
    ((row // 4) * 4 + group // 2, (group % 2) * 4 + row % 4)) into dst (fp16 or bf16,
    (rows, 128)), divided by 2^divisor_log2 (decode_chunks): 4-byte code reads, 16-byte
    writes. Rows from valid_rows on are zeros (their scales read as 0)."""
    read = row_chunks(codes.element_type, 4)  # 4 bytes: 8 codes
    write = row_chunks(dst.element_type)
    tSs = read.get_slice(tidx).partition_S(codes)
    tDd = write.get_slice(tidx).partition_D(dst)
    tDc = write.get_slice(tidx).partition_D(cute.make_identity_tensor(rows_and_columns(dst)))
    raw = cute.make_fragment_like(tSs)
    cute.copy(read, tSs, raw)
    raw_bytes = cute.make_tensor(raw.iterator, cute.make_layout((4,) + raw.shape[1:]))
    scale_bytes = cute.make_rmem_tensor((2,) + raw.shape[1:], cutlass.Uint8)
    for m in cutlass.range_constexpr(cute.size(tDc, mode=[1])):
        for k in cutlass.range_constexpr(cute.size(tDc, mode=[2])):
            row, col = tDc[0, m, k][0], tDc[0, m, k][1]
            group = col // GROUP
            place = row * 8 + group
            if cutlass.const_expr(swizzled_scales):
                place = (row - row % 4 + group // 2) * 8 + group % 2 * 4 + row % 4
            scale_bytes[0, m, k] = cutlass.Uint8(0)
            if row < valid_rows:
                scale_bytes[0, m, k] = scales[place]
    converted = cute.make_fragment_like(tDd)
    decode_chunks(raw_bytes, scale_bytes, converted, dst.element_type, divisor_log2)
    cute.copy(write, converted, tDd)


@cute.jit
def warp_finite_max(values, lanes: cutlass.Constexpr = 32):
    """The largest finite magnitude of a TensorSSA (fp32) over the thread's values and those
    of the `lanes` adjacent threads of its group (its whole warp by default), 0 when none
    is."""
    magnitudes = abs(values)
    finite = cute.where(
        magnitudes < cutlass.Float32.inf, magnitudes, cute.full_like(magnitudes, 0.0)
    )
    top = finite.reduce(cute.ReductionOp.MAX, cutlass.Float32(0.0), 0)
    for offset in (16, 8, 4, 2, 1):
        if cutlass.const_expr(offset < lanes):
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=offset))
    return top


@cute.jit
def into_fp16_range(values, top):
    """(values, a 16-bit TensorSSA whose largest finite magnitude is `top` (fp32, >= 0),
    divided by the power of two that brings top into [2^14, 2^15), in fp16; that power of
    two, the factor products of them are to be multiplied by). Exact unless a value falls
    2^24 below top; the factor is 1 when top is 0, and at least 2^-100."""
    shift = _shift_into(top, 14)
    return (values * _power_of_two(-shift)).to(cutlass.Float16), _power_of_two(shift)


@cute.jit
def split_into_e4m3(values, top):
    """(hi, lo, factor): values (fp32 TensorSSA, largest finite magnitude `top` >= 0)
    divided by the power of two `factor` that brings top into [2^7, 2^8), as the sum of two
    e4m3 parts: hi = e4m3(x), lo = e4m3(x - hi). hi + lo carries ~8 significant bits (e4m3
    alone 4), as bf16 does, down to values ~2^-12 of top (below, lo's subnormals). Inf and
    NaN become NaN (e4m3 has no inf) in both parts."""
    shift = _shift_into(top, 7)
    magnitudes = abs(values)
    scaled = cute.where(
        magnitudes < cutlass.Float32.inf,
        values * _power_of_two(-shift),
        cute.full_like(values, float("nan")),
    )
    hi = scaled.to(cutlass.Float8E4M3FN)
    lo = (scaled - hi.to(cutlass.Float32)).to(cutlass.Float8E4M3FN)
    return hi, lo, _power_of_two(shift)


@cute.jit
def _shift_into(top, exponent):
    """The power of two (its exponent, at least -100) that divides top (fp32, >= 0) into
    [2^exponent, 2^(exponent + 1)); 0 when top is 0."""
    shift = cutlass.Int32(0)
    if top > 0.0:
        bits = cute.make_rmem_tensor((1,), cutlass.Float32)
        bits[0] = top
        top_exponent = ((cute.recast_tensor(bits, cutlass.Int32)[0] >> 23) & 0xFF) - 127
        shift = cutlass.max(top_exponent - exponent, -100)
    return shift


@cute.jit
def _power_of_two(exponent):
    """2^exponent in fp32 for an integer exponent in [-126, 127], from its bits."""
    bits = cute.make_rmem_tensor((1,), cutlass.Int32)
    bits[0] = (exponent + 127) << 23
    return cute.recast_tensor(bits, cutlass.Float32)[0]


def rows_and_columns(tile: cute.Tensor):
    """A tile's (rows, columns) as flat sizes (its modes may be hierarchical)."""
    return (cute.size(tile, mode=[0]), cute.size(tile, mode=[1]))
