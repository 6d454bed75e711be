"""plan()'s logit options and block sizes that are not multiples of 64 on the GPU kernels
(block_sparse_fwd_logits) against the fp32 reference.

Fresh random inputs per case, outputs poisoned with NaN before each run, every element
checked: relative L2 error of the output, LSE within 1e-3 (soft cap: 5e-3, its tanh is the
hardware's approximation) and -inf exactly where a row sees no key, whose output is 0.
Both templates run: the wgmma kernel (when built) and the portable mma.sync kernel that
ships for SM100 / SM120.
"""

import zlib

import numpy as np
import pytest
import torch
from sparseforge import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper, reference

pytestmark = pytest.mark.gpu

DEV = "cuda"


def backends():
    from sparseforge._library import manifest
    from sparseforge.arch import arch_for_device

    arch = arch_for_device(0)
    templates = {v["template"] for v in manifest()["variants"] if v["arch"] == arch}
    return ["warp_mma"] + (["sparseforge"] if "sm90_wgmma" in templates else [])


BACKENDS = backends() if torch.cuda.is_available() else ["warp_mma"]
# The templates a backend's plans run: on "warp_mma", options run the cp.async kernel's
# logits variants and plans without any (rotary embedding alone, blocks of whole tiles) the
# TMA kernel.
KERNELS_OF = {"warp_mma": ("warp_mma", "tma_warp_mma"), "sparseforge": ("sm90_wgmma",)}


def seeded(*key) -> torch.Generator:
    gen = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    torch.manual_seed(gen.initial_seed())
    return gen


def random_bsr(M, N, R, C, gen, density=0.5):
    """indptr, indices (on the GPU) and the (M, N) token mask of a random BSR matrix."""
    mb, nb = -(-M // R), N // C
    blocks = torch.rand(mb, nb, generator=gen) < density
    indptr = torch.cat([torch.zeros(1, dtype=torch.int32), blocks.sum(1).cumsum(0).int()])
    indices = blocks.nonzero()[:, 1].int()
    token = blocks.repeat_interleave(R, 0)[:M].repeat_interleave(C, 1)
    return indptr.to(DEV), indices.to(DEV), token


def element_token_mask(indptr, indices, mask, M, N, R, C):
    """(M, N) bool of the per-element masks of stored blocks (written out here, not taken
    from the library)."""
    out = torch.zeros(-(-M // R) * R, N, dtype=torch.bool)
    indptr, indices = indptr.cpu(), indices.cpu()
    for r in range(indptr.numel() - 1):
        for e in range(int(indptr[r]), int(indptr[r + 1])):
            c = int(indices[e])
            out[r * R : (r + 1) * R, c * C : (c + 1) * C] = mask[e]
    return out[:M]


def expected(q, k, v, token, sm_scale, soft_cap=None, alibi=False):
    """The fp32 reference on NHD tensors, token (M, N) shared by the heads."""
    hq = q.shape[1]
    out, lse = reference.attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), token.to(DEV)[None],
        sm_scale, compute_dtype=torch.float32, logits_soft_cap=soft_cap,
        alibi_slopes=reference.alibi_slopes(hq) if alibi else None,
    )  # fmt: skip
    return out.transpose(0, 1), lse.transpose(0, 1)


def check(out, lse, want_out, want_lse, tol=5e-3, lse_tol=1e-3):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten or NaN output"
    err = float((out.float() - want_out).norm() / want_out.norm().clamp_min(1e-30))
    assert err <= tol, f"relative L2 error {err:.2e} > {tol}"
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty), "LSE -inf rows differ"
    assert torch.all(out[empty] == 0), "rows without keys must be 0"
    assert torch.allclose(lse[~empty], want_lse[~empty], atol=lse_tol, rtol=1e-4)


def run_bsr(backend, args, q, k, v, **options):
    wrapper = BlockSparseAttentionWrapper(
        torch.empty(1024, dtype=torch.uint8, device=DEV), backend=backend
    )
    wrapper.plan(*args, q_data_type=q.dtype, **options)
    assert wrapper.backend_in_use in KERNELS_OF[backend]
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEV)
    wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
    return out, lse


def qkv(M, N, hq, hkv, d, dtype, scale=1.0):
    q = torch.randn(M, hq, d, device=DEV, dtype=dtype) * scale
    k = torch.randn(N, hkv, d, device=DEV, dtype=dtype)
    v = torch.randn(N, hkv, d, device=DEV, dtype=dtype)
    return q, k, v


OPTIONS = {
    "causal": dict(causal=True),
    "soft_cap": dict(logits_soft_cap=8.0),
    "alibi": dict(pos_encoding_mode="ALIBI"),
    "causal_soft_cap_alibi": dict(causal=True, logits_soft_cap=20.0, pos_encoding_mode="ALIBI"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("M, N", [(320, 320), (200, 448), (448, 256)])
def test_options(backend, dtype, head_dim, name, M, N):
    gen = seeded(backend, dtype, head_dim, name, M, N)
    options = OPTIONS[name]
    hq, hkv, R, C = 8, 2, 64, 64
    indptr, indices, token = random_bsr(M, N, R, C, gen, density=0.7)
    q, k, v = qkv(M, N, hq, hkv, head_dim, dtype, scale=3.0)  # logits past the soft cap
    out, lse = run_bsr(
        backend, (indptr, indices, M, N, R, C, hq, hkv, head_dim), q, k, v, **options
    )
    if options.get("causal"):
        i, j = torch.arange(M)[:, None], torch.arange(N)[None, :]
        token = token & (j <= i + N - M)
    soft_cap = options.get("logits_soft_cap")
    want = expected(
        q, k, v, token, head_dim**-0.5, soft_cap, options.get("pos_encoding_mode") == "ALIBI"
    )
    check(out, lse, *want, lse_tol=5e-3 if soft_cap else 1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("R, C", [(64, 64), (128, 64), (16, 32), (1, 1), (4, 16), (100, 8)])
@pytest.mark.parametrize("packed", [False, True])
def test_masks_inside_blocks(backend, dtype, R, C, packed):
    gen = seeded(backend, dtype, R, C, packed)
    M, N, hq, hkv, d = 300, 64 * 5, 6, 2, 128
    N = N // C * C
    indptr, indices, token = random_bsr(M, N, R, C, gen, density=0.6)
    mask = torch.rand(indices.shape[0], R, C, generator=gen) < 0.5
    # Query row 1 sees nothing: 0 and LSE -inf.
    block_row = 1 // R
    mask[int(indptr[block_row]) : int(indptr[block_row + 1]), 1 % R] = False
    q, k, v = qkv(M, N, hq, hkv, d, dtype)
    given = (
        dict(
            packed_mask=torch.from_numpy(np.packbits(mask.flatten().numpy(), bitorder="little")).to(
                DEV
            )
        )
        if packed
        else dict(mask=mask.to(DEV))
    )
    args = (indptr, indices, M, N, R, C, hq, hkv, d)
    out, lse = run_bsr(backend, args, q, k, v, **given, causal=True)  # causal: ignored
    want = expected(q, k, v, element_token_mask(indptr, indices, mask, M, N, R, C), d**-0.5)
    check(out, lse, *want)
    assert torch.isinf(lse[1]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("R, C", [(1, 1), (16, 16), (32, 96), (50, 10), (192, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_that_are_not_multiples_of_64(backend, R, C, causal):
    gen = seeded(backend, R, C, causal)
    M, N, hq, hkv, d = 260, 384 // C * C, 4, 4, 64
    indptr, indices, token = random_bsr(M, N, R, C, gen, density=0.4)
    q, k, v = qkv(M, N, hq, hkv, d, torch.float16)
    out, lse = run_bsr(backend, (indptr, indices, M, N, R, C, hq, hkv, d), q, k, v, causal=causal)
    if causal:
        i, j = torch.arange(M)[:, None], torch.arange(N)[None, :]
        token = token & (j <= i + N - M)
    check(out, lse, *expected(q, k, v, token, d**-0.5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_variable_wrapper_small_blocks_per_head_with_options(backend):
    """Per-kv-head block sizes that are not multiples of 64, HND, GQA, causal and soft cap."""
    gen = seeded(backend)
    hkv, group, d, seq = 2, 3, 128, 300
    rows = torch.tensor([[100, 100, 100], [20, 180, 100]])
    cols = torch.tensor([[150, 150], [30, 270]])
    block_mask = torch.rand(hkv, 3, 2, generator=gen) < 0.7
    block_mask[:, :, 0] = True
    q = torch.randn(hkv * group, seq, d, device=DEV, dtype=torch.bfloat16) * 3
    k = torch.randn(hkv, seq, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(hkv, seq, d, device=DEV, dtype=torch.bfloat16)
    wrapper = VariableBlockSparseAttentionWrapper(
        torch.empty(1024, dtype=torch.uint8, device=DEV), backend=backend
    )
    wrapper.plan(
        block_mask.to(DEV), rows.int().to(DEV), cols.int().to(DEV), hkv * group, hkv, d,
        causal=True, logits_soft_cap=10.0, q_data_type=torch.bfloat16,
    )  # fmt: skip
    assert wrapper.backend_in_use in KERNELS_OF[backend]
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEV)
    wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
    token = reference.block_mask_to_token_mask(block_mask, rows, cols)
    token = token & (torch.arange(seq)[None, :] <= torch.arange(seq)[:, None])
    want = reference.attention(
        q, k, v, token.to(DEV), d**-0.5, compute_dtype=torch.float32, logits_soft_cap=10.0
    )
    check(out, lse, *want, lse_tol=5e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_options_extreme_inputs(backend):
    """Huge logits under the soft cap stay finite; a row whose visible keys are all masked
    gives 0 and LSE -inf; Inf in q of a masked-out row does not leak into other rows."""
    M = N = 256
    hq = hkv = 2
    d = 64
    gen = seeded(backend)
    indptr, indices, token = random_bsr(M, N, 64, 64, gen, density=1.0)
    q, k, v = qkv(M, N, hq, hkv, d, torch.bfloat16, scale=1e4)
    out, lse = run_bsr(
        backend, (indptr, indices, M, N, 64, 64, hq, hkv, d), q, k, v, logits_soft_cap=5.0
    )
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check(out, lse, *expected(q, k, v, token, d**-0.5, 5.0), tol=2e-2, lse_tol=2e-2)
    mask = torch.ones(indices.shape[0], 64, 64, dtype=torch.bool)
    mask[:, 5] = False
    out, lse = run_bsr(
        backend, (indptr, indices, M, N, 64, 64, hq, hkv, d), q, k, v, mask=mask.to(DEV)
    )
    assert torch.isinf(lse[5::64]).all() and (out[5::64] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("M, N, causal", [(256, 256, False), (200, 448, True), (448, 320, False)])
def test_rope_llama(backend, dtype, head_dim, M, N, causal):
    """q and k rotated by the rope_llama kernel (in fp32, stored in q's dtype) before the
    attention: checked against the reference's rotation rounded the same way."""
    gen = seeded(backend, dtype, head_dim, M, N, causal)
    hq, hkv, scale, theta = 4, 2, 2.0, 5e5
    indptr, indices, token = random_bsr(M, N, 64, 64, gen, density=0.7)
    q, k, v = qkv(M, N, hq, hkv, head_dim, dtype)
    args = (indptr, indices, M, N, 64, 64, hq, hkv, head_dim)
    options = dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=scale, rope_theta=theta)
    out, lse = run_bsr(backend, args, q, k, v, causal=causal, **options)
    positions_q = torch.arange(M) + N - M
    rq = reference.rope_llama(q.transpose(0, 1), positions_q, scale, theta).to(dtype)
    rk = reference.rope_llama(k.transpose(0, 1), torch.arange(N), scale, theta).to(dtype)
    if causal:
        token = token & (torch.arange(N)[None, :] <= torch.arange(M)[:, None] + N - M)
    want = expected(rq.transpose(0, 1), rk.transpose(0, 1), v, token, head_dim**-0.5)
    check(out, lse, *want, tol=1e-2, lse_tol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_llama_variable_wrapper_hnd(backend):
    gen = seeded(backend)
    heads, seq, d = 2, 320, 128
    block_mask = torch.rand(heads, 5, 5, generator=gen) < 0.6
    sizes = torch.full((heads, 5), 64, dtype=torch.int32)
    q, k, v = (torch.randn(heads, seq, d, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    wrapper = VariableBlockSparseAttentionWrapper(
        torch.empty(1024, dtype=torch.uint8, device=DEV), backend=backend
    )
    wrapper.plan(
        block_mask.to(DEV), sizes.to(DEV), sizes.to(DEV), heads, heads, d,
        pos_encoding_mode="ROPE_LLAMA", q_data_type=torch.bfloat16,
    )  # fmt: skip
    assert wrapper.backend_in_use in KERNELS_OF[backend]
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEV)
    wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
    positions = torch.arange(seq)
    rq = reference.rope_llama(q, positions).to(torch.bfloat16)
    rk = reference.rope_llama(k, positions).to(torch.bfloat16)
    token = reference.block_mask_to_token_mask(block_mask, sizes, sizes)
    want = reference.attention(rq, rk, v, token.to(DEV), d**-0.5, compute_dtype=torch.float32)
    check(out, lse, *want, tol=1e-2, lse_tol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_options_capture_in_a_cuda_graph(backend):
    """run() of a plan with RoPE (two extra launches), causal and a mask replays in a CUDA
    graph with the eager result."""
    gen = seeded(backend)
    M, N, hq, hkv, d = 256, 320, 4, 2, 64
    indptr, indices, _ = random_bsr(M, N, 64, 64, gen, density=0.7)
    mask = (torch.rand(indices.shape[0], 64, 64, generator=gen) < 0.7).to(DEV)
    q, k, v = qkv(M, N, hq, hkv, d, torch.bfloat16)
    wrapper = BlockSparseAttentionWrapper(
        torch.empty(1024, dtype=torch.uint8, device=DEV), backend=backend
    )
    wrapper.plan(
        indptr, indices, M, N, 64, 64, hq, hkv, d, mask=mask, pos_encoding_mode="ROPE_LLAMA",
        logits_soft_cap=20.0, q_data_type=torch.bfloat16,
    )  # fmt: skip
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEV)
    eager = [t.clone() for t in wrapper.run(q, k, v, return_lse=True)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)  # warm-up off the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_block_lens_with_causal_and_alibi(backend):
    """kv_block_lens cut key blocks short; positions are K's indices (padding included),
    as in the reference."""
    gen = seeded(backend)
    M, N, R, C, hq, hkv, d = 256, 384, 64, 128, 4, 2, 128
    indptr, indices, token = random_bsr(M, N, R, C, gen, density=0.8)
    lens = torch.tensor([128, 70, 1], dtype=torch.int32)
    q, k, v = qkv(M, N, hq, hkv, d, torch.float16)
    out, lse = run_bsr(
        backend, (indptr, indices, M, N, R, C, hq, hkv, d), q, k, v,
        kv_block_lens=lens.to(DEV), causal=True, pos_encoding_mode="ALIBI",
    )  # fmt: skip
    valid = torch.arange(N) % C < lens.repeat_interleave(C)
    causal = torch.arange(N)[None, :] <= torch.arange(M)[:, None] + N - M
    check(out, lse, *expected(q, k, v, token & valid & causal, d**-0.5, alibi=True))
