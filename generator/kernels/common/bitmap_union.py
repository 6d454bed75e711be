"""Unions kept as bitmaps in shared memory: bit p of word p / 32 says that member p is in.

After `popcount_scan`, member p's place in the union's ascending order is
`rank(sBits, sBase, p)`: the set bits of the words before its own (sBase) plus the set bits
below it in its word. group_union_masks (keys of a token group) and msa_sparse_attention
(128-key blocks of a tile's tokens) build their unions this way.
"""

import cutlass
import cutlass.cute as cute

from generator.kernels.common.block_scan import exclusive_scan


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
    """sBase[w] = the set bits of words 0 .. w-1; returns the total (every thread). Ends with
    a barrier, so sBase is ready for every thread."""
    return exclusive_scan(
        lambda w: cutlass.Int32(cute.arch.popc(sBits[w])), sBase, sWarpSums, words, tidx,
        num_threads,
    )  # fmt: skip
