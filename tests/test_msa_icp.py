"""The ICP indexer's surface on the CPU (sparseforge.msa_icp): sizes, the receive storage's
layout, arguments refused by name, the names in msa_ops. The kernels and chains:
test_gpu_msa_icp.py."""

import math

import pytest
import torch
from sparseforge import msa_icp


def test_sizes():
    assert msa_icp.msa_icp_index_score_columns(1000, 128) == 8
    assert msa_icp.msa_icp_index_score_columns(1000, 256) == 4
    assert msa_icp.msa_icp_index_score_columns(1025, 256) == 5
    assert msa_icp.msa_icp_decode_score_columns(1000, 128) == 8
    assert msa_icp.msa_icp_decode_score_columns(1000, 256) == 4
    assert msa_icp.msa_icp_decode_score_columns(10**7, 128) == 8192
    sizes = msa_icp.msa_icp_index_score_plan_storage(
        num_qo_heads=4, total_q=100, batch=3, device="cpu"
    )
    assert sizes["work_info_numel"] * 2 >= 3 * 3 + 1


@pytest.mark.parametrize("world", [2, 4])
def test_comm_layout(world):
    hpr = 4 // world
    layout = msa_icp.msa_icp_comm_layout(world, hpr, 24)
    assert layout["legacy_shape"] == (3, world, hpr, 24, 33)
    assert layout["tagged_shape"] == (3, world, hpr, 24, 32)
    assert layout["generations_shape"] == (3, 4, 24)
    assert layout["expected_shape"] == (3, hpr, 24)
    legacy_bytes = math.prod(layout["legacy_shape"]) * 4
    assert layout["legacy_offset_bytes"] == 0
    assert layout["tagged_offset_bytes"] >= legacy_bytes
    assert layout["tagged_offset_bytes"] % 256 == 0
    end = layout["tagged_offset_bytes"] + math.prod(layout["tagged_shape"]) * 8
    assert layout["storage_words"] * 4 == end


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="world_size must be 2 or 4"):
        msa_icp.msa_icp_comm_layout(3, 1, 8)
    with pytest.raises(ValueError, match="heads_per_rank must be 2"):
        msa_icp.msa_icp_comm_layout(2, 1, 8)
    with pytest.raises(ValueError, match="page_size must be 128 or 256"):
        msa_icp.msa_icp_decode_score_columns(1000, 64)
    with pytest.raises(ValueError, match="4 index heads"):
        msa_icp.msa_icp_index_score_plan_storage(num_qo_heads=8, total_q=1, batch=1, device="cpu")
    scores = torch.zeros(3, 4, 20)
    nvp = torch.zeros(3, dtype=torch.int32)
    carrier = torch.zeros(4, 3, 33, dtype=torch.int32)
    with pytest.raises(ValueError, match="scores must be float32 \\[T, 4, K\\]"):
        msa_icp.msa_icp_topk_select_prefill(scores[:, :2], nvp, carrier)
    with pytest.raises(ValueError, match="scores is on cpu"):
        msa_icp.msa_icp_topk_select_prefill(scores, nvp, carrier)
    with pytest.raises(ValueError, match="sm_scale must be 1.0"):
        msa_icp.msa_icp_index_score_sharded(
            None, None, None, None, rank=0, max_score=None, sm_scale=0.5
        )
    with pytest.raises(ValueError, match="rank must be in \\[0, 2\\)"):
        msa_icp.msa_icp_index_score_sharded(None, None, None, None, rank=2, max_score=None)
    with pytest.raises(ValueError, match="backend must be one of"):
        msa_icp.msa_icp_topk_select_prefill(scores, nvp, carrier, backend="triton")
    with pytest.raises(ValueError, match="4 x max_decode_query_len must be <= 32"):
        msa_icp.prepare_msa_icp_indexer(
            world_size=2, rank=0, num_index_heads=4, page_size=128, init_blocks=1,
            local_blocks=2, max_decode_tokens=64, max_decode_query_len=9,
            max_num_batched_tokens=8192, max_num_seqs=64, max_model_len=1 << 20,
            num_sparse_layers=4, device="cuda:0",
        )  # fmt: skip
    with pytest.raises(ValueError, match="init_blocks \\+ local_blocks = 17 exceeds 16"):
        msa_icp.prepare_msa_icp_indexer(
            world_size=2, rank=0, num_index_heads=4, page_size=128, init_blocks=9,
            local_blocks=8, max_decode_tokens=64, max_decode_query_len=2,
            max_num_batched_tokens=8192, max_num_seqs=64, max_model_len=1 << 20,
            num_sparse_layers=4, device="cuda:0",
        )  # fmt: skip


def test_the_surface_is_in_msa_ops():
    from sparseforge import msa_ops

    for name in (
        "prepare_msa_icp_indexer", "msa_icp_index_score_sharded_plan",
        "msa_icp_index_score_sharded_plan_device", "msa_icp_index_score_sharded",
        "msa_icp_topk_select_prefill", "msa_icp_decode_index_score_sharded",
        "msa_icp_topk_select_publish", "msa_icp_merge_candidates",
        "msa_icp_index_score_plan_storage", "msa_icp_index_score_columns",
        "msa_icp_decode_score_columns", "msa_icp_comm_layout", "msa_icp_prefill_score_select",
        "msa_icp_decode_score_publish", "msa_icp_prefill_pool_bytes",
        "msa_icp_decode_pool_bytes",
    ):  # fmt: skip
        assert getattr(msa_ops, name) is getattr(msa_icp, name)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("page", [128, 256])
def test_the_kernels_layout_scalars_match_the_reference_layouts(world, page):
    """What the runtime passes the kernels (key_base / key_step, column maps, publish row
    offsets), applied as the kernels apply them, against reference_icp's layouts."""
    from sparseforge import reference_icp as ref

    keys, rows = 9 * 256 + 40, page // world
    for rank in range(world):
        base, step = msa_icp._key_layout(page, rows, world, rank)
        pages = -(-keys // page)
        c, i = torch.arange(pages)[:, None], torch.arange(rows)[None, :]
        assert torch.equal(page * c + base + i * step, ref.shard_keys(keys, world, rank, page))
        ids = ref.block_ids(keys, world, rank, page)
        scale, offset = msa_icp._page_columns(page, world, rank, compact=False)
        assert torch.equal(torch.arange(pages) * scale + offset, ids)  # columns = global ids
        assert msa_icp._page_columns(page, world, rank, compact=True) == (1, 0)
        scale, offset = msa_icp._column_blocks(page, world, rank, compact=True)
        assert torch.equal(torch.arange(pages) * scale + offset, ids)  # compact columns
        assert msa_icp._column_blocks(page, world, rank, compact=False) == (1, 0)
    # Publish: row (t, h) of rank r lands where reference_icp.publish puts it.
    capacity, tokens, hpr = 5, 3, 4 // world
    for slot in range(3):
        for rank in range(world):
            receive = [ref.receive_rows(world, capacity) for _ in range(world)]
            rows_in = torch.arange(tokens * 4 * 33, dtype=torch.int32).view(tokens, 4, 33)
            ref.publish(rows_in, receive, rank, slot)
            first = msa_icp._publish_row_offset(slot, world, rank, capacity)
            for t in range(tokens):
                for h in range(4):
                    at = first + (h % hpr) * capacity + t  # the select kernel's row_address
                    assert torch.equal(receive[h // hpr][at], rows_in[t, h])


def test_decode_splits_a_requests_pages_to_fill_the_gpu(monkeypatch):
    monkeypatch.setattr(msa_icp, "multiprocessors", lambda index: 132)
    device = torch.device("cuda", 0)
    # One wave: two CTAs an SM, three with 32 rows a page.
    assert msa_icp._decode_page_splits(device, 64, 256, 64) == 4  # 256 CTAs for 264 slots
    assert msa_icp._decode_page_splits(device, 64, 256, 32) == 6  # 384 for 396
    assert msa_icp._decode_page_splits(device, 256, 256, 64) == 1
    assert msa_icp._decode_page_splits(device, 256, 256, 128) == 1
    assert msa_icp._decode_page_splits(device, 100, 256, 32) == 3
    assert msa_icp._decode_page_splits(device, 1024, 8192, 32) == 1
    assert msa_icp._decode_page_splits(device, 4, 16, 64) == 2  # runs of >= 8 pages
    assert msa_icp._decode_page_splits(device, 4, 4, 64) == 1


def test_the_runtime_and_the_build_agree_on_the_constants():
    from sparseforge.families import msa_icp as family

    for key, value in (
        ("topk", msa_icp.TOPK),
        ("heads", msa_icp.HEADS),
        ("max_blocks", msa_icp.MAX_BLOCKS),
        ("max_columns", msa_icp.MAX_COLUMNS),
        ("carrier_words", msa_icp.CARRIER_WORDS),
        ("tagged_words", msa_icp.TAGGED_WORDS),
        ("max_world", 4),
        ("list_words", msa_icp.LIST_WORDS),
        ("max_list_splits", msa_icp.MAX_LIST_SPLITS),
    ):
        assert family.constant(key) == value, key
    assert {family.mode(m) for m in ("local", "publish", "publish_tagged")} == {0, 1, 2}
    assert {family.mode(m) for m in ("read", "wait", "wait_tagged")} == {0, 1, 2}


# ---- the fused paths ---------------------------------------------------------------------


def test_pool_sizes():
    # A list of 32 int32 words per (token, head); decode up to four per row.
    assert msa_icp.msa_icp_prefill_pool_bytes(total_q=8192, batch=3, device="cpu") == 8192 * 512
    assert (
        msa_icp.msa_icp_prefill_pool_bytes(total_q=10, batch=1, device="cpu", num_heads=4) == 5120
    )
    assert msa_icp.msa_icp_decode_pool_bytes(max_decode_tokens=256) == 256 * 4 * 4 * 128
    assert msa_icp.msa_icp_decode_pool_bytes(max_decode_tokens=0) == 0
    with pytest.raises(ValueError, match="max_decode_tokens must be an int >= 0"):
        msa_icp.msa_icp_decode_pool_bytes(max_decode_tokens=-1)
    with pytest.raises(ValueError, match="4 index heads"):
        msa_icp.msa_icp_prefill_pool_bytes(total_q=8, batch=1, device="cpu", num_heads=2)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        msa_icp.msa_icp_prefill_pool_bytes(total_q=8, batch=0, device="cpu")


def test_the_fused_paths_refuse_bad_arguments_by_name():
    with pytest.raises(ValueError, match="4 x decode_query_len must be <= 32"):
        msa_icp.msa_icp_decode_score_publish(
            None, None, None, None, None, None, None, None, rank=0, world_size=2,
            page_size=128, decode_query_len=9, slot=0, capacity=8, force_begin_blocks=0,
            force_end_blocks=0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="rank must be in \\[0, 4\\)"):
        msa_icp.msa_icp_prefill_score_select(None, None, None, None, None, None, None, rank=5, tp=4)
    with pytest.raises(TypeError, match="plan must come from"):
        msa_icp.msa_icp_prefill_score_select(None, None, None, None, None, None, None, rank=0)
    lists = torch.zeros(5, 4, 3, 32, dtype=torch.int32)
    with pytest.raises(ValueError, match="lists must be a contiguous int32 tensor \\[S <= 4"):
        msa_icp.merge_lists_into_carrier(lists, None, None, 0, 0)
    pool = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(
        ValueError, match="pool must be a contiguous torch.uint8 tensor of at least 128 elements"
    ):
        msa_icp._pool_lists("pool", pool, 128, 1, 1, torch.device("cpu"), "sizer")
    with pytest.raises(ValueError, match="pool must be a contiguous torch.uint8"):
        msa_icp._pool_lists("pool", pool.view(2, 50)[:, :10], 16, 1, 0, pool.device, "sizer")
    view = msa_icp._pool_lists(
        "pool", torch.zeros(2048, dtype=torch.uint8), 1536, 3, 1, pool.device, "s"
    )
    assert view.shape == (3, 4, 1, 32) and view.dtype == torch.int32


@pytest.mark.parametrize("splits", [1, 2, 3, 4])
@pytest.mark.parametrize("fb, fe", [(0, 0), (1, 2), (4, 4)])
def test_the_lists_of_runs_of_pages_hold_the_rows_top16(splits, fb, fe):
    """Why the fused paths are exact: each run of a row's pages keeps its own top-16 (as the
    list scorer does), and the top-16 of the runs' lists is the row's top-16 (ties, -inf,
    NaN, forced blocks, ids past nvp), word for word."""
    from sparseforge import check
    from sparseforge import reference_icp as ref

    tokens, columns = 37, 400
    scores = check.icp_random_scores(tokens, columns, seed=splits) + 0.0  # no -0 in a list
    nvp = torch.randint(0, columns + 20, (tokens,), generator=torch.Generator().manual_seed(3))
    nvp = nvp.int()
    ids = torch.arange(columns)
    want = ref.local_top16(scores, ids, nvp, fb, fe).transpose(0, 1)
    bounds = [columns * s // splits for s in range(splits + 1)]
    lists = torch.empty(splits, 4, tokens, 32, dtype=torch.int32)
    for s in range(splits):
        run = slice(bounds[s], bounds[s + 1])
        rows = ref.local_top16(scores[..., run], ids[run], nvp, fb, fe)
        lists[s] = rows[..., :32].transpose(0, 1)
    assert torch.equal(ref.lists_top16(lists, nvp, fb, fe), want)
