"""Where a sequence's keys lie, for the MSA attention kernels (msa_sparse_attention's ABI)."""

import cutlass
import cutlass.cute as cute

from generator.families.msa_sparse_attention import BLOCK_KEYS


@cute.jit
def sequence_keys(args, seq):
    """(seqlen_k, key_start, blocks) of sequence `seq`: paged, its seqused_k and the blocks
    that its page-table row covers (key_start 0); flat, from cu_seqlens_k, key_start its
    first row of the one "page"."""
    seqlen_k = cutlass.Int32(0)
    key_start = cutlass.Int32(0)
    blocks = cutlass.Int32(0)
    if args.paged != 0:
        seqlen_k = args.mSeqUsedK[seq]
        blocks = cutlass.min(cute.ceil_div(seqlen_k, BLOCK_KEYS), args.mPageTable.shape[1])
    else:
        key_start = args.mCuK[seq]
        seqlen_k = args.mCuK[seq + 1] - key_start
        blocks = cute.ceil_div(seqlen_k, BLOCK_KEYS)
    return seqlen_k, key_start, blocks
