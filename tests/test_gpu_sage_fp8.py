"""Sage FP8 block-sparse attention on the GPU.

Kernel checks compare with the fp32 reference on the *dequantized* e4m3 inputs, so the only
error left is the e4m3 rounding of P (relative L2 <= 0.03, cosine >= 0.999; LSE within
5e-3 + 2e-3 |LSE|: e4m3 wgmma sums Q K^T with fewer than fp32's mantissa bits, 7e-4 of the
LSE measured; -inf exactly where a row selects nothing). Accuracy checks compare with the
fp32 reference on the unquantized bf16 inputs: relative L2 <= 0.052 and cosine >= 0.998.
The target is <= 0.05; e4m3 q/k/v/P at these scale granularities give 0.0505-0.051 on N(0,1)
inputs (Q K^T rounding 0.038, V 0.026, P 0.020, in quadrature; CONTRIBUTING.md). Outputs are
poisoned with NaN before every run. Both templates run on sm_90a: the e4m3 wgmma kernel and
the portable e4m3 mma.sync kernel that ships for SM100/SM120 (emulated on SM90).
"""

import pytest
import sparseforge
import torch
from sparseforge import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper, reference
from sparseforge.check import ragged_mask

pytestmark = pytest.mark.gpu

DEV = "cuda"
FP8 = torch.float8_e4m3fn
BACKENDS = ["sparseforge", "warp_mma"]


def rel_l2(out, ref):
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def cosine(out, ref):
    out = out.float().flatten()
    ref = ref.flatten()
    return float(out @ ref / (out.norm() * ref.norm()).clamp_min(1e-30))


def check(out, lse, ref_out, ref_lse, tol=0.03, min_cos=0.999):
    assert out.dtype == torch.bfloat16
    assert not torch.isnan(out).any(), "unwritten or NaN output"
    assert not torch.isnan(lse).any(), "unwritten or NaN lse"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "LSE -inf rows differ"
    assert torch.all(out[empty] == 0), "rows without keys must be 0"
    err, cos = rel_l2(out, ref_out), cosine(out, ref_out)
    assert err <= tol and cos >= min_cos, (
        f"relative L2 error {err:.3e} (max {tol}), cosine {cos:.5f} (min {min_cos})"
    )
    if (~empty).any():
        torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=5e-3, rtol=2e-3)


def bf16_inputs(hq, hkv, sq, sk, d, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(hq, sq, d, device=DEV, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(hkv, sk, d, device=DEV, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(hkv, sk, d, device=DEV, dtype=torch.bfloat16, generator=gen)
    return q, k, v


def plan_variable(mask, sizes_q, sizes_k, hq, hkv, d, qz, backend):
    w = VariableBlockSparseAttentionWrapper(torch.empty(1, device=DEV), backend=backend)
    w.plan(
        mask.to(DEV),
        sizes_q.to(DEV),
        sizes_k.to(DEV),
        hq,
        hkv,
        d,
        q_data_type=FP8,
        q_scale=qz.q_scale,
        k_scale=qz.k_scale,
        v_scale=qz.v_scale,
    )
    return w


def run_poisoned(w, q, k, v, out_shape):
    out = torch.full(out_shape, float("nan"), device=DEV, dtype=torch.bfloat16)
    lse = torch.full(out_shape[:-1], float("nan"), device=DEV)
    return w.run(q, k, v, out=out, lse=lse, return_lse=True)


def dequantized_reference(qz, token_mask):
    q, k, v = reference.sage_dequantize(qz.q, qz.k, qz.v, qz.q_scale, qz.k_scale, qz.v_scale)
    return reference.attention(q, k, v, token_mask.to(DEV), compute_dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "hq, hkv, d, seq, block",
    [
        (4, 4, 128, 1000, 64),
        (8, 4, 128, 777, 64),
        (8, 2, 64, 640, 128),
        (8, 1, 128, 300, 128),
        (3, 3, 64, 64, 64),
    ],
)
def test_variable_wrapper_matches_dequantized_reference(backend, hq, hkv, d, seq, block):
    q, k, v = bf16_inputs(hq, hkv, seq, seq, d, seed=seq + d)
    # Keys of very different magnitude per 16-token group make every k_scale matter.
    k = k * (1.0 + 7.0 * torch.rand(hkv, -(-seq // 16), 1, device=DEV)).repeat_interleave(16, 1)[
        :, :seq
    ].to(k.dtype)
    qz = sparseforge.sage_fp8_quantize(q, k, v)
    sizes = reference.uniform_sizes(seq, block).to(torch.int32).expand(hkv, -1).contiguous()
    nb = sizes.shape[1]
    mask = ragged_mask(hkv, nb, nb, seed=seq)
    w = plan_variable(mask, sizes, sizes, hq, hkv, d, qz, backend)
    assert w.backend_in_use == ("tma_warp_mma_fp8" if backend == "warp_mma" else "sm90_sage_fp8")
    out, lse = run_poisoned(w, qz.q, qz.k, qz.v, (hq, seq, d))
    check(
        out, lse, *dequantized_reference(qz, reference.block_mask_to_token_mask(mask, sizes, sizes))
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sm_scale", [-0.125, 0.02])
def test_sm_scale_of_either_sign(backend, sm_scale):
    """A negative scale takes the softmax's in-place scaling path (the row max of c * s is
    no longer c times the max of s); a short last block takes it too."""
    hq, hkv, d, seq, block = 4, 2, 128, 1000, 64
    q, k, v = bf16_inputs(hq, hkv, seq, seq, d, seed=11)
    qz = sparseforge.sage_fp8_quantize(q, k, v)
    sizes = reference.uniform_sizes(seq, block).to(torch.int32).expand(hkv, -1).contiguous()
    nb = sizes.shape[1]
    mask = ragged_mask(hkv, nb, nb, seed=5)
    w = VariableBlockSparseAttentionWrapper(torch.empty(1, device=DEV), backend=backend)
    w.plan(
        mask.to(DEV),
        sizes.to(DEV),
        sizes.to(DEV),
        hq,
        hkv,
        d,
        q_data_type=FP8,
        sm_scale=sm_scale,
        q_scale=qz.q_scale,
        k_scale=qz.k_scale,
        v_scale=qz.v_scale,
    )
    out, lse = run_poisoned(w, qz.q, qz.k, qz.v, (hq, seq, d))
    dq, dk, dv = reference.sage_dequantize(qz.q, qz.k, qz.v, qz.q_scale, qz.k_scale, qz.v_scale)
    token_mask = reference.block_mask_to_token_mask(mask, sizes, sizes).to(DEV)
    check(
        out,
        lse,
        *reference.attention(
            dq, dk, dv, token_mask, sm_scale=sm_scale, compute_dtype=torch.float32
        ),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [64, 128])
def test_accuracy_against_unquantized_inputs(backend, d):
    """N(0,1) inputs (W1's pattern, smaller) against the unquantized fp32 reference; the
    quantizer's scale search (default) must beat the amax scales end to end."""
    hq, hkv, seq, block, topk = 4, 2, 4096, 64, 16
    q, k, v = bf16_inputs(hq, hkv, seq, seq, d, seed=7)
    nb = seq // block
    rank = (
        torch.rand(hkv, nb, nb, generator=torch.Generator().manual_seed(3)).argsort(-1).argsort(-1)
    )
    mask = rank < topk
    sizes = torch.full((hkv, nb), block, dtype=torch.int32)
    ref, _ = reference.attention(
        q,
        k,
        v,
        reference.block_mask_to_token_mask(mask, sizes, sizes).to(DEV),
        compute_dtype=torch.float32,
    )
    errors = {}
    for scale_search in (True, False):
        qz = sparseforge.sage_fp8_quantize(q, k, v, scale_search=scale_search)
        w = plan_variable(mask, sizes, sizes, hq, hkv, d, qz, backend)
        out, lse = run_poisoned(w, qz.q, qz.k, qz.v, (hq, seq, d))
        err, cos = rel_l2(out, ref), cosine(out, ref)
        print(
            f"Sage FP8 d{d} {backend} scale_search={scale_search}: "
            f"rel L2 {err:.4f}, cosine {cos:.5f}"
        )
        # The accuracy target (0.05) with the search; the amax scales' e4m3 floor is ~0.0505
        # (H200 at 740a08a: 0.0480 / 0.0484 with the search, 0.0507 / 0.0505 without, d 64 / 128).
        bound = 0.050 if scale_search else 0.052
        assert err <= bound and cos >= 0.998, f"relative L2 {err:.4f}, cosine {cos:.5f}"
        errors[scale_search] = err
    assert errors[True] < errors[False] - 0.0005, errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_bsr_wrapper_nhd_kv_block_lens_and_v_layouts(backend):
    """NHD views, a short last block and kv_block_lens cutting blocks short; NaN bytes in K
    and V past each block's valid keys must not leak (sm90_sage_fp8 loads keys permuted
    within each 16 and masks them by key); k and v in any layout give the same output."""
    hq, hkv, d, m, n, block = 4, 2, 128, 320, 448, 64
    q, k, v = bf16_inputs(hq, hkv, m, n, d, seed=11)
    qz = sparseforge.sage_fp8_quantize(q, k, v)
    mb, nb = -(-m // block), n // block
    mask = ragged_mask(1, mb, nb, seed=5)[0]
    rows, cols = mask.nonzero(as_tuple=True)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), mask.sum(1).cumsum(0)]).to(torch.int32)
    lens = torch.randint(1, block + 1, (nb,), generator=torch.Generator().manual_seed(2)).to(
        torch.int32
    )
    v8 = qz.v.clone()  # same layout as sage_fp8_quantize's (unit stride on the keys)
    k8 = qz.k.clone()  # contiguous HND; n is whole 64-key tiles, so used as is
    assert v8.stride(1) == 1 and k8.is_contiguous() and n % 64 == 0
    for b in range(nb):  # NaN (0x7f) in the keys each block does not use
        v8.view(torch.uint8)[:, b * block + int(lens[b]) : (b + 1) * block] = 0x7F
        k8.view(torch.uint8)[:, b * block + int(lens[b]) : (b + 1) * block] = 0x7F
    w = BlockSparseAttentionWrapper(torch.empty(1, device=DEV), backend=backend)
    w.plan(
        indptr.to(DEV),
        cols.to(torch.int32).to(DEV),
        m,
        n,
        block,
        block,
        hq,
        hkv,
        d,
        kv_block_lens=lens.to(DEV),
        q_data_type=FP8,
        q_scale=qz.q_scale,
        k_scale=qz.k_scale,
        v_scale=qz.v_scale,
    )
    out, lse = run_poisoned(
        w, qz.q.transpose(0, 1), k8.transpose(0, 1), v8.transpose(0, 1), (m, hq, d)
    )
    tokens = reference.block_mask_to_token_mask(
        mask[None], reference.uniform_sizes(m, block), torch.full((nb,), block), lens
    )
    ref_out, ref_lse = dequantized_reference(qz, tokens)
    check(out.transpose(0, 1), lse.t(), ref_out, ref_lse)
    # k and v as plain contiguous NHD tensors: copied by run() into new buffers (heads a whole
    # number of tiles apart; keys contiguous).
    nhd = (qz.q.transpose(0, 1), k8.transpose(0, 1).contiguous(), v8.transpose(0, 1).contiguous())
    out2, _ = run_poisoned(w, *nhd, (m, hq, d))
    assert torch.equal(out, out2)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(
    "hq, hkv, seq, block", [(8, 2, 1000, 64), (4, 1, 300, 128), (3, 3, 700, 256)]
)
def test_groups_of_units_match_the_reference(monkeypatch, d, hq, hkv, seq, block):
    """Units that list the same tiles (GQA 4, the four 64-row units of a 256-row block) run
    one a CTA on sm_90a (the sm90_sage_fp8 variants are built for one unit a CTA only) and
    match the dequantized reference."""
    q, k, v = bf16_inputs(hq, hkv, seq, seq, d, seed=seq + hq)
    qz = sparseforge.sage_fp8_quantize(q, k, v)
    sizes = reference.uniform_sizes(seq, block).to(torch.int32).expand(hkv, -1).contiguous()
    nb = sizes.shape[1]
    mask = ragged_mask(hkv, nb, nb, seed=seq)
    monkeypatch.setenv("SPARSEFORGE_VARIANT", f"sage_fp8_fwd__sm90_sage_fp8__e4m3_d{d}__sm_90a")
    w = plan_variable(mask, sizes, sizes, hq, hkv, d, qz, "sparseforge")
    out, lse = run_poisoned(w, qz.q, qz.k, qz.v, (hq, seq, d))
    check(
        out,
        lse,
        *dequantized_reference(qz, reference.block_mask_to_token_mask(mask, sizes, sizes)),
    )


@pytest.mark.parametrize("d", [64, 128])
def test_tma_and_cp_async_mma_sync_kernels_match_the_reference(monkeypatch, d):
    """The two e4m3 mma.sync templates (SM120's): the TMA one, which backend="warp_mma"
    runs, and the cp.async one it gives way to (forced), on ragged blocks with short tiles:
    both match the dequantized reference."""
    hq, hkv, seq, block = 4, 2, 700, 64
    q, k, v = bf16_inputs(hq, hkv, seq, seq, d, seed=d + 5)
    qz = sparseforge.sage_fp8_quantize(q, k, v)
    sizes = reference.uniform_sizes(seq, block).to(torch.int32).expand(hkv, -1).contiguous()
    nb = sizes.shape[1]
    mask = ragged_mask(hkv, nb, nb, seed=d)
    for template in ("tma_warp_mma_fp8", "warp_mma_fp8"):
        monkeypatch.setenv("SPARSEFORGE_VARIANT", f"sage_fp8_fwd__{template}__e4m3_d{d}__sm_90a")
        w = plan_variable(mask, sizes, sizes, hq, hkv, d, qz, "sparseforge")
        assert w.backend_in_use == template
        out, lse = run_poisoned(w, qz.q, qz.k, qz.v, (hq, seq, d))
        tokens = reference.block_mask_to_token_mask(mask, sizes, sizes)
        check(out, lse, *dequantized_reference(qz, tokens))


def test_cuda_graph_replay_matches_eager():
    hq, hkv, d, seq = 4, 1, 128, 512
    q, k, v = bf16_inputs(hq, hkv, seq, seq, d, seed=4)
    qz = sparseforge.sage_fp8_quantize(q, k, v)
    sizes = torch.full((hkv, seq // 64), 64, dtype=torch.int32)
    w = plan_variable(
        ragged_mask(hkv, seq // 64, seq // 64, 9), sizes, sizes, hq, hkv, d, qz, "auto"
    )
    eager = w.run(qz.q, qz.k, qz.v)
    out = torch.full_like(eager, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(qz.q, qz.k, qz.v, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_run_rejects_bf16_and_misaligned_inputs():
    hq = hkv = 2
    d, seq = 64, 128
    q, k, v = bf16_inputs(hq, hkv, seq, seq, d, seed=1)
    qz = sparseforge.sage_fp8_quantize(q, k, v)
    sizes = torch.full((hkv, 2), 64, dtype=torch.int32)
    w = plan_variable(torch.ones(hkv, 2, 2, dtype=torch.bool), sizes, sizes, hq, hkv, d, qz, "auto")
    with pytest.raises(ValueError, match="q has dtype torch.bfloat16"):
        w.run(q, qz.k, qz.v)
    with pytest.raises(ValueError, match="multiples of 16 elements"):
        w.run(torch.empty(hq, seq, d + 8, device=DEV, dtype=FP8)[..., :d], qz.k, qz.v)
