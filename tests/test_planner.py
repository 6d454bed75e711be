"""The planner on the CPU: the tile lists it builds select exactly the keys the API asks for.

`tiles_to_token_mask` reads a TilePlan the way the kernels do (unit -> listed tiles ->
valid keys), so these tests pin the kernel contract without a GPU.
"""

import pytest
import torch
from sparseforge import planner, reference, sparsity
from sparseforge.bench import random_selection


def tiles_to_token_mask(plan: planner.TilePlan):
    """(Hkv, Sq, Sk) mask of the keys each query row's unit visits."""
    hkv, units, _ = plan.tile_idx.shape
    mask = torch.zeros(hkv, units * 64, plan.seq_k + 64, dtype=torch.bool)
    for h in range(hkv):
        for r in range(units):
            for j in range(int(plan.tile_cnt[h, r])):
                t = int(plan.tile_idx[h, r, j])
                mask[h, r * 64 : r * 64 + 64, t * 64 : t * 64 + int(plan.tile_len[t])] = True
    return mask[:, : plan.seq_q, : plan.seq_k]


def tile_plan(*args, **kwargs):
    """planner.plan_tiles with the attention families' 64-row units and 64-key tiles."""
    if len(args) > 6:  # kv_block_lens, kv_block_size given by position
        kwargs.update(kv_block_lens=args[6], kv_block_size=args[7])
        args = args[:6]
    return planner.plan_tiles(*args, unit_rows=64, tile_keys=64, **kwargs)


def uniform(hkv, total, block):
    return reference.uniform_sizes(total, block).expand(hkv, -1)


@pytest.mark.parametrize(
    "block_r, block_c", [(64, 64), (128, 128), (64, 128), (128, 64), (192, 256)]
)
@pytest.mark.parametrize("seq_q, seq_k", [(1024, 1024), (1000, 777), (64, 4096), (130, 65)])
def test_uniform_blocks(block_r, block_c, seq_q, seq_k):
    hkv = 3
    mb, nb = -(-seq_q // block_r), -(-seq_k // block_c)
    mask = torch.rand(hkv, mb, nb, generator=torch.Generator().manual_seed(seq_q + block_c)) < 0.4
    mask[0, 0] = False  # an empty row
    plan = tile_plan(
        mask, uniform(hkv, seq_q, block_r), uniform(hkv, seq_k, block_c), seq_q, seq_k, hkv * 2
    )
    want = reference.block_mask_to_token_mask(
        mask, uniform(hkv, seq_q, block_r), uniform(hkv, seq_k, block_c)
    )
    assert torch.equal(tiles_to_token_mask(plan), want)
    # Lists are ascending and the spare slots past the count hold nothing the kernel reads.
    for h in range(hkv):
        for r in range(plan.tile_idx.shape[1]):
            row = plan.tile_idx[h, r, : int(plan.tile_cnt[h, r])]
            assert torch.all(row[1:] > row[:-1])


def test_variable_blocks_per_head():
    row_sizes = torch.tensor([[64, 192, 128, 50], [128, 128, 64, 114]])
    col_sizes = torch.tensor([[256, 64, 64, 70], [64, 64, 64, 262]])
    mask = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(3)) < 0.5
    plan = tile_plan(mask, row_sizes, col_sizes, 434, 454, 4)
    want = reference.block_mask_to_token_mask(mask, row_sizes, col_sizes)
    assert torch.equal(tiles_to_token_mask(plan), want)


def test_kv_block_lens_cut_tiles():
    hkv, seq_q, seq_k, block = 2, 256, 512, 128
    mask = torch.ones(hkv, 2, 4, dtype=torch.bool)
    lens = torch.tensor([128, 1, 64, 100], dtype=torch.int32)
    plan = tile_plan(
        mask, uniform(hkv, seq_q, block), uniform(hkv, seq_k, block), seq_q, seq_k, hkv, lens, block
    )
    assert plan.tile_len.tolist() == [64, 64, 1, 0, 64, 0, 64, 36]
    assert int(plan.tile_cnt[0, 0]) == 6  # tiles with no valid key are not listed
    want = reference.block_mask_to_token_mask(
        mask, uniform(hkv, seq_q, block), uniform(hkv, seq_k, block), lens
    )
    assert torch.equal(tiles_to_token_mask(plan), want)


def test_work_order_longest_first_and_complete():
    mask = random_selection(4, 8, 8, topk=3)
    mask[1, 2] = True
    mask[3, 5] = False
    plan = tile_plan(mask, uniform(4, 512, 64), uniform(4, 512, 64), 512, 512, 8)
    work = plan.work.tolist()
    assert sorted(work) == list(range(8 * 8))
    counts = [int(plan.tile_cnt[(u // 8) // 2, u % 8]) for u in work]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] == 8 and counts[-1] == 0


@pytest.mark.parametrize("group, n", [(2, 2), (4, 2), (8, 2), (4, 4), (8, 4)])
def test_cta_work_groups_query_heads_of_a_kv_group(group, n):
    hkv, units = 3, 7
    mask = random_selection(hkv, units, 8, topk=3)
    mask[1, 4] = True
    plan = tile_plan(
        mask,
        uniform(hkv, 64 * units, 64),
        uniform(hkv, 512, 64),
        64 * units,
        512,
        hkv * group,
        units_per_cta=n,
    )
    work = plan.work.view(-1, n).tolist()
    assert sorted(u for members in work for u in members) == list(range(hkv * group * units))
    for members in work:  # one CTA: heads n*m .. n*m + n-1 of one group, same rows
        lead = members[0]
        assert members == [lead + i * units for i in range(n)]
        assert (lead // units) % n == 0 and (lead // units) // group == (
            members[-1] // units
        ) // group
    counts = [int(plan.tile_cnt[(m[0] // units) // group, m[0] % units]) for m in work]
    assert counts == sorted(counts, reverse=True) and counts[0] == 8


@pytest.mark.parametrize("seq_q", [64 * 6, 64 * 7 - 5])
def test_cta_work_pairs_units_of_128_row_blocks(seq_q):
    """Pairs of 64-row units; four units of 256-row blocks are the same code."""
    hq, units = 3, -(-seq_q // 64)
    mask = random_selection(hq, -(-seq_q // 128), 8, topk=3)
    mask[2, 1] = True
    rows = uniform(hq, seq_q, 128)
    assert planner.rows_fit_units(rows, 2, 64) and not planner.rows_fit_units(
        uniform(hq, seq_q, 192), 2, 64
    )
    plan = tile_plan(mask, rows, uniform(hq, 512, 64), seq_q, 512, hq, units_per_cta=2)
    work = plan.work.view(-1, 2).tolist()
    for a, b in work:  # one CTA: units 2m, 2m+1 of one head (a last odd unit twice)
        assert (
            a // units == b // units
            and (a % units) % 2 == 0
            and b == min(a + 1, (a // units + 1) * units - 1)
        )
        assert torch.equal(
            plan.tile_idx[a // units, a % units, : plan.tile_cnt[a // units, a % units]],
            plan.tile_idx[b // units, b % units, : plan.tile_cnt[b // units, b % units]],
        )
    assert sorted({u for pair in work for u in pair}) == list(range(hq * units))
    counts = [int(plan.tile_cnt[a // units, a % units]) for a, _ in work]
    assert counts == sorted(counts, reverse=True) and counts[0] == 8


def test_tile_padded_scales_rows_are_whole_tiles_with_zero_padding():
    buf = planner.tile_padded_scales(2, 100, 16, 64, "cpu")  # 7 groups of 16 keys, 2 tiles
    assert buf.shape == (1, 2, 8) and buf.is_contiguous()
    assert not buf[..., 7:].any()
    assert planner.tile_padded_scales(1, 64, 16, 64, "cpu").shape == (1, 1, 4)


def test_bsr_and_selection_masks_match_reference():
    indptr = torch.tensor([0, 1, 3, 5], dtype=torch.int32)
    indices = torch.tensor([2, 0, 2, 1, 2], dtype=torch.int32)
    mask, errors = sparsity.bsr_block_mask(indptr, indices, 3, 3)
    assert (
        torch.equal(mask[0], reference.bsr_to_block_mask(indptr, indices, 3, 3))
        and int(errors) == 0
    )
    sel = torch.tensor([[[2, 0, 1], [1, 9, 0]]], dtype=torch.int32)  # 9: past the count, unused
    num = torch.tensor([[2, 1]], dtype=torch.int32)
    mask, errors = sparsity.selection_block_mask(sel, num, 3)
    assert torch.equal(mask, reference.selections_to_block_mask(sel, num, 3)) and int(errors) == 0
    assert mask[0].tolist() == [[True, False, True], [False, True, False]]


@pytest.mark.parametrize(
    "indptr, indices, bits",
    [
        ([0, 1, 3, 5], [2, 0, 3, 1, -1], sparsity.ERR_INDEX_RANGE),
        ([0, 2, 3, 5], [1, 1, 2, 1, 2], sparsity.ERR_DUPLICATE),
        ([0, 3, 2, 5], [0, 1, 2, 0, 1], sparsity.ERR_INDPTR),
        ([1, 1, 3, 5], [2, 0, 2, 1, 2], sparsity.ERR_INDPTR),
    ],
)
def test_bsr_errors_are_flagged_and_ignored(indptr, indices, bits):
    mask, errors = sparsity.bsr_block_mask(torch.tensor(indptr), torch.tensor(indices), 3, 3)
    assert int(errors) & bits
    assert mask.shape == (1, 3, 3)  # whatever was wrong, the mask stays in range


def test_selection_errors():
    sel = torch.tensor([[[0, 5], [1, 1]]], dtype=torch.int32)
    _, errors = sparsity.selection_block_mask(sel, None, 3)
    assert int(errors) == sparsity.ERR_INDEX_RANGE | sparsity.ERR_DUPLICATE
    _, errors = sparsity.selection_block_mask(sel, torch.tensor([[3, 1]], dtype=torch.int32), 3)
    assert int(errors) == sparsity.ERR_Q2K_NUM | sparsity.ERR_INDEX_RANGE


def test_blocks_are_tiles_shortcut_matches_the_general_path():
    mask = torch.rand(2, 16, 16, generator=torch.Generator().manual_seed(8)) < 0.4
    sizes = uniform(2, 1000, 64)
    fast = tile_plan(mask, sizes, sizes, 1000, 1000, 4, blocks_are_tiles=True)
    slow = tile_plan(mask, sizes, sizes, 1000, 1000, 4)
    for a, b in zip(fast.tensors(), slow.tensors(), strict=True):
        assert torch.equal(a, b)


def test_plan_tensors_have_the_kernel_abi_strides():
    """The kernels take tile_cnt, tile_len and work with unit inner stride (family ABI)."""
    mask = torch.rand(2, 16, 16, generator=torch.Generator().manual_seed(2)) < 0.4
    sizes = uniform(2, 1000, 64)
    plans = [
        tile_plan(mask, sizes, sizes, 1000, 1000, 4, blocks_are_tiles=True),
        tile_plan(mask, sizes, sizes, 1000, 1000, 4),
    ]
    for plan in plans:
        assert plan.tile_idx.stride(-1) == 1
        assert (
            plan.tile_cnt.stride(-1) == 1
            and plan.tile_len.is_contiguous()
            and plan.work.is_contiguous()
        )
        assert (
            plan.tile_idx.dtype
            == plan.tile_cnt.dtype
            == plan.tile_len.dtype
            == plan.work.dtype
            == torch.int32
        )


def test_host_size_facts_follow_writes_to_the_tensor():
    """The alignment facts are remembered per tensor, and asked again after a write to it
    (its version counter moves) or of another tensor."""
    sizes = torch.full((2, 4), 128, dtype=torch.int64)
    assert planner.sizes_tile_aligned(sizes, 64) and planner.sizes_are_tiles(sizes[:, :1], 128)
    assert not planner.sizes_are_tiles(sizes, 64)
    sizes[1, 2] = 96  # not a multiple of 64
    assert not planner.sizes_tile_aligned(sizes, 64)
    assert planner.sizes_tile_aligned(sizes, 32)
    other = torch.full((2, 4), 64, dtype=torch.int64)
    assert planner.sizes_are_tiles(other, 64)
    sizes[1, 2] = 128
    assert planner.sizes_tile_aligned(sizes, 64)


def test_host_size_facts_of_inference_tensors():
    """Tensors made under torch.inference_mode() have no version counter (engines plan under
    it): their facts are asked once and remembered while the tensor lives."""
    with torch.inference_mode():
        sizes = torch.full((2, 4), 128, dtype=torch.int64)
        assert planner.tensor_version(sizes) is None
        assert planner.sizes_tile_aligned(sizes, 64)
        assert not planner.sizes_are_tiles(sizes, 64)
    assert planner.sizes_tile_aligned(sizes, 64)
    assert planner.tensor_version(torch.zeros(1)) == 0


def test_size_checks_errors_flag_a_size_tensor_that_changed():
    rows = torch.full((2, 4), 64, dtype=torch.int32)
    cols = torch.full((2, 6), 64, dtype=torch.int32)
    pairs = ((rows, rows.to(torch.int64)), (cols, cols.to(torch.int64)))
    assert sparsity.size_checks_errors(()) is None
    assert int(sparsity.size_checks_errors(pairs)) == 0
    cols[1, 5] = 32  # written in place after plan() read it
    assert int(sparsity.size_checks_errors(pairs)) == sparsity.ERR_STALE_SIZES
