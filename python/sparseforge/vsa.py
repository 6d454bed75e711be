"""Video sparse attention in one call, as video diffusion models use it (the VSA recipe):

    1. coarse: q, k, v mean-pooled over 64-token tiles; attention between the tiles
    2. select: per query tile and kv head, the top-k key tiles by coarse logit
    3. fine:   block-sparse attention of the tokens over the selected tiles (our kernels)
    4. out  =  fine + gate * coarse output broadcast to the tile's tokens (if a gate is given)

Tokens must already be in tile order (a video latent's 4x4x4 cubes flattened, say): tile t
is tokens 64 t .. 64 t + 63, the last tile may be short. GQA: the query heads of a kv group
share its selection (the mean of their coarse logits decides). Everything runs on the GPU
without a host synchronisation, so the call can be captured in a CUDA graph.

    video_sparse_attention(q, k, v, topk=..., sm_scale=None, gate=None, fp8=False) -> out

q (B, Hq, S, D) or (Hq, S, D), k / v (B, Hkv, S, D) or (Hkv, S, D), bf16 or fp16 (fp8=True
quantizes them with sage_fp8_quantize and runs the Sage FP8 kernels; the output is bf16).
`gate` is broadcast against the output (e.g. a learned (Hq, 1, D) or (B, Hq, S, D) tensor).
"""

from __future__ import annotations

import math

import torch

from sparseforge import sparsity
from sparseforge.checks import check_tensor, positive_int
from sparseforge.families import selection_mask
from sparseforge.reference import VSA_TILE as TILE
from sparseforge.reference import coarse_logits, select_tiles, tile_means
from sparseforge.sparse import BlockSparseAttentionWrapper


def _check(q, k, v, topk):
    if not isinstance(q, torch.Tensor) or q.dim() not in (3, 4):
        raise ValueError(f"q must be (B, Hq, S, D) or (Hq, S, D), got {getattr(q, 'shape', q)}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q has dtype {q.dtype}; video_sparse_attention takes bfloat16 or float16")
    if not isinstance(k, torch.Tensor) or k.dim() != q.dim():
        raise ValueError(f"k must have q's number of dimensions ({q.dim()})")
    if q.shape[-3] % k.shape[-3]:
        raise ValueError(
            f"num_qo_heads {q.shape[-3]} must be a multiple of num_kv_heads {k.shape[-3]}"
        )
    kv_shape = (*q.shape[:-3], k.shape[-3], *q.shape[-2:])
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, kv_shape, q.dtype, q.device)
    if q.shape[-3] % k.shape[-3]:
        raise ValueError(
            f"num_qo_heads {q.shape[-3]} must be a multiple of num_kv_heads {k.shape[-3]}"
        )
    positive_int("topk", topk)


def video_sparse_attention(
    q, k, v, *, topk: int, sm_scale=None, gate=None, fp8: bool = False, backend: str = "auto"
):
    """The VSA recipe (module docstring). `backend` as the wrappers' ("torch": the PyTorch
    reference for the fine attention)."""
    _check(q, k, v, topk)
    batched = q.dim() == 4
    if not batched:
        q, k, v = q[None], k[None], v[None]
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    q_tiles, k_tiles = tile_means(q), tile_means(k)
    logits = coarse_logits(q_tiles, k_tiles, scale)
    selected = select_tiles(logits, hkv, topk)  # (B, Hkv, T, k)
    # Batch folded into the heads: (b, h) -> b * H + h keeps every query head's kv head.
    q2k = selected.repeat_interleave(hq // hkv, 1).flatten(0, 1).to(torch.int32).contiguous()
    heads = (b * hq, b * hkv)
    tokens = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)  # HND
    wrapper = BlockSparseAttentionWrapper(torch.empty(1, device=q.device), backend=backend)
    q_data_type, scales = q.dtype, (None, None, None)
    if fp8:
        from sparseforge.sage import sage_fp8_quantize

        quantized = sage_fp8_quantize(*tokens)
        tokens = quantized.q, quantized.k, quantized.v
        q_data_type = torch.float8_e4m3fn
        scales = quantized.q_scale, quantized.k_scale, quantized.v_scale
    # The selections as the BSR wrapper's q2k form, planned directly: its FlashInfer plan()
    # signature would also ask N to be a multiple of C, which a ragged last tile is not.
    selection = sparsity.from_bsr_wrapper(
        indptr=None, indices=None, block_mask=None, q2k_indices=q2k, q2k_num=None,
        kv_block_lens=None, M=s, N=s, R=TILE, C=TILE, num_qo_heads=heads[0],
        num_kv_heads=heads[1], device=q.device, non_blocking=True,
        mask_of_selections=selection_mask.selection_block_mask,
    )  # fmt: skip
    wrapper._plan_attention(
        selection, *heads, d, scale, q_data_type, None, None, scales, hnd=False,
        blocks=f"{TILE}-token tiles",
    )  # fmt: skip
    out = wrapper.run(*(t.transpose(0, 1) for t in tokens)).transpose(0, 1)  # NHD views
    out = out.unflatten(0, (b, hq))
    if gate is not None:
        coarse = torch.softmax(logits, -1) @ tile_means(v).repeat_interleave(hq // hkv, 1)
        sizes = torch.full((coarse.shape[2],), TILE, device=q.device)
        sizes[-1] = s - (coarse.shape[2] - 1) * TILE
        per_token = coarse.repeat_interleave(sizes, dim=2, output_size=s)
        out = (out.float() + gate * per_token).to(out.dtype)
    return out if batched else out[0]
