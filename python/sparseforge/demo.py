"""`python -m sparseforge demo`: one block-sparse problem beside cuDNN dense attention.

With no GPU it says so, runs the PyTorch reference on a small problem on the CPU and shows
what the build contains.
"""

from __future__ import annotations

import torch

from sparseforge import arch, reference
from sparseforge.errors import SparseforgeError
from sparseforge.info import build_summary


def cpu_demo(reason: str) -> int:
    print(f"no GPU run: {reason}")
    print(
        "running the PyTorch reference on the CPU instead (2 heads, 256 tokens, 64-token blocks):"
    )
    from sparseforge.bench import random_selection

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 256, 64) for _ in range(3))
    blocks = random_selection(2, 4, 4, topk=2)
    mask = reference.block_mask_to_token_mask(blocks, torch.full((4,), 64), torch.full((4,), 64))
    out, lse = reference.attention(q, k, v, mask)
    print(
        f"  out {tuple(out.shape)} mean |out| {out.abs().mean():.4f}, "
        f"lse range [{lse.min():.2f}, {lse.max():.2f}]"
    )
    for line in build_summary():
        print(line)
    return 0


def gpu_demo() -> int:
    from sparseforge.bench import Workload, run_workload, table

    w = Workload("demo", heads_q=16, heads_kv=16, seq=8192, block=64, topk=16)
    print(
        f"block-sparse attention: H={w.heads_q}, S={w.seq}, 64-token blocks, "
        f"{w.topk} per query block, bf16"
    )
    row = run_workload(w)
    print(table([row]))
    print(
        f"the sparse call took {row['ms']:.3f} ms against {row['dense_ms']:.3f} ms for cuDNN dense "
        f"attention: {row['dense_ms'] / row['ms']:.1f}x faster in wall time (it computes "
        f"{row['density']:.1%} of the scores, at {row['tflops'] / row['dense_tflops']:.2f}x "
        "cuDNN's rate per computed score)"
    )
    return 0


def main() -> int:
    try:
        arch.arch_for_device(0)
    except SparseforgeError as exc:
        return cpu_demo(str(exc))
    return gpu_demo()
