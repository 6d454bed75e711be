"""MiniMax sparse attention (MSA) operations, call-compatible with `flashinfer.msa_ops`.

    msa_topk_select   per (token, query head), the 16 key blocks it attends to, from the
                      proxy scores (max of q.k per 128-key block)

Each call is one launch on the current stream with no host synchronisation (CUDA-graph
capturable). Kernel: generator/kernels/portable/msa_topk_select.py (every arch); PyTorch
reference: sparseforge.reference.msa_topk_select.
"""

from __future__ import annotations

import functools

import torch

from sparseforge import ops
from sparseforge.checks import check_writable
from sparseforge.families import msa_topk_select as topk_family


def msa_topk_select(
    max_score,
    topk: int,
    num_valid_pages=None,
    output=None,
    force_begin_blocks: int = 0,
    force_end_blocks: int = 0,
):
    """max_score (Hq, P, S): fp32, contiguous, block scores of S tokens over P blocks.
    Returns int32 (S, Hq, 16) (written into `output` if given): for token s and head h,
    blocks [0, fb) and [nvp - fe, nvp) forced (fb = force_begin_blocks, fe =
    force_end_blocks, fb + fe <= 16), the other 16 - fb - fe by descending score from the
    blocks between them, ties to the lower id; ascending, -1 tail. A selected block whose
    score is -inf (or NaN) is written as -1 (so a -inf block is never selected).
    num_valid_pages (nvp): None (= P), an int in (0, P], or a per-token int32 tensor (S,)
    on the device, whose values are clamped to [0, P] on the GPU (not checked: that would
    need a host synchronisation)."""
    want = topk_family.constant("topk")
    if topk != want:
        raise ValueError(f"topk must be {want}, got {topk!r}")
    if not isinstance(max_score, torch.Tensor):
        raise TypeError(f"max_score must be a torch.Tensor, got {type(max_score).__name__}")
    if max_score.dtype != torch.float32 or max_score.dim() != 3:
        raise ValueError(
            f"max_score must be float32 (Hq, P, S), got {max_score.dtype} {tuple(max_score.shape)}"
        )
    if not max_score.is_contiguous():
        raise ValueError(f"max_score must be contiguous, got strides {max_score.stride()}")
    heads, blocks, tokens = max_score.shape
    device = max_score.device
    for name, value in (
        ("force_begin_blocks", force_begin_blocks),
        ("force_end_blocks", force_end_blocks),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if force_begin_blocks + force_end_blocks > want:
        raise ValueError(
            f"force_begin_blocks + force_end_blocks = {force_begin_blocks + force_end_blocks} "
            f"exceeds topk {want}"
        )
    num_valid = _num_valid(num_valid_pages, blocks, tokens, device)
    if output is None:
        output = torch.empty((tokens, heads, want), dtype=torch.int32, device=device)
    elif (
        not isinstance(output, torch.Tensor)
        or output.dtype != torch.int32
        or tuple(output.shape) != (tokens, heads, want)
        or output.device != device
        or not output.is_contiguous()
    ):
        raise ValueError(
            f"output must be a contiguous int32 tensor of shape {(tokens, heads, want)} on "
            f"{device}, got {_describe(output)}"
        )
    check_writable("output", output, (("max_score", max_score), ("num_valid_pages", num_valid)))
    if device.type != "cuda":
        raise ValueError(f"max_score is on {device}; msa_topk_select needs a CUDA device")
    if heads and tokens:
        launch = topk_family.launch(device.index, force_begin_blocks, force_end_blocks)
        with torch.cuda.device(device):
            ops.launch(launch, (max_score, num_valid, output))
    return output


def _num_valid(num_valid_pages, blocks: int, tokens: int, device) -> torch.Tensor:
    """The kernel's per-token valid-block counts: a stride-0 view for None and scalars."""
    if (
        num_valid_pages is None
        or isinstance(num_valid_pages, int)
        and not isinstance(num_valid_pages, bool)
    ):
        value = blocks if num_valid_pages is None else num_valid_pages
        if not 0 < value <= blocks:
            raise ValueError(f"num_valid_pages must be in (0, {blocks}] (P), got {value}")
        return _constant_count(device, value).expand(tokens)
    if not isinstance(num_valid_pages, torch.Tensor):
        raise TypeError(
            "num_valid_pages must be None, an int or an int32 tensor, got "
            f"{type(num_valid_pages).__name__}"
        )
    if (
        num_valid_pages.dtype != torch.int32
        or tuple(num_valid_pages.shape) != (tokens,)
        or num_valid_pages.device != device
        or not num_valid_pages.is_contiguous()
    ):
        raise ValueError(
            f"num_valid_pages must be a contiguous int32 tensor of shape ({tokens},) (S) on "
            f"{device}, got {_describe(num_valid_pages)}"
        )
    return num_valid_pages


@functools.lru_cache(maxsize=64)
def _constant_count(device: torch.device, value: int) -> torch.Tensor:
    """A one-element int32 tensor kept per (device, value): a call per layer with the same
    count launches no fill kernel and allocates nothing."""
    return torch.full((1,), value, dtype=torch.int32, device=device)


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}, strides {t.stride()}"
