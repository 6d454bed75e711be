"""Turn the API's sparsity descriptions into the kernels' tile lists, on the inputs' device.

The kernels (generator/catalog.py, block_sparse_fwd ABI) see only 64-row query units and
64-key tiles. Every input form is first made a per-kv-head block mask (Hkv, MB, NB) with
block sizes per head, then mapped onto units and tiles:
    unit r (rows 64r..64r+63) of kv head h     -> row block containing row 64r
    tile t (keys 64t..64t+63)                  -> column block containing key 64t
    tile t is listed for (h, r) when its column block is selected for that row block
So any block size that is a multiple of 64 is exact (the last block of a sequence may be
short). The lists are compacted with a prefix sum, not a sort, and the units are launched
longest list first. All of it is torch arithmetic: no Python loop over heads or rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

TILE = 64


@dataclass
class TilePlan:
    tile_idx: torch.Tensor  # (Hkv, R, T) int32: the first tile_cnt entries are read
    tile_cnt: torch.Tensor  # (Hkv, R) int32
    tile_len: torch.Tensor  # (NT,) int32 valid keys per tile
    work: torch.Tensor  # (Hq * R,) int32 unit ids h * R + r, longest list first
    seq_q: int
    seq_k: int
    num_qo_heads: int
    num_kv_heads: int

    def tensors(self):
        return self.work, self.tile_idx, self.tile_cnt, self.tile_len


def num_tiles(tokens: int) -> int:
    return -(-tokens // TILE)


def tile_padded_keys(num_heads: int, seq_k: int, head_dim: int, dtype, device) -> torch.Tensor:
    """A (num_heads, seq_k rounded up to 64, head_dim) buffer, zero past seq_k: Sage K as
    sm90_sage_fp8 reads it (every head's whole 64-key tiles through one view). Callers
    fill [:, :seq_k] and pass that view."""
    buf = torch.empty((num_heads, num_tiles(seq_k) * TILE, head_dim), dtype=dtype, device=device)
    buf[:, seq_k:].zero_()
    return buf


def tile_key_scales(k_scale: torch.Tensor, keys_per_scale: int) -> torch.Tensor:
    """(Hkv, G) per-group key scales as (Hkv, TILE / keys_per_scale * NT), NT = the 64-key
    tiles they cover: each tile's scales side by side (one 16-byte load in the kernels),
    padded past the last group with its scale."""
    per_tile = TILE // keys_per_scale
    groups = k_scale.shape[-1]
    index = torch.arange(-(-groups // per_tile) * per_tile, device=k_scale.device).clamp_max(groups - 1)
    return k_scale[:, index].contiguous()


def sizes_tile_aligned(sizes: torch.Tensor, tokens: int = TILE) -> bool:
    """True when every block but the last of each row of `sizes` is a multiple of `tokens`."""
    return bool((sizes[..., :-1] % tokens == 0).all())


def sizes_are_tiles(sizes: torch.Tensor) -> bool:
    """True when every block is 64 tokens but each row's last, which is at most 64."""
    return bool((sizes[..., :-1] == TILE).all() and (sizes[..., -1] <= TILE).all())


def block_of_position(sizes: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Index of the block (per row of `sizes`, (H, B)) that contains each position (P,)."""
    ends = torch.cumsum(sizes, dim=-1)
    index = torch.searchsorted(ends, positions.expand(sizes.shape[0], -1).contiguous(), right=True)
    return index.clamp_max(sizes.shape[-1] - 1)


def tile_lengths(seq_k: int, device, kv_block_lens=None, kv_block_size: int = TILE) -> torch.Tensor:
    """Valid keys in each 64-key tile: the sequence end and kv_block_lens cut tiles short.

    kv_block_lens (NB,) applies to uniform key blocks of kv_block_size tokens: block b holds
    valid keys b*C .. b*C + len_b - 1.
    """
    if kv_block_lens is None and seq_k % TILE == 0:
        return torch.full((seq_k // TILE,), TILE, device=device, dtype=torch.int32)
    start = torch.arange(num_tiles(seq_k), device=device, dtype=torch.int64) * TILE
    length = (seq_k - start).clamp(0, TILE)
    if kv_block_lens is not None:
        lens = kv_block_lens.to(device=device, dtype=torch.int64).clamp(0, kv_block_size)
        block = (start // kv_block_size).clamp_max(lens.numel() - 1)
        valid_end = block * kv_block_size + lens[block]
        length = torch.minimum(length, (valid_end - start).clamp(0, TILE))
    return length.to(torch.int32)


def plan_tiles(
    block_mask: torch.Tensor,
    row_sizes: torch.Tensor,
    col_sizes: torch.Tensor,
    seq_q: int,
    seq_k: int,
    num_qo_heads: int,
    kv_block_lens: torch.Tensor | None = None,
    kv_block_size: int = TILE,
    blocks_are_tiles: bool = False,
    units_per_cta: int = 1,
) -> TilePlan:
    """block_mask (Hkv, MB, NB) bool; row_sizes (Hkv, MB), col_sizes (Hkv, NB) in tokens.

    blocks_are_tiles: every block is 64 x 64 tokens (the last may be short), so the mask
    already is the tile mask and the two gathers are skipped.
    units_per_cta: units per CTA of the chosen kernel (see longest_first).
    """
    device = block_mask.device
    hkv = block_mask.shape[0]
    n_units, n_tiles = num_tiles(seq_q), num_tiles(seq_k)
    tile_len = tile_lengths(seq_k, device, kv_block_lens, kv_block_size)
    if blocks_are_tiles:
        listed = block_mask
    else:
        unit_start = torch.arange(n_units, device=device, dtype=torch.int64) * TILE
        tile_start = torch.arange(n_tiles, device=device, dtype=torch.int64) * TILE
        row_block = block_of_position(row_sizes, unit_start)  # (Hkv, R)
        col_block = block_of_position(col_sizes, tile_start)  # (Hkv, NT)
        rows = torch.gather(block_mask, 1, row_block.unsqueeze(-1).expand(-1, -1, block_mask.shape[2]))
        listed = torch.gather(rows, 2, col_block.unsqueeze(1).expand(-1, n_units, -1))
    if kv_block_lens is not None:  # only kv_block_lens leaves tiles with no valid key
        listed = listed & (tile_len > 0)

    tile_idx, tile_cnt = compact_rows(listed)
    return TilePlan(
        tile_idx=tile_idx,
        tile_cnt=tile_cnt,
        tile_len=tile_len,
        work=longest_first(tile_cnt, num_qo_heads // hkv, units_per_cta),
        seq_q=seq_q,
        seq_k=seq_k,
        num_qo_heads=num_qo_heads,
        num_kv_heads=hkv,
    )


def compact_rows(listed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_idx, tile_cnt) of a (Hkv, R, NT) bool tile mask: each row's listed tile ids,
    ascending, and their count (entries past the count are not read).

    On a GPU this is the tile_compact kernel (one warp per row); elsewhere a prefix sum and a
    search: the j-th listed tile is the first t whose inclusive count reaches j + 1.
    """
    if listed.is_cuda:
        tile_idx = torch.empty(listed.shape, device=listed.device, dtype=torch.int32)
        tile_cnt = torch.empty(listed.shape[:2], device=listed.device, dtype=torch.int32)
        _compact_launch(listed.device.index)((listed.view(torch.uint8), tile_idx, tile_cnt))
        return tile_idx, tile_cnt
    count = torch.cumsum(listed, dim=-1, dtype=torch.int32)
    ranks = torch.arange(1, listed.shape[-1] + 1, dtype=torch.int32).repeat(*listed.shape[:2], 1)
    return torch.searchsorted(count, ranks, out_int32=True), count[..., -1].contiguous()


@functools.cache
def _compact_launch(device_index: int):
    from sparseforge._library import find_kernel
    from sparseforge.arch import arch_for_device

    kernel = find_kernel("tile_compact", arch_for_device(device_index))
    kernel.prepare()
    return kernel.bind()


def longest_first(tile_cnt: torch.Tensor, group: int, units_per_cta: int = 1) -> torch.Tensor:
    """Unit ids h * R + r of every query head's units in launch order, longest list first.

    With n = units_per_cta > 1 each run of n entries is one CTA, whose units must share a
    tile list: n query heads of one kv group when the group allows (group % n == 0), else n
    consecutive 64-row units of one head, which the caller guarantees lie in one row block
    (a last unit without partners is its own partner: computed twice, written alike).
    """
    r = tile_cnt.shape[1]
    n = units_per_cta
    if n == 1:
        unit_cnt = tile_cnt.repeat_interleave(group, dim=0).reshape(-1)
        return torch.argsort(unit_cnt, descending=True, stable=True).to(torch.int32)
    rank = torch.arange(n, device=tile_cnt.device)
    if group % n == 0:
        cta_cnt = tile_cnt.repeat_interleave(group // n, dim=0).reshape(-1)
        order = torch.argsort(cta_cnt, descending=True, stable=True)
        head = (order // r * n).unsqueeze(1) + rank
        row = (order % r).unsqueeze(1)
    else:
        cta_cnt = tile_cnt[:, ::n].repeat_interleave(group, dim=0)
        width = cta_cnt.shape[1]
        order = torch.argsort(cta_cnt.reshape(-1), descending=True, stable=True)
        head = (order // width).unsqueeze(1)
        row = ((order % width) * n).unsqueeze(1).add(rank).clamp_max(r - 1)
    return (head * r + row).reshape(-1).to(torch.int32)


def rows_fit_units(row_sizes: torch.Tensor, units: int) -> bool:
    """True when `units` consecutive 64-row units always lie in one row block: every block
    but each head's last is a multiple of 64 * units tokens (host sizes)."""
    return sizes_tile_aligned(row_sizes, TILE * units)


# Error bits of the data checks done on the GPU (see validation.py).
ERR_INDEX_RANGE = 1
ERR_DUPLICATE = 2
ERR_INDPTR = 4
ERR_KV_BLOCK_LENS = 8
ERR_Q2K_NUM = 16
ERR_GROUP_SELECTIONS = 32


def _flag(condition: torch.Tensor, bit: int) -> torch.Tensor:
    """int32 scalar: `bit` when any element of `condition` holds, else 0 (no host sync)."""
    return condition.any().to(torch.int32) * bit


def bsr_block_mask(indptr, indices, num_row_blocks: int, num_col_blocks: int):
    """(1, MB, NB) bool mask of a BSR structure shared by all heads, and its error bits.

    Entries that are out of range, or that a malformed indptr puts nowhere, select nothing,
    so a bad structure can never send a kernel out of bounds; the bits say what was wrong.
    """
    device = indices.device
    ptr = indptr.to(torch.int64)
    entry = torch.arange(indices.numel(), device=device)
    rows = torch.searchsorted(ptr[1:].contiguous(), entry, right=True)
    cols = indices.to(torch.int64)
    valid = (cols >= 0) & (cols < num_col_blocks) & (rows < num_row_blocks)
    mask = torch.zeros(num_row_blocks + 1, num_col_blocks + 1, device=device, dtype=torch.bool)
    hit = (torch.where(valid, rows, num_row_blocks), torch.where(valid, cols, num_col_blocks))
    mask.index_put_(hit, torch.ones((), device=device, dtype=torch.bool))  # no host scalar copy
    mask = mask[:num_row_blocks, :num_col_blocks]
    per_row = torch.zeros(num_row_blocks + 1, device=device, dtype=torch.int64)
    per_row.index_add_(0, torch.where(valid, rows, num_row_blocks), valid.to(torch.int64))
    errors = (
        _flag((cols < 0) | (cols >= num_col_blocks), ERR_INDEX_RANGE)
        + _flag(per_row[:num_row_blocks] != mask.sum(-1, dtype=torch.int64), ERR_DUPLICATE)
        + _flag(
            (ptr[0] != 0) | (ptr[-1] != indices.numel()) | (ptr[1:] < ptr[:-1]).any(), ERR_INDPTR
        )
    )
    return mask.unsqueeze(0), errors


def selection_block_mask(q2k_indices, q2k_num, num_col_blocks: int):
    """(H, MB, NB) bool mask of direct selections (H, MB, topk) with counts (H, MB), and its
    error bits. Out-of-range entries select nothing; entries past a row's count are unused."""
    h, mb, topk = q2k_indices.shape
    device = q2k_indices.device
    idx = q2k_indices.to(torch.int64)
    in_range = (idx >= 0) & (idx < num_col_blocks)
    used = torch.ones_like(in_range)
    errors = torch.zeros((), device=device, dtype=torch.int32)
    if q2k_num is not None:
        num = q2k_num.to(device=device, dtype=torch.int64)
        errors = errors + _flag((num < 0) | (num > topk), ERR_Q2K_NUM)
        used = torch.arange(topk, device=device) < num.unsqueeze(-1)
    valid = in_range & used
    mask = torch.zeros(h, mb, num_col_blocks + 1, device=device, dtype=torch.bool)
    mask.scatter_(2, torch.where(valid, idx, num_col_blocks), True)
    mask = mask[..., :num_col_blocks]
    errors = errors + _flag(used & ~in_range, ERR_INDEX_RANGE)
    errors = errors + _flag(valid.sum(-1, dtype=torch.int32) != mask.sum(-1, dtype=torch.int32), ERR_DUPLICATE)
    return mask, errors


def group_selection_errors(per_head: torch.Tensor, group: int) -> torch.Tensor:
    """ERR_GROUP_SELECTIONS when the query heads of a GQA group have different rows in
    `per_head` (Hq, ...): a block mask, or sorted_selections."""
    rows = per_head.reshape(per_head.shape[0] // group, group, *per_head.shape[1:])
    return _flag(rows != rows[:, :1], ERR_GROUP_SELECTIONS)


def sorted_selections(q2k_indices, q2k_num) -> torch.Tensor:
    """Each selection row's used entries, sorted (unused ones as INT32_MIN, first): rows
    that select the same blocks in any order compare equal."""
    idx = q2k_indices
    if q2k_num is not None:
        used = torch.arange(idx.shape[-1], device=idx.device) < q2k_num.unsqueeze(-1)
        idx = torch.where(used, idx, torch.iinfo(torch.int32).min)
    return idx.sort(dim=-1).values


def kv_block_lens_errors(kv_block_lens, block: int) -> torch.Tensor:
    """Error bits of kv_block_lens (entries must lie in [1, C]; tile_lengths clamps them)."""
    return _flag((kv_block_lens < 1) | (kv_block_lens > block), ERR_KV_BLOCK_LENS)


def uniform_block_sizes(total: int, block: int, heads: int, device) -> torch.Tensor:
    """(heads, ceil(total / block)) sizes of `block`-token blocks, the last one short; built
    on `device` (no host-to-device copy)."""
    n = -(-total // block)
    sizes = torch.full((n,), block, device=device, dtype=torch.int64)
    sizes[-1:].fill_(total - block * (n - 1))  # a fill kernel, not a host-to-device copy
    return sizes.expand(heads, -1)
