"""GPU side of the input rules: non-contiguous selections, GPU checks that must not be dropped,
wrapper state, Sage scales written in place, extreme finite values and NaN / Inf placement.

Each case runs the kernels (bf16 / fp16 and Sage FP8, the default template and the portable
one) and compares with the PyTorch reference in fp64 on the same inputs."""

import pytest
import torch
from sparseforge import (
    BlockSparseAttentionWrapper,
    VariableBlockSparseAttentionWrapper,
    VariantNotBuiltError,
    reference,
    sage_fp8_quantize,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"
FP8 = torch.float8_e4m3fn
BACKENDS = ["sparseforge", "warp_mma"]


def workspace():
    return torch.empty(16, dtype=torch.uint8, device=DEV)


def uniform(hkv, total, block):
    return reference.uniform_sizes(total, block).expand(hkv, -1).to(torch.int32).to(DEV)


def plan_variable(mask, hq, d, seq, block=64, backend="sparseforge", dtype=torch.bfloat16, **kw):
    hkv = mask.shape[0]
    w = VariableBlockSparseAttentionWrapper(workspace(), backend=backend)
    w.plan(
        mask,
        uniform(hkv, seq, block),
        uniform(hkv, seq, block),
        hq,
        hkv,
        d,
        q_data_type=dtype,
        **kw,
    )
    return w


def run(w, q, k, v):
    out = torch.full(
        q.shape, float("nan"), device=DEV, dtype=torch.bfloat16 if q.dtype == FP8 else q.dtype
    )
    lse = torch.full(q.shape[:2], float("nan"), device=DEV)
    w.run(q, k, v, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    return out, lse


def reference_hnd(mask, q, k, v, seq, block=64, sm_scale=None):
    sizes = reference.uniform_sizes(seq, block)
    tokens = reference.block_mask_to_token_mask(mask.cpu(), sizes, sizes).to(DEV)
    return reference.attention(q, k, v, tokens, sm_scale, compute_dtype=torch.float64)


def ragged(hkv, blocks, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(hkv, blocks, blocks, generator=gen) < 0.5
    mask[0, 0] = False
    mask[-1, -1] = True
    return mask


# --- selections of any strides ------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_selections_match_contiguous_ones(backend):
    hkv, hq, d, seq = 2, 4, 64, 512
    blocks = seq // 64
    torch.manual_seed(0)
    q = torch.randn(hq, seq, d, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(hkv, seq, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    mask = ragged(hkv, blocks, 1).to(DEV)
    views = {
        "contiguous": mask,
        "transposed": mask.transpose(1, 2).contiguous().transpose(1, 2),
        "expanded last dim": mask[:, :, :1].expand(-1, -1, blocks),
        "every other head": torch.stack([mask, ~mask], 1).reshape(2 * hkv, blocks, blocks)[::2],
    }
    for name, view in views.items():
        out, lse = run(plan_variable(view, hq, d, seq, backend=backend), q, k, v)
        ref, ref_lse = reference_hnd(view, q, k, v, seq)
        assert float((out.double() - ref).norm() / ref.norm()) < 5e-3, name
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), name
        # The BSR wrapper's block_mask form, NHD.
        w = BlockSparseAttentionWrapper(workspace(), backend=backend)
        w.plan(
            None, None, seq, seq, 64, 64, hq, hkv, d, block_mask=view, q_data_type=torch.bfloat16
        )
        out_nhd = w.run(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        assert torch.equal(out_nhd.transpose(0, 1), out), name


# --- GPU checks are kept ---------------------------------------------------------------------


def test_invalid_kv_block_lens_on_the_gpu_is_raised_with_any_form():
    hq, hkv, d, seq, block = 4, 2, 64, 256, 64
    lens = torch.tensor([64, 0, 64, 64], dtype=torch.int32, device=DEV)
    indptr = torch.arange(5, dtype=torch.int32)
    indices = torch.arange(4, dtype=torch.int32)
    forms = {
        "host indptr / indices": dict(indptr=indptr, indices=indices),
        "GPU block_mask per kv head": dict(
            block_mask=torch.ones(hkv, 4, 4, dtype=torch.bool, device=DEV)
        ),
        "host block_mask per query head": dict(block_mask=torch.ones(hq, 4, 4, dtype=torch.bool)),
    }
    for name, form in forms.items():
        print(name)
        w = BlockSparseAttentionWrapper(workspace())
        w.plan(
            form.get("indptr"),
            form.get("indices"),
            seq,
            seq,
            block,
            block,
            hq,
            hkv,
            d,
            block_mask=form.get("block_mask"),
            kv_block_lens=lens,
            q_data_type=torch.bfloat16,
        )
        with pytest.raises(ValueError, match=r"kv_block_lens values must lie in \[1, C\]"):
            w.check_plan()


# --- wrapper state ----------------------------------------------------------------------------


def test_a_plan_that_fails_after_its_gpu_checks_started_leaves_no_pending_error():
    hq, hkv, d, seq = 4, 2, 64, 256
    q = torch.randn(seq, hq, d, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(seq, hkv, d, device=DEV, dtype=torch.bfloat16)
    w = BlockSparseAttentionWrapper(workspace())
    good = torch.ones(hkv, 4, 4, dtype=torch.bool, device=DEV)
    w.plan(None, None, seq, seq, 64, 64, hq, hkv, d, block_mask=good, q_data_type=torch.bfloat16)
    want = w.run(q, kv, kv)
    bad = torch.full((hq, 4, 2), 9, dtype=torch.int32, device=DEV)  # out of range: a GPU error
    with pytest.raises(VariantNotBuiltError, match="head_dim 96 is not built"):
        w.plan(
            None, None, seq, seq, 64, 64, hq, hkv, 96, q2k_indices=bad, q_data_type=torch.bfloat16
        )
    torch.cuda.synchronize()
    assert torch.equal(w.run(q, kv, kv), want)
    w.check_plan()


def test_block_sizes_rewritten_behind_torchs_back_are_caught():
    hq, hkv, d, seq = 2, 2, 64, 256
    mask = torch.ones(hkv, 4, 4, dtype=torch.bool, device=DEV)
    sizes = uniform(hkv, seq, 64)
    w = VariableBlockSparseAttentionWrapper(workspace())
    w.plan(mask, sizes, sizes, hq, hkv, d, q_data_type=torch.bfloat16)
    w.plan(mask, sizes, sizes, hq, hkv, d, q_data_type=torch.bfloat16)  # cached: fine
    w.check_plan()
    sizes.data[:, 0] = 32  # no version bump
    sizes.data[:, 1] = 96
    w.plan(mask, sizes, sizes, hq, hkv, d, q_data_type=torch.bfloat16)
    with pytest.raises(ValueError, match="changed in place without torch noticing"):
        w.check_plan()


# --- Sage scales read at every run --------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scales_from", ["quantizer", "plain tensors"])
def test_scales_written_in_place_reach_the_kernel(backend, scales_from):
    """A caller re-quantizes K/V (and q) every step and writes codes and scales into the
    tensors it planned with: the next run uses them."""
    hq, hkv, d, seq = 4, 2, 128, 300
    blocks = -(-seq // 64)
    gen = torch.Generator(device=DEV).manual_seed(4)
    first, second = (
        [
            torch.randn(h, seq, d, device=DEV, dtype=torch.bfloat16, generator=gen) * s
            for h in (hq, hkv, hkv)
        ]
        for s in (1.0, 3.0)
    )
    mask = ragged(hkv, blocks, 2).to(DEV)
    qz = sage_fp8_quantize(*first)
    scales = [qz.q_scale, qz.k_scale, qz.v_scale]
    if scales_from == "plain tensors":
        scales = [s.contiguous().clone() for s in scales]
    sizes = uniform(hkv, seq, 64)
    w = VariableBlockSparseAttentionWrapper(workspace(), backend=backend)
    w.plan(
        mask,
        sizes,
        sizes,
        hq,
        hkv,
        d,
        q_data_type=FP8,
        q_scale=scales[0],
        k_scale=scales[1],
        v_scale=scales[2],
    )
    new = sage_fp8_quantize(*second)
    for planned, fresh in zip(scales, (new.q_scale, new.k_scale, new.v_scale), strict=True):
        planned.copy_(fresh)
    out, _ = run(w, new.q, new.k, new.v)
    ref, _ = reference_hnd(
        mask,
        *reference.sage_dequantize(new.q, new.k, new.v, new.q_scale, new.k_scale, new.v_scale),
        seq,
    )
    assert float((out.double() - ref).norm() / ref.norm()) < 0.03


# --- extreme finite values: finite out, as the reference -----------------------------------------


def extreme_inputs(case, dtype, hq, hkv, seq, d, seed=5):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v = (
        torch.randn(h, seq, d, device=DEV, dtype=torch.float32, generator=gen)
        for h in (hq, hkv, hkv)
    )
    big = torch.finfo(dtype).max
    if case == "largest values":
        q, k, v = (
            q.sign() * 200,
            k.sign() * 200,
            v.sign() * big,
        )  # |q.k| ~ 5e6, v at the dtype's max
    elif case == "hugely negative logits":
        q, k = q.abs() * 100, -k.abs() * 100  # every logit ~ -1e5 x scale
    elif case == "logits below -1e30":  # bf16 only: every logit ~ -1e35, finite in fp32
        q, k = q.abs() * 1e17, -k.abs() * 1e17
    elif case == "one huge logit per row":
        k[:, 7] = 300.0
        q = q.abs() + 1
    elif case == "one winner among logits beyond 2^30":
        # q in [A, 2A] and keys at -A (1 + [0, 1]) but key 7 at -A / 4: every logit is of
        # order -1e10 (x scale log2 e: 2^31 and beyond), and key 7's is twice above the rest,
        # so the softmax is one-hot on it whatever the rounding. A = 30000 fits fp16.
        a = 30000.0
        q = a * (1 + q.abs().clamp(max=1))
        k = -a * (1 + k.abs().clamp(max=1))
        k[:, 7] = -a / 4
    return q.to(dtype), k.to(dtype), v.to(dtype)


def assert_convex_combination_of_v(out, v, hq):
    """Each output row lies within V's per-channel range (up to rounding) and is not zero:
    what a softmax that is one-hot on an unknown key gives."""
    v_rows = v.float().repeat_interleave(hq // v.shape[0], 0)  # (Hq, Sk, D)
    low, high = v_rows.amin(1, keepdim=True), v_rows.amax(1, keepdim=True)
    slack = 0.02 * (high - low)
    assert (out.float() >= low - slack).all() and (out.float() <= high + slack).all()
    assert (out.float().abs().amax(-1) > 0).all(), "rows lost their keys"


EXTREME_16BIT_CASES = [
    (dtype, case)
    for dtype in (torch.float16, torch.bfloat16)
    for case in (
        "largest values",
        "hugely negative logits",
        "one huge logit per row",
        "one winner among logits beyond 2^30",
    )
] + [(torch.bfloat16, "logits below -1e30")]  # (fp16 q.k cannot reach -1e30)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, case", EXTREME_16BIT_CASES)
def test_extreme_finite_inputs_give_the_references_finite_outputs(backend, dtype, case):
    hq, hkv, d, seq = 2, 2, 64, 256
    q, k, v = extreme_inputs(case, dtype, hq, hkv, seq, d)
    mask = torch.ones(hkv, 4, 4, dtype=torch.bool, device=DEV)
    out, lse = run(plan_variable(mask, hq, d, seq, backend=backend, dtype=dtype), q, k, v)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all(), case
    if case == "logits below -1e30":  # one-hot on a key that rounding picks: see the Sage test
        assert_convex_combination_of_v(out, v, hq)
        return
    ref, ref_lse = reference_hnd(mask, q, k, v, seq)
    assert torch.isfinite(ref).all() and torch.isfinite(ref_lse).all()
    scale = ref.abs().max().clamp_min(1)
    assert float((out.double() - ref).abs().max() / scale) < 1e-2, case
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case",
    [
        "hugely negative logits",
        "logits below -1e30",
        "one huge logit per row",
        "one winner among logits beyond 2^30",
    ],
)
def test_extreme_finite_inputs_on_the_sage_path(backend, case):
    """Logits below -1e30 (no K smoothing, which would shift them back): the softmax is
    one-hot and which key wins depends on rounding, so the output is checked to be finite,
    non-zero and a convex combination of V's rows, not against the reference's argmax."""
    hq, hkv, d, seq = 2, 2, 64, 256
    q, k, v = extreme_inputs(case, torch.bfloat16, hq, hkv, seq, d)
    qz = sage_fp8_quantize(q, k, v, smooth_k=case != "logits below -1e30")
    mask = torch.ones(hkv, 4, 4, dtype=torch.bool, device=DEV)
    w = plan_variable(
        mask, hq, d, seq, backend=backend, dtype=FP8,
        q_scale=qz.q_scale, k_scale=qz.k_scale, v_scale=qz.v_scale,
    )  # fmt: skip
    out, lse = run(w, qz.q, qz.k, qz.v)
    dequantized = reference.sage_dequantize(qz.q, qz.k, qz.v, qz.q_scale, qz.k_scale, qz.v_scale)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    if case == "logits below -1e30":
        assert_convex_combination_of_v(out, dequantized[2], hq)
        return
    ref, _ = reference_hnd(mask, *dequantized, seq)
    cos = float((out.double() * ref).sum() / (out.double().norm() * ref.norm()))
    assert cos > 0.999, cos


# --- NaN / Inf: in exactly the rows that see them ---------------------------------------------


def poison_cases(seq):
    """(where, index): a NaN or inf in one element of q, k or v."""
    return [
        ("q", (1, 70, 3), float("nan")),
        ("k", (0, 130, 5), float("nan")),
        ("v", (1, 200, 9), float("inf")),
        ("k", (1, 10, 0), float("-inf")),
        ("v", (0, 66, 3), float("nan")),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sage", [False, True])
def test_nan_and_inf_reach_exactly_the_rows_that_see_them(backend, sage):
    hq, hkv, d, seq = 4, 2, 64, 256
    blocks = seq // 64
    gen = torch.Generator(device=DEV).manual_seed(6)
    clean = [
        torch.randn(h, seq, d, device=DEV, dtype=torch.bfloat16, generator=gen)
        for h in (hq, hkv, hkv)
    ]
    mask = ragged(hkv, blocks, 7).to(DEV)
    mask[:, 1, 2] = False  # query block 1 of every head does not see key block 2 (keys 128..191)
    mask[:, 2, 2] = True
    sizes = reference.uniform_sizes(seq, 64)
    tokens = (
        reference.block_mask_to_token_mask(mask.cpu(), sizes, sizes)
        .to(DEV)
        .repeat_interleave(hq // hkv, 0)
    )

    def attend(q, k, v):
        if not sage:
            return run(plan_variable(mask, hq, d, seq, backend=backend), q, k, v)
        qz = sage_fp8_quantize(q, k, v)
        w = plan_variable(
            mask,
            hq,
            d,
            seq,
            backend=backend,
            dtype=FP8,
            q_scale=qz.q_scale,
            k_scale=qz.k_scale,
            v_scale=qz.v_scale,
        )
        return run(w, qz.q, qz.k, qz.v)

    base_out, base_lse = attend(*clean)
    for name, (h, s, c), value in poison_cases(seq):
        tensors = [t.clone() for t in clean]
        which = "qkv".index(name)
        tensors[which][h, s, c] = value
        out, lse = attend(*tensors)
        if name == "q":
            sees = torch.zeros(hq, seq, dtype=torch.bool, device=DEV)
            sees[h, s] = True
        else:  # query rows of kv head h's group whose blocks include key s
            sees = tokens[:, :, s] & (torch.arange(hq, device=DEV) // (hq // hkv) == h)[:, None]
        bad_rows = ~torch.isfinite(out.float()).all(-1)
        assert not bad_rows[~sees].any(), (
            f"{name}[{h}, {s}, {c}] = {value} reached rows that do not see it"
        )
        if not sage:  # the 16-bit kernels reproduce the others bit for bit
            assert torch.equal(out[~sees], base_out[~sees]), name
        assert bad_rows[sees].all() or name == "k" and value == float("-inf"), (
            f"{name}: rows that see it"
        )
