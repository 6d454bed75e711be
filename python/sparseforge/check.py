"""`python -m sparseforge.check [--variant NAME] [--small]`: every kernel variant of the loaded
library for this GPU (or one) on fresh random inputs against the PyTorch reference.

- attention variants: a ragged problem each fits (its dtype and head_dim, GQA groups of its
  units per CTA, 64- and 128-token blocks, an empty and a full row; the logits variants
  with causal, and the soft cap for the "scores" kind), outputs poisoned with NaN;
  relative L2 error and LSE against the fp32 reference (Sage FP8 on the dequantized e4m3
  inputs, quantized by the reference quantizer);
- quantizer launches: sage_fp8_quantize without the scale search, codes and scales equal to
  the reference's bit for bit (given the kernel's k mean);
- tile_compact: run by every attention plan;
- rope_llama: q and k rotated by a ROPE_LLAMA plan, the attention against the reference's
  rotation rounded to the dtype (1e-2);
- msa_proxy_score (and msa_proxy_score_fp4, against the reference on the dequantized
  values): ragged sequences (keys past the last full block, a sequence without
  keys, more than 64 queries), GQA, causal with default and explicit query offsets and not,
  flat and paged keys, reduce_heads, a wider output than needed; scores within 1e-5 of the
  fp64 reference, -inf exactly where it has them;
- nvfp4_kv_write: every scale range, E2M1 midpoints, zero and NaN groups, shuffled and
  negative slots; the pages byte for byte equal to reference.nvfp4_write_slots';
- msa_sparse_attention (16-bit, FP8 and NVFP4 K/V): ragged paged sequences, -1 and
  repeated ids, an empty selection, GQA 4 (GQA 16 for the wgmma union tile); output and LSE
  against the fp64 reference on the dequantized K/V;
- sdsa_quantize: keys and queries over the scale range, zero, NaN and midpoint groups,
  shuffled and negative slots and rows, cache and scales as views of one allocation; every
  output byte equal to reference.quantize_write_index_qk_nvfp4's; sdsa_scores,
  sdsa_sample, sdsa_thresholds, sdsa_topk, sdsa_select, sdsa_repair: paged BF16 / NVFP4
  keys (an empty request), sample rows, NaN and -1 positions, ties, infinities and NaNs
  among the candidates, rows the repair fixes, against the reference;
- msa_topk_select: tied, -inf and NaN scores, forced blocks and per-token valid pages, ids
  equal to the reference's;
- token_sparse_kv_indices / group_union_masks: ragged rows, -1 rows and repeated or
  out-of-range positions, every output buffer (poisoned) equal to the reference's;
- msa_icp_score / msa_icp_select / msa_icp_merge: ragged prefill sequences sharded over two
  or four ranks against reference_icp.rank_scores; carrier rows and merged ids word for word
  equal to reference_icp's (ties, NaN, -0, forced blocks, nvp 0 and past 8192);
  msa_icp_list_score / msa_icp_list_merge: the fused prefill's carrier rows on integer keys
  (exact scores) and the merge of random lists, word for word against reference_icp's.

One line per case; exit status 1 if any fails. `--small` shrinks the problems (for
compute-sanitizer, and for the first-use self-checks of selftest.py, which run a variant's
case through check_variant). With SPARSEFORGE_LIBRARY_DIR it checks a development build of a few
variants (generator/dev.py) without the full build.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from sparseforge import _library, reference, reference_icp
from sparseforge.arch import arch_for_device
from sparseforge.dtypes import BY_NAME
from sparseforge.families import sdsa as sdsa_family
from sparseforge.sparse import VariableBlockSparseAttentionWrapper

ATTENTION_FAMILIES = ("block_sparse_fwd", "block_sparse_fwd_logits", "sage_fp8_fwd")
# The logits variants' plan options: "scores" runs with a score option, "masks" without.
LOGIT_OPTIONS = {"masks": dict(causal=True), "scores": dict(causal=True, logits_soft_cap=8.0)}
QUANTIZER_FAMILY = "sage_quantize_stats"  # its variants stand for both launches
TOPK_FAMILY = "msa_topk_select"
PROXY_FAMILIES = ("msa_proxy_score", "msa_proxy_score_nvfp4")
NVFP4_WRITE_FAMILY = "nvfp4_kv_write"
ROPE_FAMILY = "rope_llama"
SDSA_QUANTIZE_FAMILY = "sdsa_quantize"
SDSA_FAMILIES = tuple(f for f in sdsa_family.FAMILIES if f != SDSA_QUANTIZE_FAMILY)
MSA_ATTENTION_FAMILIES = (
    "msa_sparse_attention",
    "msa_sparse_attention_fp8kv",
    "msa_sparse_attention_nvfp4",
)
TOKEN_SPARSE_FAMILIES = ("token_sparse_kv_indices", "group_union_masks")
ICP_FAMILIES = (
    "msa_icp_score",
    "msa_icp_select",
    "msa_icp_merge",
    "msa_icp_list_score",
    "msa_icp_list_merge",
)
ICP_HEADS, ICP_TOPK, ICP_WORDS = (
    reference_icp.HEADS,
    reference_icp.TOPK,
    reference_icp.CARRIER_WORDS,
)
# Relative L2 error bounds: 16-bit kernels against fp32; Sage against the dequantized inputs
# (what is left is the e4m3 rounding of P).
TOLERANCE = {"block_sparse_fwd": 5e-3, "block_sparse_fwd_logits": 5e-3, "sage_fp8_fwd": 3e-2}


def ragged_mask(hkv: int, mb: int, nb: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rank = torch.rand(hkv, mb, nb, generator=gen).argsort(-1).argsort(-1)
    mask = rank < torch.randint(0, nb + 1, (hkv, mb, 1), generator=gen)
    mask[0, 0] = False
    mask[-1, -1] = True
    return mask


def random_positions(t, k, num_keys, gen, valid_max=None):
    """(t, k) int32: each row a random count (<= valid_max) of distinct positions below
    num_keys first, then -1."""
    out = torch.full((t, k), -1, dtype=torch.int32)
    for i in range(t):
        count = int(torch.randint(0, min(valid_max or k, num_keys) + 1, (1,), generator=gen))
        out[i, :count] = torch.randperm(num_keys, generator=gen)[:count].to(torch.int32)
    return out


def token_sparse_kv_inputs(t=5, k=512, rpt=2, seed=0):
    """token_sparse_kv_indices arguments (CPU), outputs poisoned with -7 and 3 rows longer
    than written."""
    gen = torch.Generator().manual_seed(seed)
    requests_rows, blocks = 3, 20
    block_table = torch.randperm(1000, generator=gen)[: requests_rows * blocks].view(
        requests_rows, blocks
    )
    positions = random_positions(t, k, 64 * blocks, gen)
    requests = torch.randint(0, requests_rows, (t + 2,), generator=gen)
    block_tables = torch.full((t * rpt + 3, 2, k), -7, dtype=torch.int32)
    seq_lens = torch.full((t * rpt + 3,), -7, dtype=torch.int32)
    return dict(
        positions=positions,
        requests=requests.to(torch.int32),
        block_table=block_table.to(torch.int32).contiguous(),
        block_tables=block_tables,
        seq_lens=seq_lens,
        requests_per_token=rpt,
    )


def group_union_inputs(groups=3, n=4, k=512, num_keys=3000, seed=0):
    """group_union_masks arguments (CPU): positions also past num_keys, a repeated key, a
    token and a group with row -1 (where there are several), outputs poisoned with -7 and
    rows that are not written."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-num_keys // 64) + 2
    t = groups * n
    positions = random_positions(t, k, num_keys + 100, gen, valid_max=300)  # some >= num_keys
    positions[0, :3] = torch.tensor([5, 5, 7])  # a repeated key
    query_rows = torch.randperm(t + 4, generator=gen)[:t].to(torch.int32)
    if t > 1:  # a token without a row (one token alone keeps its row, so it is checked)
        query_rows[1] = -1
    group_unions = torch.randperm(groups + 2, generator=gen)[:groups].to(torch.int32)
    if groups > 1:
        group_unions[-1] = -1
    columns = min(n * k, 128 * -(-num_keys // 128))
    return dict(
        positions=positions,
        query_rows=query_rows,
        group_unions=group_unions,
        requests=torch.randint(0, 2, (groups,), generator=gen).to(torch.int32),
        block_table=torch.randperm(2 * blocks + 1000, generator=gen)[: 2 * blocks]
        .view(2, blocks)
        .int(),
        union=torch.full((groups + 2, columns), -7, dtype=torch.int32),
        union_sizes=torch.full((groups + 2,), -7, dtype=torch.int32),
        mask=torch.full((t + 4, -(-columns // 32)), -7, dtype=torch.int32),
        num_keys=num_keys,
    )


def topk_scores(heads, blocks, tokens, seed=0, per_token=True):
    """msa_topk_select inputs (CPU): (Hq, P, S) fp32 scores rounded to a few values, so
    ties are common, with -inf and NaN blocks; and per-token valid pages (or None)."""
    gen = torch.Generator().manual_seed(seed)
    score = (torch.randn(heads, blocks, tokens, generator=gen) * 4).round() / 4
    score[torch.rand(score.shape, generator=gen) < 0.1] = -math.inf
    score[torch.rand(score.shape, generator=gen) < 0.02] = math.nan
    nvp = None
    if per_token:
        nvp = torch.randint(0, blocks + 1, (tokens,), generator=gen, dtype=torch.int32)
        nvp[0] = blocks
    return score, nvp


def check_attention(v: dict, block: int, small: bool, seed: int = 0) -> tuple[str, bool]:
    """A ragged problem the variant fits (logits variants: causal, and the soft cap for the
    "scores" kind), planned and run with the variant forced, against the fp32 reference."""
    p = v["params"]
    options = LOGIT_OPTIONS[p["logits"]] if p.get("logits") else {}
    group = v["constraints"]["units_per_cta"]
    hkv, hq, d = 2, 2 * group, p["head_dim"]
    sq, sk = (300, 200) if small else (1000, 777)
    torch.manual_seed(seed)
    q, k, v_ = (torch.randn(h, s, d, device="cuda") for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    mask = ragged_mask(hkv, -(-sq // block), -(-sk // block), seed)
    rows = reference.uniform_sizes(sq, block).expand(hkv, -1).to(torch.int32)
    cols = reference.uniform_sizes(sk, block).expand(hkv, -1).to(torch.int32)
    wrapper = VariableBlockSparseAttentionWrapper(
        torch.empty(1, device="cuda"), backend="sparseforge"
    )
    scales = {}
    if v["family"] == "sage_fp8_fwd":
        qz = reference.sage_fp8_quantize(q, k, v_)
        scales = dict(q_scale=qz.q_scale, k_scale=qz.k_scale, v_scale=qz.v_scale)
        q, k, v_ = qz.q, qz.k, qz.v
        ref_inputs = reference.sage_dequantize(q, k, v_, qz.q_scale, qz.k_scale, qz.v_scale)
        out_dtype = torch.bfloat16
    else:
        q, k, v_ = (t.to(BY_NAME[p["dtype"]]) for t in (q, k, v_))
        ref_inputs, out_dtype = (q, k, v_), q.dtype
    os.environ["SPARSEFORGE_VARIANT"] = v["name"]
    try:
        wrapper.plan(
            mask.cuda(), rows.cuda(), cols.cuda(), hq, hkv, d, q_data_type=q.dtype, **scales,
            **options,
        )  # fmt: skip
        wrapper.check_plan()
        out = torch.full((hq, sq, d), float("nan"), device="cuda", dtype=out_dtype)
        lse = torch.full((hq, sq), float("nan"), device="cuda")
        wrapper.run(q, k, v_, out=out, lse=lse, return_lse=True)
        torch.cuda.synchronize()
    finally:
        os.environ.pop("SPARSEFORGE_VARIANT")
    tokens = reference.block_mask_to_token_mask(mask, rows, cols).cuda()
    if options.get("causal"):  # aligned at the bottom right, as plan()'s causal is
        i, j = torch.arange(sq, device="cuda")[:, None], torch.arange(sk, device="cuda")[None]
        tokens = tokens & (j <= i + sk - sq)
    ref_out, ref_lse = reference.attention(
        *ref_inputs, tokens, compute_dtype=torch.float32,
        logits_soft_cap=options.get("logits_soft_cap"),
    )  # fmt: skip
    err = float((out.float() - ref_out).norm() / ref_out.norm())
    empty = torch.isinf(ref_lse)
    ok = (
        err <= TOLERANCE[v["family"]]
        and not torch.isnan(out).any()
        and torch.equal(torch.isinf(lse), empty)
        and bool((out[empty] == 0).all())
        and torch.allclose(lse[~empty], ref_lse[~empty], atol=5e-3, rtol=2e-3)
    )
    what = "".join(f", {name} {value}" for name, value in options.items())
    return f"blocks {block}{what}: rel. L2 {err:.2e}", ok


def check_rope(v: dict, small: bool, seed: int = 0) -> tuple[str, bool]:
    """rope_llama through the variable wrapper's pos_encoding_mode="ROPE_LLAMA" (forced; the
    attention kernel is this GPU's default): against the fp32 reference attention of the
    reference's rotation (q at positions i + Sk - Sq, k at j) rounded to the dtype."""
    p = v["params"]
    hq, hkv, d, block = 4, 2, p["head_dim"], 64
    sq, sk = (200, 320) if small else (1000, 777)
    dtype = BY_NAME[p["dtype"]]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v_ = (
        torch.randn(h, s, d, device="cuda", generator=gen).to(dtype)
        for h, s in ((hq, sq), (hkv, sk), (hkv, sk))
    )
    mask = ragged_mask(hkv, -(-sq // block), -(-sk // block), seed)
    rows = reference.uniform_sizes(sq, block).expand(hkv, -1).to(torch.int32)
    cols = reference.uniform_sizes(sk, block).expand(hkv, -1).to(torch.int32)
    scale, theta = 2.0, 5e5
    wrapper = VariableBlockSparseAttentionWrapper(
        torch.empty(1, device="cuda"), backend="sparseforge"
    )
    os.environ["SPARSEFORGE_VARIANT"] = v["name"]
    try:
        wrapper.plan(
            mask.cuda(), rows.cuda(), cols.cuda(), hq, hkv, d, q_data_type=dtype,
            pos_encoding_mode="ROPE_LLAMA", rope_scale=scale, rope_theta=theta,
        )  # fmt: skip
        out = wrapper.run(q, k, v_)
        torch.cuda.synchronize()
    finally:
        os.environ.pop("SPARSEFORGE_VARIANT")
    rq = reference.rope_llama(q, torch.arange(sq) + sk - sq, scale, theta).to(dtype)
    rk = reference.rope_llama(k, torch.arange(sk), scale, theta).to(dtype)
    tokens = reference.block_mask_to_token_mask(mask, rows, cols).cuda()
    want, _ = reference.attention(rq, rk, v_, tokens, compute_dtype=torch.float32)
    err = float((out.float() - want).norm() / want.norm())
    return f"rotated q and k, rel. L2 {err:.2e}", err <= 1e-2 and not torch.isnan(out).any()


def check_quantizer(v: dict, small: bool, seed: int = 0) -> tuple[str, bool]:
    from sparseforge.sage import sage_fp8_quantize

    p = v["params"]
    hq, hkv, sq, sk, d = (
        (4, 2, 70, 90, p["head_dim"]) if small else (8, 2, 1000, 777, p["head_dim"])
    )
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v_ = (
        torch.randn(h, s, d, device="cuda", generator=gen).to(BY_NAME[p["dtype"]])
        for h, s in ((hq, sq), (hkv, sk), (hkv, sk))
    )
    got = sage_fp8_quantize(q, k, v_, scale_search=False)
    want = reference.sage_fp8_quantize(q, k, v_, k_mean=got.k_mean, scale_search=False)
    same = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got[:6], want[:6], strict=True))
    return "codes and scales vs the reference", same


def check_token_sparse(v: dict, small: bool, seed: int = 0) -> tuple[str, bool]:
    from sparseforge import token_sparse

    if v["family"] == "token_sparse_kv_indices":
        args = token_sparse_kv_inputs(t=9 if small else 300, k=512 if small else 2048, rpt=2)
        function, ref = token_sparse.token_sparse_kv_indices, reference.token_sparse_kv_indices
        outputs, leading = ("block_tables", "seq_lens"), 3
    else:
        args = group_union_inputs(groups=3, n=4, k=512, num_keys=3000 if small else 100000)
        function, ref = token_sparse.group_union_masks, reference.group_union_masks
        outputs, leading = ("union", "union_sizes", "mask"), 5
    args = {k: a.cuda() if isinstance(a, torch.Tensor) else a for k, a in args.items()}
    want = {k: a.clone() if k in outputs else a for k, a in args.items()}
    for given, fn in ((args, function), (want, ref)):
        names = list(given)
        fn(*(given[n] for n in names[:leading]), **{n: given[n] for n in names[leading:]})
    same = all(torch.equal(args[n], want[n]) for n in outputs)
    return "every output buffer vs the reference", same


def paged_cache(xs, gen, table=None, garbage=1.0):
    """Sequences' rows (each (n, Hkv, D)) in 128-row pages of one cache (pages, Hkv, 128, D)
    of their dtype, pages in random order: (cache, page table (B, max pages + 1) int32). A
    spare page, rows past a sequence's end and table entries past its pages hold garbage
    (N(0, garbage^2)). Given a table (another tensor's), the rows go to its pages."""
    hkv, d = xs[0].shape[1:]
    counts = [-(-x.shape[0] // 128) for x in xs]
    if table is None:
        order = torch.randperm(sum(counts) + 1, generator=gen).to(torch.int32)
        table = torch.full((len(xs), max(counts, default=0) + 1), int(order[-1]), dtype=torch.int32)
        for b, pages in enumerate(order[:-1].split(counts)):
            table[b, : len(pages)] = pages
    cache = (torch.randn(sum(counts) + 1, hkv, 128, d, generator=gen) * garbage).to(xs[0].dtype)
    for b, x in enumerate(xs):
        for p in range(counts[b]):
            chunk = x[p * 128 : (p + 1) * 128]
            cache[int(table[b, p]), :, : chunk.shape[0]] = chunk.transpose(0, 1)
    return cache, table


def proxy_score_inputs(dtype, paged: bool, seq_q, seq_k, hq=4, hkv=2, seed=0, device="cpu"):
    """msa_proxy_score arguments (q, k, cu_seqlens_q, and cu_seqlens_k or page_table and
    seqused_k) for sequences of seq_q queries and seq_k keys; paged keys sit in 128-key pages
    of one cache in random order (a spare page, and page-table entries past a sequence's
    pages, point at garbage). dtype "nvfp4": msa_proxy_score_fp4's arguments instead."""
    if dtype == "nvfp4":
        return proxy_score_fp4_inputs(paged, seq_q, seq_k, hq, hkv, seed, device)
    gen = torch.Generator().manual_seed(seed)
    d = 128
    q = torch.randn(sum(seq_q), hq, d, generator=gen).to(dtype)
    keys = [torch.randn(n, hkv, d, generator=gen).to(dtype) for n in seq_k]
    cu_q = torch.tensor([0, *torch.tensor(seq_q).cumsum(0).tolist()], dtype=torch.int32)
    args = dict(q=q, cu_seqlens_q=cu_q)
    if not paged:
        args.update(
            k=torch.cat(keys),
            cu_seqlens_k=torch.tensor(
                [0, *torch.tensor(seq_k).cumsum(0).tolist()], dtype=torch.int32
            ),
        )
    else:
        cache, table = paged_cache(keys, gen, garbage=100.0)
        args.update(k=cache, page_table=table, seqused_k=torch.tensor(seq_k, dtype=torch.int32))
    return {name: t.to(device) for name, t in args.items()}


def proxy_score_fp4_inputs(paged: bool, seq_q, seq_k, hq=4, hkv=2, seed=0, device="cpu"):
    """msa_proxy_score_fp4 arguments: proxy_score_inputs' fp32 q and k (the garbage pages
    too) quantized to NVFP4 with 128x4 tiled scales, global scales that put each tensor's
    largest magnitude at 6 x 448."""
    args = proxy_score_inputs(torch.float32, paged, seq_q, seq_k, hq, hkv, seed)
    q, k = args.pop("q"), args.pop("k")
    for name, x in (("q", q), ("k", k)):
        global_scale = float(x.abs().max().clamp_min(1e-12)) / (6 * 448)
        codes, scales = reference.nvfp4_quantize_128x4(x, global_scale)
        args.update({f"{name}_fp4": codes, f"{name}_scale": scales})
        args[f"{name}_global_scale"] = global_scale
    return {name: t.to(device) if torch.is_tensor(t) else t for name, t in args.items()}


def msa_selections(seq_q, seq_k, hkv, topk, gen):
    """(Hkv, total_q, topk) int32: random ids in [-1, blocks + 1) (so -1, repeats and ids
    past the sequence occur), ascending; the first token selects nothing."""
    rows = []
    for n_q, n_k in zip(seq_q, seq_k, strict=True):
        blocks = -(-n_k // 128)
        ids = torch.randint(-1, blocks + 1, (hkv, n_q, topk), generator=gen, dtype=torch.int32)
        rows.append(ids.sort(-1).values)
    rows[0][:, 0] = -1
    return torch.cat(rows, 1)


def msa_attention_inputs(kv_format, paged, seq_q, seq_k, hq, hkv, topk=8, seed=0):
    """msa_sparse_attention arguments and reference.msa_sparse_attention's (K/V as fp32
    values: dequantized, for FP8 and NVFP4; "unquantized": the values before), on the GPU,
    for sequences of seq_q queries and seq_k keys. K/V in kv_format (bf16, fp16 (q too),
    e4m3, nvfp4: packed pages); paged K/V sit in shuffled pages with garbage past each
    sequence."""
    gen = torch.Generator().manual_seed(seed)
    q_dtype = torch.float16 if kv_format == "fp16" else torch.bfloat16
    q = torch.randn(sum(seq_q), hq, 128, generator=gen).to(q_dtype)
    keys = [torch.randn(n, hkv, 128, generator=gen) for n in seq_k]
    values = [torch.randn(n, hkv, 128, generator=gen) for n in seq_k]
    cu_q = torch.tensor([0, *torch.tensor(seq_q).cumsum(0).tolist()], dtype=torch.int32)
    q2k = msa_selections(seq_q, seq_k, hkv, topk, gen)
    kernel = dict(q=q, q2k_indices=q2k, cu_seqlens_q=cu_q)
    ref = dict(q=q.float(), q2k_indices=q2k, cu_seqlens_q=cu_q)
    if paged:
        k_cache, table = paged_cache(keys, gen)
        v_cache, _ = paged_cache(values, gen, table)
        used = torch.tensor(seq_k, dtype=torch.int32)
        kernel.update(page_table=table, seqused_k=used)
        ref.update(page_table=table, seqused_k=used)
        k_all, v_all = k_cache, v_cache
    else:
        cu_k = torch.tensor([0, *torch.tensor(seq_k).cumsum(0).tolist()], dtype=torch.int32)
        kernel.update(cu_seqlens_k=cu_k)
        ref.update(cu_seqlens_k=cu_k)
        k_all, v_all = torch.cat(keys), torch.cat(values)
    if kv_format in ("bf16", "fp16"):
        kernel.update(k=k_all.to(q_dtype), v=v_all.to(q_dtype))
        ref.update(k=k_all.to(q_dtype).float(), v=v_all.to(q_dtype).float())
    elif kv_format == "e4m3":
        k_scale, v_scale = 0.02, 0.03
        k8 = (k_all / k_scale).to(torch.float8_e4m3fn)
        v8 = (v_all / v_scale).to(torch.float8_e4m3fn)
        kernel.update(k=k8, v=v8, k_scale=k_scale, v_scale=v_scale)
        ref.update(k=k8.float() * k_scale, v=v8.float() * v_scale)
        ref["unquantized"] = (k_all.cuda(), v_all.cuda())
    else:
        k_global, v_global = 0.01, 0.02
        pages = reference.nvfp4_pack_pages(k_all, v_all, k_global, v_global)
        views = reference.nvfp4_page_views(pages, hkv)
        k_deq, v_deq = reference.nvfp4_unpack_pages(pages, hkv, k_global, v_global)
        kernel.update(
            k=views["k_data"], v=views["v_data"], k_scale=views["k_scales"],
            v_scale=views["v_scales"], k_global_scale=k_global, v_global_scale=v_global,
        )  # fmt: skip
        ref.update(k=k_deq, v=v_deq)
        ref["unquantized"] = (k_all.cuda(), v_all.cuda())
    move = lambda d: {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in d.items()}  # noqa: E731
    return move(kernel), move(ref)


def check_msa_attention(v: dict, small: bool, seed: int = 0) -> tuple[str, bool]:
    """The union tiles (portable, and wgmma at G = 16) through msa_sparse_attention with the
    variant forced; the one-token kernel (tile "token") through its route,
    msa_sparse_decode_attention (two tokens a request)."""
    from sparseforge.msa_ops import msa_sparse_attention, msa_sparse_decode_attention

    kv_format = {
        "msa_sparse_attention": v["params"]["dtype"],
        "msa_sparse_attention_fp8kv": "e4m3",
        "msa_sparse_attention_nvfp4": "nvfp4",
    }[v["family"]]
    decode = v["params"].get("tile") == "token"
    seq_q, seq_k = ([5, 1], [200, 3]) if small else ([70, 1, 33], [700, 128, 200])
    if decode:
        seq_q = [2] * len(seq_k)
    hkv = 1 if v["params"].get("tile") == "wgmma" else 4  # the wgmma tile takes G = 16
    kernel, ref = msa_attention_inputs(kv_format, True, seq_q, seq_k, 16, hkv, seed=seed)
    if kv_format in ("e4m3", "nvfp4") and v["params"]["dtype"] == "fp16":
        kernel["q"] = kernel["q"].half()
    out = torch.full_like(kernel["q"], float("nan"))
    if decode:
        kernel.pop("cu_seqlens_q")
        q, k, v_, q2k = (kernel.pop(n) for n in ("q", "k", "v", "q2k_indices"))
        got, lse = msa_sparse_decode_attention(
            q, k, v_, q2k, seqlen_q=2, return_softmax_lse=True, out=out, **kernel
        )
    else:  # prefill runs the variant SPARSEFORGE_VARIANT names (a union tile)
        os.environ["SPARSEFORGE_VARIANT"] = v["name"]
        try:
            got, lse = msa_sparse_attention(**kernel, causal=True, return_softmax_lse=True, out=out)
        finally:
            os.environ.pop("SPARSEFORGE_VARIANT")
    ref.pop("unquantized", None)
    want, want_lse, _ = reference.msa_sparse_attention(
        ref.pop("q"), ref.pop("k"), ref.pop("v"), ref.pop("q2k_indices"), ref.pop("cu_seqlens_q"),
        causal=True, **ref,
    )  # fmt: skip
    err = float((got.double() - want).norm() / want.double().norm())
    finite = torch.isfinite(want_lse)
    ok = err < (5e-3 if kv_format in ("bf16", "fp16") else 1e-2)
    ok &= torch.equal(torch.isfinite(lse), finite)
    ok &= bool((lse[finite] - want_lse[finite]).abs().max() < 2e-2)
    route = "decode, 2 tokens a request" if decode else "causal"
    return f"{kv_format} paged K/V, {route}, rel. L2 {err:.1e}", ok


def check_proxy_score(v: dict, small: bool, seed: int = 0) -> tuple[str, bool]:
    from sparseforge import msa_ops

    paged = v["params"]["key_layout"] == "paged"
    seq_q, seq_k = ([3, 70, 1], [300, 100, 0]) if small else ([1, 200, 77, 5], [5000, 700, 77, 0])
    if v["family"] == "msa_proxy_score_nvfp4":
        dtype, run, ref = "nvfp4", msa_ops.msa_proxy_score_fp4, reference.msa_proxy_score_fp4
    else:
        dtype = BY_NAME[v["params"]["dtype"]]
        run, ref = msa_ops.msa_proxy_score, reference.msa_proxy_score
    args = proxy_score_inputs(dtype, paged, seq_q, seq_k, seed=seed, device="cuda")
    ok = True
    for causal, reduce_heads in ((True, False), (False, True)):
        tiles = -(-max(seq_k) // 128) + 1  # one block more than any sequence has
        out = torch.full((1 if reduce_heads else 4, tiles, sum(seq_q)), float("nan"), device="cuda")
        run(**args, causal=causal, reduce_heads=reduce_heads, max_k_tiles=tiles, output=out)
        want = ref(**args, causal=causal, reduce_heads=reduce_heads, max_k_tiles=tiles)
        ok &= torch.equal(torch.isinf(out), torch.isinf(want))
        finite = torch.isfinite(want)
        ok &= bool((out[finite] - want[finite]).abs().max() <= 1e-5 * want[finite].abs().max())
    return "causal / non-causal + reduce_heads vs the reference", ok


def nvfp4_write_inputs(dtype, heads, tokens, pages, k_global_scale=2**-6, v_global_scale=2**-5,
                       seed=0, device="cpu"):  # fmt: skip
    """quantize_write_kv_nvfp4 arguments: k and v whose 16-channel groups span the scale
    range (tiny, ordinary, saturating, all zero, E2M1 midpoints times a representable scale:
    the global scales are powers of two, so bf16 holds the midpoints exactly; one group with
    a NaN), slots in random order over the pages with every fifth one -1, pages poisoned
    with random bytes."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(tokens, heads, 128, generator=gen) for _ in "kv")
    span = torch.logspace(-9, 4, 8)  # group magnitudes: subnormal e4m3 scales to saturation
    for x, g in ((k, k_global_scale), (v, v_global_scale)):
        x *= (
            span[torch.randint(0, 8, (tokens, heads, 8, 1), generator=gen)]
            .repeat_interleave(16, 2)
            .flatten(2)
        )
        x[0, 0, :16] = 0.0
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] * 2)
        x[1 % tokens, 0, :16] = mids * 2.0 * g  # scale 2 (e4m3-exact): ratios at the midpoints
        x[1 % tokens, 0, 0] = 12.0 * g  # the group's amax: 6 * scale
    k[2 % tokens, 0, 16:32] = float("nan")
    slots = torch.randperm(pages * 128, generator=gen)[:tokens].to(torch.int32)
    slots[::5] = -1
    page_bytes = heads * reference.NVFP4_PAGE_BYTES_PER_HEAD
    poisoned = torch.randint(0, 256, (pages, page_bytes), generator=gen, dtype=torch.uint8)
    args = dict(k=k.to(dtype), v=v.to(dtype), slots=slots, pages=poisoned)
    args = {name: t.to(device) for name, t in args.items()}
    return dict(args, k_global_scale=k_global_scale, v_global_scale=v_global_scale)


def check_nvfp4_write(v: dict, small: bool, seed: int = 0) -> tuple[str, bool]:
    from sparseforge.msa_ops import quantize_write_kv_nvfp4

    heads = 1 if small else 4
    args = nvfp4_write_inputs(
        BY_NAME[v["params"]["dtype"]], heads, tokens=20 if small else 500, pages=2 if small else 8,
        seed=seed, device="cuda",
    )  # fmt: skip
    want = nvfp4_written_pages(args)
    got = quantize_write_kv_nvfp4(**args)
    return "pages byte for byte vs the reference", torch.equal(got, want)


def nvfp4_written_pages(args: dict) -> torch.Tensor:
    """The pages reference.nvfp4_write_slots leaves for nvfp4_write_inputs' arguments (a
    copy: args' pages are untouched)."""
    pages = args["pages"].clone()
    reference.nvfp4_write_slots(
        pages, args["k"], args["v"], args["slots"], args["k"].shape[1], args["k_global_scale"],
        args["v_global_scale"],
    )  # fmt: skip
    return pages


def sdsa_quantize_inputs(dtype, keys, queries, pages, rows, seed=0, device="cpu"):
    """quantize_write_index_qk_nvfp4 arguments: keys and queries whose 16-value groups span
    the scale range (subnormal e4m3 scales to saturation beyond 2688), a zero group, a NaN
    group and E2M1 midpoints at scale 2; slots in random order over the pages and query rows
    shuffled, every fifth -1; outputs poisoned with random bytes (the key cache and its
    scales as views of one allocation of 72-byte-per-key pages)."""
    gen = torch.Generator().manual_seed(seed)
    key, query = (torch.randn(n, 128, generator=gen) for n in (keys, queries))
    span = torch.logspace(-9, 4, 8)
    for x in (key, query):
        x *= (
            span[torch.randint(0, 8, (x.shape[0], 8, 1), generator=gen)]
            .repeat_interleave(16, 1)
            .flatten(1)
        )
        x[0, :16] = 0.0
        x[min(1, x.shape[0] - 1), :16] = (
            torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] * 2) * 2.0
        )
        x[min(1, x.shape[0] - 1), 0] = 12.0
    key[min(2, keys - 1), 16:32] = float("nan")
    slots = torch.randperm(pages * 64, generator=gen)[:keys]
    slots[::5] = -1
    query_rows = torch.randperm(rows, generator=gen)[:queries]
    query_rows[::5] = -1
    cache = torch.randint(0, 256, (pages, 64 * 72), generator=gen, dtype=torch.uint8)
    packed = torch.randint(0, 256, (rows, 72), generator=gen, dtype=torch.uint8)
    args = dict(
        key=key.to(dtype), slots=slots, query=query.to(dtype), query_rows=query_rows,
        key_cache=cache[:, : 64 * 64].view(pages, 64, 64),
        key_scales=cache[:, 64 * 64 :].view(pages, 64, 8),
        packed_query=packed[:, :64], query_scales=packed[:, 64:],
    )  # fmt: skip
    return {name: t.to(device) for name, t in args.items()}


def sdsa_quantized(args: dict) -> dict:
    """The outputs reference.quantize_write_index_qk_nvfp4 leaves for sdsa_quantize_inputs'
    arguments (copies)."""
    outputs = ("key_cache", "key_scales", "packed_query", "query_scales")
    want = {name: args[name].clone() for name in outputs}
    reference.quantize_write_index_qk_nvfp4(
        args["key"], args["slots"], args["query"], args["query_rows"], **want
    )
    return want


def check_sdsa_quantize(v: dict, small: bool, seed: int = 0) -> tuple[str, bool]:
    from sparseforge.sdsa import quantize_write_index_qk_nvfp4

    keys, queries, pages, rows = (20, 6, 1, 8) if small else (3000, 300, 64, 512)
    args = sdsa_quantize_inputs(
        BY_NAME[v["params"]["dtype"]], keys, queries, pages, rows, seed=seed, device="cuda"
    )
    want = sdsa_quantized(args)
    quantize_write_index_qk_nvfp4(**args)
    same = all(torch.equal(args[name], want[name]) for name in want)
    return "keys and queries byte for byte vs the reference", same


def sdsa_paged_keys(lengths, nvfp4: bool, seed=0, device="cpu"):
    """(key_cache, key_scales or None, block_table) for requests of `lengths` keys: 64-key
    pages in random order (and a spare), BF16 or NVFP4 (reference.sdsa_nvfp4_quantize).
    Table entries past a request's pages hold 2^30, no page: a kernel that reads them
    faults."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // 64) for n in lengths]
    pages = sum(counts) + 1
    ids = torch.randperm(pages, generator=gen)[: sum(counts)].split(counts)
    table = torch.full((len(lengths), max(counts) + 1), 2**30, dtype=torch.int32)
    for r, row in enumerate(ids):
        table[r, : len(row)] = row
    values = torch.randn(pages, 64, 128, generator=gen)
    if not nvfp4:
        return values.to(torch.bfloat16).to(device), None, table.to(device)
    data, scales = reference.sdsa_nvfp4_quantize(values)
    return data.to(device), scales.view(torch.uint8).to(device), table.to(device)


def sdsa_queries(rows: int, nvfp4: bool, seed=1, device="cpu"):
    """(query, query_scales or None): random rows, BF16 or NVFP4."""
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(seed))
    if not nvfp4:
        return x.to(torch.bfloat16).to(device), None
    data, scales = reference.sdsa_nvfp4_quantize(x)
    return data.to(device), scales.view(torch.uint8).to(device)


def sdsa_candidates(rows: int, slots: int, seed=0, device="cpu"):
    """(candidates (rows, slots, 2), ranges (2, rows)) int32: random keys and stored values
    (ties, +-inf, NaN of both signs among them); per row a random range of slots, some with
    fewer pairs than 32 and one empty."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, slots, generator=gen).round(decimals=1)  # ties
    values[:, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan")])
    shift = torch.randint(0, 131, (rows, 1), generator=gen)
    keys = (torch.arange(slots)[None] * 131 + shift).to(torch.int32)  # distinct within a row
    candidates = torch.stack([keys, values.view(torch.int32)], -1)
    first = torch.randint(0, slots // 2, (rows,), generator=gen)
    end = first + torch.randint(0, slots // 2, (rows,), generator=gen)
    end[0] = first[0]  # an empty row
    ranges = torch.stack([first, end]).to(torch.int32)
    return candidates.to(device), ranges.to(device)


def same_top_k(got, want, candidates, ranges) -> bool:
    """Both tops hold the same multiset of stored values (ties may pick other keys), each
    key one of its row's range, and -1 exactly where the reference has it."""
    if not torch.equal(got < 0, want < 0):
        return False
    for r in range(got.shape[0]):
        pairs = candidates[r, int(ranges[0, r]) : int(ranges[1, r])]
        value_of = {int(k): int(v) for k, v in pairs.tolist()}
        keys_got = [int(k) for k in got[r] if k >= 0]
        keys_want = [int(k) for k in want[r] if k >= 0]
        if any(k not in value_of for k in keys_got) or len(set(keys_got)) != len(keys_got):
            return False
        if sorted(value_of[k] for k in keys_got) != sorted(value_of[k] for k in keys_want):
            return False
    return True


def sdsa_select_inputs(
    lengths, nvfp4: bool, top_k=16, slots=64, seed=0, device="cpu", fitting=False
):
    """indexer_threshold_select arguments for one 128-row tile per request of `lengths` keys:
    rows see up to their request's length (some fewer); each row's threshold lies midway in
    the widest gap between its scores near a random rank (so fp32 rounding cannot move a
    key across it), with `fitting` a rank from top_k to the slots' capacity, where a row
    needs no repair; three rows get +inf, -inf and NaN (everything a tie)."""
    gen = torch.Generator().manual_seed(seed)
    cache, key_scales, table = sdsa_paged_keys(lengths, nvfp4, seed, device)
    query, query_scales = sdsa_queries(128 * len(lengths), nvfp4, seed + 1, device)
    row_ends = torch.tensor([n for n in lengths for _ in range(128)], dtype=torch.int32)
    row_ends[1::7] //= 3
    q = reference.sdsa_dequantize(query, query_scales).double().cpu()
    thresholds = torch.empty(len(row_ends))
    for r in range(len(row_ends)):
        keys = reference.sdsa_request_keys(
            cache.cpu(), table.cpu(), r // 128, int(row_ends[r]),
            None if key_scales is None else key_scales.cpu(),
        )  # fmt: skip
        score = (keys.double() @ q[r]).sort(descending=True).values
        if score.numel() < 2:
            thresholds[r] = 0.0
            continue
        low, high = (top_k + 3, slots - top_k - 4) if fitting else (0, score.numel() - 1)
        high = min(high, score.numel() - 1)
        rank = int(torch.randint(min(low, high - 1), high, (1,), generator=gen))
        near = slice(max(rank - 3, 0), min(rank + 4, score.numel() - 1))
        gaps = score[near] - score[near.start + 1 : near.stop + 1]
        at = near.start + int(gaps.argmax())
        thresholds[r] = float((score[at] + score[at + 1]) / 2)
    thresholds[:3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    args = dict(
        query=query, key_cache=cache, row_ends=row_ends.to(device),
        tile_requests=torch.arange(len(lengths), dtype=torch.int32, device=device),
        block_table=table, thresholds=thresholds.to(device),
        counters=torch.zeros(len(row_ends), 2, dtype=torch.int32, device=device),
        candidates=torch.full((len(row_ends), slots, 2), -7, dtype=torch.int32, device=device),
        max_context=max(lengths), top_k=top_k, query_scales=query_scales, key_scales=key_scales,
    )  # fmt: skip
    return args


def same_selection(got: dict, want: dict) -> bool:
    """The kernel's counters equal the reference's, and each row's stored candidates and
    ties are distinct keys of the right class (any of them where more than fit), with
    stored values within 1e-4 of the reference's."""
    if not torch.equal(got["counters"].cpu(), want["counters"].cpu()):
        return False
    top_k = want["top_k"]
    cap = want["candidates"].shape[1] - top_k
    for r in range(want["counters"].shape[0]):
        cands, ties = (int(x) for x in want["counters"][r])
        g, w = got["candidates"][r].cpu(), want["candidates"][r].cpu()
        for part in (slice(top_k, top_k + min(cands, cap)), slice(top_k - min(ties, top_k), top_k)):
            keys = g[part, 0].tolist()
            if len(set(keys)) != len(keys):
                return False
        # The reference stores the first ones in key order; the kernel any: compare values
        # where every key of the class was stored.
        if cands <= cap:
            mine = dict(g[top_k : top_k + cands].tolist())
            theirs = dict(w[top_k : top_k + cands].tolist())
            if mine.keys() != theirs.keys():
                return False
            as_float = lambda b: torch.tensor([b], dtype=torch.int32).view(torch.float32)  # noqa: E731
            if any(
                abs(float(as_float(mine[k]) - as_float(theirs[k])))
                > 1e-4 * max(1.0, abs(float(as_float(theirs[k]))))
                for k in mine
            ):
                return False
    return True


# Keys of each request's 128-row tile in the select / repair checks, by `small`: small keeps
# a partial page and a second request and stays short under racecheck (which took minutes
# for [300, 129]).
SDSA_SELECT_LENGTHS = {False: [5000, 64, 4097], True: [150, 65]}


def check_sdsa(v: dict, small: bool, seed: int = 0) -> tuple[str, bool]:
    """sdsa_scores / sdsa_sample / sdsa_thresholds against the reference."""
    from sparseforge import sdsa

    nvfp4 = v["params"].get("dtype") == "u8"
    lengths = [300, 0, 64] if small else [5000, 0, 64, 4097]
    cache, key_scales, table = sdsa_paged_keys(lengths, nvfp4, seed, "cuda")
    if v["family"] == "sdsa_scores":
        query, query_scales = sdsa_queries(2 * len(lengths), nvfp4, seed + 1, "cuda")
        args = dict(
            requests=torch.arange(len(lengths) - 1, -1, -1, dtype=torch.int32, device="cuda"),
            query_scales=query_scales, key_scales=key_scales,
        )  # fmt: skip
        context = torch.tensor(lengths[::-1], dtype=torch.int32, device="cuda")
        got = torch.full((2 * len(lengths), max(lengths)), float("nan"), device="cuda")
        want = got.clone()
        sdsa.indexer_scores(query, cache, table, context, scores=got, **args)
        reference.indexer_scores(query, cache, table, context, scores=want, **args)
        same = torch.equal(got.isnan(), want.isnan())
        close = bool((got - want).nan_to_num().abs().max() <= 1e-4 * want.nan_to_num().abs().max())
        return "scores vs the reference", same and close
    if v["family"] == "sdsa_sample":
        cap = 128
        offsets = torch.randint(0, 64, (cap,), dtype=torch.uint8, device="cuda")
        # Up to the row's last page (16 samples a page), one row short of it.
        ends = [min(cap, -(-n // 64) * 16) for n in lengths]
        ends[-1] -= 7
        ends = torch.tensor(ends, dtype=torch.int32, device="cuda")
        width = 64 if nvfp4 else 128
        got = torch.full((len(lengths), cap, width), 7, dtype=cache.dtype, device="cuda")
        scales = (
            torch.full((len(lengths), cap, 8), 7, dtype=torch.uint8, device="cuda")
            if nvfp4
            else None
        )
        want, want_scales = got.clone(), None if scales is None else scales.clone()
        kw = dict(samples_per_run=16, pages_per_run=1, key_scales=key_scales)
        sdsa.gather_key_sample(
            cache, table, offsets, ends, sample_keys=got, sample_scales=scales, **kw
        )
        reference.gather_key_sample(
            cache, table, offsets, ends, sample_keys=want, sample_scales=want_scales, **kw
        )
        same = torch.equal(got, want) and (scales is None or torch.equal(scales, want_scales))
        return "sample rows byte for byte vs the reference", same
    if v["family"] == "sdsa_select":
        got = sdsa_select_inputs(SDSA_SELECT_LENGTHS[small], nvfp4, seed=seed, device="cuda")
        want = {**got, "counters": got["counters"].clone(), "candidates": got["candidates"].clone()}
        sdsa.indexer_threshold_select(**got)
        reference.indexer_threshold_select(**want)
        return "counters, candidates and ties vs the reference", same_selection(got, want)
    if v["family"] == "sdsa_repair":
        # Small: most rows fit and every 41st misses; else rows miss at random and every
        # 5th. A cluster repairs its rows one after the other, four radix passes each (slow
        # under racecheck).
        got = sdsa_select_inputs(
            SDSA_SELECT_LENGTHS[small], nvfp4, seed=seed, device="cuda", fitting=small
        )
        got["thresholds"][3 :: 41 if small else 5] = float("inf")
        want = {**got, "counters": got["counters"].clone(), "candidates": got["candidates"].clone()}
        want["thresholds"] = got["thresholds"].clone()
        rows = got["query"].shape[0]
        repair = [
            dict(
                arrivals=torch.zeros(rows // 128, dtype=torch.int32, device="cuda"),
                ranges=torch.full((2, rows), -5, dtype=torch.int32, device="cuda"),
            )
            for _ in range(2)
        ]
        sdsa.indexer_threshold_select(**got, **repair[0])
        reference.indexer_threshold_select(**want, **repair[1])
        same = same_selection(got, want) and torch.equal(repair[0]["ranges"], repair[1]["ranges"])
        close = torch.allclose(got["thresholds"], want["thresholds"], rtol=1e-4, equal_nan=True)
        return "repaired thresholds, counters, candidates and ranges vs the reference", (
            same and close
        )
    if v["family"] == "sdsa_topk":
        candidates, ranges = sdsa_candidates(40 if small else 600, 300, seed, "cuda")
        got = torch.full((candidates.shape[0], 32), -9, dtype=torch.int32, device="cuda")
        want = got.clone()
        sdsa.top_k_from_candidates(candidates, ranges, top_keys=got)
        reference.top_k_from_candidates(candidates, ranges, top_keys=want)
        return "top-K keys as score multisets vs the reference", same_top_k(
            got, want, candidates, ranges
        )
    rows = 70 if small else 3000
    scores = torch.randn(rows, 256, device="cuda")
    scores[0, 3] = float("nan")
    top = torch.randint(-1, 256, (rows, 33), dtype=torch.int32, device="cuda")
    thresholds, counters = (
        torch.zeros(rows, device="cuda"),
        torch.ones(rows, 2, dtype=torch.int32, device="cuda"),
    )
    want, want_counters = thresholds.clone(), counters.clone()
    sdsa.thresholds_from_sample(scores, top, thresholds=thresholds, counters=counters)
    reference.thresholds_from_sample(scores, top, thresholds=want, counters=want_counters)
    same = torch.equal(thresholds, want) and torch.equal(counters, want_counters)
    return "thresholds and counters vs the reference", same


def check_topk_select(small: bool, seed: int = 0) -> tuple[str, bool]:
    from sparseforge.msa_ops import msa_topk_select

    heads, blocks, tokens = (2, 40, 70) if small else (8, 256, 2000)
    score, valid = topk_scores(heads, blocks, tokens, seed)
    score, valid = score.cuda(), valid.cuda()
    got = msa_topk_select(score, 16, valid, None, 1, 1)
    same = torch.equal(got, reference.msa_topk_select(score, 16, valid, 1, 1))
    return "ids vs the reference", same


def icp_e4m3(*shape, generator, scale=2.0, integer=False):
    if integer:
        return torch.randint(-2, 3, shape, generator=generator).float().to(torch.float8_e4m3fn)
    return (torch.randn(*shape, generator=generator) * scale).to(torch.float8_e4m3fn)


def icp_sharded_problem(
    keys, queries, world, page, seed, q_offsets=None, spare_pages=3, integer=False
):
    """Sequences of `keys` keys and `queries` query tokens (the last ones of each sequence,
    unless q_offsets), sharded over `world` ranks in pages of `page` keys: physical pages out
    of order, unused pages and rows past a sequence's end filled with large garbage, table
    entries past a sequence's pages an id outside the shard. A dict (CPU tensors): per
    sequence its keys, e4m3 queries, query offset and positions; the block table, every
    rank's shard. integer: keys and queries in {-2, ..., 2}, so that every scorer's sums are
    exact (scores equal the reference's bit for bit, with many ties)."""
    g = torch.Generator().manual_seed(seed)
    rows = page // world
    pages = [-(-n // page) for n in keys]
    physical = torch.randperm(sum(pages) + spare_pages, generator=g).int()
    width = max(pages) + 1
    table = torch.full((len(keys), width), 10**6, dtype=torch.int32)  # past the shard
    shards = [icp_e4m3(len(physical), rows, 128, generator=g, scale=40.0) for _ in range(world)]
    seqs, first = [], 0
    for b, (n, t) in enumerate(zip(keys, queries, strict=True)):
        table[b, : pages[b]] = physical[first : first + pages[b]]
        first += pages[b]
        k = icp_e4m3(n, 128, generator=g, integer=integer)
        q = icp_e4m3(t, ICP_HEADS, 128, generator=g, integer=integer)
        offset = n - t if q_offsets is None else q_offsets[b]
        for r in range(world):
            held = reference_icp.shard_keys(n, world, r, page)  # (pages, rows) global keys
            for c in range(pages[b]):
                live = held[c] < n
                shards[r][table[b, c], live] = k[held[c][live]]
        seqs.append(dict(k=k.float(), q=q, offset=offset, positions=offset + torch.arange(t)))
    return dict(seqs=seqs, table=table, shards=shards, pages=pages, world=world, page=page)


def icp_expected_rank_scores(p, rank, compact, width):
    """(T, 4, width) the rank's scores per the contract (-inf where no page fills)."""
    out = []
    for s, n_pages in zip(p["seqs"], p["pages"], strict=True):
        scores = reference_icp.key_scores(s["q"].float(), s["k"])
        local = reference_icp.rank_scores(scores, s["positions"], p["world"], rank, p["page"])
        plane = torch.full((local.shape[0], ICP_HEADS, width), -math.inf)
        if p["page"] == 256 and not compact:
            ids = reference_icp.block_ids(s["k"].shape[0], p["world"], rank, p["page"])
            plane[..., ids] = local
        else:
            plane[..., :n_pages] = local
        out.append(plane)
    return torch.cat(out)


def icp_close_scores(got, want) -> bool:
    """Finite scores within the FP8 wgmma accumulator's error of the fp64 ones (2e-3 of the
    largest; a GPU test of msa_proxy_score read 4.2e-4 with it), -inf exactly where the
    reference has -inf."""
    if not torch.equal(torch.isinf(got), torch.isinf(want)):
        return False
    finite = ~torch.isinf(want)
    if not finite.any():
        return True
    err = (got[finite] - want[finite]).abs().max().item()
    return err <= 2e-3 * want[finite].abs().max().item() + 1e-3


def icp_random_scores(tokens, columns, seed):
    """Scores with many exact ties, NaN, -0, +0 and -inf."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-6, 7, (tokens, ICP_HEADS, columns), generator=g).float() / 4
    u = torch.rand(s.shape, generator=g)
    s[u < 0.03] = math.nan
    s[(u >= 0.03) & (u < 0.06)] = -0.0
    s[(u >= 0.06) & (u < 0.1)] = -math.inf
    return s


def icp_random_carriers(world, tokens, blocks, seed):
    """(W, hpr, T, 33) exchanged carrier rows: ascending ids (some repeated across ranks,
    some past nvp or 8192), -1 padding, NaN and -0 scores."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.empty(world, ICP_HEADS // world, tokens, ICP_WORDS, dtype=torch.int32)
    for index in range(world * (ICP_HEADS // world) * tokens):
        count = int(torch.randint(0, ICP_TOPK + 1, (1,), generator=g))
        ids = torch.randperm(blocks, generator=g)[:count].sort().values
        scores = torch.randint(-3, 4, (count,), generator=g).float()
        scores[torch.rand(count, generator=g) < 0.1] = math.nan
        scores[torch.rand(count, generator=g) < 0.1] = -0.0
        row = rows.view(-1, ICP_WORDS)[index]
        row[:ICP_TOPK] = torch.full((ICP_TOPK,), -math.inf).view(torch.int32)
        row[ICP_TOPK : 2 * ICP_TOPK] = -1
        row[:count] = scores.view(torch.int32)
        row[ICP_TOPK : ICP_TOPK + count] = ids.int()
        row[-1] = 1
    return rows


def icp_window(p, keys):
    """(the queries on the GPU, the scorer's plan) of a sharded problem's prefill window."""
    from sparseforge import msa_icp

    seqs = p["seqs"]
    plan = msa_icp.msa_icp_index_score_sharded_plan(
        torch.tensor([s["q"].shape[0] for s in seqs], dtype=torch.int32),
        torch.tensor(keys, dtype=torch.int32), 4,
        qo_offset=torch.tensor([s["offset"] for s in seqs], dtype=torch.int32),
    )  # fmt: skip
    return torch.cat([s["q"] for s in seqs]).cuda(), plan


def icp_scores_match(v: dict, small: bool, seed: int) -> bool:
    """msa_icp_score's prefill scores of every rank of the layout of the variant's rows a
    page (P128 over 4 / 2 ranks, P256 over 2) against rank_scores."""
    from sparseforge import msa_icp

    world, page = {32: (4, 128), 64: (2, 128), 128: (2, 256)}[v["params"]["shard_rows"]]
    keys = [300, 900] if small else [700, 5000]
    p = icp_sharded_problem(keys, [40, 100], world, page, seed)
    same = True
    for rank in range(world):
        q, plan = icp_window(p, keys)
        width = msa_icp.msa_icp_index_score_columns(max(keys), page)
        out = torch.full((q.shape[0], ICP_HEADS, width), math.nan, device="cuda")
        msa_icp.msa_icp_index_score_sharded(
            q, p["shards"][rank].cuda(), p["table"].cuda(), plan, rank=rank, max_score=out,
            tp=world, compact=True,
        )  # fmt: skip
        same = same and icp_close_scores(out.cpu(), icp_expected_rank_scores(p, rank, True, width))
    return same


def icp_fused_prefill_match(v: dict, small: bool, seed: int) -> bool:
    """msa_icp_prefill_score_select's carrier rows of every rank of the layout of the list
    scorer's rows a page, on integer keys and queries (exact scores, many ties; forced
    blocks, random nvp), word for word against local_top16 of the reference's scores."""
    from sparseforge import msa_icp

    world, page = {32: (4, 128), 64: (2, 128), 128: (2, 256)}[v["params"]["shard_rows"]]
    keys = [300, 900] if small else [700, 5000]
    p = icp_sharded_problem(keys, [40, 100], world, page, seed, integer=True)
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(s["q"].shape[0] for s in p["seqs"])
    width = msa_icp.msa_icp_index_score_columns(max(keys), 128)
    nvp = torch.randint(0, width + 2, (tokens,), generator=gen, dtype=torch.int32)
    same = True
    for rank in range(world):
        q, plan = icp_window(p, keys)
        pool = torch.full(
            (msa_icp.msa_icp_prefill_pool_bytes(total_q=tokens, batch=2, device=q.device),),
            0x7F, dtype=torch.uint8, device="cuda",
        )  # fmt: skip
        carrier = torch.full((ICP_HEADS, tokens, ICP_WORDS), -7, dtype=torch.int32, device="cuda")
        msa_icp.msa_icp_prefill_score_select(
            q, p["shards"][rank].cuda(), p["table"].cuda(), plan, nvp.cuda(), pool, carrier,
            rank=rank, tp=world, force_begin_blocks=1, force_end_blocks=2,
        )  # fmt: skip
        scores = icp_expected_rank_scores(p, rank, False, width) + 0.0  # -0 as +0
        want = reference_icp.local_top16(scores, torch.arange(width), nvp, 1, 2)
        same = same and torch.equal(carrier.cpu(), want.transpose(0, 1))
    return same


def icp_random_lists(splits, tokens, blocks, seed):
    """(S, 4, T, 32) lists as the list scorer writes them: distinct ids within a row (some
    past nvp or 8192), scores with ties, (-inf, -1) entries, in no order."""
    g = torch.Generator().manual_seed(seed)
    lists = torch.empty(splits, ICP_HEADS, tokens, 2 * ICP_TOPK, dtype=torch.int32)
    for h in range(ICP_HEADS):
        for t in range(tokens):
            ids = torch.randperm(blocks, generator=g)[: splits * ICP_TOPK].int()
            scores = torch.randint(-3, 4, (splits * ICP_TOPK,), generator=g).float() / 2 + 0.0
            empty = torch.rand(splits * ICP_TOPK, generator=g) < 0.2
            ids[empty] = -1
            scores[empty] = -math.inf
            lists[:, h, t, :ICP_TOPK] = scores.view(torch.int32).view(splits, ICP_TOPK)
            lists[:, h, t, ICP_TOPK:] = ids.view(splits, ICP_TOPK)
    return lists


def check_icp(v: dict, small: bool, seed: int = 0) -> tuple[str, bool]:
    """msa_icp_score (the variant forced): ragged prefill sequences sharded in the layout of
    its rows a page, against rank_scores; the select and the merge: tied, NaN, -0 and -inf
    scores, forced blocks, nvp 0 and past 8192, word for word against local_top16 and
    merge."""
    from sparseforge import msa_icp

    family, gen = v["family"], torch.Generator().manual_seed(seed)
    if family in ("msa_icp_score", "msa_icp_list_score"):
        os.environ["SPARSEFORGE_VARIANT"] = v["name"]
        try:
            if family == "msa_icp_score":
                return "scores vs the reference", icp_scores_match(v, small, seed)
            return "fused carrier rows vs the reference", icp_fused_prefill_match(v, small, seed)
        finally:
            os.environ.pop("SPARSEFORGE_VARIANT")
    tokens = 9 if small else 300
    nvp = torch.randint(0, 9000, (tokens,), generator=gen, dtype=torch.int32)
    nvp[0] = 0
    if family == "msa_icp_select":
        scores = icp_random_scores(tokens, 4600 if small else 9000, seed)
        ids = torch.arange(scores.shape[2]) * 2 + 1
        carrier = torch.full((ICP_HEADS, tokens, ICP_WORDS), -7, dtype=torch.int32, device="cuda")
        msa_icp.msa_icp_topk_select_prefill(
            scores.cuda(), nvp.cuda(), carrier, force_begin_blocks=2, force_end_blocks=1,
            index_scale=2, index_offset=1,
        )  # fmt: skip
        want = reference_icp.local_top16(scores, ids, nvp, 2, 1).transpose(0, 1)
        return "carrier rows vs the reference", torch.equal(carrier.cpu(), want)
    if family == "msa_icp_list_merge":
        lists = icp_random_lists(3, tokens, 9000, seed)
        carrier = torch.full((ICP_HEADS, tokens, ICP_WORDS), -7, dtype=torch.int32, device="cuda")
        msa_icp.merge_lists_into_carrier(lists.cuda(), nvp.cuda(), carrier, 2, 1)
        want = reference_icp.lists_top16(lists, nvp, 2, 1)
        return "carrier rows vs the reference", torch.equal(carrier.cpu(), want)
    rows = icp_random_carriers(4, tokens, 9000, seed)
    out = torch.full((tokens, 1, ICP_TOPK), -7, dtype=torch.int32, device="cuda")
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    msa_icp.msa_icp_merge_candidates(
        rows.cuda(), nvp.cuda(), out, errors, init_blocks=1, local_blocks=2, prefill=True
    )
    want = reference_icp.merge(rows, nvp, 1, 2)
    return "merged ids vs the reference", torch.equal(out.cpu(), want) and errors.item() == 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as bytes (NaN codes compare equal), others as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# The families with checks of their own. The others: tile_compact and unit_order run in
# every attention plan, selection_mask in those of q2k_indices (GPU tests compare it with
# sparsity.selection_block_mask), msa_attention_combine in the decode checks (their small
# batches split), the sage_quantize_stats check launches sage_quantize_kv too.
CHECKED_FAMILIES = (
    *ATTENTION_FAMILIES,
    QUANTIZER_FAMILY,
    TOPK_FAMILY,
    *PROXY_FAMILIES,
    NVFP4_WRITE_FAMILY,
    SDSA_QUANTIZE_FAMILY,
    *SDSA_FAMILIES,
    *MSA_ATTENTION_FAMILIES,
    *TOKEN_SPARSE_FAMILIES,
    ROPE_FAMILY,
    *ICP_FAMILIES,
)


def check_variant(v: dict, small: bool) -> list[tuple[str, bool]]:
    """(what, passed) of each case of the variant with manifest entry v, on the current GPU."""
    family = v["family"]
    if family == QUANTIZER_FAMILY:
        return [check_quantizer(v, small)]
    if family == TOPK_FAMILY:
        return [check_topk_select(small)]
    if family in PROXY_FAMILIES:
        return [check_proxy_score(v, small)]
    if family == NVFP4_WRITE_FAMILY:
        return [check_nvfp4_write(v, small)]
    if family == SDSA_QUANTIZE_FAMILY:
        return [check_sdsa_quantize(v, small)]
    if family in SDSA_FAMILIES:
        return [check_sdsa(v, small)]
    if family in MSA_ATTENTION_FAMILIES:
        return [check_msa_attention(v, small)]
    if family in TOKEN_SPARSE_FAMILIES:
        return [check_token_sparse(v, small)]
    if family == ROPE_FAMILY:
        return [check_rope(v, small)]
    if family in ICP_FAMILIES:
        return [check_icp(v, small)]
    return [check_attention(v, block, small) for block in (64, 128)]


def shard_spec(text: str) -> tuple[int, int]:
    """--shard's "I/N" as (I, N), 0 <= I < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes I/N, got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard {text}: needs 0 <= I < N")
    return index, count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", help="only this variant")
    parser.add_argument("--family", help="only variants of families whose name starts so")
    parser.add_argument("--small", action="store_true", help="small problems (for sanitizers)")
    parser.add_argument(
        "--shard",
        type=shard_spec,
        default=(0, 1),
        metavar="I/N",
        help="only every N-th chosen variant from the I-th (0 <= I < N): N processes side by "
        "side check them all (tests/test_gpu_sanitizer.py runs the sanitizers so)",
    )
    args = parser.parse_args(argv)
    # Every variant is checked here, each on its own: no first-use self-checks besides.
    os.environ["SPARSEFORGE_SELFTEST"] = "0"
    arch = arch_for_device(torch.cuda.current_device())
    chosen = [
        v
        for v in _library.manifest()["variants"]
        if v["family"] in CHECKED_FAMILIES
        and v["arch"] == arch
        and args.variant in (None, v["name"])
        and v["family"].startswith(args.family or "")
    ]
    if not chosen:
        print(f"no variant to check for {arch} in {_library.PACKAGE_DIR} {args.variant or ''}")
        return 1
    index, count = args.shard
    chosen = chosen[index::count]
    cases = failed = 0
    for v in chosen:
        for what, ok in check_variant(v, args.small):
            cases += 1
            failed += not ok
            print(f"{v['name']} {what} {'ok' if ok else 'FAILED'}", flush=True)
    print(f"{len(chosen)} variants, {cases} cases, {failed} failed ({_library.PACKAGE_DIR})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
