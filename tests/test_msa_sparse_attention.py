"""The MSA sparse-attention reference on the CPU against a plain reading of the contract, one
(token, head) at a time: ragged sequences with a partial last block, pages in random order
(the same keys flat and paged give the same result), blocks repeated across tokens, -1
entries, ids past the sequence, a block listed twice, empty selections (0 and LSE -inf),
causal with default and explicit query offsets and non-causal, GQA 1 / 4 / 16, the
softmax scale, v_global_scale and the temperature LSE."""

import math

import pytest
import torch
from sparseforge import msa_ops, reference
from sparseforge.check import paged_cache

BLOCK = reference.MSA_BLOCK


def plain(q, keys, values, cu_q, q2k, causal, offsets, scale, v_scale, temperature):
    """(out, lse, lse_t) from loops over (token, head), gathering the selected keys."""
    total_q, hq, d = q.shape
    hkv = keys[0].shape[1]
    out = torch.zeros(total_q, hq, d, dtype=torch.float64)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float64)
    lse_t = lse.clone()
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        blocks = -(-k.shape[0] // BLOCK)
        for i in range(int(cu_q[b]), int(cu_q[b + 1])):
            pos = offsets[b] + i - int(cu_q[b])
            for h in range(hq):
                g = h // (hq // hkv)
                chosen = sorted({int(t) for t in q2k[g, i] if 0 <= int(t) < blocks})
                seen = [
                    j
                    for t in chosen
                    for j in range(t * BLOCK, min((t + 1) * BLOCK, k.shape[0]))
                    if not causal or j <= pos
                ]
                if not seen:
                    continue
                s = torch.stack([q[i, h].double() @ k[j, g].double() for j in seen]) * scale
                p = torch.softmax(s, 0)
                out[i, h] = sum(p[n] * v[j, g].double() for n, j in enumerate(seen)) * v_scale
                lse[i, h] = torch.logsumexp(s, 0)
                lse_t[i, h] = torch.logsumexp(s * temperature, 0)
    return out.float(), lse.float(), lse_t.float()


def problem(seq_q, seq_k, hq, hkv, topk=4, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(seq_q), hq, d, generator=gen)
    keys = [torch.randn(n, hkv, d, generator=gen) for n in seq_k]
    values = [torch.randn(n, hkv, d, generator=gen) for n in seq_k]
    cu_q = torch.tensor([0, *torch.tensor(seq_q).cumsum(0).tolist()], dtype=torch.int32)
    most = max(-(-n // BLOCK) for n in seq_k) + 1  # ids up to one past the longest sequence
    q2k = torch.randint(-1, most, (hkv, sum(seq_q), topk), generator=gen, dtype=torch.int32)
    q2k[:, 0] = -1  # the first token selects nothing
    q2k[:, 1, :2] = 0  # a block listed twice
    return q, keys, values, cu_q, q2k


@pytest.mark.parametrize("hq, hkv", [(2, 2), (8, 2), (16, 1)])
@pytest.mark.parametrize("causal, explicit_offsets", [(False, False), (True, False), (True, True)])
def test_matches_the_plain_reading(hq, hkv, causal, explicit_offsets):
    seq_q, seq_k = [3, 1, 4], [300, 128, 5]
    q, keys, values, cu_q, q2k = problem(seq_q, seq_k, hq, hkv, seed=hq + causal)
    offsets = [n - m for n, m in zip(seq_k, seq_q, strict=True)]
    q_offset = None
    if explicit_offsets:
        offsets = [130, -1, 2]
        q_offset = torch.tensor(offsets, dtype=torch.int32)
    scale, v_scale, temperature = 0.3, 1.5, 0.7
    want = plain(q, keys, values, cu_q, q2k, causal, offsets, scale, v_scale, temperature)
    cu_k = torch.tensor([0, *torch.tensor(seq_k).cumsum(0).tolist()], dtype=torch.int32)
    kwargs = dict(
        causal=causal, softmax_scale=scale, q_offset=q_offset, v_global_scale=v_scale,
        lse_temperature_scale=temperature,
    )  # fmt: skip
    flat = reference.msa_sparse_attention(
        q, torch.cat(keys), torch.cat(values), q2k, cu_q, cu_k, **kwargs
    )
    gen = torch.Generator().manual_seed(1)
    k_cache, table = paged_cache(keys, gen)
    v_cache, _ = paged_cache(values, gen, table)
    by_pages = reference.msa_sparse_attention(
        q, k_cache, v_cache, q2k, cu_q, page_table=table,
        seqused_k=torch.tensor(seq_k, dtype=torch.int32), **kwargs,
    )  # fmt: skip
    for got in (flat, by_pages):
        for g, w in zip(got, want, strict=True):
            assert torch.equal(torch.isinf(g), torch.isinf(w))
            torch.testing.assert_close(g[torch.isfinite(w)], w[torch.isfinite(w)])
    assert torch.equal(flat[0][0], torch.zeros_like(flat[0][0]))  # the empty selection
    assert torch.isinf(flat[1][0]).all()


def test_reference_skips_blocks_whose_page_id_leaves_the_cache():
    seq_q, seq_k = [3, 1, 4], [300, 128, 5]
    q, keys, values, cu_q, q2k = problem(seq_q, seq_k, 8, 2, seed=3)
    gen = torch.Generator().manual_seed(1)
    k_cache, table = paged_cache(keys, gen)
    v_cache, _ = paged_cache(values, gen, table)
    used = torch.tensor(seq_k, dtype=torch.int32)
    bad = table.clone()
    bad[0, 1] = k_cache.shape[0]  # past the cache
    bad[2, 0] = -2
    got = reference.msa_sparse_attention(
        q, k_cache, v_cache, q2k, cu_q, page_table=bad, seqused_k=used
    )
    dropped = q2k.clone()
    dropped[:, :3] = torch.where(dropped[:, :3] == 1, -1, dropped[:, :3])
    dropped[:, 4:] = torch.where(dropped[:, 4:] == 0, -1, dropped[:, 4:])
    want = reference.msa_sparse_attention(
        q, k_cache, v_cache, dropped, cu_q, page_table=table, seqused_k=used
    )
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def api_args(**change):
    """Valid msa_sparse_attention arguments on the CPU (paged bf16 K/V, G 4, topk 16) with
    `change` applied: every check runs before the device check, which then refuses."""
    hq, hkv, pages = 16, 4, 3
    args = dict(
        q=torch.randn(5, hq, 128, dtype=torch.bfloat16),
        k=torch.randn(pages, hkv, 128, 128, dtype=torch.bfloat16),
        v=torch.randn(pages, hkv, 128, 128, dtype=torch.bfloat16),
        q2k_indices=torch.zeros(hkv, 5, 16, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32),
        page_table=torch.zeros(1, pages, dtype=torch.int32),
        seqused_k=torch.tensor([300], dtype=torch.int32),
    )
    return args | change


NVFP4 = dict(
    k=torch.zeros(3, 4, 128, 64, dtype=torch.uint8),
    v=torch.zeros(3, 4, 128, 64, dtype=torch.uint8),
    k_scale=torch.zeros(3, 4, 128, 8, dtype=torch.uint8),
    v_scale=torch.zeros(3, 4, 128, 8, dtype=torch.uint8),
    k_global_scale=0.5,
    v_global_scale=0.5,
)


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({}, ValueError, "needs a CUDA device"),
        (NVFP4, ValueError, "needs a CUDA device"),
        ({"q": torch.randn(5, 16, 128)}, NotImplementedError, "q has dtype"),
        ({"q": torch.randn(5, 16, 64, dtype=torch.bfloat16)}, ValueError, "q must be"),
        ({"k": torch.randn(3, 4, 128, 128, dtype=torch.float16)}, ValueError, "k and v must have"),
        ({"k_scale": 0.5}, ValueError, "k_scale applies to FP8 or NVFP4"),
        ({"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
        ({"lse_temperature_scale": 0.0}, ValueError, "lse_temperature_scale"),
        ({"v_global_scale": "2"}, TypeError, "v_global_scale"),
        ({"q2k_indices": torch.zeros(4, 5, 33, dtype=torch.int32)}, ValueError, "1 <= topk"),
        ({"q2k_indices": torch.zeros(4, 5, 16, dtype=torch.int64)}, ValueError, "q2k_indices"),
        ({"q2k_indices": torch.zeros(2, 5, 16, dtype=torch.int32)}, ValueError, "q2k_indices"),
        (
            {"q": torch.randn(5, 32, 128, dtype=torch.bfloat16),
             "k": torch.randn(3, 1, 128, 128, dtype=torch.bfloat16),
             "v": torch.randn(3, 1, 128, 128, dtype=torch.bfloat16),
             "q2k_indices": torch.zeros(1, 5, 16, dtype=torch.int32)},
            ValueError, "at most 16 query heads per kv head",
        ),
        ({"k": torch.randn(3, 4, 64, 128, dtype=torch.bfloat16)}, ValueError, "paged k must be"),
        ({"seqused_k": None}, ValueError, "paged K/V: give both page_table and seqused_k"),
        ({"cu_seqlens_k": torch.tensor([0, 300], dtype=torch.int32)}, ValueError, "not both"),
        ({"page_table": torch.zeros(1, 20000, dtype=torch.int32)}, ValueError, "at most 16384"),
        ({"cu_seqlens_q": torch.tensor([0, 5])}, ValueError, "cu_seqlens_q"),
        ({"q_offset": torch.zeros(2, dtype=torch.int32)}, ValueError, "q_offset"),
        ({"workspace": object()}, TypeError, "workspace"),
        ({"out": torch.empty(5, 16, 128)}, ValueError, "output must be"),
        (NVFP4 | {"k_global_scale": None}, ValueError, "k_global_scale and v_global_scale"),
        (NVFP4 | {"k_scale": torch.zeros(3, 4, 128, 4, dtype=torch.uint8)}, ValueError,
         "k_scale must be the NVFP4 scales"),
        (NVFP4 | {"v_scale": torch.zeros(3, 4, 128, 16, dtype=torch.uint8)[..., :8]}, ValueError,
         "v_scale must be the NVFP4 scales"),
        ({"k": torch.zeros(3, 4, 128, 128, dtype=torch.float8_e4m3fn),
          "v": torch.zeros(3, 4, 128, 128, dtype=torch.float8_e4m3fn),
          "k_global_scale": 1.0}, ValueError, "k_global_scale applies to NVFP4"),
        ({"k": torch.zeros(3, 4, 128, 128, dtype=torch.int8)}, ValueError,
         "k and v must have one dtype"),
    ],
)  # fmt: skip
def test_arguments_are_checked_by_name(change, error, words):
    with pytest.raises(error, match=words):
        msa_ops.msa_sparse_attention(**api_args(**change))


def test_nvfp4_is_paged_only():
    flat = dict(
        k=torch.zeros(300, 4, 64, dtype=torch.uint8), v=torch.zeros(300, 4, 64, dtype=torch.uint8),
        k_scale=None, v_scale=None, k_global_scale=1.0, v_global_scale=1.0,
        cu_seqlens_k=torch.tensor([0, 300], dtype=torch.int32), page_table=None, seqused_k=None,
    )  # fmt: skip
    with pytest.raises(ValueError, match="paged only"):
        msa_ops.msa_sparse_attention(**api_args(**flat))


def test_out_may_not_alias_an_input():
    args = api_args()
    with pytest.raises(ValueError, match="alias"):
        msa_ops.msa_sparse_attention(**args, out=args["q"])


def test_decode_arguments():
    args = api_args()
    args.pop("cu_seqlens_q")
    with pytest.raises(ValueError, match="seqlen_q must be an int >= 1"):
        msa_ops.msa_sparse_decode_attention(**args, seqlen_q=0)
    with pytest.raises(ValueError, match="B \\* seqlen_q"):
        msa_ops.msa_sparse_decode_attention(**args, seqlen_q=2)
    with pytest.raises(ValueError, match="partial_dtype"):
        msa_ops.msa_sparse_decode_attention(**args, partial_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        msa_ops.msa_sparse_decode_attention(**args, seqlen_q=5)


def test_prepared_decode_arguments():
    args = api_args() | NVFP4
    args.pop("cu_seqlens_q")
    with pytest.raises(ValueError, match="seqlen_q must be an int in \\[1, 32\\]"):
        msa_ops.prepare_msa_nvfp4_sparse_decode(**args, seqlen_q=33)
    with pytest.raises(ValueError, match="uint8 NVFP4 data"):
        msa_ops.prepare_msa_nvfp4_sparse_decode(**(args | {"k": api_args()["k"]}))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        msa_ops.prepare_msa_nvfp4_sparse_decode(**args, seqlen_q=5)


@pytest.mark.parametrize("wgmma_built", [True, False])
def test_prefill_picks_its_kernel_by_format_group_and_grid(monkeypatch, wgmma_built):
    """At G = 16 where the wgmma union tile is built and its grid (4 tokens a CTA) fills the
    GPU: 16-bit K/V on that tile, FP8 / NVFP4 K/V on the hand-off route (faster on MP1 with
    chunk-shared selections, near the one-token kernel with per-token ones, bench/results).
    Smaller launches and other builds: FP8 / NVFP4 on the one-token kernel, 16-bit on the
    union tile (both split); other G: the union tile."""
    monkeypatch.setattr(msa_ops, "_wgmma_built", lambda index, kv_format: wgmma_built)
    monkeypatch.setattr(msa_ops, "_multiprocessors", lambda device: 132)
    device = torch.device("cuda", 0)
    fills = 132  # tokens: 132 / 4 CTAs a kv head, times Hkv = 4, is 132 CTAs
    assert msa_ops._prefill_tile("16bit", 16, device, fills, 4) == (
        "wgmma" if wgmma_built else None
    )
    assert msa_ops._prefill_tile("16bit", 16, device, fills - 4, 4) is None
    for kv_format in ("e4m3", "nvfp4"):
        tokens_a_cta = 4 * msa_ops.WGMMA_WARPGROUPS[kv_format]
        filled = fills * tokens_a_cta // 4
        assert msa_ops._prefill_tile(kv_format, 16, device, 1, 4) == "token"
        assert msa_ops._prefill_tile(kv_format, 16, device, filled - tokens_a_cta, 4) == "token"
        for tokens in (filled, 10 * filled):
            assert msa_ops._prefill_tile(kv_format, 16, device, tokens, 4) == (
                "hybrid" if wgmma_built else "token"
            )
    for kv_format, group in (("16bit", 8), ("e4m3", 8), ("nvfp4", 4), ("16bit", 1)):
        assert msa_ops._prefill_tile(kv_format, group, device, 10 * fills, 4) is None


def test_a_forced_variant_picks_its_tile(monkeypatch):
    """SPARSEFORGE_VARIANT=<an MSA attention variant> makes prefill run that variant's tile
    (tuning, benchmarks); a variant of another family leaves prefill's choice alone."""
    from sparseforge.families import msa_sparse_attention as family

    monkeypatch.delenv("SPARSEFORGE_VARIANT", raising=False)
    assert family.forced_tile("16bit") == "auto"
    for name, tile in (
        ("msa_sparse_attention__wgmma__bf16_d128__sm_90a", "wgmma"),
        ("msa_sparse_attention__warp_mma__bf16_d128__sm_90a", None),
        ("msa_sparse_attention__warp_mma_token__fp16_d128__sm_100f", "token"),
    ):
        monkeypatch.setenv("SPARSEFORGE_VARIANT", name)
        assert family.forced_tile("16bit") == tile
        assert family.forced_tile("e4m3") == "auto"


def test_the_wgmma_tile_of_several_warpgroups_runs_when_chosen_or_forced(monkeypatch):
    """The wgmma union tile is also built with 2 and 4 warpgroups a CTA: chosen by its
    `warpgroups`, or forced by SPARSEFORGE_VARIANT (whose tile and warpgroups prefill then
    runs)."""
    from sparseforge import families
    from sparseforge.families import msa_sparse_attention as family

    monkeypatch.delenv("SPARSEFORGE_VARIANT", raising=False)
    for kv_format in ("16bit", "e4m3", "nvfp4"):
        name = family.FAMILY_OF_FORMAT[kv_format]
        params = dict(dtype="bf16", head_dim=128, tile="wgmma")
        assert families.choose(name, "sm_90a", **params).params["warpgroups"] == 1
        assert family.forced_warpgroups(kv_format) is None
        for warpgroups in (2, 4):
            monkeypatch.delenv("SPARSEFORGE_VARIANT", raising=False)
            chosen = families.choose(name, "sm_90a", **params, warpgroups=warpgroups)
            assert chosen.name == f"{name}__wgmma__bf16_d128_w{warpgroups}__sm_90a"
            monkeypatch.setenv("SPARSEFORGE_VARIANT", chosen.name)
            assert families.choose(name, "sm_90a", **params).name == chosen.name
            assert family.forced_tile(kv_format) == "wgmma"
            assert family.forced_warpgroups(kv_format) == warpgroups
        monkeypatch.setenv("SPARSEFORGE_VARIANT", f"{name}__warp_mma_token__bf16_d128__sm_90a")
        assert family.forced_warpgroups(kv_format) is None
        monkeypatch.delenv("SPARSEFORGE_VARIANT")
    # Prefill's grid check counts the tile's warpgroups: 4 tokens each.
    monkeypatch.setattr(msa_ops, "_wgmma_built", lambda index, kv_format: True)
    monkeypatch.setattr(msa_ops, "_multiprocessors", lambda device: 132)
    monkeypatch.setitem(msa_ops.WGMMA_WARPGROUPS, "e4m3", 4)
    device = torch.device("cuda", 0)
    assert msa_ops._prefill_tile("e4m3", 16, device, 132, 4) == "token"
    assert msa_ops._prefill_tile("e4m3", 16, device, 4 * 132, 4) == "hybrid"
    # 16-bit K/V on a tile of several warpgroups takes the hand-off route: its union of 8 or
    # 16 tokens' per-token selections would be several times a token's blocks.
    monkeypatch.setitem(msa_ops.WGMMA_WARPGROUPS, "16bit", 2)
    assert msa_ops._prefill_tile("16bit", 16, device, 132, 4) is None
    assert msa_ops._prefill_tile("16bit", 16, device, 2 * 132, 4) == "hybrid"


def test_the_forced_wgmma_tile_refuses_other_groups(monkeypatch):
    """The wgmma union tile is built for G = 16 only: forced at G = 4 it raises before the
    launch, naming the requirement."""
    monkeypatch.setenv("SPARSEFORGE_VARIANT", "msa_sparse_attention__wgmma__bf16_d128__sm_90a")
    with pytest.raises(ValueError, match="takes 16 query heads per kv head; Hq = 16, Hkv = 4"):
        msa_ops.msa_sparse_attention(**api_args(), causal=True)


def test_the_hybrid_route_refuses_other_groups(monkeypatch):
    """tile="hybrid" (the wgmma union tile handing tiles to the one-token kernel) needs
    G = 16 as the wgmma tile does: at G = 4 it raises before the launch; every K/V format
    has a hand-off threshold."""
    attention = msa_ops._attention
    monkeypatch.setattr(
        msa_ops, "_attention", lambda *a, **kw: attention(*a, **kw | {"tile": "hybrid"})
    )
    with pytest.raises(ValueError, match="takes 16 query heads per kv head; Hq = 16, Hkv = 4"):
        msa_ops.msa_sparse_attention(**api_args(), causal=True)
    assert set(msa_ops.HAND_OFF) == {"16bit", "e4m3", "nvfp4"}
    assert all(set(by_warpgroups) == {1, 2, 4} for by_warpgroups in msa_ops.HAND_OFF.values())


def test_the_hand_off_route_stages(monkeypatch):
    """The hand-off route's launches: the wgmma tile, then the one-token kernel, both by
    HAND_OFF at the tile's warpgroups; with FOUR_TOKEN_HAND_OFF, a tile of several warpgroups
    hands its large unions to the 4-token tile first (which reads the hand-off flags), and
    the one-token kernel runs what that tile hands on. Other routes launch one kernel."""
    hand_off = {1: 1.25, 2: 1.5, 4: 1.75}
    monkeypatch.setitem(msa_ops.HAND_OFF, "e4m3", hand_off)
    monkeypatch.setitem(msa_ops.FOUR_TOKEN_HAND_OFF, "e4m3", None)
    assert msa_ops._stages("token", "e4m3", 1) == (("token", 1, 0.0, False),)
    assert msa_ops._stages("wgmma", "e4m3", 2) == (("wgmma", 2, 0.0, False),)
    assert msa_ops._stages("hybrid", "e4m3", 2) == (
        ("wgmma", 2, 1.5, False),
        ("token", 1, 1.5, False),
    )
    monkeypatch.setitem(msa_ops.FOUR_TOKEN_HAND_OFF, "e4m3", 1.125)
    assert msa_ops._stages("hybrid", "e4m3", 1) == (
        ("wgmma", 1, 1.25, False),
        ("token", 1, 1.25, False),
    )
    for warpgroups in (2, 4):
        assert msa_ops._stages("hybrid", "e4m3", warpgroups) == (
            ("wgmma", warpgroups, 1.125, False),
            ("wgmma", 1, 1.25, True),
            ("token", 1, 1.25, False),
        )
    assert set(msa_ops.FOUR_TOKEN_HAND_OFF) == set(msa_ops.HAND_OFF)


def test_the_prefill_stats_say_which_tile_runs(monkeypatch):
    """msa_prefill_nvfp4_specialized_stats describes the route prefill takes: the wgmma tile
    of WGMMA_WARPGROUPS["nvfp4"] warpgroups, its hand-off threshold and, with
    FOUR_TOKEN_HAND_OFF, the 4-token tile's."""
    monkeypatch.setitem(msa_ops.WGMMA_WARPGROUPS, "nvfp4", 4)
    monkeypatch.setitem(msa_ops.HAND_OFF, "nvfp4", {1: 1.25, 4: 1.75})
    monkeypatch.setitem(msa_ops.FOUR_TOKEN_HAND_OFF, "nvfp4", None)
    text = msa_ops.msa_prefill_nvfp4_specialized_stats()["kernel"]
    assert "wgmma union tile of 4 warpgroups (16 tokens x 16 heads a CTA" in text
    assert "at most 1.75 x topk blocks, then msa_sparse_decode_attention's" in text
    assert "4-token tile" not in text
    monkeypatch.setitem(msa_ops.FOUR_TOKEN_HAND_OFF, "nvfp4", 1.5)
    text = msa_ops.msa_prefill_nvfp4_specialized_stats()["kernel"]
    assert "at most 1.5 x topk blocks, then the 4-token tile" in text
    assert "union is at most 1.25 x topk blocks, then msa_sparse_decode_attention's" in text
