"""The SDSA (simplified DSA) indexer, call-compatible with `flashinfer.sdsa`: one index head,
FP32 q.k scores over 64-key pages of 128-dim keys, BF16 or NVFP4 (one e4m3 scale per 16
values, no global scale).

    quantize_write_index_qk_nvfp4   keys into a paged NVFP4 key cache and queries into NVFP4
                                    rows, one launch

Kernel: generator/kernels/portable/sdsa_quantize.py (every arch). PyTorch references of the
whole indexer (scores, threshold select, top-K, sample, thresholds): sparseforge.reference.
"""

from __future__ import annotations

import torch

from sparseforge import ops
from sparseforge.checks import check_writable, describe
from sparseforge.dtypes import NAME_OF
from sparseforge.families import sdsa as sdsa_family


def quantize_write_index_qk_nvfp4(
    key, slots, query, query_rows, *, key_cache, key_scales, packed_query, query_scales
):
    """Quantize key (T, 128) bf16 / fp16 to NVFP4 into key_cache (pages, 64, 64) uint8 and
    key_scales (pages, 64, 8) (uint8 or float8_e4m3fn) at slots (int64 (T,): page s // 64,
    row s % 64), and query (Q, 128) (key's dtype) into packed_query (R, 64) uint8 and
    query_scales (R, 8) at query_rows (int64 (Q,)); negative slots and rows are skipped. One
    launch, no host synchronisation. Rounding: scale = e4m3(amax / 6) to nearest even
    (saturating at 448), each value the nearest E2M1 with ties to the even code (|x| beyond
    2688 saturates), 0 where the scale is 0; bit for bit reference.quantize_write_index_qk_nvfp4.
    The cache's pages may be strided (data: a page stride that is a multiple of 16 bytes,
    scales: of 8, so both can be views of one allocation); rows are contiguous. Slot and row
    values are not checked on the GPU (that would need a host synchronisation): one past the
    cache writes out of bounds."""
    dim = sdsa_family.constant("key_dim")
    page = sdsa_family.constant("page_keys")
    for name, x in (("key", key), ("query", query)):
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{name} must be a bf16 or fp16 tensor, got {describe(x)}")
        if x.dim() != 2 or x.shape[1] != dim or x.stride(1) != 1:
            raise ValueError(
                f"{name} must be (rows, {dim}) with unit stride on the last dim, got {describe(x)}"
            )
    if query.dtype != key.dtype:
        raise ValueError(f"query must have key's dtype {key.dtype}, got {query.dtype}")
    device = key.device
    for name, rows, n in (
        ("slots", slots, key.shape[0]),
        ("query_rows", query_rows, query.shape[0]),
    ):
        if (
            not isinstance(rows, torch.Tensor)
            or rows.dtype != torch.int64
            or rows.shape != (n,)
            or rows.device != device
            or not rows.is_contiguous()
        ):
            raise ValueError(
                f"{name} must be a contiguous int64 vector of length {n} on {device}, got "
                f"{describe(rows)}"
            )
    key_scales = _bytes("key_scales", key_scales, (None, page, dim // 16), 8, device)
    key_cache = _bytes("key_cache", key_cache, (key_scales.shape[0], page, dim // 2), 16, device)
    query_scales = _bytes("query_scales", query_scales, (None, dim // 16), 8, device)
    packed_query = _bytes(
        "packed_query", packed_query, (query_scales.shape[0], dim // 2), 16, device
    )
    if query.device != device:
        raise ValueError(f"query is on {query.device}, key on {device}")
    inputs = (("key", key), ("slots", slots), ("query", query), ("query_rows", query_rows))
    outputs = (
        ("key_cache", key_cache),
        ("key_scales", key_scales),
        ("packed_query", packed_query),
        ("query_scales", query_scales),
    )
    for name, t in outputs:
        check_writable(name, t, inputs + tuple(o for o in outputs if o[0] != name))
    if device.type != "cuda":
        raise ValueError(f"key is on {device}; quantize_write_index_qk_nvfp4 needs a CUDA device")
    if key.shape[0] + query.shape[0]:
        launch = sdsa_family.quantize_launch(device.index, NAME_OF[key.dtype])
        with torch.cuda.device(device):
            ops.launch(
                launch,
                (key, slots, query, query_rows, key_cache, key_scales, packed_query, query_scales),
            )


def _bytes(name: str, t, shape: tuple, row_bytes_multiple: int, device) -> torch.Tensor:
    """t as uint8: shape (None = any), the inner dims contiguous, the outer stride a multiple
    of row_bytes_multiple bytes."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"{name} must be a uint8 (or float8_e4m3fn) tensor, got {describe(t)}")
    inner = t.stride()[1:]
    want_inner = tuple(
        int(torch.tensor(shape[i + 2 :] or (1,)).prod()) for i in range(len(shape) - 1)
    )
    if (
        t.dim() != len(shape)
        or any(s is not None and n != s for n, s in zip(t.shape, shape, strict=True))
        or inner != want_inner
        or t.stride(0) % row_bytes_multiple
        or t.device != device
    ):
        want = ", ".join("N" if s is None else str(s) for s in shape)
        raise ValueError(
            f"{name} must be ({want}) with contiguous rows and a first stride that is a "
            f"multiple of {row_bytes_multiple} bytes on {device}, got {describe(t)}"
        )
    return t.view(torch.uint8)
