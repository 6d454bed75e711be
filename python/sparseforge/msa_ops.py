"""MiniMax sparse attention (MSA) operations, call-compatible with `flashinfer.msa_ops`.

    msa_proxy_score   per (query head, 128-key block, token), the max of the unscaled q.k
                      over the keys the token may see
    msa_topk_select   per (token, query head), the 16 key blocks it attends to, from the
                      proxy scores
    quantize_write_kv_nvfp4   new tokens' K and V into packed NVFP4 pages at their slots

Each call is one launch on the current stream with no host synchronisation when the sizes
it would otherwise read from the GPU are given (msa_proxy_score: max_seqlen_q and
max_k_tiles), so it can be captured in a CUDA graph. Kernels:
generator/kernels/portable/{msa_proxy_score,msa_topk_select,nvfp4_kv_write}.py (every arch);
PyTorch references: sparseforge.reference.msa_proxy_score, .msa_topk_select and
.nvfp4_write_slots.
"""

from __future__ import annotations

import functools
import math

import torch

from sparseforge import ops
from sparseforge.checks import check_writable
from sparseforge.dtypes import NAME_OF
from sparseforge.families import msa_proxy_score as proxy_family
from sparseforge.families import msa_topk_select as topk_family
from sparseforge.families import nvfp4_kv_write as nvfp4_family


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
    unwritten. The index values (offsets, lengths, page ids) are not checked on the GPU
    (that would need a host synchronisation): a page id outside the cache reads out of
    bounds. use_fp32_acc=False is accepted; the products are always summed in fp32."""
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise TypeError(f"q and k must be torch.Tensors, got {_describe(q)} and {_describe(k)}")
    head_dim = proxy_family.constant("head_dim")
    block = proxy_family.constant("block_keys")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        raise NotImplementedError(
            f"q has dtype {q.dtype}: bf16, fp16 and float8_e4m3fn (with k of the same dtype) "
            "are built"
        )
    if k.dtype != q.dtype:
        raise ValueError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    _check_rows("q", q, "total_q, Hq", head_dim)
    total_q, heads = q.shape[:2]
    device = q.device
    paged = page_table is not None or seqused_k is not None
    if paged:
        if cu_seqlens_k is not None:
            raise ValueError("give cu_seqlens_k (flat k) or page_table and seqused_k, not both")
        if page_table is None or seqused_k is None:
            raise ValueError("paged k needs both page_table and seqused_k")
        if k.dim() != 4 or k.shape[2:] != (block, head_dim) or k.stride(3) != 1:
            raise ValueError(
                f"paged k must be (pages, Hkv, {block}, {head_dim}) with unit stride on the "
                f"last dim, got {_describe(k)}"
            )
        if k.stride(0) != k.shape[1] * k.stride(1):
            raise ValueError(
                f"paged k's pages must hold their heads contiguously (stride(0) = Hkv * "
                f"stride(1)), got {_describe(k)}"
            )
        kv_heads = k.shape[1]
        kernel_k = k.flatten(0, 1)
    else:
        if cu_seqlens_k is None:
            raise ValueError("flat k needs cu_seqlens_k (or give page_table and seqused_k)")
        _check_rows("flat k", k, "total_k, Hkv", head_dim)
        kv_heads = k.shape[1]
        kernel_k = k
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"Hq = {heads} must be a multiple of Hkv = {kv_heads}")
    batch = _index_vector("cu_seqlens_q", cu_seqlens_q, None, device) - 1
    if batch < 1:
        raise ValueError(
            f"cu_seqlens_q must hold B + 1 >= 2 offsets, got {_describe(cu_seqlens_q)}"
        )
    if paged:
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
                f"its last dim, got {_describe(page_table)}"
            )
    else:
        _index_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, device)
    if q_offset is not None:
        _index_vector("q_offset", q_offset, batch, device)
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
    index_inputs = [("cu_seqlens_q", cu_seqlens_q), ("q", q), ("k", k)]
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
        raise ValueError(f"q is on {device}; msa_proxy_score needs a CUDA device")
    if k.device != device:
        raise ValueError(f"k is on {k.device}, q on {device}")
    if output.numel() == 0 or max_seqlen_q == 0:
        return output
    unused = _constant_count(device, 0)
    launch = proxy_family.launch(
        device.index,
        NAME_OF[q.dtype],
        "paged" if paged else "flat",
        max_seqlen_q,
        kv_heads,
        bool(causal),
        q_offset is not None,
        bool(reduce_heads),
    )
    tensors = (
        q,
        kernel_k,
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
        raise ValueError(f"v must match k ({k.dtype} {tuple(k.shape)}), got {_describe(v)}")
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
            f"stride on the last dim, got {_describe(pages)}"
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
            f"{_describe(output)}"
        )
    return output


def _check_rows(name: str, x: torch.Tensor, dims: str, head_dim: int) -> None:
    """x must be 3-D (dims..., head_dim) with unit stride on its last dim."""
    if x.dim() != 3 or x.shape[2] != head_dim or x.stride(2) != 1:
        raise ValueError(
            f"{name} must be ({dims}, {head_dim}) with unit stride on the last dim, got "
            f"{_describe(x)}"
        )


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
            f"{name} must be a contiguous int32 vector{want} on {device}, got {_describe(t)}"
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
