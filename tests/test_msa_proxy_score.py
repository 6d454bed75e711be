"""The MSA proxy-score reference on the CPU against a plain reading of the contract: flat and
paged K (the same keys in both give the same scores), GQA, right-aligned and explicit query
offsets, non-causal, ragged sequences with a partial last block, reduce_heads; and
msa_proxy_score's argument checks, each error naming its argument (the kernel's GPU tests:
test_gpu_msa_proxy_score.py)."""

import math

import pytest
import torch
from sparseforge import reference
from sparseforge.check import paged_cache

BLOCK = reference.MSA_BLOCK


def plain_scores(q, keys_per_seq, cu_q, hkv, causal, offsets):
    """(Hq, tiles, total_q) from loops over (head, token, block, key)."""
    hq = q.shape[1]
    tiles = max(-(-k.shape[0] // BLOCK) for k in keys_per_seq)
    out = torch.full((hq, tiles, q.shape[0]), -math.inf, dtype=torch.float64)
    for b, keys in enumerate(keys_per_seq):
        for i in range(int(cu_q[b]), int(cu_q[b + 1])):
            pos = offsets[b] + i - int(cu_q[b])
            for h in range(hq):
                for j in range(keys.shape[0]):
                    if causal and j > pos:
                        continue
                    s = float(q[i, h].double() @ keys[j, h // (hq // hkv)].double())
                    out[h, j // BLOCK, i] = max(out[h, j // BLOCK, i], s)
    return out.float()


def ragged_problem(seed=0, hq=4, hkv=2, d=16):
    gen = torch.Generator().manual_seed(seed)
    seq_q, seq_k = [3, 1, 5], [300, 128, 5]
    q = torch.randn(sum(seq_q), hq, d, generator=gen)
    keys = [torch.randn(n, hkv, d, generator=gen) for n in seq_k]
    cu_q = torch.tensor([0, *torch.tensor(seq_q).cumsum(0).tolist()], dtype=torch.int32)
    return q, keys, cu_q, seq_q, seq_k


def test_flat_and_paged_read_the_contract():
    q, keys, cu_q, seq_q, seq_k = ragged_problem()
    cu_k = torch.tensor([0, *torch.tensor(seq_k).cumsum(0).tolist()], dtype=torch.int32)
    flat = reference.msa_proxy_score(q, torch.cat(keys), cu_q, cu_k)
    cache, table = paged_cache(keys, torch.Generator().manual_seed(1))
    lens = torch.tensor(seq_k, dtype=torch.int32)
    from_pages = reference.msa_proxy_score(q, cache, cu_q, page_table=table, seqused_k=lens)
    right_aligned = [k - s for k, s in zip(seq_k, seq_q, strict=True)]
    want = plain_scores(q, keys, cu_q, 2, True, right_aligned)
    assert flat.dtype == torch.float32 and flat.shape == want.shape
    assert torch.allclose(flat, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(flat, from_pages)
    assert torch.isinf(flat[:, 1:, 3:]).all()  # sequences 1 and 2 have one block each
    assert torch.isfinite(flat[:, :, 0]).all()  # token 0 of sequence 0 sees keys 0 .. 297


def test_offsets_non_causal_and_reduce_heads():
    q, keys, cu_q, seq_q, seq_k = ragged_problem(seed=2)
    cu_k = torch.tensor([0, *torch.tensor(seq_k).cumsum(0).tolist()], dtype=torch.int32)
    offsets = torch.tensor([0, 127, 2], dtype=torch.int32)
    got = reference.msa_proxy_score(q, torch.cat(keys), cu_q, cu_k, q_offset=offsets)
    assert torch.allclose(got, plain_scores(q, keys, cu_q, 2, True, offsets.tolist()), atol=1e-6)
    assert torch.isinf(got[:, 1:, 0]).all()  # offset 0: token 0 sees key 0 only
    dense = reference.msa_proxy_score(q, torch.cat(keys), cu_q, cu_k, causal=False)
    assert torch.allclose(dense, plain_scores(q, keys, cu_q, 2, False, [0, 0, 0]), atol=1e-6)
    reduced = reference.msa_proxy_score(q, torch.cat(keys), cu_q, cu_k, reduce_heads=True)
    full = reference.msa_proxy_score(q, torch.cat(keys), cu_q, cu_k)
    assert torch.equal(reduced, full.amax(0, keepdim=True))


# --- msa_proxy_score's argument checks (CPU: every check comes before the device's) ---------


def proxy_args(paged=False, **changes):
    from sparseforge.check import proxy_score_inputs

    args = proxy_score_inputs(torch.bfloat16, paged, [3, 70], [300, 100])
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, error, words",
    [
        (dict(q=torch.zeros(73, 4, 128)), NotImplementedError, "bf16, fp16 and float8_e4m3fn"),
        (
            dict(k=torch.zeros(400, 2, 128, dtype=torch.float16)),
            ValueError,
            "k must have q's dtype",
        ),
        (
            dict(q=torch.zeros(73, 4, 64, dtype=torch.bfloat16)),
            ValueError,
            "q must be (total_q, Hq, 128)",
        ),
        (dict(k=torch.zeros(400, 3, 128, dtype=torch.bfloat16)), ValueError, "multiple of Hkv = 3"),
        (dict(cu_seqlens_k=None), ValueError, "flat k: give cu_seqlens_k"),
        (
            dict(cu_seqlens_q=torch.tensor([0, 3, 73])),
            ValueError,
            "cu_seqlens_q must be a contiguous int32",
        ),
        (dict(cu_seqlens_q=torch.tensor([0], dtype=torch.int32)), ValueError, "B + 1 >= 2"),
        (
            dict(cu_seqlens_k=torch.tensor([0, 300], dtype=torch.int32)),
            ValueError,
            "cu_seqlens_k must be a contiguous int32 vector of length 3",
        ),
        (
            dict(q_offset=torch.zeros(3, dtype=torch.int32)),
            ValueError,
            "q_offset must be a contiguous int32 vector of length 2",
        ),
        (dict(max_k_tiles=-1), ValueError, "max_k_tiles must be an int >= 0"),
        (
            dict(output=torch.zeros(4, 2, 73)),
            ValueError,
            "output must be a contiguous float32 tensor of shape (4, 3, 73)",
        ),
        (dict(), ValueError, "msa_proxy_score needs a CUDA device"),
    ],
)
def test_proxy_score_arguments_are_checked_by_name(changes, error, words):
    from sparseforge.msa_ops import msa_proxy_score

    with pytest.raises(error) as info:
        msa_proxy_score(**proxy_args(**changes))
    assert words in str(info.value), str(info.value)


def test_paged_proxy_score_arguments_are_checked_by_name():
    from sparseforge.msa_ops import msa_proxy_score

    args = proxy_args(paged=True)
    with pytest.raises(ValueError, match="paged k: give both page_table and seqused_k"):
        msa_proxy_score(**{**args, "seqused_k": None})
    with pytest.raises(ValueError, match="not both"):
        msa_proxy_score(**args, cu_seqlens_k=torch.tensor([0, 300, 400], dtype=torch.int32))
    with pytest.raises(ValueError, match="page_table must be int32"):
        msa_proxy_score(**{**args, "page_table": args["page_table"].long()})
    with pytest.raises(ValueError, match=r"paged k must be \(pages, Hkv, 128, 128\)"):
        msa_proxy_score(**{**args, "k": args["k"][:, :, :64]})
    with pytest.raises(ValueError, match="hold their heads contiguously"):
        msa_proxy_score(**{**args, "k": args["k"].transpose(0, 1).contiguous().transpose(0, 1)})


# --- msa_proxy_score_fp4: the 128x4 tiled scales, the reference, the argument checks -------


def test_scale_offsets_follow_the_128x4_tiled_layout():
    """A plain reading of the layout: 512-byte tiles of 128 rows x 4 groups, row r of a tile
    at (r % 32) * 16 + (r // 32) * 4, the group's byte after it; tiles of a band in group
    order, then the next band's. Every byte of the padded buffer is used once."""
    offsets = reference.scale_offsets_128x4(256, 8)
    assert offsets[0, 0] == 0 and offsets[0, 3] == 3
    assert offsets[1, 0] == 16 and offsets[31, 0] == 31 * 16
    assert offsets[32, 0] == 4 and offsets[127, 2] == 31 * 16 + 3 * 4 + 2
    assert offsets[0, 4] == 512 and offsets[5, 6] == 512 + 5 * 16 + 2
    assert offsets[128, 0] == 1024 and offsets[255, 7] == 2047
    assert torch.equal(offsets.flatten().sort().values, torch.arange(2048))


def test_nvfp4_128x4_round_trip_matches_the_plain_quantizer():
    x = torch.randn(5, 3, 128, generator=torch.Generator().manual_seed(1)) * 10
    codes, scales = reference.nvfp4_quantize_128x4(x, 0.01)
    assert codes.shape == (5, 3, 64) and codes.dtype == torch.uint8
    assert scales.shape == (128 * 8,)  # 15 rows: one 128-row band of 8 groups
    plain_codes, plain_scales = reference.nvfp4_quantize(x, 0.01)
    want = reference.nvfp4_dequantize(plain_codes, plain_scales, 0.01)
    assert torch.equal(reference.nvfp4_dequantize_128x4(codes, scales, 0.01), want)


@pytest.mark.parametrize("paged", [False, True])
def test_fp4_reference_is_the_proxy_score_of_the_dequantized_inputs(paged):
    from sparseforge.check import proxy_score_fp4_inputs, proxy_score_inputs

    args = proxy_score_fp4_inputs(paged, [3, 70], [300, 100])
    q = reference.nvfp4_dequantize_128x4(args["q_fp4"], args["q_scale"], args["q_global_scale"])
    k = reference.nvfp4_dequantize_128x4(args["k_fp4"], args["k_scale"], args["k_global_scale"])
    keys = {"k": k, "cu_seqlens_q": args["cu_seqlens_q"]}
    for name in ("cu_seqlens_k", "page_table", "seqused_k"):
        if name in args:
            keys[name] = args[name]
    want = reference.msa_proxy_score(q=q, **keys)
    got = reference.msa_proxy_score_fp4(**args)
    assert torch.equal(got, want)
    # ... and close to the unquantized inputs' scores (the quantization's error only).
    exact = reference.msa_proxy_score(
        **proxy_score_inputs(torch.float32, paged, [3, 70], [300, 100])
    )
    finite = torch.isfinite(exact)
    assert torch.equal(finite, torch.isfinite(got))
    assert float((got[finite] - exact[finite]).abs().max() / exact[finite].abs().max()) < 0.2


def fp4_args(paged=False, **changes):
    from sparseforge.check import proxy_score_fp4_inputs

    args = proxy_score_fp4_inputs(paged, [3, 70], [300, 100])
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(q_fp4=torch.zeros(73, 4, 64, dtype=torch.int8)), "q_fp4 must be a uint8"),
        (dict(k_scale=torch.zeros(8, dtype=torch.float32)), "k_scale must be a uint8"),
        (dict(q_fp4=torch.zeros(73, 4, 128, dtype=torch.uint8)), "q_fp4 must be (total_q, Hq, 64)"),
        (dict(k_fp4=torch.zeros(400, 2, 128, dtype=torch.uint8)), "flat k_fp4 must be"),
        (dict(q_global_scale=float("inf")), "q_global_scale must be a finite number"),
        (dict(k_global_scale=None), "k_global_scale must be a finite number"),
        (dict(q_scale=torch.zeros(1024, dtype=torch.uint8)), "q_scale must be a contiguous uint8"),
        (
            dict(k_scale=torch.zeros(2, 8192, dtype=torch.uint8)[:, ::2]),
            "k_scale must be a contiguous uint8",
        ),
        (dict(), "msa_proxy_score_fp4 needs a CUDA device"),
    ],
)
def test_fp4_arguments_are_checked_by_name(changes, words):
    from sparseforge.msa_ops import msa_proxy_score_fp4

    with pytest.raises(ValueError) as info:
        msa_proxy_score_fp4(**fp4_args(**changes))
    assert words in str(info.value), str(info.value)


def test_paged_fp4_arguments_are_checked_by_name():
    from sparseforge.msa_ops import msa_proxy_score_fp4

    args = fp4_args(paged=True)
    with pytest.raises(ValueError, match=r"paged k_fp4 must be \(pages, Hkv, 128, 64\)"):
        msa_proxy_score_fp4(**{**args, "k_fp4": args["k_fp4"][:, :, :64, :]})
    small = args["k_scale"][: args["k_scale"].numel() - 1024]
    with pytest.raises(ValueError, match="k_scale must be a contiguous uint8 tensor of the 128x4"):
        msa_proxy_score_fp4(**{**args, "k_scale": small})


def test_reference_scores_blocks_whose_page_id_leaves_the_cache_minus_inf():
    from sparseforge.check import proxy_score_inputs

    args = proxy_score_inputs(torch.float32, True, [3, 70], [300, 100])
    good = reference.msa_proxy_score(**args)
    table = args["page_table"].clone()
    table[0, 1] = args["k"].shape[0]  # past the cache
    table[1, 0] = -1
    bad = reference.msa_proxy_score(**{**args, "page_table": table})
    assert torch.isinf(bad[:, 1, :3]).all() and torch.isinf(bad[:, 0, 3:]).all()
    keep = torch.ones_like(good, dtype=torch.bool)
    keep[:, 1, :3] = False
    keep[:, 0, 3:] = False
    assert torch.equal(bad[keep], good[keep])


@pytest.mark.parametrize(
    "arch, dtype, fp32_sums, name",
    [
        ("sm_90a", "e4m3", True, "msa_proxy_score__sm90_wgmma__e4m3_d128_flat__sm_90a"),
        ("sm_90a", "e4m3", False, "msa_proxy_score__sm90_wgmma__e4m3_d128_flat_acc_fp8__sm_90a"),
        ("sm_90a", "bf16", False, "msa_proxy_score__sm90_wgmma__bf16_d128_flat__sm_90a"),
        # No FP8-summing variant built for these: fp32 sums on mma.sync.
        ("sm_100f", "e4m3", False, "msa_proxy_score__warp_mma__e4m3_d128_flat__sm_100f"),
        ("sm_120f", "e4m3", True, "msa_proxy_score__warp_mma__e4m3_d128_flat__sm_120f"),
    ],
)
def test_use_fp32_acc_picks_how_e4m3_is_summed(arch, dtype, fp32_sums, name):
    """use_fp32_acc=False may sum e4m3 on Hopper's FP8 tensor cores; True, and every other
    case, takes a variant that sums in fp32 (families/msa_proxy_score.py _choose)."""
    from sparseforge.families import msa_proxy_score as family

    assert family._choose(arch, dtype, 128, "flat", fp32_sums).name == name
