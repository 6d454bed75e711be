"""Unions kept as bitmaps in shared memory: bit p of word p / 32 says that member p is in.

After `popcount_scan`, member p's place in the union's ascending order is
`rank(sBits, sBase, p)`: the set bits of the words before its own (sBase) plus the set bits
below it in its word. group_union_masks (keys of a token group) and msa_sparse_attention
(128-key blocks of a tile's tokens) build their unions this way.
"""

import cutlass
import cutlass.cute as cute


@cute.jit
def add_member(sBits, p):
    cute.arch.atomic_or(sBits.iterator + p // 32, cutlass.Int32(1) << (p % 32))


@cute.jit
def rank(sBits, sBase, p):
    """The number of union members below p (p itself a member)."""
    below = (cutlass.Uint32(1) << cutlass.Uint32(p % 32)) - cutlass.Uint32(1)
    bits = cutlass.Uint32(sBits[p // 32])
    return sBase[p // 32] + cutlass.Int32(cute.arch.popc(bits & below))


@cute.jit
def popcount_scan(sBits, sBase, sWarpSums, words, tidx, num_threads: cutlass.Constexpr):
    """sBase[w] = the set bits of words 0 .. w-1; returns the total (every thread).
    Thread t owns a run of consecutive words: its sum, a warp scan of the sums, a scan of
    the warps' totals (sWarpSums: one slot per warp), then the run again writing the bases.
    Ends with a barrier, so sBase is ready for every thread."""
    per_thread = cute.ceil_div(words, num_threads)
    begin = cutlass.min(tidx * per_thread, words)
    end = cutlass.min(begin + per_thread, words)
    own = cutlass.Int32(0)
    for w in cutlass.range(begin, end, unroll=1):
        own = own + cute.arch.popc(sBits[w])
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
    for w in cutlass.range(begin, end, unroll=1):
        sBase[w] = before
        before = before + cute.arch.popc(sBits[w])
    cute.arch.sync_threads()
    return total
