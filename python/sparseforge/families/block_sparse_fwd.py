"""block_sparse_fwd: 16-bit block-sparse attention over units and tiles (both wrappers'
bf16 / fp16 plans); block_sparse_fwd_logits: the same with plan()'s logit options
(logit_options.py)."""

from __future__ import annotations

from sparseforge.checks import check_vector_operand

FAMILIES = ("block_sparse_fwd", "block_sparse_fwd_logits")
LOGITS_FAMILY = FAMILIES[1]
CONSTANTS = (
    "unit_rows",
    "tile_keys",
    "logit_causal",
    "logit_mask",
    "logit_alibi",
    "logit_soft_cap",
)
CONSTRAINTS = ("units_per_cta",)


def bind(kernel, tiles, scale_log2: float, scales=None, logit_args=None):
    """(launch, refresh): the plan's arguments packed once (the tile lists, the softmax
    scale, and for block_sparse_fwd_logits the logit arguments); nothing to refresh before
    a run."""
    return kernel.bind(*tiles.tensors(), scale_log2, *(logit_args or ())), None


def check_sm_scale(sm_scale: float) -> None:
    """The online softmax takes each row's running max of the raw scores, which is the max of
    the scaled ones only for a positive scale."""
    if not sm_scale > 0:
        raise ValueError(
            f"sm_scale={sm_scale} is not supported by the bf16/fp16 kernels (they need "
            "sm_scale > 0); backend='torch' computes any finite sm_scale"
        )


def check_operand(name: str, t) -> None:
    """q, k, v and out as the kernels load and store them (16-byte vectors)."""
    check_vector_operand(name, t)


def operands(kernel, q, k, v, out, lse, hnd: bool):
    """(leading tensors in ABI order, swap01): the ABI takes (seq, heads, ...) views, so
    HND tensors are passed as their (1, 0)-transposed views."""
    return (q, k, v, out, lse), hnd
