"""sparseforge.sdsa on the GPU against the PyTorch reference: the NVFP4 quantizer byte for
byte (scale range, saturation, zero / NaN / midpoint groups, skipped slots and rows, the
cache and its scales as views of one allocation), no rows at all, CUDA-graph replay; scores
over paged BF16 and NVFP4 keys (groups of 1-5 and 8 rows, an empty request, untouched
entries); the key sample; the thresholds from a sample (NaN and -1 positions); the top-K
from candidates (ties, infinities, NaNs; K 1, 32, 200; rows enough for each CTA to walk
more than 256); the threshold select (counters,
slots, stored values; +inf, -inf and NaN thresholds; more candidates than a CTA stages;
unaligned NVFP4 scale pages) and its repair mode (every row fits,
its exact top-K); the whole pipeline from the quantizer to token-sparse slot lists."""

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
_u8 = dict(dtype=torch.uint8, device="cuda")


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
@pytest.mark.parametrize("rows_per_group", [1, 2, 3, 4, 5, 8])
def test_scores_match_fp32_dot_products(nvfp4, rows_per_group):
    lengths = [1000, 0, 64, 4097]
    cache, key_scales, table = sdsa_paged_keys(lengths, nvfp4, device="cuda")
    groups = len(lengths)
    query, query_scales = sdsa_queries(groups * rows_per_group, nvfp4, device="cuda")
    # The empty group's request is ignored: any number, here past the table's rows.
    requests = torch.tensor([3, 1 << 30, 2, 0], dtype=torch.int32, device="cuda")
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


@pytest.mark.parametrize("offset, page_stride", [(0, 512), (2, 512), (8, 520), (16, 528)])
def test_nvfp4_scores_read_scale_pages_at_every_allowed_alignment(offset, page_stride):
    """The scores stage 16-byte aligned scale pages by bulk copies and the others (even
    addresses, page strides that are multiples of 8) two bytes at a time: the same scores."""
    lengths = [1000, 0, 64, 4097]
    cache, key_scales, table = sdsa_paged_keys(lengths, True, device="cuda")
    query, query_scales = sdsa_queries(2 * len(lengths), True, device="cuda")
    pages = key_scales.shape[0]
    storage = torch.zeros(offset + pages * page_stride, **_u8)
    strided = storage[offset:].as_strided((pages, 64, 8), (page_stride, 8, 1))
    strided.copy_(key_scales)
    requests = torch.tensor([3, 1, 2, 0], dtype=torch.int32, device="cuda")
    context = torch.tensor(
        [lengths[3], 0, lengths[2], lengths[0]], dtype=torch.int32, device="cuda"
    )
    got, want = (torch.full((len(query), 4200), float("nan"), device="cuda") for _ in range(2))
    for scales, scores in ((strided, got), (key_scales, want)):
        sdsa.indexer_scores(
            query, cache, table, context, requests=requests, scores=scores,
            query_scales=query_scales, key_scales=scales,
        )  # fmt: skip
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("nvfp4", [False, True])
def test_scores_of_groups_that_see_no_key_with_an_empty_table(nvfp4):
    """Every group's context is 0, so no request names a table row: a table of no rows is
    never read, and the scores stay as they were."""
    cache, key_scales, _ = sdsa_paged_keys([64], nvfp4, device="cuda")
    query, query_scales = sdsa_queries(4, nvfp4, device="cuda")
    table = torch.empty(0, 16, dtype=torch.int32, device="cuda")
    scores = torch.full((4, 1000), 7.0, device="cuda")
    sdsa.indexer_scores(
        query, cache, table, torch.zeros(2, dtype=torch.int32, device="cuda"),
        requests=torch.tensor([5, -3], dtype=torch.int32, device="cuda"), scores=scores,
        query_scales=query_scales, key_scales=key_scales,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert (scores == 7.0).all()


def test_scales_at_an_odd_address_are_refused_before_launch():
    """The scores read a key's (and a query row's) two scales as one 2-byte load."""
    cache, key_scales, table = sdsa_paged_keys([100], True, device="cuda")
    query, query_scales = sdsa_queries(1, True, device="cuda")
    odd = torch.empty(key_scales.numel() + 1, **_u8)[1:].view(key_scales.shape)
    odd.copy_(key_scales.view(torch.uint8))
    scores = torch.full((1, 100), float("nan"), device="cuda")
    context = torch.tensor([100], dtype=torch.int32, device="cuda")
    requests = torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="key_scales must start at an even address"):
        sdsa.indexer_scores(
            query, cache, table, context, requests=requests, scores=scores,
            query_scales=query_scales, key_scales=odd,
        )  # fmt: skip
    torch.cuda.synchronize()
    assert scores.isnan().all()  # nothing launched


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


def test_top_k_of_the_live_rows_of_tiles_as_strided_views():
    """The j-th row of each 128-row tile, picked by strided views of candidates, ranges and
    top_keys (what a decode engine runs: the other rows see no key), gives the same keys as
    the whole rows; the rows of other j and of top_keys stay untouched."""
    tiles, slots, k = 5, 300, 32
    candidates, ranges = sdsa_candidates(tiles * 128, slots, device="cuda")
    whole = torch.full((tiles * 128, k), -9, dtype=torch.int32, device="cuda")
    sdsa.top_k_from_candidates(candidates, ranges, top_keys=whole)
    live = torch.full((tiles, 3, k), -9, dtype=torch.int32, device="cuda")
    for j in (0, 2):
        sdsa.top_k_from_candidates(
            candidates.view(tiles, 128, slots, 2)[:, j],
            ranges.view(2, tiles, 128)[:, :, j],
            top_keys=live[:, j],
        )
    by_tile = whole.view(tiles, 128, k)
    for j in (0, 2):
        rows = torch.arange(tiles, device="cuda") * 128 + j
        assert same_top_k(live[:, j], by_tile[:, j], candidates[rows], ranges[:, rows]), j
    assert (live[:, 1] == -9).all()
    # Rows 1-3 of every tile as a (tiles, 3) grid in one call, into a strided top_keys.
    grid = torch.full((tiles, 3, 2 * k), -9, dtype=torch.int32, device="cuda")
    sdsa.top_k_from_candidates(
        candidates.view(tiles, 128, slots, 2)[:, 1:4],
        ranges.view(2, tiles, 128)[:, :, 1:4],
        top_keys=grid[:, :, :k],
    )
    rows = torch.arange(tiles, device="cuda")[:, None] * 128 + torch.arange(1, 4, device="cuda")
    rows = rows.flatten()
    got = grid[:, :, :k].reshape(-1, k)
    assert same_top_k(got, whole[rows], candidates[rows], ranges[:, rows])
    assert (grid[:, :, k:] == -9).all()


def test_top_k_walks_many_rows_per_cta():
    """The launch runs at most 1021 CTAs, each walking rows at that stride and loading their
    ranges 256 at a time: 257 x 1021 + 3 rows, each with 0-2 pairs (K = 2: copied, then -1)
    but every 97th with 3 (radix select), checked whole."""
    rows, k = 257 * 1021 + 3, 2
    gen = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 3, (rows,), generator=gen, dtype=torch.int32)
    counts[::97] = 3
    first = torch.randint(0, 2, (rows,), generator=gen, dtype=torch.int32)
    candidates = torch.stack(
        [
            torch.randint(0, 1 << 20, (rows, 5), generator=gen, dtype=torch.int32),
            torch.randn(rows, 5, generator=gen).view(torch.int32),
        ],
        dim=2,
    ).cuda()
    ranges = torch.stack([first, first + counts]).cuda()
    got = torch.full((rows, k), -9, dtype=torch.int32, device="cuda")
    sdsa.top_k_from_candidates(candidates, ranges, top_keys=got)
    counts, first = counts.cuda(), first.cuda()
    column = torch.arange(k, device="cuda")
    copied = candidates[
        torch.arange(rows, device="cuda")[:, None], (first[:, None] + column).clamp(max=4), 0
    ]
    copied = torch.where(column < counts[:, None], copied, -1)
    few = counts <= k
    assert torch.equal(got[few], copied[few])
    many = (~few).nonzero().flatten()
    want = torch.full((many.numel(), k), -9, dtype=torch.int32, device="cuda")
    reference.top_k_from_candidates(candidates[many], ranges[:, many], top_keys=want)
    assert same_top_k(got[many], want, candidates[many], ranges[:, many])


def own_outputs(args: dict) -> dict:
    """indexer_threshold_select's arguments with counters and candidates (its in-place
    outputs) of their own, for a second select over the same inputs."""
    return {**args, "counters": args["counters"].clone(), "candidates": args["candidates"].clone()}


@pytest.mark.parametrize("nvfp4", [False, True])
def test_threshold_select(nvfp4):
    got = sdsa_select_inputs([5000, 64, 4097], nvfp4, device="cuda")
    want = own_outputs(got)
    sdsa.indexer_threshold_select(**got)
    reference.indexer_threshold_select(**want)
    assert same_selection(got, want)


@pytest.mark.parametrize("nvfp4", [False, True])
def test_threshold_select_stores_more_candidates_than_a_cta_stages(nvfp4):
    """Room for every key: a CTA stages 64 candidates a row and stores the rest at once
    (the -inf row and rows with low thresholds find up to 512 in a CTA's keys); every
    candidate is stored once, with the reference's value."""
    got = sdsa_select_inputs([5000, 64, 4097], nvfp4, slots=16 + 5000, device="cuda")
    want = own_outputs(got)
    sdsa.indexer_threshold_select(**got)
    reference.indexer_threshold_select(**want)
    assert int(want["counters"][:, 0].max()) > 64
    assert same_selection(got, want)


@pytest.mark.parametrize("nvfp4", [False, True])
def test_select_of_a_tile_that_sees_no_key_may_name_any_request(nvfp4):
    """The select loads a CTA's table entries before it knows which rows see its keys: a
    tile whose rows see no key may name a request past the table's rows, and selects
    nothing."""
    got = sdsa_select_inputs([5000, 64], nvfp4, device="cuda")
    got["row_ends"][128:] = 0
    want = own_outputs(got)
    want["tile_requests"] = torch.zeros(2, dtype=torch.int32, device="cuda")
    got["tile_requests"] = torch.tensor([0, 1 << 30], dtype=torch.int32, device="cuda")
    sdsa.indexer_threshold_select(**got)
    reference.indexer_threshold_select(**want)
    assert (got["counters"][128:] == 0).all()
    assert same_selection(got, want)


@pytest.mark.parametrize("offset, page_stride", [(2, 512), (8, 520)])
def test_nvfp4_select_reads_scale_pages_at_unaligned_addresses(offset, page_stride):
    """The select stages NVFP4 pages as the scores do: scale pages that bulk copies cannot
    take (even addresses, page strides that are multiples of 8) give the same selection."""
    got = sdsa_select_inputs([5000, 64, 4097], True, device="cuda")
    want = own_outputs(got)
    scales = got["key_scales"]
    storage = torch.zeros(offset + scales.shape[0] * page_stride, **_u8)
    got["key_scales"] = storage[offset:].as_strided(scales.shape, (page_stride, 8, 1))
    got["key_scales"].copy_(scales)
    sdsa.indexer_threshold_select(**got)
    reference.indexer_threshold_select(**want)
    assert same_selection(got, want)


def kernel_scores(args: dict) -> torch.Tensor:
    """indexer_scores of every row of indexer_threshold_select's arguments against its
    tile's keys (what the select and its repair compute, bit for bit), -inf past row_end."""
    rows = args["query"].shape[0]
    tiles = args["tile_requests"].repeat_interleave(128)
    scores = torch.full((rows, args["max_context"]), float("nan"), device="cuda")
    ends = args["row_ends"].clamp(max=args["max_context"])
    sdsa.indexer_scores(
        args["query"], args["key_cache"], args["block_table"], ends, requests=tiles,
        scores=scores, query_scales=args["query_scales"], key_scales=args["key_scales"],
    )  # fmt: skip
    return scores.nan_to_num(nan=-float("inf"))


def assert_exact_top_k(args: dict, ranges, scores) -> torch.Tensor:
    """Every row fits, ranges are its slots, and top_k_from_candidates over them gives the
    exact top-K of the row's scores (as multisets: ties may pick other keys) where the
    threshold is a number (a NaN threshold makes every key a tie: such a row fits with any
    top_k of its keys)."""
    top_k, rows = args["top_k"], args["query"].shape[0]
    cap = args["candidates"].shape[1] - top_k
    cands, ties = args["counters"].unbind(1)
    wanted = args["row_ends"].clamp(max=args["max_context"]).clamp(max=top_k)
    assert (cands <= cap).all() and (cands + ties.clamp(max=top_k) >= wanted).all()
    assert torch.equal(ranges[0], top_k - ties.clamp(max=top_k))
    assert torch.equal(ranges[1], top_k + cands.clamp(max=cap))
    top_keys = torch.full((rows, top_k), -9, dtype=torch.int32, device="cuda")
    sdsa.top_k_from_candidates(args["candidates"], ranges, top_keys=top_keys)
    for r in range(rows):
        if args["thresholds"][r].isnan():
            continue
        n = int(wanted[r])
        assert (top_keys[r, n:] == -1).all(), r
        got = scores[r, top_keys[r, :n].long()].sort().values
        assert torch.equal(got, scores[r].topk(n).values.sort().values), r
    return top_keys


@pytest.mark.parametrize("lengths", [[5000, 64, 4097], [5000, 64, 4097, 300, 2000], [140_000, 64]])
@pytest.mark.parametrize("nvfp4", [False, True])
def test_threshold_select_repair(nvfp4, lengths):
    """Rows whose thresholds are +inf (nothing above), -inf (everything above) or from
    the data (some fit, some do not) all end up fitting with their exact top-K; the rows
    that fit keep their thresholds and the plain select's counters. (The repair takes 512
    rows a cluster: five tiles are two clusters, the second with 128 rows. On SM90 a
    cluster keeps the scores of a row's first 131,072 keys on chip: 140,000 keys make it
    compute the rest in every pass.)"""
    args = sdsa_select_inputs(lengths, nvfp4, top_k=16, slots=64, device="cuda")
    rows = 128 * len(lengths)
    args["thresholds"][3::5] = -float("inf")
    args["thresholds"][4::5] = float("inf")
    plain = own_outputs(args)
    sdsa.indexer_threshold_select(**plain)
    given = args["thresholds"].clone()
    arrivals = torch.zeros(len(lengths), dtype=torch.int32, device="cuda")
    ranges = torch.full((2, rows), -5, dtype=torch.int32, device="cuda")
    sdsa.indexer_threshold_select(**args, arrivals=arrivals, ranges=ranges)
    assert (arrivals == 0).all()
    kept = args["thresholds"] == given
    kept |= args["thresholds"].isnan() & given.isnan()
    assert 0 < int((~kept[512:]).sum()) or rows <= 512  # the second cluster repairs too
    assert 0 < int((~kept).sum()) < rows
    assert torch.equal(args["counters"][kept], plain["counters"][kept])
    assert_exact_top_k(args, ranges, kernel_scores(args))


@pytest.mark.parametrize("nvfp4", [False, True])
def test_select_repair_and_top_k_replay_in_a_cuda_graph(nvfp4):
    """Threshold select in repair mode and the top-K of its ranges, captured in one CUDA
    graph and replayed over poisoned outputs, give what they give eagerly: the same
    thresholds, counters and ranges, and the same top keys as score multisets (a class's
    slot order is free, so the keys within a tie may differ), each the exact top-K."""
    args = sdsa_select_inputs([5000, 64, 4097], nvfp4, top_k=16, slots=64, device="cuda")
    rows = args["thresholds"].shape[0]
    arrivals = torch.zeros(3, dtype=torch.int32, device="cuda")
    ranges = torch.empty(2, rows, dtype=torch.int32, device="cuda")
    top_keys = torch.empty(rows, 16, dtype=torch.int32, device="cuda")
    given = args["thresholds"].clone()

    def pipeline():
        sdsa.indexer_threshold_select(**args, arrivals=arrivals, ranges=ranges)
        sdsa.top_k_from_candidates(args["candidates"], ranges, top_keys=top_keys)

    def poison():
        args["thresholds"].copy_(given)
        args["counters"].zero_()
        args["candidates"].fill_(-7)
        ranges.fill_(-5)
        top_keys.fill_(-9)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        pipeline()  # eager (and the kernels loaded)
    torch.cuda.synchronize()
    eager = [t.clone() for t in (args["thresholds"], args["counters"], ranges, top_keys)]
    candidates = args["candidates"].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        pipeline()
    poison()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(args["thresholds"].isnan(), eager[0].isnan())
    assert torch.equal(args["thresholds"].nan_to_num(), eager[0].nan_to_num())
    assert torch.equal(args["counters"], eager[1])
    assert torch.equal(ranges, eager[2])
    # (Rows 0-2 have thresholds +inf, -inf, NaN: which of their many ties are stored is
    # free, so only the exact top-K below says they are right.)
    assert same_top_k(top_keys[3:], eager[3][3:], candidates[3:], eager[2][:, 3:])
    assert_exact_top_k(args, ranges, kernel_scores(args))


@pytest.mark.parametrize("nvfp4", [False, True])
def test_repair_with_top_k_0_counts_as_the_reference(nvfp4):
    """top_k = 0: a row whose candidates pass the slots is repaired to threshold +inf
    (nothing wanted) and selected again; its counters (0 candidates, the ties at +inf
    or NaN) equal the reference's, as do every row's ranges (all empty)."""
    args = sdsa_select_inputs([3000, 300], nvfp4, top_k=0, slots=8, device="cuda")
    rows = args["query"].shape[0]
    want = own_outputs(args)
    want["thresholds"] = args["thresholds"].clone()
    repair = [
        dict(
            arrivals=torch.zeros(2, dtype=torch.int32, device="cuda"),
            ranges=torch.full((2, rows), -5, dtype=torch.int32, device="cuda"),
        )
        for _ in range(2)
    ]
    sdsa.indexer_threshold_select(**args, **repair[0])
    reference.indexer_threshold_select(**want, **repair[1])
    assert (args["thresholds"] == float("inf")).any()  # some rows repaired
    assert torch.equal(args["counters"].cpu(), want["counters"].cpu())
    assert torch.equal(repair[0]["ranges"].cpu(), repair[1]["ranges"].cpu())


@pytest.mark.parametrize("nvfp4", [False, True])
def test_pipeline_gives_the_exact_top_k(nvfp4):
    """The documented pipeline on the GPU: keys and queries quantized (NVFP4) -> a key
    sample gathered and scored -> its top positions -> thresholds -> threshold select with
    repair -> top-K from candidates -> token-sparse slot lists; each row's top-K is the
    exact top-K of its full scores."""
    lengths, top_k, slots, rows = [5000, 3000], 512, 512 + 600, 256
    gen = torch.Generator(device="cuda").manual_seed(5)
    cache, _, table = sdsa_paged_keys(lengths, False, seed=5, device="cuda")
    query = torch.randn(rows, 128, device="cuda", generator=gen).to(torch.bfloat16)
    key_scales = query_scales = None
    if nvfp4:
        pages = cache.shape[0]
        key_cache = torch.empty(pages, 64, 64, dtype=torch.uint8, device="cuda")
        key_scales = torch.empty(pages, 64, 8, dtype=torch.uint8, device="cuda")
        packed = torch.empty(rows, 64, dtype=torch.uint8, device="cuda")
        query_scales = torch.empty(rows, 8, dtype=torch.uint8, device="cuda")
        sdsa.quantize_write_index_qk_nvfp4(
            cache.view(-1, 128), torch.arange(pages * 64, device="cuda"), query,
            torch.arange(rows, device="cuda"), key_cache=key_cache, key_scales=key_scales,
            packed_query=packed, query_scales=query_scales,
        )  # fmt: skip
        cache, query = key_cache, packed
    # A sample of 128 keys a request (8 of each 64-key page) and its top 14: thresholds
    # near the 11% point, so the 5000-key rows about fit (top_k 512) and the others miss.
    per_run, cap = 8, 128
    sample = torch.empty(2, cap, cache.shape[2], dtype=cache.dtype, device="cuda")
    sample_scales = None if key_scales is None else torch.empty(2, cap, 8, **_u8)
    offsets = (torch.arange(cap, device="cuda") % per_run * 8).to(torch.uint8)
    ends = torch.full((2,), cap, dtype=torch.int32, device="cuda")
    sdsa.gather_key_sample(
        cache, table, offsets, ends, sample_keys=sample, samples_per_run=per_run,
        pages_per_run=1, key_scales=key_scales, sample_scales=sample_scales,
    )  # fmt: skip
    sample_scores = torch.empty(rows, cap, device="cuda")
    tiles = torch.arange(rows, device="cuda", dtype=torch.int32) // 128
    sdsa.indexer_scores(
        query, sample.view(-1, 64, sample.shape[2]),
        torch.arange(4, dtype=torch.int32, device="cuda").view(2, 2),
        torch.full((rows,), cap, dtype=torch.int32, device="cuda"), requests=tiles,
        scores=sample_scores, query_scales=query_scales,
        key_scales=None if sample_scales is None else sample_scales.view(-1, 64, 8),
    )  # fmt: skip
    thresholds = torch.empty(rows, device="cuda")
    counters = torch.ones(rows, 2, dtype=torch.int32, device="cuda")
    sdsa.thresholds_from_sample(
        sample_scores, sample_scores.topk(14, dim=1).indices.int(), thresholds=thresholds,
        counters=counters,
    )  # fmt: skip
    from_sample = thresholds.clone()
    args = dict(
        query=query, key_cache=cache, row_ends=torch.tensor(lengths, device="cuda").int()
        .repeat_interleave(128), tile_requests=torch.arange(2, dtype=torch.int32, device="cuda"),
        block_table=table, thresholds=thresholds, counters=counters,
        candidates=torch.full((rows, slots, 2), -7, dtype=torch.int32, device="cuda"),
        max_context=max(lengths), top_k=top_k, query_scales=query_scales, key_scales=key_scales,
    )  # fmt: skip
    ranges = torch.empty(2, rows, dtype=torch.int32, device="cuda")
    sdsa.indexer_threshold_select(
        **args, arrivals=torch.zeros(2, dtype=torch.int32, device="cuda"), ranges=ranges
    )
    assert 0 < int((thresholds != from_sample).sum()) < rows  # some rows were repaired
    top_keys = assert_exact_top_k(args, ranges, kernel_scores(args))

    from sparseforge.token_sparse import token_sparse_kv_indices

    block_tables = torch.full((rows, 2, top_k), -9, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((rows,), -9, dtype=torch.int32, device="cuda")
    token_sparse_kv_indices(top_keys, tiles, table, block_tables=block_tables, seq_lens=seq_lens)
    keys = top_keys.long()
    slots_want = table[tiles[:, None].long(), keys // 64].long() * 64 + keys % 64
    assert torch.equal(block_tables[:, 0].long(), slots_want)
    assert torch.equal(block_tables[:, 1], block_tables[:, 0])
    assert (seq_lens == top_k).all()
