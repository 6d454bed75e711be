"""Top-16 candidate lists of the ICP indexer (generator/families/msa_icp.py has the ranking):
the 64-bit ranking key of a candidate, each query row's best 16 kept while the list scorer
scores the row's blocks, and the count that ranks up to 64 keys of one row in a warp (the
merges).

A ranking key is forced << 63 | order_key(score) << 31 | (2^31 - 1 - id), 0 for no
candidate: a larger key ranks first and exact score ties go to the lower id.

RowLists: a CTA's rows' lists in shared memory. A row's list belongs to the one thread that
stores the row's maxima (the first lane of its quad, the same at every block), so it is
opened, offered to and written out without barriers: 16 keys, the smallest of them and its
slot; a key larger than the smallest replaces it. A list is written out as 32 words, 16
score words (fp32 bits) and 16 ids in slot order, (-inf, -1) for an empty slot, into
mLists[split, h, t] for query row 4 t + h.
"""

import collections

import cutlass
import cutlass.cute as cute

from generator.families.msa_icp import HEADS, LIST_WORDS, MAX_BLOCKS, TOPK
from generator.kernels.common.radix_select import float_bits, float_of_order_key, order_key
from generator.kernels.common.softmax import quad_max
from generator.kernels.common.warp_rows import WARPS_PER_CTA

ID_BITS = 0x7FFFFFFF
SMALLEST, SMALLEST_SLOT = TOPK, TOPK + 1  # a list's words after its keys
LIST_SLOTS = TOPK + 2
NOT_CANDIDATE = -8388608  # -inf's bits as an Int32 (0xFF800000)


@cute.jit
def ranking_key(score, block, limit, end_start, nvp, force_begin):
    """The ranking key of block `block` scoring `score` (Float32), 0 when it is no candidate
    (an id outside [0, limit), a score of -inf or NaN); forced when below force_begin or in
    [end_start, nvp)."""
    score = score + cutlass.Float32(0.0)  # -0 ranks as +0
    key = cutlass.Uint64(0)
    # NaN fails the comparison: no candidate.
    if (block >= 0) & (block < limit) & (score > -cutlass.Float32.inf):
        key = (cutlass.Uint64(order_key(float_bits(score))) << 31) | cutlass.Uint64(ID_BITS - block)
        if (block < force_begin) | ((block >= end_start) & (block < nvp)):
            key = key | (cutlass.Uint64(1) << 63)  # forced
    return key


@cute.jit
def key_block(key):
    """The block id of a (non-zero) ranking key."""
    return cutlass.Int32(ID_BITS) - cutlass.Int32(key & cutlass.Uint64(ID_BITS))


@cute.jit
def key_score_bits(key):
    """The score bits of a (non-zero) ranking key (+0 for a score of -0)."""
    return float_bits(float_of_order_key(cutlass.Uint32((key >> 31) & cutlass.Uint64(0xFFFFFFFF))))


@cute.jit
def warp_keys(count: cutlass.Constexpr, warp):
    """`count` Uint64 of shared memory for warp `warp`'s ranking keys (warp_rows' CTA)."""
    smem = cutlass.memory.SmemAllocator()
    layout = cute.make_layout((count, WARPS_PER_CTA), stride=(1, count))
    return smem.allocate_tensor(cutlass.Uint64, layout, 16)[None, warp]


@cute.jit
def top16_of_keys(keys, sKeys, count: cutlass.Constexpr, lane):
    """Zero the keys of `keys` (a lane's count // 32, lane + 32 k each, also in sKeys) that
    16 others rank above; returns how many keys of the warp are left (every lane, sKeys
    holding them)."""
    per_lane = count // 32
    for k in cutlass.range_constexpr(per_lane):
        own = keys[k]
        above = cutlass.Int32(0)
        for j in cutlass.range(count, unroll=8):
            if sKeys[j] > own:
                above = above + 1
        if above >= TOPK:
            keys[k] = cutlass.Uint64(0)
    cute.arch.sync_warp()
    selected = cutlass.Int32(0)
    for k in cutlass.range_constexpr(per_lane):
        sKeys[lane + 32 * k] = keys[k]
        selected = selected + cute.arch.popc(
            cute.arch.vote_ballot_sync(keys[k] != cutlass.Uint64(0))
        )
    cute.arch.sync_warp()
    return selected


@cute.jit
def ascending_slot(own, sKeys, count: cutlass.Constexpr):
    """A selected key's place among the selected ids of sKeys, ascending (a larger id
    field is a lower id)."""
    slot = cutlass.Int32(0)
    for j in cutlass.range(count, unroll=8):
        other = sKeys[j]
        if (other != cutlass.Uint64(0)) & (
            (other & cutlass.Uint64(ID_BITS)) > (own & cutlass.Uint64(ID_BITS))
        ):
            slot = slot + 1
    return slot


class RowLists(collections.namedtuple("RowLists", ("keys", "valid", "first_row", "split"))):
    """The lists of a CTA's query rows from global row first_row on (keys: LIST_SLOTS
    Uint64 a row, valid: the row's nvp, in shared memory), written out as list `split` of
    each row. Block c's id is c * column_scale + column_offset; a row's nvp is mNumValid of
    its token; force_begin / force_end as the select's. A named tuple of DSL values, so that
    a run-time `if` can carry it."""

    @staticmethod
    def allocate(smem, rows: int, first_row, split):
        keys = smem.allocate_tensor(
            cutlass.Uint64, cute.make_layout((rows, LIST_SLOTS), stride=(LIST_SLOTS, 1)), 16
        )
        valid = smem.allocate_tensor(cutlass.Int32, cute.make_layout(rows), 16)
        return RowLists(keys, valid, first_row, split)

    @staticmethod
    def smem_bytes(rows: int) -> int:
        """Shared memory the lists take, with the allocator's alignment."""
        return rows * LIST_SLOTS * 8 + rows * 4 + 32

    @cute.jit
    def open_rows(self, args, tScS_mn, tidx, first_row, rows_left):
        """Empty lists for the thread's rows from global row first_row (those below
        rows_left), and their tokens' nvp."""
        for r in cutlass.range_constexpr(cute.size(tScS_mn, mode=[0])):
            row = tScS_mn[r, 0][0]
            if (tidx % 4 == 0) & (row < rows_left):
                local = first_row + row - self.first_row
                for i in cutlass.range_constexpr(LIST_SLOTS):
                    self.keys[local, i] = cutlass.Uint64(0)
                self.valid[local] = args.mNumValid[(first_row + row) // HEADS]

    @cute.jit
    def offer_rows(self, args, row_max, tScS_mn, tidx, first_row, rows_left, page):
        """Each of the thread's rows' max (over its quad) as block `page`'s candidate."""
        block = page * args.column_scale + args.column_offset
        for r in cutlass.range_constexpr(cute.size(row_max)):
            value = quad_max(row_max[r])
            row = tScS_mn[r, 0][0]
            if (tidx % 4 == 0) & (row < rows_left):
                local = first_row + row - self.first_row
                nvp = self.valid[local]
                limit = cutlass.min(cutlass.max(nvp, 0), MAX_BLOCKS)
                key = ranking_key(value, block, limit, nvp - args.force_end, nvp, args.force_begin)
                if key > self.keys[local, SMALLEST]:
                    self.keys[local, cutlass.Int32(self.keys[local, SMALLEST_SLOT])] = key
                    smallest = self.keys[local, 0]
                    at = cutlass.Int32(0)
                    for i in cutlass.range_constexpr(1, TOPK):
                        if self.keys[local, i] < smallest:
                            smallest = self.keys[local, i]
                            at = cutlass.Int32(i)
                    self.keys[local, SMALLEST] = smallest
                    self.keys[local, SMALLEST_SLOT] = cutlass.Uint64(at)

    @cute.jit
    def close_rows(self, args, tScS_mn, tidx, first_row, rows_left):
        """The thread's rows' lists into mLists."""
        for r in cutlass.range_constexpr(cute.size(tScS_mn, mode=[0])):
            row = tScS_mn[r, 0][0]
            if (tidx % 4 == 0) & (row < rows_left):
                local = first_row + row - self.first_row
                out = list_words(args, first_row + row, self.split)
                for i in cutlass.range_constexpr(TOPK):
                    key = self.keys[local, i]
                    score_bits, block = cutlass.Int32(NOT_CANDIDATE), cutlass.Int32(-1)
                    if key != cutlass.Uint64(0):
                        score_bits, block = key_score_bits(key), key_block(key)
                    out[i] = score_bits
                    out[TOPK + i] = block


@cute.jit
def list_words(args, row, split):
    """The 32 words of list `split` of global query row `row` (token row // 4, head row %
    4)."""
    return args.mLists[split, row % HEADS, row // HEADS, None]


@cute.jit
def write_empty_lists(args, first_row, rows, split, tidx, threads: cutlass.Constexpr):
    """Empty lists (-inf, -1) for `rows` query rows from first_row (a split with no page)."""
    for i in cutlass.range(tidx, rows * LIST_WORDS, threads, unroll=1):
        word = i % LIST_WORDS
        value = cutlass.Int32(NOT_CANDIDATE)
        if word >= TOPK:
            value = cutlass.Int32(-1)
        list_words(args, first_row + i // LIST_WORDS, split)[word] = value
