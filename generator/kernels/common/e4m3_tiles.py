"""e4m3 tiles in shared memory converted to the 16-bit tiles a 16-bit MMA reads (every e4m3
value is exactly an fp16 and a bf16 one): the sm_90a kernels that multiply FP8 data in
exact fp32 sums (msa_proxy_score's converter warpgroup, the MSA wgmma union tile)."""

import cutlass
import cutlass.cute as cute

THREADS = 128  # a warpgroup converts a tile


@cute.jit
def convert_tile(src: cute.Tensor, dst: cute.Tensor, tidx, valid_rows=None):
    """src (e4m3) into dst (fp16 or bf16), both (rows, 128) tiles (any swizzle; dst may be a
    transposed view of an MN-major operand whose rows are its contiguous mode), by THREADS
    threads: eight consecutive values of a row a step (8-byte reads, 16-byte writes). With
    valid_rows, rows from valid_rows on are written as zeros (what they hold is not data)."""
    threads = cute.make_layout((THREADS // 16, 16), stride=(16, 1))
    values = cute.make_layout((1, 8))
    universal = cute.nvgpu.CopyUniversalOp()
    read = cute.make_tiled_copy_tv(
        cute.make_copy_atom(universal, src.element_type, num_bits_per_copy=64), threads, values
    )
    write = cute.make_tiled_copy_tv(
        cute.make_copy_atom(universal, dst.element_type, num_bits_per_copy=128), threads, values
    )
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
        rows_cols = (cute.size(dst, mode=[0]), cute.size(dst, mode=[1]))
        tDc = write.get_slice(tidx).partition_D(cute.make_identity_tensor(rows_cols))
        for m in cutlass.range_constexpr(cute.size(tDc, mode=[1])):
            if tDc[0, m, 0][0] >= valid_rows:
                converted[None, m, None].fill(0)
    cute.copy(write, converted, tDd)
