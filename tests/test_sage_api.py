"""The Sage FP8 API on the CPU: scale checks before any kernel, and the reference path
(backend="torch") on dequantized inputs, in both wrappers."""

import pytest
import torch
from sparseforge import reference
from sparseforge.sparse import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper

WS = torch.empty(16, dtype=torch.uint8)
FP8 = torch.float8_e4m3fn


def sage_inputs(hq, hkv, sq, sk, d, seed=0):
    """e4m3 q/k/v (HND) with random positive scales of the documented shapes."""
    g = torch.Generator().manual_seed(seed)
    q8 = (torch.randn(hq, sq, d, generator=g) * 60).to(FP8)
    k8 = (torch.randn(hkv, sk, d, generator=g) * 60).to(FP8)
    v8 = (torch.randn(hkv, sk, d, generator=g) * 60).to(FP8)
    q_scale = torch.rand(1, hq, sq, generator=g) * 0.02 + 0.001
    k_scale = torch.rand(1, hkv, -(-sk // 16), generator=g) * 0.02 + 0.001
    v_scale = torch.rand(hkv, d, generator=g) * 0.02 + 0.001
    return q8, k8, v8, q_scale, k_scale, v_scale


def test_variable_reference_path_dequantizes():
    hq, hkv, s, d = 4, 2, 200, 64
    q8, k8, v8, qs, ks, vs = sage_inputs(hq, hkv, s, s, d)
    mask = torch.rand(hkv, 4, 4, generator=torch.Generator().manual_seed(1)) < 0.6
    sizes = reference.uniform_sizes(s, 64).to(torch.int32).expand(hkv, -1).contiguous()
    w = VariableBlockSparseAttentionWrapper(WS, backend="torch")
    w.plan(mask, sizes, sizes, hq, hkv, d, q_data_type=FP8, q_scale=qs, k_scale=ks, v_scale=vs)
    out, lse = w.run(q8, k8, v8, return_lse=True)
    assert out.dtype == torch.bfloat16
    q, k, v = reference.sage_dequantize(q8, k8, v8, qs, ks, vs)
    tokens = reference.block_mask_to_token_mask(mask, sizes, sizes)
    o_ref, lse_ref = reference.attention(q, k, v, tokens)
    torch.testing.assert_close(out.double(), o_ref.double(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), lse_ref.double(), atol=1e-4, rtol=1e-4)


def test_bsr_reference_path_dequantizes():
    hq = hkv = 2
    m, n, d = 128, 192, 64
    q8, k8, v8, qs, ks, vs = sage_inputs(hq, hkv, m, n, d, seed=3)
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32)
    indices = torch.tensor([0, 2, 1], dtype=torch.int32)
    w = BlockSparseAttentionWrapper(WS, backend="torch")
    w.plan(
        indptr,
        indices,
        m,
        n,
        64,
        64,
        hq,
        hkv,
        d,
        q_data_type=FP8,
        q_scale=qs,
        k_scale=ks,
        v_scale=vs,
    )
    out = w.run(q8.transpose(0, 1), k8.transpose(0, 1), v8.transpose(0, 1))
    q, k, v = reference.sage_dequantize(q8, k8, v8, qs, ks, vs)
    block = reference.bsr_to_block_mask(indptr, indices, 2, 3)[None]
    tokens = reference.block_mask_to_token_mask(block, torch.full((2,), 64), torch.full((3,), 64))
    o_ref, _ = reference.attention(q, k, v, tokens)
    torch.testing.assert_close(out.transpose(0, 1).double(), o_ref.double(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q_scale=None), "missing q_scale"),
        (dict(k_scale=None, v_scale=None), "missing k_scale, v_scale"),
        (
            dict(q_scale=torch.ones(1, 4, 199)),
            "q_scale has shape (1, 4, 199), expected (1, 4, 200)",
        ),
        (dict(k_scale=torch.ones(1, 4, 13)), "k_scale has shape (1, 4, 13), expected (1, 2, 13)"),
        (dict(v_scale=torch.ones(2, 64, dtype=torch.float16)), "v_scale has dtype torch.float16"),
        (dict(kv_data_type=torch.bfloat16), "kv_data_type"),
    ],
)
def test_sage_plan_checks_scales(change, message):
    hq, hkv, s, d = 4, 2, 200, 64
    _, _, _, qs, ks, vs = sage_inputs(hq, hkv, s, s, d)
    kwargs = dict(q_data_type=FP8, q_scale=qs, k_scale=ks, v_scale=vs)
    kwargs.update(change)
    sizes = reference.uniform_sizes(s, 64).to(torch.int32).expand(hkv, -1).contiguous()
    mask = torch.ones(hkv, 4, 4, dtype=torch.bool)
    w = VariableBlockSparseAttentionWrapper(WS, backend="torch")
    with pytest.raises((ValueError, NotImplementedError)) as info:
        w.plan(mask, sizes, sizes, hq, hkv, d, **kwargs)
    assert message in str(info.value)


def test_sage_run_rejects_16_bit_inputs():
    hq, hkv, s, d = 2, 2, 64, 64
    q8, k8, v8, qs, ks, vs = sage_inputs(hq, hkv, s, s, d)
    sizes = torch.full((hkv, 1), 64, dtype=torch.int32)
    w = VariableBlockSparseAttentionWrapper(WS, backend="torch")
    w.plan(
        torch.ones(hkv, 1, 1, dtype=torch.bool),
        sizes,
        sizes,
        hq,
        hkv,
        d,
        q_data_type=FP8,
        q_scale=qs,
        k_scale=ks,
        v_scale=vs,
    )
    with pytest.raises(
        ValueError, match="q has dtype torch.bfloat16, expected torch.float8_e4m3fn"
    ):
        w.run(q8.to(torch.bfloat16), k8, v8)
    with pytest.raises(
        ValueError, match="out has dtype torch.float8_e4m3fn, expected torch.bfloat16"
    ):
        w.run(q8, k8, v8, out=torch.empty(hq, s, d, dtype=FP8))


def test_bsr_sage_output_dtype_is_bf16():
    w = BlockSparseAttentionWrapper(WS, backend="torch")
    _, _, _, qs, ks, vs = sage_inputs(2, 2, 64, 64, 64)
    with pytest.raises(NotImplementedError, match="written in torch.bfloat16"):
        w.plan(
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32),
            64,
            64,
            64,
            64,
            2,
            2,
            64,
            q_data_type=FP8,
            o_data_type=torch.float16,
            q_scale=qs,
            k_scale=ks,
            v_scale=vs,
        )


def test_k_heads_in_whole_tiles_kept_or_copied():
    """sm90_sage_fp8 reads every head's keys through one view: k passes as is when heads lie
    whole 64-key tiles apart and the last head's padding is in its storage; otherwise run()
    copies it into such a buffer (zero padding), with the same values."""
    from sparseforge.families.sage_fp8_fwd import heads_in_whole_tiles

    hkv, sk, d = 3, 300, 64
    buf = (torch.randn(hkv, 320, d) * 60).to(FP8)
    padded = buf[:, :sk].transpose(0, 1)  # (Sk, Hkv, D) as the kernel ABI takes it
    assert heads_in_whole_tiles(padded) is padded
    short = torch.empty(
        (hkv - 1) * 320 * d + sk * d, dtype=FP8
    )  # last head's padding not allocated
    short = short.as_strided((sk, hkv, d), (d, 320 * d, 1)).copy_(padded)
    for k in (
        buf[:, :sk].contiguous().transpose(0, 1),
        buf[:, :sk].transpose(0, 1).contiguous(),
        short,
    ):
        got = heads_in_whole_tiles(k)
        assert got.data_ptr() != k.data_ptr() and torch.equal(
            got.view(torch.uint8), k.view(torch.uint8)
        )
        assert got.stride() == (d, 320 * d, 1)
        assert (
            not got.transpose(0, 1)
            .as_strided((hkv, 320, d), (320 * d, d, 1))[:, sk:]
            .view(torch.uint8)
            .any()
        )
