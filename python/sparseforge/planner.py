"""Turn a per-kv-head block mask into the kernels' tile lists, on the mask's device.

Pure torch. The attention kernels see only units of `unit_rows` query rows and tiles of
`tile_keys` keys (their family's constants in manifest.json: 64 and 64 today). A block mask
(Hkv, MB, NB) with block sizes per head is mapped onto them:
    unit r (rows r*U .. r*U+U-1) of kv head h  -> row block containing row r*U
    tile t (keys t*T .. t*T+T-1)                -> column block containing key t*T
    tile t is listed for (h, r) when its column block is selected for that row block
so any block size that is a multiple of the tile is exact (the last block of a sequence may
be short). Each row of listed tiles is compacted into ascending tile ids (a prefix sum here;
the caller may pass a faster `compact`, e.g. the tile_compact kernel), and the units are
ordered longest list first. No Python loop over heads or rows.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch


@dataclass(frozen=True)
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
        """The plan tensors in the attention ABI's order (mWork, mTileIdx, mTileCnt, mTileLen)."""
        return self.work, self.tile_idx, self.tile_cnt, self.tile_len


def num_tiles(tokens: int, tile: int) -> int:
    return -(-tokens // tile)


def tile_padded_keys(
    num_heads: int, seq_k: int, head_dim: int, dtype, device, tile: int
) -> torch.Tensor:
    """A (num_heads, seq_k rounded up to `tile`, head_dim) buffer, zero past seq_k: keys whose
    heads lie whole tiles apart. Callers fill [:, :seq_k] and pass that view."""
    buf = torch.empty(
        (num_heads, num_tiles(seq_k, tile) * tile, head_dim), dtype=dtype, device=device
    )
    buf[:, seq_k:].zero_()
    return buf


def tile_padded_scales(
    num_heads: int, seq_k: int, keys_per_scale: int, tile: int, device
) -> torch.Tensor:
    """A (1, num_heads, G_pad) fp32 buffer for per-group key scales, G_pad = the groups of
    whole tiles, zero past ceil(seq_k / keys_per_scale): k_scale whose per-tile layout the
    kernels read in place (families/sage_fp8_fwd.py copies any other into one). Callers
    fill [..., :G] and pass that view."""
    groups = num_tiles(seq_k, tile) * (tile // keys_per_scale)
    buf = torch.empty((1, num_heads, groups), dtype=torch.float32, device=device)
    buf[..., -(-seq_k // keys_per_scale) :].zero_()
    return buf


# Facts about host size tensors (alignment, lengths), computed once per tensor object and
# version: a torch op on the host costs 10-100 us, and plan() asks the same questions of the
# same cached size tensors (VariableBlockSparseAttentionWrapper._host_sizes) on every call.
_host_facts: dict[int, tuple[weakref.ref, int, dict]] = {}


def tensor_version(t: torch.Tensor) -> int | None:
    """t's version counter (it moves on every in-place write), or None for a tensor made
    under torch.inference_mode(), which has none."""
    return None if t.is_inference() else t._version


def host_fact(sizes: torch.Tensor, question, answer: Callable):
    """answer() for this host tensor and `question`, remembered while the tensor lives
    unmodified (same object, same version counter; a tensor made under inference mode has
    no version counter: its facts are remembered while it lives, so pass only tensors that
    are not written after they are made, as plan()'s host size copies)."""
    version = tensor_version(sizes)
    entry = _host_facts.get(id(sizes))
    if entry is None or entry[0]() is not sizes or entry[1] != version:
        if len(_host_facts) > 64:
            _host_facts.clear()
        entry = (weakref.ref(sizes), version, {})
        _host_facts[id(sizes)] = entry
    facts = entry[2]
    if question not in facts:
        facts[question] = answer()
    return facts[question]


def sizes_tile_aligned(sizes: torch.Tensor, tokens: int) -> bool:
    """True when every block but the last of each row of `sizes` is a multiple of `tokens`."""
    return host_fact(
        sizes, ("aligned", tokens), lambda: bool((sizes[..., :-1] % tokens == 0).all())
    )


def sizes_are_tiles(sizes: torch.Tensor, tile: int) -> bool:
    """True when every block is `tile` tokens but each row's last, which is at most that."""
    return host_fact(
        sizes,
        ("tiles", tile),
        lambda: bool((sizes[..., :-1] == tile).all() and (sizes[..., -1] <= tile).all()),
    )


def rows_fit_units(row_sizes: torch.Tensor, units: int, unit_rows: int) -> bool:
    """True when `units` consecutive units always lie in one row block: every block but each
    head's last is a multiple of units * unit_rows tokens (host sizes)."""
    return sizes_tile_aligned(row_sizes, unit_rows * units)


_device_constants: dict[tuple, object] = {}
Constant = TypeVar("Constant")


def device_constant(key: tuple, device, make: Callable[[], Constant]) -> Constant:
    """make(), tensors on a GPU that kernels only read, made once per key and device: each
    fill is a launch of host time. Made afresh on the host, and during a CUDA graph capture
    (which records the fill instead of running it: a tensor kept from there would hold its
    values only once the graph had replayed)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return make()
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    entry = (key, device.index)
    if entry not in _device_constants:
        if len(_device_constants) > 64:
            _device_constants.clear()
        _device_constants[entry] = make()
    return _device_constants[entry]


def block_of_position(sizes: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Index of the block (per row of `sizes`, (H, B)) that contains each position (P,)."""
    ends = torch.cumsum(sizes, dim=-1)
    index = torch.searchsorted(ends, positions.expand(sizes.shape[0], -1).contiguous(), right=True)
    return index.clamp_max(sizes.shape[-1] - 1)


def tile_lengths(
    seq_k: int, device, tile: int, kv_block_lens=None, kv_block_size: int | None = None
) -> torch.Tensor:
    """Valid keys in each tile: the sequence end and kv_block_lens cut tiles short.

    kv_block_lens (NB,) applies to uniform key blocks of kv_block_size tokens: block b holds
    valid keys b*C .. b*C + len_b - 1.
    """
    if kv_block_lens is None and seq_k % tile == 0:
        return device_constant(
            ("whole tiles", seq_k, tile),
            device,
            lambda: torch.full((seq_k // tile,), tile, device=device, dtype=torch.int32),
        )
    start = torch.arange(num_tiles(seq_k, tile), device=device, dtype=torch.int64) * tile
    length = (seq_k - start).clamp(0, tile)
    if kv_block_lens is not None:
        lens = kv_block_lens.to(device=device, dtype=torch.int64).clamp(0, kv_block_size)
        block = (start // kv_block_size).clamp_max(lens.numel() - 1)
        valid_end = block * kv_block_size + lens[block]
        length = torch.minimum(length, (valid_end - start).clamp(0, tile))
    return length.to(torch.int32)


def compact_rows(listed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_idx, tile_cnt) of a (Hkv, R, NT) bool tile mask: each row's listed tile ids,
    ascending, and their count (entries past the count are not read). A prefix sum and a
    search: the j-th listed tile is the first t whose inclusive count reaches j + 1."""
    count = torch.cumsum(listed, dim=-1, dtype=torch.int32)
    ranks = torch.arange(1, listed.shape[-1] + 1, dtype=torch.int32, device=listed.device)
    ranks = ranks.repeat(*listed.shape[:2], 1)
    return torch.searchsorted(count, ranks, out_int32=True), count[..., -1].contiguous()


def plan_tiles(
    block_mask: torch.Tensor,
    row_sizes: torch.Tensor,
    col_sizes: torch.Tensor,
    seq_q: int,
    seq_k: int,
    num_qo_heads: int,
    *,
    unit_rows: int,
    tile_keys: int,
    kv_block_lens: torch.Tensor | None = None,
    kv_block_size: int | None = None,
    blocks_are_tiles: bool = False,
    units_per_cta: int = 1,
    compact: Callable = compact_rows,
    order: Callable | None = None,
) -> TilePlan:
    """block_mask (Hkv, MB, NB) bool; row_sizes (Hkv, MB), col_sizes (Hkv, NB) in tokens.

    blocks_are_tiles: every block is one unit by one tile (the last may be short), so the
    mask already is the tile mask and the two gathers are skipped.
    units_per_cta: units per CTA of the chosen kernel (see longest_first).
    compact: (Hkv, R, NT) bool -> (tile_idx, tile_cnt), as compact_rows.
    order: (tile_cnt, group, units_per_cta) -> work, as longest_first (its default).
    """
    device = block_mask.device
    hkv = block_mask.shape[0]
    n_units, n_tiles = num_tiles(seq_q, unit_rows), num_tiles(seq_k, tile_keys)
    tile_len = tile_lengths(seq_k, device, tile_keys, kv_block_lens, kv_block_size)
    if blocks_are_tiles:
        listed = block_mask
    else:
        unit_start = torch.arange(n_units, device=device, dtype=torch.int64) * unit_rows
        tile_start = torch.arange(n_tiles, device=device, dtype=torch.int64) * tile_keys
        row_block = block_of_position(row_sizes, unit_start)  # (Hkv, R)
        col_block = block_of_position(col_sizes, tile_start)  # (Hkv, NT)
        rows = torch.gather(
            block_mask, 1, row_block.unsqueeze(-1).expand(-1, -1, block_mask.shape[2])
        )
        listed = torch.gather(rows, 2, col_block.unsqueeze(1).expand(-1, n_units, -1))
    if kv_block_lens is not None:  # only kv_block_lens leaves tiles with no valid key
        listed = listed & (tile_len > 0)

    tile_idx, tile_cnt = compact(listed)
    return TilePlan(
        tile_idx=tile_idx,
        tile_cnt=tile_cnt,
        tile_len=tile_len,
        work=(order or longest_first)(tile_cnt, num_qo_heads // hkv, units_per_cta),
        seq_q=seq_q,
        seq_k=seq_k,
        num_qo_heads=num_qo_heads,
        num_kv_heads=hkv,
    )


def longest_first(tile_cnt: torch.Tensor, group: int, units_per_cta: int = 1) -> torch.Tensor:
    """Unit ids h * R + r of every query head's units in launch order, longest list first.

    With n = units_per_cta > 1 each run of n entries is one CTA, whose units must share a
    tile list: n query heads of one kv group when the group allows (group % n == 0), else n
    consecutive units of one head, which the caller guarantees lie in one row block
    (rows_fit_units; a last unit without partners is its own partner: computed twice,
    written alike).
    """
    r = tile_cnt.shape[1]
    n = units_per_cta
    if n == 1:
        unit_cnt = tile_cnt.repeat_interleave(group, dim=0) if group > 1 else tile_cnt
        unit_cnt = unit_cnt.reshape(-1)
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
