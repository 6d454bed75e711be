"""Kernels that give each row of a problem to one warp, WARPS_PER_CTA warps a CTA
(tile_compact, selection_mask, msa_attention_combine)."""

import cutlass.cute as cute

WARPS_PER_CTA = 4


@cute.jit
def launch_warp_rows(kernel, rows, stream):
    """Launch `kernel` (a kernel bound to its arguments) with a warp for each of `rows`."""
    kernel.launch(
        grid=[cute.ceil_div(rows, WARPS_PER_CTA), 1, 1],
        block=[32 * WARPS_PER_CTA, 1, 1],
        stream=stream,
    )


@cute.jit
def warp_row():
    """(row, lane, warp of the CTA) of the calling thread: rows past the problem's are the
    last CTA's idle warps."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    warp = tidx // 32
    return bidx * WARPS_PER_CTA + warp, cute.arch.lane_idx(), warp
