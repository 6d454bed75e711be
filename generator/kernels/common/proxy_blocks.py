"""Which 128-key blocks a CTA of a proxy-score kernel scores (both templates of
generator/families/msa_proxy_score.py)."""

import cutlass
import cutlass.cute as cute

from generator.families.msa_proxy_score import BLOCK_KEYS


@cute.jit
def scored_blocks(args, paged: cutlass.Constexpr, batch, seqlen_q, first_row, rows):
    """(the sequence's keys, the position of the CTA's first row, the blocks it scores) for a
    CTA of `rows` query rows from row first_row of sequence `batch`: the blocks that hold a
    key one of its rows sees (causal: up to the last row's position), at most the output's
    width."""
    seqlen_k = cutlass.Int32(0)
    if cutlass.const_expr(paged):
        seqlen_k = args.mSeqUsedK[batch]
    else:
        seqlen_k = args.mCuK[batch + 1] - args.mCuK[batch]
    offset = seqlen_k - seqlen_q
    if args.has_q_offset != 0:
        offset = args.mQOffset[batch]
    first_pos = offset + first_row
    blocks = cute.ceil_div(seqlen_k, BLOCK_KEYS)
    if args.causal != 0:
        last_pos = first_pos + rows - 1
        blocks = cutlass.min(blocks, cutlass.max(last_pos + BLOCK_KEYS, 0) // BLOCK_KEYS)
    return seqlen_k, first_pos, cutlass.min(blocks, args.mOut.shape[1])
