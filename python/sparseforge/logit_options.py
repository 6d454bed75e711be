"""plan()'s logit options as the block_sparse_fwd_logits kernels take them.

    bsr_mask_bits(...)            the BSR blocks' per-element masks as bit rows, on the GPU
    pack_mask_bits(mask)          (H, Sq, Sk) bool -> (H, Sq, W) int32 bit rows
    unpack_mask_bits(bits, Sk)    the inverse (the reference path's token mask)
    causal_blocks(selection)      the selection without blocks that lie wholly above the diagonal
    shared_head(selection)        its first kv head where all heads share one structure
    token_tiles(selection, ...)   a selection of 64 x 64 tiles and its bit rows: blocks whose
                                  sizes are not multiples of 64 on the kernels (GPU, no sync)
    kernel_arguments(...)         the logits family's arguments
                                  (generator/families/block_sparse_fwd.py)

Bit rows: word k // 32 of row q holds key k at bit k % 32 (set: visible); a row has
W = 2 * ceil(Sk / 64) words, so that a 64-key tile is two whole words. Scores are in raw
q.k units in the kernels (their softmax scales in the exponent), so the soft cap and the
ALiBi slopes are divided by sm_scale here.
"""

from __future__ import annotations

import dataclasses

import torch

from sparseforge import reference
from sparseforge.planner import block_of_position
from sparseforge.sparsity import Selection, uniform_sizes

TILE = 64  # tokens of a unit and of a key tile (block_sparse_fwd's unit_rows / tile_keys)
WORD_BITS = 32


def words_per_row(seq_k: int) -> int:
    return 2 * -(-seq_k // TILE)


def _pack_bytes(mask: torch.Tensor) -> torch.Tensor:
    """(..., 8n) bool -> (..., n) uint8, key 8i + b at bit b of byte i (little-endian)."""
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=mask.device)
    eight = mask.reshape(*mask.shape[:-1], -1, 8).to(torch.uint8)
    return (eight * weights).sum(-1, dtype=torch.uint8)


def pack_mask_bits(mask: torch.Tensor) -> torch.Tensor:
    """(H, Sq, Sk) bool -> (H, Sq, W) int32 bit rows (module docstring)."""
    h, sq, sk = mask.shape
    padded = torch.zeros(h, sq, words_per_row(sk) * WORD_BITS, dtype=torch.bool, device=mask.device)
    padded[:, :, :sk] = mask
    return _pack_bytes(padded).view(torch.int32)


def unpack_mask_bits(bits: torch.Tensor, seq_k: int) -> torch.Tensor:
    """(H, Sq, W) int32 bit rows -> (H, Sq, Sk) bool."""
    shifts = torch.arange(WORD_BITS, device=bits.device, dtype=torch.int32)
    unpacked = (bits.unsqueeze(-1) >> shifts) & 1
    return unpacked.flatten(-2)[..., :seq_k].bool()


def bsr_mask_bits(indptr, indices, mask, M: int, N: int, R: int, C: int) -> torch.Tensor:
    """(1, M, W) int32 bit rows of a BSR matrix's per-element masks, on the indices' device:
    mask (nnz, R, C) bool is the mask of stored block e (row block r for indptr[r] <= e <
    indptr[r + 1], column block indices[e]); unstored blocks are 0. Entries whose indices
    are out of range are dropped (the selection's checks report them)."""
    device = indices.device
    nnz, mb, nb = indices.numel(), -(-M // R), -(-N // C)
    words = words_per_row(N)
    entry = torch.arange(nnz, device=device)
    row_block = torch.searchsorted(indptr.to(torch.int64)[1:].contiguous(), entry, right=True)
    col_block = indices.to(torch.int64)
    valid = (col_block >= 0) & (col_block < nb) & (row_block < mb)
    # Invalid entries write zeros into a spare row.
    rows = torch.where(valid, row_block, mb)[:, None] * R + torch.arange(R, device=device)
    mask = mask.to(device=device, dtype=torch.bool) & valid[:, None, None]
    col_block = torch.where(valid, col_block, 0)
    if C % 8 == 0:  # whole bytes per block row: no two blocks share one
        dense = torch.zeros((mb + 1) * R, words * 4, dtype=torch.uint8, device=device)
        cols = col_block[:, None] * (C // 8) + torch.arange(C // 8, device=device)
        dense.index_put_((rows[:, :, None], cols[:, None, :]), _pack_bytes(mask))
        dense = dense.view(torch.int32)
    else:  # blocks share words: the bits are disjoint, so a sum is their OR
        dense = torch.zeros((mb + 1) * R, words, dtype=torch.int32, device=device)
        keys = col_block[:, None] * C + torch.arange(C, device=device)
        values = mask.to(torch.int32) << (keys % WORD_BITS).to(torch.int32)[:, None, :]
        index = (
            rows[:, :, None].expand(-1, -1, C),
            (keys // WORD_BITS)[:, None, :].expand(-1, R, -1),
        )
        dense.index_put_(index, values, accumulate=True)
    return dense[:M].unsqueeze(0)


def causal_blocks(selection: Selection) -> Selection:
    """The selection without the blocks no query row of theirs may see under the causal
    mask (bottom-right aligned: query i sees keys <= i + Sk - Sq). No host synchronisation."""
    diagonal = selection.seq_k - selection.seq_q
    last_row = selection.row_sizes.cumsum(-1) - 1
    first_key = selection.col_sizes.cumsum(-1) - selection.col_sizes
    visible = first_key[:, None, :] <= last_row[:, :, None] + diagonal
    return dataclasses.replace(selection, mask=selection.mask & visible)


def shared_head(selection: Selection) -> Selection:
    """The selection's first kv head where every head shares one structure (an expanded
    BSR mask), else the selection: what its token mask needs to be built from."""
    mask = selection.mask
    if mask.shape[0] == 1 or mask.stride(0) != 0:
        return selection
    return dataclasses.replace(
        selection,
        mask=mask[:1],
        row_sizes=selection.row_sizes[:1],
        col_sizes=selection.col_sizes[:1],
        host_row_sizes=selection.host_row_sizes[:1],
        host_col_sizes=selection.host_col_sizes[:1],
    )


def token_tiles(
    selection: Selection, mask_bits, causal: bool, heads: int, chunk_bytes: int = 2**28
) -> tuple[Selection, torch.Tensor]:
    """(selection of 64-token row and key blocks, bit rows) of a selection whose blocks are
    not multiples of 64, on its device without a host synchronisation: the bit rows hold
    its token mask (blocks, kv_block_lens) and, within it, `mask_bits` (1, Sq, W) or else
    the causal mask; a tile is listed where any of its bits is set. `selection` may be
    shared_head()'s one head of `heads` kv heads (the tile lists are then expanded). Rows
    are built `chunk_bytes` of bools at a time."""
    device, seq_q, seq_k = selection.mask.device, selection.seq_q, selection.seq_k
    h, nb = selection.mask.shape[0], selection.mask.shape[2]
    words = words_per_row(seq_k)
    keys = torch.arange(words * WORD_BITS, device=device)
    col_block = block_of_position(selection.col_sizes, keys)  # (H, keys)
    visible_key = (keys < seq_k).expand(h, -1)
    if selection.kv_block_lens is not None:  # uniform key blocks of kv_block_size tokens
        size = selection.kv_block_size
        lens = selection.kv_block_lens.to(device=device, dtype=torch.int64)
        visible_key = visible_key & (keys - col_block * size < lens[col_block])
    row_block = block_of_position(selection.row_sizes, torch.arange(seq_q, device=device))
    bits = torch.empty(h, seq_q, words, dtype=torch.int32, device=device)
    rows_per_chunk = max(1, chunk_bytes // (h * keys.numel()))
    for first in range(0, seq_q, rows_per_chunk):
        last = min(seq_q, first + rows_per_chunk)
        block_rows = torch.gather(
            selection.mask, 1, row_block[:, first:last, None].expand(-1, -1, nb)
        )
        token = torch.gather(block_rows, 2, col_block[:, None, :].expand(-1, last - first, -1))
        token &= visible_key[:, None, :]
        if mask_bits is not None:
            token &= unpack_mask_bits(mask_bits[:, first:last], keys.numel())
        elif causal:
            query = torch.arange(first, last, device=device) + (seq_k - seq_q)
            token &= keys[None, None, :] <= query[None, :, None]
        bits[:, first:last] = pack_mask_bits(token)
    rows, tiles = -(-seq_q // TILE), words // 2
    padded = torch.zeros(h, rows * TILE, tiles, dtype=torch.bool, device=device)
    padded[:, :seq_q] = bits.view(torch.int64) != 0
    listed = padded.view(h, rows, TILE, tiles).any(2)
    host_rows, host_cols = uniform_sizes(seq_q, TILE), uniform_sizes(seq_k, TILE)
    tiled = dataclasses.replace(
        selection,
        mask=listed.expand(heads, -1, -1),
        row_sizes=uniform_sizes(seq_q, TILE, device).expand(heads, -1),
        col_sizes=uniform_sizes(seq_k, TILE, device).expand(heads, -1),
        host_row_sizes=host_rows.expand(heads, -1),
        host_col_sizes=host_cols.expand(heads, -1),
        kv_block_lens=None,
        kv_block_size=None,
    )
    return tiled, bits


def kernel_arguments(options, bits, *, flags: dict, num_qo_heads: int, num_kv_heads: int,
                     sm_scale: float, seq_q: int, seq_k: int, device):  # fmt: skip
    """(mMaskBits, mAlibi, diagonal, logit_flags, cap_in, cap_out) of a plan; `bits`: its
    bit rows (1 or Hkv heads; the kernels read them as one int64 per 64-key tile, (H, T, Sq))
    or None;
    `flags`: the family's logit_* constants. Causal comes from the options only where no
    bit rows carry it."""
    used = 0
    if bits is None:
        bits = torch.zeros(1, 1, 2, dtype=torch.int32, device=device)
    else:
        used |= flags["logit_mask"]
    # A 64-key tile's two words as one (little-endian), tile-major: the rows of a tile are
    # adjacent, so that a warp's reads of them coalesce.
    bits = bits.view(torch.int64).transpose(1, 2).contiguous()
    if bits.shape[0] != num_kv_heads:
        bits = bits.expand(num_kv_heads, -1, -1)
    if options.causal and not used:
        used |= flags["logit_causal"]
    alibi = torch.zeros(num_qo_heads, dtype=torch.float32)
    if options.pos_encoding_mode == "ALIBI":
        alibi = reference.alibi_slopes(num_qo_heads) / sm_scale
        used |= flags["logit_alibi"]
    cap_in = cap_out = 0.0
    if options.soft_cap:
        cap_in, cap_out = sm_scale / options.soft_cap, options.soft_cap / sm_scale
        used |= flags["logit_soft_cap"]
    return bits, alibi.to(device), seq_k - seq_q, used, cap_in, cap_out
