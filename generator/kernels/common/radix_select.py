"""The exact k-th largest of n floats (given by their bits) by a CTA: four passes of an
8-bit histogram in shared memory over their order keys, counting those whose higher bits
match the prefix found so far (the SDSA top-K).

Floats are compared through `order_key`: negative values with every bit inverted, others
with the sign bit set, so the unsigned order is the float order with a positive NaN above
+inf (and a negative NaN below -inf).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import dsl_user_op

from generator.kernels.common.block_scan import exclusive_scan
from generator.kernels.common.ptx import inline_ptx

BINS = 256


@cute.jit
def order_key(bits):
    """A float's bits (Int32) as its unsigned order key (Uint32)."""
    u = cutlass.Uint32(bits)
    flip = cutlass.Uint32(0x80000000)
    if bits < 0:
        flip = cutlass.Uint32(0xFFFFFFFF)
    return u ^ flip


def histogram_words(peers: int) -> int:
    """The Int32 words of shared memory radix_select's sHist needs: one histogram, or with
    peers one per pass and their sum; then the counts above each bin and the scan's warp
    totals (up to 32 warps)."""
    return (BINS if peers == 1 else 5 * BINS) + BINS + 32


@cute.jit
def count_digits(
    values_of, start, end, stride, step: cutlass.Constexpr, prefix, sHist, own: cutlass.Constexpr,
    batch: cutlass.Constexpr = 1,
):  # fmt: skip
    """One radix pass's counting (radix_select): each valid value of values_of(i) for i =
    start, start + stride, ... < end whose higher bits match `prefix` adds one to its
    digit's bin of the histogram at sHist[own]. values_of is called for `batch` indices
    before any of their values is counted (indices at or past end included: their values
    count as invalid), so that their loads are in flight together: the shared atomics
    between them kept one load at a time in flight."""
    shift = 24 - 8 * step
    for i in cutlass.range(start, end, stride * batch, unroll=1):
        pairs = []
        for b in cutlass.range_constexpr(batch):
            for valid, bits in values_of(i + b * stride):
                if cutlass.const_expr(b > 0):
                    valid = valid & (i + b * stride < end)
                pairs.append((valid, bits))
        for v in cutlass.range_constexpr(len(pairs)):
            valid, bits = pairs[v]
            key = order_key(bits)
            digit = cutlass.Int32((key >> cutlass.Uint32(shift)) & cutlass.Uint32(0xFF))
            if cutlass.const_expr(step > 0):
                high = cutlass.Uint32(shift + 8)
                valid = valid & ((key >> high) == (prefix >> high))
            if valid:
                cute.arch.atomic_add(sHist.iterator + own + digit, cutlass.Int32(1))


@cute.jit
def radix_select(
    values_at, count, wanted, sHist, sState, tidx, threads: cutlass.Constexpr,
    peers: cutlass.Constexpr = 1, rank=0, split: cutlass.Constexpr = None,
    batch: cutlass.Constexpr = 1,
):  # fmt: skip
    """(the order key of the wanted-th largest of a set of floats (1 <= wanted <= its
    size), how many of the values equal to it are among the wanted largest). The set:
    values_at(i, step) for i = tidx, tidx + threads, ... < count, each a list of (valid,
    Int32 bits) pairs, the valid ones members. values_at is called once per i and pass (step
    0 to 3, a Constexpr), so it may compute the values rather than load them, and keep what
    it computed in step 0; every thread makes the same calls when count is a multiple of
    threads. sHist: histogram_words(peers) Int32 of shared memory, sState: 2 Int32. Every
    thread of the CTA calls it (it synchronises).

    With peers > 1 the set is split over the CTAs of a cluster of that many (this one is
    `rank`): each counts its share (i = tidx + rank x threads, stepping threads x peers,
    count a multiple of that) into its pass's own histogram; after a cluster barrier each
    sums all of them through distributed shared memory, so all find the same answer. The
    caller keeps every CTA of the cluster alive until a later cluster barrier (its peers
    read its histograms).

    With `split` (a multiple of threads x peers), values_at takes a third argument, a
    Constexpr: True for i < split, False beyond, in two loops. A caller whose values come
    from two places (kept on chip, computed) gets each loop compiled for one of them: with
    both in one loop body ptxas predicated the rarer path and issued it for every i.

    With `batch` > 1 (no split), values_at is called for batch indices i, i + threads x
    peers, ... before any is counted, those at or past count included: it must then return
    something loadable for them (their values are not counted)."""
    prefix = cutlass.Uint32(0)
    scan_at = BINS if peers == 1 else 5 * BINS  # sHist's words after the histograms
    if cutlass.const_expr(peers > 1):
        for b in cutlass.range(tidx, 4 * BINS, threads, unroll=1):
            sHist[b] = 0
    for step in cutlass.range_constexpr(4):
        shift = 24 - 8 * step
        own = step * BINS if cutlass.const_expr(peers > 1) else 0  # this pass's histogram
        if cutlass.const_expr(peers == 1):
            for b in cutlass.range(tidx, BINS, threads, unroll=1):
                sHist[b] = 0
        cute.arch.sync_threads()
        first = tidx + rank * threads
        if cutlass.const_expr(split is None):
            count_digits(
                lambda i, step=step: values_at(i, step), first, count, threads * peers,
                step, prefix, sHist, own, batch,
            )  # fmt: skip
        else:
            count_digits(
                lambda i, step=step: values_at(i, step, True), first,
                cutlass.min(count, split), threads * peers, step, prefix, sHist, own,
            )  # fmt: skip
            count_digits(
                lambda i, step=step: values_at(i, step, False), first + split, count,
                threads * peers, step, prefix, sHist, own,
            )  # fmt: skip
        counts = sHist
        if cutlass.const_expr(peers > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            for b in cutlass.range(tidx, BINS, threads, unroll=1):
                total = cutlass.Int32(0)
                for r in cutlass.range_constexpr(peers):
                    total = total + peer_shared_int32(sHist.iterator + own + b, r)
                sHist[4 * BINS + b] = total
            counts = cute.make_tensor(sHist.iterator + 4 * BINS, cute.make_layout(BINS))
        cute.arch.sync_threads()
        # The bin where the count from the top reaches `wanted`: the counts above each bin
        # by a scan over the bins from the top, then the one bin whose range holds `wanted`
        # says so (one thread walking the 256 bins serialised every pass: a lone repaired
        # SDSA row took 148 us with it, 111 us with the scan).
        sAbove = cute.make_tensor(sHist.iterator + scan_at, cute.make_layout(BINS))
        sWarpSums = cute.make_tensor(sHist.iterator + scan_at + BINS, cute.make_layout(32))
        exclusive_scan(
            lambda i, counts=counts: counts[BINS - 1 - i], sAbove, sWarpSums, BINS, tidx, threads
        )
        for b in cutlass.range(tidx, BINS, threads, unroll=1):
            above = sAbove[BINS - 1 - b]
            if (above < wanted) & (above + counts[b] >= wanted):
                sState[0] = b
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
def float_of_bits(bits):
    """The Float32 whose bits are the Int32 `bits`."""
    word = cute.make_rmem_tensor((1,), cutlass.Int32)
    word[0] = bits
    return cute.recast_tensor(word, cutlass.Float32)[0]


@cute.jit
def float_of_order_key(key):
    """The float whose order key is `key` (order_key's inverse)."""
    flip = cutlass.Uint32(0xFFFFFFFF)
    if key >= cutlass.Uint32(0x80000000):
        flip = cutlass.Uint32(0x80000000)
    word = cute.make_rmem_tensor((1,), cutlass.Uint32)
    word[0] = key ^ flip
    return cute.recast_tensor(word, cutlass.Float32)[0]


@dsl_user_op
def peer_shared_int32(ptr, rank, *, loc=None, ip=None):
    """The Int32 at this CTA's shared-memory pointer `ptr`, read from the same place in
    the shared memory of the cluster's CTA `rank` (mapa, then ld.shared::cluster: the
    DSL's loads do not take distributed shared memory)."""
    operands = [ptr.toint(loc=loc, ip=ip), cutlass.Int32(rank)]
    return inline_ptx(
        cutlass.Int32,
        operands,
        "{\n\t.reg .u32 peer;\n\tmapa.shared::cluster.u32 peer, $1, $2;\n\t"
        "ld.shared::cluster.u32 $0, [peer];\n\t}",
        "=r,r,r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )
