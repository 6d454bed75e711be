"""Bad inputs raise clear errors that name the argument, before any launch; a plan() that
raises leaves the wrapper as it was; outputs may not alias inputs or themselves. On the CPU
(host checks and the reference path); tests/test_gpu_inputs.py has the GPU side."""

import math

import pytest
import torch
from sparseforge import reference
from sparseforge.checks import check_writable, contiguous_operands, overlaps_itself
from sparseforge.sparse import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper

WS = torch.empty(16, dtype=torch.uint8)


def bsr_args(M=256, N=256, R=64, C=64, hq=4, hkv=2, d=64):
    mb = -(-M // R)
    return (
        torch.arange(mb + 1, dtype=torch.int32),
        torch.zeros(mb, dtype=torch.int32),
        M,
        N,
        R,
        C,
        hq,
        hkv,
        d,
    )


@pytest.mark.parametrize(
    "index, value, message",
    [
        (6, 4.0, "num_qo_heads must be a positive int, got 4.0"),
        (7, 2.0, "num_kv_heads must be a positive int, got 2.0"),
        (8, 0, "head_dim must be a positive int, got 0"),
        (8, -64, "head_dim must be a positive int, got -64"),
        (6, True, "num_qo_heads must be a positive int, got True"),
        (2, 256.0, "M must be a positive int"),
        (4, 0, "R must be a positive int"),
    ],
)
def test_sizes_must_be_positive_ints(index, value, message):
    args = list(bsr_args())
    args[index] = value
    with pytest.raises(ValueError, match=message):
        BlockSparseAttentionWrapper(WS, backend="torch").plan(*args)


@pytest.mark.parametrize(
    "sm_scale, error, message",
    [
        (1e40, ValueError, "sm_scale=1e\\+40 must be a finite number"),
        (float("nan"), ValueError, "sm_scale=nan must be a finite number"),
        (float("inf"), ValueError, "sm_scale=inf must be a finite number"),
        (True, TypeError, "sm_scale must be a number, got bool"),
        ("0.1", TypeError, "sm_scale must be a number, got str"),
    ],
)
def test_sm_scale_must_be_a_finite_number(sm_scale, error, message):
    with pytest.raises(error, match=message):
        BlockSparseAttentionWrapper(WS, backend="torch").plan(*bsr_args(), sm_scale=sm_scale)


@pytest.mark.parametrize("sm_scale", [0.0, -0.125])
def test_16_bit_kernels_refuse_non_positive_scales_the_reference_computes_them(sm_scale):
    with pytest.raises(ValueError, match="not supported by the bf16/fp16 kernels"):
        BlockSparseAttentionWrapper(WS, backend="sparseforge").plan(*bsr_args(), sm_scale=sm_scale)
    wrapper = BlockSparseAttentionWrapper(WS, backend="torch")
    wrapper.plan(
        *bsr_args(), sm_scale=sm_scale, q_data_type=torch.float32 if False else torch.float16
    )
    q = torch.randn(256, 4, 64, dtype=torch.float16)
    kv = torch.randn(256, 2, 64, dtype=torch.float16)
    out, lse = wrapper.run(q, kv, kv, return_lse=True)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()


def test_empty_block_maps_are_refused_by_name():
    wrapper = VariableBlockSparseAttentionWrapper(WS, backend="torch")
    sizes = torch.full((2, 2), 64, dtype=torch.int32)
    with pytest.raises(
        ValueError, match="block_mask_map has shape \\(2, 0, 2\\): it needs at least one block row"
    ):
        wrapper.plan(torch.ones(2, 0, 2, dtype=torch.bool), sizes[:, :0], sizes, 2, 2, 64)
    with pytest.raises(ValueError, match="block_mask_map has shape \\(2, 2, 0\\)"):
        wrapper.plan(torch.ones(2, 2, 0, dtype=torch.bool), sizes, sizes[:, :0], 2, 2, 64)


def test_tile_lists_past_32_bit_indexing_raise_before_any_launch():
    """4M tokens in 64 blocks of 64K: 65536 units x 65536 tiles per kv head."""
    seq, block = 2**22, 2**16
    wrapper = BlockSparseAttentionWrapper(WS, backend="sparseforge")
    with pytest.raises(ValueError, match="2\\^31"):
        wrapper.plan(
            None,
            None,
            seq,
            seq,
            block,
            block,
            2,
            2,
            128,
            block_mask=torch.ones(2, 64, 64, dtype=torch.bool),
        )


def test_a_failed_plan_leaves_the_previous_plan():
    wrapper = BlockSparseAttentionWrapper(WS, backend="torch")
    wrapper.plan(*bsr_args(), q_data_type=torch.float16)
    q = torch.randn(256, 4, 64, dtype=torch.float16)
    kv = torch.randn(256, 2, 64, dtype=torch.float16)
    want = wrapper.run(q, kv, kv)
    bad_indices = torch.tensor([0, 1, 2, 9], dtype=torch.int32)
    failures = [
        dict(indices=bad_indices),  # host error bits
        dict(sm_scale=float("nan")),
        dict(q_data_type="int8"),
        dict(head_dim=0),
    ]
    for change in failures:
        args = list(bsr_args())
        if "indices" in change:
            args[1] = change.pop("indices")
        if "head_dim" in change:
            args[8] = change.pop("head_dim")
        with pytest.raises((ValueError, TypeError)):
            wrapper.plan(*args, **change)
        assert torch.equal(wrapper.run(q, kv, kv), want)
        wrapper.check_plan()


def test_overlaps_itself():
    base = torch.empty(4, 8)
    assert (
        not overlaps_itself(base)
        and not overlaps_itself(base.t())
        and not overlaps_itself(base[:, ::2])
    )
    assert overlaps_itself(torch.empty(4, 1).expand(4, 8))
    assert overlaps_itself(base.as_strided((4, 8), (1, 1)))
    assert not overlaps_itself(torch.empty(1, 5).expand(1, 5))


def test_interleaved_regions_of_one_allocation_are_apart():
    """Pages holding two regions (data, then scales) as strided views of one allocation: an
    output in one region does not alias an input in the other; one reaching into the other
    does."""
    pages = torch.zeros(3, 64 * 72, dtype=torch.uint8)
    data, scales = pages[:, : 64 * 64].view(3, 64, 64), pages[:, 64 * 64 :].view(3, 64, 8)
    check_writable("scales", scales, [("data", data)])
    check_writable("data", data, [("scales", scales)])
    with pytest.raises(ValueError, match="overlaps data's"):
        check_writable("scales", pages[:, 64 * 64 - 4 :], [("data", data)])
    with pytest.raises(ValueError, match="overlaps pages's"):
        check_writable("data", data, [("pages", pages)])
    # A 0-dim output over an input's memory: an overlap (not an error about its strides).
    with pytest.raises(ValueError, match="overlaps pages's"):
        check_writable("count", pages[1, 5], [("pages", pages)])


def test_out_and_lse_may_not_alias_inputs_or_themselves():
    wrapper = BlockSparseAttentionWrapper(WS, backend="torch")
    wrapper.plan(*bsr_args(), q_data_type=torch.float16)
    q = torch.randn(256, 4, 64, dtype=torch.float16)
    kv = torch.randn(256, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="out overlaps itself"):
        wrapper.run(q, kv, kv, out=torch.empty(1, 4, 64, dtype=torch.float16).expand(256, -1, -1))
    with pytest.raises(ValueError, match="the memory out spans overlaps q's"):
        wrapper.run(q, kv, kv, out=q)
    with pytest.raises(ValueError, match="the memory lse spans overlaps out's"):
        out = torch.empty(256, 4, 64, dtype=torch.float16)
        wrapper.run(q, kv, kv, out=out, lse=out.view(torch.float32)[:, :4, 0], return_lse=True)
    out = torch.empty(256, 4, 64, dtype=torch.float16)
    assert wrapper.run(q, kv, kv, out=out) is out


def test_quick_operand_check_accepts_only_what_the_full_checks_accept():
    """run()'s quick check (contiguous_operands): plain contiguous operands of the plan's
    shapes and dtypes, outputs apart from the inputs; everything else goes to the full
    checks (CPU tensors here: device index -1)."""
    wrapper = BlockSparseAttentionWrapper(WS, backend="torch")
    wrapper.plan(*bsr_args(), q_data_type=torch.float16)
    plan = wrapper._plan
    q = torch.randn(256, 4, 64, dtype=torch.float16)
    kv = torch.randn(256, 2, 64, dtype=torch.float16)
    out = torch.empty_like(q)
    lse = torch.empty(256, 4)
    assert contiguous_operands(plan, -1, q, kv, kv, out, lse)
    assert contiguous_operands(plan, -1, q, kv, kv, None, None)
    assert not contiguous_operands(plan, 0, q, kv, kv, out, lse)  # another device
    refused = {
        "q transposed view": (q.transpose(0, 1).contiguous().transpose(0, 1), kv, out, lse),
        "k of another dtype": (q, kv.half().bfloat16(), out, lse),
        "k of another shape": (q, kv[:128], out, lse),
        "out of q's memory": (q, kv, q, lse),
        "lse inside out": (q, kv, out, out.view(torch.float32).flatten()[:1024].view(256, 4)),
        "out a Parameter": (q, kv, torch.nn.Parameter(out, requires_grad=False), lse),
        "lse a transposed view": (q, kv, out, torch.empty(4, 256).t()),
    }
    for what, (q_, k_, out_, lse_) in refused.items():
        assert not contiguous_operands(plan, -1, q_, k_, k_, out_, lse_), what


def test_non_contiguous_selections_on_the_reference_path_match_contiguous_ones():
    """The reference path reads block masks of any strides (the GPU tests cover the kernels)."""
    torch.manual_seed(3)
    mask = torch.rand(2, 4, 4) < 0.5
    q = torch.randn(256, 4, 64, dtype=torch.float16)
    kv = torch.randn(256, 2, 64, dtype=torch.float16)
    outs = []
    for view in (
        mask,
        mask.transpose(1, 2).contiguous().transpose(1, 2),
        mask[:, :, :1].expand(-1, -1, 4),
    ):
        wrapper = BlockSparseAttentionWrapper(WS, backend="torch")
        wrapper.plan(
            None, None, 256, 256, 64, 64, 4, 2, 64, block_mask=view, q_data_type=torch.float16
        )
        outs.append(wrapper.run(q, kv, kv))
    assert torch.equal(outs[0], outs[1])
    tokens = reference.block_mask_to_token_mask(
        mask[:, :, :1].expand(-1, -1, 4), torch.full((4,), 64), torch.full((4,), 64)
    )
    want, _ = reference.attention(q.transpose(0, 1), kv.transpose(0, 1), kv.transpose(0, 1), tokens)
    assert torch.allclose(outs[2].float(), want.transpose(0, 1).float(), atol=2e-3)
    assert math.isfinite(float(outs[2].float().abs().sum()))
