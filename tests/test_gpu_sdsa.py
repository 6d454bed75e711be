"""sparseforge.sdsa on the GPU against the PyTorch reference: the NVFP4 quantizer byte for
byte (scale range, saturation, zero / NaN / midpoint groups, skipped slots and rows, the
cache and its scales as views of one allocation), no rows at all, CUDA-graph replay; scores
over paged BF16 and NVFP4 keys (groups of 1, 4, 8 rows, an empty request, untouched
entries); the key sample; the thresholds from a sample (NaN and -1 positions); the top-K
from candidates (ties, infinities, NaNs; K 1, 32, 200); the threshold select (counters,
slots, stored values; +inf, -inf and NaN thresholds)."""

import pytest
import torch
from sparseforge import reference, sdsa
from sparseforge.check import (
    same_selection,
    same_top_k,
    sdsa_candidates,
    sdsa_paged_keys,
    sdsa_quantize_inputs,
    sdsa_quantized,
    sdsa_queries,
    sdsa_select_inputs,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("keys, queries", [(3000, 300), (1, 0), (0, 5)])
def test_quantizer_matches_the_reference_byte_for_byte(dtype, keys, queries):
    args = sdsa_quantize_inputs(dtype, max(keys, 1), max(queries, 1), 64, 512, device="cuda")
    args["key"], args["slots"] = args["key"][:keys], args["slots"][:keys]
    args["query"], args["query_rows"] = args["query"][:queries], args["query_rows"][:queries]
    want = sdsa_quantized(args)
    sdsa.quantize_write_index_qk_nvfp4(**args)
    torch.cuda.synchronize()
    for name, expected in want.items():
        assert torch.equal(args[name], expected), name


def test_graph_replay_writes_what_eager_writes():
    args = sdsa_quantize_inputs(torch.bfloat16, 500, 50, 16, 64, seed=2, device="cuda")
    want = sdsa_quantized(args)
    poisoned = {name: args[name].clone() for name in want}
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sdsa.quantize_write_index_qk_nvfp4(**args)  # warm-up (loads the kernel)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sdsa.quantize_write_index_qk_nvfp4(**args)
    for name in want:
        args[name].copy_(poisoned[name])
    graph.replay()
    torch.cuda.synchronize()
    for name, expected in want.items():
        assert torch.equal(args[name], expected), name


@pytest.mark.parametrize("nvfp4", [False, True])
@pytest.mark.parametrize("rows_per_group", [1, 4, 8])
def test_scores_match_fp32_dot_products(nvfp4, rows_per_group):
    lengths = [1000, 0, 64, 4097]
    cache, key_scales, table = sdsa_paged_keys(lengths, nvfp4, device="cuda")
    groups = len(lengths)
    query, query_scales = sdsa_queries(groups * rows_per_group, nvfp4, device="cuda")
    requests = torch.tensor([3, 1, 2, 0], dtype=torch.int32, device="cuda")
    context = torch.tensor(
        [lengths[3], 0, lengths[2], lengths[0]], dtype=torch.int32, device="cuda"
    )
    scores = torch.full((groups * rows_per_group, 4200), float("nan"), device="cuda")
    want = scores.clone()
    reference.indexer_scores(
        query, cache, table, context, requests=requests, scores=want, query_scales=query_scales,
        key_scales=key_scales,
    )  # fmt: skip
    sdsa.indexer_scores(
        query, cache, table, context, requests=requests, scores=scores, query_scales=query_scales,
        key_scales=key_scales,
    )  # fmt: skip
    assert torch.equal(scores.isnan(), want.isnan())  # the same entries written
    # Within 1e-5 of sum |q_i k_i| (what fp32 sums of 128 products can guarantee): the
    # reference on |q| and |k| (NVFP4: the sign bits cleared).
    absolute = (lambda x: x & 0x77) if nvfp4 else torch.abs  # noqa: E731
    bound = torch.zeros_like(want)
    reference.indexer_scores(
        absolute(query), absolute(cache), table, context, requests=requests, scores=bound,
        query_scales=query_scales, key_scales=key_scales,
    )  # fmt: skip
    written = ~want.isnan()
    excess = (scores[written] - want[written]).abs() - 1e-5 * bound[written]
    assert excess.max() <= 0, float(excess.max())


@pytest.mark.parametrize("nvfp4", [False, True])
def test_sample_copies_the_logical_keys(nvfp4):
    cache, key_scales, table = sdsa_paged_keys([5000, 3000], nvfp4, seed=2, device="cuda")
    width = 64 if nvfp4 else 128
    rows, cap = 2, 256
    gen = torch.Generator().manual_seed(3)
    offsets = torch.randint(0, 64, (cap,), generator=gen, dtype=torch.uint8).cuda()
    ends = torch.tensor([256, 100], dtype=torch.int32, device="cuda")
    sample = torch.full((rows, cap, width), 7, dtype=cache.dtype, device="cuda")
    sample_scales = (
        torch.full((rows, cap, 8), 7, dtype=torch.uint8, device="cuda") if nvfp4 else None
    )
    want, want_scales = sample.clone(), None if sample_scales is None else sample_scales.clone()
    kw = dict(samples_per_run=32, pages_per_run=2, key_scales=key_scales)
    reference.gather_key_sample(
        cache, table, offsets, ends, sample_keys=want, sample_scales=want_scales, **kw
    )
    sdsa.gather_key_sample(
        cache, table, offsets, ends, sample_keys=sample, sample_scales=sample_scales, **kw
    )
    torch.cuda.synchronize()
    assert torch.equal(sample, want)
    if nvfp4:
        assert torch.equal(sample_scales, want_scales)


def test_thresholds_from_sample():
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(300, 512, generator=gen)
    scores[5, 7] = float("nan")
    top = torch.randint(0, 512, (300, 40), generator=gen, dtype=torch.int32)
    top[5, 0] = 7  # a NaN score: -inf
    top[9, 3] = -1  # no position: -inf
    thresholds = torch.full((300,), 5.0)
    counters = torch.ones(300, 2, dtype=torch.int32)
    want, want_counters = thresholds.clone(), counters.clone()
    reference.thresholds_from_sample(scores, top, thresholds=want, counters=want_counters)
    args = [t.cuda() for t in (scores, top, thresholds, counters)]
    sdsa.thresholds_from_sample(args[0], args[1], thresholds=args[2], counters=args[3])
    assert torch.equal(args[2].cpu(), want) and torch.equal(args[3].cpu(), want_counters)
    assert want[5] == -float("inf") and want[9] == -float("inf")


def test_top_k_from_candidates():
    candidates, ranges = sdsa_candidates(600, 300, device="cuda")
    for k in (1, 32, 200):
        got = torch.full((600, k), -9, dtype=torch.int32, device="cuda")
        want = got.clone()
        sdsa.top_k_from_candidates(candidates, ranges, top_keys=got)
        reference.top_k_from_candidates(candidates, ranges, top_keys=want)
        assert same_top_k(got, want, candidates, ranges), k


@pytest.mark.parametrize("nvfp4", [False, True])
def test_threshold_select(nvfp4):
    got = sdsa_select_inputs([5000, 64, 4097], nvfp4, device="cuda")
    want = {**got, "counters": got["counters"].clone(), "candidates": got["candidates"].clone()}
    sdsa.indexer_threshold_select(**got)
    reference.indexer_threshold_select(**want)
    assert same_selection(got, want)
