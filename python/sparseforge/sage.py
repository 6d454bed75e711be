"""Sage FP8 quantization of attention inputs: q, k and v to float8_e4m3fn codes with
fp32 scales, in the layouts the Sage FP8 attention kernels read (the wrappers' plan() with
q_data_type=torch.float8_e4m3fn and the three scales).

    sage_fp8_quantize(q, k, v, *, smooth_k=True, scale_search=True) -> SageFP8Tensors

q (Hq, Sq, D), k and v (Hkv, Sk, D): HND, bfloat16 or float16, on one CUDA device, unit stride
on D (head and token strides free, multiples of 8 elements), D in {64, 128}, Hq a multiple of
Hkv. Returns SageFP8Tensors(q, k, v, q_scale, k_scale, v_scale, k_mean), where x8 is the
e4m3 output and x the input:
  q        (Hq, Sq, D) e4m3, contiguous.     q8[h, s] * q_scale[0, h, s] ~= q[h, s]
  q_scale  (1, Hq, Sq) fp32 per token: (amax / 448) * (16 + c) / 16, amax = max |q[h, s, :]|,
           c the token's searched scale candidate (below; 0 without the search).
  k        (Hkv, Sk, D) e4m3, a view k8 = buf[:, :Sk] of a buffer buf (Hkv, Sk_pad64, D),
           Sk_pad64 = Sk rounded up to 64, zero past Sk (the sm90 kernel TMA-loads every
           head's keys through one view, so heads must lie whole 64-key tiles apart).
                                              k8[h, s] * k_scale[0, h, s // 16] ~= k[h, s] - m[h]
           (m = k_mean, or 0 without smoothing)
  k_scale  (1, Hkv, ceil(Sk / 16)) fp32: (amax / 448) * (16 + c) / 16 with amax = max |k - k_mean|
           over 16 tokens (the last group may be short) and all D channels, c the group's
           searched candidate (0 without the search). A view [..., :G] of a buffer whose
           rows are padded to whole 64-key tiles (zeros), so that the attention kernels read
           it in place at every run: scales written into it later (re-quantized K) are used.
  v        (Hkv, Sk, D) e4m3, a transposed view: v8 = buf.transpose(1, 2)[:, :Sk] of a buffer
           buf (Hkv, D, Sk_pad), Sk_pad = Sk rounded up to 16, zero past Sk; so v8.stride() ==
           (D * Sk_pad, 1, Sk_pad) (e4m3 MMAs need V K-major; the kernels TMA-load this).
                                              v8[h, :, d] * v_scale[h, d] ~= v[h, :, d]
  v_scale  (Hkv, D) fp32: max over the tokens of |v[h, :, d]| / 448.
  k_mean   (Hkv, D) fp32: mean of k over all Sk tokens per channel; None unless smooth_k
           (then k is quantized as it is).
Every amax is floored at 2^-100: all-zero rows, groups and channels give codes 0 and a
finite positive scale. Conversion saturates finite values at +-448. Non-finite inputs (NaN,
+-inf) count as 0 in every amax, mean and search and get the code NaN: an inf or NaN in k
or v reaches only the rows that attend to its key, as in dense attention, and never another
row's scale. Codes are
e4m3(x * ((448 / amax) * fl32(16 / (16 + c)))). Without the search they and the scales equal,
bit for bit, those of reference.sage_fp8_quantize(..., scale_search=False) given the same
k_mean; with it, the codes equal the reference's for the candidate the kernel chose.

Scale search (scale_search=True, the default). e4m3 keeps 3 mantissa bits, so each element
is rounded by up to 1/16 of itself, and where a set's values fall on that grid depends on
the scale. For every q row and k group the quantizer tries the 16 candidates c = 0 .. 15
and keeps the one whose codes have the least squared rounding error (ranked with an f16
criterion, so a candidate within ~1% of the best may win a near-tie; the reference ranks in
fp64). On N(0, 1) inputs that is 21% less squared error on q and 7% on k (CPU reference,
tests/test_sage_quantize.py), and the attention error of F1 / F3 drops from 0.0510 / 0.0505
to 0.0489 / 0.0485. It costs quantizer time: 0.89 ms instead of 0.44 ms on the F1 shapes,
0.50 instead of 0.21 on F3 (H200, bench/results/2026-11-30_740a08a_h200_bench_sage_scale_search.md;
the bench prints both). scale_search=False gives the amax scales (c = 0 everywhere).

Smoothing K. Scores with the smoothed keys are q . (k - m) = q . k - q . m: each query row
changes by the constant q . m, which softmax removes, so the attention output is unchanged.
The LSE an attention returns on these inputs is of the smoothed scores: it is smaller by
sm_scale * (q . k_mean) per row than the LSE of the original scores (add that back if the
LSE is combined with other attention results). Why smooth: keys often carry a large offset
per channel, shared by all tokens. With one scale per 16 tokens over all channels, that
offset sets the scale and leaves few e4m3 steps for the token-to-token differences that
decide the softmax; without it the scale follows those differences (bench.py:
sage_offset_accuracy; tests/test_sage_quantize.py: test_smoothing_helps_offset_keys).

Two kernel launches (generator/kernels/portable/sage_quantize.py): column statistics of k and v per
chunk of tokens plus q's scale search and codes, then k's and v's. quantize_bandwidth() times
them.
Host time per call: eight output allocations and two argument packings (not yet measured in
a kept run); large problems hide it behind the GPU queue.
"""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple

import torch

from sparseforge.arch import multiprocessors
from sparseforge.dtypes import BY_NAME, NAME_OF
from sparseforge.families import sage_fp8_fwd, sage_quantize
from sparseforge.planner import num_tiles, tile_padded_keys, tile_padded_scales

FP8 = torch.float8_e4m3fn
# Preferred tokens per chunk: chosen from an H200 sweep of 256 .. 8192 tokens made while the
# quantizer was written (2048 best or within 5% on the F1/F3 shapes; that table was not kept:
# re-measure with quantize_bandwidth before changing it).
PREFERRED_CHUNK = 2048


class SageFP8Tensors(NamedTuple):
    """The outputs of sage_fp8_quantize; layouts in the module docstring."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_mean: torch.Tensor | None


def sage_fp8_quantize(
    q, k, v, *, smooth_k: bool = True, scale_search: bool = True
) -> SageFP8Tensors:
    """Quantize bf16/fp16 HND q, k, v for the Sage FP8 attention kernels (module docstring)."""
    if not isinstance(scale_search, bool) or not isinstance(smooth_k, bool):
        raise TypeError(
            f"smooth_k and scale_search must be bool, got {smooth_k!r}, {scale_search!r}"
        )
    _check_inputs(q, k, v)
    hq, sq, d = q.shape
    hkv, sk, _ = k.shape
    device = q.device
    per_scale = sage_quantize.constant("keys_per_scale")
    groups = -(-sk // per_scale)
    chunk = chunk_tokens(sk, hkv, multiprocessors(device.index))
    f32 = dict(dtype=torch.float32, device=device)
    q8 = torch.empty((hq, sq, d), dtype=FP8, device=device)
    q_scale = torch.empty((1, hq, sq), **f32)
    k8 = tile_padded_keys(hkv, sk, d, FP8, device, sage_fp8_fwd.constant("tile_keys"))
    k_scale = tile_padded_scales(hkv, sk, per_scale, sage_fp8_fwd.constant("tile_keys"), device)
    vt = torch.empty((hkv, d, groups * per_scale), dtype=FP8, device=device)  # padding too
    v_scale = torch.empty((hkv, d), **f32)
    k_mean = torch.empty((hkv, d), **f32)  # written (zeros) even without smoothing
    partial = torch.empty((hkv, -(-sk // chunk), 2, d), **f32)
    steps = sage_quantize.constant("scale_steps") if scale_search else 1
    stats, quantize_kv = sage_quantize.launches(
        device.index, NAME_OF[q.dtype], d, chunk, int(smooth_k), steps
    )
    with torch.cuda.device(device):
        stats((q, k, v, q8, q_scale[0], partial))
        quantize_kv((k, v, partial, k8[:, :sk], k_scale[0, :, :groups], vt, v_scale, k_mean))
    return SageFP8Tensors(
        q8,
        k8[:, :sk],
        vt.transpose(1, 2)[:, :sk],
        q_scale,
        k_scale[:, :, :groups],
        v_scale,
        k_mean if smooth_k else None,
    )


sage_fp8_quantize_sm90 = sage_fp8_quantize  # the reference's name for the same function


def chunk_tokens(seq_k: int, num_kv_heads: int, num_sms: int) -> int:
    """Tokens per chunk, a multiple of the quantizer's chunk_multiple (256: whole launch-2
    tiles): PREFERRED_CHUNK, or 4 sqrt(Sk) if more (each launch-2 CTA reads its head's P
    partials, 4 P D bytes against 3 chunk D bytes of its own traffic: (4/3) Sk / chunk^2 <=
    1/12 of it), halved down to the multiple while launch 2 would have fewer CTAs (two per
    chunk and kv head) than the GPU has SMs."""
    multiple = sage_quantize.constant("chunk_multiple")
    chunk = max(PREFERRED_CHUNK, 4 * math.isqrt(seq_k))
    while chunk > multiple and 2 * num_kv_heads * -(-seq_k // chunk) < num_sms:
        chunk //= 2
    return -(-chunk // multiple) * multiple


def quantize_bytes(q, k, v, *, smooth_k: bool = True) -> int:
    """Bytes both launches read and write: q once, k twice with smoothing (else once), v
    twice; the codes (k and v with their padding), scales and mean; the chunk partials once each
    way (launch-2 CTAs re-read them from L2, not counted)."""
    hq, sq, d = q.shape
    hkv, sk, _ = k.shape
    per_scale, tile = sage_quantize.constant("keys_per_scale"), sage_fp8_fwd.constant("tile_keys")
    groups = -(-sk // per_scale)
    chunks = -(-sk // chunk_tokens(sk, hkv, multiprocessors(q.device.index)))
    reads = q.element_size() * (q.numel() + (2 if smooth_k else 1) * k.numel() + 2 * v.numel())
    codes = q.numel() + hkv * d * (num_tiles(sk, tile) * tile + groups * per_scale)
    scales = 4 * (hq * sq + hkv * groups + 2 * hkv * d)
    partials = 2 * 4 * hkv * chunks * 2 * d
    return reads + codes + scales + partials


def quantize_bandwidth(
    q, k, v, *, smooth_k: bool = True, scale_search: bool = True, iters: int = 20
) -> tuple[float, float]:
    """(microseconds, GB/s) of sage_fp8_quantize: median of `iters` CUDA-event timings after
    three warm-up calls; GB/s counts quantize_bytes(). Small problems include the host's
    launch time (the GPU waits for it)."""
    for _ in range(3):
        sage_fp8_quantize(q, k, v, smooth_k=smooth_k, scale_search=scale_search)
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        sage_fp8_quantize(q, k, v, smooth_k=smooth_k, scale_search=scale_search)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    us = 1e3 * statistics.median(start.elapsed_time(end) for start, end in events)
    return us, quantize_bytes(q, k, v, smooth_k=smooth_k) / (us * 1e3)


def _check_inputs(q, k, v) -> None:
    """Everything the kernels assume, checked before any launch (no GPU needed)."""
    dtypes = [BY_NAME[name] for name in sage_quantize.spec().dtypes]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be (heads, tokens, head_dim) (HND), got shape {tuple(t.shape)}"
            )
        if t.dtype not in dtypes:
            raise ValueError(
                f"{name} has dtype {t.dtype}; it must be one of {', '.join(map(str, dtypes))}"
            )
        if 0 in t.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: no dimension may be empty")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if v.shape != k.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    hq, _, d = q.shape
    hkv = k.shape[0]
    if k.shape[2] != d:
        raise ValueError(f"q has head_dim {d}, k and v {k.shape[2]}")
    head_dims = sage_quantize.head_dims()
    if d not in head_dims:
        raise ValueError(f"head_dim {d} is not supported; sage_fp8_quantize supports {head_dims}")
    if hq % hkv:
        raise ValueError(f"num_qo_heads {hq} is not a multiple of num_kv_heads {hkv}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        stride = t.stride()
        if stride[2] != 1:
            raise ValueError(f"{name} must have unit stride on head_dim, got strides {stride}")
        if stride[0] % 8 or stride[1] % 8:
            raise ValueError(
                f"{name} must have strides that are multiples of 8 elements, got {stride}"
            )
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned, got address {t.data_ptr():#x}")
    if q.device.type != "cuda" or k.device != q.device or v.device != q.device:
        raise ValueError(
            f"q, k and v must be on one CUDA device, got {q.device}, {k.device}, {v.device}"
        )
