"""MSA sparse attention: every query token, per kv head, attends to its own list of 128-key
blocks (msa_ops.msa_sparse_attention and msa_sparse_decode_attention).

Query (i, h) of sequence b sees the keys of the blocks listed in q2k[h // G, i] (-1 entries,
repeats, ids past the sequence's blocks and, paged, blocks whose page id lies outside the
cache ignored) that lie inside the sequence and, with causal, at positions <=
q_offset[b] + i. out = softmax(scale * q.k) V * out_scale; lse and
the temperature lse (scale * temperature) in natural log; a query that sees no key gets 0
and -inf.

K/V come in three formats, one family each (the ABI's K/V element types differ):
    msa_sparse_attention          K/V in q's dtype (bf16 / fp16)
    msa_sparse_attention_fp8kv    e4m3 K/V; their per-tensor scales fold into scale and
                                  out_scale
    msa_sparse_attention_nvfp4    e2m1 K/V data (two codes a byte, the even element in the
                                  low nibble) with one e4m3 scale per 16 values (K scales
                                  linear, V scales in the 4x4 swizzle of the packed page);
                                  global scales fold into scale and out_scale
and in one of two layouts, told apart at run time: paged, (pages, Hkv, 128, X) with a page
table, or flat, the same view with one "page" (1, Hkv, total_k, X) and cu_seqlens_k.
"""

import functools

from generator.abi import ScalarArg, TensorArg
from generator.family import ALL_ARCHS, Family, Template

BLOCK_KEYS = 128  # keys per selected block (= page size of the paged form)
HEAD_DIM = 128
TILE_ROWS = 64  # rows of a CTA: (tokens of one sequence) x (query heads of one kv head)
MAX_TOPK = 32
MAX_GROUP = 16  # query heads per kv head
WGMMA_GROUP = 16  # the sm_90a template's G (4 tokens x 16 heads a CTA)
# A CTA keeps the union of its tokens' blocks as a bitmap over the sequence's blocks.
MAX_BLOCKS = 16384  # per sequence: 2M keys
MAX_SPLITS = 16  # CTAs a tile's keys may be split across (the runtime picks, for small grids)
NVFP4_GROUP = 16  # values per e4m3 scale
Q_DTYPES = ("bf16", "fp16")
# family -> the kernels' name of its K/V format
KV_FORMAT = {
    "msa_sparse_attention": "16bit",
    "msa_sparse_attention_fp8kv": "e4m3",
    "msa_sparse_attention_nvfp4": "nvfp4",
}
KV_FORMATS = {  # family -> (K/V element type, bytes of a 128-value row)
    "msa_sparse_attention": ("input", 256),
    "msa_sparse_attention_fp8kv": ("e4m3", 128),
    "msa_sparse_attention_nvfp4": ("u8", 64),
}


def abi(head_dim=HEAD_DIM, kv_dtype="input"):
    """mQ          (total_q, Hq, D)
    mK, mV      (pages, Hkv, rows, X): paged (rows = 128) or flat (one page of total_k rows);
                X = D, or D / 2 bytes for NVFP4
    mKScale, mVScale   (pages, Hkv, rows, D / 16) u8: the NVFP4 scales' e4m3 bytes, rows
                contiguous, page and head strides multiples of 16 (any such tensor otherwise)
    mIdx        (Hkv, total_q, topk) i32: each token's blocks, -1 for none
    mCuQ        (B + 1,) i32: query offsets of the sequences
    mCuK        (B + 1,) i32: key offsets (flat; any one-element tensor when paged)
    mSeqUsedK   (B,)     i32: keys of each sequence (paged; one element when flat)
    mPageTable  (B, W)   i32: page ids (paged; one element when flat)
    mQOffset    (B,)     i32: position of each sequence's first query (if has_q_offset)
    mO          (total_q, Hq, D) out, q's dtype
    mLSE, mLSET (total_q, Hq) f32 out: lse and temperature lse (written if want_lse)
    mOSplit     (S, total_q, Hq, D) f32 out, with splits S > 1: each split's normalized O
                (times out_scale) over its share of the tile's keys
    mLSESplit   (S, 2, total_q, Hq) f32 out, with splits > 1: each split's lse and
                temperature lse (msa_attention_combine merges the splits)
    mHandOff    (total_q, Hkv) i32, with hand_off > 0: per (token, kv head) 1 where the
                wgmma union tile handed the row to the one-token kernel, else 0 (written
                by the former, read by the latter; any (1, 1) tensor otherwise)
    scale_log2  softmax scale (times the K dequantization scale) times log2(e)
    out_scale   the V dequantization scale times v_global_scale
    temperature the temperature lse's factor on the scale
    group, paged, causal, has_q_offset, want_lse   ints (flags 0 or 1)
    splits      CTAs per tile (grid z), each over a contiguous share of its 64-key tiles
    hand_off    0, or the union size (in top-k lists) past which a wgmma union tile hands
                its tokens to the one-token kernel launched after it: the wgmma tile keeps
                a tile whose union has at most hand_off x topk blocks, the one-token kernel
                runs only the tokens handed to it (the union tile ignores it)
    hand_in     0, or 1 for a wgmma union tile launched after a wgmma tile of more
                warpgroups with hand_off: it runs only the tiles whose tokens that tile
                handed off (mHandOff != 0), itself keeping or handing on by hand_off"""
    x = head_dim // 2 if kv_dtype == "u8" else head_dim
    rows = dict(shape=(None, None, head_dim), stride=(None, None, 1), divisibility=8)
    vector = dict(shape=(None,), stride=(1,))
    kv = dict(shape=(None, None, None, x), stride=(None, None, None, 1), divisibility=16)
    # Scales: rows of 8 bytes, each (page, head)'s rows contiguous (16-byte cp.async).
    groups = head_dim // NVFP4_GROUP
    scales = dict(shape=(None, None, None, groups), stride=(None, None, groups, 1), divisibility=16)
    stats = dict(shape=(None, None), stride=(None, 1), output=True)
    partial_rows = dict(
        shape=(None, None, None, head_dim), stride=(None, None, None, 1), output=True
    )
    partial_stats = dict(shape=(None, None, None, None), stride=(None, None, None, 1), output=True)
    return (
        TensorArg("mQ", "input", **rows),
        TensorArg("mK", kv_dtype, **kv),
        TensorArg("mV", kv_dtype, **kv),
        TensorArg("mKScale", "u8", **scales),
        TensorArg("mVScale", "u8", **scales),
        TensorArg("mIdx", "i32", shape=(None, None, None), stride=(None, None, 1)),
        TensorArg("mCuQ", "i32", **vector),
        TensorArg("mCuK", "i32", **vector),
        TensorArg("mSeqUsedK", "i32", **vector),
        TensorArg("mPageTable", "i32", shape=(None, None), stride=(None, 1)),
        TensorArg("mQOffset", "i32", **vector),
        TensorArg("mO", "input", **rows, output=True),
        TensorArg("mLSE", "f32", **stats),
        TensorArg("mLSET", "f32", **stats),
        TensorArg("mOSplit", "f32", **partial_rows),
        TensorArg("mLSESplit", "f32", **partial_stats),
        TensorArg("mHandOff", "i32", shape=(None, None), stride=(None, 1), output=True),
        ScalarArg("scale_log2", "f32"),
        ScalarArg("out_scale", "f32"),
        ScalarArg("temperature", "f32"),
        ScalarArg("group", "i32"),
        ScalarArg("paged", "i32"),
        ScalarArg("causal", "i32"),
        ScalarArg("has_q_offset", "i32"),
        ScalarArg("want_lse", "i32"),
        ScalarArg("splits", "i32"),
        ScalarArg("hand_off", "f32"),
        ScalarArg("hand_in", "i32"),
    )


def _family(name: str, doc: str) -> Family:
    kv_dtype, _ = KV_FORMATS[name]
    return Family(
        name=name,
        doc=doc,
        abi=functools.partial(abi, kv_dtype=kv_dtype),
        dtypes=Q_DTYPES,
        constants={
            "block_keys": BLOCK_KEYS,
            "head_dim": HEAD_DIM,
            "tile_rows": TILE_ROWS,
            "max_topk": MAX_TOPK,
            "max_group": MAX_GROUP,
            "wgmma_group": WGMMA_GROUP,
            "max_blocks": MAX_BLOCKS,
            "max_splits": MAX_SPLITS,
        },
        templates=(
            # The union tile (64 // G tokens a CTA): mma.sync on every arch, K/V dequantized
            # into shared memory in q's dtype.
            Template(
                "warp_mma",
                "generator.kernels.portable.msa_sparse_attention",
                mma="mma.sync",
                archs=ALL_ARCHS,
                configs=tuple(dict(dtype=t, head_dim=HEAD_DIM) for t in Q_DTYPES),
                portable=True,
            ),
            # The union tile on sm_90a for G = 16 (4 tokens a warpgroup): wgmma, K and V
            # tiles TMA-gathered by page (FP8 / NVFP4 converted to fp16 in shared memory).
            # Chosen by tile="wgmma" with `warpgroups` a CTA: 1, 2 or 4 (one K/V ring, and
            # for FP8 / NVFP4 one converted tile, for all; msa_ops.WGMMA_WARPGROUPS).
            Template(
                "wgmma",
                "generator.kernels.sm90.msa_sparse_attention",
                mma="wgmma",
                archs=("sm_90a",),
                configs=tuple(
                    dict(dtype=t, head_dim=HEAD_DIM, tile="wgmma", warpgroups=w)
                    for w in (1, 2, 4)
                    for t in Q_DTYPES
                ),
            ),
            # One token a CTA, each warp a quarter of every block (decode): mma.sync on every
            # arch, K/V read from shared memory straight into MMA operands. Chosen by
            # tile="token".
            Template(
                "warp_mma_token",
                "generator.kernels.portable.msa_token_attention",
                mma="mma.sync",
                archs=ALL_ARCHS,
                configs=tuple(dict(dtype=t, head_dim=HEAD_DIM, tile="token") for t in Q_DTYPES),
                portable=True,
            ),
        ),
    )


def combine_abi(head_dim=HEAD_DIM):
    """mOSplit    (S, total_q, Hq, D) f32: the splits' normalized O
    mLSESplit  (S, 2, total_q, Hq) f32: their lse and temperature lse
    mO         (total_q, Hq, D) out, q's dtype: sum over s of exp(lse_s - lse) O_s
    mLSE, mLSET (total_q, Hq) f32 out: logsumexp over the splits (written if want_lse)"""
    return (
        TensorArg(
            "mOSplit", "f32", shape=(None, None, None, head_dim), stride=(None, None, None, 1)
        ),
        TensorArg("mLSESplit", "f32", shape=(None, None, None, None), stride=(None, None, None, 1)),
        TensorArg("mO", "input", shape=(None, None, head_dim), stride=(None, None, 1), output=True),
        TensorArg("mLSE", "f32", shape=(None, None), stride=(None, 1), output=True),
        TensorArg("mLSET", "f32", shape=(None, None), stride=(None, 1), output=True),
        ScalarArg("want_lse", "i32"),
    )


FAMILIES = (
    _family("msa_sparse_attention", "MSA sparse attention, bf16 / fp16 K/V"),
    _family("msa_sparse_attention_fp8kv", "MSA sparse attention, e4m3 K/V"),
    _family("msa_sparse_attention_nvfp4", "MSA sparse attention, NVFP4 K/V (e2m1 + e4m3 scales)"),
    Family(
        name="msa_attention_combine",
        doc="MSA sparse attention: the splits of a tile merged by their lse",
        abi=combine_abi,
        dtypes=Q_DTYPES,
        constants={"head_dim": HEAD_DIM},
        templates=(
            Template(
                "combine",
                "generator.kernels.portable.msa_attention_combine",
                archs=ALL_ARCHS,
                configs=tuple(dict(dtype=t, head_dim=HEAD_DIM) for t in Q_DTYPES),
                portable=True,
            ),
        ),
    ),
)
