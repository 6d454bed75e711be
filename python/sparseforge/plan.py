"""The plan of an attention call: everything run() needs, fixed by plan()."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from sparseforge._library import BoundLaunch, Kernel


@dataclass(frozen=True)
class LogitOptions:
    """What plan() asked of the logits besides sm_scale (FlashInfer's plan() options). The
    16-bit kernels take causal, masks, the soft cap and ALiBi (block_sparse_fwd_logits,
    logit_options.py) and RoPE (q and k rotated first: families/rope_llama.py); any option
    with Sage FP8 runs the PyTorch reference (reference.attention, rope_llama), with a
    warning under backend="auto"."""

    causal: bool = False  # bottom-right aligned (reference.causal_mask)
    soft_cap: float = 0.0  # > 0: cap * tanh(logits / cap)
    pos_encoding_mode: str = "NONE"  # or "ROPE_LLAMA" (q and k rotated), "ALIBI"
    rope_scale: float = 1.0
    rope_theta: float = 1e4
    mask_bits: torch.Tensor | None = None  # (1, Sq, W) int32: masks inside BSR blocks

    def named(self) -> list[str]:
        """The options that are set, as the caller wrote them (for messages)."""
        named = []
        if self.mask_bits is not None:
            named.append("mask")
        if self.causal:
            named.append("causal=True")
        if self.soft_cap:
            named.append(f"logits_soft_cap={self.soft_cap!r}")
        if self.pos_encoding_mode != "NONE":
            named.append(f"pos_encoding_mode={self.pos_encoding_mode!r}")
        return named


NO_LOGIT_OPTIONS = LogitOptions()


@dataclass(frozen=True)
class Plan:
    path: str  # the template that runs, or "torch" (the PyTorch reference)
    dtype: torch.dtype  # of q, k and v
    out_dtype: torch.dtype
    sm_scale: float
    seq_q: int
    seq_k: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    hnd: bool  # q, k, v, out are (heads, seq, D) and lse (heads, seq); else (seq, heads, ...)
    scales: tuple | None  # Sage FP8: (q_scale, k_scale, v_scale), read by every run()
    family: ModuleType | None = None  # the runtime family module (sparseforge/families/)
    kernel: Kernel | None = None
    launch: BoundLaunch | None = None
    refresh: Callable | None = None  # brings plan-time copies of caller tensors up to date
    lse_scratch: torch.Tensor | None = None  # lse when the caller wants none (no allocation)
    token_mask: torch.Tensor | None = None  # the reference path's (Hkv, Sq, Sk) mask
    logits: LogitOptions = NO_LOGIT_OPTIONS  # the reference path's options beyond sm_scale
    # RoPE LLaMA on the kernels: (launch of q, launch of k, q buffer, k buffer), the rotated
    # q and k the attention reads (families/rope_llama.py)
    rope: tuple | None = None
    # int32 scalar of error bits the GPU computes for this plan (sparsity.ERR_*), raised by
    # check_plan() / run(); None: nothing checked there
    errors: torch.Tensor | None = None

    def _layout(self, heads: int, seq: int, *rest) -> tuple:
        return (heads, seq, *rest) if self.hnd else (seq, heads, *rest)

    @property
    def q_shape(self) -> tuple:
        return self._layout(self.num_qo_heads, self.seq_q, self.head_dim)

    @property
    def kv_shape(self) -> tuple:
        return self._layout(self.num_kv_heads, self.seq_k, self.head_dim)

    @property
    def lse_shape(self) -> tuple:
        return self._layout(self.num_qo_heads, self.seq_q)

    @functools.cached_property
    def contiguous_layouts(self) -> tuple:
        """(shape, strides, dtype, bytes) of q, k, v, out and lse as contiguous tensors."""
        layouts = []
        for shape, dtype in (
            (self.q_shape, self.dtype),
            (self.kv_shape, self.dtype),
            (self.kv_shape, self.dtype),
            (self.q_shape, self.out_dtype),
            (self.lse_shape, torch.float32),
        ):
            strides, size = [1], 1
            for extent in reversed(shape[1:]):
                strides.insert(0, strides[0] * extent)
            for extent in shape:
                size *= extent
            layouts.append((shape, tuple(strides), dtype, size * dtype.itemsize))
        return tuple(layouts)
