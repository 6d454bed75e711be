"""msa_sparse_attention / msa_sparse_decode_attention on the GPU against the fp64 reference
(reference.msa_sparse_attention, which gathers each token's selected keys), on fresh random
inputs with poisoned outputs: K/V in q's dtype, FP8 (separate and the halves of one
interleaved cache) and NVFP4 (packed pages and separate tensors; the reference runs on the
dequantized values), flat and paged (pages shuffled, garbage past each sequence), ragged
batches with a partial last block, -1 entries, repeats and ids past the sequence, empty
selections (0 and LSE -inf), causal with default and explicit offsets and non-causal, GQA
1 / 4 / 16, topk 1 to 32, LSE and temperature LSE, decode with 1 and 4 tokens, graph
replay; launches whose tiles' keys are split across CTAs (small batches) and unsplit ones
(the split count forced both ways), each against the reference; page ids outside the
cache skipped."""

import math

import pytest
import torch
from sparseforge import msa_ops, reference
from sparseforge.check import msa_attention_inputs

pytestmark = pytest.mark.gpu

DEV = "cuda"
D = 128
TOLERANCE = {"bf16": 5e-3, "fp16": 5e-3, "e4m3": 1e-2, "nvfp4": 1e-2}


def run_reference(ref, causal, q_offset=None, softmax_scale=None, v_global_scale=1.0, temp=1.0):
    args = {n: t for n, t in ref.items() if n != "unquantized"}
    return reference.msa_sparse_attention(
        args.pop("q"), args.pop("k"), args.pop("v"), args.pop("q2k_indices"),
        args.pop("cu_seqlens_q"), args.pop("cu_seqlens_k", None), causal=causal,
        softmax_scale=softmax_scale, q_offset=q_offset, v_global_scale=v_global_scale,
        lse_temperature_scale=temp, **args,
    )  # fmt: skip


def rel_l2(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def check_lse(got, want):
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert torch.equal(got[~finite], want[~finite])
    assert (got[finite] - want[finite]).abs().max() < 2e-2


def poisoned_out(q):
    return torch.full_like(q, float("nan"))


FORMATS = [("bf16", False), ("bf16", True), ("fp16", False), ("fp16", True)]
FORMATS += [("e4m3", False), ("e4m3", True), ("nvfp4", True)]


FAMILY = {
    "bf16": "msa_sparse_attention",
    "fp16": "msa_sparse_attention",
    "e4m3": "msa_sparse_attention_fp8kv",
    "nvfp4": "msa_sparse_attention_nvfp4",
}
# The wgmma union tile of 2 and 4 warpgroups a CTA (forced by SPARSEFORGE_VARIANT).
SHARED_TILES = ("wgmma_w2", "wgmma_w4")
WGMMA_TILES = ("wgmma",) + SHARED_TILES


def use_tile(monkeypatch, tile, kv_format=None):
    """Run msa_sparse_attention on the given kernel: None, the portable union tile, "wgmma",
    its sm_90a form (G = 16), "wgmma_w2" / "wgmma_w4", that form with 2 / 4 warpgroups a CTA
    (forced by SPARSEFORGE_VARIANT: q is fp16 for fp16 K/V, else bf16), "token", the
    one-token kernel (decode's), or "hybrid", the wgmma tile handing tiles of little shared
    selection to the one-token kernel."""
    if tile in SHARED_TILES:
        dtype = "fp16" if kv_format == "fp16" else "bf16"
        name = f"{FAMILY[kv_format]}__wgmma__{dtype}_d128_{tile.split('_')[1]}__sm_90a"
        monkeypatch.setenv("SPARSEFORGE_VARIANT", name)
        tile = "wgmma"
    attention = msa_ops._attention
    monkeypatch.setattr(
        msa_ops, "_attention", lambda *a, **kw: attention(*a, **kw | {"tile": tile})
    )


# (K/V format, paged, Hq, Hkv, kernel): the portable union tile and the one-token kernel on
# every case, the wgmma union tile (sm_90a) on those it takes (G = 16).
CASES = [
    (fmt, paged, hq, hkv, tile)
    for fmt, paged in FORMATS
    for hq, hkv in [(4, 4), (16, 4), (16, 1)]
    for tile in (None, "token")
]
CASES += [
    (fmt, paged, hq, hkv, tile)
    for fmt, paged in FORMATS
    for hq, hkv in [(16, 1), (32, 2)]
    for tile in ("wgmma", "hybrid") + SHARED_TILES
]


@pytest.mark.parametrize("kv_format, paged, hq, hkv, tile", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_the_reference(kv_format, paged, hq, hkv, causal, tile, monkeypatch):
    use_tile(monkeypatch, tile, kv_format)
    seq_q, seq_k = [70, 1, 33], [700, 128, 200]
    kernel, ref = msa_attention_inputs(
        kv_format, paged, seq_q, seq_k, hq, hkv, seed=hq + hkv + causal
    )
    scale, v_global, temp = 0.07, 1.5, 0.7
    if kv_format == "nvfp4":
        v_global = kernel["v_global_scale"]
    out = poisoned_out(kernel["q"])
    got, lse, lse_t = msa_ops.msa_sparse_attention(
        **{n: kernel.pop(n) for n in ("q", "k", "v", "q2k_indices", "cu_seqlens_q")},
        causal=causal, softmax_scale=scale, return_softmax_lse=True,
        return_temperature_lse=True, lse_temperature_scale=temp, out=out,
        **({"v_global_scale": v_global} | kernel),
    )  # fmt: skip
    assert got is out
    want, want_lse, want_lse_t = run_reference(
        ref, causal, softmax_scale=scale, temp=temp,
        v_global_scale=1.0 if kv_format == "nvfp4" else v_global,
    )  # fmt: skip
    assert not got.isnan().any()
    err = rel_l2(got, want)
    assert err < TOLERANCE[kv_format], err
    check_lse(lse, want_lse)
    check_lse(lse_t, want_lse_t)
    # Tokens that select nothing: 0 and -inf.
    empty = torch.isinf(want_lse)
    assert empty.any() and (got[empty] == 0).all()


def rows_outside_the_sequences(table, used, pages):
    """(pages, 128) bool: the cache rows that hold no key of any sequence (rows past each
    sequence's end, and pages no sequence reaches)."""
    inside = torch.zeros(pages, 128, dtype=torch.bool, device=DEV)
    for b in range(table.shape[0]):
        n = int(used[b])
        for j in range(-(-n // 128)):
            inside[int(table[b, j]), : min(128, n - 128 * j)] = True
    return ~inside


@pytest.mark.parametrize(
    "kv_format, tile",
    [(f, t) for f in ("bf16", "e4m3", "nvfp4") for t in (None, "token", "wgmma")]
    + [(f, t) for f in ("bf16", "e4m3", "nvfp4") for t in SHARED_TILES],
)
def test_nan_outside_the_sequences_never_reaches_the_output(kv_format, tile, monkeypatch):
    """Every cache row that holds no key of a sequence is NaN (K and V; NVFP4: their e4m3
    scales, V's through the 4x4 swizzle): the output equals the reference's on the clean
    cache, with nothing NaN."""
    use_tile(monkeypatch, tile, kv_format)
    hkv = 1 if tile in WGMMA_TILES else 4
    kernel, ref = msa_attention_inputs(kv_format, True, [5, 1, 3], [300, 129, 70], 16, hkv, 16, 12)
    want, _, _ = run_reference(ref, True)
    outside = rows_outside_the_sequences(
        kernel["page_table"], kernel["seqused_k"], kernel["k"].shape[0]
    )
    if kv_format == "nvfp4":
        page, row = outside.nonzero(as_tuple=True)
        kernel["k_scale"].permute(0, 2, 1, 3)[page, row] = 0x7F
        v_scales = kernel["v_scale"]
        for group in range(8):  # logical (row, group) at (row - row % 4 + group // 2, ...)
            v_scales[page, :, row - row % 4 + group // 2, group % 2 * 4 + row % 4] = 0x7F
    else:
        for name in ("k", "v"):
            x = kernel[name]
            x.view(torch.uint8 if x.element_size() == 1 else torch.int16).permute(0, 2, 1, 3)[
                outside
            ] = 0x7F if x.element_size() == 1 else 0x7FC0
    got = msa_ops.msa_sparse_attention(**kernel, causal=True)
    assert not got.isnan().any()
    assert rel_l2(got, want) < TOLERANCE[kv_format]


@pytest.mark.parametrize("kv_format", ["e4m3", "nvfp4"])
@pytest.mark.parametrize("magnitude", [2.0**40, 2.0**-40, 1e4])
def test_bf16_queries_far_outside_fp16s_range_on_the_decode_kernel(kv_format, magnitude):
    """FP8 and NVFP4 K/V run fp16 MMAs: bf16 q is scaled into fp16's range by a power of
    two (one head of one token much larger than the rest at 1e4)."""
    kernel, ref = msa_attention_inputs(kv_format, True, [2] * 3, [700, 129, 300], 16, 4, 16, 13)
    kernel.pop("cu_seqlens_q")
    q, k, v, q2k = (kernel.pop(n) for n in ("q", "k", "v", "q2k_indices"))
    if magnitude == 1e4:
        q[1, 3] *= magnitude
    else:
        q.mul_(magnitude)
    got = msa_ops.msa_sparse_decode_attention(
        q, k, v, q2k, seqlen_q=2, softmax_scale=1.0 / magnitude if magnitude > 1 else 1.0,
        **kernel,
    )  # fmt: skip
    want, _, _ = run_reference(
        ref | {"q": q.float()}, True, softmax_scale=1.0 / magnitude if magnitude > 1 else 1.0
    )
    assert torch.isfinite(got).all()
    assert rel_l2(got, want) < TOLERANCE[kv_format]


@pytest.mark.parametrize("kv_format", ["e4m3", "nvfp4"])
@pytest.mark.parametrize("tile", WGMMA_TILES)
def test_query_heads_of_very_different_magnitudes_on_the_wgmma_tile(kv_format, tile, monkeypatch):
    """The wgmma tile brings q to its MMAs' range per warpgroup (fp16 tiles) or per row (FP8
    K/V's two e4m3 parts): heads 2^-8 .. 2^2 in magnitude within one warpgroup's rows still
    match the reference."""
    use_tile(monkeypatch, tile, kv_format)
    kernel, ref = msa_attention_inputs(kv_format, True, [9, 1, 6], [300, 129, 700], 16, 1, 16, 14)
    q = kernel["q"]
    q.mul_(torch.exp2(torch.linspace(-8, 2, q.shape[1], device=DEV))[None, :, None].to(q.dtype))
    got = msa_ops.msa_sparse_attention(**kernel, causal=True)
    want, _, _ = run_reference(ref | {"q": q.float()}, True)
    assert torch.isfinite(got).all()
    assert rel_l2(got, want) < TOLERANCE[kv_format]


def test_errors_against_the_unquantized_values_are_reported():
    """FP8 and NVFP4 K/V against the reference on the unquantized K/V (printed, loosely
    bounded: the quantization error, not the kernel's)."""
    for kv_format in ("e4m3", "nvfp4"):
        kernel, ref = msa_attention_inputs(kv_format, True, [64], [1000], 16, 4, seed=5)
        got = msa_ops.msa_sparse_attention(**kernel, causal=True)
        want, _, _ = run_reference(ref, True)
        exact_k, exact_v = ref.get("unquantized", (None, None))
        if exact_k is None:
            continue
        plain, _, _ = run_reference(ref | {"k": exact_k, "v": exact_v}, True)
        print(f"{kv_format}: rel L2 vs dequantized {rel_l2(got, want):.2e}, "
              f"vs unquantized {rel_l2(got, plain):.2e}")  # fmt: skip
        assert rel_l2(got, plain) < 0.2


@pytest.mark.parametrize("tile", [None, "token", "wgmma"])
def test_explicit_q_offset_and_topk_range(tile, monkeypatch):
    use_tile(monkeypatch, tile)
    hkv = 1 if tile == "wgmma" else 4
    for topk, offsets in ((1, [700, 5, 190]), (32, [100, 0, 170]), (17, [640, 127, 0])):
        kernel, ref = msa_attention_inputs(
            "bf16", True, [70, 1, 33], [700, 128, 200], 16, hkv, topk, topk
        )
        q_offset = torch.tensor(offsets, dtype=torch.int32, device=DEV)
        got = msa_ops.msa_sparse_attention(**kernel, causal=True, q_offset=q_offset)
        want, _, _ = run_reference(ref, True, q_offset=q_offset)
        assert rel_l2(got, want) < 5e-3


def test_fp8_halves_of_an_interleaved_cache():
    kernel, ref = msa_attention_inputs("e4m3", True, [40, 3], [300, 129], 16, 4, seed=3)
    k, v = kernel.pop("k"), kernel.pop("v")
    cache = torch.cat([k, v], -1)  # (pages, Hkv, 128, 256)
    got = msa_ops.msa_sparse_attention(k=cache[..., :D], v=cache[..., D:], **kernel, causal=True)
    want, _, _ = run_reference(ref, True)
    assert rel_l2(got, want) < 1e-2


def test_nvfp4_separate_tensors_give_the_packed_pages_result():
    kernel, _ = msa_attention_inputs("nvfp4", True, [40, 3], [300, 129], 16, 4, seed=4)
    packed = msa_ops.msa_sparse_attention(**kernel, causal=True)
    separate = {n: kernel[n].contiguous() for n in ("k", "v", "k_scale", "v_scale")}
    got = msa_ops.msa_sparse_attention(**(kernel | separate), causal=True)
    assert torch.equal(got, packed)


@pytest.mark.parametrize("kv_format", ["bf16", "e4m3", "nvfp4"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_decode(kv_format, seqlen_q):
    batch, hq, hkv = 5, 16, 4
    seq_k = [1000, 129, 128, 4000, seqlen_q]
    kernel, ref = msa_attention_inputs(kv_format, True, [seqlen_q] * batch, seq_k, hq, hkv, 16, 6)
    kernel.pop("cu_seqlens_q")
    q, k, v, q2k = (kernel.pop(n) for n in ("q", "k", "v", "q2k_indices"))
    got, lse = msa_ops.msa_sparse_decode_attention(
        q, k, v, q2k, seqlen_q=seqlen_q, return_softmax_lse=True, **kernel
    )
    want, want_lse, _ = run_reference(ref, True)
    assert rel_l2(got, want) < TOLERANCE[kv_format]
    check_lse(lse, want_lse)


@pytest.mark.parametrize("kv_format", ["bf16", "e4m3", "nvfp4"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_split_keys_merge_to_the_reference(kv_format, seqlen_q, splits, monkeypatch):
    """The split count forced: 1 (one CTA per tile), 3 (uneven shares) and 16 (more splits
    than some tiles have 64-key tiles: empty splits). The first request selects nothing."""
    monkeypatch.setattr(msa_ops, "_splits", lambda *args: splits)
    batch, hq, hkv = 3, 16, 4
    seq_k = [3000, 129, 700]
    kernel, ref = msa_attention_inputs(kv_format, True, [seqlen_q] * batch, seq_k, hq, hkv, 16, 9)
    kernel.pop("cu_seqlens_q")
    q, k, v, q2k = (kernel.pop(n) for n in ("q", "k", "v", "q2k_indices"))
    out = poisoned_out(q)
    got, lse, lse_t = msa_ops.msa_sparse_decode_attention(
        q, k, v, q2k, seqlen_q=seqlen_q, return_temperature_lse=True, lse_temperature_scale=0.5,
        out=out, **kernel,
    )  # fmt: skip
    want, want_lse, want_lse_t = run_reference(ref, True, temp=0.5)
    assert got is out
    assert rel_l2(got, want) < TOLERANCE[kv_format]
    check_lse(lse, want_lse)
    check_lse(lse_t, want_lse_t)


def test_small_batches_split_and_large_ones_do_not():
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    device = torch.device(DEV)
    assert msa_ops._splits(device, 4, 16) == 16  # one decode token, 4 kv heads: 4 CTAs
    assert msa_ops._splits(device, 40, 16) == min(16, -(-2 * sms // 40))
    assert msa_ops._splits(device, 1024, 16) == 1
    assert msa_ops._splits(device, 4, 2) == 2  # at most topk


@pytest.mark.parametrize(
    "kv_format, warpgroups",
    [(f, w) for f in ("bf16", "e4m3", "nvfp4") for w in (1, 2, 4)],
)
@pytest.mark.parametrize("hand_off", [100.0, 1.5, 1e-3])
def test_hybrid_runs_every_token_once(kv_format, warpgroups, hand_off, monkeypatch):
    """The wgmma union tile (of 1, 2 or 4 warpgroups a CTA) with hand-off, then the
    one-token kernel (no 4-token stage): tiles kept (hand_off large), all handed off (tiny),
    and mixed (chunk-shared selections in one sequence, per-token ones in the other); every
    row written once (poisoned output), each matching the reference."""
    fmt = "16bit" if kv_format == "bf16" else kv_format
    monkeypatch.setitem(msa_ops.HAND_OFF, fmt, {warpgroups: hand_off})
    monkeypatch.setitem(msa_ops.FOUR_TOKEN_HAND_OFF, fmt, None)
    monkeypatch.setitem(msa_ops.WGMMA_WARPGROUPS, fmt, warpgroups)
    check_the_hand_off_route(monkeypatch, kv_format, [(0, 96, 8)])


def check_the_hand_off_route(monkeypatch, kv_format, sharing):
    """The hand-off route over two sequences of 96 and 61 tokens with per-token selections
    except where tokens share their blocks (`sharing`: (first, end, tokens a group) each):
    every row written once (poisoned output), matching the reference."""
    from sparseforge.families import msa_sparse_attention as family

    if not family.built_for(torch.cuda.current_device(), "16bit", "wgmma"):
        pytest.skip("no wgmma union tile for this GPU's arch")
    use_tile(monkeypatch, "hybrid")
    kernel, ref = msa_attention_inputs(kv_format, True, [96, 61], [3000, 6000], 32, 2, 16, 5)
    q2k = kernel["q2k_indices"]
    for first, end, tokens in sharing:
        q2k[:, first:end] = q2k[:, first:end:tokens].repeat_interleave(tokens, 1)
    ref["q2k_indices"] = q2k.clone()
    out = poisoned_out(kernel["q"])
    got, lse = msa_ops.msa_sparse_attention(
        **{n: kernel.pop(n) for n in ("q", "k", "v", "q2k_indices", "cu_seqlens_q")},
        causal=True, out=out, return_softmax_lse=True, **kernel,
    )  # fmt: skip
    want, want_lse, _ = run_reference(ref, True)
    assert not got.isnan().any()
    assert rel_l2(got, want) < TOLERANCE[kv_format]
    check_lse(lse, want_lse)


@pytest.mark.parametrize(
    "kv_format, warpgroups",
    [(f, w) for f in ("bf16", "e4m3", "nvfp4") for w in (2, 4)],
)
@pytest.mark.parametrize(
    "to_four, hand_off", [(100.0, 1e-3), (1e-3, 100.0), (1e-3, 1e-3), (1.0, 1.5)]
)
def test_the_four_token_stage_runs_every_token_once(
    kv_format, warpgroups, to_four, hand_off, monkeypatch
):
    """The hand-off route with the 4-token stage: the tile of several warpgroups keeps every
    tile (to_four large) or hands all (tiny) or some to the 4-token tile, which keeps them
    (hand_off large) or hands all or some on to the one-token kernel; every row written once
    (poisoned output), each matching the reference."""
    fmt = "16bit" if kv_format == "bf16" else kv_format
    monkeypatch.setitem(msa_ops.HAND_OFF, fmt, {1: hand_off})
    monkeypatch.setitem(msa_ops.FOUR_TOKEN_HAND_OFF, fmt, to_four)
    monkeypatch.setitem(msa_ops.WGMMA_WARPGROUPS, fmt, warpgroups)
    check_the_hand_off_route(monkeypatch, kv_format, [(0, 48, 16), (48, 96, 4)])


@pytest.mark.parametrize("kv_format", ["bf16", "fp16", "e4m3", "nvfp4"])
def test_prefill_chooses_the_wgmma_tile_where_its_grid_fills_the_gpu(kv_format, monkeypatch):
    """G = 16 with enough tokens: prefill's own choice (no variant forced) is the wgmma union
    tile where the build has it (for FP8 / NVFP4 K/V the hand-off route: that tile, the
    4-token tile where FOUR_TOKEN_HAND_OFF is set, then the one-token kernel), and it
    matches the reference."""
    from sparseforge.families import msa_sparse_attention as family

    monkeypatch.delenv("SPARSEFORGE_VARIANT", raising=False)
    fmt = "16bit" if kv_format in ("bf16", "fp16") else kv_format
    if not family.built_for(torch.cuda.current_device(), fmt, "wgmma"):
        pytest.skip("no wgmma union tile for this GPU's arch")
    tiles = []
    launch = family.launch
    monkeypatch.setattr(family, "launch", lambda *a: tiles.append(a[12]) or launch(*a))
    kernel, ref = msa_attention_inputs(kv_format, True, [400, 250], [2000, 700], 64, 4, 16, 3)
    out = poisoned_out(kernel["q"])
    got = msa_ops.msa_sparse_attention(
        **{n: kernel.pop(n) for n in ("q", "k", "v", "q2k_indices", "cu_seqlens_q")},
        causal=True, out=out, **kernel,
    )  # fmt: skip
    four = ["wgmma"] if msa_ops.FOUR_TOKEN_HAND_OFF[fmt] is not None else []
    assert tiles == (["wgmma"] if fmt == "16bit" else ["wgmma", *four, "token"])
    want, _, _ = run_reference(ref, True)
    assert rel_l2(got, want) < TOLERANCE[kv_format]


@pytest.mark.parametrize("kv_format", ["bf16", "nvfp4"])
def test_blocks_whose_page_id_leaves_the_cache_are_skipped(kv_format):
    """A page id past the cache or negative: its block is skipped like a -1 (never read)."""
    kernel, ref = msa_attention_inputs(kv_format, True, [5, 3], [900, 300], 16, 4, seed=11)
    table = kernel["page_table"].clone()
    table[0, 1] = kernel["k"].shape[0]
    table[1, 0] = -3
    got = msa_ops.msa_sparse_attention(**{**kernel, "page_table": table}, causal=True)
    # The reference skips them too; and equals the reference without those selections.
    want, _, _ = run_reference({**ref, "page_table": table}, True)
    q2k = ref["q2k_indices"].clone()
    q2k[:, :5] = torch.where(q2k[:, :5] == 1, -1, q2k[:, :5])  # sequence 0's block 1
    q2k[:, 5:] = torch.where(q2k[:, 5:] == 0, -1, q2k[:, 5:])  # sequence 1's block 0
    without, _, _ = run_reference({**ref, "q2k_indices": q2k}, True)
    assert torch.allclose(want, without, atol=1e-6)
    assert rel_l2(got, want) < TOLERANCE[kv_format]


def test_graph_replay_is_bit_equal_to_eager():
    kernel, _ = msa_attention_inputs("nvfp4", True, [64, 5], [900, 300], 16, 4, seed=7)
    out = torch.empty_like(kernel["q"])
    eager = msa_ops.msa_sparse_attention(**kernel, causal=True).clone()
    workspace = msa_ops.MSASparseAttentionWorkspace(DEV)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        msa_ops.msa_sparse_attention(**kernel, causal=True, out=out, workspace=workspace)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        msa_ops.msa_sparse_attention(**kernel, causal=True, out=out, workspace=workspace)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_runs_are_deterministic_and_need_no_host_sync():
    kernel, _ = msa_attention_inputs("bf16", True, [64, 5], [900, 300], 16, 4, seed=8)
    first = msa_ops.msa_sparse_attention(**kernel, causal=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = msa_ops.msa_sparse_attention(**kernel, causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first, second)


def test_stats_describe_the_routes():
    assert msa_ops.supports_packed_kv(DEV) is True
    for stats in (
        msa_ops.msa_prefill_nvfp4_specialized_stats(),
        msa_ops.msa_decode_nvfp4_specialized_stats(),
    ):
        assert stats["available"] is True
        assert stats["topk_range"] == (1, 32)
        assert math.isfinite(stats["head_dim"])


def test_prepared_nvfp4_decode_runner():
    kernel, ref = msa_attention_inputs("nvfp4", True, [2] * 3, [700, 129, 300], 16, 4, 16, 9)
    kernel.pop("cu_seqlens_q")
    q, k, v, q2k = (kernel.pop(n) for n in ("q", "k", "v", "q2k_indices"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEV)
    run = msa_ops.prepare_msa_nvfp4_sparse_decode(q, k, v, q2k, seqlen_q=2, lse=lse, **kernel)
    q.mul_(0.5)  # the runner reads the tensors as they are at the call
    got = run()
    want, want_lse, _ = run_reference(ref | {"q": q.float()}, True)
    assert rel_l2(got, want) < 1e-2
    check_lse(lse, want_lse)


def test_engine_chain_proxy_score_top16_attention():
    """The MSA layer as an engine runs it, each stage against its reference: proxy score
    per query head (causal, two ragged sequences, flat K), the max over each kv head's
    group, msa_topk_select (first block forced), msa_sparse_attention over the selections
    (causal, GQA 4)."""
    hq, hkv, seq = 8, 2, [700, 1300]
    group = hq // hkv
    gen = torch.Generator(device=DEV).manual_seed(11)
    total = sum(seq)
    q = torch.randn(total, hq, D, device=DEV, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(total, hkv, D, device=DEV, generator=gen).to(torch.bfloat16) for _ in "kv")
    cu = torch.tensor([0, seq[0], total], dtype=torch.int32, device=DEV)
    blocks = -(-max(seq) // 128)
    scores = msa_ops.msa_proxy_score(q, k, cu, cu, max_seqlen_q=max(seq), max_k_tiles=blocks)
    want_scores = reference.msa_proxy_score(q, k, cu, cu, max_k_tiles=blocks)
    assert torch.equal(scores.isinf(), want_scores.isinf())
    finite = want_scores.isfinite()
    error = (scores[finite] - want_scores[finite]).abs().max()
    assert error < 1e-3 * want_scores[finite].abs().max()
    per_kv_head = scores.view(hkv, group, blocks, total).amax(1)
    selected = msa_ops.msa_topk_select(per_kv_head, 16, force_begin_blocks=1)
    assert torch.equal(selected, reference.msa_topk_select(per_kv_head, 16, None, 1, 0))
    q2k = selected.permute(1, 0, 2).contiguous()  # (Hkv, total_q, 16)
    out = poisoned_out(q)
    msa_ops.msa_sparse_attention(q, k, v, q2k, cu, cu, causal=True, out=out)
    want, _, _ = reference.msa_sparse_attention(q, k, v, q2k, cu, cu, causal=True)
    assert rel_l2(out, want) < TOLERANCE["bf16"]
