"""The ICP indexer's reference (sparseforge.reference_icp) on the CPU: the W-rank simulation
(shard, score, local top-16, exchange, merge) reproduces the unsharded top-16 of global block
maxima id for id, for W = 2 and 4, P128 and P256 (split blocks at W = 4), with NaN and +-0
scores, forced blocks, per-token valid-page counts (0 included) and a cap on the block ids."""

import math

import pytest
import torch
from sparseforge import reference_icp as icp


def e4m3_values(*shape, generator):
    """Random values an e4m3 tensor can hold (the index q and k are FP8)."""
    x = torch.randn(*shape, generator=generator) * 2
    return x.to(torch.float8_e4m3fn).float()


def simulate(scores, positions, nvp, world, page, fb=0, fe=0, max_blocks=icp.MAX_BLOCKS):
    """Every rank's carrier rows, the exchange and every owner's merge, as (T, HEADS, 16)."""
    carriers = []
    for rank in range(world):
        ids = icp.block_ids(scores.shape[-1], world, rank, page)
        local = icp.rank_scores(scores, positions, world, rank, page)
        carriers.append(icp.local_top16(local, ids, nvp, fb, fe, max_blocks))
    merged = [icp.merge(r, nvp, fb, fe, max_blocks) for r in icp.all_to_all(carriers)]
    return torch.cat(merged, dim=1)


def problem(tokens, keys, seed, nan=False):
    g = torch.Generator().manual_seed(seed)
    q = e4m3_values(tokens, icp.HEADS, 128, generator=g)
    k = e4m3_values(keys, 128, generator=g)
    scores = icp.key_scores(q, k)
    if nan:  # NaN and -0 scores: ignored / written as +0
        scores[torch.rand(scores.shape, generator=g) < 0.05] = math.nan
        scores[torch.rand(scores.shape, generator=g) < 0.05] = -0.0
    positions = torch.randint(0, keys, (tokens,), generator=g)
    nvp = (positions // icp.BLOCK + 1).clamp(max=-(-keys // icp.BLOCK))
    return scores, positions, nvp


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("page", [128, 256])
@pytest.mark.parametrize("nan", [False, True])
def test_merge_reproduces_the_unsharded_top16(world, page, nan):
    scores, positions, nvp = problem(24, 40 * 128 + 70, seed=world * page + nan, nan=nan)
    nvp[0] = 0  # a row with no valid page
    nvp[1] = 3
    got = simulate(scores, positions, nvp, world, page)
    want = icp.global_top16(scores, positions, nvp)
    assert torch.equal(got[1:], want[1:])
    assert got[0].tolist() == [[0] + [-1] * 15] * icp.HEADS  # the contract's empty row


@pytest.mark.parametrize("world, page", [(2, 128), (4, 256)])
def test_forced_blocks_and_the_block_cap(world, page):
    scores, positions, nvp = problem(16, 30 * 128, seed=7)
    nvp = nvp.clamp(min=1)
    for fb, fe, cap in ((2, 3, icp.MAX_BLOCKS), (1, 0, 12), (0, 4, 9)):
        got = simulate(scores, positions, nvp, world, page, fb, fe, cap)
        want = icp.global_top16(scores, positions, nvp, fb, fe, cap)
        assert torch.equal(got, want)
        assert bool((got < cap).all())
        if fb:  # forced blocks are selected whenever they have a visible key
            assert bool((got[..., 0] == 0).all())


def test_layouts_cover_every_key_once():
    keys = 9 * 256
    for world in (2, 4):
        for page in (128, 256):
            held = torch.cat([icp.shard_keys(keys, world, r, page).flatten() for r in range(world)])
            assert torch.equal(held.sort().values, torch.arange(keys))
    # P256 at W = 4: ranks 0, 1 hold halves of block 2c, ranks 2, 3 of block 2c + 1.
    assert icp.shard_keys(512, 4, 2, 256)[1, 0].item() == 256 + 128
    assert icp.block_ids(512, 4, 2, 256).tolist() == [1, 3]
    assert icp.shard_keys(256, 2, 1, 128)[0, :3].tolist() == [1, 3, 5]


def test_scores_ignore_nan_write_plus_zero_and_minus_inf_for_no_visible_key():
    scores = torch.tensor([[[math.nan, -0.0, -1.0] + [-2.0] * 125 + [5.0] * 128]]).expand(
        1, icp.HEADS, 256
    )
    positions = torch.tensor([2])
    maxima = icp.global_block_max(scores, positions)
    assert maxima[0, 0, 0].item() == 0.0 and not math.copysign(1, maxima[0, 0, 0].item()) < 0
    assert maxima[0, 0, 1].item() == -math.inf  # block 1 lies past the token's position
    all_nan = torch.full((1, icp.HEADS, 128), math.nan)
    assert icp.global_block_max(all_nan, torch.tensor([127]))[0, 0, 0].item() == -math.inf


def test_carrier_rows_and_generation_tags():
    scores, positions, nvp = problem(8, 20 * 128, seed=3)
    ids = icp.block_ids(scores.shape[-1], 2, 0, 128)
    rows = icp.local_top16(icp.rank_scores(scores, positions, 2, 0, 128), ids, nvp)
    assert rows.shape == (8, icp.HEADS, icp.CARRIER_WORDS) and bool((rows[..., -1] == 1).all())
    used = rows[..., 16:32]
    pad = used < 0
    assert bool((rows[..., :16][pad] == torch.tensor(-math.inf).view(torch.int32)).all())
    valid = torch.where(pad, torch.iinfo(torch.int32).max, used)
    assert torch.equal(valid, valid.sort(-1).values)  # ascending ids, padding last
    tagged = icp.tag_rows(rows, generation=5)
    assert torch.equal(icp.untag_rows(tagged, 5), rows)
    stale = tagged.clone()
    stale[0, 0, 3] = (4 << 32) | (stale[0, 0, 3] & 0xFFFFFFFF)
    assert icp.untag_rows(stale, 5)[0, 0, -1].item() == 0


@pytest.mark.parametrize("fb, fe", [(0, 0), (2, 3)])
def test_unsharded_top16_is_msa_topk_selects(fb, fe):
    """Without a cap, and with every forced block visible, the ranking is msa_topk_select's
    (sparseforge.reference, checked against the GPU kernels) on the global block maxima."""
    from sparseforge import reference

    scores, positions, nvp = problem(20, 33 * 128 + 5, seed=11)
    nvp = nvp.clamp(min=fb + fe)
    positions = torch.maximum(positions, nvp * icp.BLOCK - icp.BLOCK)  # block nvp - 1 visible
    maxima = icp.global_block_max(scores, positions)  # (T, HEADS, blocks)
    want = reference.msa_topk_select(maxima.permute(1, 2, 0).contiguous(), 16, nvp.int(), fb, fe)
    assert torch.equal(icp.global_top16(scores, positions, nvp, fb, fe), want)


@pytest.mark.parametrize("world", [2, 4])
def test_decode_publish_and_collect_match_the_prefill_exchange(world):
    """Every rank publishes into the owners' receive rows before any merge (one stream on one
    GPU); the owners collect their slot set (ready flags checked, then cleared) and merge to
    what the all-to-all gives; slot sets do not overlap; an unpublished row is refused."""
    scores, positions, nvp = problem(6, 24 * 128, seed=world)
    cap = 8
    receive = [icp.receive_rows(world, cap) for _ in range(world)]
    steps = {}
    for slot in (2, 0):
        carriers = []
        for rank in range(world):
            ids = icp.block_ids(scores.shape[-1], world, rank, 128)
            local = icp.rank_scores(scores + slot, positions, world, rank, 128)
            carriers.append(icp.local_top16(local, ids, nvp))
            icp.publish(carriers[-1], receive, rank, slot)
        steps[slot] = carriers
    for slot, carriers in steps.items():
        exchanged = icp.all_to_all(carriers)
        for owner in range(world):
            got = icp.collect(receive[owner], world, slot, tokens=6)
            assert torch.equal(got, exchanged[owner])
            assert torch.equal(icp.merge(got, nvp), icp.merge(exchanged[owner], nvp))
    with pytest.raises(ValueError, match="was not published"):
        icp.collect(receive[0], world, 2, tokens=6)  # its flags were cleared
    with pytest.raises(ValueError, match="do not fit"):
        icp.publish(
            torch.zeros(cap + 1, icp.HEADS, icp.CARRIER_WORDS, dtype=torch.int32), receive, 0, 1
        )


def test_bad_arguments_are_refused_by_name():
    for args, message in (
        ((1024, 3, 0, 128), "world_size must be 2 or 4"),
        ((1024, 2, 2, 128), r"rank must be in \[0, 2\)"),
        ((1024, 4, 0, 64), "page_size must be 128 or 256"),
    ):
        with pytest.raises(ValueError, match=message):
            icp.shard_keys(*args)
    receive = [icp.receive_rows(2, 4) for _ in range(2)]
    rows = torch.zeros(2, icp.HEADS, icp.CARRIER_WORDS, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"slot must be in \[0, 3\)"):
        icp.publish(rows, receive, 0, 3)


def test_a_duplicate_id_keeps_its_largest_score_nan_counting_as_minus_inf():
    """Rank 0 sends block 5 with a NaN score, rank 1 the same block with 1.0: the merge keeps
    1.0 (the NaN copy is no candidate), so block 5 is selected."""
    rows = torch.zeros(2, 2, 1, icp.CARRIER_WORDS, dtype=torch.int32)
    rows[..., : icp.TOPK] = torch.tensor(-math.inf).view(torch.int32)
    rows[..., icp.TOPK : 2 * icp.TOPK] = -1
    rows[0, :, 0, 0] = torch.tensor(math.nan).view(torch.int32)
    rows[1, :, 0, 0] = torch.tensor(1.0).view(torch.int32)
    rows[:, :, 0, icp.TOPK] = 5
    merged = icp.merge(rows, torch.tensor([9]))
    assert merged[0, :, 0].tolist() == [5, 5] and bool((merged[0, :, 1:] == -1).all())
