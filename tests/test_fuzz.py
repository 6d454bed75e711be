"""Property-based fuzzing of both wrappers, every sparsity form, the Sage path and wrapper
state (hypothesis).

- Valid problems (random shapes, GQA groups, block sizes, forms, strides of the selection
  tensors, dtypes, sm_scale) give the dense masked attention that torch's own SDPA computes
  in fp64 (an implementation independent of sparseforge.reference); on the GPU the kernels
  must match it within their tolerances, outputs poisoned with NaN before each run.
- Invalid inputs raise a ValueError / TypeError / NotImplementedError that names the
  argument, before any launch, and a known-good plan and run afterwards still match.
- Sequences of good plans, failed plans and runs always run the last good plan.

SPARSEFORGE_FUZZ_EXAMPLES=N runs N examples per property (default 40 on the CPU, 25 on the
GPU); CONTRIBUTING.md says how to run it longer.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sparseforge import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper, reference

EXAMPLES = int(os.environ.get("SPARSEFORGE_FUZZ_EXAMPLES", "0"))
CPU = settings(
    max_examples=EXAMPLES or 40,
    deadline=None,
    derandomize=not EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
GPU = settings(
    max_examples=EXAMPLES or 25,
    deadline=None,
    derandomize=not EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- problems -----------------------------------------------------------------------------------


@st.composite
def problems(draw, kernel=False):
    """A random attention problem as a dict: heads, lengths, blocks, a block mask and a form."""
    hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    if kernel:
        d = draw(st.sampled_from([64, 128]))
        block_r = 64 * draw(st.integers(1, 3))
        block_c = 64 * draw(st.integers(1, 3))
        seq_q, seq_k = draw(st.integers(1, 700)), draw(st.integers(1, 700))
    else:
        d = draw(st.sampled_from([8, 16, 32]))
        block_r, block_c = draw(st.integers(1, 48)), draw(st.integers(1, 48))
        seq_q, seq_k = draw(st.integers(1, 160)), draw(st.integers(1, 160))
    form = draw(st.sampled_from(["bsr", "block_mask", "q2k", "mask_map"]))
    hkv_mask = 1 if form == "bsr" else hkv  # BSR: one structure for every head
    if form != "mask_map":
        seq_k = -(-seq_k // block_c) * block_c  # N must be a multiple of C
    mb, nb = -(-seq_q // block_r), -(-seq_k // block_c)
    density = draw(st.floats(0.0, 1.0))
    seed = draw(st.integers(0, 2**31 - 1))
    mask = torch.rand(hkv_mask, mb, nb, generator=torch.Generator().manual_seed(seed)) < density
    return dict(
        hkv=hkv,
        hq=hkv * group,
        d=d,
        seq_q=seq_q,
        seq_k=seq_k,
        block_r=block_r,
        block_c=block_c,
        form=form,
        mask=mask,
        seed=seed,
        view=draw(st.sampled_from(["contiguous", "transposed", "sliced"])),
        sm_scale=draw(st.one_of(st.none(), st.floats(0.01, 2.0))),
    )


def selection_view(mask: torch.Tensor, view: str) -> torch.Tensor:
    """The same values in another memory layout."""
    if view == "transposed":
        return mask.transpose(1, 2).contiguous().transpose(1, 2)
    if view == "sliced":
        wide = torch.zeros(mask.shape[0], mask.shape[1], 2 * mask.shape[2], dtype=mask.dtype)
        wide[:, :, ::2] = mask
        return wide[:, :, ::2]
    return mask


def plan(p: dict, backend: str, device, dtype, **kwargs):
    """(wrapper, hnd, (Hkv, Sq, Sk) token mask): the problem planned in its form."""
    mask = p["mask"]
    ws = torch.empty(16, dtype=torch.uint8, device=device)
    rows = reference.uniform_sizes(p["seq_q"], p["block_r"])
    cols = reference.uniform_sizes(p["seq_k"], p["block_c"])
    common = dict(q_data_type=dtype, sm_scale=p["sm_scale"], **kwargs)
    if p["form"] == "mask_map":
        w = VariableBlockSparseAttentionWrapper(ws, backend=backend)
        sizes_r = rows.expand(p["hkv"], -1).to(torch.int32).to(device)
        sizes_c = cols.expand(p["hkv"], -1).to(torch.int32).to(device)
        w.plan(
            selection_view(mask, p["view"]).to(device),
            sizes_r,
            sizes_c,
            p["hq"],
            p["hkv"],
            p["d"],
            **common,
        )
        hnd = True
    else:
        w = BlockSparseAttentionWrapper(ws, backend=backend)
        args = (p["seq_q"], p["seq_k"], p["block_r"], p["block_c"], p["hq"], p["hkv"], p["d"])
        if p["form"] == "bsr":
            rows_of = [torch.nonzero(r).flatten() for r in mask[0]]
            indptr = torch.tensor([0] + [len(r) for r in rows_of]).cumsum(0).to(torch.int32)
            indices = (
                torch.cat(rows_of).to(torch.int32) if rows_of else torch.zeros(0, dtype=torch.int32)
            )
            w.plan(indptr.to(device), indices.to(device), *args, **common)
        elif p["form"] == "block_mask":
            w.plan(
                None, None, *args, block_mask=selection_view(mask, p["view"]).to(device), **common
            )
        else:
            topk = max(1, int(mask.sum(-1).max()))
            order = mask.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :topk]
            num = mask.sum(-1).to(torch.int32)
            group = p["hq"] // p["hkv"]
            q2k = order.repeat_interleave(group, 0).to(torch.int32)
            w.plan(
                None,
                None,
                *args,
                q2k_indices=q2k.to(device),
                q2k_num=num.repeat_interleave(group, 0).to(device),
                **common,
            )
        hnd = False
    tokens = reference.block_mask_to_token_mask(mask.expand(p["hkv"], -1, -1), rows, cols)
    return w, hnd, tokens


def dense_attention(q, k, v, tokens, sm_scale):
    """fp64 SDPA with a boolean mask (rows with no key: 0), HND, GQA by repetition."""
    group = q.shape[0] // k.shape[0]
    mask = tokens.repeat_interleave(group, 0).to(q.device)
    k, v = (t.double().repeat_interleave(group, 0) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k, v, attn_mask=mask, scale=sm_scale
    )
    return torch.where(mask.any(-1, keepdim=True), out, 0.0)


def run_problem(p, backend, device, dtype=torch.bfloat16):
    gen = torch.Generator(device=device).manual_seed(p["seed"])
    q = torch.randn(p["hq"], p["seq_q"], p["d"], device=device, generator=gen).to(dtype)
    k = torch.randn(p["hkv"], p["seq_k"], p["d"], device=device, generator=gen).to(dtype)
    v = torch.randn(p["hkv"], p["seq_k"], p["d"], device=device, generator=gen).to(dtype)
    w, hnd, tokens = plan(p, backend, device, dtype)
    args = (q, k, v) if hnd else (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    out = torch.full_like(args[0], float("nan"))
    w.run(*args, out=out)
    out = out if hnd else out.transpose(0, 1)
    return out, dense_attention(q, k, v, tokens, p["sm_scale"])


# --- CPU: the reference path and every host check -------------------------------------------


@CPU
@given(problems())
def test_valid_problems_on_the_reference_path(p):
    out, want = run_problem(p, "torch", "cpu")
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


# (argument, how to corrupt a valid BSR plan's keyword arguments, expected words)
CORRUPTIONS = [
    ("num_qo_heads", lambda a: a.update(num_qo_heads=3.0), "num_qo_heads"),
    (
        "num_qo_heads",
        lambda a: a.update(num_qo_heads=5),
        "num_qo_heads 5 must be a positive multiple",
    ),
    ("head_dim", lambda a: a.update(head_dim=-1), "head_dim"),
    ("M", lambda a: a.update(M=0), "M must be a positive int"),
    ("N", lambda a: a.update(N=a["N"] + 1), "N ("),
    ("indptr", lambda a: a.update(indptr=a["indptr"][:-1]), "indptr has shape"),
    ("indptr", lambda a: a.update(indptr=a["indptr"].long()), "indptr has dtype"),
    ("indices", lambda a: a.update(indices=a["indices"] + 100), "block index is out of range"),
    ("indices", lambda a: a.update(indices=a["indices"].float()), "indices has dtype"),
    ("sm_scale", lambda a: a.update(sm_scale=float("nan")), "sm_scale=nan"),
    ("sm_scale", lambda a: a.update(sm_scale=1e39), "sm_scale=1e+39"),
    ("q_data_type", lambda a: a.update(q_data_type="float64"), "q_data_type"),
    ("causal", lambda a: a.update(causal="yes"), "causal must be a bool"),
    ("logits_soft_cap", lambda a: a.update(logits_soft_cap=-5.0), "logits_soft_cap"),
    (
        "block_mask",
        lambda a: a.update(block_mask=torch.ones(1, 1, 1, dtype=torch.bool)),
        "block_mask must be",
    ),
    (
        "q2k_num",
        lambda a: a.update(q2k_num=torch.zeros(4, 4, dtype=torch.int32)),
        "q2k_num is given without",
    ),
    (
        "kv_block_lens",
        lambda a: a.update(kv_block_lens=torch.zeros(4, dtype=torch.int32)),
        "kv_block_lens",
    ),
    ("q_scale", lambda a: a.update(q_scale=torch.ones(1)), "q_scale are for"),
]


def good_bsr_kwargs():
    return dict(
        indptr=torch.arange(5, dtype=torch.int32),
        indices=torch.tensor([0, 1, 1, 3], dtype=torch.int32),
        M=256,
        N=256,
        R=64,
        C=64,
        num_qo_heads=4,
        num_kv_heads=2,
        head_dim=32,
        q_data_type=torch.float16,
    )


@CPU
@given(st.lists(st.sampled_from(range(len(CORRUPTIONS))), min_size=1, max_size=3))
def test_invalid_inputs_raise_clear_errors_and_leave_the_plan(which):
    wrapper = BlockSparseAttentionWrapper(torch.empty(1), backend="torch")
    wrapper.plan(**good_bsr_kwargs())
    q = torch.randn(256, 4, 32, dtype=torch.float16)
    kv = torch.randn(256, 2, 32, dtype=torch.float16)
    want = wrapper.run(q, kv, kv)
    for index in which:
        name, corrupt, words = CORRUPTIONS[index]
        kwargs = good_bsr_kwargs()
        corrupt(kwargs)
        with pytest.raises((ValueError, TypeError, NotImplementedError)) as info:
            wrapper.plan(**kwargs)
        assert words in str(info.value), (name, str(info.value))
        assert torch.equal(wrapper.run(q, kv, kv), want), name


@CPU
@given(
    st.lists(st.sampled_from(["good", "bad", "run"]), min_size=1, max_size=8), st.integers(0, 100)
)
def test_state_sequences_run_the_last_good_plan(steps, seed):
    wrapper = VariableBlockSparseAttentionWrapper(torch.empty(1), backend="torch")
    q = torch.randn(2, 128, 16, dtype=torch.bfloat16)
    kv = torch.randn(2, 128, 16, dtype=torch.bfloat16)
    sizes = torch.full((2, 2), 64, dtype=torch.int32)
    last = None
    for i, step in enumerate(steps):
        if step == "good":
            mask = torch.rand(2, 2, 2, generator=torch.Generator().manual_seed(seed + i)) < 0.5
            wrapper.plan(mask, sizes, sizes, 2, 2, 16, q_data_type=torch.bfloat16)
            tokens = reference.block_mask_to_token_mask(mask, sizes, sizes)
            last = reference.attention(q, kv, kv, tokens)[0]
        elif step == "bad":
            with pytest.raises((ValueError, TypeError)):
                wrapper.plan(
                    torch.ones(2, 2, 2, dtype=torch.bool),
                    sizes,
                    sizes,
                    2,
                    2,
                    16,
                    sm_scale=float("inf"),
                )
        elif last is None:
            with pytest.raises(RuntimeError, match="plan\\(\\) must be called"):
                wrapper.run(q, kv, kv)
        else:
            torch.testing.assert_close(
                wrapper.run(q, kv, kv).float(), last.float(), atol=1e-2, rtol=1e-2
            )


# --- GPU: the kernels -------------------------------------------------------------------


@pytest.mark.gpu
@GPU
@given(
    problems(kernel=True),
    st.sampled_from(["sparseforge", "warp_mma"]),
    st.sampled_from(["bf16", "fp16"]),
)
def test_valid_problems_on_the_kernels(p, backend, dtype):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    out, want = run_problem(p, backend, "cuda", dtype)
    assert not torch.isnan(out).any(), "unwritten or NaN output"
    err = float((out.double() - want).norm() / want.norm().clamp_min(1e-30))
    assert err <= 5e-3, err
    assert torch.all(out[~want.ne(0).any(-1)] == 0)


@pytest.mark.gpu
@GPU
@given(problems(kernel=True), st.sampled_from(["sparseforge", "warp_mma"]))
def test_valid_problems_on_the_sage_kernels(p, backend):
    """Sage FP8 against the dense fp64 attention of the dequantized inputs."""
    from sparseforge import sage_fp8_quantize

    gen = torch.Generator(device="cuda").manual_seed(p["seed"])
    q, k, v = (
        torch.randn(h, s, p["d"], device="cuda", generator=gen).to(torch.bfloat16)
        for h, s in ((p["hq"], p["seq_q"]), (p["hkv"], p["seq_k"]), (p["hkv"], p["seq_k"]))
    )
    qz = sage_fp8_quantize(q, k, v)
    w, hnd, tokens = plan(
        p,
        backend,
        "cuda",
        torch.float8_e4m3fn,
        q_scale=qz.q_scale,
        k_scale=qz.k_scale,
        v_scale=qz.v_scale,
    )
    args = (qz.q, qz.k, qz.v) if hnd else tuple(t.transpose(0, 1) for t in (qz.q, qz.k, qz.v))
    out = w.run(*args)
    out = out if hnd else out.transpose(0, 1)
    want = dense_attention(
        *reference.sage_dequantize(qz.q, qz.k, qz.v, qz.q_scale, qz.k_scale, qz.v_scale),
        tokens,
        p["sm_scale"],
    )
    assert not torch.isnan(out).any()
    if want.norm() > 0:
        cos = float(
            (out.double() * want).sum() / (out.double().norm() * want.norm()).clamp_min(1e-30)
        )
        assert cos >= 0.999, cos


@pytest.mark.gpu
@GPU
@given(
    st.sampled_from(["index", "duplicate", "indptr", "q2k_num", "kv_block_lens"]), st.integers(0, 3)
)
def test_invalid_gpu_selections_raise_at_check_plan_then_a_good_plan_runs(problem, where):
    device = "cuda"
    wrapper = BlockSparseAttentionWrapper(torch.empty(1, device=device))
    indptr = torch.arange(5, dtype=torch.int32, device=device)
    indices = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=device)
    kwargs = dict(q_data_type=torch.bfloat16)
    if problem == "index":
        indices[where] = 4 + where
    elif problem == "duplicate":
        indptr, indices = (
            torch.tensor([0, 2, 2, 3, 4], dtype=torch.int32, device=device),
            torch.tensor([1, 1, 2, 3], dtype=torch.int32, device=device),
        )
    elif problem == "indptr":
        indptr[where + 1] = 9
    elif problem == "q2k_num":
        indptr = indices = None
        kwargs.update(
            q2k_indices=torch.zeros(4, 4, 1, dtype=torch.int32, device=device),
            q2k_num=torch.full((4, 4), 2, dtype=torch.int32, device=device),
        )
    else:
        kwargs.update(kv_block_lens=torch.tensor([64, 64, 0, 64], dtype=torch.int32, device=device))
    wrapper.plan(indptr, indices, 256, 256, 64, 64, 4, 2, 128, **kwargs)
    with pytest.raises(ValueError, match="invalid"):
        wrapper.check_plan()
    good = torch.arange(5, dtype=torch.int32, device=device)
    wrapper.plan(good, good[:4], 256, 256, 64, 64, 4, 2, 128, q_data_type=torch.bfloat16)
    wrapper.check_plan()
    q = torch.randn(256, 4, 128, device=device, dtype=torch.bfloat16)
    kv = torch.randn(256, 2, 128, device=device, dtype=torch.bfloat16)
    assert torch.isfinite(wrapper.run(q, kv, kv).float()).all()
