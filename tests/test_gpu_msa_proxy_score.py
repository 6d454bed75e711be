"""msa_proxy_score on the GPU against the fp64 PyTorch reference: flat and paged keys, bf16,
fp16, e4m3 and NVFP4 (msa_proxy_score_fp4, against the reference on the dequantized values),
causal with default (right-aligned) and explicit query offsets and not, GQA,
reduce_heads, ragged sequences (a partial last block, a sequence without keys, several
64-query tiles, decode rows of one query), an output wider than the sequences' blocks,
outputs poisoned with NaN before the run, a CUDA graph replay; and the chain an engine runs
(proxy score -> msa_topk_select -> the BSR wrapper's q2k_indices), each stage checked."""

import pytest
import torch
from sparseforge import reference
from sparseforge.check import proxy_score_inputs
from sparseforge.msa_ops import msa_proxy_score, msa_proxy_score_fp4, msa_topk_select

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


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, "nvfp4"], ids=str
)
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
    run, ref = msa_proxy_score, reference.msa_proxy_score
    if dtype == "nvfp4":
        run, ref = msa_proxy_score_fp4, reference.msa_proxy_score_fp4
    got = run(
        **args, causal=causal, reduce_heads=reduce_heads, max_k_tiles=tiles, output=out,
        max_seqlen_q=max(seq_q),
    )  # fmt: skip
    assert got is out
    want = ref(**args, causal=causal, reduce_heads=reduce_heads, max_k_tiles=tiles)
    torch.cuda.synchronize()
    assert_scores_match(got, want.to(got.device))


@pytest.mark.parametrize("paged", [False, True], ids=["flat", "paged"])
@pytest.mark.parametrize("causal, reduce_heads", [(True, False), (False, True)])
def test_e4m3_on_fp8_tensor_cores(paged, causal, reduce_heads):
    """use_fp32_acc=False: e4m3 sums on Hopper's FP8 wgmma, whose accumulator keeps fewer bits
    than fp32; the same blocks are -inf and the rest within 2e-3 of the largest score."""
    seq_q, seq_k = SHAPES["prefill"]
    args = proxy_score_inputs(torch.float8_e4m3fn, paged, seq_q, seq_k, hq=8, hkv=2, device="cuda")
    options = dict(causal=causal, reduce_heads=reduce_heads, max_k_tiles=42)
    got = msa_proxy_score(**args, **options, max_seqlen_q=max(seq_q), use_fp32_acc=False)
    want = reference.msa_proxy_score(**args, **options).to(got.device)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "-inf blocks differ"
    finite = torch.isfinite(want)
    scale = want[finite].abs().max()
    assert float((got[finite] - want[finite]).abs().max() / scale) <= 2e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["flat", "paged"])
def test_portable_kernel_where_a_native_one_exists(monkeypatch, dtype, paged):
    """The mma.sync variants SM100 and SM120 run, forced on this GPU (SPARSEFORGE_VARIANT)."""
    from sparseforge.families import msa_proxy_score as family

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the forced variants are the sm_90a build's")
    name = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "e4m3"}[dtype]
    layout = "paged" if paged else "flat"
    variant = f"msa_proxy_score__warp_mma__{name}_d128_{layout}__sm_90a"
    monkeypatch.setenv("SPARSEFORGE_VARIANT", variant)
    family.launch.cache_clear()
    try:
        seq_q, seq_k = SHAPES["prefill"]
        args = proxy_score_inputs(dtype, paged, seq_q, seq_k, hq=8, hkv=2, device="cuda")
        got = msa_proxy_score(**args, max_seqlen_q=max(seq_q), max_k_tiles=42)
        assert_scores_match(got, reference.msa_proxy_score(**args, max_k_tiles=42).to(got.device))
    finally:
        family.launch.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, "nvfp4"], ids=str)
def test_blocks_whose_page_id_leaves_the_cache_score_minus_inf(dtype):
    args = proxy_score_inputs(dtype, True, [3, 70], [300, 100], device="cuda")
    table = args["page_table"].clone()
    table[0, 1] = (args["k_fp4"] if dtype == "nvfp4" else args["k"]).shape[0]
    table[1, 0] = -1
    args["page_table"] = table
    run, ref = msa_proxy_score, reference.msa_proxy_score
    if dtype == "nvfp4":
        run, ref = msa_proxy_score_fp4, reference.msa_proxy_score_fp4
    got = run(**args)
    want = ref(**args)
    assert torch.isinf(want[:, 1, :3]).all()
    assert_scores_match(got, want.to(got.device))


def test_default_sizes_are_read_from_the_gpu():
    """max_seqlen_q and max_k_tiles left out: the output is as wide as the longest sequence."""
    args = proxy_score_inputs(torch.bfloat16, False, [3, 70], [300, 100], device="cuda")
    got = msa_proxy_score(**args)
    assert got.shape == (4, 3, 73)
    assert_scores_match(got, reference.msa_proxy_score(**args).to(got.device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, "nvfp4"])
def test_replays_in_a_cuda_graph(dtype):
    args = proxy_score_inputs(dtype, True, [70, 1], [300, 129], device="cuda")
    run = msa_proxy_score_fp4 if dtype == "nvfp4" else msa_proxy_score
    out = torch.empty(4, 3, 71, device="cuda")
    kwargs = dict(max_seqlen_q=70, max_k_tiles=3, output=out)
    run(**args, **kwargs)  # binds before capture
    want = out.clone()
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(**args, **kwargs)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_chain_into_block_sparse_attention():
    """proxy score -> one top-16 per (kv head, 64-token query block) -> the BSR wrapper's
    q2k_indices (the README's MSA quick start), each stage against its reference."""
    from sparseforge import BlockSparseAttentionWrapper

    seq, hq, hkv, d = 4096, 4, 2, 128  # 32 key blocks, 16 selected
    group, blocks = hq // hkv, seq // 128
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(seq, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(seq, hkv, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in "kv")
    cu = torch.tensor([0, seq], dtype=torch.int32, device="cuda")
    scores = msa_proxy_score(q, k, cu, cu, causal=False, max_seqlen_q=seq, max_k_tiles=blocks)
    assert_scores_match(scores, reference.msa_proxy_score(q, k, cu, cu, causal=False))
    rows = scores.view(hkv, group, blocks, seq // 64, 64).amax((1, 4))
    selected = msa_topk_select(rows, 16, force_begin_blocks=1)
    assert torch.equal(selected, reference.msa_topk_select(rows, 16, None, 1, 0))
    q2k = selected.permute(1, 0, 2).repeat_interleave(group, 0).contiguous()
    wrapper = BlockSparseAttentionWrapper(torch.empty(1, device="cuda"))
    wrapper.plan(
        None, None, seq, seq, 64, 128, hq, hkv, d, q2k_indices=q2k,
        q2k_num=(q2k >= 0).sum(-1, dtype=torch.int32), q_data_type=torch.bfloat16,
    )  # fmt: skip
    wrapper.check_plan()
    out = wrapper.run(q, k, v)
    block_mask = torch.zeros(hkv, seq // 64, blocks, dtype=torch.bool)
    block_mask.scatter_(2, selected.permute(1, 0, 2).long().cpu(), True)
    tokens = reference.block_mask_to_token_mask(
        block_mask, reference.uniform_sizes(seq, 64), reference.uniform_sizes(seq, 128)
    ).cuda()
    want, _ = reference.attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), tokens,
        compute_dtype=torch.float64,
    )  # fmt: skip
    err = (out.transpose(0, 1).double() - want).norm() / want.norm()
    assert float(err) < 5e-3
