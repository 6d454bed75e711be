"""Where the ICP indexer's selections write a (token, head) row, and how (the select and the
list merge; generator/families/msa_icp.py has the row formats and the addresses): a local
carrier row (LOCAL), a legacy receive row of the head's owner (PUBLISH: wait until the owner
has cleared its ready flag, write, then set the flag by a release store once every word of
the row is written) or a tagged receive row (PUBLISH_TAGGED: each word carries the row's
next generation, one more than mGenerations', and no flag)."""

import cutlass
import cutlass.cute as cute

from generator.families.msa_icp import (
    CARRIER_WORDS,
    LOCAL,
    PUBLISH,
    PUBLISH_TAGGED,
    TAGGED_WORDS,
    TOPK,
)
from generator.kernels.common.signals import (
    store_b32,
    store_relaxed_b64,
    store_release_b32,
    wait_for_flag,
)


@cute.jit
def row_address(args, token, head):
    """The byte address of row (token, head)."""
    row_bytes = cutlass.Int64(CARRIER_WORDS * 4)
    if args.mode == PUBLISH_TAGGED:
        row_bytes = cutlass.Int64(TAGGED_WORDS * 8)
    owner = head // args.heads_per_owner
    index = cutlass.Int64(args.row_offset) + cutlass.Int64(
        (head % args.heads_per_owner) * args.head_rows + token
    )
    address = args.mBases[owner] + index * row_bytes
    if args.mode == LOCAL:
        address = args.mCarrier[head, token, None].iterator.toint()
    return address


@cute.jit
def claim_row(args, address, token, head, errors):
    """Before a row is written (one thread): PUBLISH waits for the owner's merge of the slot
    set's last use to clear the flag; returns the row's generation shifted into the high
    word (PUBLISH_TAGGED, counted in mGenerations), else 0."""
    generation = cutlass.Int32(0)
    if args.mode == PUBLISH:
        wait_for_flag(address + 4 * 2 * TOPK, cutlass.Int32(0), args.spin_limit, errors)
    if args.mode == PUBLISH_TAGGED:
        generation = args.mGenerations[head, token] + 1
        args.mGenerations[head, token] = generation
    return generation


@cute.jit
def write_entry(args, address, slot, score_bits, block, generation):
    """Slot `slot` of the row: its score word and its id (generation: claim_row's)."""
    if args.mode == PUBLISH_TAGGED:
        low = cutlass.Int64(0xFFFFFFFF)
        high = cutlass.Int64(generation) << cutlass.Int64(32)
        store_relaxed_b64(address + 8 * slot, high | (cutlass.Int64(score_bits) & low))
        store_relaxed_b64(address + 8 * (TOPK + slot), high | (cutlass.Int64(block) & low))
    else:
        store_b32(address + 4 * slot, score_bits)
        store_b32(address + 4 * (TOPK + slot), cutlass.Int32(block))


@cute.jit
def set_ready(args, address):
    """After every word of the row is written and a barrier (one thread): the ready flag."""
    if args.mode == LOCAL:
        store_b32(address + 4 * 2 * TOPK, cutlass.Int32(1))
    if args.mode == PUBLISH:
        store_release_b32(address + 4 * 2 * TOPK, cutlass.Int32(1))
