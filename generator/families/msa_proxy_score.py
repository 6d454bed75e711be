"""MSA proxy score: per (query head, 128-key block, query token), the max of the unscaled q.k
over the keys of the block the token may see (msa_ops.msa_proxy_score).

A key is visible when it lies inside its sequence (paged: in a block whose page id lies
inside the cache) and, with causal, at a position <= the query's, q_offset[b] + i. A block
with no visible key gets -inf, and so does every block from the sequence's last visible one
up to the output's width (max_k_tiles). Keys come flat
((total_k, Hkv, D) with cu_seqlens_k) or paged ((pages, Hkv, 128, D) with a page table and
seqused_k): one variant per key layout.

msa_proxy_score_nvfp4 (msa_ops.msa_proxy_score_fp4) scores NVFP4 q and k: e2m1 codes, two a
byte (the even element in the low nibble), with one e4m3 scale per 16 values in the cuBLAS
128x4 tiled layout (generator/kernels/common/nvfp4.py: scale_offset_128x4), indexed by a
logical row: token * Hq + head for q, token * Hkv + head for flat k, (page * Hkv + head) *
128 + row for paged k. The scores are those of the dequantized values times logit_scale (the
product of the global scales).
"""

from generator.abi import ScalarArg, TensorArg
from generator.family import ALL_ARCHS, Family, Template

BLOCK_KEYS = 128  # keys per scored block (= page size of the paged form)
QUERY_ROWS = 64  # query rows of one CTA
HEAD_DIM = 128
DTYPES = ("bf16", "fp16", "e4m3")  # e4m3: q and k both
KEY_LAYOUTS = ("flat", "paged")
NVFP4_GROUP = 16  # values per e4m3 scale
# How a variant sums the products: "fp32" (within 1e-5 of the exact sum: use_fp32_acc=True;
# sm_90a converts e4m3 tiles to fp16 for it) or "fp8": Hopper's FP8 wgmma, whose accumulator
# is not a full fp32 one (a GPU test read errors of 4.2e-4 of the largest score, at S 5000,
# where fp32 sums are within 1e-5), for use_fp32_acc=False, which asks for no more than fp16
# accumulation.
ACCUMULATE = {"bf16": ("fp32",), "fp16": ("fp32",), "e4m3": ("fp32", "fp8")}


def abi(head_dim=HEAD_DIM):
    """mQ         (total_q, Hq, D)
    mK         flat: (total_k, Hkv, D); paged: (pages * Hkv, 128, D), the cache viewed so
    mCuQ       (B + 1,)      i32: query offsets of the sequences
    mCuK       (B + 1,)      i32: key offsets (flat; any one-element tensor when paged)
    mSeqUsedK  (B,)          i32: keys of each sequence (paged; one element when flat)
    mPageTable (B, W)        i32: page ids (paged; one element when flat)
    mQOffset   (B,)          i32: position of each sequence's first query (if has_q_offset)
    mOut       (Hq or 1, T, total_q) f32 out
    max_seqlen_q, kv_heads   the grid's query tiles come from the first; GQA from the second
    causal, has_q_offset, reduce_heads   0 or 1 (reduce_heads: one output row, max over heads)"""
    vector = dict(shape=(None,), stride=(1,))
    # Strides in multiples of 16 elements: 16-byte loads for e4m3 as for 16-bit (the rows of
    # 128 channels give that).
    return (
        TensorArg(
            "mQ", "input", shape=(None, None, head_dim), stride=(None, None, 1), divisibility=16
        ),
        TensorArg(
            "mK", "input", shape=(None, None, head_dim), stride=(None, None, 1), divisibility=16
        ),
        TensorArg("mCuQ", "i32", **vector),
        TensorArg("mCuK", "i32", **vector),
        TensorArg("mSeqUsedK", "i32", **vector),
        TensorArg("mPageTable", "i32", shape=(None, None), stride=(None, 1)),
        TensorArg("mQOffset", "i32", **vector),
        TensorArg("mOut", "f32", shape=(None, None, None), stride=(None, None, 1), output=True),
        ScalarArg("max_seqlen_q", "i32"),
        ScalarArg("kv_heads", "i32"),
        ScalarArg("causal", "i32"),
        ScalarArg("has_q_offset", "i32"),
        ScalarArg("reduce_heads", "i32"),
    )


def abi_nvfp4(head_dim=HEAD_DIM):
    """mQ         (total_q, Hq, D / 2) u8: e2m1 codes, two a byte
    mK         flat: (total_k, Hkv, D / 2); paged: (pages * Hkv, 128, D / 2), the cache viewed so
    mQScale, mKScale   u8 vectors: the e4m3 scales in the 128x4 tiled layout
    ... then abi()'s index tensors, output and scalars, and
    logit_scale  f32: what the dequantized q.k is multiplied by (q_global * k_global)"""
    codes = dict(shape=(None, None, head_dim // 2), stride=(None, None, 1), divisibility=16)
    vector = dict(shape=(None,), stride=(1,))
    _, _, *rest = abi(head_dim)
    return (
        TensorArg("mQ", "u8", **codes),
        TensorArg("mK", "u8", **codes),
        TensorArg("mQScale", "u8", **vector),
        TensorArg("mKScale", "u8", **vector),
        *rest,
        ScalarArg("logit_scale", "f32"),
    )


CONSTANTS = {"block_keys": BLOCK_KEYS, "head_dim": HEAD_DIM}
FAMILIES = (
    Family(
        name="msa_proxy_score",
        doc="MSA proxy score: max of q.k per 128-key block, bf16 / fp16 / e4m3 (msa_proxy_score)",
        abi=abi,
        dtypes=DTYPES,
        constants=CONSTANTS,
        templates=(
            # wgmma (e4m3: ACCUMULATE).
            Template(
                "sm90_wgmma",
                "generator.kernels.sm90.msa_proxy_score",
                mma="wgmma",
                archs=("sm_90a",),
                configs=tuple(
                    dict(dtype=t, head_dim=HEAD_DIM, key_layout=layout, accumulate=acc)
                    for t in DTYPES
                    for acc in ACCUMULATE[t]
                    for layout in KEY_LAYOUTS
                ),
            ),
            # mma.sync on every arch (e4m3: m16n8k32, exact products summed in fp32; on sm_90a
            # and sm_100f through fp16 MMAs), built for sm_90a too.
            Template(
                "warp_mma",
                "generator.kernels.portable.msa_proxy_score",
                mma="mma.sync",
                archs=ALL_ARCHS,
                configs=tuple(
                    dict(dtype=t, head_dim=HEAD_DIM, key_layout=layout, accumulate="fp32")
                    for t in DTYPES
                    for layout in KEY_LAYOUTS
                ),
                portable=True,
            ),
        ),
    ),
    Family(
        name="msa_proxy_score_nvfp4",
        doc="MSA proxy score of NVFP4 q and k (msa_proxy_score_fp4)",
        abi=abi_nvfp4,
        constants=CONSTANTS,
        templates=(
            # mma.sync on every arch, the codes decoded to fp16 (exactly) in shared memory;
            # SM120's block-scaled FP4 MMA is to come.
            Template(
                "warp_mma",
                "generator.kernels.portable.msa_proxy_score",
                mma="mma.sync",
                archs=ALL_ARCHS,
                configs=tuple(dict(head_dim=HEAD_DIM, key_layout=layout) for layout in KEY_LAYOUTS),
                portable=True,
            ),
        ),
    ),
)
