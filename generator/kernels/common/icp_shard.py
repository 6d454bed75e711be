"""A rank's shard of the ICP index keys as both scorer templates see it
(generator/families/msa_icp.py): the pages a CTA scores, the rows of a page a position sees,
the row maxima's stores and the -inf fill of the columns no page fills (score rows; the
lists of the fused paths are generator/kernels/common/icp_lists.py's)."""

import cutlass
import cutlass.cute as cute

from generator.families.msa_icp import HEADS
from generator.kernels.common.softmax import quad_max

NEG_INF = -cutlass.Float32.inf


@cute.jit
def scored_pages(args, seqlen_k, first_pos, rows, width):
    """The shard pages that hold a key one of the CTA's `rows` query rows sees (HEADS rows a
    token, the first at position first_pos), at most as many as have a column below `width`
    (page c's is c * column_scale + column_offset: the score rows' width, or the lists'
    block id bound)."""
    last_pos = first_pos + (rows - 1) // HEADS
    reach = cutlass.min(last_pos, seqlen_k - 1) - args.key_base
    pages = cutlass.Int32(0)
    if reach >= 0:
        pages = reach // args.page_size + 1
    fitting = cutlass.Int32(0)
    if width > args.column_offset:
        fitting = cute.ceil_div(width - args.column_offset, args.column_scale)
    return cutlass.min(pages, fitting)


@cute.jit
def split_pages(pages, split, splits):
    """[first, end): the run of a row tile's `pages` pages the CTA of split `split` (of
    `splits`) scores."""
    per = cute.ceil_div(pages, splits)
    first = cutlass.min(split * per, pages)
    return first, cutlass.min(first + per, pages)


@cute.jit
def rows_at_or_before(args, position, page, first_row, most):
    """How many of page `page`'s rows from first_row on (at most `most`) hold a key at or
    before `position` (the rows' keys grow with them)."""
    reach = position - args.page_size * page - args.key_base - first_row * args.key_step
    rows = cutlass.Int32(0)
    if reach >= 0:
        rows = cutlass.min(reach // args.key_step + 1, most)
    return rows


@cute.jit
def store_row_maxima(args, row_max, tScS_mn, tidx, first_row, rows_left, page):
    """Each of the thread's rows' max (over its quad), written by the quad's first lane to
    page `page`'s column of query row first_row + row."""
    column = page * args.column_scale + args.column_offset
    for r in cutlass.range_constexpr(cute.size(row_max)):
        value = quad_max(row_max[r])
        row = tScS_mn[r, 0][0]
        if (tidx % 4 == 0) & (row < rows_left):
            args.mOut[first_row + row, column] = value


@cute.jit
def fill_unscored(args, tidx, threads: cutlass.Constexpr, first_row, rows, pages, seqlen_k):
    """-inf in the columns of the CTA's `rows` query rows from first_row that none of its
    `pages` scored pages filled, below the fill bound: fill_columns and (fill_page_multiple >
    0) the sequence's page count rounded up to that multiple."""
    fill = args.fill_columns
    if args.fill_page_multiple > 0:
        multiple = args.fill_page_multiple
        rounded = cute.ceil_div(cute.ceil_div(seqlen_k, args.page_size), multiple)
        fill = cutlass.max(fill, rounded * multiple)
    fill = cutlass.min(fill, args.mOut.shape[1])
    for i in cutlass.range(tidx, fill * rows, threads, unroll=1):
        row, column = i % rows, i // rows
        local = column - args.column_offset
        unscored = (
            (local < 0) | (local % args.column_scale != 0) | (local // args.column_scale >= pages)
        )
        if unscored:
            args.mOut[first_row + row, column] = NEG_INF
