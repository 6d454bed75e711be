"""Sparse self-attention inside a diffusers video transformer (Wan), per layer and step.

    from sparseforge.diffusers_processor import enable_sparse_attention
    enable_sparse_attention(transformer, topk=32)      # a diffusers WanTransformer3DModel

replaces the processor of every self-attention (`attn1`) with SparseWanAttnProcessor: q, k
and v are projected, normalised and rotated as the model does, then attended with
sparseforge.video_sparse_attention, which picks each 64-token query tile's `topk` key tiles
on the GPU from the tiles' mean-pooled logits (in the model's token order: frames, rows,
columns) and runs the block-sparse kernels over them. Cross-attention keeps the model's own
processor. With topk >= the number of tiles every block is selected: dense attention.
Needs `pip install "sparseforge[diffusers]"`.
"""

from __future__ import annotations

import torch

from sparseforge.vsa import video_sparse_attention


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on interleaved pairs (x[2i], x[2i+1]), as Wan applies it: the model
    passes the frequencies repeated per pair."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2).type_as(x)


class SparseWanAttnProcessor:
    """A Wan self-attention processor whose attention is video_sparse_attention."""

    def __init__(self, topk: int, fp8: bool = False, backend: str = "auto"):
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        self.topk, self.fp8, self.backend = topk, fp8, backend
        self.dense = WanAttnProcessor()  # for cross-attention, if it is ever handed one

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None
    ):
        if encoder_hidden_states is not None or attention_mask is not None:
            return self.dense(
                attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb
            )
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            query, key = rotate(query, *rotary_emb), rotate(key, *rotary_emb)
        # (B, S, H, D) -> (B, H, S, D) for the attention, and back.
        out = video_sparse_attention(
            *(t.transpose(1, 2) for t in (query, key, value)),
            topk=self.topk, fp8=self.fp8, backend=self.backend,
        )  # fmt: skip
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def enable_sparse_attention(
    transformer, topk: int, fp8: bool = False, backend: str = "auto"
) -> int:
    """Give every self-attention of `transformer` a SparseWanAttnProcessor; returns how many."""
    modules = [block.attn1 for block in transformer.blocks]
    for module in modules:
        module.set_processor(SparseWanAttnProcessor(topk, fp8, backend))
    return len(modules)
