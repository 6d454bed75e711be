"""Token-sparse attention inputs, call-compatible with `flashinfer.token_sparse`.

    token_sparse_kv_indices   each token's key positions as paged-cache slot lists, for
                              decode kernels that read one slot per key
    group_union_masks         for groups of consecutive tokens, the union of their keys as
                              slots and each token's bitmask over it, for masked dense
                              attention

Rules both share: every tensor is int32, contiguous and on one CUDA device; K, the
positions per token, is a multiple of 512; pages hold 64 keys, so key k of a request is at
slot block_table[request, k // 64] * 64 + k % 64. Each call is one launch on the current
stream with no host synchronisation (CUDA-graph capturable) and writes its outputs in
place. Index values (positions, table rows, output rows) are not bounds-checked on the GPU:
out-of-range values read or write out of bounds, as in the reference. Kernels:
generator/kernels/portable/{token_sparse_kv_indices,group_union_masks}.py; PyTorch
references: sparseforge.reference.
"""

from __future__ import annotations

import torch

from sparseforge import ops
from sparseforge.checks import check_writable, positive_int
from sparseforge.families import token_sparse


def token_sparse_kv_indices(
    positions, requests, block_table, *, block_tables, seq_lens, requests_per_token: int = 1
):
    """positions (T, K): each token's key positions, the valid ones (>= 0) first, then -1;
    requests (>= T,): each token's block_table row; block_table (R, B >= 1): page ids.

    Writes block_tables (>= T rpt, 2, K): row t rpt + j (j < rpt = requests_per_token) gets
    token t's K slots in plane 0 and the same V slots in plane 1, in input order, -1 where
    the position is negative (rows past T rpt untouched); seq_lens (>= T rpt,): the token's
    count of positions >= 0. Each token becomes rpt consecutive attention requests (one per
    group of its query heads: reshape q (T, H, D) to (T rpt, H / rpt, D)).
    Returns (block_tables, seq_lens)."""
    rpt = positive_int("requests_per_token", requests_per_token)
    device = _check_int32("positions", positions, 2)
    t, k = positions.shape
    _check_positions_per_token(k)
    for name, tensor, dims in (
        ("requests", requests, 1),
        ("block_table", block_table, 2),
        ("block_tables", block_tables, 3),
        ("seq_lens", seq_lens, 1),
    ):
        _check_int32(name, tensor, dims, device)
    if requests.shape[0] < t:
        raise ValueError(f"requests has {requests.shape[0]} entries, fewer than the {t} tokens")
    if 0 in block_table.shape:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}: it is empty")
    rows = t * rpt
    if block_tables.shape[0] < rows or tuple(block_tables.shape[1:]) != (2, k):
        raise ValueError(
            f"block_tables has shape {tuple(block_tables.shape)}, expected (>= {rows}, 2, {k}): "
            f"{t} tokens x requests_per_token {rpt} rows of K and V slots"
        )
    if seq_lens.shape[0] < rows:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, fewer than the {rows} rows")
    _check_outputs(
        (("block_tables", block_tables), ("seq_lens", seq_lens)),
        (("positions", positions), ("requests", requests), ("block_table", block_table)),
    )
    _check_cuda(device)
    if t:
        launch = token_sparse.kv_indices_launch(device.index, rpt)
        with torch.cuda.device(device):
            ops.launch(launch, (positions, requests, block_table, block_tables, seq_lens))
    return block_tables, seq_lens


def group_union_masks(
    positions,
    query_rows,
    group_unions,
    requests,
    block_table,
    *,
    union,
    union_sizes,
    mask,
    num_keys: int,
):
    """Tokens form G = len(requests) groups of n = T / G consecutive tokens.
    positions (T, K): key positions, those outside [0, num_keys) ignored; query_rows (T,):
    each token's mask row; group_unions (G,): each group's union row; requests (G,): each
    group's block_table row; -1 in query_rows or group_unions means "do not write".

    Writes union[b, :U]: the cache slots of group g's U distinct keys, ascending by key
    (b = group_unions[g]), and union_sizes[b] = U; mask[query_rows[t]]: int32 words, bit j
    of word w set iff token t selected union column 32 w + j; only the words of whole
    128-column tiles, w < 4 ceil(U / 128), are written. Capacity: union's rows and
    32 x mask's words each hold at least min(n K, 128 ceil(num_keys / 128)) columns.
    num_keys <= 64 x block_table's columns and <= 262144 (one bit per key in shared memory).
    Returns (union, union_sizes, mask)."""
    device = _check_int32("positions", positions, 2)
    t, k = positions.shape
    _check_positions_per_token(k)
    for name, tensor, dims in (
        ("query_rows", query_rows, 1),
        ("group_unions", group_unions, 1),
        ("requests", requests, 1),
        ("block_table", block_table, 2),
        ("union", union, 2),
        ("union_sizes", union_sizes, 1),
        ("mask", mask, 2),
    ):
        _check_int32(name, tensor, dims, device)
    groups = requests.shape[0]
    if (groups == 0 and t) or (groups and t % groups):
        raise ValueError(
            f"positions has {t} tokens, not a whole number of groups of the {groups} requests "
            "(T = G n is required)"
        )
    if query_rows.shape[0] != t:
        raise ValueError(
            f"query_rows has {query_rows.shape[0]} entries, expected {t} (one a token)"
        )
    if group_unions.shape[0] != groups:
        raise ValueError(
            f"group_unions has {group_unions.shape[0]} entries, expected {groups} (one a group)"
        )
    if 0 in block_table.shape:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}: it is empty")
    positive_int("num_keys", num_keys)
    page_keys = token_sparse.constant("page_keys")
    if num_keys > page_keys * block_table.shape[1]:
        raise ValueError(
            f"num_keys {num_keys} exceeds the block table's {block_table.shape[1]} pages of "
            f"{page_keys} keys"
        )
    limit = token_sparse.constant("max_union_keys")
    if num_keys > limit:
        raise ValueError(
            f"num_keys {num_keys} exceeds {limit}, the keys one group's shared-memory key set holds"
        )
    tile = token_sparse.constant("mask_tile")
    columns = min(t // max(groups, 1) * k, tile * -(-num_keys // tile))
    if union.shape[1] < columns:
        raise ValueError(f"union rows hold {union.shape[1]} columns; at least {columns} needed")
    if 32 * mask.shape[1] < columns:
        raise ValueError(
            f"mask rows hold {mask.shape[1]} words ({32 * mask.shape[1]} columns); at least "
            f"{-(-columns // 32)} words needed"
        )
    _check_outputs(
        (("union", union), ("union_sizes", union_sizes), ("mask", mask)),
        (
            ("positions", positions),
            ("query_rows", query_rows),
            ("group_unions", group_unions),
            ("requests", requests),
            ("block_table", block_table),
        ),
    )
    _check_cuda(device)
    if t:
        launch = token_sparse.group_union_launch(device.index, num_keys)
        with torch.cuda.device(device):
            ops.launch(
                launch,
                (
                    positions,
                    query_rows,
                    group_unions,
                    requests,
                    block_table,
                    union,
                    union_sizes,
                    mask,
                ),
            )
    return union, union_sizes, mask


def _check_int32(name: str, t, dims: int, device=None) -> torch.device:
    """int32, `dims` dimensions, contiguous, on `device` (that of positions)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} has dtype {t.dtype}, expected torch.int32")
    if t.dim() != dims:
        raise ValueError(f"{name} has {t.dim()} dimensions ({tuple(t.shape)}), expected {dims}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (that of positions)")
    return t.device


def _check_outputs(outputs, inputs) -> None:
    """Each output apart from every input and from the outputs before it."""
    for i, (name, tensor) in enumerate(outputs):
        check_writable(name, tensor, (*inputs, *outputs[:i]))


def _check_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"the tensors are on {device}; token_sparse kernels need a CUDA device")


def _check_positions_per_token(k: int) -> None:
    multiple = token_sparse.constant("positions_multiple")
    if k == 0 or k % multiple:
        raise ValueError(
            f"positions has {k} per token; K must be a positive multiple of {multiple}"
        )
