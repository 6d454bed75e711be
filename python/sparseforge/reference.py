"""Plain PyTorch implementations of what the kernels compute. Slow, simple, any device.

The tests compare every kernel with these (in fp32 or fp64), and the block sizes our
kernels do not cover run through them (documented in the wrappers). Layout here is HND:
q (Hq, Sq, D), k and v (Hkv, Sk, D).
"""

from __future__ import annotations

import math

import torch

from sparseforge.families import sage_fp8_fwd, sage_quantize, token_sparse
from sparseforge.planner import tile_padded_keys, tile_padded_scales
from sparseforge.sage import SageFP8Tensors


def attention(
    q, k, v, mask=None, sm_scale=None, compute_dtype=None, logits_soft_cap=None,
    alibi_slopes=None,
):  # fmt: skip
    """Masked softmax attention with GQA; returns (out (Hq, Sq, D), lse (Hq, Sq)).

    mask: bool, broadcastable per head to (Hq, Sq, Sk); a (Hkv, Sq, Sk) mask is shared by
    the query heads of each group. Rows that attend to no key give out 0 and lse -inf.
    The logits are sm_scale * q.k, then, with logits_soft_cap > 0, cap * tanh(logits / cap),
    then plus alibi_slopes[h] * (key position - query position) with alibi_slopes (Hq,)
    (query i at position i + Sk - Sq: the two sequences end together). lse is the
    natural-log log-sum-exp of the final logits.
    """
    hq, hkv = q.shape[0], k.shape[0]
    if hq % hkv:
        raise ValueError(f"num_qo_heads {hq} is not a multiple of num_kv_heads {hkv}")
    group = hq // hkv
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.device.type == "cpu" else torch.float32
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    qc = q.to(compute_dtype)
    kc = k.to(compute_dtype).repeat_interleave(group, dim=0)
    vc = v.to(compute_dtype).repeat_interleave(group, dim=0)
    logits = torch.matmul(qc, kc.transpose(-1, -2)) * scale
    if logits_soft_cap:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    if alibi_slopes is not None:
        distance = key_minus_query_positions(q.shape[1], k.shape[1], q.device)
        logits = logits + alibi_slopes.to(q.device, compute_dtype)[:, None, None] * distance
    if mask is not None:
        mask = mask.to(q.device)
        if mask.dim() == 3 and mask.shape[0] == hkv and hkv != hq:
            mask = mask.repeat_interleave(group, dim=0)
        logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse.unsqueeze(-1).clamp_min(torch.finfo(compute_dtype).min))
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.matmul(probs, vc)
    return out, lse


def key_minus_query_positions(seq_q: int, seq_k: int, device=None) -> torch.Tensor:
    """(Sq, Sk) int64: key position j minus query position i + Sk - Sq (the query and key
    sequences end together, as FlashInfer aligns them when Sq != Sk)."""
    query = torch.arange(seq_q, device=device) + (seq_k - seq_q)
    return torch.arange(seq_k, device=device)[None, :] - query[:, None]


def causal_mask(seq_q: int, seq_k: int, device=None) -> torch.Tensor:
    """(Sq, Sk) bool: query i sees key j when j <= i + Sk - Sq (bottom-right aligned)."""
    return key_minus_query_positions(seq_q, seq_k, device) <= 0


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """(num_heads,) fp32 ALiBi slopes as FlashInfer defines them: for n, the largest power of
    two <= num_heads, 2^(-8 i / n) for i = 1..n, then for the heads beyond n,
    2^(-4 j / n) for odd j = 1, 3, ..."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    slopes += [2.0 ** (-4.0 * j / n) for j in range(1, 2 * (num_heads - n), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def rope_llama(x, positions, rope_scale: float = 1.0, rope_theta: float = 1e4):
    """LLaMA-style rotary embedding of x (H, S, D) at positions (S,), in fp32 or wider
    (x's own dtype if wider): channel i < D / 2 pairs with i + D / 2, rotated by the angle
    positions / rope_scale * rope_theta^(-2i / D)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    half = x.shape[-1] // 2
    frequencies = rope_theta ** (
        -torch.arange(half, dtype=dtype, device=x.device) * 2 / x.shape[-1]
    )
    angles = positions.to(x.device, dtype)[:, None] / rope_scale * frequencies[None, :]
    cos, sin = torch.cos(angles), torch.sin(angles)
    first, second = x.to(dtype)[..., :half], x.to(dtype)[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def unpack_bits(packed, count: int) -> torch.Tensor:
    """The first `count` bits of a uint8 tensor as bools, little-endian within each byte
    (flashinfer.quantization.packbits(x, bitorder="little") inverted)."""
    bits = (packed.to(torch.int32)[:, None] >> torch.arange(8, device=packed.device)) & 1
    return bits.flatten()[:count].bool()


def bsr_element_mask(indptr, indices, mask, seq_q: int, seq_k: int, R: int, C: int):
    """(Sq, Sk) bool of a BSR matrix's per-element masks: mask (nnz, R, C) is the mask of
    the nnz-th stored block (row block r for indptr[r] <= nnz < indptr[r + 1], column
    block indices[nnz]); rows past Sq in the last row block are dropped. Unstored blocks
    are False."""
    indptr = indptr.to(torch.int64).cpu()
    row_blocks = indptr.numel() - 1
    rows = torch.repeat_interleave(torch.arange(row_blocks), indptr[1:] - indptr[:-1])
    out = torch.zeros(row_blocks, R, seq_k // C, C, dtype=torch.bool)
    out[rows, :, indices.to(torch.int64).cpu(), :] = mask.to(torch.bool).cpu()
    return out.view(row_blocks * R, seq_k)[:seq_q]


def bsr_to_block_mask(indptr, indices, num_row_blocks: int, num_col_blocks: int):
    """(MB, NB) bool mask of a block-sparse row (BSR) structure."""
    indptr = indptr.to(torch.int64).cpu()
    indices = indices.to(torch.int64).cpu()
    rows = torch.repeat_interleave(torch.arange(num_row_blocks), indptr[1:] - indptr[:-1])
    mask = torch.zeros(num_row_blocks, num_col_blocks, dtype=torch.bool)
    mask[rows, indices] = True
    return mask


def selections_to_block_mask(q2k_indices, q2k_num, num_col_blocks: int):
    """(H, MB, NB) bool mask of direct per-head selections (H, MB, topk) with counts."""
    h, mb, topk = q2k_indices.shape
    idx = q2k_indices.to(torch.int64).cpu()
    num = torch.full((h, mb), topk) if q2k_num is None else q2k_num.to(torch.int64).cpu()
    valid = torch.arange(topk) < num.unsqueeze(-1)
    mask = torch.zeros(h, mb, num_col_blocks + 1, dtype=torch.bool)
    mask.scatter_(2, torch.where(valid, idx, num_col_blocks), True)
    return mask[..., :num_col_blocks]


def block_mask_to_token_mask(block_mask, row_sizes, col_sizes, col_valid=None):
    """(H, Sq, Sk) token mask of a per-head block mask (H, MB, NB).

    row_sizes (H, MB) / col_sizes (H, NB): tokens per block (1-D sizes are shared by all
    heads). col_valid (NB,): valid leading tokens of each key block (kv_block_lens).
    """
    block_mask = block_mask.cpu()
    h, mb, nb = block_mask.shape
    row_sizes = torch.as_tensor(row_sizes).to(torch.int64).cpu().expand(h, mb)
    col_sizes = torch.as_tensor(col_sizes).to(torch.int64).cpu().expand(h, nb)
    masks = []
    for head in range(h):
        rows = torch.repeat_interleave(block_mask[head], row_sizes[head], dim=0)
        tokens = torch.repeat_interleave(rows, col_sizes[head], dim=1)
        if col_valid is not None:
            offset = torch.cat([torch.arange(int(n)) for n in col_sizes[head]])
            limit = torch.repeat_interleave(torch.as_tensor(col_valid).cpu(), col_sizes[head])
            tokens &= offset < limit
        masks.append(tokens)
    return torch.stack(masks)


def uniform_sizes(total: int, block: int):
    """Block sizes of `total` tokens cut into `block`-token blocks (the last may be short)."""
    n = -(-total // block)
    sizes = torch.full((n,), block, dtype=torch.int64)
    sizes[-1] = total - block * (n - 1)
    return sizes


FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def sage_dequantize(q8, k8, v8, q_scale, k_scale, v_scale, dtype=torch.float32):
    """fp32 q, k, v (HND) of Sage FP8 tensors: q8 (Hq, Sq, D) * q_scale (1, Hq, Sq) per token,
    k8 (Hkv, Sk, D) * k_scale (1, Hkv, ceil(Sk / 16)) per 16 keys, v8 * v_scale (Hkv, D) per
    channel."""
    sk = k8.shape[1]
    per_scale = sage_quantize.constant("keys_per_scale")
    q = q8.to(dtype) * q_scale[0].to(dtype).unsqueeze(-1)
    k = k8.to(dtype) * k_scale[0].to(dtype).repeat_interleave(per_scale, dim=-1)[:, :sk].unsqueeze(
        -1
    )
    v = v8.to(dtype) * v_scale.to(dtype).unsqueeze(1)
    return q, k, v


def scale_step_factors(step, device=None):
    """fp32 (grow, shrink) of candidate(s) `step` (an int or an int tensor): (16 + c) / 16,
    exact, and fl32(16 / (16 + c)) by an IEEE tensor division, as the kernels."""
    steps = torch.as_tensor(step, dtype=torch.float32, device=device) + 16.0
    return steps / 16.0, torch.full_like(steps, 16.0) / steps


def finite(x):
    """x with its non-finite elements (NaN, +-inf) as 0: what the quantizer's amaxes, sums
    and scale search are taken over."""
    return torch.where(torch.isfinite(x), x, 0.0)


def fp8_quantize(x, amax, step=0):
    """(float8_e4m3fn codes, fp32 scale) of fp32 x for its amax (broadcastable to x) and scale
    candidate `step` (an int, or an int tensor broadcastable to amax): a = max(amax, amax_min),
    scale = (a / 448) * grow, codes = e4m3((x * ((448 / a) * shrink))) saturated to +-448,
    NaN where x is not finite, (grow, shrink) = scale_step_factors(step). Step 0 has
    grow = shrink = 1: the amax scale.

    The same fp32 operations in the same order as the quantizer kernels
    (generator/kernels/sage_quantize.py), so codes and scales agree bit for bit. 448 is a
    tensor, not a Python number: torch's CUDA division by a host scalar multiplies by its
    reciprocal instead, which rounds differently.
    """
    a = amax.float().clamp_min(sage_quantize.constant("amax_min"))
    fp8_max = torch.tensor(FP8_MAX, device=x.device)
    grow, shrink = scale_step_factors(step, x.device)
    y = torch.where(torch.isfinite(x), x * ((fp8_max / a) * shrink), torch.nan)
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), (a / fp8_max) * grow


def scale_step_errors(x, amax, dims):
    """(..., scale_steps) fp64: per set (the elements of x along `dims`), the search criterion
    of every candidate: sum over the set of (y - e4m3(y))^2 * grow^2 with y = x * inverse
    scale, i.e. the squared rounding error in units of (amax / 448)^2 (the kernels sum it
    in fp32, in their own order). Non-finite elements count as 0."""
    x = finite(x)
    inverse = torch.tensor(FP8_MAX, device=x.device) / amax.float().clamp_min(
        sage_quantize.constant("amax_min")
    )
    errors = []
    for c in range(sage_quantize.constant("scale_steps")):
        grow, shrink = scale_step_factors(c, x.device)
        y = x * (inverse * shrink)
        rounded = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        errors.append(((y - rounded).double() ** 2).sum(dims, keepdim=True) * grow.double() ** 2)
    return torch.stack(errors, -1)


def fp8_quantize_searched(x, amax, dims, search=True):
    """fp8_quantize with, per set (the elements of x along `dims`), the candidate of smallest
    scale_step_errors (the first of equals); step 0 for all without `search`."""
    if not search:
        return fp8_quantize(x, amax)
    return fp8_quantize(x, amax, scale_step_errors(x, amax, dims).argmin(-1))


def sage_scale_sets(q, k, smooth_k=True, k_mean=None):
    """The sets of Sage quantization that get one searched scale each, as fp32 with their
    amax (keepdim, over their finite elements): q rows (Hq, Sq, D) and 16-token groups of
    k - k_mean (Hkv, G, 16, D), zero past Sk; and the k_mean used (None without smoothing;
    the mean of k's finite elements, the others counted as 0). k_mean as in
    sage_fp8_quantize."""
    hkv, sk, d = k.shape
    per_scale = sage_quantize.constant("keys_per_scale")
    groups = -(-sk // per_scale)
    qf, kf = q.float(), k.float()
    if smooth_k:
        if k_mean is None:
            k_mean = finite(kf).double().mean(1).float()
        kf = kf - k_mean.unsqueeze(1)
    else:
        k_mean = None
    # Zeros pad the last group: they raise no max, add no rounding error and are cut off.
    kg = torch.nn.functional.pad(kf, (0, 0, 0, groups * per_scale - sk))
    kg = kg.view(hkv, groups, per_scale, d)
    return (
        (qf, finite(qf).abs().amax(-1, keepdim=True)),
        (kg, finite(kg).abs().amax(dim=(2, 3), keepdim=True)),
        k_mean,
    )


def sage_fp8_quantize(q, k, v, smooth_k=True, k_mean=None, scale_search=True):
    """sparseforge.sage_fp8_quantize in torch (HND inputs, any device); same outputs and
    layouts (SageFP8Tensors, contract in sparseforge/sage.py).

    k_mean (Hkv, D) fp32: smooth with this mean instead of computing one. The kernel sums
    in another order, so its k_mean differs from torch's in the last bits; passed here, it
    makes every code and scale equal to the kernel's (without scale_search; with it, up to
    the near-ties of the search's fp32 sums: tests/test_sage_quantize.py).
    """
    hq, sq, d = q.shape
    hkv, sk, _ = k.shape
    per_scale, tile = sage_quantize.constant("keys_per_scale"), sage_fp8_fwd.constant("tile_keys")
    groups = -(-sk // per_scale)
    pad = groups * per_scale
    (qf, q_amax), (kg, k_amax), k_mean = sage_scale_sets(q, k, smooth_k, k_mean)
    q8, q_scale = fp8_quantize_searched(qf, q_amax, -1, scale_search)
    k8, k_scale = fp8_quantize_searched(kg, k_amax, (2, 3), scale_search)
    k_scale_buffer = tile_padded_scales(hkv, sk, per_scale, tile, k.device)
    k_scale_buffer[0, :, :groups] = k_scale.view(hkv, groups)
    k_buffer = tile_padded_keys(hkv, sk, d, torch.float8_e4m3fn, k.device, tile)
    k_buffer[:, :sk] = k8.view(hkv, pad, d)[:, :sk]
    vf = v.float()
    v8, v_scale = fp8_quantize(vf, finite(vf).abs().amax(1, keepdim=True))
    vt = torch.zeros(hkv, d, pad, dtype=torch.float8_e4m3fn, device=v.device)
    vt[:, :, :sk] = v8.transpose(1, 2)
    return SageFP8Tensors(
        q=q8,
        k=k_buffer[:, :sk],
        v=vt.transpose(1, 2)[:, :sk],
        q_scale=q_scale.view(1, hq, sq),
        k_scale=k_scale_buffer[:, :, :groups],
        v_scale=v_scale.view(hkv, d),
        k_mean=k_mean,
    )


# --- video sparse attention (sparseforge/vsa.py): the recipe's coarse stage --------------

VSA_TILE = 64  # tokens per tile: the block of the fine attention


def tile_means(x: torch.Tensor, tile: int = VSA_TILE) -> torch.Tensor:
    """(..., S, D) -> (..., ceil(S / tile), D): the mean over each tile's tokens, in fp32
    (the last tile averages only the tokens it has). The sums read x as it is (fp32
    accumulation, no fp32 copy of x): a full-size fp32 copy and its padding cost the VSA call
    ~2 ms at S = 32768 with 32 heads."""
    s = x.shape[-2]
    whole = s // tile
    parts = []
    if whole:
        tiles = x[..., : whole * tile, :].unflatten(-2, (whole, tile))
        parts.append(tiles.sum(-2, dtype=torch.float32) / tile)
    if whole * tile < s:
        rest = x[..., whole * tile :, :]
        parts.append(rest.sum(-2, keepdim=True, dtype=torch.float32) / (s - whole * tile))
    return parts[0] if len(parts) == 1 else torch.cat(parts, -2)


def coarse_logits(q_tiles, k_tiles, sm_scale: float):
    """(B, Hq, T, T) scaled logits between query tiles and key tiles (GQA: kv tiles repeated)."""
    group = q_tiles.shape[1] // k_tiles.shape[1]
    return q_tiles @ k_tiles.repeat_interleave(group, 1).transpose(-1, -2) * sm_scale


def select_tiles(logits: torch.Tensor, num_kv_heads: int, topk: int) -> torch.Tensor:
    """(B, Hkv, T, topk) int64 key tiles per (batch, kv head, query tile): the top-k of the
    group's mean coarse logits, in torch.topk's order (which of two equal logits wins is
    torch's choice)."""
    b, hq, t, _ = logits.shape
    grouped = logits.unflatten(1, (num_kv_heads, hq // num_kv_heads)).mean(2)
    return grouped.topk(min(topk, t), dim=-1).indices


def video_sparse_attention(q, k, v, *, topk, sm_scale=None, gate=None):
    """sparseforge.video_sparse_attention with the fine attention computed by attention() on
    the token mask of the selected tiles (the pooling, logits and top-k above are the
    recipe's own, shared with it). q, k, v as there; fp64 on the CPU, fp32 on a GPU."""
    batched = q.dim() == 4
    if not batched:
        q, k, v = q[None], k[None], v[None]
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    q_tiles, k_tiles, v_tiles = tile_means(q), tile_means(k), tile_means(v)
    logits = coarse_logits(q_tiles, k_tiles, scale)
    selected = select_tiles(logits, hkv, topk).cpu()  # (B, Hkv, T, k)
    tiles = selected.shape[2]
    blocks = torch.zeros(b, hkv, tiles, tiles, dtype=torch.bool)
    blocks.scatter_(-1, selected, True)
    sizes = uniform_sizes(s, VSA_TILE)
    mask = block_mask_to_token_mask(blocks.flatten(0, 1), sizes, sizes)
    out, _ = attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), mask, scale)
    out = out.unflatten(0, (b, hq))
    if gate is not None:
        coarse = torch.softmax(logits, -1) @ v_tiles.repeat_interleave(hq // hkv, 1)
        out = out + gate * coarse.repeat_interleave(sizes.to(coarse.device), dim=2)
    return out if batched else out[0]


def _slots(block_table, request_rows, keys):
    """Cache slots of `keys` (any shape, >= 0) of the block-table rows `request_rows`
    (broadcast against keys)."""
    page_keys = token_sparse.constant("page_keys")
    pages = block_table[request_rows.long(), keys.long() // page_keys].long()
    return pages * page_keys + keys.long() % page_keys


def token_sparse_kv_indices(
    positions, requests, block_table, *, block_tables, seq_lens, requests_per_token=1
):
    """sparseforge.token_sparse.token_sparse_kv_indices, on any device."""
    t = positions.shape[0]
    valid = positions >= 0
    slots = _slots(block_table, requests[:t, None], positions.clamp_min(0))
    slots = torch.where(valid, slots, -1).to(torch.int32)
    rows = t * requests_per_token
    block_tables[:rows, 0] = slots.repeat_interleave(requests_per_token, 0)
    block_tables[:rows, 1] = block_tables[:rows, 0]
    seq_lens[:rows] = valid.sum(1, dtype=torch.int32).repeat_interleave(requests_per_token, 0)
    return block_tables, seq_lens


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(..., 32 W) bool -> (..., W) int32 words, bit j of word w = bits[..., 32 w + j]."""
    weights = torch.ones(32, dtype=torch.int64, device=bits.device) << torch.arange(
        32, device=bits.device
    )
    words = (bits.unflatten(-1, (-1, 32)).long() * weights).sum(-1)
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


def group_union_masks(
    positions, query_rows, group_unions, requests, block_table, *, union, union_sizes, mask,
    num_keys,
):  # fmt: skip
    """sparseforge.token_sparse.group_union_masks, on any device (a loop over groups)."""
    tile = token_sparse.constant("mask_tile")
    groups = requests.shape[0]
    n = positions.shape[0] // groups if groups else 0
    for g in range(groups):
        pos = positions[g * n : (g + 1) * n].long()
        inside = (pos >= 0) & (pos < num_keys)
        keys = torch.unique(pos[inside])  # sorted
        union_row = int(group_unions[g])
        if union_row >= 0:
            union[union_row, : keys.numel()] = _slots(block_table, requests[g], keys).int()
            union_sizes[union_row] = keys.numel()
        words = -(-keys.numel() // tile) * tile // 32
        rows = [int(r) for r in query_rows[g * n : (g + 1) * n]]
        for row in rows:
            if row >= 0:
                mask[row, :words] = 0
        for i, row in enumerate(rows):  # OR: tokens that share a mask row share its bits
            if row >= 0:
                bits = torch.zeros(32 * words, dtype=torch.bool, device=positions.device)
                bits[torch.searchsorted(keys, pos[i][inside[i]])] = True
                mask[row, :words] |= pack_bits(bits)
    return union, union_sizes, mask


def msa_topk_select(
    max_score, topk=16, num_valid_pages=None, force_begin_blocks=0, force_end_blocks=0
):
    """sparseforge.msa_ops.msa_topk_select, on any device: (S, Hq, topk) int32."""
    heads, blocks, tokens = max_score.shape
    device = max_score.device
    if num_valid_pages is None or isinstance(num_valid_pages, int):
        nvp = torch.full((tokens,), blocks if num_valid_pages is None else num_valid_pages)
    else:
        nvp = num_valid_pages.long().clamp(0, blocks)
    nvp = nvp.to(device)
    score = max_score.float().permute(2, 0, 1)  # (S, Hq, P)
    score = score.masked_fill(score.isnan(), -math.inf)
    block = torch.arange(blocks, device=device)
    begin_end = nvp.clamp(max=force_begin_blocks)[:, None]
    end_start = torch.maximum(nvp[:, None] - force_end_blocks, begin_end)
    forced = (block < begin_end) | ((block >= end_start) & (block < nvp[:, None]))
    middle = (block >= begin_end) & (block < end_start)
    keep = topk - force_begin_blocks - force_end_blocks
    # Stable descending sort: equal scores keep ascending ids.
    order = torch.sort(
        score.masked_fill(~middle[:, None], -math.inf), dim=-1, descending=True, stable=True
    )
    chosen = order.indices[..., :keep]
    chosen_score = order.values[..., :keep]
    selected = torch.zeros(tokens, heads, blocks, dtype=torch.bool, device=device)
    selected |= forced[:, None] & (score > -math.inf)
    selected |= torch.zeros_like(selected).scatter(-1, chosen, chosen_score > -math.inf)
    ids = torch.where(selected, block, blocks).sort(-1).values[..., :topk]
    ids = torch.nn.functional.pad(ids, (0, topk - ids.shape[-1]), value=blocks)  # P < topk
    return torch.where(ids < blocks, ids, -1).to(torch.int32)


MSA_BLOCK = 128  # keys per block = tokens per page of the MSA K cache


def msa_proxy_score(
    q, k, cu_seqlens_q, cu_seqlens_k=None, *, page_table=None, seqused_k=None, causal=True,
    max_k_tiles=None, reduce_heads=False, q_offset=None,
):  # fmt: skip
    """flashinfer.msa_ops.msa_proxy_score in fp64 (any device): fp32 (Hq, tiles, total_q),
    per 128-key block the max of the unscaled q.k over the keys the query sees (key < its
    sequence's length; with causal, position <= q_offset[b] + i, q_offset defaulting to
    seqlen_k - seqlen_q), -inf for a block it sees none of. q (total_q, Hq, D); k flat
    (total_k, Hkv, D) with cu_seqlens_k, or paged (pages, Hkv, 128, D) with page_table
    (B, max pages) and seqused_k (B,); a block whose page id lies outside the cache gets
    -inf. reduce_heads: the max over heads, (1, tiles, total_q)."""
    total_q, hq, _ = q.shape
    batch = cu_seqlens_q.numel() - 1
    hkv = k.shape[1]
    lengths = _msa_lengths(batch, cu_seqlens_k, seqused_k)
    if max_k_tiles is None:
        max_k_tiles = -(-max(lengths, default=0) // MSA_BLOCK)
    out = torch.full((hq, max_k_tiles, total_q), -math.inf, dtype=torch.float64, device=q.device)
    for b in range(batch):
        q0, q1, sk = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), lengths[b]
        keys = _msa_sequence(k, b, sk, cu_seqlens_k, page_table)
        keys = keys.double().repeat_interleave(hq // hkv, 1)
        logits = torch.einsum("ihd,jhd->hij", q[q0:q1].double(), keys)  # (Hq, sq, sk)
        if causal:
            offset = sk - (q1 - q0) if q_offset is None else int(q_offset[b])
            pos = offset + torch.arange(q1 - q0, device=q.device)
            visible = torch.arange(sk, device=q.device)[None, :] <= pos[:, None]
            logits = logits.masked_fill(~visible, -math.inf)
        tiles = min(-(-sk // MSA_BLOCK), max_k_tiles)
        padded = torch.nn.functional.pad(logits, (0, tiles * MSA_BLOCK - sk), value=-math.inf)
        block_max = padded[..., : tiles * MSA_BLOCK].unflatten(-1, (tiles, MSA_BLOCK)).amax(-1)
        if page_table is not None:  # blocks whose page id lies outside the cache: -inf
            ids = page_table[b, :tiles].long().to(q.device)
            block_max[:, :, (ids < 0) | (ids >= k.shape[0])] = -math.inf
        out[:, :tiles, q0:q1] = block_max.transpose(1, 2)
    if reduce_heads:
        out = out.amax(0, keepdim=True)
    return out.float()


def _msa_lengths(batch: int, cu_seqlens_k, seqused_k) -> list[int]:
    """Each sequence's key count: seqused_k (paged) or from cu_seqlens_k (flat)."""
    if seqused_k is not None:
        return [int(seqused_k[b]) for b in range(batch)]
    return [int(cu_seqlens_k[b + 1] - cu_seqlens_k[b]) for b in range(batch)]


def _msa_sequence(x, b: int, length: int, cu_seqlens_k, page_table):
    """(length, Hkv, D): sequence b's keys (or values) from a flat (total_k, Hkv, D) tensor
    with cu_seqlens_k, or from paged (pages, Hkv, 128, D) with page_table."""
    if page_table is not None:
        # (Page ids outside the cache read page 0 or the last: callers skip those blocks.)
        pages = page_table[b, : -(-length // MSA_BLOCK)].long().clamp(0, x.shape[0] - 1)
        return x[pages].permute(0, 2, 1, 3).flatten(0, 1)[:length]
    start = int(cu_seqlens_k[b])
    return x[start : start + length]


def msa_sparse_attention(
    q, k, v, q2k_indices, cu_seqlens_q, cu_seqlens_k=None, *, causal=False,
    softmax_scale=None, page_table=None, seqused_k=None, q_offset=None,
    v_global_scale=1.0, lse_temperature_scale=1.0,
):  # fmt: skip
    """flashinfer.msa_ops.msa_sparse_attention in fp64 (any device), on K/V given as values
    (dequantize FP8 or NVFP4 first: nvfp4_unpack_pages). Returns fp32 (out (total_q, Hq, D),
    lse (total_q, Hq), temperature lse (total_q, Hq)).

    Query i of sequence b, head h attends to the keys of the blocks in
    q2k_indices[h // G, i] (Hkv, total_q, topk): -1 entries, ids past the sequence's
    blocks and (paged) blocks whose page id lies outside the cache are ignored, a block
    listed twice counts once; only keys < the sequence's length
    and, with causal, at positions <= q_offset[b] + i (q_offset defaults to seqlen_k -
    seqlen_q). out = softmax(scale * s) V * v_global_scale (scale defaults to 1/sqrt(D));
    lse = ln sum exp(scale * s), the temperature lse with scale * lse_temperature_scale. A
    query that sees no key gets 0 and lse -inf. k, v: flat (total_k, Hkv, D) with
    cu_seqlens_k, or paged (pages, Hkv, 128, D) with page_table (B, W) and seqused_k (B,)."""
    total_q, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    out = torch.zeros(total_q, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float64, device=q.device)
    lse_t = lse.clone()
    batch = cu_seqlens_q.numel() - 1
    lengths = _msa_lengths(batch, cu_seqlens_k, seqused_k)
    for b in range(batch):
        q0, q1, sk = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), lengths[b]
        if q1 == q0 or sk == 0:
            continue
        keys, values = (_msa_sequence(x, b, sk, cu_seqlens_k, page_table) for x in (k, v))
        blocks = -(-sk // MSA_BLOCK)
        usable = torch.ones(blocks + 1, dtype=torch.bool, device=q.device)
        if page_table is not None:  # blocks whose page id lies outside the cache: skipped
            ids = page_table[b, :blocks].long().to(q.device)
            usable[:blocks] = (ids >= 0) & (ids < k.shape[0])
        chosen = q2k_indices[:, q0:q1].long().to(q.device)  # (Hkv, sq, topk)
        chosen = torch.where((chosen >= 0) & (chosen < blocks), chosen, blocks)
        chosen = torch.where(usable[chosen], chosen, blocks)
        block_mask = torch.zeros(*chosen.shape[:2], blocks + 1, dtype=torch.bool, device=q.device)
        block_mask.scatter_(2, chosen, True)
        visible = block_mask[..., :blocks].repeat_interleave(MSA_BLOCK, -1)[..., :sk]
        if causal:
            offset = sk - (q1 - q0) if q_offset is None else int(q_offset[b])
            pos = offset + torch.arange(q1 - q0, device=q.device)
            visible = visible & (torch.arange(sk, device=q.device) <= pos[:, None])
        qh, kh, vh = q[q0:q1].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
        o, l = attention(qh, kh, vh, visible, scale, compute_dtype=torch.float64)
        _, l_t = attention(
            qh, kh, vh, visible, scale * lse_temperature_scale, compute_dtype=torch.float64
        )
        out[q0:q1] = o.transpose(0, 1) * v_global_scale
        lse[q0:q1], lse_t[q0:q1] = l.T, l_t.T
    return out.float(), lse.float(), lse_t.float()


# NVFP4 (the MSA packed K/V pages): e2m1 codes (sign in bit 3, magnitude code in bits 0-2),
# one e4m3 scale per 16 values, and an fp32 global scale per tensor; value = E2M1[code] x
# scale x global scale. A page holds four [Hkv, 128, X] byte regions (K data X = 64, two
# codes a byte with the even element in the low nibble; K scales X = 8, linear; V data;
# V scales X = 8 in the 4x4 swizzle) at Hkv x these byte offsets.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_GROUP = 16
E4M3_MAX = 448.0
NVFP4_REGIONS = {"k_data": 0, "k_scales": 8192, "v_data": 9216, "v_scales": 17408}
NVFP4_PAGE_BYTES_PER_HEAD = 18432


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes of the E2M1 values nearest to x (|x| above 6 saturates to 6); a value
    halfway between two takes the even magnitude code (round to nearest even)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    distance = (x.float().abs()[..., None] - table).abs()
    nearest = distance == distance.min(-1, keepdim=True).values
    even = (torch.arange(8, device=x.device) % 2 == 0).float()
    magnitude = (nearest.float() * (1 + even)).argmax(-1)  # the even one of a tie
    return (magnitude + 8 * (x < 0)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where(codes >= 8, -magnitude, magnitude)


def nvfp4_quantize(x: torch.Tensor, global_scale: float):
    """(codes uint8 (..., D), scales float8_e4m3fn (..., D / 16)) of x: each group of 16
    gets the scale amax / 6 / global_scale (clamped to 448 before the cast, which rounds to
    nearest even), and each value the E2M1 code nearest to x / (scale x global_scale)."""
    groups = x.float().unflatten(-1, (-1, NVFP4_GROUP))
    amax = groups.abs().amax(-1)
    scales = (amax / 6.0 / global_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = scales.float()[..., None] * global_scale
    ratio = torch.where(step > 0, groups / step, torch.zeros_like(groups))
    return e2m1_encode(ratio).flatten(-2), scales


def nvfp4_dequantize(codes, scales, global_scale: float) -> torch.Tensor:
    """float32 values of nvfp4_quantize's output."""
    values = e2m1_decode(codes).unflatten(-1, (-1, NVFP4_GROUP))
    return (values * scales.float()[..., None] * global_scale).flatten(-2)


def scale_offsets_128x4(rows: int, groups: int, device=None) -> torch.Tensor:
    """int64 (rows, groups): the byte of scale (row, group) in the cuBLAS 128x4 tiled layout:
    512-byte tiles of 128 rows x 4 groups, (r, g) of a tile at (r % 32) * 16 + (r // 32) * 4
    + g; a 128-row band's tiles in group order, then the next band's."""
    r = torch.arange(rows, device=device)[:, None]
    g = torch.arange(groups, device=device)[None, :]
    tiles_per_band = -(-groups // 4)
    band, within = r // 128, r % 128
    return (band * tiles_per_band + g // 4) * 512 + within % 32 * 16 + within // 32 * 4 + g % 4


def nvfp4_quantize_128x4(x: torch.Tensor, global_scale: float):
    """nvfp4_quantize of x (..., D) with its codes packed ((..., D / 2) uint8, two a byte) and
    its scales as the flat uint8 bytes of the cuBLAS 128x4 tiled layout (rows: x's leading
    dims flattened in order, rounded up to 128; groups D / 16 rounded up to 4; padding 0)."""
    codes, scales = nvfp4_quantize(x, global_scale)
    rows, groups = scales[..., 0].numel(), scales.shape[-1]
    flat = torch.zeros(
        -(-rows // 128) * 128 * -(-groups // 4) * 4, dtype=torch.uint8, device=x.device
    )
    flat[scale_offsets_128x4(rows, groups, x.device)] = scales.view(torch.uint8).reshape(
        rows, groups
    )
    return pack_e2m1(codes), flat


def nvfp4_dequantize_128x4(packed, flat_scales, global_scale: float) -> torch.Tensor:
    """float32 values of packed codes (..., D / 2) with their 128x4 tiled scales (flat
    bytes, read at the offsets of the leading dims' rows)."""
    codes = unpack_e2m1(packed)
    rows, groups = codes[..., 0].numel(), codes.shape[-1] // NVFP4_GROUP
    offsets = scale_offsets_128x4(rows, groups, packed.device)
    scales = flat_scales.reshape(-1)[offsets].view(torch.float8_e4m3fn)
    return nvfp4_dequantize(codes, scales.reshape(*codes.shape[:-1], groups), global_scale)


def msa_proxy_score_fp4(
    q_fp4, k_fp4, q_scale, k_scale, q_global_scale, k_global_scale, cu_seqlens_q,
    cu_seqlens_k=None, **options,
):  # fmt: skip
    """flashinfer.msa_ops.msa_proxy_score_fp4: msa_proxy_score (the same options) of q and k
    dequantized from NVFP4 with 128x4 tiled scales, each times its global scale."""
    q = nvfp4_dequantize_128x4(q_fp4, q_scale, q_global_scale)
    k = nvfp4_dequantize_128x4(k_fp4, k_scale, k_global_scale)
    return msa_proxy_score(q, k, cu_seqlens_q, cu_seqlens_k, **options)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(..., D) codes -> (..., D / 2) bytes, the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], -1).flatten(-2)


def swizzle_v_scales(scales: torch.Tensor) -> torch.Tensor:
    """(..., 128, 8) logical V scales (token t, group s) -> the stored order: (t, s) goes to
    row (t // 4) * 4 + s // 2, column (s % 2) * 4 + t % 4."""
    t = torch.arange(128, device=scales.device)[:, None]
    s = torch.arange(8, device=scales.device)[None, :]
    rows, cols = (t // 4 * 4 + s // 2).expand(128, 8), (s % 2 * 4 + t % 4).expand(128, 8)
    out = torch.empty_like(scales)
    out[..., rows, cols] = scales
    return out


def unswizzle_v_scales(stored: torch.Tensor) -> torch.Tensor:
    t = torch.arange(128, device=stored.device)[:, None]
    s = torch.arange(8, device=stored.device)[None, :]
    return stored[..., (t // 4 * 4 + s // 2).expand(128, 8), (s % 2 * 4 + t % 4).expand(128, 8)]


def nvfp4_page_views(pages: torch.Tensor, num_kv_heads: int) -> dict:
    """The four regions of packed NVFP4 pages (uint8, (num_pages, Hkv x 18432)) as strided
    views: data (pages, Hkv, 128, 64) strides (page_bytes, 8192, 64, 1), scales
    (pages, Hkv, 128, 8) strides (page_bytes, 1024, 8, 1)."""
    page_bytes = num_kv_heads * NVFP4_PAGE_BYTES_PER_HEAD
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != page_bytes:
        raise ValueError(f"pages must be uint8 (num_pages, {page_bytes}), got {pages.shape}")
    views = {}
    for name, offset in NVFP4_REGIONS.items():
        width = 64 if name.endswith("data") else 8
        views[name] = pages.as_strided(
            (pages.shape[0], num_kv_heads, 128, width),
            (pages.stride(0), 128 * width, width, 1),
            pages.storage_offset() + num_kv_heads * offset,
        )
    return views


def nvfp4_pack_pages(k, v, k_global_scale: float, v_global_scale: float) -> torch.Tensor:
    """k, v (num_pages, Hkv, 128, 128) -> packed NVFP4 pages (num_pages, Hkv x 18432)."""
    hkv = k.shape[1]
    pages = torch.zeros(
        k.shape[0], hkv * NVFP4_PAGE_BYTES_PER_HEAD, dtype=torch.uint8, device=k.device
    )
    views = nvfp4_page_views(pages, hkv)
    for x, g, name in ((k, k_global_scale, "k"), (v, v_global_scale, "v")):
        codes, scales = nvfp4_quantize(x, g)
        if name == "v":
            scales = swizzle_v_scales(scales)
        views[f"{name}_data"].copy_(pack_e2m1(codes))
        views[f"{name}_scales"].copy_(scales.view(torch.uint8))
    return pages


def _v_scale_position(token: torch.Tensor, group: torch.Tensor):
    """Where the 4x4 swizzle stores V scale (token % 128, group) within its page: (row, col)."""
    t = token % MSA_BLOCK
    return t // 4 * 4 + group // 2, group % 2 * 4 + t % 4


def nvfp4_write_slots(pages, k, v, slots, num_kv_heads: int, k_global_scale, v_global_scale):
    """Quantize k, v (T, Hkv, 128) and write token i into packed NVFP4 pages (in place) at
    slot slots[i] (page slots // 128, row slots % 128); negative slots are skipped. The codes
    and scales are nvfp4_quantize's: scale = e4m3(amax / 6 / global scale), rounded to
    nearest even and clamped to 448; each value the nearest E2M1 (ties to the even code, 6
    beyond); the other tokens of a page are untouched."""
    views = nvfp4_page_views(pages, num_kv_heads)
    keep = slots >= 0
    slots = slots[keep].long()
    page, row = slots // MSA_BLOCK, slots % MSA_BLOCK
    heads = torch.arange(num_kv_heads, device=pages.device)
    for x, g, name in ((k[keep], k_global_scale, "k"), (v[keep], v_global_scale, "v")):
        codes, scales = nvfp4_quantize(x, g)  # (n, Hkv, 128), (n, Hkv, 8)
        views[f"{name}_data"][page[:, None], heads, row[:, None]] = pack_e2m1(codes)
        stored = views[f"{name}_scales"]
        if name == "k":
            stored[page[:, None], heads, row[:, None]] = scales.view(torch.uint8)
            continue
        group = torch.arange(scales.shape[-1], device=pages.device)
        r, c = _v_scale_position(row[:, None, None], group)  # (n, 1, 8)
        stored[page[:, None, None], heads[:, None], r, c] = scales.view(torch.uint8)


def nvfp4_read_slots(pages, slots, num_kv_heads: int, k_global_scale, v_global_scale):
    """(k, v) float32 (T, Hkv, 128): the values nvfp4_write_slots stored at `slots` (all
    >= 0)."""
    views = nvfp4_page_views(pages, num_kv_heads)
    slots = slots.long()
    page, row = slots // MSA_BLOCK, slots % MSA_BLOCK
    heads = torch.arange(num_kv_heads, device=pages.device)
    out = []
    for g, name in ((k_global_scale, "k"), (v_global_scale, "v")):
        data = views[f"{name}_data"][page[:, None], heads, row[:, None]]
        stored = views[f"{name}_scales"]
        if name == "k":
            scales = stored[page[:, None], heads, row[:, None]]
        else:
            group = torch.arange(8, device=pages.device)
            r, c = _v_scale_position(row[:, None, None], group)
            scales = stored[page[:, None, None], heads[:, None], r, c]
        out.append(nvfp4_dequantize(unpack_e2m1(data), scales.view(torch.float8_e4m3fn), g))
    return tuple(out)


def nvfp4_unpack_pages(pages, num_kv_heads: int, k_global_scale: float, v_global_scale: float):
    """(k, v) float32 (num_pages, Hkv, 128, 128): the values packed NVFP4 pages hold."""
    views = nvfp4_page_views(pages, num_kv_heads)
    out = []
    for g, name in ((k_global_scale, "k"), (v_global_scale, "v")):
        scales = views[f"{name}_scales"].view(torch.float8_e4m3fn)
        if name == "v":
            scales = unswizzle_v_scales(scales)
        out.append(nvfp4_dequantize(unpack_e2m1(views[f"{name}_data"]), scales, g))
    return tuple(out)


# SDSA (the simplified DSA indexer, flashinfer.sdsa): one query head, scores are fp32 q.k over
# 64-key pages of 128-dim keys, BF16 or NVFP4 (the encoding above with no global scale).
SDSA_PAGE = 64
SDSA_TILE_ROWS = 128  # query rows of an indexer_threshold_select tile


def sdsa_nvfp4_quantize(x: torch.Tensor):
    """(packed codes uint8 (..., 64), scales float8_e4m3fn (..., 8)) of x (..., 128):
    scale = e4m3(amax / 6) (clamped to 448), codes E2M1 nearest (ties to even), 0 where the
    scale is 0; |x| beyond 2688 saturates."""
    codes, scales = nvfp4_quantize(x, 1.0)
    return pack_e2m1(codes), scales


def sdsa_dequantize(data: torch.Tensor, scales=None) -> torch.Tensor:
    """float32 values of BF16 rows (scales None) or of NVFP4 rows (data uint8 (..., 64),
    scales e4m3 or uint8 (..., 8))."""
    if scales is None:
        return data.float()
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    return nvfp4_dequantize(unpack_e2m1(data), scales, 1.0)


def quantize_write_index_qk_nvfp4(
    key, slots, query, query_rows, *, key_cache, key_scales, packed_query, query_scales
):
    """In place: key row i (bf16 / fp16 (T, 128)) quantized into key_cache / key_scales
    [pages, 64, ...] at slot slots[i] (page s // 64, row s % 64), query row j into
    packed_query / query_scales at row query_rows[j]; negative slots and rows are skipped."""
    keep = slots >= 0
    codes, scales = sdsa_nvfp4_quantize(key[keep])
    at = slots[keep].long()
    key_cache[at // SDSA_PAGE, at % SDSA_PAGE] = codes
    key_scales[at // SDSA_PAGE, at % SDSA_PAGE] = scales.view(key_scales.dtype)
    keep = query_rows >= 0
    codes, scales = sdsa_nvfp4_quantize(query[keep])
    packed_query[query_rows[keep].long()] = codes
    query_scales[query_rows[keep].long()] = scales.view(query_scales.dtype)


def sdsa_request_keys(key_cache, block_table, row: int, length: int, key_scales=None):
    """float32 (length, 128): the first `length` keys of table row `row`."""
    pages = block_table[row, : -(-length // SDSA_PAGE)].long()
    data = key_cache[pages].flatten(0, 1)[:length]
    scales = None if key_scales is None else key_scales[pages].flatten(0, 1)[:length]
    return sdsa_dequantize(data, scales)


def indexer_scores(
    query, key_cache, block_table, context_lengths, *, requests, scores, query_scales=None,
    key_scales=None,
):  # fmt: skip
    """In place: G = len(requests) groups of R = rows / G consecutive query rows; group g's
    rows get scores[q, k] = q . k (fp32 of the dequantized values, accumulated in fp64 here)
    for k < context_lengths[g], keys from table row requests[g]; other entries untouched."""
    groups = requests.shape[0]
    per_group = scores.shape[0] // groups
    q = sdsa_dequantize(query, query_scales).double()
    for g in range(groups):
        length = int(context_lengths[g])
        if length == 0:
            continue
        keys = sdsa_request_keys(key_cache, block_table, int(requests[g]), length, key_scales)
        rows = slice(g * per_group, (g + 1) * per_group)
        scores[rows, :length] = (q[rows] @ keys.double().T).float()
    return scores


def float_order(values: torch.Tensor) -> torch.Tensor:
    """int64 keys that order float32 values by their bits as unsigned numbers after the
    usual flip (negative: all bits inverted; positive: sign bit set), so -NaN < -inf < ... <
    +inf < +NaN."""
    bits = values.float().view(torch.int32).long() & 0xFFFFFFFF
    return torch.where(bits >= 2**31, 0xFFFFFFFF - bits, bits + 2**31)


def stored_value(scores: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """What indexer_threshold_select stores for a pair: score - thr where score <= 2 thr
    (exact there), else the score itself; either keeps the order of the scores."""
    t = thresholds[:, None].expand_as(scores)
    return torch.where(scores <= 2 * t, scores - t, scores)


def sdsa_select_classes(score, threshold, keys: int, cap: int, top_k: int):
    """(candidates, ties, fits) of threshold select over the last dim of `score` (a row's
    `keys` visible scores, or rows of them with thresholds (rows, 1)): a candidate is above
    the threshold, a tie neither above nor below it (equal or NaN); a row fits when its
    candidates are at most `cap` and, with at most top_k of its ties, at least
    min(keys, top_k)."""
    above = score > threshold
    tie = ~above & ~(score < threshold)
    cands = above.sum(-1)
    fits = (cands <= cap) & (cands + tie.sum(-1).clamp(max=top_k) >= min(keys, top_k))
    return above, tie, fits


def indexer_threshold_select(
    query, key_cache, row_ends, tile_requests, block_table, *, thresholds, counters,
    candidates, max_context: int, top_k: int, query_scales=None, key_scales=None,
    arrivals=None, ranges=None,
):  # fmt: skip
    """In place, one valid outcome of flashinfer.sdsa.indexer_threshold_select (the order
    within a class is free; this one is ascending by key). Row r of tile t = r // 128 scores
    the keys < min(row_ends[r], max_context) of table row tile_requests[t]: a key is a
    candidate when score > thresholds[r], a tie when neither above nor below (equal or
    NaN). counters[r] += (candidates, ties); the n-th candidate goes to slot top_k + n (n <
    cap = slots - top_k), the n-th tie to slot top_k - 1 - n (n < top_k), as (key, stored
    value bits). With arrivals and ranges (repair), a row that does not fit takes the
    exact min(row_end, top_k)-th largest score as its threshold, its counters restart and
    it is selected again; ranges[:, r] = (top_k - min(ties, top_k), top_k + min(cands, cap))."""
    slots = candidates.shape[1]
    if not 0 <= top_k < slots:
        raise ValueError(f"top_k = {top_k} must be in [0, {slots}) (candidate slots)")
    if (arrivals is None) != (ranges is None):
        raise ValueError("give both arrivals and ranges (repair mode) or neither")
    cap = slots - top_k
    q = sdsa_dequantize(query, query_scales).double()
    for r in range(q.shape[0]):
        end = min(int(row_ends[r]), max_context)
        keys = sdsa_request_keys(
            key_cache, block_table, int(tile_requests[r // SDSA_TILE_ROWS]), end, key_scales
        )
        score = (keys.double() @ q[r]).float()
        for attempt in range(2):
            above, tie, fits = sdsa_select_classes(score, thresholds[r].float(), end, cap, top_k)
            cands, ties = int(above.sum()), int(tie.sum())
            if arrivals is None or bool(fits) or attempt:
                break
            want = min(end, top_k)  # the want-th largest score in float-bit order
            nth = score[float_order(score).argsort(descending=True)[want - 1]] if want else None
            thresholds[r] = math.inf if nth is None else nth
            counters[r] = 0
        counters[r, 0] += cands
        counters[r, 1] += ties
        value = stored_value(score[None], thresholds[r : r + 1].float())[0]
        pairs = torch.stack([torch.arange(end, device=score.device), value.view(torch.int32)], -1)
        chosen = pairs[above][:cap]
        candidates[r, top_k : top_k + chosen.shape[0]] = chosen.to(candidates.dtype)
        tied = pairs[tie][:top_k]
        candidates[r, top_k - tied.shape[0] : top_k] = tied.flip(0).to(candidates.dtype)
        if ranges is not None:
            ranges[0, r] = top_k - min(ties, top_k)
            ranges[1, r] = top_k + min(cands, cap)


def top_k_from_candidates(candidates, ranges, *, top_keys):
    """In place: row r's pairs in slots [ranges[0, r], ranges[1, r]); at most K of them:
    their keys in slot order, then -1; more: the exact top-K by stored value (float_order),
    those strictly above the K-th value first, then ties up to K (here the earliest slots).
    Rows may be a (tiles, rows) grid: candidates (T, R, slots, 2), ranges (2, T, R)."""
    k = top_keys.shape[-1]
    if k >= 65536:
        raise ValueError(f"top_keys has {k} columns; K must be < 65536")
    if candidates.dim() == 4:
        for t in range(candidates.shape[0]):
            top_k_from_candidates(candidates[t], ranges[:, t], top_keys=top_keys[t])
        return
    top_keys.fill_(-1)
    for r in range(candidates.shape[0]):
        pairs = candidates[r, int(ranges[0, r]) : int(ranges[1, r])]
        if pairs.shape[0] <= k:
            top_keys[r, : pairs.shape[0]] = pairs[:, 0]
            continue
        order = float_order(pairs[:, 1].view(torch.float32))
        kth = order.sort(descending=True).values[k - 1]
        above = pairs[order > kth, 0]
        equal = pairs[order == kth, 0][: k - above.shape[0]]
        top_keys[r] = torch.cat([above, equal])


def gather_key_sample(
    key_cache, block_table, offsets, sample_ends, *, sample_keys, samples_per_run: int,
    pages_per_run: int, key_scales=None, sample_scales=None,
):  # fmt: skip
    """In place: row r's slot s < sample_ends[r] gets logical key
    (s // samples_per_run) * 64 * pages_per_run + offsets[s] of table row r (and its
    scales); other slots are untouched."""
    for r in range(sample_keys.shape[0]):
        s = torch.arange(int(sample_ends[r]), device=sample_keys.device)
        key = (s // samples_per_run) * SDSA_PAGE * pages_per_run + offsets[s].long()
        pages = block_table[r, key // SDSA_PAGE].long()
        sample_keys[r, s] = key_cache[pages, key % SDSA_PAGE]
        if sample_scales is not None:
            sample_scales[r, s] = key_scales[pages, key % SDSA_PAGE]


def thresholds_from_sample(sample_scores, sample_top, *, thresholds, counters):
    """In place: thresholds[r] = the min of sample_scores[r, p] over p in sample_top[r] (a
    -1 position or a NaN score counts as -inf); counters[r] = 0."""
    picked = sample_scores.float().gather(1, sample_top.long().clamp(min=0))
    picked = torch.where((sample_top < 0) | picked.isnan(), -math.inf, picked)
    thresholds.copy_(picked.min(1).values)
    counters.zero_()
