"""msa_proxy_score on the GPU against the fp64 PyTorch reference: flat and paged keys, bf16
and fp16, causal with default (right-aligned) and explicit query offsets and not, GQA,
reduce_heads, ragged sequences (a partial last block, a sequence without keys, several
64-query tiles, decode rows of one query), an output wider than the sequences' blocks,
outputs poisoned with NaN before the run, and a CUDA graph replay."""

import pytest
import torch
from sparseforge import reference
from sparseforge.check import proxy_score_inputs
from sparseforge.msa_ops import msa_proxy_score

pytestmark = pytest.mark.gpu

SHAPES = {
    "prefill": ([1, 200, 77, 5], [5000, 700, 77, 0]),
    "decode": ([1] * 9, [128 * i + 17 * i for i in range(9)]),
}


def assert_scores_match(got, want):
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "-inf blocks differ"
    assert torch.equal(torch.isinf(got) & (got > 0), torch.isinf(want) & (want > 0))
    finite = torch.isfinite(want)
    assert torch.isfinite(got[finite]).all(), "NaN or inf where the reference is finite"
    scale = want[finite].abs().max().clamp_min(1)
    assert float((got[finite] - want[finite]).abs().max() / scale) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("paged", [False, True], ids=["flat", "paged"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(
    "causal, offsets, reduce_heads",
    [(True, None, False), (True, "explicit", True), (False, None, False), (False, None, True)],
)
def test_matches_the_reference(dtype, paged, shape, causal, offsets, reduce_heads):
    seq_q, seq_k = SHAPES[shape]
    hq, hkv = (8, 2) if shape == "prefill" else (4, 1)
    args = proxy_score_inputs(dtype, paged, seq_q, seq_k, hq=hq, hkv=hkv, device="cuda")
    if offsets == "explicit":  # some rows before the first key, some past the last
        args["q_offset"] = torch.tensor(
            [(-1) ** b * 40 * b for b in range(len(seq_q))], dtype=torch.int32, device="cuda"
        )
    tiles = -(-max(seq_k) // 128) + 2
    out = torch.full((1 if reduce_heads else hq, tiles, sum(seq_q)), float("nan"), device="cuda")
    got = msa_proxy_score(
        **args, causal=causal, reduce_heads=reduce_heads, max_k_tiles=tiles, output=out,
        max_seqlen_q=max(seq_q),
    )  # fmt: skip
    assert got is out
    want = reference.msa_proxy_score(
        **args, causal=causal, reduce_heads=reduce_heads, max_k_tiles=tiles
    )
    torch.cuda.synchronize()
    assert_scores_match(got, want.to(got.device))


def test_default_sizes_are_read_from_the_gpu():
    """max_seqlen_q and max_k_tiles left out: the output is as wide as the longest sequence."""
    args = proxy_score_inputs(torch.bfloat16, False, [3, 70], [300, 100], device="cuda")
    got = msa_proxy_score(**args)
    assert got.shape == (4, 3, 73)
    assert_scores_match(got, reference.msa_proxy_score(**args).to(got.device))


def test_replays_in_a_cuda_graph():
    args = proxy_score_inputs(torch.bfloat16, True, [70, 1], [300, 129], device="cuda")
    out = torch.empty(4, 3, 71, device="cuda")
    kwargs = dict(max_seqlen_q=70, max_k_tiles=3, output=out)
    msa_proxy_score(**args, **kwargs)  # binds before capture
    want = out.clone()
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        msa_proxy_score(**args, **kwargs)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
