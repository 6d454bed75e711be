"""Planning on the GPU without host synchronisation, deferred validation, CUDA graphs and
torch.compile (plan() as often as run(), for per-step dynamic sparsity)."""

import pytest
import torch
from sparseforge import (
    BlockSparseAttentionWrapper,
    VariableBlockSparseAttentionWrapper,
    planner,
    reference,
)
from sparseforge.bench import random_selection

pytestmark = pytest.mark.gpu

DEV = "cuda"
HQ, HKV, D, SEQ, BLOCK = 8, 2, 128, 2048, 64
MB = SEQ // BLOCK


def workspace():
    return torch.empty(16, dtype=torch.uint8, device=DEV)


def inputs(layout="nhd"):
    gen = torch.Generator(device=DEV).manual_seed(3)
    shape_q, shape_kv = (
        ((SEQ, HQ, D), (SEQ, HKV, D)) if layout == "nhd" else ((HQ, SEQ, D), (HKV, SEQ, D))
    )
    q = torch.randn(shape_q, device=DEV, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(shape_kv, device=DEV, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape_kv, device=DEV, dtype=torch.bfloat16, generator=gen)
    return q, k, v


def selections(seed, topk=8):
    """q2k form (HQ, MB, topk) int32 with ragged counts, the same per GQA group."""
    mask = random_selection(HKV, MB, MB, topk, seed=seed)
    idx = (
        mask.to(torch.int8)
        .argsort(dim=-1, descending=True, stable=True)[..., :topk]
        .to(torch.int32)
    )
    num = torch.randint(0, topk + 1, (HKV, MB), generator=torch.Generator().manual_seed(seed)).to(
        torch.int32
    )
    group = HQ // HKV
    return idx.repeat_interleave(group, 0).contiguous().to(DEV), num.repeat_interleave(
        group, 0
    ).contiguous().to(DEV)


def bsr_plan_args():
    mask = random_selection(1, MB, MB, 6, seed=1)[0]
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), mask.sum(-1).cumsum(0)]).to(
        DEV, torch.int32
    )
    indices = mask.nonzero()[:, 1].to(DEV, torch.int32)
    return indptr, indices


def plan_forms():
    """(wrapper, plan kwargs) for every input form, all on the GPU."""
    indptr, indices = bsr_plan_args()
    sel, num = selections(2)
    block_mask = random_selection(HKV, MB, MB, 5, seed=3).to(DEV)
    common = (SEQ, SEQ, BLOCK, BLOCK, HQ, HKV, D)
    sizes = torch.full((HKV, MB), BLOCK, dtype=torch.int32, device=DEV)
    return {
        "bsr": (BlockSparseAttentionWrapper, (indptr, indices, *common), {}),
        "block_mask": (
            BlockSparseAttentionWrapper,
            (None, None, *common),
            dict(block_mask=block_mask),
        ),
        "q2k": (
            BlockSparseAttentionWrapper,
            (None, None, *common),
            dict(q2k_indices=sel, q2k_num=num),
        ),
        "variable": (
            VariableBlockSparseAttentionWrapper,
            (block_mask, sizes, sizes.clone(), HQ, HKV, D),
            {},
        ),
    }


@pytest.mark.parametrize("form", ["bsr", "block_mask", "q2k", "variable"])
def test_plan_and_run_without_host_sync(form):
    cls, args, kwargs = plan_forms()[form]
    wrapper = cls(workspace())
    q, k, v = inputs("hnd" if form == "variable" else "nhd")
    wrapper.plan(*args, q_data_type=torch.bfloat16, **kwargs)  # warm-up: module load, caches
    out = torch.empty_like(q)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        wrapper.plan(*args, q_data_type=torch.bfloat16, **kwargs)
        wrapper.run(q, k, v, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    wrapper.check_plan()
    assert torch.isfinite(out.float()).all()


def test_gpu_validation_raises_at_check_and_at_run():
    indptr, indices = bsr_plan_args()
    bad = indices.clone()
    bad[3] = MB + 7
    wrapper = BlockSparseAttentionWrapper(workspace())
    wrapper.plan(
        indptr, bad, SEQ, SEQ, BLOCK, BLOCK, HQ, HKV, D, q_data_type=torch.bfloat16
    )  # no raise here
    with pytest.raises(
        ValueError, match=r"invalid indptr / indices: a block index is out of range \[0, 32\)"
    ):
        wrapper.check_plan()
    q, k, v = inputs()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="a block index is out of range"):
        wrapper.run(q, k, v)
    sel, num = selections(4)
    sel[0, 0, 0] = -1
    num[0, 1] = 99  # head 0 selects for its GQA group
    wrapper.plan(
        None,
        None,
        SEQ,
        SEQ,
        BLOCK,
        BLOCK,
        HQ,
        HKV,
        D,
        q_data_type=torch.bfloat16,
        q2k_indices=sel,
        q2k_num=num,
    )
    with pytest.raises(ValueError, match="q2k_num values must lie in"):
        wrapper.check_plan()
    per_head = random_selection(HKV, MB, MB, 5, seed=3).repeat_interleave(HQ // HKV, 0).to(DEV)
    per_head[HQ - 1, 0] = ~per_head[HQ - 1, 0]  # the last query head leaves its group's selection
    wrapper.plan(
        None,
        None,
        SEQ,
        SEQ,
        BLOCK,
        BLOCK,
        HQ,
        HKV,
        D,
        q_data_type=torch.bfloat16,
        block_mask=per_head,
    )
    with pytest.raises(ValueError, match="the query heads of a GQA group select different blocks"):
        wrapper.check_plan()
    wrapper.plan(indptr, indices, SEQ, SEQ, BLOCK, BLOCK, HQ, HKV, D, q_data_type=torch.bfloat16)
    wrapper.check_plan()  # a good plan clears the error


# The BSR wrapper's plan() arguments before the q2k selections.
Q2K_PLAN = (None, None, SEQ, SEQ, BLOCK, BLOCK, HQ, HKV, D)


def captured_q2k_plan_and_run(wrapper, q, k, v, sel, num, out):
    """A CUDA graph of the BSR wrapper's plan() of (sel, num) and its run() into out."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.plan(*Q2K_PLAN, q_data_type=torch.bfloat16, q2k_indices=sel, q2k_num=num)
        wrapper.run(q, k, v, out=out)
    return graph


@pytest.mark.parametrize("form", ["bsr", "variable"])
def test_run_in_cuda_graph_is_bit_identical(form):
    cls, args, kwargs = plan_forms()[form]
    wrapper = cls(workspace())
    q, k, v = inputs("hnd" if form == "variable" else "nhd")
    wrapper.plan(*args, q_data_type=torch.bfloat16, **kwargs)
    eager = wrapper.run(q, k, v)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(eager.shape[:2], float("nan"), device=DEV)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, k, v, out=out, lse=lse)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_q2k_plan_and_run_in_cuda_graph_follow_new_selections():
    q, k, v = inputs()
    sel, num = selections(5)
    wrapper = BlockSparseAttentionWrapper(workspace())
    wrapper.plan(*Q2K_PLAN, q_data_type=torch.bfloat16, q2k_indices=sel, q2k_num=num)
    wrapper.run(q, k, v)
    out = torch.empty_like(q)
    graph = captured_q2k_plan_and_run(wrapper, q, k, v, sel, num, out)
    for seed in (6, 7):
        new_sel, new_num = selections(seed)
        sel.copy_(new_sel)
        num.copy_(new_num)
        graph.replay()
        eager = BlockSparseAttentionWrapper(workspace())
        eager.plan(*Q2K_PLAN, q_data_type=torch.bfloat16, q2k_indices=new_sel, q2k_num=new_num)
        want = eager.run(q, k, v)
        torch.cuda.synchronize()
        assert torch.equal(out, want), seed


def test_constants_first_needed_in_a_capture_are_made_there():
    """The device constants plans keep per device (planner.device_constant), first needed
    inside a CUDA graph capture, are made afresh there: an eager plan() and run() after the
    capture, before any replay, find no constant whose fill only the graph would run (the
    stand-in size pair of plans without a recheck read as stale sizes otherwise)."""
    q, k, v = inputs()
    sel, num = selections(5)
    wrapper = BlockSparseAttentionWrapper(workspace())
    wrapper.plan(*Q2K_PLAN, q_data_type=torch.bfloat16, q2k_indices=sel, q2k_num=num)
    want = wrapper.run(q, k, v)  # kernels loaded before the capture
    planner._device_constants.clear()
    out = torch.empty_like(q)
    graph = captured_q2k_plan_and_run(wrapper, q, k, v, sel, num, out)
    wrapper.plan(*Q2K_PLAN, q_data_type=torch.bfloat16, q2k_indices=sel, q2k_num=num)
    got = wrapper.run(q, k, v)
    wrapper.check_plan()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert torch.equal(out, want)


def test_torch_compile_fullgraph_runs_the_kernel():
    cls, args, kwargs = plan_forms()["variable"]
    wrapper = cls(workspace())
    wrapper.plan(*args, q_data_type=torch.bfloat16, **kwargs)
    q, k, v = inputs("hnd")

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return wrapper.run(q, k, v).float() * 2.0

    compiled = torch.compile(Attend(), fullgraph=True)
    got = compiled(q, k, v)
    want = wrapper.run(q, k, v).float() * 2.0
    assert torch.equal(got, want)
    mask, sizes = args[0], args[1]
    tokens = reference.block_mask_to_token_mask(mask.cpu(), sizes.cpu(), sizes.cpu())
    ref, _ = reference.attention(q, k, v, tokens.to(DEV), compute_dtype=torch.float32)
    assert float((got / 2 - ref).norm() / ref.norm()) < 5e-3


def test_tile_compact_kernel_matches_the_torch_compaction():
    from sparseforge import planner
    from sparseforge.families import tile_compact

    for shape, density in (((3, 40, 517), 0.3), ((2, 7, 64), 0.9), ((1, 5, 31), 0.0)):
        listed = torch.rand(shape, generator=torch.Generator().manual_seed(5)) < density
        want_idx, want_cnt = planner.compact_rows(listed)
        got_idx, got_cnt = tile_compact.compact(listed.to(DEV))
        assert torch.equal(got_cnt.cpu(), want_cnt)
        for h in range(shape[0]):
            for r in range(shape[1]):
                n = int(want_cnt[h, r])
                assert torch.equal(got_idx[h, r, :n].cpu(), want_idx[h, r, :n])
    expanded = (torch.rand(1, 6, 70, generator=torch.Generator().manual_seed(6)) < 0.5).expand(
        4, -1, -1
    )
    got_idx, got_cnt = tile_compact.compact(
        expanded.to(DEV)
    )  # stride-0 head mode, as BSR plans pass
    assert torch.equal(got_cnt.cpu(), expanded.sum(-1, dtype=torch.int32))


@pytest.mark.parametrize(
    "heads, rows, group, units",
    [(32, 512, 1, 1), (4, 300, 8, 2), (2, 77, 4, 4), (3, 41, 3, 2), (2, 5, 1, 2), (1, 1, 1, 1)],
)
def test_unit_order_kernel_matches_longest_first(heads, rows, group, units):
    """The GPU order is planner.longest_first's, ties included (few distinct counts), for
    each way a CTA's units are chosen: query heads of a row or consecutive rows."""
    from sparseforge import planner
    from sparseforge.families import unit_order

    gen = torch.Generator().manual_seed(heads * rows + units)
    for top in (3, 200, 4095):  # D = 4, ~200, ~3300 distinct keys at 32 x 512
        counts = torch.randint(0, top + 1, (heads, rows), generator=gen, dtype=torch.int32)
        work = unit_order.order(counts.to(DEV), group, units, tiles=4095)
        assert torch.equal(work.cpu(), planner.longest_first(counts, group, units))


def test_unit_order_kernel_rechecks_size_tensors():
    """errors[0] says whether a size tensor (any strides) still holds the values read."""
    from sparseforge import planner, sparsity
    from sparseforge.families import unit_order

    counts = torch.randint(0, 9, (2, 33), dtype=torch.int32, device=DEV)
    rows = torch.full((2, 40), 64, dtype=torch.int32, device=DEV)
    cols = torch.full((2, 70), 64, dtype=torch.int32, device=DEV)
    pairs = ((rows, rows.to(torch.int64)), (cols[:, ::2], cols[:, ::2].to(torch.int64)))
    errors = torch.full((1,), -1, dtype=torch.int32, device=DEV)
    stale = sparsity.ERR_STALE_SIZES
    for changed, at, want in ((None, None, 0), (rows, 38, stale), (cols, 68, stale), (cols, 69, 0)):
        if changed is not None:
            changed[1, at] = 1  # cols: the checked view holds the even columns only
        unit_order.order(counts, 1, tiles=64, size_checks=pairs, errors=errors)
        assert int(errors) == want
        if changed is not None:
            changed.fill_(64)
    # Lists too long for the kernel's histogram: torch orders them and checks the sizes.
    rows[0, 0] = 3
    work = unit_order.order(counts, 1, tiles=4096, size_checks=pairs[:1], errors=errors)
    assert int(errors) == stale
    assert torch.equal(work.cpu(), planner.longest_first(counts.cpu(), 1))


@pytest.mark.parametrize("with_counts", [False, True])
def test_selection_mask_kernel_matches_the_torch_build(with_counts):
    """Masks and error bits as sparsity.selection_block_mask: clean rows, an index out of
    range, a repeated block (used or past the count), counts outside [0, topk], a strided
    head view (GQA's first heads), and masks wider than the kernel's bitmap (torch)."""
    from sparseforge import sparsity
    from sparseforge.families import selection_mask

    gen = torch.Generator().manual_seed(11)
    for heads, rows, topk, nb in ((4, 33, 8, 40), (2, 5, 70, 300), (1, 3, 4, 5000)):
        idx = torch.stack([torch.randperm(nb, generator=gen)[:topk] for _ in range(heads * rows)])
        idx = idx.view(heads, rows, topk).to(torch.int32)
        num = torch.randint(0, topk + 1, (heads, rows), generator=gen, dtype=torch.int32)
        cases = [idx]
        for r, value in ((1, nb), (2, -1)):  # out of range
            bad = idx.clone()
            bad[0, r, 0] = value
            cases.append(bad)
        repeated = idx.clone()
        repeated[-1, -1, 1] = repeated[-1, -1, 0]
        cases.append(repeated)
        for sel in cases:
            counts = None
            if with_counts:
                counts = num.clone()
                counts[-1, 0] = topk + 1 if sel is repeated else counts[-1, 0]
                counts[0, -1] = -1 if sel is cases[1] else counts[0, -1]
            want_mask, want_errors = sparsity.selection_block_mask(sel, counts, nb)
            for view in (lambda t: t, lambda t: t.repeat_interleave(2, 0)[::2]):
                on_gpu = [None if t is None else view(t.to(DEV)) for t in (sel, counts)]
                got_mask, got_errors = selection_mask.selection_block_mask(*on_gpu, nb)
                assert torch.equal(got_mask.cpu(), want_mask)
                assert int(got_errors) == int(want_errors)
