"""The SDSA indexer's PyTorch references (sparseforge.reference, flashinfer.sdsa's contract) on
the CPU against plain readings of the contract: the NVFP4 quantizer (no global scale,
saturation, zero groups, skipped slots), scores of grouped rows over paged BF16 and NVFP4 keys
(other entries untouched), the float-bit order (a positive NaN above +inf), the threshold
select's classes, counters, slots and repair, the top-K from candidates, the key sample and
the thresholds from it, and the documented pipeline end to end against the exact top-K."""

import math

import pytest
import torch
from sparseforge import reference
from sparseforge.check import sdsa_paged_keys

PAGE = reference.SDSA_PAGE


def paged_keys(lengths, nvfp4: bool, seed=0):
    """check.sdsa_paged_keys' cache, scales and table, and each request's keys as fp32."""
    cache, key_scales, table = sdsa_paged_keys(lengths, nvfp4, seed)
    keys = [
        reference.sdsa_request_keys(cache, table, r, n, key_scales) for r, n in enumerate(lengths)
    ]
    return cache, key_scales, table, keys


def test_quantizer_has_no_global_scale_saturates_and_skips():
    x = torch.randn(5, 128)
    x[1] = 0.0  # zero groups: scale 0, codes 0
    x[2, :16] = 1e4  # beyond 2688: saturates
    codes, scales = reference.sdsa_nvfp4_quantize(x)
    assert codes.shape == (5, 64) and scales.shape == (5, 8)
    back = reference.sdsa_dequantize(codes, scales)
    assert torch.equal(back[1], torch.zeros(128))
    assert torch.equal(back[2, :16], torch.full((16,), 2688.0))
    assert float(scales[0, 0].float()) == float(
        (x[0, :16].abs().max() / 6).to(torch.float8_e4m3fn).float()
    )
    cache = torch.full((2, PAGE, 64), 7, dtype=torch.uint8)
    key_scales = torch.full((2, PAGE, 8), 7, dtype=torch.uint8)
    packed = torch.full((4, 64), 7, dtype=torch.uint8)
    q_scales = torch.full((4, 8), 7, dtype=torch.uint8)
    reference.quantize_write_index_qk_nvfp4(
        x[:3], torch.tensor([70, -1, 3]), x[3:], torch.tensor([-5, 2]), key_cache=cache,
        key_scales=key_scales, packed_query=packed, query_scales=q_scales,
    )  # fmt: skip
    assert torch.equal(cache[1, 6], codes[0]) and torch.equal(cache[0, 3], codes[2])
    assert (cache[0, :3] == 7).all() and (cache[1, 7:] == 7).all()
    assert torch.equal(packed[2], codes[4]) and (packed[[0, 1, 3]] == 7).all()
    assert torch.equal(q_scales[2], scales[4].view(torch.uint8))


@pytest.mark.parametrize("nvfp4", [False, True])
def test_scores_of_row_groups(nvfp4):
    lengths = [100, 0, 64]
    cache, key_scales, table, keys = paged_keys(lengths, nvfp4)
    rows_per_group = 2
    q_values = torch.randn(6, 128)
    if nvfp4:
        query, q_scales = reference.sdsa_nvfp4_quantize(q_values)
        q_scales = q_scales.view(torch.uint8)
    else:
        query, q_scales = q_values.to(torch.bfloat16), None
    q = reference.sdsa_dequantize(query, q_scales)
    scores = torch.full((6, 130), math.nan)
    requests = torch.tensor([2, 1, 0], dtype=torch.int32)  # group g reads table row 2 - g
    context = torch.tensor([lengths[2], 0, lengths[0]], dtype=torch.int32)
    reference.indexer_scores(
        query, cache, table, context, requests=requests, scores=scores, query_scales=q_scales,
        key_scales=key_scales,
    )  # fmt: skip
    for g in range(3):
        n = int(context[g])
        for row in range(g * rows_per_group, (g + 1) * rows_per_group):
            for k in range(n):
                want = float(sum(q[row, i].double() * keys[2 - g][k, i] for i in range(128)))
                assert abs(float(scores[row, k]) - want) <= 1e-5 * max(1.0, abs(want))
            assert scores[row, n:].isnan().all()  # untouched


def test_float_order_puts_positive_nan_above_inf():
    nan = torch.tensor([math.nan]).view(torch.int32)
    negative_nan = (nan | torch.tensor([-(2**31)], dtype=torch.int32)).view(torch.float32)
    values = torch.tensor([-math.inf, -1.0, -0.0, 0.0, 1.0, math.inf, math.nan])
    order = reference.float_order(torch.cat([negative_nan, values]))
    assert torch.equal(order, order.sort().values) and order.unique().numel() == 8


def select(lengths, top_k, slots, thresholds, repair, seed=1):
    cache, _, table, keys = paged_keys(lengths, False, seed)
    tiles = len(lengths)
    query = torch.randn(tiles * 128, 128).to(torch.bfloat16)
    row_ends = torch.tensor([n for n in lengths for _ in range(128)], dtype=torch.int32)
    row_ends[5] = 3  # a row that sees only 3 keys
    counters = torch.zeros(tiles * 128, 2, dtype=torch.int32)
    candidates = torch.full((tiles * 128, slots, 2), -7, dtype=torch.int32)
    ranges = torch.zeros(2, tiles * 128, dtype=torch.int32) if repair else None
    arrivals = torch.zeros(tiles, dtype=torch.int32) if repair else None
    reference.indexer_threshold_select(
        query, cache, row_ends, torch.arange(tiles, dtype=torch.int32), table,
        thresholds=thresholds, counters=counters, candidates=candidates,
        max_context=max(lengths), top_k=top_k, arrivals=arrivals, ranges=ranges,
    )  # fmt: skip
    full = [
        (keys[r // 128][: min(int(row_ends[r]), max(lengths))].double() @ query[r].double()).float()
        for r in range(tiles * 128)
    ]
    return candidates, counters, ranges, full


def test_threshold_select_classes_counters_and_slots():
    top_k, slots = 8, 40
    thresholds = torch.full((256,), 0.5)
    thresholds[7] = math.inf  # no candidate, no tie
    candidates, counters, _, full = select([300, 200], top_k, slots, thresholds, repair=False)
    for r in (0, 5, 7, 130):
        score, thr = full[r], float(thresholds[r])
        above = (score > thr).nonzero().flatten()
        tie = (~(score > thr) & ~(score < thr)).nonzero().flatten()
        assert counters[r].tolist() == [above.numel(), tie.numel()]
        stored = candidates[r, top_k : top_k + min(above.numel(), slots - top_k)]
        assert set(stored[:, 0].tolist()) <= set(above.tolist())
        value = reference.stored_value(score[None], thresholds[r : r + 1])[0]
        for key, bits in stored.tolist():
            assert torch.tensor([bits], dtype=torch.int32).view(torch.float32) == value[key]
        untouched = candidates[r, top_k + min(above.numel(), slots - top_k) :]
        assert (untouched == -7).all()


def test_stored_value_keeps_the_order():
    scores = torch.randn(1, 1000) * 10
    for thr in (-3.0, 0.0, 0.25, 4.0):
        value = reference.stored_value(scores, torch.tensor([thr]))[0]
        above = scores[0] > thr
        order = scores[0][above].argsort()
        assert torch.equal(value[above][order], value[above][order].sort().values)


def test_pipeline_gives_the_exact_top_k():
    """quantize -> sample -> score the sample -> top of the sample -> thresholds -> threshold
    select with repair -> top-K from candidates: the exact top-K of the full scores (as
    score multisets)."""
    lengths, top_k, slots = [1000, 700], 32, 32 + 48
    rows = 256
    # A sample: every 4th key of each request's first pages, scored; its top 40 set the
    # thresholds (loose: some rows get too many candidates, which repair fixes).
    cache, _, table, keys = paged_keys(lengths, False, seed=3)
    sample_cap, per_run, pages_per_run = 128, 16, 1
    sample = torch.zeros(len(lengths), sample_cap, 128, dtype=cache.dtype)
    offsets = (torch.arange(sample_cap) % per_run * 4).to(torch.uint8)
    sample_ends = torch.tensor([128, 128], dtype=torch.int32)
    reference.gather_key_sample(
        cache, table, offsets, sample_ends, sample_keys=sample, samples_per_run=per_run,
        pages_per_run=pages_per_run,
    )  # fmt: skip
    key = 5 * PAGE * pages_per_run + int(offsets[5 * per_run + 3])
    assert torch.equal(sample[1, 5 * per_run + 3].float(), keys[1][key])
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
    sample_scores = torch.stack(
        [sample[r // 128].double() @ query[r].double() for r in range(rows)]
    ).float()
    sample_top = sample_scores.topk(4, dim=1).indices.int()
    sample_top[3, 0] = -1  # a missing position: that row's threshold is -inf
    thresholds = torch.empty(rows)
    counters = torch.ones(rows, 2, dtype=torch.int32)
    reference.thresholds_from_sample(
        sample_scores, sample_top, thresholds=thresholds, counters=counters
    )
    assert thresholds[3] == -math.inf and (counters == 0).all()
    assert thresholds[0] == sample_scores[0].topk(4).values.min()

    row_ends = torch.tensor([n for n in lengths for _ in range(128)], dtype=torch.int32)
    from_sample = thresholds.clone()
    candidates = torch.full((rows, slots, 2), -7, dtype=torch.int32)
    ranges = torch.zeros(2, rows, dtype=torch.int32)
    reference.indexer_threshold_select(
        query, cache, row_ends, torch.arange(2, dtype=torch.int32), table,
        thresholds=thresholds, counters=counters, candidates=candidates,
        max_context=max(lengths), top_k=top_k, arrivals=torch.zeros(2, dtype=torch.int32),
        ranges=ranges,
    )  # fmt: skip
    repaired = thresholds != from_sample
    assert (
        0 < int(repaired.sum()) < rows
    )  # some rows missed (too many candidates) and were repaired
    assert (counters[:, 0] <= slots - top_k).all()
    top_keys = torch.full((rows, top_k), -9, dtype=torch.int32)
    reference.top_k_from_candidates(candidates, ranges, top_keys=top_keys)
    for r in range(rows):
        full = (keys[r // 128].double() @ query[r].double()).float()
        got = full[top_keys[r].long()].sort().values
        want = full.topk(top_k).values.sort().values
        assert torch.equal(got, want), r
    # The same rows as a (tiles, rows) grid: the same keys.
    grid = torch.full((2, 128, top_k), -9, dtype=torch.int32)
    reference.top_k_from_candidates(
        candidates.view(2, 128, slots, 2), ranges.view(2, 2, 128), top_keys=grid
    )
    assert torch.equal(grid.view(rows, top_k), top_keys)


def test_top_k_from_candidates_with_few_pairs_and_errors():
    candidates = torch.tensor([[[5, 0], [9, 0], [2, 0], [-7, -7]]], dtype=torch.int32)
    ranges = torch.tensor([[0], [3]], dtype=torch.int32)
    top_keys = torch.zeros(1, 4, dtype=torch.int32)
    reference.top_k_from_candidates(candidates, ranges, top_keys=top_keys)
    assert top_keys.tolist() == [[5, 9, 2, -1]]
    with pytest.raises(ValueError, match="must be < 65536"):
        reference.top_k_from_candidates(
            candidates, ranges, top_keys=torch.zeros(1, 65536, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="top_k = 4 must be in"):
        reference.indexer_threshold_select(
            torch.zeros(128, 128), torch.zeros(1, PAGE, 128), torch.zeros(128, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
            thresholds=torch.zeros(128), counters=torch.zeros(128, 2, dtype=torch.int32),
            candidates=torch.zeros(128, 4, 2, dtype=torch.int32), max_context=64, top_k=4,
        )  # fmt: skip
