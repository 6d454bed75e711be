"""FlashInfer's logit options of plan() (per-element masks, packed masks, causal, soft cap,
RoPE LLaMA, ALiBi, use_fp16_qk_reduction) on the CPU, through the PyTorch reference path:
each against an expectation written here independently of sparseforge.reference; the bit
rows the kernels read (logit_options.py) against the reference's masks; which plans reach a
kernel. tests/test_gpu_logit_options.py runs the kernels against the same expectations."""

import math

import numpy as np
import pytest
import torch
from sparseforge import logit_options, reference, sparsity
from sparseforge.sparse import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper

WS = torch.empty(16, dtype=torch.uint8)


def bsr(M, N, R, C, seed=0, density=0.6):
    """A random BSR structure with at least one block in every row block."""
    gen = torch.Generator().manual_seed(seed)
    mb, nb = -(-M // R), N // C
    blocks = torch.rand(mb, nb, generator=gen) < density
    blocks[torch.arange(mb), torch.randint(0, nb, (mb,), generator=gen)] = True
    indptr = torch.cat([torch.zeros(1, dtype=torch.int32), blocks.sum(1).cumsum(0).int()])
    indices = blocks.nonzero()[:, 1].int()
    token = blocks.repeat_interleave(R, 0)[:M].repeat_interleave(C, 1)
    return indptr, indices, token


def qkv(M, N, hq, hkv, d, seed=1, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(M, hq, d, generator=gen).to(dtype)
    k = torch.randn(N, hkv, d, generator=gen).to(dtype)
    v = torch.randn(N, hkv, d, generator=gen).to(dtype)
    return q, k, v


def expected(q, k, v, allowed, scale, transform=lambda logits: logits):
    """fp64 attention of NHD q / k / v: softmax over the allowed keys of transform(scale
    q.k) (per head, broadcast (Hq, M, N)); rows with no key give 0 and lse -inf."""
    hq, hkv = q.shape[1], k.shape[1]
    qd, kd, vd = (t.double().transpose(0, 1) for t in (q, k, v))
    kd, vd = (t.repeat_interleave(hq // hkv, 0) for t in (kd, vd))
    logits = transform(torch.einsum("hmd,hnd->hmn", qd, kd) * scale)
    logits = logits.masked_fill(~allowed.expand_as(logits), -math.inf)
    lse = torch.logsumexp(logits, -1)
    weights = torch.nan_to_num(torch.exp(logits - lse[..., None]))
    return torch.einsum("hmn,hnd->hmd", weights, vd).transpose(0, 1), lse.transpose(0, 1)


def run_bsr(args, q, k, v, backend="torch", **options):
    wrapper = BlockSparseAttentionWrapper(WS, backend=backend)
    wrapper.plan(*args, q_data_type=q.dtype, **options)
    return wrapper.run(q, k, v, return_lse=True)


def assert_close(got, want):
    out, lse = got
    want_out, want_lse = want
    assert torch.allclose(out.double(), want_out, atol=2e-3, rtol=1e-3)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse.double()[finite], want_lse[finite], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("M, N, R, C", [(128, 128, 64, 64), (100, 192, 16, 32)])
def test_soft_cap(M, N, R, C):
    indptr, indices, token = bsr(M, N, R, C)
    q, k, v = qkv(M, N, 4, 2, 64)
    q = q * 4  # logits well past the cap
    cap, scale = 5.0, 0.125
    got = run_bsr(
        (indptr, indices, M, N, R, C, 4, 2, 64), q, k, v, logits_soft_cap=cap, sm_scale=scale
    )
    assert_close(got, expected(q, k, v, token, scale, lambda x: cap * torch.tanh(x / cap)))


@pytest.mark.parametrize("M, N", [(128, 128), (96, 192), (100, 256)])
def test_causal_is_bottom_right_aligned(M, N):
    indptr, indices, token = bsr(M, N, 32, 64, density=1.0)
    q, k, v = qkv(M, N, 4, 4, 32)
    got = run_bsr((indptr, indices, M, N, 32, 64, 4, 4, 32), q, k, v, causal=True)
    i, j = torch.arange(M)[:, None], torch.arange(N)[None, :]
    assert_close(got, expected(q, k, v, token & (j <= i + N - M), 32**-0.5))


def test_alibi_slopes_and_bias():
    M, N, hq = 64, 96, 12
    indptr, indices, token = bsr(M, N, 32, 32)
    q, k, v = qkv(M, N, hq, 4, 32)
    got = run_bsr((indptr, indices, M, N, 32, 32, hq, 4, 32), q, k, v, pos_encoding_mode="ALIBI")
    # 8 heads: 2^-1 .. 2^-8; the 4 beyond: 2^(-4 j / 8) for j = 1, 3, 5, 7.
    slopes = torch.tensor([2.0**-i for i in range(1, 9)] + [2.0 ** (-j / 2) for j in (1, 3, 5, 7)])
    distance = torch.arange(N)[None, :] - (torch.arange(M)[:, None] + N - M)
    bias = slopes.double()[:, None, None] * distance
    assert_close(got, expected(q, k, v, token, 32**-0.5, lambda x: x + bias))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rope_llama(dtype):
    M, N, d, scale, theta = 48, 80, 64, 2.0, 500.0
    indptr, indices, token = bsr(M, N, 16, 16)
    q, k, v = qkv(M, N, 2, 1, d, dtype=dtype)
    got = run_bsr(
        (indptr, indices, M, N, 16, 16, 2, 1, d), q, k, v, pos_encoding_mode="ROPE_LLAMA",
        rope_scale=scale, rope_theta=theta,
    )  # fmt: skip

    def rotate(x, positions):  # channel i and i + d/2 as one complex number
        z = torch.complex(x.double()[..., : d // 2], x.double()[..., d // 2 :])
        angle = positions.double()[:, None] / scale * theta ** (-torch.arange(d // 2) * 2 / d)
        z = z * torch.polar(torch.ones_like(angle), angle)[:, None, :]
        return torch.cat([z.real, z.imag], -1)

    rq, rk = rotate(q, torch.arange(M) + N - M), rotate(k, torch.arange(N))
    want = expected(rq, rk, v, token, d**-0.5)
    out, lse = got
    assert torch.allclose(out.double(), want[0], atol=1e-2)  # rotated in fp32 there
    assert torch.allclose(lse.double(), want[1], atol=1e-3)


def test_masks_inside_blocks_and_packed_masks():
    M, N, R, C = 70, 128, 16, 32
    indptr, indices, token = bsr(M, N, R, C)
    q, k, v = qkv(M, N, 4, 2, 32)
    gen = torch.Generator().manual_seed(5)
    mask = torch.rand(indices.shape[0], R, C, generator=gen) < 0.5
    mask[:, 3] = False  # row 3 of every block row sees nothing: 0 and lse -inf
    allowed = torch.zeros(-(-M // R) * R, N, dtype=torch.bool)
    for r in range(indptr.numel() - 1):
        for j in range(int(indptr[r]), int(indptr[r + 1])):
            c = int(indices[j])
            allowed[r * R : (r + 1) * R, c * C : (c + 1) * C] = mask[j]
    want = expected(q, k, v, allowed[:M], 32**-0.5)
    args = (indptr, indices, M, N, R, C, 4, 2, 32)
    assert_close(run_bsr(args, q, k, v, mask=mask), want)
    assert_close(run_bsr(args, q, k, v, mask=mask, causal=True), want)  # causal ignored
    packed = torch.from_numpy(np.packbits(mask.flatten().numpy(), bitorder="little"))
    assert_close(run_bsr(args, q, k, v, packed_mask=packed, mask=~mask), want)  # packed wins
    assert not torch.isfinite(run_bsr(args, q, k, v, mask=mask)[1][3]).any()


def test_fp16_qk_reduction_is_accepted_and_changes_nothing():
    indptr, indices, _ = bsr(64, 64, 32, 32)
    q, k, v = qkv(64, 64, 2, 2, 32)
    args = (indptr, indices, 64, 64, 32, 32, 2, 2, 32)
    plain, reduced = run_bsr(args, q, k, v), run_bsr(args, q, k, v, use_fp16_qk_reduction=True)
    assert torch.equal(plain[0], reduced[0]) and torch.equal(plain[1], reduced[1])


@pytest.mark.parametrize(
    "options",
    [
        dict(causal=True),
        dict(logits_soft_cap=30.0),
        dict(pos_encoding_mode="ALIBI"),
        dict(pos_encoding_mode="ROPE_LLAMA"),
        dict(mask=torch.ones(4, 64, 64, dtype=torch.bool)),
        dict(R=16, C=32),
    ],
)
def test_16_bit_options_and_small_blocks_plan_kernels(options):
    """On this CPU the kernel path is reached and stops at its device check; the same
    plans with Sage FP8 have no kernel."""
    sizes = dict(R=options.pop("R", 64), C=options.pop("C", 64))
    nnz = (256 // sizes["R"]) * (256 // sizes["C"])
    args = (torch.arange(0, nnz + 1, 256 // sizes["C"], dtype=torch.int32),)
    args += (torch.arange(nnz, dtype=torch.int32) % (256 // sizes["C"]),)
    args += (256, 256, sizes["R"], sizes["C"], 4, 2, 64)
    if "mask" in options:
        options["mask"] = torch.ones(nnz, sizes["R"], sizes["C"], dtype=torch.bool)
    with pytest.raises(ValueError, match="sparseforge kernels need a CUDA device"):
        BlockSparseAttentionWrapper(WS, backend="sparseforge").plan(*args, **options)
    scales = dict(
        q_scale=torch.ones(1, 4, 256), k_scale=torch.ones(1, 2, 16), v_scale=torch.ones(2, 64)
    )
    with pytest.raises(NotImplementedError, match="backend='sparseforge' has no kernel"):
        BlockSparseAttentionWrapper(WS, backend="sparseforge").plan(
            *args, **options, q_data_type=torch.float8_e4m3fn, **scales
        )


def test_variable_wrapper_takes_the_options_too():
    heads, rows, cols = 2, torch.tensor([[32, 32]] * 2), torch.tensor([[16, 48]] * 2)
    block_mask = torch.tensor([[[True, False], [True, True]], [[True, True], [False, True]]])
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(heads, 64, 32, generator=gen).half() for _ in range(3))
    wrapper = VariableBlockSparseAttentionWrapper(WS, backend="torch")
    wrapper.plan(
        block_mask, rows.int(), cols.int(), heads, heads, 32, causal=True, logits_soft_cap=2.0,
        q_data_type=torch.float16,
    )  # fmt: skip
    out, lse = wrapper.run(q, k, v, return_lse=True)
    token = block_mask.repeat_interleave(32, 1).repeat_interleave(cols[0], 2)
    causal = torch.arange(64)[None, :] <= torch.arange(64)[:, None]
    want = expected(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), token & causal, 32**-0.5,
        lambda x: 2.0 * torch.tanh(x / 2.0),
    )  # fmt: skip
    assert_close((out.transpose(0, 1), lse.transpose(0, 1)), want)


def test_masks_inside_blocks_need_the_bsr_form():
    q2k = torch.zeros(2, 4, 1, dtype=torch.int32)  # direct selections, no indptr / indices
    with pytest.raises(ValueError, match="mask / packed_mask need the BSR form"):
        BlockSparseAttentionWrapper(WS, backend="torch").plan(
            None, None, 256, 256, 64, 64, 2, 2, 64, q2k_indices=q2k,
            mask=torch.ones(4, 64, 64, dtype=torch.bool),
        )  # fmt: skip


@pytest.mark.parametrize("R, C", [(64, 64), (16, 32), (7, 5), (1, 1), (128, 8)])
def test_bsr_mask_bits_match_the_reference_masks(R, C):
    M, N = 7 * R + 3, 9 * C
    indptr, indices, _ = bsr(M, N, R, C, seed=R + C)
    gen = torch.Generator().manual_seed(C)
    mask = torch.rand(indices.shape[0], R, C, generator=gen) < 0.5
    bits = logit_options.bsr_mask_bits(indptr, indices, mask, M, N, R, C)
    assert bits.shape == (1, M, logit_options.words_per_row(N)) and bits.dtype == torch.int32
    want = reference.bsr_element_mask(indptr, indices, mask, M, N, R, C)
    assert torch.equal(logit_options.unpack_mask_bits(bits, N)[0], want)
    # Bits past the sequence's last key are clear.
    assert not logit_options.unpack_mask_bits(bits, bits.shape[-1] * 32)[0, :, N:].any()


def test_bsr_mask_bits_drop_out_of_range_entries():
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32)
    indices = torch.tensor([0, 5, -1], dtype=torch.int32)  # 5 and -1: no such column block
    mask = torch.ones(3, 64, 64, dtype=torch.bool)
    bits = logit_options.bsr_mask_bits(indptr, indices, mask, 128, 128, 64, 64)
    token = logit_options.unpack_mask_bits(bits, 128)[0]
    assert token[:64, :64].all() and not token[:64, 64:].any() and not token[64:].any()


def test_pack_and_unpack_mask_bits_are_inverse():
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(3, 37, 131, generator=gen) < 0.3
    bits = logit_options.pack_mask_bits(mask)
    assert bits.shape == (3, 37, 6)
    assert torch.equal(logit_options.unpack_mask_bits(bits, 131), mask)
    # Key k is bit k % 32 of word k // 32, as the kernels read it.
    k = 77
    one = torch.zeros(1, 1, 131, dtype=torch.bool)
    one[0, 0, k] = True
    assert int(logit_options.pack_mask_bits(one)[0, 0, k // 32]) == 1 << (k % 32)


def test_causal_blocks_drop_only_blocks_above_the_diagonal():
    M, N = 192, 320  # diagonal 128: row block r sees key blocks up to its last row + 128
    selection = sparsity.from_bsr_wrapper(
        indptr=None, indices=None, q2k_indices=None, q2k_num=None, kv_block_lens=None,
        block_mask=torch.ones(2, 3, 5, dtype=torch.bool), M=M, N=N, R=64, C=64,
        num_qo_heads=2, num_kv_heads=2, device=torch.device("cpu"), non_blocking=False,
    )  # fmt: skip
    kept = logit_options.causal_blocks(selection).mask
    i, j = torch.arange(3)[:, None], torch.arange(5)[None, :]
    assert torch.equal(kept, (j * 64 <= i * 64 + 63 + 128).expand(2, -1, -1))


def test_token_tiles_of_a_shared_bsr_structure_build_one_head():
    M, N, R, C = 150, 96, 16, 32
    indptr, indices, token = bsr(M, N, R, C, seed=4)
    selection = sparsity.from_bsr_wrapper(
        indptr=indptr, indices=indices, block_mask=None, q2k_indices=None, q2k_num=None,
        kv_block_lens=None, M=M, N=N, R=R, C=C, num_qo_heads=8, num_kv_heads=4,
        device=torch.device("cpu"), non_blocking=False,
    )  # fmt: skip
    one = logit_options.shared_head(selection)
    assert one.mask.shape[0] == 1
    tiled, bits = logit_options.token_tiles(one, None, False, heads=4, chunk_bytes=5000)
    assert bits.shape == (1, M, logit_options.words_per_row(N))
    assert torch.equal(logit_options.unpack_mask_bits(bits, N)[0], token)
    assert tiled.mask.shape == (4, 3, 2)  # the tile lists are per kv head, all the same
    padded = torch.zeros(3 * 64, 2 * 64, dtype=torch.bool)
    padded[:M, :N] = token
    want = padded.view(3, 64, 2, 64).any(3).any(1)
    assert torch.equal(tiled.mask[0], want) and torch.equal(tiled.mask[3], want)


@pytest.mark.parametrize("causal", [False, True])
def test_token_tiles_of_variable_blocks_per_head(causal):
    """Per-kv-head block sizes (not multiples of 64), causal: the bit rows are the
    reference's token mask."""
    rows = torch.tensor([[30, 50, 70], [100, 25, 25]])
    cols = torch.tensor([[90, 40, 70], [7, 192, 1]])
    block_mask = torch.rand(2, 3, 3, generator=torch.Generator().manual_seed(1)) < 0.6
    selection = sparsity.from_block_mask_map(
        block_mask_map=block_mask, block_row_sz=rows.int(), block_col_sz=cols.int(),
        host_rows=rows, host_cols=cols, num_kv_heads=2, device=torch.device("cpu"),
        non_blocking=False,
    )  # fmt: skip
    tiled, bits = logit_options.token_tiles(selection, None, causal, heads=2, chunk_bytes=9000)
    want = reference.block_mask_to_token_mask(block_mask, rows, cols)
    if causal:
        want &= reference.causal_mask(150, 200)
    assert torch.equal(logit_options.unpack_mask_bits(bits, 200), want)


def test_token_tiles_with_kv_block_lens_and_element_masks():
    M, N, R, C = 70, 120, 10, 40
    indptr, indices, token = bsr(M, N, R, C, seed=2)
    lens = torch.tensor([40, 13, 1], dtype=torch.int32)
    selection = sparsity.from_bsr_wrapper(
        indptr=indptr, indices=indices, block_mask=None, q2k_indices=None, q2k_num=None,
        kv_block_lens=lens, M=M, N=N, R=R, C=C, num_qo_heads=2, num_kv_heads=2,
        device=torch.device("cpu"), non_blocking=False,
    )  # fmt: skip
    mask = torch.rand(indices.shape[0], R, C, generator=torch.Generator().manual_seed(3)) < 0.5
    element = logit_options.bsr_mask_bits(indptr, indices, mask, M, N, R, C)
    one = logit_options.shared_head(selection)
    _, bits = logit_options.token_tiles(one, element, True, heads=2)  # causal: mask wins
    offset = torch.arange(N) % C
    valid = offset < lens.repeat_interleave(C)
    want = token & valid & reference.bsr_element_mask(indptr, indices, mask, M, N, R, C)
    assert torch.equal(logit_options.unpack_mask_bits(bits, N)[0], want)


def test_sage_fp8_with_soft_cap_and_causal_runs_the_reference():
    """Sage FP8 has no logits kernels: under "auto" its options run the reference on the
    dequantized inputs (with a warning)."""
    g = torch.Generator().manual_seed(6)
    M, N, hq, hkv, d = 128, 192, 2, 2, 64
    q8, k8, v8 = ((torch.randn(s, h, d, generator=g) * 60).to(torch.float8_e4m3fn)
                  for s, h in ((M, hq), (N, hkv), (N, hkv)))  # fmt: skip
    q_scale = torch.rand(1, hq, M, generator=g) * 0.02 + 0.001
    k_scale = torch.rand(1, hkv, -(-N // 16), generator=g) * 0.02 + 0.001
    v_scale = torch.rand(hkv, d, generator=g) * 0.02 + 0.001
    indptr, indices, token = bsr(M, N, 64, 64, seed=6)
    wrapper = BlockSparseAttentionWrapper(WS)
    with pytest.warns(UserWarning, match="running the PyTorch reference"):
        wrapper.plan(
            indptr, indices, M, N, 64, 64, hq, hkv, d, q_data_type=torch.float8_e4m3fn,
            q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, logits_soft_cap=3.0,
            causal=True,
        )  # fmt: skip
    out, lse = wrapper.run(q8, k8, v8, return_lse=True)
    q, k, v = reference.sage_dequantize(
        *(t.transpose(0, 1) for t in (q8, k8, v8)), q_scale, k_scale, v_scale
    )
    causal = torch.arange(N)[None, :] <= torch.arange(M)[:, None] + N - M
    want = reference.attention(q, k, v, (token & causal)[None], d**-0.5, logits_soft_cap=3.0)
    torch.testing.assert_close(out.transpose(0, 1).double(), want[0].double(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.transpose(0, 1).double(), want[1].double(), atol=1e-4, rtol=1e-4)
