"""Standard block-sparse workloads beside cuDNN dense attention (shared/BENCHMARKS.md).

    python -m sparseforge.bench [--workloads W1,W2] [--out bench/results/FILE.md] [--backend B]

Per workload: per-head random selections (torch.Generator seed 0 on the CPU), N(0,1) bf16
q/k/v in HND, the variable wrapper; median of CUDA-event timings after warm-up; cuDNN dense
SDPA (bf16) on the same shape in the same process; relative L2 error and cosine similarity
against an fp32 reference on the unquantized inputs, on a slice of heads and rows.
Sage FP8 workloads (F1, F3) quantize the bf16 inputs with sparseforge.sage_fp8_quantize
(timed separately, not in the attention time) and run the e4m3 kernels; a line per Sage
workload gives the error and quantizer time without the scale search.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import statistics
import sys
import unittest.mock
from dataclasses import dataclass

import torch

from sparseforge import reference

MATMUL_CEILING_TFLOPS = 788.0  # bf16 dense matmul measured on the H200 (BENCHMARKS.md)
FP8_MATMUL_CEILING_TFLOPS = 1343.0  # e4m3 dense matmul (torch._scaled_mm), same source
HBM_TBPS = 4.3
_U8 = dict(dtype=torch.uint8, device="cuda")  # SDSA byte tensors


@dataclass(frozen=True)
class Workload:
    name: str
    heads_q: int
    heads_kv: int
    seq: int
    block: int
    topk: int
    head_dim: int = 128
    sage: bool = False  # Sage FP8 (e4m3 q/k/v, bf16 out)
    vsa: bool = False  # video_sparse_attention end to end: selection + attention


WORKLOADS = {
    w.name: w
    for w in (
        Workload("W1", 32, 32, 32768, 64, 64),
        Workload("W2", 32, 32, 32768, 64, 16),
        Workload("W3", 32, 8, 32768, 64, 64),
        Workload("W4", 32, 32, 65536, 64, 64),
        Workload("W5", 32, 32, 32768, 128, 32),
        Workload("F1", 32, 32, 32768, 64, 64, sage=True),
        Workload("F3", 32, 8, 32768, 64, 64, sage=True),
        Workload("V1", 32, 32, 32768, 64, 64, vsa=True),
        Workload("V3", 32, 8, 32768, 64, 64, vsa=True),
    )
}


def random_selection(heads_kv: int, row_blocks: int, col_blocks: int, topk: int, seed: int = 0):
    """(Hkv, MB, NB) bool: `topk` distinct key blocks per (kv head, query block), uniform."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.rand(heads_kv, row_blocks, col_blocks, generator=gen).argsort(dim=-1)
    mask = torch.zeros(heads_kv, row_blocks, col_blocks, dtype=torch.bool)
    mask.scatter_(2, order[..., :topk], True)
    return mask


# GPU cycles the stream spins ahead of each timed run (~1 ms at the H200's clocks): the
# host's work for the run (argument checks, launches) is queued by the time the GPU reaches
# the start event, so the time is the GPU's alone. Without it a run whose host work takes
# longer than what the GPU had queued (an L2 flush, or nothing) times that host work too.
HOST_LEAD_CYCLES = 2_000_000


def cuda_time_ms(fn, warmup: int = 5, iters: int = 30, before=None) -> float:
    """Median time of fn() over `iters` runs, each bracketed by CUDA events (the GPU's time:
    HOST_LEAD_CYCLES); before(), when given, runs ahead of each run outside its events (a
    cold L2: overwriting a buffer larger than L2)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        torch.cuda._sleep(HOST_LEAD_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cudnn_dense_ms(q, k, v, iters: int = 30) -> float:
    """cuDNN SDPA on the same (HND) shapes; GQA heads repeated."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[0] // k.shape[0]
    qd, kd, vd = q[None], k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return cuda_time_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd), iters=iters
        )


def relative_error(
    out, q, k, v, block_mask, block: int, heads=(0,), rows: int = 1024
) -> tuple[float, float]:
    """(‖out - ref‖ / ‖ref‖, cosine similarity of out and ref) over a slice of heads and the
    first `rows` query rows."""
    group = q.shape[0] // k.shape[0]
    num, den, dot, norm_out = 0.0, 0.0, 0.0, 0.0
    seq_k = k.shape[1]
    for h in heads:
        hk = h // group
        row_blocks = -(-rows // block)
        mask = reference.block_mask_to_token_mask(
            block_mask[hk : hk + 1, :row_blocks],
            torch.full((row_blocks,), block),
            reference.uniform_sizes(seq_k, block),
        )[:, :rows].to(q.device)
        ref, _ = reference.attention(
            q[h : h + 1, :rows], k[hk : hk + 1], v[hk : hk + 1], mask, compute_dtype=torch.float32
        )
        got = out[h : h + 1, :rows].float()
        num += float((got - ref).pow(2).sum())
        den += float(ref.pow(2).sum())
        dot += float((got * ref).sum())
        norm_out += float(got.pow(2).sum())
    return math.sqrt(num / den), dot / math.sqrt(den * norm_out)


def sage_inputs(q, k, v, smooth_k: bool = True, scale_search: bool = True):
    """(quantized tensors, quantizer ms, quantizer GB/s) of bf16 HND q/k/v."""
    from sparseforge import quantize_bandwidth, sage_fp8_quantize

    us, gbps = quantize_bandwidth(q, k, v, smooth_k=smooth_k, scale_search=scale_search)
    return sage_fp8_quantize(q, k, v, smooth_k=smooth_k, scale_search=scale_search), us / 1e3, gbps


def run_vsa_workload(w: Workload, iters: int = 30) -> dict:
    """video_sparse_attention end to end (pooling, coarse logits, top-k, plan, fine
    attention) at a workload's shape, beside cuDNN dense; the error is against the recipe's
    reference on a slice of heads."""
    from sparseforge import video_sparse_attention

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (
        torch.randn(h, w.seq, w.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
        for h in (w.heads_q, w.heads_kv, w.heads_kv)
    )
    out = video_sparse_attention(q, k, v, topk=w.topk)
    ms = cuda_time_ms(lambda: video_sparse_attention(q, k, v, topk=w.topk), iters=iters)
    dense_ms = cudnn_dense_ms(q, k, v, iters=iters)
    group = w.heads_q // w.heads_kv
    ref = reference.video_sparse_attention(
        q[:group, :4096], k[:1, :4096], v[:1, :4096], topk=w.topk // 8
    )
    got = video_sparse_attention(q[:group, :4096], k[:1, :4096], v[:1, :4096], topk=w.topk // 8)
    err = float((got.double() - ref.double()).norm() / ref.double().norm())
    cos = float((got.double() * ref).sum() / (got.double().norm() * ref.double().norm()))
    flops = 4.0 * w.heads_q * w.seq * (w.topk * w.block) * w.head_dim
    dense_flops = 4.0 * w.heads_q * w.seq * w.seq * w.head_dim
    assert torch.isfinite(out.float()).all()
    return dict(
        workload=w.name, path="video_sparse_attention", ms=ms, dense_ms=dense_ms,
        density=w.topk * w.block / w.seq, tflops=flops / (ms * 1e9),
        dense_tflops=dense_flops / (dense_ms * 1e9), err=err, cos=cos,
        floor_ms=flops / (MATMUL_CEILING_TFLOPS * 1e9), quant_ms=None, quant_gbps=None,
        amax_scales="",
    )  # fmt: skip


def run_workload(w: Workload, backend: str = "auto", iters: int = 30) -> dict:
    from sparseforge import VariableBlockSparseAttentionWrapper

    if w.vsa:
        return run_vsa_workload(w, iters)
    device = torch.device("cuda")
    mb = nb = w.seq // w.block
    mask = random_selection(w.heads_kv, mb, nb, w.topk).to(device)
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(
        w.heads_q, w.seq, w.head_dim, device=device, dtype=torch.bfloat16, generator=gen
    )
    k = torch.randn(
        w.heads_kv, w.seq, w.head_dim, device=device, dtype=torch.bfloat16, generator=gen
    )
    v = torch.randn(
        w.heads_kv, w.seq, w.head_dim, device=device, dtype=torch.bfloat16, generator=gen
    )
    sizes = torch.full((w.heads_kv, mb), w.block, dtype=torch.int32, device=device)
    workspace = torch.empty(1, dtype=torch.uint8, device=device)
    wrapper = VariableBlockSparseAttentionWrapper(workspace, backend=backend)
    quant_ms = quant_gbps = None
    amax_scales = ""
    if w.sage:

        def plan_sage(quantized):
            wrapper.plan(
                mask,
                sizes,
                sizes.clone(),
                w.heads_q,
                w.heads_kv,
                w.head_dim,
                q_data_type=torch.float8_e4m3fn,
                q_scale=quantized.q_scale,
                k_scale=quantized.k_scale,
                v_scale=quantized.v_scale,
            )
            return (quantized.q, quantized.k, quantized.v)

        # The same inputs without the scale search (q and k at amax / 448): error and time.
        quantized, amax_ms, amax_gbps = sage_inputs(q, k, v, scale_search=False)
        err, cos = relative_error(
            wrapper_out(wrapper, plan_sage(quantized), q),
            q,
            k,
            v,
            mask.cpu(),
            w.block,
            heads=(0, w.heads_q - 1),
        )
        amax_scales = (
            f"{w.name} without the scale search (scale_search=False): rel. L2 error "
            f"{err:.3e}, cosine {cos:.5f}, quantizer {amax_ms:.3f} ms ({amax_gbps:.0f} GB/s)"
        )
        quantized, quant_ms, quant_gbps = sage_inputs(q, k, v)
        operands = plan_sage(quantized)
    else:
        wrapper.plan(
            mask,
            sizes,
            sizes.clone(),
            w.heads_q,
            w.heads_kv,
            w.head_dim,
            q_data_type=torch.bfloat16,
        )
        operands = (q, k, v)
    out = torch.full_like(q, float("nan"))
    ms = cuda_time_ms(lambda: wrapper.run(*operands, out=out), iters=iters)
    err, cos = relative_error(out, q, k, v, mask.cpu(), w.block, heads=(0, w.heads_q - 1))
    dense_ms = cudnn_dense_ms(q, k, v, iters=iters)
    flops = 4.0 * w.heads_q * w.seq * (w.topk * w.block) * w.head_dim
    dense_flops = 4.0 * w.heads_q * w.seq * w.seq * w.head_dim
    element_bytes = operands[0].element_size()
    hbm_bytes = element_bytes * (q.numel() + 2 * k.numel()) + 2 * q.numel()
    ceiling = FP8_MATMUL_CEILING_TFLOPS if w.sage else MATMUL_CEILING_TFLOPS
    floor_ms = max(flops / (ceiling * 1e9), hbm_bytes / (HBM_TBPS * 1e9))
    return dict(
        workload=w.name,
        path=wrapper.backend_in_use,
        ms=ms,
        dense_ms=dense_ms,
        density=w.topk * w.block / w.seq,
        tflops=flops / (ms * 1e9),
        dense_tflops=dense_flops / (dense_ms * 1e9),
        err=err,
        cos=cos,
        floor_ms=floor_ms,
        quant_ms=quant_ms,
        quant_gbps=quant_gbps,
        amax_scales=amax_scales,
    )


def logit_options_times(iters: int = 10, rounds: int = 5) -> list[str]:
    """W1's shape (H 32, S 32768, 64-token blocks, top-64) through the BSR wrapper (NHD, one
    selection shared by the heads) with plan()'s options, beside the same selection without
    them, and causal beside cuDNN's dense causal attention. Causal uses a causal selection:
    top-64 among each row's visible blocks (the diagonal block always in)."""
    from sparseforge import BlockSparseAttentionWrapper

    w = WORKLOADS["W1"]
    device = torch.device("cuda")
    nb = w.seq // w.block
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (
        torch.randn(
            w.seq, w.heads_q, w.head_dim, device=device, dtype=torch.bfloat16, generator=gen
        )
        for _ in range(3)
    )
    selected = random_selection(1, nb, nb, w.topk)[0]
    rank = torch.rand(nb, nb, generator=torch.Generator().manual_seed(2))
    below = torch.arange(nb)[None, :] < torch.arange(nb)[:, None]
    order = torch.where(below, rank, -1.0).argsort(-1, descending=True)[:, : w.topk - 1]
    causal = torch.eye(nb, dtype=torch.bool).scatter(1, order, True) & (
        below | torch.eye(nb, dtype=torch.bool)
    )
    mask = torch.rand(int(selected.sum()), w.block, w.block, device=device, generator=gen) < 0.5
    # Most real masks leave most tiles whole: 90% of the blocks all visible, the rest random.
    mostly_whole = mask | (torch.rand(mask.shape[0], 1, 1, device=device, generator=gen) < 0.9)

    def bsr(blocks):
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), blocks.sum(1).cumsum(0)])
        return indptr.int().to(device), blocks.nonzero()[:, 1].int().to(device)

    def plan(blocks, **options):
        wrapper = BlockSparseAttentionWrapper(torch.empty(1, dtype=torch.uint8, device=device))
        args = (*bsr(blocks), w.seq, w.seq, w.block, w.block, w.heads_q, w.heads_kv, w.head_dim)
        wrapper.plan(*args, q_data_type=torch.bfloat16, **options)
        out = torch.empty_like(q)
        flops = 4.0 * w.heads_q * w.block * w.block * int(blocks.sum()) * w.head_dim
        return wrapper, (lambda: wrapper.run(q, k, v, out=out)), flops

    from torch.nn.attention import SDPBackend, sdpa_kernel

    qd, kd, vd = (t.transpose(0, 1)[None] for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        dense_causal = cuda_time_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True),
            iters=iters,
        )
    variants = [
        ("top-64, no options", selected, 0, {}),
        ("top-64, mask (50% random bits)", selected, 0, dict(mask=mask)),
        (
            "top-64, mask (90% of blocks whole, 10% random bits)",
            selected,
            0,
            dict(mask=mostly_whole),
        ),
        ("top-64, logits_soft_cap=30", selected, 0, dict(logits_soft_cap=30.0)),
        ("top-64, ALiBi", selected, 0, dict(pos_encoding_mode="ALIBI")),
        (
            "top-64, ROPE_LLAMA (q, k rotated first)",
            selected,
            0,
            dict(pos_encoding_mode="ROPE_LLAMA"),
        ),
        ("causal top-64, no options", causal, 6, {}),
        ("causal top-64, causal=True", causal, 6, dict(causal=True)),
    ]
    planned = [plan(blocks, **options) for _, blocks, _, options in variants]
    # Interleaved: every variant once per round, medians over the rounds.
    times = [[] for _ in variants]
    for _ in range(rounds):
        for i, (_, fn, _) in enumerate(planned):
            times[i].append(cuda_time_ms(fn, warmup=2, iters=iters))
    lines = [
        f"| W1 variant (BSR, NHD) | kernel | ms (median of {rounds} interleaved rounds) | TFLOPS "
        "| vs the same selection without options |",
        "|---|---|---:|---:|---:|",
    ]
    medians = [statistics.median(t) for t in times]
    for (name, _, base, _), (wrapper, _, flops), ms in zip(variants, planned, medians, strict=True):
        lines.append(
            f"| {name} | {wrapper.backend_in_use} | {ms:.3f} | {flops / (ms * 1e9):.0f} "
            f"| {ms / medians[base]:.3f}x |"
        )
    dense_tflops = 2.0 * w.heads_q * w.seq * w.seq * w.head_dim / (dense_causal * 1e9)
    lines.append(
        f"cuDNN dense causal (same shape): {dense_causal:.3f} ms, {dense_tflops:.0f} TFLOPS "
        "(half the dense work)"
    )
    return lines


def wrapper_out(wrapper, operands, q):
    """One run of a planned wrapper into a NaN-filled output."""
    out = torch.full_like(q, float("nan"))
    wrapper.run(*operands, out=out)
    return out


def sage_offset_accuracy(heads: int = 4, seq: int = 8192, offset: float = 8.0) -> list[str]:
    """Sage FP8 error on N(0,1) inputs whose K has a per-channel offset of N(0, offset^2),
    with and without K smoothing (W1's block pattern on a smaller problem)."""
    from sparseforge import VariableBlockSparseAttentionWrapper

    device = torch.device("cuda")
    block, topk = 64, 16
    mb = seq // block
    mask = random_selection(heads, mb, mb, topk).to(device)
    gen = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(heads, seq, 128, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(heads, seq, 128, device=device, dtype=torch.bfloat16, generator=gen)
    k = k + offset * torch.randn(heads, 1, 128, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(heads, seq, 128, device=device, dtype=torch.bfloat16, generator=gen)
    sizes = torch.full((heads, mb), block, dtype=torch.int32, device=device)
    lines = []
    for smooth in (False, True):
        quantized, _, _ = sage_inputs(q, k, v, smooth_k=smooth)
        wrapper = VariableBlockSparseAttentionWrapper(torch.empty(1, device=device))
        wrapper.plan(
            mask,
            sizes,
            sizes,
            heads,
            heads,
            128,
            q_data_type=torch.float8_e4m3fn,
            q_scale=quantized.q_scale,
            k_scale=quantized.k_scale,
            v_scale=quantized.v_scale,
        )
        out = wrapper.run(quantized.q, quantized.k, quantized.v)
        err, cos = relative_error(out, q, k, v, mask.cpu(), block, heads=(0, heads - 1))
        lines.append(
            f"Sage FP8, K with a per-channel offset N(0, {offset:g}^2), smooth_k={smooth}: "
            f"rel. L2 error {err:.3e}, cosine {cos:.5f}"
        )
    return lines


def table(rows: list[dict]) -> str:
    head = (
        "| workload | kernel | ms | effective TFLOPS | cuDNN dense TFLOPS | ratio | rel. L2 error "
        "| cosine | floor ms | time / floor | quantizer ms (GB/s) |"
    )
    lines = [head, "|" + " --- |" * 11]
    for r in rows:
        quant = "-" if r["quant_ms"] is None else f"{r['quant_ms']:.3f} ({r['quant_gbps']:.0f})"
        cells = (
            r["workload"],
            r["path"],
            f"{r['ms']:.3f}",
            f"{r['tflops']:.0f}",
            f"{r['dense_tflops']:.0f}",
            f"{r['tflops'] / r['dense_tflops']:.2f}",
            f"{r['err']:.2e}",
            f"{r['cos']:.5f}",
            f"{r['floor_ms']:.3f}",
            f"{r['ms'] / r['floor_ms']:.2f}",
            quant,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def density_sweep(topks=(4, 8, 16, 32, 64, 128, 256), iters: int = 20) -> list[dict]:
    """W1's shape (H 32, S 32768, 64-token blocks) at several top-k, bf16 and Sage FP8: the
    rows of the TFLOPS-vs-density chart."""
    rows = []
    for sage in (False, True):
        for topk in topks:
            w = Workload(f"{'F' if sage else 'W'}@{topk}", 32, 32, 32768, 64, topk, sage=sage)
            rows.append(run_workload(w, iters=iters))
    return rows


def plot(rows: list[dict], sweep: list[dict], out_dir: str, title: str) -> list[str]:
    """Two PNG charts (matplotlib): effective TFLOPS against density, bf16 and Sage FP8 beside
    cuDNN dense (`sweep` rows), and time per workload, sparse against dense (`rows`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for sage, label in ((False, "sparseforge bf16"), (True, "sparseforge Sage FP8")):
        points = sorted(
            (r["density"], r["tflops"]) for r in sweep if r["workload"].startswith("F") == sage
        )
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
    if sweep:
        dense = statistics.median(r["dense_tflops"] for r in sweep)
        ax.axhline(dense, color="gray", linestyle="--", label=f"cuDNN dense bf16 ({dense:.0f})")
    ax.set(xscale="log", xlabel="density (selected keys / all keys)", ylabel="effective TFLOPS")
    ax.set_title(f"H 32, S 32768, 64-token blocks\n{title}", fontsize=9)
    ax.legend()
    paths.append(os.path.join(out_dir, "tflops_vs_density.png"))
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r["workload"] for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["ms"] for r in rows], width=0.4, label="sparseforge")
    ax.bar([i + 0.2 for i in x], [r["dense_ms"] for r in rows], width=0.4, label="cuDNN dense")
    ax.set_xticks(list(x), names)
    ax.set(ylabel="ms per call", yscale="log")
    ax.set_title(f"standard workloads (docs/benchmarks.md)\n{title}", fontsize=9)
    ax.legend()
    paths.append(os.path.join(out_dir, "time_per_workload.png"))
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths


def diffusers_forward_times(frames: int = 21, side: int = 80, layers: int = 4, topk: int = 64):
    """(dense ms, sparse ms, tokens) of a diffusers WanTransformer3DModel forward pass with
    random weights (Wan 1.3B's width: 12 heads of 128; `layers` blocks), the latents of a
    video of `frames` x side x side (21 x 80 x 80 at patch 1x2x2: 33,600 tokens), dense
    attention against enable_sparse_attention(topk) (64-token tiles: topk 64 of 525 is 12%)."""
    import diffusers

    from sparseforge.diffusers_processor import enable_sparse_attention

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=layers,
    ).to(device, torch.bfloat16).eval()  # fmt: skip
    latents = torch.randn(1, 16, frames, side, side, device=device, dtype=torch.bfloat16)
    text = torch.randn(1, 512, 4096, device=device, dtype=torch.bfloat16)
    step = torch.tensor([500], device=device)

    def forward():
        with torch.no_grad():
            return model(latents, timestep=step, encoder_hidden_states=text).sample

    dense = cuda_time_ms(forward, warmup=2, iters=5)
    enable_sparse_attention(model, topk=topk)
    sparse = cuda_time_ms(forward, warmup=2, iters=5)
    return dense, sparse, frames * (side // 2) ** 2


def selection_times(iters: int = 50) -> list[str]:
    """The selection kernels, microseconds (CUDA events, median) and the bandwidth of the
    bytes each must read and write, against HBM (MS1, the proxy score: TFLOPS). MS2:
    msa_topk_select of max_score (64, 256, 32768), one forced begin and end block. TS1 /
    TS2, the token-sparse builders at a decode serving shape: 1024 tokens, one per request
    of 128k context (2048 pages of 64 keys), K = 2048 selected keys each; slot lists with 2
    requests per token; unions of groups of 8 tokens over the 131,072 keys."""
    from sparseforge import msa_ops, token_sparse

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    tokens, k, rpt, group, keys = 1024, 2048, 2, 8, 131072
    i32 = dict(dtype=torch.int32, device=device)
    positions = torch.rand(tokens, keys, device=device, generator=gen).topk(k).indices.int()
    pages = keys // 64
    block_table = torch.randperm(tokens * pages, device=device).view(tokens, pages).int()
    requests = torch.arange(tokens, **i32)
    block_tables = torch.empty(tokens * rpt, 2, k, **i32)
    seq_lens = torch.empty(tokens * rpt, **i32)
    groups = tokens // group
    union = torch.empty(groups, group * k, **i32)
    mask = torch.empty(tokens, group * k // 32, **i32)

    def slots():
        token_sparse.token_sparse_kv_indices(
            positions, requests, block_table, block_tables=block_tables, seq_lens=seq_lens,
            requests_per_token=rpt,
        )  # fmt: skip

    def unions():
        token_sparse.group_union_masks(
            positions, requests, torch.arange(groups, **i32), requests[::group].contiguous(),
            block_table, union=union, union_sizes=seq_lens[:groups], mask=mask, num_keys=keys,
        )  # fmt: skip

    max_score = torch.randn(64, 256, 32768, device=device, generator=gen)
    topk_out = torch.empty(32768, 64, 16, dtype=torch.int32, device=device)

    def topk():
        msa_ops.msa_topk_select(max_score, 16, None, topk_out, 1, 1)

    lines = []
    for name, fn, moved in (
        ("MS2 msa_topk_select", topk, 4 * max_score.numel() + 4 * topk_out.numel()),
        ("TS1 token_sparse_kv_indices", slots, 4 * tokens * k * (1 + 2 * rpt)),
        ("TS2 group_union_masks", unions, 4 * tokens * k + 4 * union.numel() + 4 * mask.numel()),
    ):
        us = cuda_time_ms(fn, warmup=5, iters=iters) * 1e3
        lines.append(
            f"{name}: {us:.1f} us, {moved / us / 1e3:.0f} GB/s "
            f"({moved / us / 1e6 / HBM_TBPS:.0%} of HBM) on {moved / 1e6:.1f} MB read + written"
        )
    return lines + proxy_score_times(iters)


def proxy_score_times(iters: int) -> list[str]:
    """MS1: msa_proxy_score of one causal sequence of 32768 tokens, 4 index heads, 1 kv head,
    flat K, in bf16 and e4m3 (fp32 sums, and with use_fp32_acc=False the FP8 tensor cores'
    sums), and msa_proxy_score_fp4 of the same q and k in NVFP4; TFLOPS on
    the causal FLOPs (2 * heads * 128 per visible (query, key)) against the matmul ceiling of
    the tensor cores' input type (NVFP4 is decoded to fp16: the bf16 ceiling)."""
    from sparseforge import msa_ops, reference

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    seq, heads = 32768, 4
    q = torch.randn(seq, heads, 128, device=device, generator=gen)
    k = torch.randn(seq, 1, 128, device=device, generator=gen)
    cu = torch.tensor([0, seq], dtype=torch.int32, device=device)
    out = torch.empty(heads, seq // 128, seq, device=device)
    sizes = dict(max_seqlen_q=seq, max_k_tiles=seq // 128, output=out)
    fp4 = {}
    for name, x in (("q", q), ("k", k)):
        global_scale = float(x.abs().max()) / (6 * 448)
        fp4[f"{name}_fp4"], fp4[f"{name}_scale"] = reference.nvfp4_quantize_128x4(x, global_scale)
        fp4[f"{name}_global_scale"] = global_scale
    e4m3 = dict(q=q.to(torch.float8_e4m3fn), k=k.to(torch.float8_e4m3fn))
    runs = [
        ("bf16, flat K", MATMUL_CEILING_TFLOPS, msa_ops.msa_proxy_score,
         dict(q=q.to(torch.bfloat16), k=k.to(torch.bfloat16))),
        ("e4m3, flat K, fp32 sums", FP8_MATMUL_CEILING_TFLOPS, msa_ops.msa_proxy_score, e4m3),
        ("e4m3, flat K, use_fp32_acc=False", FP8_MATMUL_CEILING_TFLOPS, msa_ops.msa_proxy_score,
         dict(e4m3, use_fp32_acc=False)),
    ]  # fmt: skip
    runs.append(("nvfp4, flat K", MATMUL_CEILING_TFLOPS, msa_ops.msa_proxy_score_fp4, fp4))
    lines = []
    for what, ceiling, fn, inputs in runs:
        call = functools.partial(fn, **inputs, cu_seqlens_q=cu, cu_seqlens_k=cu, **sizes)
        us = cuda_time_ms(call, warmup=3, iters=iters) * 1e3
        tflops = 2 * heads * 128 * seq * (seq + 1) / 2 / us / 1e6
        lines.append(
            f"MS1 msa_proxy_score ({what}, causal, S {seq}, 4 heads): {us:.1f} us, "
            f"{tflops:.0f} TFLOPS on the causal FLOPs ({tflops / ceiling:.0%} of {ceiling})"
        )
    return lines


def msa_kv(fmt: str, pages: int, hkv: int, gen):
    """Random paged K/V of `pages` 128-token pages in one of the MSA formats: the kwargs of
    msa_sparse_attention, and the bytes of one selected block (K and V, with scales)."""
    device = torch.device("cuda")
    if fmt == "nvfp4":
        cache = torch.randint(0, 256, (pages, hkv * 18432), dtype=torch.uint8, device=device)
        # Scales in [2^-7, 2^-2]: finite codes (a random byte may be NaN).
        views = reference.nvfp4_page_views(cache, hkv)
        for name in ("k_scales", "v_scales"):
            views[name].copy_(torch.randint(0x08, 0x28, views[name].shape, device=device))
        kwargs = dict(
            k=views["k_data"], v=views["v_data"], k_scale=views["k_scales"],
            v_scale=views["v_scales"], k_global_scale=1.0, v_global_scale=1.0,
        )  # fmt: skip
        return kwargs, 2 * 128 * (64 + 8)
    dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.bfloat16
    # Drawn in bf16 (no fp32 copy): MD1's bf16 cache is 34 GB, on an 80 GB GPU too.
    draw = dict(device=device, generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(pages, hkv, 128, 128, **draw).to(dtype) for _ in range(2))
    return dict(k=k, v=v), 2 * 128 * 128 * k.element_size()


def msa_attention_times(
    iters: int = 10, formats=("bf16", "e4m3", "nvfp4"), modes=("random", "chunked")
) -> list[str]:
    """MP1 / MD1 / MD4 (BENCHMARKS.md): msa_sparse_attention and msa_sparse_decode_attention
    on the H200 beside cuDNN dense attention of the same shape (prefill) or the HBM floor
    (decode, cold L2: 256 MB overwritten before each call, outside its timing).
    MP1 runs prefill's choice of kernel and, forced by SPARSEFORGE_VARIANT, the K/V
    format's other kernels of this arch beside it, and the hand-off route (tile "hybrid")
    where the wgmma union tile is built, for each selection kind in `modes`
    (mp1_selections)."""
    from sparseforge import _library, msa_ops
    from sparseforge.arch import arch_for_device

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    i32 = dict(dtype=torch.int32, device=device)
    lines = []

    # MP1: one causal sequence of 32768 tokens, Hq 64, Hkv 4, top-16 blocks per token.
    seq, hq, hkv, topk = 32768, 64, 4, 16
    blocks = seq // 128
    q = torch.randn(seq, hq, 128, device=device, generator=gen).to(torch.bfloat16)
    dense = torch.randn(1, hq, seq, 128, device=device, generator=gen).to(torch.bfloat16)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        dense_ms = cuda_time_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(
                dense, dense, dense, is_causal=True
            ),
            iters=iters,
        )
    dense_tflops = 4 * hq * seq * (seq + 1) / 2 * 128 / dense_ms / 1e9
    lines.append(
        f"MP1 cuDNN dense causal (Hq {hq}, S {seq}): {dense_ms:.2f} ms, {dense_tflops:.0f} TFLOPS"
    )
    cu = torch.tensor([0, seq], **i32)
    table = torch.arange(blocks, **i32)[None]
    used = torch.tensor([seq], **i32)
    # Prefill's choice beside the format's other kernels (forced by SPARSEFORGE_VARIANT).
    arch = arch_for_device(torch.cuda.current_device())
    families = {
        "bf16": "msa_sparse_attention",
        "e4m3": "msa_sparse_attention_fp8kv",
        "nvfp4": "msa_sparse_attention_nvfp4",
    }
    tile_names = {
        None: "union tile",
        "wgmma": "wgmma union tile",
        "token": "one-token tile",
        "hybrid": "hand-off route: wgmma union tile, then one-token",
    }
    chosen, others = {}, {}
    for fmt, family in families.items():
        kv_format = "16bit" if fmt == "bf16" else fmt
        tile = msa_ops._prefill_tile(kv_format, hq // hkv, q.device, seq, hkv)
        chosen[fmt] = tile_names[tile]
        others[fmt] = {
            v["name"]: f"{tile_names[v['params'].get('tile')]}"
            + (f" of {w} warpgroups" if (w := v["params"].get("warpgroups", 1)) > 1 else "")
            + ", forced"
            for v in _library.manifest()["variants"]
            if v["family"] == family
            and v["arch"] == arch
            and v["params"]["dtype"] == "bf16"
            and v["params"].get("tile") != tile
        }
        # The hand-off route (wgmma union tile, then the one-token kernel) where both are
        # built and prefill does not take it.
        if tile != "hybrid" and msa_ops._wgmma_built(q.device.index, kv_format):
            others[fmt]["hybrid"] = f"{tile_names['hybrid']}, forced"
    prefill_tile = msa_ops._prefill_tile
    for mode in modes:
        ids, useful = mp1_selections(seq, hq, hkv, topk, mode, gen)
        times = {}
        for fmt in formats:
            kv, _ = msa_kv(fmt, blocks, hkv, gen)
            kernels = {"": chosen[fmt]} | others[fmt]
            for variant, label in kernels.items():
                os.environ["SPARSEFORGE_VARIANT"] = "" if variant == "hybrid" else variant
                if variant == "hybrid":  # a route, not a variant: prefill's choice replaced
                    msa_ops._prefill_tile = lambda *args: "hybrid"
                ms = cuda_time_ms(
                    lambda kv=kv, ids=ids: msa_ops.msa_sparse_attention(
                        q, q2k_indices=ids, cu_seqlens_q=cu, causal=True, page_table=table,
                        seqused_k=used, **kv,
                    ),
                    warmup=2, iters=iters,
                )  # fmt: skip
                os.environ.pop("SPARSEFORGE_VARIANT")
                msa_ops._prefill_tile = prefill_tile
                tflops = useful / ms / 1e9
                lines.append(
                    f"MP1 {mode} selections, {fmt} K/V ({label}): {ms:.2f} ms, {tflops:.0f} "
                    f"useful TFLOPS ({tflops / dense_tflops:.2f}x cuDNN dense)"
                )
                if fmt == "bf16" and "hand-off" not in label:
                    times[label.split(" tile")[0]] = ms
        del kv
        lines.append(mp1_streamed_bytes(ids, mode, times))

    return lines + msa_prefill_end_to_end(iters) + msa_decode_times(iters, formats)


def mp1_streamed_bytes(ids, mode: str, times: dict) -> str:
    """What bounds MP1 with bf16 K/V: the K/V bytes each kernel streams from L2 (a block:
    128 keys of K and V, 64 KiB) and the rate that makes at the measured times (`times`: ms
    by kernel name). A 4-token CTA of the union tiles streams the union of its tokens'
    blocks; the one-token kernel streams each token's own blocks."""
    hkv, seq, topk = ids.shape
    per_token = float((ids >= 0).sum()) / (hkv * seq)
    groups = ids.view(hkv, seq // 4, 4 * topk).sort(-1).values
    distinct = (groups >= 0) & torch.cat(
        [torch.ones_like(groups[..., :1], dtype=torch.bool), groups[..., 1:] != groups[..., :-1]],
        -1,
    )
    union = float(distinct.sum()) / (hkv * seq // 4)
    block_bytes = 2 * 128 * 128 * 2
    union_bytes = union * block_bytes * hkv * seq / 4  # either union tile
    streamed = {
        "union": union_bytes,
        "wgmma union": union_bytes,
        "one-token": per_token * block_bytes * hkv * seq,
    }
    rates = ", ".join(
        f"{name} {streamed[name] / 1e9:.0f} GB in {ms:.2f} ms "
        f"= {streamed[name] / ms / 1e9:.1f} TB/s"
        for name, ms in times.items()
    )
    return (
        f"MP1 {mode} selections, bf16 K/V streamed: a 4-token CTA's union is {union:.1f} blocks "
        f"for {per_token:.1f} a token ({union / per_token:.2f}x); {rates}"
    )


# MP1's selection kinds besides "random" and "chunked": "shared:N" (selections shared in
# part, where the MSA hand-off thresholds are tuned).
SHARED_GROUP = 16  # tokens that share N of their drawn blocks


def mp1_selections(seq: int, hq: int, hkv: int, topk: int, mode: str, gen):
    """MP1's selections for one causal sequence: block 0, the token's own block and 14 more
    visible ones, drawn per token ("random"), once per 64-token chunk ("chunked", the
    chunk's first token's visible blocks) or in part: "shared:N", N of the 14 drawn once
    per SHARED_GROUP tokens (as for the group's first token) and 14 - N per token; ascending
    with a -1 tail (repeats drop out). On the generator's device. Returns (q2k (Hkv, seq,
    topk) int32, useful FLOPs: 4 x Hq x 128 x the keys each query attends)."""
    device = gen.device
    blocks = seq // 128
    pos = torch.arange(seq, device=device)
    own = pos // 128
    if mode.startswith("shared:"):
        shared, group = int(mode.split(":")[1]), SHARED_GROUP
        if not 0 <= shared <= 14:
            raise ValueError(f"mode {mode!r}: N must be in 0 .. 14")
    elif mode in ("random", "chunked"):
        shared, group = (0, 1) if mode == "random" else (14, 64)
    else:
        raise ValueError(f"mode {mode!r}: expected 'random', 'chunked' or 'shared:N'")
    draw = torch.rand(hkv, seq, 14, device=device, generator=gen)
    # The first `shared` draws of a group are its first token's; the rest each token's own.
    draw[..., :shared] = draw[:, ::group, :shared].repeat_interleave(group, 1)[:, :seq]
    anchor = torch.cat([(pos // group * group).expand(shared, seq), pos.expand(14 - shared, seq)]).T
    extra = (draw * (anchor // 128 + 1)[None]).long()
    ids = torch.cat([torch.zeros_like(extra[..., :1]), own.expand(hkv, seq)[..., None], extra], -1)
    chosen = torch.zeros(hkv, seq, blocks, dtype=torch.bool, device=device)
    chosen.scatter_(2, ids, True)
    ids = torch.where(chosen, torch.arange(blocks, device=device), blocks).sort(-1).values
    ids = torch.where(ids < blocks, ids, -1)[..., :topk].int().contiguous()
    # Keys attended: whole blocks below the own block, the own block up to the token.
    below = chosen.sum(-1) - 1
    useful = 4 * (hq // hkv) * 128 * float((below * 128 + (pos % 128 + 1)).sum())
    return ids, useful


def msa_prefill_end_to_end(iters: int = 10, seq: int = 65536) -> list[str]:
    """A 65,536-token causal prefill (Hq 64, Hkv 4, bf16 q/k/v, flat K/V) with chunk-shared
    top-16 selections (MP1's "chunked") against cuDNN dense causal attention on the same
    q/k/v (K/V heads repeated for the dense call): the speed-up."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sparseforge import msa_ops

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(2)
    hq, hkv = 64, 4
    q, k, v = (
        torch.randn(seq, h, 128, device=device, generator=gen).to(torch.bfloat16)
        for h in (hq, hkv, hkv)
    )
    cu = torch.tensor([0, seq], dtype=torch.int32, device=device)
    ids, _ = mp1_selections(seq, hq, hkv, 16, "chunked", gen)
    sparse_ms = cuda_time_ms(
        lambda: msa_ops.msa_sparse_attention(q, k, v, ids, cu, cu, causal=True), iters=iters
    )
    dense = [
        x.transpose(0, 1)[None] for x in (q, k.repeat_interleave(16, 1), v.repeat_interleave(16, 1))
    ]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        dense_ms = cuda_time_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(*dense, is_causal=True),
            iters=iters,
        )
    return [
        f"End to end, {seq}-token causal prefill (Hq {hq}, Hkv {hkv}, bf16, chunk-shared "
        f"top-16): msa_sparse_attention {sparse_ms:.2f} ms, cuDNN dense causal {dense_ms:.2f} "
        f"ms: {dense_ms / sparse_ms:.1f}x"
    ]


# MSA decode workloads: name, requests, seqlen_q (BENCHMARKS.md MD1 / MD4, and MD1 at small
# batches, where the kernel splits each tile's keys across CTAs).
MSA_DECODE = (("MD1", 256, 1), ("MD4", 64, 4), ("MD1 batch 8", 8, 1), ("MD1 batch 1", 1, 1))


def msa_decode_times(iters: int = 10, formats=("bf16", "e4m3", "nvfp4"), shapes=MSA_DECODE):
    """msa_sparse_decode_attention at 64k context, Hq 64, Hkv 4, 16 random blocks per
    (request, kv head[, token]) with the last included, cold L2 (256 MB overwritten before
    each call, outside its timing); bandwidth on the distinct selected K/V bytes (with
    scales) against HBM."""
    from sparseforge import msa_ops

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(1)
    i32 = dict(dtype=torch.int32, device=device)
    hq, hkv = 64, 4
    lines = []
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    for name, batch, seqlen_q in shapes:
        ctx, pages = 65536, 512
        qd = torch.randn(batch * seqlen_q, hq, 128, device=device, generator=gen).to(torch.bfloat16)
        table = torch.arange(batch * pages, **i32).view(batch, pages)
        used = torch.full((batch,), ctx, **i32)
        rows = batch * seqlen_q
        draw = torch.rand(hkv, rows, pages - 1, device=device, generator=gen).topk(15).indices
        ids = torch.cat([draw, torch.full_like(draw[..., :1], pages - 1)], -1).sort(-1).values
        ids = ids.int().contiguous()
        # Bytes: each (request, kv head)'s distinct selected blocks once.
        chosen = torch.zeros(hkv, batch, pages, dtype=torch.bool, device=device)
        chosen.scatter_(2, ids.view(hkv, batch, -1).long(), True)
        distinct = int(chosen.sum())
        for fmt in formats:
            kv, block_bytes = msa_kv(fmt, batch * pages, hkv, gen)

            def decode(kv=kv, qd=qd, ids=ids, table=table, used=used, seqlen_q=seqlen_q):
                msa_ops.msa_sparse_decode_attention(
                    qd, q2k_indices=ids, page_table=table, seqused_k=used, seqlen_q=seqlen_q, **kv
                )

            us = cuda_time_ms(decode, warmup=2, iters=iters, before=flush.zero_) * 1e3
            moved = distinct * block_bytes
            lines.append(
                f"{name} {fmt} K/V ({batch} x {ctx // 1024}k, seqlen_q {seqlen_q}): {us:.1f} us "
                f"cold L2, {moved / us / 1e3:.0f} GB/s ({moved / us / 1e6 / HBM_TBPS:.0%} of HBM) "
                f"on {moved / 1e6:.0f} MB of selected K/V"
            )
            del kv
    return lines


SDSA_KEY_FORMATS = ("bf16", "nvfp4")


# SD2's wider window: on Gaussian scores no row left to repair for 10% more candidates a
# row (sdsa_window_fit on 4,000 rows: 0 rows, 2,813 candidates, against 28 rows and 2,558
# at the defined 160th / 3072; the 192nd with cap 4096 also leaves none, for 3,068).
SDSA_WIDE_WINDOW = dict(sample_rank=176, cap=4096)


def sdsa_window_fit(
    scores, sample_rank: int, cap: int, top_k: int = 2048, sample_every: int = 16
) -> tuple[int, float]:
    """(rows that would not fit, mean candidates a row) of threshold select over `scores`
    (fp32 (rows, keys), every key visible) with each row's threshold at the `sample_rank`-th
    largest of its sample (every `sample_every`-th key, as SD2 gathers it): the contract's
    fit rule (candidates above the threshold <= cap, and with the ties at least
    min(keys, top_k)). An engine can run it on the CPU over scores of its own to choose a
    window: each row that does not fit costs a repair, each candidate a slot and the top-K's
    time."""
    sample = scores[:, ::sample_every]
    if not 0 < sample_rank <= sample.shape[1]:
        raise ValueError(
            f"sample_rank = {sample_rank}: give 1 to {sample.shape[1]} (the sample's keys)"
        )
    threshold = sample.topk(sample_rank, dim=1).values[:, -1:]
    above, _, fits = reference.sdsa_select_classes(scores, threshold, scores.shape[1], cap, top_k)
    return int((~fits).sum()), float(above.sum(1).float().mean())


def sdsa_times(iters: int = 20, keys: tuple = SDSA_KEY_FORMATS) -> list[str]:
    """SD1 and SD2 (BENCHMARKS.md) over 128 requests x 65,536 keys each (64-key pages in
    shuffled order), for each key format in `keys` (BF16, NVFP4), cold L2 (256 MB
    overwritten before each call, outside its timing); bandwidth on the key bytes (+ scales)
    read once per request. SD1: indexer_scores of 1 and 4 rows a request. SD2: threshold
    select (repair mode) and top_k_from_candidates of the live rows, top_k 2048, thresholds
    from a scored 4096-key sample, called eagerly and replayed as one CUDA graph; also the
    select alone, with every row fitting and without repair mode; and the select + top-K
    with SDSA_WIDE_WINDOW's thresholds."""
    unknown = [k for k in keys if k not in SDSA_KEY_FORMATS]
    if unknown or not keys:
        raise ValueError(f"keys = {keys!r}: give key formats among {SDSA_KEY_FORMATS}")
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    requests, context = 128, 65536
    pages = context // 64
    table = (
        torch.randperm(requests * pages, device=device, generator=gen).int().view(requests, pages)
    )
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    lines = []
    for fmt in keys:
        values = torch.randn(requests * pages, 64, 128, device=device, generator=gen)
        if fmt == "nvfp4":
            # The reference quantizer in slices of pages: whole, its temporaries outgrow HBM.
            parts = [reference.sdsa_nvfp4_quantize(v) for v in values.split(4096)]
            cache = torch.cat([codes for codes, _ in parts])
            key_scales = torch.cat([scales for _, scales in parts]).view(torch.uint8)
            del parts
            key_bytes = 64 + 8
        else:
            cache, key_scales, key_bytes = values.to(torch.bfloat16), None, 256
        del values
        keys = (cache, key_scales, table)
        moved = requests * context * key_bytes
        for rows in (1, 4):
            q = torch.randn(requests * rows, 128, device=device, generator=gen)
            sd1_us = sdsa_scores_us(keys, q, fmt, flush, iters)
            sd2, repaired = sdsa_select_top_k_us(keys, q, fmt, flush)
            wide, wide_repaired = sdsa_select_top_k_us(keys, q, fmt, flush, **SDSA_WIDE_WINDOW)
            for name, what, us in (
                ("SD1", "indexer_scores", sd1_us),
                (
                    "SD2",
                    f"threshold select + top-2048 of the live rows ({repaired} rows repaired)",
                    sd2.pop("select + top-K"),
                ),
                *(("SD2", f"threshold {what}", us) for what, us in sd2.items()),
                (
                    "SD2",
                    f"threshold select + top-2048 of the live rows, threshold at the sample's "
                    f"{SDSA_WIDE_WINDOW['sample_rank']}th, cap {SDSA_WIDE_WINDOW['cap']} "
                    f"({wide_repaired} rows repaired)",
                    wide["select + top-K"],
                ),
            ):
                lines.append(
                    f"{name} {what}, {fmt} keys, {requests} x {rows} rows x {context} keys: "
                    f"{us:.1f} us cold L2, {moved / us / 1e3:.0f} GB/s "
                    f"({moved / us / 1e6 / HBM_TBPS:.0%} of HBM) on {moved / 1e6:.0f} MB of keys"
                )
    return lines


def icp_times(iters: int = 20) -> list[str]:
    """The ICP indexer's chains (P128, W = 2 and 4) with the ranks simulated on one GPU: their
    kernels one after the other on one stream, the exchange a same-GPU publish (decode) or a
    copy (prefill's all-to-all), so no NVLink time is in them. Decode: one layer (every
    rank's score plane and select + publish, then every owner's merge) at 64 and 256 requests
    x 32,768 tokens, one query token each; the score plane alone beside the HBM floor of its
    shard's key bytes. Prefill: one 8192-token window at the end of a 65,536-token sequence
    (score, select, all-to-all, merge). Per rank: the simulated chain's time / W."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = []
    for world in (2, 4):
        for requests in (64, 256):
            lines.append(icp_decode_line(world, requests, 32768, gen, iters))
        lines.append(icp_prefill_line(world, 65536, 8192, gen, iters))
    return lines


def icp_fp8(gen, *shape):
    return torch.randn(*shape, device="cuda", generator=gen).to(torch.float8_e4m3fn)


def icp_decode_line(world: int, requests: int, context: int, gen, iters: int) -> str:
    from sparseforge import msa_icp

    page, hpr, device = 128, 4 // world, torch.device("cuda")
    pages = context // page
    table = torch.randperm(requests * pages, device=device, generator=gen)
    table = table.int().view(requests, pages)
    shards = [icp_fp8(gen, requests * pages, page // world, 128) for _ in range(world)]
    q = icp_fp8(gen, requests, 4, 128)
    seq_lens = torch.full((requests,), context, dtype=torch.int32, device=device)
    nvp = torch.full((requests,), context // 128, dtype=torch.int32, device=device)
    comms = msa_icp.MSAIcpComm.simulated(world, requests, device)
    columns = msa_icp.msa_icp_decode_score_columns(context, page)
    scores = [torch.empty(requests, 4, columns, device=device) for _ in range(world)]
    outs = [torch.empty(requests, hpr, 16, dtype=torch.int32, device=device) for _ in comms]
    slot = [0]

    def score(r):
        msa_icp.msa_icp_decode_index_score_sharded(
            q, shards[r], table, seq_lens, scores[r], rank=r, world_size=world,
            page_size=page, decode_query_len=1, max_decode_query_len=1,
        )  # fmt: skip

    pools = [
        torch.empty(msa_icp.msa_icp_decode_pool_bytes(max_decode_tokens=requests),
                    dtype=torch.uint8, device=device)
        for _ in range(world)
    ]  # fmt: skip

    def layer(fused: bool):
        s = slot[0]
        slot[0] = (s + 1) % 3
        for r in range(world):
            if fused:
                msa_icp.msa_icp_decode_score_publish(
                    q, shards[r], table, seq_lens, nvp, pools[r], comms[r].legacy_bases,
                    comms[r].errors, rank=r, world_size=world, page_size=page,
                    decode_query_len=1, slot=s, capacity=requests, force_begin_blocks=1,
                    force_end_blocks=2,
                )  # fmt: skip
                continue
            score(r)
            msa_icp.msa_icp_topk_select_publish(
                scores[r], nvp, comms[r].legacy_bases, comms[r].errors, slot=s, rank=r,
                world_size=world, heads_per_rank=hpr, capacity=requests,
                force_begin_blocks=1, force_end_blocks=2,
            )  # fmt: skip
        for r in range(world):
            msa_icp.msa_icp_merge_candidates(
                comms[r].legacy[s], nvp, outs[r], comms[r].errors, init_blocks=1,
                local_blocks=2,
            )  # fmt: skip

    # The chains interleaved: score plane and select, then the fused path, twice.
    chain = fused = math.inf
    for _ in range(2):
        chain = min(chain, cuda_time_ms(lambda: layer(False), iters=iters) * 1e3 / world)
        fused = min(fused, cuda_time_ms(lambda: layer(True), iters=iters) * 1e3 / world)
    plane = cuda_time_ms(lambda: score(0), iters=iters) * 1e3
    # The same plane with a request's pages in one CTA (no split), interleaved with it.
    with unittest.mock.patch.object(msa_icp, "_decode_page_splits", lambda *args: 1):
        unsplit = cuda_time_ms(lambda: score(0), iters=iters) * 1e3
    plane = min(plane, cuda_time_ms(lambda: score(0), iters=iters) * 1e3)
    assert all(c.errors.item() == 0 for c in comms)
    key_bytes = requests * context // world * 128
    splits = msa_icp._decode_page_splits(device, requests, columns, page // world)
    return (
        f"ICP decode P128 W={world}, {requests} requests x {context} tokens: chain "
        f"{chain:.1f} us a rank (score plane {plane:.1f} us = "
        f"{key_bytes / plane / 1e6 / HBM_TBPS:.0%} of HBM on {key_bytes / 1e6:.0f} MB of "
        f"keys, pages split over {splits} CTAs a request; {unsplit:.1f} us unsplit; select, "
        f"publish and merge the rest); fused path (msa_icp_decode_score_publish) {fused:.1f} "
        "us a rank"
    )


def icp_prefill_line(world: int, context: int, window: int, gen, iters: int) -> str:
    from sparseforge import msa_icp

    page, hpr, device = 128, 4 // world, torch.device("cuda")
    pages = context // page
    table = torch.randperm(pages, device=device, generator=gen).int().view(1, pages)
    shards = [icp_fp8(gen, pages, page // world, 128) for _ in range(world)]
    q = icp_fp8(gen, window, 4, 128)
    plan = msa_icp.msa_icp_index_score_sharded_plan(
        torch.tensor([window], dtype=torch.int32), torch.tensor([context], dtype=torch.int32),
        4, qo_offset=torch.tensor([context - window], dtype=torch.int32), device=device,
    )  # fmt: skip
    columns = msa_icp.msa_icp_index_score_columns(context, page)
    positions = torch.arange(context - window, context, device=device)
    nvp = (positions // 128 + 1).int()
    scores = [torch.empty(window, 4, columns, device=device) for _ in range(world)]
    carriers = [torch.empty(4, window, 33, dtype=torch.int32, device=device) for _ in scores]
    received = torch.empty(world, world, hpr, window, 33, dtype=torch.int32, device=device)
    outs = [torch.empty(window, hpr, 16, dtype=torch.int32, device=device) for _ in scores]
    errors = torch.zeros(1, dtype=torch.int32, device=device)

    def score(r):
        msa_icp.msa_icp_index_score_sharded(
            q, shards[r], table, plan, rank=r, max_score=scores[r], tp=world
        )

    def prefill():
        for r in range(world):
            score(r)
            msa_icp.msa_icp_topk_select_prefill(
                scores[r], nvp, carriers[r], force_begin_blocks=1, force_end_blocks=2
            )
        for owner in range(world):
            for r in range(world):
                received[owner, r].copy_(carriers[r][owner * hpr : (owner + 1) * hpr])
        for owner in range(world):
            msa_icp.msa_icp_merge_candidates(
                received[owner], nvp, outs[owner], errors, init_blocks=1, local_blocks=2,
                prefill=True,
            )  # fmt: skip

    pool = torch.empty(
        msa_icp.msa_icp_prefill_pool_bytes(total_q=window, batch=1, device=device),
        dtype=torch.uint8, device=device,
    )  # fmt: skip

    def local(fused: bool):
        """A rank's score and local top-16 (before the exchange)."""
        if fused:
            msa_icp.msa_icp_prefill_score_select(
                q, shards[0], table, plan, nvp, pool, carriers[0], rank=0, tp=world,
                force_begin_blocks=1, force_end_blocks=2,
            )  # fmt: skip
            return
        score(0)
        msa_icp.msa_icp_topk_select_prefill(
            scores[0], nvp, carriers[0], force_begin_blocks=1, force_end_blocks=2
        )

    chain = cuda_time_ms(prefill, iters=iters) / world
    scored = cuda_time_ms(lambda: score(0), iters=iters)
    separate = fused = math.inf
    for _ in range(2):  # interleaved
        separate = min(separate, cuda_time_ms(lambda: local(False), iters=iters))
        fused = min(fused, cuda_time_ms(lambda: local(True), iters=iters))
    assert errors.item() == 0
    flops = 2 * 128 * 4 * float((positions + 1).sum()) / world  # a rank's visible keys
    return (
        f"ICP prefill P128 W={world}, a {window}-token window at the end of {context} tokens: "
        f"chain {chain:.2f} ms a rank ({window / chain / 1e3:.2f} M tokens/s; score "
        f"{scored:.2f} ms = {flops / scored / 1e9:.0f} TFLOPS of FP8 q.k); score and local "
        f"top-16 {separate:.2f} ms, fused (msa_icp_prefill_score_select) {fused:.2f} ms"
    )


def sdsa_query(q: torch.Tensor, fmt: str):
    """(query, query_scales) of fp32 rows in the key format."""
    if fmt == "bf16":
        return q.to(torch.bfloat16), None
    data, scales = reference.sdsa_nvfp4_quantize(q)
    return data, scales.view(torch.uint8)


def sdsa_scores_us(keys, q, fmt: str, flush, iters: int) -> float:
    """Microseconds of indexer_scores of q's rows (rows / requests a request) over every
    key of each request, cold L2."""
    from sparseforge import sdsa

    cache, key_scales, table = keys
    requests, context = table.shape[0], table.shape[1] * 64
    query, query_scales = sdsa_query(q, fmt)
    scores = torch.empty(q.shape[0], context, device=q.device)
    lengths = torch.full((requests,), context, dtype=torch.int32, device=q.device)
    order = torch.arange(requests, dtype=torch.int32, device=q.device)
    call = functools.partial(
        sdsa.indexer_scores, query, cache, table, lengths, requests=order, scores=scores,
        query_scales=query_scales, key_scales=key_scales,
    )  # fmt: skip

    return cuda_time_ms(call, warmup=2, iters=iters, before=flush.zero_) * 1e3


def sdsa_select_top_k_us(
    keys, q, fmt: str, flush, iters: int = 10, sample_rank: int = 160, cap: int = 3072
):
    """({what: microseconds} of threshold select with repair + top_k_from_candidates (over
    the live rows: a (requests, rows) grid of strided views, one call), of the two replayed
    as one CUDA graph, of the select alone in repair mode, of it when every row fits
    (thresholds from a first repair: the repair launch's fixed cost), of the select without
    repair mode (its first launch only); rows repaired) for q's rows (rows / requests a
    request, each request one 128-row tile, its other rows seeing no key), top_k 2048,
    thresholds from the scores of a 4096-key sample (4 keys of each page) at its
    `sample_rank`-th largest (160: about 2560 candidates expected in 65,536 keys, most rows
    fit in a `cap` of 3072; a wider window, such as SDSA_WIDE_WINDOW, leaves fewer rows to
    repair for more candidates a row: sdsa_window_fit), cold L2, the thresholds and
    counters reset before each run outside its timing."""
    from sparseforge import sdsa

    cache, key_scales, table = keys
    requests, context = table.shape[0], table.shape[1] * 64
    per_request = q.shape[0] // requests
    device, top_k, tile = q.device, 2048, 128
    slots = top_k + cap
    sample = torch.empty(requests, 4096, cache.shape[2], dtype=cache.dtype, device=device)
    sample_scales = None if key_scales is None else torch.empty(requests, 4096, 8, **_U8)
    offsets = (torch.arange(4096, device=device) % 4 * 16).to(torch.uint8)
    sdsa.gather_key_sample(
        cache, table, offsets, torch.full((requests,), 4096, dtype=torch.int32, device=device),
        sample_keys=sample, samples_per_run=4, pages_per_run=1, key_scales=key_scales,
        sample_scales=sample_scales,
    )  # fmt: skip
    query, query_scales = sdsa_query(q, fmt)
    sample_scores = torch.empty(q.shape[0], 4096, device=device)
    sdsa.indexer_scores(
        query, sample.view(-1, 64, sample.shape[2]),
        torch.arange(requests * 64, dtype=torch.int32, device=device).view(requests, 64),
        torch.full((requests,), 4096, dtype=torch.int32, device=device),
        requests=torch.arange(requests, dtype=torch.int32, device=device),
        scores=sample_scores, query_scales=query_scales,
        key_scales=None if sample_scales is None else sample_scales.view(-1, 64, 8),
    )  # fmt: skip
    thresholds = torch.empty(q.shape[0], device=device)
    counters = torch.empty(q.shape[0], 2, dtype=torch.int32, device=device)
    sdsa.thresholds_from_sample(
        sample_scores, sample_scores.topk(sample_rank, dim=1).indices.int(),
        thresholds=thresholds, counters=counters,
    )  # fmt: skip
    # Each request's rows at the top of its 128-row tile; the rest see no key.
    rows = requests * tile
    first_rows = torch.arange(requests, device=device)[:, None] * tile
    at = (first_rows + torch.arange(per_request, device=device)).flatten()
    tile_query = torch.zeros(rows, query.shape[1], dtype=query.dtype, device=device)
    tile_query[at] = query
    tile_scales = None
    if query_scales is not None:
        tile_scales = torch.zeros(rows, 8, **_U8)
        tile_scales[at] = query_scales
    from_sample = torch.full((rows,), float("inf"), device=device)
    from_sample[at] = thresholds
    row_ends = torch.zeros(rows, dtype=torch.int32, device=device)
    row_ends[at] = context
    args = dict(
        thresholds=from_sample.clone(),
        counters=torch.zeros(rows, 2, dtype=torch.int32, device=device),
        candidates=torch.empty(rows, slots, 2, dtype=torch.int32, device=device),
        max_context=context, top_k=top_k, query_scales=tile_scales, key_scales=key_scales,
        arrivals=torch.zeros(requests, dtype=torch.int32, device=device),
        ranges=torch.empty(2, rows, dtype=torch.int32, device=device),
    )  # fmt: skip
    requests_of_tiles = torch.arange(requests, dtype=torch.int32, device=device)
    top_keys = torch.empty(requests, per_request, top_k, dtype=torch.int32, device=device)

    def select(**mode):
        sdsa.indexer_threshold_select(
            tile_query, cache, row_ends, requests_of_tiles, table, **(args | mode)
        )

    def select_top_k():
        select()
        # The live rows only: the first per_request rows of every tile, one call.
        sdsa.top_k_from_candidates(
            args["candidates"].view(requests, tile, slots, 2)[:, :per_request],
            args["ranges"].view(2, requests, tile)[:, :, :per_request],
            top_keys=top_keys,
        )

    def timed(fn, thresholds=from_sample):
        """fn's time, each run from `thresholds` and zeroed counters (set outside the
        timing, with the cold L2)."""

        def before():
            flush.zero_()
            args["thresholds"].copy_(thresholds)
            args["counters"].zero_()

        return cuda_time_ms(fn, warmup=2, iters=iters, before=before) * 1e3

    times = {"select + top-K": timed(select_top_k)}
    # As a decode engine runs it: the two calls captured in one CUDA graph (no host work or
    # launch gaps between the kernels), replayed from the same reset state.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        select_top_k()
    times["select + top-K, one CUDA graph"] = timed(graph.replay)
    times["select, repair mode"] = timed(select)
    repaired = int((args["thresholds"] != from_sample).sum())
    # The repaired rows' exact thresholds make every row fit: the repair launch's fixed cost.
    fitting = args["thresholds"].clone()
    times["select, repair mode, every row fits"] = timed(select, thresholds=fitting)
    times["select without repair mode"] = timed(lambda: select(arrivals=None, ranges=None))
    return times, repaired


# GPU cycles spun ahead of a series of run() calls whose host time is measured (~50 ms):
# the calls queue behind it, so the GPU's pace at the tiny kernels cannot set the time.
HOST_SERIES_LEAD_CYCLES = 100_000_000


def run_host_overhead(backend: str = "auto", calls: int = 400, series: int = 5) -> dict:
    """Microseconds of host time per run() on a tiny problem (out= given), by wrapper
    ("variable", "BSR"): the median over `series` series of the mean of `calls` back-to-back
    calls, so that one stalled series does not set the number. Each series queues behind a
    GPU spin (HOST_SERIES_LEAD_CYCLES): timed back to back on an idle GPU, calls faster than
    the GPU runs their kernels would be timed at the GPU's pace once its launch queue
    filled. The host itself varies more: with the same code, machines have read 15 us
    (d4244c8) and 17-23 us (three calls in one process on another)."""
    import time

    from sparseforge import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper

    device = torch.device("cuda")
    workspace = torch.empty(1, device=device)
    q = torch.randn(1, 64, 128, device=device, dtype=torch.bfloat16)  # HND: 64 tokens, 1 head
    mask = torch.ones(1, 1, 1, dtype=torch.bool, device=device)
    sizes = torch.full((1, 1), 64, dtype=torch.int32, device=device)
    variable = VariableBlockSparseAttentionWrapper(workspace, backend=backend)
    variable.plan(mask, sizes, sizes, 1, 1, 128, q_data_type=torch.bfloat16)
    # The same problem through the BSR wrapper (NHD): one 64 x 64 block.
    bsr = BlockSparseAttentionWrapper(workspace, backend=backend)
    indptr = torch.tensor([0, 1], dtype=torch.int32, device=device)
    bsr.plan(indptr, indptr[:1], 64, 64, 64, 64, 1, 1, 128, q_data_type=torch.bfloat16)
    # NHD with the strides a (tokens, heads, D) projection has: q.transpose(0, 1).contiguous()
    # would keep the head dimension's stride of 8192 (a size-1 dimension is contiguous with
    # any stride), which run()'s quick check (exact strides) sends to the full checks.
    q_nhd = torch.randn(64, 1, 128, device=device, dtype=torch.bfloat16)
    out, out_nhd = torch.empty_like(q), torch.empty_like(q_nhd)
    runs = {
        "variable": lambda: variable.run(q, q, q, out=out),
        "BSR": lambda: bsr.run(q_nhd, q_nhd, q_nhd, out=out_nhd),
    }
    overhead = {}
    for name, run in runs.items():
        for _ in range(50):
            run()
        means = []
        for _ in range(series):
            torch.cuda.synchronize()
            torch.cuda._sleep(HOST_SERIES_LEAD_CYCLES)
            start = time.perf_counter()
            for _ in range(calls):
                run()
            means.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
        overhead[name] = statistics.median(means)
    return overhead


def plan_time_us(w: Workload, form: str, iters: int = 20) -> tuple[float, float]:
    """(GPU time of plan() from a CUDA-graph replay, host wall time of an eager plan()), in
    microseconds, for the workload's selections on the GPU as a `form`: "mask" (variable
    wrapper, block_mask_map) or "q2k" (BSR wrapper, q2k_indices)."""
    import time

    from sparseforge import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper

    device = torch.device("cuda")
    mb = w.seq // w.block
    mask = random_selection(w.heads_kv, mb, mb, w.topk)
    workspace = torch.empty(1, device=device)
    if form == "mask":
        mask = mask.to(device)
        sizes = torch.full((w.heads_kv, mb), w.block, dtype=torch.int32, device=device)
        wrapper = VariableBlockSparseAttentionWrapper(workspace)
        args, kwargs = (mask, sizes, sizes, w.heads_q, w.heads_kv, w.head_dim), {}
    else:
        selected = mask.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., : w.topk]
        group = w.heads_q // w.heads_kv
        q2k = selected.repeat_interleave(group, 0).to(device, torch.int32).contiguous()
        wrapper = BlockSparseAttentionWrapper(workspace)
        args = (None, None, w.seq, w.seq, w.block, w.block, w.heads_q, w.heads_kv, w.head_dim)
        kwargs = dict(q2k_indices=q2k)

    def plan():
        wrapper.plan(*args, q_data_type=torch.bfloat16, **kwargs)

    for _ in range(3):
        plan()
    torch.cuda.synchronize()
    walls = []
    for _ in range(iters):
        start = time.perf_counter()
        plan()
        walls.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan()
    gpu_us = cuda_time_ms(graph.replay, iters=iters) * 1e3
    return gpu_us, statistics.median(walls)


def describe_run() -> str:
    """Date, the commit the kernel library was built from (its manifest's "source";
    SPARSEFORGE_COMMIT overrides it), GPU."""
    from sparseforge import _library

    commit = os.environ.get("SPARSEFORGE_COMMIT") or _library.manifest().get("source")
    gpu = torch.cuda.get_device_name()
    line = (
        f"date {datetime.date.today()}, commit {commit or 'unknown'}, GPU {gpu}, "
        f"torch {torch.__version__}"
    )
    if "H200" not in gpu:  # the floors are constants measured on the H200
        line += (
            f"\nfloors and '% of HBM' use the H200's {MATMUL_CEILING_TFLOPS:.0f} TFLOPS (bf16) "
            f"and {HBM_TBPS} TB/s, not this GPU's"
        )
    return line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", help="also write the table (markdown) here")
    parser.add_argument("--plot", metavar="DIR", help="also write PNG charts there (matplotlib)")
    parser.add_argument(
        "--diffusers",
        action="store_true",
        help="also time a Wan transformer forward, dense vs sparse",
    )
    parser.add_argument(
        "--selection",
        action="store_true",
        help="also time the selection kernels (MS1 proxy score, MS2 top-16, TS1 / TS2 "
        "token-sparse builders)",
    )
    parser.add_argument(
        "--msa",
        action="store_true",
        help="also time MSA sparse attention (MP1 prefill, MD1 / MD4 decode)",
    )
    parser.add_argument(
        "--msa-modes",
        default="random,chunked",
        help="MP1's selection kinds for --msa: random, chunked, shared:N (N of 14 drawn "
        "blocks shared by each 16 tokens)",
    )
    parser.add_argument(
        "--sdsa",
        action="store_true",
        help="also time the SDSA indexer (SD1 scores, SD2 threshold select + top-K)",
    )
    parser.add_argument(
        "--sdsa-keys",
        default=",".join(SDSA_KEY_FORMATS),
        help="key formats for --sdsa: bf16, nvfp4 (comma list)",
    )
    parser.add_argument(
        "--icp",
        action="store_true",
        help="also time the ICP indexer's chains (decode and prefill, ranks simulated on one GPU)",
    )
    parser.add_argument(
        "--options",
        action="store_true",
        help="also time W1 with plan()'s options (mask, soft cap, ALiBi, causal)",
    )
    parser.add_argument(
        "--variants", default="", help="comma list of variant names to time one by one (tuning)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: the benchmark needs one", file=sys.stderr)
        return 1
    rows = []
    for variant in args.variants.split(",") if args.variants else [""]:
        os.environ["SPARSEFORGE_VARIANT"] = variant
        for name in args.workloads.split(","):
            try:
                rows.append(run_workload(WORKLOADS[name], args.backend, args.iters))
            except Exception as exc:  # a variant that does not fit a workload: skip the row
                print(f"{variant or 'default'} {name}: {exc}")
                continue
            if variant:
                rows[-1]["path"] = variant.split("__")[2]
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    os.environ.pop("SPARSEFORGE_VARIANT", None)
    sage_lines = [r["amax_scales"] for r in rows if r["amax_scales"]]
    if any(WORKLOADS[n].sage for n in args.workloads.split(",")):
        sage_lines += sage_offset_accuracy()
    overhead = run_host_overhead(args.backend)
    plan_rows = []
    for form, what in (
        ("mask", "block_mask_map, variable wrapper"),
        ("q2k", "q2k_indices, BSR wrapper"),
    ):
        gpu_us, wall_us = plan_time_us(WORKLOADS["W1"], form)
        plan_rows.append(
            f"plan() of the W1 selections ({what}, on the GPU): {gpu_us:.1f} us GPU time "
            f"(CUDA-graph replay, median), {wall_us:.1f} us host time (eager, median)"
        )
    report = "\n".join(
        [
            describe_run(),
            f"backend {args.backend}",
            "",
            table(rows),
            "",
            *sage_lines,
            f"run() host overhead: {overhead['variable']:.1f} us per call (variable wrapper), "
            f"{overhead['BSR']:.1f} us (BSR wrapper)",
            *plan_rows,
        ]
    )
    if args.diffusers:
        dense, sparse, tokens = diffusers_forward_times()
        report += (
            f"\nWanTransformer3DModel forward (random weights, 4 blocks of Wan 1.3B's width, "
            f"{tokens} tokens): dense {dense:.1f} ms, sparse (top-64 tiles) {sparse:.1f} ms, "
            f"{dense / sparse:.2f}x"
        )
    if args.selection:
        report += "\n" + "\n".join(selection_times())
    if args.msa:
        modes = tuple(args.msa_modes.split(","))
        report += "\n" + "\n".join(msa_attention_times(modes=modes))
    if args.sdsa:
        report += "\n" + "\n".join(sdsa_times(keys=tuple(args.sdsa_keys.split(","))))
    if args.icp:
        report += "\n" + "\n".join(icp_times())
    if args.options:
        report += "\n" + "\n".join(logit_options_times())
    print(report)
    if args.plot:
        for path in plot(rows, density_sweep(), args.plot, describe_run()):
            print(f"wrote {path}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
