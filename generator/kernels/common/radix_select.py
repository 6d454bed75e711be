"""The exact k-th largest of n floats (given by their bits) by a CTA: four passes of an
8-bit histogram in shared memory over their order keys, counting those whose higher bits
match the prefix found so far (the SDSA top-K).

Floats are compared through `order_key`: negative values with every bit inverted, others
with the sign bit set, so the unsigned order is the float order with a positive NaN above
+inf (and a negative NaN below -inf).
"""

import cutlass
import cutlass.cute as cute

BINS = 256


@cute.jit
def order_key(bits):
    """A float's bits (Int32) as its unsigned order key (Uint32)."""
    u = cutlass.Uint32(bits)
    flip = cutlass.Uint32(0x80000000)
    if bits < 0:
        flip = cutlass.Uint32(0xFFFFFFFF)
    return u ^ flip


@cute.jit
def radix_select(values_at, count, wanted, sHist, sState, tidx, threads: cutlass.Constexpr):
    """(the order key of the wanted-th largest of a set of floats (1 <= wanted <= its
    size), how many of the values equal to it are among the wanted largest). The set:
    values_at(i, step) for i = tidx, tidx + threads, ... < count, each a list of (valid,
    Int32 bits) pairs, the valid ones members. values_at is called once per i and pass (step
    0 to 3, a Constexpr), so it may compute the values rather than load them, and keep what
    it computed in step 0; every thread makes the same calls when count is a multiple of
    threads. sHist: BINS Int32 of shared memory, sState: 2 Int32. Every
    thread of the CTA calls it (it synchronises)."""
    prefix = cutlass.Uint32(0)
    for step in cutlass.range_constexpr(4):
        shift = 24 - 8 * step
        for b in cutlass.range(tidx, BINS, threads, unroll=1):
            sHist[b] = 0
        cute.arch.sync_threads()
        for i in cutlass.range(tidx, count, threads, unroll=1):
            pairs = values_at(i, step)
            for v in cutlass.range_constexpr(len(pairs)):
                valid, bits = pairs[v]
                key = order_key(bits)
                digit = cutlass.Int32((key >> cutlass.Uint32(shift)) & cutlass.Uint32(0xFF))
                if cutlass.const_expr(step > 0):
                    high = cutlass.Uint32(shift + 8)
                    valid = valid & ((key >> high) == (prefix >> high))
                if valid:
                    cute.arch.atomic_add(sHist.iterator + digit, cutlass.Int32(1))
        cute.arch.sync_threads()
        if tidx == 0:
            # From the top bin down, the bin where the count reaches `wanted`.
            above = cutlass.Int32(0)
            chosen = cutlass.Int32(0)
            found = cutlass.Int32(0)
            for j in cutlass.range(BINS, unroll=1):
                b = BINS - 1 - j
                if found == 0:
                    if above + sHist[b] >= wanted:
                        chosen = b
                        found = cutlass.Int32(1)
                    else:
                        above = above + sHist[b]
            sState[0] = chosen
            sState[1] = wanted - above
        cute.arch.sync_threads()
        prefix = prefix | (cutlass.Uint32(sState[0]) << cutlass.Uint32(shift))
        wanted = sState[1]
        cute.arch.sync_threads()
    return prefix, wanted


@cute.jit
def float_bits(value):
    """A Float32's bits as an Int32."""
    word = cute.make_rmem_tensor((1,), cutlass.Float32)
    word[0] = value
    return cute.recast_tensor(word, cutlass.Int32)[0]


@cute.jit
def float_of_order_key(key):
    """The float whose order key is `key` (order_key's inverse)."""
    flip = cutlass.Uint32(0xFFFFFFFF)
    if key >= cutlass.Uint32(0x80000000):
        flip = cutlass.Uint32(0x80000000)
    word = cute.make_rmem_tensor((1,), cutlass.Uint32)
    word[0] = key ^ flip
    return cute.recast_tensor(word, cutlass.Float32)[0]
