"""The API's sparsity forms, each turned into one per-kv-head block mask on the device.

    BSR (indptr, indices)          one (MB, NB) structure for every head
    block_mask (Hq or Hkv, MB, NB) per head
    q2k_indices / q2k_num          per query head and row block, the selected block ids
    block_mask_map                 per kv head, with block sizes per head (variable wrapper)

A `Selection` is the result: the mask (Hkv, MB, NB), block sizes per head on the device and
on the host, kv_block_lens, and the error bits of the checks that need the values. Entries
that are invalid (out of range, duplicates, a malformed indptr) select nothing, so no kernel
can read out of bounds; the bits say what was wrong (validation.py raises them). GQA: the
query heads of a group share the kv head's selection; per-query-head forms whose heads of a
group differ set ERR_GROUP_SELECTIONS.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from sparseforge.checks import check_index_tensor
from sparseforge.planner import device_constant, host_fact

# Error bits of the checks done with torch ops (on the device of the index tensors).
ERR_INDEX_RANGE = 1
ERR_DUPLICATE = 2
ERR_INDPTR = 4
ERR_KV_BLOCK_LENS = 8
ERR_Q2K_NUM = 16
ERR_GROUP_SELECTIONS = 32
ERR_STALE_SIZES = 64


@dataclass(frozen=True)
class Selection:
    mask: torch.Tensor  # (Hkv, MB, NB) bool, on the plan's device
    row_sizes: torch.Tensor  # (Hkv, MB) int64 tokens per row block, on the plan's device
    col_sizes: torch.Tensor  # (Hkv, NB)
    host_row_sizes: torch.Tensor  # the same on the host (they fix the kernels' choice)
    host_col_sizes: torch.Tensor
    seq_q: int
    seq_k: int
    errors: torch.Tensor | None  # int32 scalar of ERR_* bits (host or device), None: no checks
    source: str  # the arguments the bits are about, for the error message
    # (size tensor as the caller holds it, int32; its values as plan() read them earlier,
    # int64) pairs, on the plan's device, that must still agree (ERR_STALE_SIZES); checked
    # by the plan (in unit_order's launch, or size_checks_errors)
    size_checks: tuple = ()
    kv_block_lens: torch.Tensor | None = None  # (NB,) int32 on the plan's device
    kv_block_size: int | None = None  # tokens per key block kv_block_lens refers to


def _flag(condition: torch.Tensor, bit: int) -> torch.Tensor:
    """int32 scalar: `bit` when any element of `condition` holds, else 0 (no host sync)."""
    return condition.any().to(torch.int32) * bit


def uniform_sizes(total: int, block: int, device=None) -> torch.Tensor:
    """(ceil(total / block),) int64 sizes of `block`-token blocks, the last one short; built
    on `device` without a host-to-device copy, once per shape on a GPU (read-only:
    planner.device_constant)."""

    def make():
        n = -(-total // block)
        sizes = torch.full((n,), block, device=device, dtype=torch.int64)
        sizes[-1:].fill_(total - block * (n - 1))
        return sizes

    return device_constant(("uniform sizes", total, block), device or "cpu", make)


def uniform_offsets(batch: int, step: int, device) -> torch.Tensor:
    """(batch + 1,) int32 offsets 0, step, ..., batch * step (the cu_seqlens of `batch`
    sequences of `step` tokens), once per shape on a GPU (read-only)."""

    def make():
        return torch.arange(0, (batch + 1) * step, step, dtype=torch.int32, device=device)

    return device_constant(("uniform offsets", batch, step), device, make)


@functools.lru_cache(maxsize=32)
def uniform_host_sizes(total: int, block: int, heads: int) -> torch.Tensor:
    """uniform_sizes on the host for `heads` heads (read-only): one tensor per shape, so that
    plan()'s facts about it (planner.host_fact) are found again on the next call."""
    return uniform_sizes(total, block).expand(heads, -1)


def bsr_block_mask(indptr, indices, num_row_blocks: int, num_col_blocks: int):
    """(1, MB, NB) bool mask of a BSR structure shared by all heads, and its error bits."""
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
        | _flag(per_row[:num_row_blocks] != mask.sum(-1, dtype=torch.int64), ERR_DUPLICATE)
        | _flag(
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
    if q2k_num is None:  # every entry is used (and no used mask is built: plan()'s host time)
        valid = in_range
        errors = _flag(~in_range, ERR_INDEX_RANGE)
    else:
        num = q2k_num.to(device=device, dtype=torch.int64)
        used = torch.arange(topk, device=device) < num.unsqueeze(-1)
        valid = in_range & used
        errors = _flag((num < 0) | (num > topk), ERR_Q2K_NUM) | _flag(
            used & ~in_range, ERR_INDEX_RANGE
        )
    mask = torch.zeros(h, mb, num_col_blocks + 1, device=device, dtype=torch.bool)
    mask.scatter_(2, torch.where(valid, idx, num_col_blocks), True)
    mask = mask[..., :num_col_blocks]
    errors = errors | _flag(
        valid.sum(-1, dtype=torch.int32) != mask.sum(-1, dtype=torch.int32), ERR_DUPLICATE
    )
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


def stale_sizes_errors(sizes: torch.Tensor, values_read: torch.Tensor) -> torch.Tensor:
    """ERR_STALE_SIZES when a size tensor no longer holds the values plan() read earlier."""
    return _flag(sizes != values_read, ERR_STALE_SIZES)


def size_checks_errors(size_checks) -> torch.Tensor | None:
    """ERR_STALE_SIZES when any (size tensor, values read) pair of a Selection's
    size_checks differs, with torch ops; None without pairs."""
    stale = [stale_sizes_errors(now, read) for now, read in size_checks]
    return functools.reduce(combine_errors, stale, None)


def kv_block_lens_errors(kv_block_lens, block: int) -> torch.Tensor:
    """Error bits of kv_block_lens (entries must lie in [1, C]; the planner clamps them)."""
    return _flag((kv_block_lens < 1) | (kv_block_lens > block), ERR_KV_BLOCK_LENS)


def combine_errors(errors, more):
    """The union of two error-bit scalars (either may be None); where one is on the host and
    one on the GPU, on the GPU (a non-blocking copy), so that the GPU's checks are kept."""
    if errors is None or more is None:
        return more if errors is None else errors
    if errors.device != more.device:
        if errors.device.type == "cpu":
            errors = errors.to(more.device, non_blocking=True)
        else:
            more = more.to(errors.device, non_blocking=True)
    return errors | more


def from_bsr_wrapper(
    *,
    indptr,
    indices,
    block_mask,
    q2k_indices,
    q2k_num,
    kv_block_lens,
    M,
    N,
    R,
    C,
    num_qo_heads,
    num_kv_heads,
    device,
    non_blocking,
    mask_of_selections=None,
) -> Selection:
    """The BlockSparseAttentionWrapper's forms: direct selections, a block mask, or BSR
    (in that order of precedence; mixing q2k with the others is an error).
    mask_of_selections: as selection_block_mask (its default), e.g. the GPU kernel's."""
    mb, nb = -(-M // R), -(-N // C)  # the wrapper asks N % C == 0; VSA has a ragged last tile
    group = num_qo_heads // num_kv_heads
    if kv_block_lens is not None:
        check_index_tensor("kv_block_lens", kv_block_lens, (nb,), torch.int32, device)
    if q2k_num is not None and q2k_indices is None:
        raise ValueError("q2k_num is given without q2k_indices")
    if q2k_indices is not None:
        if block_mask is not None or indptr is not None or indices is not None:
            raise ValueError("q2k_indices is mutually exclusive with block_mask and indptr/indices")
        topk = (
            q2k_indices.shape[-1]
            if isinstance(q2k_indices, torch.Tensor) and q2k_indices.dim()
            else 0
        )
        check_index_tensor(
            "q2k_indices", q2k_indices, (num_qo_heads, mb, topk), torch.int32, device
        )
        if q2k_num is not None:
            check_index_tensor(
                "q2k_num", q2k_num, (num_qo_heads, mb), torch.int32, q2k_indices.device
            )
        # GQA: the first query head of each group selects for the group; the others must agree.
        mask, errors = (mask_of_selections or selection_block_mask)(
            q2k_indices[::group], None if q2k_num is None else q2k_num[::group], nb
        )
        if group > 1:
            errors = errors | group_selection_errors(sorted_selections(q2k_indices, q2k_num), group)
        source = "q2k_indices / q2k_num"
    elif block_mask is not None:
        if (
            not isinstance(block_mask, torch.Tensor)
            or block_mask.dtype != torch.bool
            or block_mask.dim() != 3
            or block_mask.shape[0] not in (num_qo_heads, num_kv_heads)
            or tuple(block_mask.shape[1:]) != (mb, nb)
        ):
            got = (
                f"{block_mask.dtype} {tuple(block_mask.shape)}"
                if isinstance(block_mask, torch.Tensor)
                else type(block_mask).__name__
            )
            raise ValueError(
                f"block_mask must be bool of shape ({num_qo_heads} or {num_kv_heads}, {mb}, {nb}), "
                f"got {got}"
            )
        check_index_tensor("block_mask", block_mask, block_mask.shape, torch.bool, device)
        mask, errors, source = block_mask, None, "block_mask"
        if block_mask.shape[0] == num_qo_heads and group > 1:
            mask = block_mask[::group]
            errors = group_selection_errors(block_mask, group)
    else:
        if indptr is None or indices is None:
            raise ValueError("give indptr and indices, or block_mask, or q2k_indices")
        check_index_tensor("indptr", indptr, (mb + 1,), torch.int32, device)
        numel = indices.numel() if isinstance(indices, torch.Tensor) else 0
        check_index_tensor("indices", indices, (numel,), torch.int32, indptr.device)
        mask, errors = bsr_block_mask(indptr, indices, mb, nb)
        mask = mask.expand(num_kv_heads, -1, -1)
        source = "indptr / indices"
    if kv_block_lens is not None:
        errors = combine_errors(errors, kv_block_lens_errors(kv_block_lens, C))
        source += " / kv_block_lens"
        kv_block_lens = kv_block_lens.to(device, non_blocking=non_blocking)
    return Selection(
        mask=mask.to(device, non_blocking=non_blocking),
        row_sizes=uniform_sizes(M, R, device).expand(num_kv_heads, -1),
        col_sizes=uniform_sizes(N, C, device).expand(num_kv_heads, -1),
        host_row_sizes=uniform_host_sizes(M, R, num_kv_heads),
        host_col_sizes=uniform_host_sizes(N, C, num_kv_heads),
        seq_q=M,
        seq_k=N,
        errors=errors,
        source=source,
        kv_block_lens=kv_block_lens,
        kv_block_size=C,
    )


def from_block_mask_map(
    *,
    block_mask_map,
    block_row_sz,
    block_col_sz,
    host_rows,
    host_cols,
    size_checks=(),
    num_kv_heads,
    device,
    non_blocking,
) -> Selection:
    """The VariableBlockSparseAttentionWrapper's form; host_rows / host_cols are the host
    values of the size tensors (the caller reads them once and caches them), `size_checks`
    the (tensor, values read) pairs whose agreement the plan checks (Selection)."""

    def lengths(sizes):  # (least block size, each head's total), asked once per tensor
        return host_fact(sizes, "lengths", lambda: (int(sizes.min()), sizes.sum(-1).tolist()))

    (least_row, seq_q), (least_col, seq_k) = lengths(host_rows), lengths(host_cols)
    if least_row < 1 or least_col < 1:
        raise ValueError("block_row_sz and block_col_sz must be >= 1")
    if len(set(seq_q)) > 1 or len(set(seq_k)) > 1:
        raise ValueError(
            "every kv head's block_row_sz (and block_col_sz) must sum to the same length, got "
            f"{seq_q} and {seq_k}"
        )
    return Selection(
        mask=block_mask_map.to(device, non_blocking=non_blocking),
        row_sizes=block_row_sz.to(device, torch.int64, non_blocking=non_blocking),
        col_sizes=block_col_sz.to(device, torch.int64, non_blocking=non_blocking),
        host_row_sizes=host_rows,
        host_col_sizes=host_cols,
        seq_q=seq_q[0],
        seq_k=seq_k[0],
        errors=None,
        size_checks=tuple(size_checks),
        source="block_mask_map / block_row_sz / block_col_sz",
    )
