"""A unit's list of tiles: what each CTA of an attention kernel over units and tiles works on
(the plan tensors of generator/families/block_sparse_fwd.py plan_args)."""

import cutlass.cute as cute


def unit_of_cta(args, queries, num_kv_heads, tile_m: int, units_per_cta=1, index=0):
    """(head, tile_m-row chunk, kv head, tile list, its length) of a unit of this CTA: CTA b
    runs the units mWork[b * units_per_cta + index] = head * chunks + chunk. The tile list is
    the unit's row of mTileIdx, sliced once: indexing mTileIdx by (kv_head, chunk, j) in a
    loop recomputed the row's 64-bit address every tile. `queries`: a (Sq, Hq, ...) tensor
    (q or its output) whose extents the kernel reads anyway."""
    bidx, _, _ = cute.arch.block_idx()
    num_rows, num_qo_heads = queries.shape[0], queries.shape[1]
    num_chunks = cute.ceil_div(num_rows, tile_m)
    unit = args.mWork[bidx * units_per_cta + index]
    head = unit // num_chunks
    chunk = unit - head * num_chunks
    kv_head = head // (num_qo_heads // num_kv_heads)
    return head, chunk, kv_head, args.mTileIdx[kv_head, chunk, None], args.mTileCnt[kv_head, chunk]


def stacked_units_of_cta(args, queries, num_kv_heads, tile_m: int, units_per_cta: int):
    """(heads, chunks, kv head, tile list, its length) of all `units_per_cta` units of this
    CTA, stacked over one tile list (the planner groups units that list the same tiles):
    heads and chunks as lists, unit by unit (unit_of_cta)."""
    units = [
        unit_of_cta(args, queries, num_kv_heads, tile_m, units_per_cta, u)
        for u in range(units_per_cta)
    ]
    _, _, kv_head, tile_ids, num_tiles = units[0]
    return [unit[0] for unit in units], [unit[1] for unit in units], kv_head, tile_ids, num_tiles
