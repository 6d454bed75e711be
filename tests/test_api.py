"""The FlashInfer-compatible API on the CPU: every unsupported option and bad input raises a
clear error before any kernel; block sizes that are not multiples of 64 run the reference."""

import pytest
import sparseforge
import torch
from sparseforge import reference
from sparseforge.sparse import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper

WS = torch.empty(16, dtype=torch.uint8)


def bsr_args(M=256, N=256, R=64, C=64, hq=4, hkv=2, d=128):
    mb = -(-M // R)
    indptr = torch.arange(mb + 1, dtype=torch.int32)
    indices = torch.zeros(mb, dtype=torch.int32)
    return (indptr, indices, M, N, R, C, hq, hkv, d)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(causal=1), "causal must be a bool"),
        (dict(pos_encoding_mode="ROPE"), "pos_encoding_mode='ROPE' is not one of"),
        (dict(logits_soft_cap=-1.0), "logits_soft_cap=-1.0 must be a finite number >= 0"),
        (dict(logits_soft_cap="30"), "logits_soft_cap must be a number"),
        (dict(use_fp16_qk_reduction=None), "use_fp16_qk_reduction must be a bool"),
        (dict(rope_theta=0.0), "rope_theta=0.0 must be a finite number > 0"),
        (dict(rope_scale=float("inf")), "rope_scale=inf must be a finite number > 0"),
        (dict(mask=torch.ones(3, 64, 64, dtype=torch.bool)), "mask has shape (3, 64, 64)"),
        (dict(mask=torch.ones(4, 64, 64)), "mask has dtype torch.float32"),
        (dict(packed_mask=torch.ones(8, dtype=torch.uint8)), "packed_mask has shape (8,)"),
        (dict(kv_splits=4), "kv_splits=4 is not supported"),
        (dict(use_clc=True), "use_clc=True"),
        (
            dict(q_data_type=torch.float8_e4m3fn),
            "needs q_scale, k_scale and v_scale; missing q_scale, k_scale, v_scale",
        ),
        (dict(q_scale=torch.ones(1)), "q_scale are for q_data_type=torch.float8_e4m3fn"),
        (dict(q_data_type="int8"), "q_data_type='int8' is not a dtype"),
        (dict(q_data_type=torch.float16, o_data_type=torch.bfloat16), "o_data_type"),
        (dict(q_data_type=torch.float16, kv_data_type=torch.bfloat16), "kv_data_type"),
    ],
)
def test_bsr_plan_rejects_unsupported_options(kwargs, message):
    wrapper = BlockSparseAttentionWrapper(WS)
    with pytest.raises((NotImplementedError, ValueError, TypeError)) as info:
        wrapper.plan(*bsr_args(), **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hq=3, hkv=2), "num_qo_heads 3 must be a positive multiple of num_kv_heads 2"),
        (dict(N=250), "N (250) must be divisible by C (64)"),
    ],
)
def test_bsr_plan_rejects_bad_sizes(change, message):
    wrapper = BlockSparseAttentionWrapper(WS)
    with pytest.raises(ValueError) as info:
        wrapper.plan(*bsr_args(**change))
    assert message in str(info.value)


def test_bsr_plan_rejects_bad_indices():
    wrapper = BlockSparseAttentionWrapper(WS)
    indptr, indices, *rest = bsr_args()
    with pytest.raises(
        ValueError, match=r"invalid indptr / indices: a block index is out of range \[0, 4\)"
    ):
        wrapper.plan(indptr, torch.tensor([0, 1, 2, 4], dtype=torch.int32), *rest)
    with pytest.raises(ValueError, match="invalid indptr / indices: .*indptr must start at 0"):
        wrapper.plan(torch.tensor([0, 2, 1, 3, 4], dtype=torch.int32), indices, *rest)
    with pytest.raises(ValueError, match=r"indptr has shape \(3,\), expected \(5,\)"):
        wrapper.plan(indptr[:3], indices, *rest)
    with pytest.raises(ValueError, match="indices has dtype torch.int64, expected torch.int32"):
        wrapper.plan(indptr, indices.long(), *rest)


def test_bsr_plan_rejects_bad_block_mask_and_selections():
    wrapper = BlockSparseAttentionWrapper(WS)
    _, _, *rest = bsr_args()
    with pytest.raises(ValueError, match=r"block_mask must be bool of shape \(4 or 2, 4, 4\)"):
        wrapper.plan(None, None, *rest, block_mask=torch.ones(4, 4, 5, dtype=torch.bool))
    sel = torch.zeros(4, 4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="mutually exclusive"):
        wrapper.plan(
            None, None, *rest, block_mask=torch.ones(4, 4, 4, dtype=torch.bool), q2k_indices=sel
        )
    with pytest.raises(
        ValueError, match=r"invalid q2k_indices / q2k_num: a block index is out of range \[0, 4\)"
    ):
        wrapper.plan(None, None, *rest, q2k_indices=sel + 9)
    with pytest.raises(ValueError, match=r"q2k_num values must lie in \[0, topk\]"):
        wrapper.plan(
            None, None, *rest, q2k_indices=sel, q2k_num=torch.full((4, 4), 3, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match=r"kv_block_lens values must lie in \[1, C\]"):
        wrapper.plan(*bsr_args(), kv_block_lens=torch.tensor([64, 0, 1, 1], dtype=torch.int32))


def test_duplicate_blocks_in_a_row_are_rejected():
    wrapper = BlockSparseAttentionWrapper(WS)
    indptr, indices, *rest = bsr_args()
    with pytest.raises(ValueError, match="a row lists the same block more than once"):
        wrapper.plan(
            torch.tensor([0, 2, 3, 4, 5], dtype=torch.int32),
            torch.tensor([1, 1, 0, 0, 0], dtype=torch.int32),
            *rest,
        )
    sel = torch.tensor([[[1, 1]]], dtype=torch.int32).expand(4, 4, 2).contiguous()
    with pytest.raises(ValueError, match="a row lists the same block more than once"):
        wrapper.plan(None, None, *rest, q2k_indices=sel)


def test_query_heads_of_a_group_must_select_alike():
    """GQA selections are per kv head: per-query-head rows that differ within a group raise
    (the first head would otherwise select for all, silently); the same set in another order,
    or entries past q2k_num, do not."""
    wrapper = BlockSparseAttentionWrapper(WS, backend="torch")  # CPU: the checks run on the host
    _, _, *rest = bsr_args()  # 4 query heads, 2 kv heads
    mask = torch.ones(4, 4, 4, dtype=torch.bool)
    wrapper.plan(None, None, *rest, block_mask=mask)
    mask[3, 1, 2] = False
    with pytest.raises(ValueError, match="the query heads of a GQA group select different blocks"):
        wrapper.plan(None, None, *rest, block_mask=mask)
    sel = torch.tensor([0, 1, 2], dtype=torch.int32).repeat(4, 4, 1)
    sel[1, 2] = torch.tensor([2, 0, 1], dtype=torch.int32)  # same blocks, another order
    num = torch.full((4, 4), 3, dtype=torch.int32)
    wrapper.plan(None, None, *rest, q2k_indices=sel, q2k_num=num)
    num[:, 0] = 2
    sel[1, 0, 2] = 3  # past q2k_num: unused
    wrapper.plan(None, None, *rest, q2k_indices=sel, q2k_num=num)
    sel[3, 3, 0] = 3
    with pytest.raises(ValueError, match="the query heads of a GQA group select different blocks"):
        wrapper.plan(None, None, *rest, q2k_indices=sel, q2k_num=num)


def test_kernel_path_needs_cuda():
    wrapper = BlockSparseAttentionWrapper(WS)
    with pytest.raises(ValueError, match="sparseforge kernels need a CUDA device"):
        wrapper.plan(*bsr_args())


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend='xla' is not one of"):
        BlockSparseAttentionWrapper(WS, backend="xla")


def test_run_before_plan():
    with pytest.raises(RuntimeError, match=r"plan\(\) must be called before run\(\)"):
        BlockSparseAttentionWrapper(WS).run(torch.zeros(1), torch.zeros(1), torch.zeros(1))


def test_spec_example_runs_through_the_reference():
    """The 3x3 example of the FlashInfer docs (R = C = 1), on the CPU (on a GPU its 1x1
    blocks run on the kernels: tests/test_gpu_logit_options.py)."""
    torch.manual_seed(0)
    num_qo_heads, num_kv_heads, head_dim = 32, 8, 128
    wrapper = BlockSparseAttentionWrapper(WS, backend="torch")
    indptr = torch.tensor([0, 1, 3, 5], dtype=torch.int32)
    indices = torch.tensor([2, 0, 2, 1, 2], dtype=torch.int32)
    wrapper.plan(indptr, indices, 3, 3, 1, 1, num_qo_heads, num_kv_heads, head_dim)
    assert wrapper.backend_in_use == "torch"
    q = torch.randn(3, num_qo_heads, head_dim, dtype=torch.float16)
    k = torch.randn(3, num_kv_heads, head_dim, dtype=torch.float16)
    v = torch.randn(3, num_kv_heads, head_dim, dtype=torch.float16)
    o, lse = wrapper.run(q, k, v, return_lse=True)
    mask = torch.tensor([[0, 0, 1], [1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    want, want_lse = reference.attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        mask[None].expand(num_kv_heads, -1, -1),
    )
    assert torch.allclose(o.float(), want.transpose(0, 1).float(), atol=2e-3)
    assert torch.allclose(lse, want_lse.transpose(0, 1).float(), atol=1e-4)


def test_run_rejects_bad_tensors():
    wrapper = BlockSparseAttentionWrapper(WS, backend="torch")
    wrapper.plan(*bsr_args(), q_data_type=torch.bfloat16)
    q = torch.randn(256, 4, 128, dtype=torch.bfloat16)
    kv = torch.randn(256, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"q has shape \(256, 4, 64\), expected \(256, 4, 128\)"):
        wrapper.run(q[..., :64], kv, kv)
    with pytest.raises(ValueError, match="k has dtype torch.float16, expected torch.bfloat16"):
        wrapper.run(q, kv.half(), kv)
    with pytest.raises(ValueError, match=r"out has shape"):
        wrapper.run(q, kv, kv, out=torch.empty(256, 4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="lse has dtype torch.float16, expected torch.float32"):
        wrapper.run(q, kv, kv, lse=torch.empty(256, 4, dtype=torch.float16), return_lse=True)
    with pytest.raises(NotImplementedError, match="scale_q="):
        wrapper.run(q, kv, kv, scale_q=torch.ones(4))
    with pytest.raises(NotImplementedError, match="enable_pdl=True"):
        wrapper.run(q, kv, kv, enable_pdl=True)


def test_variable_wrapper_torch_backend_matches_reference():
    torch.manual_seed(1)
    hq, hkv, d = 4, 2, 64
    mask = torch.rand(hkv, 3, 2) < 0.6
    row = torch.tensor([[5, 7, 3], [10, 2, 3]], dtype=torch.int32)
    col = torch.tensor([[6, 9], [14, 1]], dtype=torch.int32)
    wrapper = VariableBlockSparseAttentionWrapper(WS, backend="torch")
    wrapper.plan(mask, row, col, hq, hkv, d, q_data_type=torch.bfloat16, sm_scale=0.3)
    q = torch.randn(hq, 15, d, dtype=torch.bfloat16)
    k, v = (
        torch.randn(hkv, 15, d, dtype=torch.bfloat16),
        torch.randn(hkv, 15, d, dtype=torch.bfloat16),
    )
    o, lse = wrapper.run(q, k, v, return_lse=True)
    tokens = reference.block_mask_to_token_mask(mask, row, col)
    want, want_lse = reference.attention(q, k, v, tokens, 0.3)
    assert torch.allclose(o.float(), want.float(), atol=1e-2)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))


def test_variable_wrapper_rejects_bad_inputs():
    wrapper = VariableBlockSparseAttentionWrapper(WS)
    mask = torch.ones(2, 2, 2, dtype=torch.bool)
    sz = torch.full((2, 2), 64, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_row_sz has shape \(2, 3\), expected \(2, 2\)"):
        wrapper.plan(mask, torch.full((2, 3), 64, dtype=torch.int32), sz, 2, 2, 128)
    with pytest.raises(ValueError, match="must sum to the same length"):
        wrapper.plan(mask, torch.tensor([[64, 64], [64, 128]], dtype=torch.int32), sz, 2, 2, 128)
    with pytest.raises(ValueError, match="block_row_sz and block_col_sz must be >= 1"):
        wrapper.plan(mask, torch.tensor([[64, 0], [64, 0]], dtype=torch.int32), sz, 2, 2, 128)
    with pytest.raises(ValueError, match="pos_encoding_mode='alibi' is not one of"):
        wrapper.plan(mask, sz, sz, 2, 2, 128, pos_encoding_mode="alibi")


def test_public_names():
    """Every name of the API table is importable from the package."""
    for name in sparseforge.__all__:
        assert getattr(sparseforge, name) is not None, name
    assert sparseforge.BlockSparseAttentionWrapper is BlockSparseAttentionWrapper


def test_custom_op_compiles_fullgraph_on_cpu():
    """torch.compile(fullgraph=True) traces a launch through the op's fake implementation,
    with the ABI's outputs as the mutated arguments."""
    from sparseforge import _library, ops

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    # Tracing uses the fake implementation; running the traced graph here needs a CPU kernel.
    torch.library.register_kernel("sparseforge::launch", "cpu", lambda *args: None)
    v = next(v for v in _library.manifest()["variants"] if v["family"] == "block_sparse_fwd")
    plan = (
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(1, 1, 1, dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
    )
    bound = _library.Kernel.from_manifest(v).bind(*plan, 0.5)

    def attend(q, k, v, out, lse):
        ops.launch(bound, (q, k, v, out, lse), True)
        return out

    compiled = torch.compile(attend, fullgraph=True, backend=record)
    q = torch.zeros(2, 64, v["params"]["head_dim"], dtype=torch.bfloat16)
    compiled(q, q, q, torch.empty_like(q), torch.empty(2, 64))
    assert len(graphs) == 1
    assert "sparseforge.launch" in str(graphs[0].graph)
    assert bound.split(("q", "k", "v", "o", "l")) == (["q", "k", "v"], ["o", "l"])
    assert bound.join(["q", "k", "v"], ["o", "l"]) == ["q", "k", "v", "o", "l"]


def cake_args(**change):
    args = dict(M=256, N=256, R=64, C=64, num_qo_heads=4, num_kv_heads=2, head_dim=128)
    args.update(change)
    return args


def test_plan_cake_vsa_runs_only_kernels():
    mask = torch.ones(2, 4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="sparseforge kernels need a CUDA device"):
        sparseforge.plan_cake_vsa(None, None, mask, **cake_args(M=200, N=200, R=50, C=50))
    with pytest.raises(ValueError, match="sparseforge kernels need a CUDA device"):
        sparseforge.plan_cake_vsa(None, None, mask, **cake_args())


def test_plan_cake_vsa_checks_like_the_wrapper():
    mask = torch.ones(2, 4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="num_qo_heads 3 must be a positive multiple"):
        sparseforge.plan_cake_vsa(None, None, mask, **cake_args(num_qo_heads=3))
    with pytest.raises(TypeError):  # the sizes are keyword-only, as in the reference
        sparseforge.plan_cake_vsa(None, None, mask, None, None, None, 256)


def test_run_cake_vsa_takes_only_its_plans():
    q = torch.zeros(1)
    with pytest.raises(TypeError, match="plan must be what plan_cake_vsa"):
        sparseforge.run_cake_vsa({"M": 1}, q, q, q)
    plan = sparseforge.CakeVSAPlan(BlockSparseAttentionWrapper(WS))
    with pytest.raises(ValueError, match="backend='fa2'"):
        sparseforge.run_cake_vsa(plan, q, q, q, backend="fa2")


def test_sage_quantizer_has_the_reference_name():
    assert sparseforge.sage_fp8_quantize_sm90 is sparseforge.sage_fp8_quantize
