"""Plain PyTorch implementations of what the kernels compute. Slow, simple, any device.

The tests compare every kernel with these (in fp32 or fp64), and the block sizes our
kernels do not cover run through them (documented in the wrappers). Layout here is HND:
q (Hq, Sq, D), k and v (Hkv, Sk, D).
"""

from __future__ import annotations

import math

import torch


def attention(q, k, v, mask=None, sm_scale=None, compute_dtype=None):
    """Masked softmax attention with GQA; returns (out (Hq, Sq, D), lse (Hq, Sq)).

    mask: bool, broadcastable per head to (Hq, Sq, Sk); a (Hkv, Sq, Sk) mask is shared by
    the query heads of each group. Rows that attend to no key give out 0 and lse -inf.
    lse is the natural-log log-sum-exp of the scaled logits.
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


def sage_dequantize(q8, k8, v8, q_scale, k_scale, v_scale, dtype=torch.float32):
    """fp32 q, k, v (HND) of Sage FP8 tensors: q8 (Hq, Sq, D) * q_scale (1, Hq, Sq) per token,
    k8 (Hkv, Sk, D) * k_scale (1, Hkv, ceil(Sk / 16)) per 16 keys, v8 * v_scale (Hkv, D) per channel."""
    sk = k8.shape[1]
    q = q8.to(dtype) * q_scale[0].to(dtype).unsqueeze(-1)
    k = k8.to(dtype) * k_scale[0].to(dtype).repeat_interleave(16, dim=-1)[:, :sk].unsqueeze(-1)
    v = v8.to(dtype) * v_scale.to(dtype).unsqueeze(1)
    return q, k, v
