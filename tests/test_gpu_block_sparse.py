"""Block-sparse forward kernels on the GPU against the fp32 reference.

Every case draws fresh random inputs, poisons the outputs with NaN before the run and checks
every element: relative L2 error <= 5e-3 for the output, LSE within 1e-3 (and -inf exactly
where a row selects nothing). Every template runs on sm_90a: the wgmma kernel (when built),
the TMA mma.sync kernel that ships for SM120 and SM100 (backend "warp_mma"), and the cp.async
mma.sync kernel it gives way to (forced).
"""

import math
import warnings
import zlib

import pytest
import torch
from sparseforge import (
    BlockSparseAttentionWrapper,
    VariableBlockSparseAttentionWrapper,
    plan_cake_vsa,
    planner,
    reference,
    run_cake_vsa,
)
from sparseforge.check import ragged_mask
from sparseforge.errors import VariantNotBuiltError

pytestmark = pytest.mark.gpu

DEV = "cuda"
WS = None


def workspace():
    global WS
    if WS is None:
        WS = torch.empty(1024, dtype=torch.uint8, device=DEV)
    return WS


def backends():
    from sparseforge._library import manifest
    from sparseforge.arch import arch_for_device

    arch = arch_for_device(0)
    templates = {v["template"] for v in manifest()["variants"] if v["arch"] == arch}
    out = ["warp_mma"]
    if "sm90_wgmma" in templates:
        out.append("sparseforge")
    return out


BACKENDS = backends() if torch.cuda.is_available() else ["warp_mma"]


def rel_l2(out, ref):
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def check(out, lse, ref_out, ref_lse, tol=5e-3):
    assert not torch.isnan(out).any(), "unwritten or NaN output"
    assert not torch.isnan(lse).any(), "unwritten or NaN lse"
    err = rel_l2(out, ref_out)
    assert err <= tol, f"relative L2 error {err:.2e} > {tol}"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "LSE -inf rows differ"
    assert torch.all(out[empty] == 0), "rows without keys must be 0"
    if (~empty).any():
        assert torch.allclose(lse[~empty], ref_lse[~empty], atol=1e-3, rtol=1e-4)


def random_inputs(hq, hkv, sq, sk, d, dtype):
    q = torch.randn(hq, sq, d, device=DEV, dtype=dtype)
    k = torch.randn(hkv, sk, d, device=DEV, dtype=dtype)
    v = torch.randn(hkv, sk, d, device=DEV, dtype=dtype)
    return q, k, v


def run_variable(mask, row_sz, col_sz, q, k, v, backend, sm_scale=None):
    hq, hkv, d = q.shape[0], k.shape[0], q.shape[-1]
    wrapper = VariableBlockSparseAttentionWrapper(workspace(), backend=backend)
    wrapper.plan(
        mask.to(DEV),
        row_sz.to(DEV, torch.int32),
        col_sz.to(DEV, torch.int32),
        hq,
        hkv,
        d,
        q_data_type=q.dtype,
        sm_scale=sm_scale,
    )
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEV)
    wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
    return wrapper, out, lse


def reference_for(mask, row_sz, col_sz, q, k, v, sm_scale=None, col_valid=None):
    tokens = reference.block_mask_to_token_mask(mask.cpu(), row_sz.cpu(), col_sz.cpu(), col_valid)
    return reference.attention(q, k, v, tokens.to(DEV), sm_scale, compute_dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
def test_variable_wrapper_ragged(backend, dtype, head_dim, block, group):
    torch.manual_seed(zlib.crc32(f"{backend}{dtype}{head_dim}{block}{group}".encode()))
    hkv = 2 if group < 8 else 1
    hq = hkv * group
    seq = 1000 if block == 64 else 1100  # not a multiple of the block: a short last block
    mb = nb = -(-seq // block)
    mask = ragged_mask(hkv, mb, nb, seed=block + group)
    sizes = reference.uniform_sizes(seq, block).expand(hkv, -1)
    q, k, v = random_inputs(hq, hkv, seq, seq, head_dim, dtype)
    wrapper, out, lse = run_variable(mask, sizes, sizes, q, k, v, backend)
    assert wrapper.backend_in_use == ("tma_warp_mma" if backend == "warp_mma" else "sm90_wgmma")
    check(out, lse, *reference_for(mask, sizes, sizes, q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", ["local", "strided", "all", "none"])
def test_structured_masks(backend, pattern):
    hkv, hq, seq, d = 2, 4, 2048, 128
    mb = seq // 64
    i = torch.arange(mb)[:, None]
    j = torch.arange(mb)[None, :]
    mask = {
        "local": (i - j).abs() <= 2,
        "strided": (j % 4 == 0) | (i == j),
        "all": torch.ones(mb, mb, dtype=torch.bool),
        "none": torch.zeros(mb, mb, dtype=torch.bool),
    }[pattern].expand(hkv, -1, -1)
    sizes = torch.full((hkv, mb), 64)
    q, k, v = random_inputs(hq, hkv, seq, seq, d, torch.bfloat16)
    _, out, lse = run_variable(mask, sizes, sizes, q, k, v, backend)
    if pattern == "none":
        assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    else:
        check(out, lse, *reference_for(mask, sizes, sizes, q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
def test_variable_block_sizes_per_head(backend):
    row_sz = torch.tensor([[64, 192, 128, 50], [128, 128, 64, 114]])
    col_sz = torch.tensor([[256, 64, 64, 70], [64, 64, 64, 262]])
    mask = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(5)) < 0.6
    q, k, v = random_inputs(4, 2, 434, 454, 128, torch.bfloat16)
    _, out, lse = run_variable(mask, row_sz, col_sz, q, k, v, backend, sm_scale=0.05)
    check(out, lse, *reference_for(mask, row_sz, col_sz, q, k, v, sm_scale=0.05))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", [64, 128])
def test_bsr_forms_agree_with_each_other_and_the_variable_wrapper(backend, block):
    """BSR indptr/indices, block_mask, q2k selections and the variable wrapper on one mask."""
    hq, hkv, d, seq = 8, 2, 128, 1024
    mb = nb = seq // block
    shared = torch.rand(mb, nb, generator=torch.Generator().manual_seed(block)) < 0.3
    shared[1] = False
    q, k, v = random_inputs(hq, hkv, seq, seq, d, torch.bfloat16)
    q_nhd, k_nhd, v_nhd = (t.transpose(0, 1).contiguous() for t in (q, k, v))

    def bsr_run(**form):
        w = BlockSparseAttentionWrapper(workspace(), backend=backend)
        w.plan(
            form.pop("indptr", None),
            form.pop("indices", None),
            seq,
            seq,
            block,
            block,
            hq,
            hkv,
            d,
            q_data_type=torch.bfloat16,
            **form,
        )
        out, lse = w.run(q_nhd, k_nhd, v_nhd, return_lse=True)
        return out.transpose(0, 1), lse.transpose(0, 1)

    counts = shared.sum(-1)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(DEV, torch.int32)
    indices = shared.nonzero()[:, 1].to(DEV, torch.int32)
    topk = int(counts.max())
    sel = torch.zeros(hq, mb, topk, dtype=torch.int32)
    for r in range(mb):
        cols = shared[r].nonzero().flatten()
        sel[:, r, : cols.numel()] = cols.to(torch.int32)
    outs = [
        bsr_run(indptr=indptr, indices=indices),
        bsr_run(block_mask=shared.expand(hq, -1, -1).to(DEV)),
        bsr_run(
            q2k_indices=sel.to(DEV),
            q2k_num=counts.to(torch.int32).expand(hq, -1).contiguous().to(DEV),
        ),
    ]
    sizes = torch.full((hkv, mb), block)
    _, out_var, lse_var = run_variable(shared.expand(hkv, -1, -1), sizes, sizes, q, k, v, backend)
    for out, lse in outs:
        assert torch.equal(out, out_var) and torch.equal(lse, lse_var)
    check(out_var, lse_var, *reference_for(shared.expand(hkv, -1, -1), sizes, sizes, q, k, v))


@pytest.mark.parametrize("block", [64, 128])
def test_functional_form_matches_the_wrapper_and_captures(block):
    """plan_cake_vsa / run_cake_vsa give the wrapper's bits, and a captured run replays."""
    hq, hkv, d, seq = 4, 2, 128, 768
    mb = seq // block
    mask = torch.rand(hkv, mb, mb, generator=torch.Generator().manual_seed(7)) < 0.4
    mask[0, 1] = False
    q, k, v = (
        t.transpose(0, 1).contiguous() for t in random_inputs(hq, hkv, seq, seq, d, torch.bfloat16)
    )
    shape = dict(M=seq, N=seq, R=block, C=block, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
    plan = plan_cake_vsa(None, None, mask.to(DEV), q_data_type=torch.bfloat16, **shape)
    plan.check()
    wrapper = BlockSparseAttentionWrapper(workspace(), backend="sparseforge")
    wrapper.plan(
        None,
        None,
        seq,
        seq,
        block,
        block,
        hq,
        hkv,
        d,
        q_data_type=torch.bfloat16,
        block_mask=mask.to(DEV),
    )
    want_out, want_lse = wrapper.run(q, k, v, return_lse=True)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(want_lse.shape, float("nan"), device=DEV)
    got = run_cake_vsa(plan, q, k, v, out=out, lse=lse, return_lse=True)
    assert got[0] is out and got[1] is lse
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_cake_vsa(plan, q, k, v, out=out, lse=lse, return_lse=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want_out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_block_lens(backend):
    hq, hkv, d, seq, block = 4, 4, 128, 512, 128
    lens = torch.tensor([128, 1, 64, 100], dtype=torch.int32)
    mask = torch.ones(4, 4, dtype=torch.bool)
    q, k, v = random_inputs(hq, hkv, seq, seq, d, torch.bfloat16)
    sizes = torch.full((hkv, 4), block)
    want = reference_for(mask.expand(hkv, -1, -1), sizes, sizes, q, k, v, col_valid=lens)
    # Keys past a block's valid length must not reach the results, whatever they hold.
    k[:, 200:256] = float("inf")
    v[:, 129:256] = float("nan")
    v[:, 330:384] = float("inf")
    w = BlockSparseAttentionWrapper(workspace(), backend=backend)
    indptr = torch.arange(0, 17, 4, dtype=torch.int32, device=DEV)
    indices = torch.arange(4, dtype=torch.int32, device=DEV).repeat(4)
    w.plan(
        indptr,
        indices,
        seq,
        seq,
        block,
        block,
        hq,
        hkv,
        d,
        q_data_type=torch.bfloat16,
        kv_block_lens=lens.to(DEV),
    )
    out, lse = w.run(*(t.transpose(0, 1).contiguous() for t in (q, k, v)), return_lse=True)
    check(out.transpose(0, 1), lse.transpose(0, 1), *want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_rows_many_tiles(backend):
    hq, hkv, d, seq = 4, 1, 128, 8192
    mb = seq // 64
    mask = torch.rand(hkv, mb, mb, generator=torch.Generator().manual_seed(9)) < 0.5
    sizes = torch.full((hkv, mb), 64)
    q, k, v = random_inputs(hq, hkv, seq, seq, d, torch.bfloat16)
    q *= 4  # sharper softmax: the running max changes often
    _, out, lse = run_variable(mask, sizes, sizes, q, k, v, backend)
    check(out, lse, *reference_for(mask, sizes, sizes, q, k, v))


def test_spec_example_on_gpu():
    """The FlashInfer docs' 3x3 example (1x1 blocks) runs on a kernel, without a warning."""
    wrapper = BlockSparseAttentionWrapper(workspace())
    indptr = torch.tensor([0, 1, 3, 5], dtype=torch.int32, device=DEV)
    indices = torch.tensor([2, 0, 2, 1, 2], dtype=torch.int32, device=DEV)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapper.plan(indptr, indices, 3, 3, 1, 1, 32, 8, 128)
    assert wrapper.backend_in_use != "torch"
    q = torch.randn(3, 32, 128, dtype=torch.float16, device=DEV)
    k = torch.randn(3, 8, 128, dtype=torch.float16, device=DEV)
    v = torch.randn(3, 8, 128, dtype=torch.float16, device=DEV)
    o = wrapper.run(q, k, v)
    mask = torch.tensor([[0, 0, 1], [1, 0, 1], [0, 1, 1]], dtype=torch.bool, device=DEV)
    want, _ = reference.attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask[None].expand(8, -1, -1)
    )
    assert torch.allclose(o.float(), want.transpose(0, 1), atol=2e-3)


def test_unaligned_operand_rejected():
    w = VariableBlockSparseAttentionWrapper(workspace())
    mask = torch.ones(1, 1, 1, dtype=torch.bool, device=DEV)
    sz = torch.full((1, 1), 64, dtype=torch.int32, device=DEV)
    w.plan(mask, sz, sz, 1, 1, 128, q_data_type=torch.bfloat16)
    base = torch.randn(1, 64 * 128 + 1, dtype=torch.bfloat16, device=DEV)
    q = base[:, 1:].view(1, 64, 128)
    with pytest.raises(ValueError, match="16-byte aligned"):
        w.run(q, q, q)
    with pytest.raises(ValueError, match="unit stride on head_dim"):
        w.run(torch.randn(1, 128, 64, dtype=torch.bfloat16, device=DEV).transpose(1, 2), q, q)


def test_no_host_sync_in_run():
    w = VariableBlockSparseAttentionWrapper(workspace())
    mask = torch.ones(1, 2, 2, dtype=torch.bool, device=DEV)
    sz = torch.full((1, 2), 64, dtype=torch.int32, device=DEV)
    w.plan(mask, sz, sz, 1, 1, 128, q_data_type=torch.bfloat16)
    q = torch.randn(1, 128, 128, dtype=torch.bfloat16, device=DEV)
    out = torch.empty_like(q)
    torch.cuda.set_sync_debug_mode("error")
    try:
        w.run(q, q, q, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(float(out.float().abs().sum()))


@pytest.mark.skipif("sparseforge" not in BACKENDS, reason="no sm90_wgmma build")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "group, block, seq",
    [(2, 64, 1000), (4, 128, 777), (8, 64, 130), (1, 128, 300), (3, 128, 1100), (1, 256, 700)],
)
def test_units_sharing_a_ring_match_single_ctas(monkeypatch, dtype, head_dim, group, block, seq):
    """Two or four units per CTA, one per warpgroup, sharing its K/V ring (_w2, _w4): heads of
    a group, or the 64-row units of a row block (a last unit without a partner computed
    twice). Each gives bit for bit the output of one unit per CTA, which matches the
    reference."""
    torch.manual_seed(zlib.crc32(f"{dtype}{head_dim}{group}{block}{seq}".encode()))
    hkv = 2
    mb = -(-seq // block)
    mask = ragged_mask(hkv, mb, mb, seed=seq)
    sizes = reference.uniform_sizes(seq, block).expand(hkv, -1)
    q, k, v = random_inputs(hkv * group, hkv, seq, seq, head_dim, dtype)
    name = (
        f"block_sparse_fwd__sm90_wgmma__{'bf16' if dtype == torch.bfloat16 else 'fp16'}_d{head_dim}"
    )
    monkeypatch.setenv("SPARSEFORGE_VARIANT", f"{name}__sm_90a")
    out1, lse1 = run_variable(mask, sizes, sizes, q, k, v, "sparseforge")[1:]
    check(out1, lse1, *reference_for(mask, sizes, sizes, q, k, v))
    for units in (2, 4):
        if group % units and not planner.rows_fit_units(sizes, units, 64):
            continue  # no groups of `units` units with one tile list (the variant refuses)
        monkeypatch.setenv("SPARSEFORGE_VARIANT", f"{name}_w{units}__sm_90a")
        out2, lse2 = run_variable(mask, sizes, sizes, q, k, v, "sparseforge")[1:]
        assert torch.equal(out2, out1) and torch.equal(lse2, lse1), units


def test_shared_ring_variant_refuses_plans_without_groups(monkeypatch):
    if "sparseforge" not in BACKENDS:
        pytest.skip("no sm90_wgmma build")
    monkeypatch.setenv("SPARSEFORGE_VARIANT", "block_sparse_fwd__sm90_wgmma__bf16_d128_w2__sm_90a")
    sizes = torch.full((3, 4), 64)
    with pytest.raises(ValueError, match="groups of 2"):
        run_variable(
            torch.ones(3, 4, 4, dtype=torch.bool),
            sizes,
            sizes,
            *random_inputs(3, 3, 256, 256, 128, torch.bfloat16),
            "sparseforge",
        )


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 2])
def test_cp_async_kernel_the_tma_kernel_gives_way_to(monkeypatch, head_dim, group):
    """The cp.async mma.sync kernel: what a TMA variant that fails its first-use self-check
    gives way to, and what no default choice takes where both are built (forced here)."""
    from sparseforge.arch import arch_for_device

    name = f"block_sparse_fwd__warp_mma__bf16_d{head_dim}__{arch_for_device(0)}"
    monkeypatch.setenv("SPARSEFORGE_VARIANT", name)
    torch.manual_seed(zlib.crc32(name.encode() + bytes([group])))
    hkv, seq = 2, 1000
    mb = -(-seq // 64)
    mask = ragged_mask(hkv, mb, mb, seed=head_dim + group)
    sizes = reference.uniform_sizes(seq, 64).expand(hkv, -1)
    q, k, v = random_inputs(hkv * group, hkv, seq, seq, head_dim, torch.bfloat16)
    wrapper, out, lse = run_variable(mask, sizes, sizes, q, k, v, "sparseforge")
    assert wrapper.backend_in_use == "warp_mma"
    check(out, lse, *reference_for(mask, sizes, sizes, q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_head_dim_256(backend, dtype, group):
    """head_dim 256 (one CTA per SM on sm90; a two-warpgroup variant for groups of 2+)."""
    torch.manual_seed(zlib.crc32(f"d256{backend}{dtype}{group}".encode()))
    hkv, seq = 2, 700
    mb = -(-seq // 64)
    mask = ragged_mask(hkv, mb, mb, seed=group)
    sizes = reference.uniform_sizes(seq, 64).expand(hkv, -1)
    q, k, v = random_inputs(hkv * group, hkv, seq, seq, 256, dtype)
    wrapper, out, lse = run_variable(mask, sizes, sizes, q, k, v, backend)
    assert wrapper.backend_in_use == ("tma_warp_mma" if backend == "warp_mma" else "sm90_wgmma")
    check(out, lse, *reference_for(mask, sizes, sizes, q, k, v))


def test_unbuilt_head_dim_names_the_built_ones():
    mask = torch.ones(1, 1, 1, dtype=torch.bool, device=DEV)
    sz = torch.full((1, 1), 64, dtype=torch.int32, device=DEV)
    wrapper = VariableBlockSparseAttentionWrapper(workspace())
    with pytest.raises(VariantNotBuiltError, match="head_dim 96 is not built .* 64, 128, 256"):
        wrapper.plan(mask, sz, sz, 1, 1, 96, q_data_type=torch.bfloat16)


def test_plans_and_runs_under_inference_mode():
    """Engines run under torch.inference_mode(), where tensors have no version counter:
    both wrappers plan there (the variable wrapper twice, the second time from its cached
    copies of the size tensors), run, and match the reference; a size tensor rewritten in
    place is still caught on the GPU."""
    hkv, hq, seq, d = 2, 4, 1024, 128
    mb = seq // 64
    mask = ragged_mask(hkv, mb, mb, seed=3)
    with torch.inference_mode():
        q, k, v = random_inputs(hq, hkv, seq, seq, d, torch.bfloat16)
        sizes = torch.full((hkv, mb), 64, dtype=torch.int32, device=DEV)
        wrapper = VariableBlockSparseAttentionWrapper(workspace())
        for _ in range(2):
            wrapper.plan(mask.to(DEV), sizes, sizes, hq, hkv, d, q_data_type=torch.bfloat16)
            out, lse = wrapper.run(q, k, v, return_lse=True)
            check(out, lse, *reference_for(mask, sizes, sizes, q, k, v))
        bsr = BlockSparseAttentionWrapper(workspace())
        q2k = mask.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :4]
        q2k = q2k.repeat_interleave(hq // hkv, 0).to(DEV, torch.int32).contiguous()
        shape = (None, None, seq, seq, 64, 64, hq, hkv, d)
        bsr.plan(*shape, q2k_indices=q2k, q_data_type=torch.bfloat16)
        got = bsr.run(*(x.transpose(0, 1).contiguous() for x in (q, k, v)))
        chosen = torch.zeros(hkv, mb, mb, dtype=torch.bool)
        chosen.scatter_(2, q2k[:: hq // hkv].long().cpu(), True)
        want, _ = reference_for(chosen, sizes, sizes, q, k, v)
        assert rel_l2(got.transpose(0, 1), want) <= 5e-3
        sizes[0, 0] = 32  # written in place: no version counter moves
        sizes[0, 1] = 96
        wrapper.plan(mask.to(DEV), sizes, sizes, hq, hkv, d, q_data_type=torch.bfloat16)
        with pytest.raises(ValueError, match="changed in place"):
            wrapper.check_plan()
