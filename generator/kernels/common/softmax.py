"""The online softmax and the accumulator views every attention template uses.

Both mma.sync (m16n8k16) and wgmma (m64nNk16) accumulators spread each row over the four
threads of a quad (lanes 4i..4i+3), so one softmax serves both; only the mode order of the
per-thread values differs, and `acc_mn_view` hides it.
"""

import math

import cutlass
import cutlass.cute as cute

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View an MMA accumulator fragment as (rows of this thread, columns of this thread).

    Value mode of one atom: (2 adjacent columns, 2 rows 8 apart[, N/8 column groups]).
    Fragment: (values, MMA_M, MMA_N).
    """
    shape = acc.layout.shape
    col_major = cute.make_layout(shape)
    s, d = col_major.shape, col_major.stride
    rows = ((s[0][1], s[1]), (d[0][1], d[1]))
    if cutlass.const_expr(cute.rank(s[0]) == 3):
        cols = ((s[0][0], s[0][2], s[2]), (d[0][0], d[0][2], d[2]))
    else:
        cols = ((s[0][0], s[2]), (d[0][0], d[2]))
    mn = cute.make_layout((rows[0], cols[0]), stride=(rows[1], cols[1]))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def row_allreduce(val, op, lanes: int = 4):
    """Reduce over the `lanes` adjacent threads that share a row (butterfly, result in all):
    four for mma.sync and wgmma fragments, one (nothing to do) where a thread holds whole rows
    (tcgen05's accumulators loaded from tensor memory a row a thread)."""
    offset = lanes // 2
    while offset >= 1:
        val = op(val, cute.arch.shuffle_sync_bfly(val, offset=offset, mask=-1, mask_and_clamp=31))
        offset //= 2
    return val


def quad_max(val):
    return row_allreduce(val, cute.arch.fmax)


def quad_sum(val):
    return row_allreduce(val, lambda a, b: a + b)


def new_softmax_state(num_rows: int):
    """(row max, row sum) registers of the online softmax, in raw score units."""
    row_max = cute.make_rmem_tensor(num_rows, cutlass.Float32)
    row_sum = cute.make_rmem_tensor(num_rows, cutlass.Float32)
    row_max.fill(-cutlass.Float32.inf)
    row_sum.fill(0.0)
    return row_max, row_sum


# The running max moves only when a tile's max exceeds it by more than this (log2 units):
# probabilities then stay below 2^8 (fine in fp32 sums and in 16-bit/e4m3 P), and the
# output's rescale, a multiply per output element, is skipped for most tiles.
RESCALE_THRESHOLD = 8.0

# Exponent bases beyond this (log2 units) are "huge": exp2(s * c - fl(m * c)), one FMA,
# leaves fl's rounding error (up to half an ulp of m * c: 2^7 at 2^31) in every exponent,
# which overflows P or flushes it to 0. Rows with such a max subtract it in raw units first
# (exact for scores within 2x of it), at the cost of one compare per row and tile otherwise.
# At 2^20 the FMA's error is at most 2^-4.
HUGE_BASE = 2.0**20


@cute.jit
def is_huge(base):
    """|base| beyond HUGE_BASE and finite (an infinite max keeps the FMA path: its NaN and
    zeros are already the right ones)."""
    magnitude = abs(base)
    return (magnitude > HUGE_BASE) & (magnitude < cutlass.Float32.inf)


# bf16 probabilities are offset by 2^-P_OFFSET_BF16 (P = exp2(x - max - offset)): bf16 V
# reaches 3.4e38, and an unnormalised fp32 sum of P V with P up to 2^8 over many keys
# would overflow where the normalised result is finite. 2^-40 keeps P in bf16's normal
# range (its exponent range is fp32's) and the sum finite up to 2^32 keys; fp16 V cannot
# overflow the sum (|v| <= 65504) and fp16 P has no room, so it keeps offset 0. The LSE adds
# the offset back.
P_OFFSET_BF16 = 40.0
# Largest finite value of each output type: a normalised row may round a hair past it.
LARGEST = {cutlass.Float16: 65504.0, cutlass.BFloat16: 3.3895313892515355e38}


def probability_offset(dtype) -> float:
    return P_OFFSET_BF16 if dtype == cutlass.BFloat16 else 0.0


@cute.jit
def rescale_rows(acc_o_mn: cute.Tensor, r, correction):
    """Row r of the output times correction; nothing when it is 1 (the running max held)."""
    if correction != 1.0:
        acc_o_mn[r, None] = acc_o_mn[r, None].load() * correction


@cute.jit
def softmax_update(
    row_max,
    row_sum,
    scale_log2,
    acc_s_mn: cute.Tensor,
    acc_o_mn: cute.Tensor,
    p_offset: cutlass.Constexpr = 0.0,
    lanes: cutlass.Constexpr = 4,
    corrections=None,
):
    """Online softmax step, in the log2 domain: scores become probabilities (in place),
    times 2^-p_offset (probability_offset), and the output rows are rescaled when the
    running max moves (RESCALE_THRESHOLD). `lanes`: threads that share a row
    (row_allreduce). Where the output is not in registers (tensor memory), acc_o_mn is None
    and each row's factor goes into `corrections` (1 where the max held) for the caller.

    Rows that have seen no valid key keep max = -inf; they use 0 as the exponent base so
    that no exp2(-inf - -inf) = NaN appears, and end with output 0 and LSE -inf. Rows
    whose max is huge (HUGE_BASE) have it subtracted in raw units first. The kernels need
    scale_log2 > 0.
    """
    rows = cute.size(row_max)
    # Every row's new max first, then one branch per tile for the rare huge rows, so that the
    # rows' shuffles and exponents can interleave (a branch per row between them cannot).
    prev_max = cute.make_rmem_tensor((rows,), cutlass.Float32)
    p_base = cute.make_rmem_tensor((rows,), cutlass.Float32)
    any_huge = False
    for r in cutlass.range_constexpr(rows):
        prev_max[r] = row_max[r]
        tile_max = row_allreduce(
            acc_s_mn[r, None].load().reduce(cute.ReductionOp.MAX, row_max[r], 0),
            cute.arch.fmax,
            lanes,
        )
        # The difference first: at huge maxima fl(m * c) + 8 would round back to fl(m * c).
        if (tile_max - row_max[r]) * scale_log2 > RESCALE_THRESHOLD:
            row_max[r] = tile_max
        p_base[r] = row_max[r] * scale_log2
        if row_max[r] == -cutlass.Float32.inf:
            p_base[r] = cutlass.Float32(0.0)
        any_huge = any_huge | is_huge(p_base[r])
    if any_huge:
        for r in cutlass.range_constexpr(rows):
            if is_huge(p_base[r]):
                acc_s_mn[r, None] = acc_s_mn[r, None].load() - row_max[r]
                p_base[r] = cutlass.Float32(0.0)
    for r in cutlass.range_constexpr(rows):
        base = p_base[r]
        if cutlass.const_expr(p_offset != 0.0):
            base = base + p_offset
        probs = cute.math.exp2(acc_s_mn[r, None].load() * scale_log2 - base, fastmath=True)
        # Exactly 1 while the max holds: exp2(prev * s - base) would be fused into an FMA
        # whose result is fl(prev * s)'s rounding error, not 0, and rescale half the tiles.
        # When it moves (rarely), the difference first, for the same reason as above.
        correction = cutlass.Float32(1.0)
        if row_max[r] != prev_max[r]:
            correction = cute.math.exp2((prev_max[r] - row_max[r]) * scale_log2, fastmath=True)
        row_sum[r] = row_sum[r] * correction + probs.reduce(
            cute.ReductionOp.ADD, cutlass.Float32.zero, 0
        )
        acc_s_mn[r, None] = probs
        if cutlass.const_expr(acc_o_mn is not None):
            rescale_rows(acc_o_mn, r, correction)
        if cutlass.const_expr(corrections is not None):
            corrections[r] = correction


@cute.jit
def temperature_update(t_max, t_sum, t_scale_log2, acc_s_mn: cute.Tensor):
    """Running max and sum of exp2(temperature x scale x s), per row, for the temperature
    lse (this thread's columns; the quad's sums meet at the end)."""
    for r in cutlass.range_constexpr(cute.size(t_max)):
        tile_max = quad_max(acc_s_mn[r, None].load().reduce(cute.ReductionOp.MAX, t_max[r], 0))
        if tile_max > -cutlass.Float32.inf:
            correction = cutlass.Float32(0.0)
            if t_max[r] > -cutlass.Float32.inf:
                correction = cute.math.exp2((t_max[r] - tile_max) * t_scale_log2, fastmath=True)
            probs = cute.math.exp2(
                (acc_s_mn[r, None].load() - tile_max) * t_scale_log2, fastmath=True
            )
            t_sum[r] = t_sum[r] * correction + probs.reduce(
                cute.ReductionOp.ADD, cutlass.Float32.zero, 0
            )
            t_max[r] = tile_max


@cute.jit
def softmax_finalize(
    row_max,
    row_sum,
    scale_log2,
    acc_o_mn: cute.Tensor,
    lse: cute.Tensor,
    p_offset: cutlass.Constexpr = 0.0,
    column_scale=None,
    lanes: cutlass.Constexpr = 4,
    inverses=None,
):
    """Normalise the output rows, then scale their columns by `column_scale` (a register
    tensor, one value per column of this thread: Sage's per-channel V scales, applied after
    the normalisation so that a large scale cannot overflow the unnormalised sum); write each
    row's natural-log LSE (p_offset added back) into `lse`. `lanes` as in softmax_update;
    where the output is not in registers, acc_o_mn is None and each row's factor (1 / sum,
    0 for a row that saw no key) goes into `inverses`."""
    for r in cutlass.range_constexpr(cute.size(row_max)):
        total = row_allreduce(row_sum[r], lambda a, b: a + b, lanes)
        inv = cutlass.Float32(0.0)
        row_lse = -cutlass.Float32.inf
        if total > 0.0:
            inv = cute.arch.rcp_approx(total)
            log_total = cute.math.log2(total, fastmath=True)
            if cutlass.const_expr(p_offset != 0.0):
                log_total = log_total + p_offset
            row_lse = (row_max[r] * scale_log2 + log_total) * LN_2
        lse[r] = row_lse
        if cutlass.const_expr(inverses is not None):
            inverses[r] = inv
        if cutlass.const_expr(acc_o_mn is not None):
            if cutlass.const_expr(column_scale is None):
                acc_o_mn[r, None] = acc_o_mn[r, None].load() * inv
            else:
                acc_o_mn[r, None] = acc_o_mn[r, None].load() * inv * column_scale.load()


@cute.jit
def saturated(values, dtype):
    """values (a TensorSSA) with finite entries beyond `dtype`'s largest finite value set to
    it, signs kept (a normalised average of values at the type's limit can round past it);
    inf and NaN stay as they are."""
    big = LARGEST[dtype]
    magnitude = abs(values)
    clamped = cute.where(values > 0.0, cute.full_like(values, big), cute.full_like(values, -big))
    finite_beyond = cute.where(magnitude < cutlass.Float32.inf, clamped, values)
    return cute.where(magnitude > big, finite_beyond, values)


@cute.jit
def mask_columns(acc_s_mn: cute.Tensor, coord_mn: cute.Tensor, limit, key_of_column=None):
    """Set scores whose key column (coordinate mode 1) is >= limit to -inf; key_of_column
    maps a column to its key where the kernel loads keys permuted (sm90/sage_fp8_fwd.py)."""
    for c in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
        key = coord_mn[0, c][1]
        if cutlass.const_expr(key_of_column is not None):
            key = key_of_column(key)
        if key >= limit:
            for r in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
                acc_s_mn[r, c] = -cutlass.Float32.inf
