"""sparseforge.video_sparse_attention: the recipe (tile means, coarse logits, top-k tiles per
kv group, fine block-sparse attention, gated coarse output) against its PyTorch reference.
CPU: the reference backend of the wrappers and the recipe's pieces against independent
fp64 computations; GPU: the kernels (bf16, fp16 and Sage FP8)."""

import math

import pytest
import torch
from sparseforge import reference, video_sparse_attention


def inputs(b, hq, hkv, s, d, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = lambda h: ((b,) if b else ()) + (h, s, d)  # noqa: E731
    return tuple(
        torch.randn(shape(h), generator=gen, device=device).to(dtype) for h in (hq, hkv, hkv)
    )


def test_tile_means_and_selection_match_fp64():
    x = torch.randn(2, 3, 150, 8, dtype=torch.float64)
    means = reference.tile_means(x)
    assert means.shape == (2, 3, 3, 8)
    torch.testing.assert_close(
        means[..., 2, :].double(), x[..., 128:, :].mean(-2), rtol=1e-6, atol=1e-6
    )
    logits = torch.randn(1, 4, 5, 5)
    chosen = reference.select_tiles(logits, 2, 2)  # groups of two query heads
    grouped = logits.view(1, 2, 2, 5, 5).double().mean(2)
    want = grouped.argsort(-1, descending=True)[..., :2]
    assert torch.equal(chosen.sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize(
    "b, hq, hkv, s, topk", [(0, 2, 2, 200, 2), (2, 4, 2, 128, 1), (1, 3, 1, 300, 5)]
)
@pytest.mark.parametrize("gated", [False, True])
def test_reference_backend_matches_the_recipe(b, hq, hkv, s, topk, gated):
    q, k, v = inputs(b, hq, hkv, s, 16, torch.bfloat16, "cpu")
    gate = torch.rand(hq, 1, 16) if gated else None
    got = video_sparse_attention(q, k, v, topk=topk, gate=gate, backend="torch")
    want = reference.video_sparse_attention(q, k, v, topk=topk, gate=gate)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), want.double(), atol=2e-2, rtol=2e-2)


def test_all_tiles_selected_is_dense_attention():
    q, k, v = inputs(0, 2, 1, 130, 16, torch.float16, "cpu")
    got = video_sparse_attention(q, k, v, topk=99, backend="torch")
    want, _ = reference.attention(q, k, v)
    torch.testing.assert_close(got.double(), want.double(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(topk=0), "topk must be a positive int"),
        (dict(k=torch.zeros(3, 64, 16, dtype=torch.bfloat16)), "num_qo_heads 2 must be a multiple"),
        (dict(q=torch.zeros(2, 64, 16)), "bfloat16 or float16"),
        (dict(v=torch.zeros(1, 64, 8, dtype=torch.bfloat16)), "v has shape"),
    ],
)
def test_bad_inputs_raise_by_name(change, message):
    q, k, v = inputs(0, 2, 1, 64, 16, torch.bfloat16, "cpu")
    args = dict(q=q, k=k, v=v, topk=1) | change
    with pytest.raises(ValueError, match=message):
        video_sparse_attention(args.pop("q"), args.pop("k"), args.pop("v"), backend="torch", **args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "b, hq, hkv, s, topk", [(2, 4, 4, 1000, 4), (1, 8, 2, 4096, 16), (0, 4, 1, 777, 3)]
)
def test_kernels_match_the_reference(dtype, b, hq, hkv, s, topk):
    q, k, v = inputs(b, hq, hkv, s, 128, dtype, "cuda", seed=s)
    gate = torch.rand(hq, 1, 128, device="cuda")
    got = video_sparse_attention(q, k, v, topk=topk, gate=gate)
    want = reference.video_sparse_attention(q, k, v, topk=topk, gate=gate)
    err = float((got.double() - want.double()).norm() / want.double().norm())
    assert err < 5e-3, err


@pytest.mark.gpu
def test_sage_fp8_matches_the_reference_within_its_error():
    q, k, v = inputs(1, 4, 2, 2048, 128, torch.bfloat16, "cuda", seed=3)
    got = video_sparse_attention(q, k, v, topk=8, fp8=True)
    want = reference.video_sparse_attention(q, k, v, topk=8)
    cos = float((got.double() * want).sum() / (got.double().norm() * want.double().norm()))
    assert got.dtype == torch.bfloat16 and cos > 0.998, cos


@pytest.mark.gpu
def test_captured_in_a_cuda_graph():
    q, k, v = inputs(1, 4, 2, 1024, 128, torch.bfloat16, "cuda", seed=4)
    eager = video_sparse_attention(q, k, v, topk=4)
    graph = torch.cuda.CUDAGraph()
    video_sparse_attention(q, k, v, topk=4)  # warm-up outside the capture
    with torch.cuda.graph(graph):
        out = video_sparse_attention(q, k, v, topk=4)
    graph.replay()
    assert torch.equal(out, eager) and math.isfinite(float(out.float().sum()))
