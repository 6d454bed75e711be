"""sparseforge.sdsa's argument checks on the CPU: each refusal names the argument; valid
arguments reach the device check."""

import pytest
import torch
from sparseforge import reference, sdsa


def quantize_args(**change):
    args = dict(
        key=torch.randn(3, 128, dtype=torch.bfloat16),
        slots=torch.tensor([0, 70, -1]),
        query=torch.randn(2, 128, dtype=torch.bfloat16),
        query_rows=torch.tensor([1, -1]),
        key_cache=torch.zeros(2, 64, 64, dtype=torch.uint8),
        key_scales=torch.zeros(2, 64, 8, dtype=torch.float8_e4m3fn),
        packed_query=torch.zeros(4, 64, dtype=torch.uint8),
        query_scales=torch.zeros(4, 8, dtype=torch.uint8),
    )
    return args | change


ONE_ALLOCATION = torch.zeros(2, 64 * 72, dtype=torch.uint8)  # data and scales of a page


@pytest.mark.parametrize(
    "change, words",
    [
        ({}, "needs a CUDA device"),
        (
            {"key_cache": ONE_ALLOCATION[:, : 64 * 64].view(2, 64, 64),
             "key_scales": ONE_ALLOCATION[:, 64 * 64 :].view(2, 64, 8)},
            "needs a CUDA device",
        ),
        ({"key": torch.randn(3, 128)}, "key must be a bf16 or fp16 tensor"),
        ({"key": torch.randn(3, 64, dtype=torch.bfloat16)}, "key must be \\(rows, 128\\)"),
        ({"query": torch.randn(2, 128, dtype=torch.float16)}, "query must have key's dtype"),
        ({"slots": torch.tensor([0, 70, -1], dtype=torch.int32)}, "slots must be a contiguous"),
        ({"query_rows": torch.tensor([1])}, "query_rows must be .* of length 2"),
        ({"key_cache": torch.zeros(2, 64, 32, dtype=torch.uint8)}, "key_cache must be \\(2, 64,"),
        ({"key_scales": torch.zeros(2, 32, 8, dtype=torch.uint8)}, "key_scales must be"),
        ({"packed_query": torch.zeros(4, 64, dtype=torch.int8)}, "packed_query must be a uint8"),
        ({"query_scales": torch.zeros(4, 16, dtype=torch.uint8)[:, ::2]}, "query_scales must be"),
    ],
)  # fmt: skip
def test_quantize_arguments(change, words):
    with pytest.raises(ValueError, match=words):
        sdsa.quantize_write_index_qk_nvfp4(**quantize_args(**change))


def test_outputs_may_not_alias_each_other():
    shared = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlaps"):
        sdsa.quantize_write_index_qk_nvfp4(
            **quantize_args(packed_query=shared, query_scales=shared[:, :8])
        )


def scores_args(nvfp4=False, **change):
    if nvfp4:
        keys = dict(
            query=torch.zeros(4, 64, dtype=torch.uint8),
            query_scales=torch.zeros(4, 8, dtype=torch.uint8),
            key_cache=torch.zeros(3, 64, 64, dtype=torch.uint8),
            key_scales=torch.zeros(3, 64, 8, dtype=torch.float8_e4m3fn),
        )
    else:
        keys = dict(
            query=torch.zeros(4, 128, dtype=torch.bfloat16),
            key_cache=torch.zeros(3, 64, 128, dtype=torch.bfloat16),
        )
    args = dict(
        block_table=torch.zeros(2, 2, dtype=torch.int32),
        context_lengths=torch.tensor([100, 3], dtype=torch.int32),
        requests=torch.tensor([1, 0], dtype=torch.int32),
        scores=torch.zeros(4, 128),
        **keys,
    )
    return args | change


@pytest.mark.parametrize(
    "nvfp4, change, words",
    [
        (False, {}, "needs a CUDA device"),
        (True, {}, "needs a CUDA device"),
        (False, {"query_scales": torch.zeros(4, 8, dtype=torch.uint8)}, "give both scale tensors"),
        (False, {"query": torch.zeros(4, 128)}, "query must be bf16"),
        (True, {"key_cache": torch.zeros(3, 64, 128, dtype=torch.bfloat16)}, "NVFP4 codes"),
        (False, {"requests": torch.tensor([1, 0, 0], dtype=torch.int32),
                 "context_lengths": torch.tensor([1, 2, 3], dtype=torch.int32)}, "1 to 8 rows"),
        (False, {"context_lengths": torch.tensor([100], dtype=torch.int32)}, "context_lengths"),
        (False, {"scores": torch.zeros(4, 129)}, "at most 128 keys"),
        (False, {"scores": torch.zeros(4, 128, dtype=torch.float64)}, "scores must be float32"),
        (True, {"key_scales": torch.zeros(2, 64, 8, dtype=torch.uint8)}, "key_scales must be"),
        (False, {"block_table": torch.zeros(2, 2, dtype=torch.int64)}, "block_table"),
    ],
)  # fmt: skip
def test_scores_arguments(nvfp4, change, words):
    with pytest.raises(ValueError, match=words):
        sdsa.indexer_scores(**scores_args(nvfp4, **change))


def test_sample_and_threshold_arguments():
    cache = torch.zeros(3, 64, 128, dtype=torch.bfloat16)
    sample = dict(
        key_cache=cache, block_table=torch.zeros(2, 2, dtype=torch.int32),
        offsets=torch.zeros(128, dtype=torch.uint8), sample_ends=torch.zeros(2, dtype=torch.int32),
        sample_keys=torch.zeros(2, 128, 128, dtype=torch.bfloat16), samples_per_run=16,
        pages_per_run=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="needs a CUDA device"):
        sdsa.gather_key_sample(**sample)
    with pytest.raises(ValueError, match="cap a multiple of 128"):
        sdsa.gather_key_sample(
            **(sample | {"sample_keys": torch.zeros(2, 100, 128, dtype=torch.bfloat16)})
        )
    with pytest.raises(ValueError, match="offsets must be"):
        sdsa.gather_key_sample(**(sample | {"offsets": torch.zeros(128, dtype=torch.int32)}))
    with pytest.raises(ValueError, match="samples_per_run must be a positive int"):
        sdsa.gather_key_sample(**(sample | {"samples_per_run": 0}))
    thresholds = dict(
        sample_scores=torch.zeros(3, 128), sample_top=torch.zeros(3, 8, dtype=torch.int32),
        thresholds=torch.zeros(3), counters=torch.zeros(3, 2, dtype=torch.int32),
    )  # fmt: skip
    with pytest.raises(ValueError, match="needs a CUDA device"):
        sdsa.thresholds_from_sample(**thresholds)
    with pytest.raises(ValueError, match="sample_top must have 3 rows"):
        sdsa.thresholds_from_sample(
            **(thresholds | {"sample_top": torch.zeros(2, 8, dtype=torch.int32)})
        )
    with pytest.raises(ValueError, match="counters must be int32"):
        sdsa.thresholds_from_sample(**(thresholds | {"counters": torch.zeros(3, 2)}))


def test_top_k_arguments():
    candidates = torch.zeros(3, 40, 2, dtype=torch.int32)
    ranges = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        sdsa.top_k_from_candidates(
            candidates, ranges, top_keys=torch.zeros(3, 8, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="K must be < 65536"):
        sdsa.top_k_from_candidates(
            candidates, ranges, top_keys=torch.zeros(3, 65536, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="ranges must be int32 \\(2, 3\\)"):
        sdsa.top_k_from_candidates(
            candidates, ranges[:, :2], top_keys=torch.zeros(3, 8, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="ranges must be int32 \\(2, 3\\)"):
        sdsa.top_k_from_candidates(
            candidates, ranges.long(), top_keys=torch.zeros(3, 8, dtype=torch.int32)
        )
    # The live rows of 128-row tiles as strided views of all three: past the checks.
    tiles = torch.zeros(3 * 128, 40, 2, dtype=torch.int32)
    tile_ranges = torch.zeros(2, 3 * 128, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        sdsa.top_k_from_candidates(
            tiles.view(3, 128, 40, 2)[:, 1],
            tile_ranges.view(2, 3, 128)[:, :, 1],
            top_keys=torch.zeros(3, 2, 8, dtype=torch.int32)[:, 1],
        )
    # The first two rows of every tile as a (tiles, rows) grid: past the checks; ranges and
    # top_keys must have the same grid.
    with pytest.raises(ValueError, match="needs a CUDA device"):
        sdsa.top_k_from_candidates(
            tiles.view(3, 128, 40, 2)[:, :2],
            tile_ranges.view(2, 3, 128)[:, :, :2],
            top_keys=torch.zeros(3, 2, 8, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="ranges must be int32 \\(2, 3, 2\\)"):
        sdsa.top_k_from_candidates(
            tiles.view(3, 128, 40, 2)[:, :2],
            tile_ranges.view(2, 3, 128)[:, :, :3],
            top_keys=torch.zeros(3, 2, 8, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="top_keys must be int32 \\(3, 2, N\\)"):
        sdsa.top_k_from_candidates(
            tiles.view(3, 128, 40, 2)[:, :2],
            tile_ranges.view(2, 3, 128)[:, :, :2],
            top_keys=torch.zeros(6, 8, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="candidates must be int32"):
        sdsa.top_k_from_candidates(
            candidates.float(), ranges, top_keys=torch.zeros(3, 8, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="candidates must be int32"):
        sdsa.top_k_from_candidates(
            candidates[None, None], ranges, top_keys=torch.zeros(3, 8, dtype=torch.int32)
        )


def test_fitting_selection_inputs_leave_only_the_marked_rows_to_repair():
    # The sanitizers' small repair check (python -m sparseforge.check --small) repairs a few
    # rows, not most: each takes a cluster four radix passes, minutes under racecheck.
    from sparseforge.check import SDSA_SELECT_LENGTHS, sdsa_select_inputs

    args = sdsa_select_inputs(SDSA_SELECT_LENGTHS[True], True, fitting=True)
    args["thresholds"][3::41] = float("inf")
    before = args["thresholds"].clone()
    rows = before.shape[0]
    repair = dict(
        arrivals=torch.zeros(rows // 128, dtype=torch.int32),
        ranges=torch.zeros(2, rows, dtype=torch.int32),
    )
    reference.indexer_threshold_select(**args, **repair)
    kept = (args["thresholds"] == before) | (args["thresholds"].isnan() & before.isnan())
    # Rows 0 (+inf: no key reaches it) and 1 (-inf: every key above it, past the slots), and
    # the marked ones.
    assert (~kept).nonzero().flatten().tolist() == [0, 1, *range(3, rows, 41)]


def test_threshold_select_arguments():
    from sparseforge.check import sdsa_select_inputs

    args = sdsa_select_inputs([100], False, top_k=4, slots=8)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        sdsa.indexer_threshold_select(**args)
    with pytest.raises(ValueError, match="top_k = 8 must be an int in \\[0, 8\\)"):
        sdsa.indexer_threshold_select(**(args | {"top_k": 8}))
    with pytest.raises(ValueError, match="give both arrivals and ranges"):
        sdsa.indexer_threshold_select(**args, arrivals=torch.zeros(1, dtype=torch.int32))
    repair = dict(
        arrivals=torch.zeros(1, dtype=torch.int32), ranges=torch.zeros(2, 128, dtype=torch.int32)
    )
    with pytest.raises(ValueError, match="needs a CUDA device"):
        sdsa.indexer_threshold_select(**args, **repair)
    with pytest.raises(ValueError, match="arrivals must be"):
        sdsa.indexer_threshold_select(**args, **(repair | {"arrivals": torch.zeros(2)}))
    with pytest.raises(ValueError, match="ranges must be"):
        sdsa.indexer_threshold_select(**args, **(repair | {"ranges": repair["ranges"][:, :5]}))
    with pytest.raises(ValueError, match="cap = slots - top_k >= top_k - 1"):
        sdsa.indexer_threshold_select(**(args | {"top_k": 6}), **repair)
    with pytest.raises(ValueError, match="ranges"):  # writes must not overlap the inputs
        sdsa.indexer_threshold_select(
            **args, **(repair | {"ranges": args["candidates"].view(-1)[:256].view(2, 128)})
        )
    with pytest.raises(ValueError, match="128 per tile"):
        sdsa.indexer_threshold_select(
            **(args | {"tile_requests": torch.zeros(2, dtype=torch.int32)})
        )
    with pytest.raises(ValueError, match="max_context = 1000 exceeds"):
        sdsa.indexer_threshold_select(**(args | {"max_context": 1000}))


def test_the_selects_rows_and_mma_columns_are_one_permutation():
    """sdsa_select's group rows in the MMA's columns: column 2q + r (lane q's accumulator
    column r) holds row lane_row(q, r), and column_row is its inverse over all 8 columns;
    rows 0..3 are the lanes' first columns, so up to 4 rows leave every second one empty."""
    pytest.importorskip("cutlass")
    from generator.kernels.portable.sdsa_select import MMA_ROWS, column_row, lane_row

    rows = [lane_row(q, r) for q in range(4) for r in range(2)]
    assert sorted(rows) == list(range(MMA_ROWS))
    assert all(column_row(2 * q + r) == lane_row(q, r) for q in range(4) for r in range(2))
    assert {lane_row(q, 0) for q in range(4)} == {0, 1, 2, 3}
