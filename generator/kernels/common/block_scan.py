"""An exclusive prefix sum over a shared-memory array, by one CTA."""

import cutlass
import cutlass.cute as cute


@cute.jit
def exclusive_scan(value_of, sOut, sWarpSums, count, tidx, num_threads: cutlass.Constexpr):
    """sOut[i] = value_of(0) + .. + value_of(i - 1) for i < count; returns the total (every
    thread). Thread t owns a run of consecutive entries: its sum, a warp scan of the sums, a
    scan of the warps' totals (sWarpSums: one slot per warp), then the run again writing the
    sums before each entry (value_of(i) is read before sOut[i] is written, so sOut may be
    the array value_of reads). Ends with a barrier, so sOut is ready for every thread."""
    per_thread = cute.ceil_div(count, num_threads)
    begin = cutlass.min(tidx * per_thread, count)
    end = cutlass.min(begin + per_thread, count)
    own = cutlass.Int32(0)
    for i in cutlass.range(begin, end, unroll=1):
        own = own + value_of(i)
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    inclusive = own
    for shift in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_up(inclusive, 1 << shift)
        if lane >= (1 << shift):
            inclusive = inclusive + other
    if lane == 31:
        sWarpSums[warp] = inclusive
    cute.arch.sync_threads()
    before = inclusive - own
    total = cutlass.Int32(0)
    for other_warp in cutlass.range_constexpr(num_threads // 32):
        if other_warp < warp:
            before = before + sWarpSums[other_warp]
        total = total + sWarpSums[other_warp]
    for i in cutlass.range(begin, end, unroll=1):
        value = value_of(i)
        sOut[i] = before
        before = before + value
    cute.arch.sync_threads()
    return total
