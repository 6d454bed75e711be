"""MiniMax sparse attention (MSA) operations, call-compatible with `flashinfer.msa_ops`.

    msa_proxy_score   per (query head, 128-key block, token), the max of the unscaled q.k
                      over the keys the token may see
    msa_proxy_score_fp4   the same of NVFP4 q and k (scales in the cuBLAS 128x4 layout)
    msa_topk_select   per (token, query head), the 16 key blocks it attends to, from the
                      proxy scores
    quantize_write_kv_nvfp4   new tokens' K and V into packed NVFP4 pages at their slots
    msa_sparse_attention, msa_sparse_decode_attention
                      each query token attends to the 128-key blocks it selected, K/V in
                      q's dtype, FP8 or NVFP4, flat or paged

Each call is one launch on the current stream (the attention: two when it splits a small
batch's keys across CTAs, the second merging the splits) with no host synchronisation when
the sizes it would otherwise read from the GPU are given (msa_proxy_score: max_seqlen_q and
max_k_tiles), so it can be captured in a CUDA graph. Kernels:
generator/kernels/portable/{msa_proxy_score,msa_topk_select,nvfp4_kv_write,
msa_sparse_attention,msa_attention_combine}.py (every arch); PyTorch references:
sparseforge.reference.msa_proxy_score, .msa_topk_select, .nvfp4_write_slots and
.msa_sparse_attention.
"""

from __future__ import annotations

import functools
import math

import torch

from sparseforge import ops
from sparseforge.arch import multiprocessors
from sparseforge.checks import check_writable, describe
from sparseforge.dtypes import NAME_OF
from sparseforge.families import msa_attention_combine as combine_family
from sparseforge.families import msa_proxy_score as proxy_family
from sparseforge.families import msa_sparse_attention as attention_family
from sparseforge.families import msa_topk_select as topk_family
from sparseforge.families import nvfp4_kv_write as nvfp4_family

# The MiniMax-M3 ICP indexer (its own module) is part of this surface, as in flashinfer.
from sparseforge.msa_icp import (  # noqa: F401
    MSAIcpComm,
    MSAIcpIndexerPlan,
    MSAIcpScorePlan,
    msa_icp_comm_layout,
    msa_icp_decode_index_score_sharded,
    msa_icp_decode_pool_bytes,
    msa_icp_decode_score_columns,
    msa_icp_decode_score_publish,
    msa_icp_index_score_columns,
    msa_icp_index_score_plan_storage,
    msa_icp_index_score_sharded,
    msa_icp_index_score_sharded_plan,
    msa_icp_index_score_sharded_plan_device,
    msa_icp_merge_candidates,
    msa_icp_prefill_pool_bytes,
    msa_icp_prefill_score_select,
    msa_icp_topk_select_prefill,
    msa_icp_topk_select_publish,
    prepare_msa_icp_indexer,
)
from sparseforge.planner import device_constant
from sparseforge.sparsity import uniform_offsets


def msa_proxy_score(
    q,
    k,
    cu_seqlens_q,
    cu_seqlens_k=None,
    *,
    page_table=None,
    seqused_k=None,
    causal: bool = True,
    max_seqlen_q=None,
    max_k_tiles=None,
    output=None,
    reduce_heads: bool = False,
    q_offset=None,
    use_fp32_acc: bool = True,
):
    """fp32 (Hq, T, total_q) (or (1, T, total_q) with reduce_heads, the max over heads):
    for query token i of sequence b, head h and 128-key block t, the max of the unscaled
    q.k over the block's keys that i sees: keys < the sequence's length and, with causal,
    at positions <= q_offset[b] + i (q_offset defaults to seqlen_k - seqlen_q, right
    aligned); -inf for a block it sees none of. T = max_k_tiles (default: the longest
    sequence's blocks).

    q (total_q, Hq, 128) bf16 / fp16 / e4m3; k of the same dtype, flat (total_k, Hkv, 128) with
    cu_seqlens_k (B + 1,), or paged (pages, Hkv, 128, 128) with page_table (B, W) and
    seqused_k (B,); int32 index tensors on q's device. max_seqlen_q and max_k_tiles are
    read from the GPU when not given (a host synchronisation; pass them under CUDA-graph
    capture). A max_seqlen_q below a sequence's length leaves that sequence's later rows
    unwritten. The index values are not checked on the host (that would need a host
    synchronisation): a block whose page id lies outside the cache is never read and
    scores -inf; offsets and lengths past the tensors read out of bounds.
    use_fp32_acc=True (the default) sums the products in fp32 (within 1e-5 of the exact
    sums). use_fp32_acc=False lets e4m3 q and k sum on Hopper's FP8 tensor cores (wgmma),
    whose accumulator keeps fewer bits than fp32 (errors of 4e-4 of the largest score were
    seen where fp32 sums are within 1e-5) and which run about twice as fast; other dtypes
    and archs sum in fp32 either way."""
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise TypeError(f"q and k must be torch.Tensors, got {describe(q)} and {describe(k)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        raise NotImplementedError(
            f"q has dtype {q.dtype}: bf16, fp16 and float8_e4m3fn (with k of the same dtype) "
            "are built"
        )
    if k.dtype != q.dtype:
        raise ValueError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    return _proxy_score(
        "msa_proxy_score", NAME_OF[q.dtype], q, k, (), 1.0, cu_seqlens_q, cu_seqlens_k,
        page_table, seqused_k, causal, max_seqlen_q, max_k_tiles, output, reduce_heads, q_offset,
        bool(use_fp32_acc),
    )  # fmt: skip


def msa_proxy_score_fp4(
    q_fp4,
    k_fp4,
    q_scale,
    k_scale,
    q_global_scale: float,
    k_global_scale: float,
    cu_seqlens_q,
    cu_seqlens_k=None,
    *,
    page_table=None,
    seqused_k=None,
    causal: bool = True,
    max_seqlen_q=None,
    max_k_tiles=None,
    output=None,
    reduce_heads: bool = False,
    q_offset=None,
):
    """msa_proxy_score of NVFP4 q and k: the same output and rules, with the scores those of
    the dequantized values times q_global_scale * k_global_scale (folded in before the block
    max), i.e. torch's dequantization of the same packed inputs (reference.msa_proxy_score_fp4).

    q_fp4 (total_q, Hq, 64) uint8 and k_fp4 flat (total_k, Hkv, 64) or paged
    (pages, Hkv, 128, 64) uint8: E2M1 codes, two a byte, the even element in the low nibble.
    q_scale and k_scale: contiguous uint8 tensors (any shape; read flat) of e4m3 scale bytes,
    one per 16 values, in the cuBLAS 128x4 tiled layout (reference.nvfp4_quantize_128x4),
    by logical row token * Hq + head for q, token * Hkv + head for flat k and
    (page * Hkv + head) * 128 + row for paged k; each must hold the tiled layout of all its
    rows (rows rounded up to 128, times 8 bytes). q_global_scale and k_global_scale: the
    dequantization multipliers (1 / the quantizer's global scale), finite.

    Every GPU runs it with the codes decoded to fp16 in shared memory (exact: a code times
    an e4m3 scale fits fp16) and fp32 sums on mma.sync; no arch needs FP4 tensor cores."""
    for name, x in (("q_fp4", q_fp4), ("k_fp4", k_fp4), ("q_scale", q_scale), ("k_scale", k_scale)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8:
            raise ValueError(f"{name} must be a uint8 torch.Tensor, got {describe(x)}")
    for name, value in (("q_global_scale", q_global_scale), ("k_global_scale", k_global_scale)):
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
        ):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    scales = (("q_scale", q_scale), ("k_scale", k_scale))
    logit_scale = float(q_global_scale) * float(k_global_scale)
    return _proxy_score(
        "msa_proxy_score_fp4", "nvfp4", q_fp4, k_fp4, scales, logit_scale, cu_seqlens_q,
        cu_seqlens_k, page_table, seqused_k, causal, max_seqlen_q, max_k_tiles, output,
        reduce_heads, q_offset,
    )  # fmt: skip


def _proxy_score(
    api, dtype, q, k, scales, logit_scale, cu_seqlens_q, cu_seqlens_k, page_table, seqused_k,
    causal, max_seqlen_q, max_k_tiles, output, reduce_heads, q_offset, fp32_sums=True,
):  # fmt: skip
    """The checks and launch both proxy scores share; `dtype` names the kernel's inputs
    (bf16, fp16, e4m3 or nvfp4: rows of 64 code bytes, with `scales` the (name, tensor) of
    q's and k's scales)."""
    head_dim = proxy_family.constant("head_dim")
    block = proxy_family.constant("block_keys")
    width = head_dim // 2 if dtype == "nvfp4" else head_dim  # elements of a stored row
    q_name, k_name = ("q_fp4", "k_fp4") if dtype == "nvfp4" else ("q", "k")
    _check_rows(q_name, q, "total_q, Hq", width)
    total_q, heads = q.shape[:2]
    device = q.device
    paged = _key_layout(cu_seqlens_k, page_table, seqused_k, k_name)
    if paged:
        if k.dim() != 4 or k.shape[2:] != (block, width) or k.stride(3) != 1:
            raise ValueError(
                f"paged {k_name} must be (pages, Hkv, {block}, {width}) with unit stride on the "
                f"last dim, got {describe(k)}"
            )
        if k.stride(0) != k.shape[1] * k.stride(1):
            raise ValueError(
                f"paged {k_name}'s pages must hold their heads contiguously (stride(0) = Hkv * "
                f"stride(1)), got {describe(k)}"
            )
        kv_heads = k.shape[1]
        kernel_k = k.flatten(0, 1)
    else:
        _check_rows(f"flat {k_name}", k, "total_k, Hkv", width)
        kv_heads = k.shape[1]
        kernel_k = k
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"Hq = {heads} must be a multiple of Hkv = {kv_heads}")
    scale_rows = (total_q * heads, kernel_k.shape[0] * kernel_k.shape[1])[: len(scales)]
    groups = -(-head_dim // 16 // 4) * 4  # scales a row, padded to the tiles' 4
    for (name, x), rows in zip(scales, scale_rows, strict=True):
        needed = -(-rows // 128) * 128 * groups  # the 128x4 tiles of all rows
        if not x.is_contiguous() or x.numel() < needed or x.numel() >= 2**31:
            raise ValueError(
                f"{name} must be a contiguous uint8 tensor of the 128x4 tiled scales of "
                f"{rows} rows ({needed} bytes, below 2^31), got {describe(x)}"
            )
    _check_sequences(cu_seqlens_q, cu_seqlens_k, page_table, seqused_k, q_offset, device)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_k_tiles is None:
        lengths = seqused_k if paged else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        max_k_tiles = -(-int(lengths.max()) // block)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_k_tiles", max_k_tiles)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    shape = (1 if reduce_heads else heads, max_k_tiles, total_q)
    output = _output(output, shape, torch.float32, device)
    index_inputs = [("cu_seqlens_q", cu_seqlens_q), (q_name, q), (k_name, k), *scales]
    for name, t in (
        ("cu_seqlens_k", cu_seqlens_k),
        ("page_table", page_table),
        ("seqused_k", seqused_k),
        ("q_offset", q_offset),
    ):
        if t is not None:
            index_inputs.append((name, t))
    check_writable("output", output, index_inputs)
    if device.type != "cuda":
        raise ValueError(f"{q_name} is on {device}; {api} needs a CUDA device")
    for name, x in ((k_name, k), *scales):
        if x.device != device:
            raise ValueError(f"{name} is on {x.device}, {q_name} on {device}")
    if output.numel() == 0 or max_seqlen_q == 0:
        return output
    unused = _constant_count(device, 0)
    launch = proxy_family.launch(
        device.index,
        dtype,
        "paged" if paged else "flat",
        max_seqlen_q,
        kv_heads,
        bool(causal),
        q_offset is not None,
        bool(reduce_heads),
        logit_scale,
        fp32_sums,
    )
    tensors = (
        q,
        kernel_k,
        *(x.view(-1) for _, x in scales),
        cu_seqlens_q,
        unused if paged else cu_seqlens_k,
        seqused_k if paged else unused,
        page_table if paged else unused.view(1, 1),
        unused if q_offset is None else q_offset,
        output,
    )
    with torch.cuda.device(device):
        ops.launch(launch, tensors)
    return output


def quantize_write_kv_nvfp4(k, v, slots, pages, *, k_global_scale: float, v_global_scale: float):
    """Quantize the new tokens' k and v (T, Hkv, 128) bf16 / fp16 to NVFP4 and write token i
    into the packed pages (P, Hkv * 18432) uint8 at slot slots[i] (int32 (T,): page
    slots // 128, row slots % 128; negative: skipped), in place, in one launch. Returns pages.

    The page layout is the MSA contract's (K data, K scales, V data, V scales with the 4x4
    swizzle; reference.nvfp4_page_views). Each 16 channels get the scale
    e4m3(min(amax / 6 / global scale, 448)) rounded to nearest even, and each value the E2M1
    code nearest to x / (scale * global scale), ties to the even code, magnitudes beyond 5
    to 6 (|x| beyond 2688 * scale * global saturates): bit for bit
    reference.nvfp4_write_slots. A NaN in a group makes its scale NaN and its codes 0.
    Global scales are the dequantization multipliers (positive, finite). Slots are not
    checked on the GPU (a slot past the pages writes out of bounds); two tokens with one
    slot leave either's values."""
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    head_dim = nvfp4_family.constant("head_dim")
    if k.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"k must be bf16 or fp16, got {k.dtype}")
    if v.dtype != k.dtype or v.shape != k.shape:
        raise ValueError(f"v must match k ({k.dtype} {tuple(k.shape)}), got {describe(v)}")
    for name, x in (("k", k), ("v", v)):
        _check_rows(name, x, "T, Hkv", head_dim)
    tokens, heads = k.shape[:2]
    device = k.device
    _index_vector("slots", slots, tokens, device)
    page_bytes = heads * nvfp4_family.constant("page_bytes_per_head")
    if (
        not isinstance(pages, torch.Tensor)
        or pages.dtype != torch.uint8
        or pages.dim() != 2
        or pages.shape[1] != page_bytes
        or pages.stride(1) != 1
        or pages.device != device
    ):
        raise ValueError(
            f"pages must be uint8 (pages, Hkv * 18432 = {page_bytes}) on {device} with unit "
            f"stride on the last dim, got {describe(pages)}"
        )
    for name, value in (("k_global_scale", k_global_scale), ("v_global_scale", v_global_scale)):
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    check_writable("pages", pages, (("k", k), ("v", v), ("slots", slots)))
    if device.type != "cuda":
        raise ValueError(f"k is on {device}; quantize_write_kv_nvfp4 needs a CUDA device")
    if tokens and heads:
        launch = nvfp4_family.launch(
            device.index, NAME_OF[k.dtype], float(k_global_scale), float(v_global_scale)
        )
        with torch.cuda.device(device):
            ops.launch(launch, (k, v, slots, pages))
    return pages


def _output(output, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """`output` if it is a contiguous `dtype` tensor of `shape` on `device`; a new one for
    None."""
    if output is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if (
        not isinstance(output, torch.Tensor)
        or output.dtype != dtype
        or tuple(output.shape) != shape
        or output.device != device
        or not output.is_contiguous()
    ):
        name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"output must be a contiguous {name} tensor of shape {shape} on {device}, got "
            f"{describe(output)}"
        )
    return output


def _check_rows(name: str, x: torch.Tensor, dims: str, head_dim: int) -> None:
    """x must be 3-D (dims..., head_dim) with unit stride on its last dim."""
    if x.dim() != 3 or x.shape[2] != head_dim or x.stride(2) != 1:
        raise ValueError(
            f"{name} must be ({dims}, {head_dim}) with unit stride on the last dim, got "
            f"{describe(x)}"
        )


def _key_layout(cu_seqlens_k, page_table, seqused_k, what: str) -> bool:
    """Whether the keys are paged (page_table and seqused_k) or flat (cu_seqlens_k)."""
    paged = page_table is not None or seqused_k is not None
    if paged and cu_seqlens_k is not None:
        raise ValueError(f"give cu_seqlens_k (flat {what}) or page_table and seqused_k, not both")
    if paged and (page_table is None or seqused_k is None):
        raise ValueError(f"paged {what}: give both page_table and seqused_k")
    if not paged and cu_seqlens_k is None:
        raise ValueError(f"flat {what}: give cu_seqlens_k (or page_table and seqused_k)")
    return paged


def _check_sequences(cu_seqlens_q, cu_seqlens_k, page_table, seqused_k, q_offset, device):
    """The per-sequence index tensors: cu_seqlens_q (B + 1,), then cu_seqlens_k (B + 1,) for
    flat keys or page_table (B, W) and seqused_k (B,) for paged ones, and q_offset (B,) if
    given; int32 on `device`."""
    batch = _index_vector("cu_seqlens_q", cu_seqlens_q, None, device) - 1
    if batch < 1:
        raise ValueError(f"cu_seqlens_q must hold B + 1 >= 2 offsets, got {describe(cu_seqlens_q)}")
    if page_table is not None:
        _index_vector("seqused_k", seqused_k, batch, device)
        if (
            not isinstance(page_table, torch.Tensor)
            or page_table.dtype != torch.int32
            or page_table.dim() != 2
            or page_table.shape[0] != batch
            or page_table.device != device
            or page_table.stride(1) != 1
        ):
            raise ValueError(
                f"page_table must be int32 (B = {batch}, W) on {device} with unit stride on "
                f"its last dim, got {describe(page_table)}"
            )
    else:
        _index_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, device)
    if q_offset is not None:
        _index_vector("q_offset", q_offset, batch, device)


def _index_vector(name: str, t, length, device) -> int:
    """Check an int32 vector argument on the device (length: None for any); its length."""
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != torch.int32
        or t.dim() != 1
        or (length is not None and t.shape[0] != length)
        or t.device != device
        or not t.is_contiguous()
    ):
        want = "" if length is None else f" of length {length}"
        raise ValueError(
            f"{name} must be a contiguous int32 vector{want} on {device}, got {describe(t)}"
        )
    return t.shape[0]


def msa_topk_select(
    max_score,
    topk: int,
    num_valid_pages=None,
    output=None,
    force_begin_blocks: int = 0,
    force_end_blocks: int = 0,
):
    """max_score (Hq, P, S): fp32, contiguous, block scores of S < 2^30 tokens over P blocks.
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
    if tokens >= 2**30:
        raise ValueError(
            f"max_score has {tokens} tokens (S); msa_topk_select takes fewer than 2^30 (the "
            "kernel steps through a token's blocks with a 32-bit byte stride)"
        )
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
    output = _output(output, (tokens, heads, want), torch.int32, device)
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
            f"{device}, got {describe(num_valid_pages)}"
        )
    return num_valid_pages


def _constant_count(device: torch.device, value: int) -> torch.Tensor:
    """A one-element int32 tensor kept per (device, value): a call per layer with the same
    count launches no fill kernel and allocates nothing. Made afresh during a CUDA graph
    capture (planner.device_constant): a tensor kept from one would hold its value only
    once the graph had replayed."""
    return device_constant(
        ("count", value), device, lambda: torch.full((1,), value, dtype=torch.int32, device=device)
    )


class MSASparseAttentionWorkspace:
    """Caller-owned storage for capturing MSA attention in a CUDA graph, accepted for call
    compatibility. Our kernels need no scratch memory: msa_sparse_attention and
    msa_sparse_decode_attention capture and replay as they are, with or without one."""

    def __init__(self, device=None):
        self.device = torch.device("cuda" if device is None else device)


def supports_packed_kv(device=None) -> bool:
    """Whether msa_sparse_attention / msa_sparse_decode_attention take packed NVFP4 paged
    K/V (the four regions of one allocation as strided views) on `device`: True wherever
    this build has the NVFP4 kernels for the device's arch (every arch it supports)."""
    device = torch.device("cuda" if device is None else device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return attention_family.built_for(index, "nvfp4")


def _nvfp4_hand_off_route_words() -> str:
    """What NVFP4 prefill's hand-off route runs (_stages), in words, for its stats."""
    warpgroups = WGMMA_WARPGROUPS["nvfp4"]
    stages = _stages("hybrid", "nvfp4", warpgroups)
    words = (
        f"the wgmma union tile of {warpgroups} warpgroups ({4 * warpgroups} tokens x 16 heads "
        "a CTA; NVFP4 tiles TMA-gathered by page and converted into fp16 tiles in shared "
        f"memory) for the tokens whose union is at most {stages[0][2]} x topk blocks, then "
    )
    if len(stages) == 3:
        words += (
            "the 4-token tile (one warpgroup) for those of the others whose 4 tokens' union "
            f"is at most {stages[1][2]} x topk blocks, then "
        )
    return words + "msa_sparse_decode_attention's one-token kernel for the others"


def _nvfp4_route_stats(kind: str) -> dict:
    return {
        "route": f"msa_sparse_{kind}_attention, NVFP4 paged K/V",
        "available": bool(torch.cuda.is_available() and supports_packed_kv()),
        "compute_capabilities": ["9.0 (run)", "10.0 (built, not run)", "12.0 (built, not run)"],
        "kernel": (
            f"G = 16 on sm_90a where its grid fills the GPU: {_nvfp4_hand_off_route_words()}"
            "; other G = 16 launches: the one-token kernel; other G: portable mma.sync union "
            "tile, raw NVFP4 tiles copied a tile ahead by cp.async and decoded into shared "
            "memory, launches with fewer tiles than SMs splitting each tile's keys across "
            "CTAs, fp32 partials merged by their lse (a second launch)"
            if kind == "prefill"
            else "portable mma.sync, one token's heads a CTA, each warp a quarter of every "
            "block: raw NVFP4 rows copied stages ahead by cp.async into each warp's ring and "
            "decoded from there into MMA operands; launches with fewer CTAs than SMs split "
            "each token's blocks across CTAs, fp32 partials merged by their lse (a second "
            "launch)"
        ),
        "head_dim": attention_family.constant("head_dim"),
        "page_size": attention_family.constant("block_keys"),
        "group_sizes": f"any Hq / Hkv <= {attention_family.constant('max_group')}",
        "topk_range": (1, attention_family.constant("max_topk")),
        "seqlen_q": "any (decode: seqlen_q tokens per request)",
        "layouts": (
            "packed pages (strided views) or separate tensors, paged only; scale rows of "
            "8 contiguous bytes, page and head strides multiples of 16"
        ),
        "causal": "causal and non-causal",
        "lse": "lse and temperature lse",
        "out": "out= accepted",
        "q_offset": kind == "prefill",
        "graph_capture": "no workspace or warm-up needed",
        "toolkit_decline_reason": None,
        # Always: no order-dependent atomics (the split merge sums in split order).
        "run_to_run_bitwise_reproducible_up_to_context": None,
        "max_blocks_per_sequence": attention_family.constant("max_blocks"),
    }


def msa_prefill_nvfp4_specialized_stats() -> dict:
    """What the NVFP4 prefill route accepts (msa_sparse_attention with packed pages)."""
    return _nvfp4_route_stats("prefill")


def msa_decode_nvfp4_specialized_stats() -> dict:
    """What the NVFP4 decode route accepts (msa_sparse_decode_attention with packed pages)."""
    return _nvfp4_route_stats("decode")


def msa_sparse_attention(
    q,
    k,
    v,
    q2k_indices,
    cu_seqlens_q,
    cu_seqlens_k=None,
    causal: bool = False,
    softmax_scale=None,
    page_table=None,
    seqused_k=None,
    return_softmax_lse: bool = False,
    k_scale=None,
    v_scale=None,
    k_global_scale=None,
    v_global_scale=None,
    q_offset=None,
    return_temperature_lse: bool = False,
    lse_temperature_scale: float = 1.0,
    workspace=None,
    out=None,
):
    """MiniMax sparse attention: query i of sequence b, head h attends to the keys of the
    128-key blocks listed in q2k_indices[h // G, i] (int32 (Hkv, total_q, topk), topk 1 to
    32; -1 entries, repeats and ids past the sequence's blocks are ignored) that lie inside
    the sequence and, with causal, at positions <= q_offset[b] + i (q_offset defaults to
    seqlen_k - seqlen_q). out = softmax(softmax_scale * q.k) V * v_global_scale (scale
    default 1/sqrt(128)); a query that sees no key gets 0 (and lse -inf).

    q (total_q, Hq, 128) bf16 / fp16 with cu_seqlens_q (B + 1,); Hq = G * Hkv, G <= 16.
    K/V, each of:
      * q's dtype;
      * float8_e4m3fn, times k_scale / v_scale (floats, default 1);
      * NVFP4 (paged only): uint8 e2m1 data (pages, Hkv, 128, 64), two codes a byte with
        the even element in the low nibble, with k_scale / v_scale the e4m3 scales
        (pages, Hkv, 128, 8) (uint8 or float8_e4m3fn; V's in the 4x4 swizzle of the
        packed page) and the required k_global_scale / v_global_scale: value = code x
        scale x global scale. The regions of packed pages are strided views
        (reference.nvfp4_page_views); separate tensors work the same. Scales: each
        (page, head)'s 128 rows of 8 bytes contiguous, page and head strides multiples of
        16 bytes (what packed pages and contiguous tensors give).
    Layout: flat (total_k, Hkv, X) with cu_seqlens_k, or paged (pages, Hkv, 128, X) with
    page_table (B, W) and seqused_k (B,); unit stride on the last dim (strided views such
    as the halves of an interleaved (pages, Hkv, 128, 256) FP8 cache are fine).

    Returns out (total_q, Hq, 128) in q's dtype (into `out` if given), with
    return_softmax_lse also lse = ln sum exp(scale * s) fp32 (total_q, Hq), and with
    return_temperature_lse also the temperature lse (scale * lse_temperature_scale).
    Kernels (_prefill_tile): at G = 16 where the union tile on wgmma is built (sm_90a) and its
    grid fills the GPU, that tile with bf16 / fp16 K/V (4 tokens a CTA); with FP8 or NVFP4 K/V
    the hand-off route (_stages): that tile of 2 warpgroups (8 tokens a CTA) for the groups of
    tokens whose blocks overlap enough (a union of at most FOUR_TOKEN_HAND_OFF x topk blocks),
    then the 4-token tile for the groups of 4 of the others whose union is at most HAND_OFF x
    topk, then the one-token kernel of msa_sparse_decode_attention (each token reads only its
    own blocks) for the rest. Selections shared by 8 tokens run fastest there; shared in part
    (a union of 1.2-2.1 x topk for 8 tokens) within 3% of the 4-token tile alone.
    Smaller launches with FP8 or NVFP4 K/V: the one-token kernel; otherwise the mma.sync union
    tile. A union tile's CTA walks the union of its tokens' blocks once, each row masked to its
    own: fastest when neighbouring tokens share their blocks. Non-finite values: a NaN or inf in
    K reaches only the rows that attend to its key; one in V also reaches, as 0 x inf, rows that
    multiply its 64-key tile without attending to that key, as in dense attention kernels: a row
    whose causal limit falls inside the tile, and rows of other tokens sharing the tile's MMA
    (in the wgmma tile the CTA's 4 or 8 tokens, in the mma.sync union tile the tokens of one
    warp's 16 rows: none other at G = 16). Values past each sequence never reach the output. One
    launch (two or three for the hand-off route; when a small batch's keys are split across
    CTAs, a second merges the fp32 partials), no host synchronisation: CUDA-graph capturable
    (`workspace`, an MSASparseAttentionWorkspace, is accepted and not needed). The index values
    are not checked on the host (that would need a host synchronisation): ids outside [0, blocks
    of the sequence) and blocks whose page id lies outside the cache are skipped like -1;
    offsets (cu_seqlens_q / _k, seqused_k) past the tensors read out of bounds."""
    return _attention(
        q, k, v, q2k_indices, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, page_table,
        seqused_k, return_softmax_lse, k_scale, v_scale, k_global_scale, v_global_scale,
        q_offset, return_temperature_lse, lse_temperature_scale, workspace, out, tile="auto",
    )  # fmt: skip


def msa_sparse_decode_attention(
    q,
    k,
    v,
    q2k_indices,
    *,
    page_table=None,
    seqused_k=None,
    cu_seqlens_k=None,
    seqlen_q: int = 1,
    causal: bool = True,
    softmax_scale=None,
    return_softmax_lse: bool = False,
    k_scale=None,
    v_scale=None,
    k_global_scale=None,
    v_global_scale=None,
    return_temperature_lse: bool = False,
    lse_temperature_scale: float = 1.0,
    partial_dtype=None,
    force_fused: bool = False,
    workspace=None,
    out=None,
    lse=None,
):
    """Sparse decode: q (B * seqlen_q, Hq, 128), request b's token j at position
    seqlen_k - seqlen_q + j; otherwise msa_sparse_attention's contract (K/V formats and
    layouts, q2k_indices (Hkv, B * seqlen_q, topk), returns). The kernel takes one token's
    G heads a CTA (no union of tokens: each token reads only its own blocks), its warps
    splitting every block; when the batch gives fewer CTAs than the GPU has SMs, each
    token's blocks are split across CTAs whose fp32 partials (O, lse) a second launch
    merges by their lse. partial_dtype (None or
    torch.float32: the partials are fp32) and force_fused are accepted and change nothing.
    `lse`: a buffer (B * seqlen_q, Hq) fp32 for the lse (natural log)."""
    if not isinstance(seqlen_q, int) or isinstance(seqlen_q, bool) or seqlen_q < 1:
        raise ValueError(f"seqlen_q must be an int >= 1, got {seqlen_q!r}")
    if partial_dtype not in (None, torch.float32):
        raise ValueError(f"partial_dtype must be None or torch.float32, got {partial_dtype}")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {describe(q)}")
    if q.dim() != 3 or q.shape[0] % seqlen_q:
        raise ValueError(
            f"q must be (B * seqlen_q, Hq, 128) with seqlen_q = {seqlen_q}, got {describe(q)}"
        )
    batch = q.shape[0] // seqlen_q
    cu_seqlens_q = uniform_offsets(batch, seqlen_q, q.device)
    return _attention(
        q, k, v, q2k_indices, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, page_table,
        seqused_k, return_softmax_lse, k_scale, v_scale, k_global_scale, v_global_scale,
        None, return_temperature_lse, lse_temperature_scale, workspace, out, lse, tile="token",
    )  # fmt: skip


# tile="hybrid": a wgmma union tile whose union has more than HAND_OFF[kv_format][warpgroups]
# x topk blocks hands its tokens to the one-token kernel. The values are where the two
# kernels' times cross on MP1's shape with selections shared in part (block 0, the own block,
# s blocks drawn per 16-token group and 14 - s per token; s from 14 down to 6: bench's
# "shared:s", `python -m sparseforge.bench --msa --msa-modes shared:13,...`), the wgmma tile
# forced alone against the one-token kernel, two interleaved rounds on an H100
# (bench/results/2026-12-05_h100_msa_warpgroups_hand_off.md): FP8 1.46 / 1.65 / 1.55 and
# NVFP4 1.44 / 1.79 / 1.79 x topk at 1 / 2 / 4 warpgroups, 16-bit 3.1 at 4 and past the
# sweep's 3.07 at 2 (3.2 extrapolated); 16-bit at one warpgroup keeps 2.8, the H200 sweep of
# the route (bench/results/2026-12-04_1d463a9_h200_msa_hand_off.md), where that sweep gives
# ~2.9. FP8 at one warpgroup is 1.8 since its tile runs S on e4m3 wgmma and four CTAs an SM:
# on the hand-off route (2 warpgroups, 4-token stage 1.1), MP1 on an H100, two rounds, ms at
# s = 14 (chunked) / 13 / 12 / 11 / 10 / per-token, 1.45: 4.62-4.66 / 6.08-6.12 / 7.22-7.36 /
# 8.56 / 9.62-9.70 / 10.19-10.28, 1.8: 4.57-4.66 / 6.04-6.08 / 7.13-7.18 / 8.01-8.04 /
# 8.79-9.01 / 10.17-10.29 (bench/results/2026-12-05_h100_msa_fp8_overlap.md).
HAND_OFF = {
    "16bit": {1: 2.8, 2: 3.2, 4: 3.1},
    "e4m3": {1: 1.8, 2: 1.65, 4: 1.55},
    "nvfp4": {1: 1.45, 2: 1.8, 4: 1.8},
}
# The wgmma union tile's warpgroups a CTA (4 tokens each) by K/V format, on both routes that
# run it. MP1 on an H100, three interleaved rounds (same results file): with chunk-shared
# selections 2 warpgroups take FP8 from 5.52 to 4.89 ms and NVFP4 from 7.45 to 5.80 on the
# hand-off route (4 warpgroups: 5.25 / 5.79), with per-token ones the route is the same
# (10.06 -> 9.99, 12.96 -> 12.87: tiles handed off). The cost: selections shared in part
# (16 tokens sharing 12-13 of their 14 drawn blocks) run up to 20% slower on 2 warpgroups.
# 16-bit K/V keeps one (its route: the tile alone): on 2 warpgroups chunk-shared selections
# take 3.74-4.12 ms on the hand-off route (3.62-3.68 alone) against 3.85-3.89, per-token ones
# 15.08 (20.67 alone) against 13.93.
WGMMA_WARPGROUPS = {"16bit": 1, "e4m3": 2, "nvfp4": 2}
# The hand-off route's 4-token stage (_stages) by K/V format: a tile of several warpgroups
# hands a union of more than this x topk blocks to the 4-token tile. Same sweep on an H200, two
# interleaved rounds, route ms at s = 14 / 13 / 12 / 11 / 10 (8-token unions 0.89 / 1.23 /
# 1.54 / 1.84 / 2.11 x topk; bench/results/2026-12-05_h200_msa_four_token_stage.md):
# FP8 at 1.1: 5.01 / 6.99 / 8.11 / 9.45 / 10.05 against 2 warpgroups alone 4.97-5.02 / 7.26 /
# 9.53 / 9.96 / 10.01 and one 5.62-5.66 / 6.79 / 7.93 / 9.26 / 9.88 (0.9 loses s = 14: 5.59);
# NVFP4 at 1.6: 5.94 / 8.63 / 10.74 / 12.33 / 13.06 against 5.90 / 8.58-8.60 / 11.33 / 12.72-
# 12.74 / 12.88-12.89 and 7.58 / 9.06 / 10.50 / 12.14 / 12.87 (1.35: s = 13 8.87). 16-bit runs
# one warpgroup (no stage).
FOUR_TOKEN_HAND_OFF = {"16bit": None, "e4m3": 1.1, "nvfp4": 1.6}


def _stages(tile: str | None, kv_format: str, warpgroups: int) -> tuple:
    """The launches of a route, in order: (kernel, warpgroups, hand_off, hand_in) each.
    "hybrid": the wgmma union tile, then the one-token kernel for the tokens of the tiles it
    hands off (a union of more than HAND_OFF x topk blocks); with FOUR_TOKEN_HAND_OFF, a tile
    of several warpgroups hands its large unions to the 4-token tile first, which keeps them
    or hands them on by HAND_OFF at one warpgroup. Other routes: the one kernel."""
    if tile != "hybrid":
        return ((tile, warpgroups, 0.0, False),)
    to_four = FOUR_TOKEN_HAND_OFF[kv_format] if warpgroups > 1 else None
    if to_four is None:
        last = HAND_OFF[kv_format][warpgroups]
        return ("wgmma", warpgroups, last, False), ("token", 1, last, False)
    last = HAND_OFF[kv_format][1]
    return (
        ("wgmma", warpgroups, to_four, False),
        ("wgmma", 1, last, True),
        ("token", 1, last, False),
    )


def _prefill_tile(kv_format: str, group: int, device, tokens: int, kv_heads: int):
    """msa_sparse_attention's kernel at G = 16 when the wgmma union tile (sm_90a) is built
    for the K/V format and its grid (4 tokens a warpgroup, WGMMA_WARPGROUPS a CTA, never
    split) fills the GPU: for 16-bit K/V that tile ("wgmma"; of several warpgroups, the
    hand-off route), for FP8 and NVFP4 K/V the hand-off route ("hybrid": the wgmma tile
    keeps the tiles whose tokens share their blocks and hands the others to the one-token
    kernel). Otherwise the one-token kernel ("token") for FP8 and NVFP4 K/V (it
    splits small launches and converts each block once a token) and the mma.sync union
    tile (None) for 16-bit K/V and at other G.
    MP1 on the H200, ms (bench/results/2026-12-04_1d463a9_h200_msa_hand_off.md, each kernel
    beside the others in one process, two rounds): chunk-shared / per-token selections,
    16-bit K/V wgmma 4.35-4.44 / 15.21, hand-off 4.50-4.57 / 14.24-14.25 (its second
    launch of one-token CTAs that exit costs ~3% where every tile stays), one-token
    14.72-14.80 / 15.14-15.15; FP8 wgmma 6.27-6.30 / 21.56, hand-off 6.49-6.55 /
    12.45-12.47, one-token 12.28 / 12.17-12.28; NVFP4 wgmma 10.38 / 33.34-33.36, hand-off
    10.47-10.52 / 14.48-14.51, one-token 14.23 / 14.24-14.25."""
    if group != attention_family.constant("wgmma_group"):
        return None
    rows = attention_family.constant("tile_rows") * WGMMA_WARPGROUPS[kv_format]
    ctas = tokens * group // rows * kv_heads
    fills = _wgmma_built(device.index, kv_format) and ctas >= _multiprocessors(device)
    if kv_format != "16bit":
        return "hybrid" if fills else "token"
    if WGMMA_WARPGROUPS[kv_format] > 1:  # 8 or 16 tokens' union: per-token ones handed off
        return "hybrid" if fills else None
    return "wgmma" if fills else None


@functools.lru_cache(maxsize=16)
def _wgmma_built(device_index: int, kv_format: str) -> bool:
    return attention_family.built_for(device_index, kv_format, "wgmma")


def _splits(device, ctas: int, topk: int) -> int:
    """CTAs per tile: 1, or, when the launch has fewer tiles (`ctas`) than the GPU has SMs
    (small-batch decode), enough to give each SM about two CTAs, at most max_splits and at
    most topk (a one-token tile has at most topk blocks to share)."""
    sms = _multiprocessors(device)
    if ctas >= sms:
        return 1
    return max(1, min(attention_family.constant("max_splits"), -(-2 * sms // ctas), topk))


@functools.lru_cache(maxsize=16)
def _multiprocessors(device: torch.device) -> int:
    return multiprocessors(device.index)


@functools.lru_cache(maxsize=16)
def _no_partials(device: torch.device) -> tuple:
    """The split outputs of a launch without splits (never written)."""
    head_dim = attention_family.constant("head_dim")
    return (
        torch.empty((1, 1, 1, head_dim), device=device),
        torch.empty((1, 1, 1, 1), device=device),
    )


@functools.lru_cache(maxsize=16)
def _no_scales(device: torch.device) -> torch.Tensor:
    """The NVFP4 scale arguments of the other K/V formats' kernels (never read)."""
    return torch.zeros((1, 1, 2, 8), dtype=torch.uint8, device=device)


def _positive(name: str, value, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _kv_view(name: str, x, paged: bool, width: int, block: int) -> torch.Tensor:
    """x as the kernel's (pages, Hkv, rows, width) view: paged as is, flat as one page."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {describe(x)}")
    if paged:
        if x.dim() != 4 or x.shape[2:] != (block, width) or x.stride(3) != 1:
            raise ValueError(
                f"paged {name} must be (pages, Hkv, {block}, {width}) with unit stride on the "
                f"last dim, got {describe(x)}"
            )
        view = x
    else:
        _check_rows(f"flat {name}", x, "total_k, Hkv", width)
        tokens, heads = x.shape[:2]
        view = x.as_strided(
            (1, heads, tokens, width), (max(tokens, 1) * x.stride(0), x.stride(1), x.stride(0), 1)
        )
    vector = 16 if x.element_size() == 1 else 8  # elements of a 16-byte load
    if any(s % vector for s in view.stride()[:3]) or x.data_ptr() % 16:
        raise ValueError(
            f"{name} must be 16-byte aligned with strides that are multiples of {vector} "
            f"elements, got {describe(x)}"
        )
    return view


def _attention(
    q, k, v, q2k_indices, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, page_table,
    seqused_k, return_softmax_lse, k_scale, v_scale, k_global_scale, v_global_scale,
    q_offset, return_temperature_lse, lse_temperature_scale, workspace, out, lse=None,
    tile=None,
):  # fmt: skip
    """msa_sparse_attention's checks and launch (msa_sparse_decode_attention's too); `lse`:
    the caller's buffer for the lse (implies return_softmax_lse); `tile`: None for the union
    tile kernel, "wgmma" for its sm_90a form (G = 16, never split),
    "token" for the one-token kernel, "hybrid" for the wgmma tile handing tiles of little
    shared selection to the one-token kernel (HAND_OFF), "auto" for prefill's choice
    (_prefill_tile)."""
    head_dim = attention_family.constant("head_dim")
    block = attention_family.constant("block_keys")
    for name, x in (("q", q), ("k", k), ("v", v), ("q2k_indices", q2k_indices)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {describe(x)}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError(f"q has dtype {q.dtype}: bf16 and fp16 are built")
    _check_rows("q", q, "total_q, Hq", head_dim)
    if any(s % 8 for s in q.stride()[:2]) or q.data_ptr() % 16:
        raise ValueError(
            f"q must be 16-byte aligned with strides in multiples of 8, got {describe(q)}"
        )
    total_q, heads = q.shape[:2]
    device = q.device
    if workspace is not None and not isinstance(workspace, MSASparseAttentionWorkspace):
        raise TypeError(
            "workspace must be an MSASparseAttentionWorkspace or None, got "
            f"{type(workspace).__name__}"
        )

    # K/V format.
    if k.dtype != v.dtype:
        raise ValueError(f"k and v must have one dtype, got {k.dtype} and {v.dtype}")
    if k.dtype == q.dtype:
        kv_format, width = "16bit", head_dim
    elif k.dtype == torch.float8_e4m3fn:
        kv_format, width = "e4m3", head_dim
    elif k.dtype == torch.uint8:
        kv_format, width = "nvfp4", head_dim // 2
    else:
        raise ValueError(
            f"k and v have dtype {k.dtype}: give q's dtype {q.dtype}, float8_e4m3fn, or uint8 "
            "NVFP4 data"
        )
    scale = _positive("softmax_scale", softmax_scale, 1.0 / math.sqrt(head_dim))
    temperature = _positive("lse_temperature_scale", lse_temperature_scale, 1.0)
    out_scale = _positive("v_global_scale", v_global_scale, 1.0)
    key_scale = 1.0
    k_scales = v_scales = _no_scales(device)
    if kv_format == "16bit":
        for name, value in (
            ("k_scale", k_scale),
            ("v_scale", v_scale),
            ("k_global_scale", k_global_scale),
        ):
            if value is not None:
                raise ValueError(f"{name} applies to FP8 or NVFP4 K/V; k and v are {k.dtype}")
    elif kv_format == "e4m3":
        if k_global_scale is not None:
            raise ValueError("k_global_scale applies to NVFP4 K/V; give FP8 K's scale as k_scale")
        key_scale = _positive("k_scale", k_scale, 1.0)
        out_scale *= _positive("v_scale", v_scale, 1.0)
    else:
        if page_table is None:
            raise ValueError("NVFP4 K/V are paged only: give page_table and seqused_k")
        if k_global_scale is None or v_global_scale is None:
            raise ValueError("NVFP4 K/V need k_global_scale and v_global_scale")
        key_scale = _positive("k_global_scale", k_global_scale, 1.0)
        k_scales = _nvfp4_scales("k_scale", k_scale, k, block, device)
        v_scales = _nvfp4_scales("v_scale", v_scale, v, block, device)

    paged = _key_layout(cu_seqlens_k, page_table, seqused_k, "K/V")
    kernel_k = _kv_view("k", k, paged, width, block)
    kernel_v = _kv_view("v", v, paged, width, block)
    kv_heads = k.shape[1]
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if (
        kv_heads == 0
        or heads % kv_heads
        or heads // kv_heads > attention_family.constant("max_group")
    ):
        raise ValueError(
            f"Hq = {heads} must be a multiple of Hkv = {kv_heads} with at most "
            f"{attention_family.constant('max_group')} query heads per kv head"
        )
    for name, x in (("k", k), ("v", v), ("q2k_indices", q2k_indices)):
        if x.device != device:
            raise ValueError(f"{name} is on {x.device}, q on {device}")
    max_topk = attention_family.constant("max_topk")
    if (
        q2k_indices.dtype != torch.int32
        or q2k_indices.dim() != 3
        or q2k_indices.shape[:2] != (kv_heads, total_q)
        or not 1 <= q2k_indices.shape[2] <= max_topk
        or q2k_indices.stride(2) != 1
    ):
        raise ValueError(
            f"q2k_indices must be int32 (Hkv = {kv_heads}, total_q = {total_q}, topk) with "
            f"1 <= topk <= {max_topk} and unit stride on the last dim, got "
            f"{describe(q2k_indices)}"
        )
    _check_sequences(cu_seqlens_q, cu_seqlens_k, page_table, seqused_k, q_offset, device)
    max_blocks = attention_family.constant("max_blocks")
    if paged:
        if page_table.shape[1] > max_blocks:
            raise ValueError(
                f"page_table has {page_table.shape[1]} columns; at most {max_blocks} are supported"
            )
    elif k.shape[0] > max_blocks * block:
        raise ValueError(
            f"flat K/V hold {k.shape[0]} keys; at most {max_blocks * block} are supported"
        )

    want_lse = bool(return_softmax_lse or return_temperature_lse or lse is not None)
    out = _output(out, (total_q, heads, head_dim), q.dtype, device)
    if lse is not None:
        lse = _output(lse, (total_q, heads), torch.float32, device)
        check_writable("lse", lse, [("out", out)])
    else:
        lse = torch.empty((total_q, heads), dtype=torch.float32, device=device)
    lse_t = torch.empty_like(lse) if return_temperature_lse else lse
    inputs = [
        ("q", q),
        ("k", k),
        ("v", v),
        ("q2k_indices", q2k_indices),
        ("cu_seqlens_q", cu_seqlens_q),
    ]
    for name, t in (
        ("cu_seqlens_k", cu_seqlens_k),
        ("page_table", page_table),
        ("seqused_k", seqused_k),
        ("q_offset", q_offset),
        ("k_scale", k_scale if kv_format == "nvfp4" else None),
        ("v_scale", v_scale if kv_format == "nvfp4" else None),
    ):
        if t is not None:
            inputs.append((name, t))
    check_writable("out", out, inputs)
    if tile == "auto":  # a variant forced by SPARSEFORGE_VARIANT, else prefill's choice
        tile = attention_family.forced_tile(kv_format)
    wgmma_group = attention_family.constant("wgmma_group")
    if tile in ("wgmma", "hybrid") and heads // kv_heads != wgmma_group:
        raise ValueError(
            f"the wgmma union tile takes {wgmma_group} query heads per "
            f"kv head; Hq = {heads}, Hkv = {kv_heads}"
        )
    if device.type != "cuda":
        raise ValueError(f"q is on {device}; msa_sparse_attention needs a CUDA device")
    if tile == "auto":
        tile = _prefill_tile(kv_format, heads // kv_heads, device, total_q, kv_heads)

    if total_q:
        unused = _constant_count(device, 0)
        if tile == "token":
            ctas = total_q * kv_heads
        else:  # the union kernel's grid, as it bounds it
            tokens_per_cta = attention_family.constant("tile_rows") // (heads // kv_heads)
            ctas = (total_q // tokens_per_cta + cu_seqlens_q.shape[0] - 1) * kv_heads
        splits = _splits(device, ctas, q2k_indices.shape[2])
        warpgroups = 1  # of the wgmma tile: the forced variant's, else prefill's choice
        if tile in ("wgmma", "hybrid"):  # one CTA a tile (and the one-token kernel unsplit)
            splits = 1
            warpgroups = (
                attention_family.forced_warpgroups(kv_format) or WGMMA_WARPGROUPS[kv_format]
            )
        partial_o, partial_lse = _no_partials(device)
        if splits > 1:
            partial_o = torch.empty((splits, total_q, heads, head_dim), device=device)
            partial_lse = torch.empty((splits, 2, total_q, heads), device=device)
        handed = unused.view(1, 1)
        if tile == "hybrid":  # per (token, kv head): handed on by the stage before
            handed = torch.empty((total_q, kv_heads), dtype=torch.int32, device=device)
        launches = [
            attention_family.launch(
                device.index,
                kv_format,
                NAME_OF[q.dtype],
                scale * key_scale * math.log2(math.e),
                out_scale,
                temperature,
                heads // kv_heads,
                paged,
                bool(causal),
                q_offset is not None,
                want_lse,
                splits,
                kernel,
                hand_off,
                stage_warpgroups,
                hand_in,
            )
            for kernel, stage_warpgroups, hand_off, hand_in in _stages(tile, kv_format, warpgroups)
        ]
        tensors = (
            q,
            kernel_k,
            kernel_v,
            k_scales,
            v_scales,
            q2k_indices,
            cu_seqlens_q,
            unused if paged else cu_seqlens_k,
            seqused_k if paged else unused,
            page_table if paged else unused.view(1, 1),
            unused if q_offset is None else q_offset,
            out,
            lse,
            lse_t,
            partial_o,
            partial_lse,
            handed,
        )
        with torch.cuda.device(device):
            for launch in launches:
                ops.launch(launch, tensors)
            if splits > 1:
                combine = combine_family.launch(device.index, NAME_OF[q.dtype], want_lse)
                ops.launch(combine, (partial_o, partial_lse, out, lse, lse_t))
    if return_temperature_lse:
        return out, lse, lse_t
    if return_softmax_lse:
        return out, lse
    return out


def prepare_msa_nvfp4_sparse_decode(
    q,
    k,
    v,
    q2k_indices,
    *,
    page_table,
    seqused_k,
    k_scale,
    v_scale,
    k_global_scale: float,
    v_global_scale: float,
    seqlen_q: int = 1,
    causal: bool = True,
    softmax_scale=None,
    out=None,
    lse=None,
    use_cache_hit: bool = False,
):
    """A runner of msa_sparse_decode_attention over packed NVFP4 pages: the arguments are
    checked now, and each call of the runner launches the decode on the tensors given here
    (update their contents in place between calls) and returns `out` (allocated here if not
    given; `lse`, if given, receives the natural-log lse). Preparing runs it once. seqlen_q
    1 to 32, G <= 16, topk 1 to 32. use_cache_hit is accepted and changes nothing: the
    kernel reads each token's own blocks (msa_sparse_decode_attention)."""
    if not isinstance(seqlen_q, int) or isinstance(seqlen_q, bool) or not 1 <= seqlen_q <= 32:
        raise ValueError(f"seqlen_q must be an int in [1, 32], got {seqlen_q!r}")
    if not isinstance(k, torch.Tensor) or k.dtype != torch.uint8:
        raise ValueError(f"k must be the uint8 NVFP4 data of packed pages, got {describe(k)}")
    kwargs = dict(
        page_table=page_table, seqused_k=seqused_k, seqlen_q=seqlen_q, causal=causal,
        softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale,
        k_global_scale=k_global_scale, v_global_scale=v_global_scale,
    )  # fmt: skip
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    msa_sparse_decode_attention(q, k, v, q2k_indices, **kwargs, out=out, lse=lse)

    def run():
        return msa_sparse_decode_attention(q, k, v, q2k_indices, **kwargs, out=out, lse=lse)

    return run


def _nvfp4_scales(name: str, scales, data, block: int, device) -> torch.Tensor:
    """NVFP4 group scales (pages, Hkv, 128, 8) uint8 / float8_e4m3fn beside `data`, as uint8."""
    groups = attention_family.constant("head_dim") // 16
    if (
        not isinstance(scales, torch.Tensor)
        or scales.dtype not in (torch.uint8, torch.float8_e4m3fn)
        or scales.dim() != 4
        or scales.shape != (data.shape[0], data.shape[1], block, groups)
        or scales.stride()[2:] != (groups, 1)
        or scales.stride(0) % 16
        or scales.stride(1) % 16
        or scales.data_ptr() % 16
        or scales.device != device
    ):
        raise ValueError(
            f"{name} must be the NVFP4 scales, uint8 or float8_e4m3fn "
            f"(pages, Hkv, {block}, {groups}) on {device}, each (page, head)'s rows contiguous "
            f"(strides (*, *, {groups}, 1), the first two multiples of 16, 16-byte aligned), "
            f"got {describe(scales)}"
        )
    return scales.view(torch.uint8)
