"""SDSA indexer (sparseforge.sdsa, flashinfer.sdsa's contract): one index head, FP32 q.k
scores over 64-key pages of 128-dim keys, BF16 or NVFP4 (one e4m3 scale per 16 values, no
global scale).

    sdsa_quantize   quantize_write_index_qk_nvfp4: keys into a paged NVFP4 key cache at
                    int64 slots, queries into NVFP4 rows, one launch (negative slots / rows
                    skipped)
    sdsa_scores     indexer_scores: scores[q, k] = q . k in fp32 for k < the group's context,
                    groups of R consecutive rows sharing a table row (dtype "bf16": BF16 keys
                    and queries; "u8": NVFP4 keys and queries with their scales)
    sdsa_sample     gather_key_sample: slot s of sample row r copies logical key
                    (s // samples_per_run) * 64 * pages_per_run + offsets[s] of table row r
                    (and its scales)
    sdsa_thresholds thresholds_from_sample: each row's min sample score over its top
                    positions (-1 or NaN: -inf); its counters zeroed
    sdsa_select     indexer_threshold_select (without repair): each row's candidates (score >
                    threshold) and ties (neither above nor below) into its slots, counted
    sdsa_repair     indexer_threshold_select's repair mode, after sdsa_select: each row that
                    does not fit gets the exact min(row_end, top_k)-th score as its threshold
                    and is selected again; every row's ranges
    sdsa_topk       top_k_from_candidates: each row's exact top-K keys from its range of
                    candidate slots (radix select in float-bit order)
"""

from generator.abi import ScalarArg, TensorArg
from generator.family import ALL_ARCHS, Family, Template

PAGE_KEYS = 64
KEY_DIM = 128
NVFP4_GROUP = 16
DTYPES = ("bf16", "fp16")
KEY_DTYPES = ("bf16", "u8")  # BF16 keys, or NVFP4 codes (two a byte) with e4m3 scales


def quantize_abi(head_dim=KEY_DIM):
    """mKey        (T, 128)        the keys (bf16 / fp16)
    mSlots      (T,)  i64       each key's slot (page * 64 + row); negative: skipped
    mQuery      (Q, 128)        the queries (the keys' dtype)
    mQueryRows  (Q,)  i64       each query's row; negative: skipped
    mKeyCache   (pages, 64, 64) u8 out: codes, two a byte, the even element in the low nibble
    mKeyScales  (pages, 64, 8)  u8 out: the e4m3 scales
    mPackedQuery (R, 64) u8 out, mQueryScales (R, 8) u8 out: the same for query rows"""
    rows = dict(shape=(None, head_dim), stride=(None, 1))
    vector = dict(shape=(None,), stride=(1,))
    return (
        TensorArg("mKey", "input", **rows),
        TensorArg("mSlots", "i64", **vector),
        TensorArg("mQuery", "input", **rows),
        TensorArg("mQueryRows", "i64", **vector),
        TensorArg(
            "mKeyCache",
            "u8",
            shape=(None, PAGE_KEYS, head_dim // 2),
            stride=(None, None, 1),
            output=True,
        ),  # fmt: skip
        TensorArg(
            "mKeyScales",
            "u8",
            shape=(None, PAGE_KEYS, head_dim // NVFP4_GROUP),
            stride=(None, None, 1),
            output=True,
        ),  # fmt: skip
        TensorArg("mPackedQuery", "u8", shape=(None, head_dim // 2), stride=(None, 1), output=True),
        TensorArg(
            "mQueryScales",
            "u8",
            shape=(None, head_dim // NVFP4_GROUP),
            stride=(None, 1),
            output=True,
        ),  # fmt: skip
    )


def key_width(dtype) -> int:
    """Elements of one stored key row: 128 BF16 values or 64 bytes of NVFP4 codes."""
    return KEY_DIM // 2 if dtype == "u8" else KEY_DIM


# A paged key cache (pages, 64, X: 128 BF16 values or 64 NVFP4 bytes) and its e4m3 scales
# (NVFP4; any one-page tensor otherwise).
KEY_CACHE_ARGS = (
    TensorArg("mKeyCache", "input", shape=(None, PAGE_KEYS, None), stride=(None, None, 1),
              divisibility=16),
    TensorArg("mKeyScales", "u8", shape=(None, PAGE_KEYS, KEY_DIM // NVFP4_GROUP),
              stride=(None, KEY_DIM // NVFP4_GROUP, 1)),
)  # fmt: skip


def scores_abi(head_dim=KEY_DIM):
    """mQuery      (rows, X)         queries (X = key_width: 128 BF16 or 64 NVFP4 bytes)
    mQueryScales (rows, 8)  u8     their e4m3 scales (NVFP4; any one-row tensor otherwise)
    mKeyCache   (pages, 64, X)      keys
    mKeyScales  (pages, 64, 8) u8  their e4m3 scales (NVFP4; any one-page tensor otherwise)
    mBlockTable (B, W)   i32       page ids
    mContext    (G,)     i32       keys of each group
    mRequests   (G,)     i32       table row of each group
    mScores     (rows, C) f32 out  scores of keys < the group's context (others untouched)"""
    scales = dict(shape=(None, KEY_DIM // NVFP4_GROUP), stride=(None, 1))
    return (
        TensorArg("mQuery", "input", shape=(None, None), stride=(None, 1), divisibility=16),
        TensorArg("mQueryScales", "u8", **scales),
        *KEY_CACHE_ARGS,
        TensorArg("mBlockTable", "i32", shape=(None, None), stride=(None, 1)),
        TensorArg("mContext", "i32", shape=(None,), stride=(1,)),
        TensorArg("mRequests", "i32", shape=(None,), stride=(1,)),
        TensorArg("mScores", "f32", shape=(None, None), stride=(None, 1), output=True),
    )  # fmt: skip


def sample_abi(head_dim=KEY_DIM):
    """mKeyCache   (pages, 64, X)      keys (BF16 or NVFP4 bytes)
    mKeyScales  (pages, 64, 8) u8  their scales (NVFP4; any one-page tensor otherwise)
    mBlockTable (R, W)   i32       page ids of each sample row's request
    mOffsets    (cap,)   u8        key offset of each slot within its run
    mSampleEnds (R,)     i32       slots filled per row
    mSampleKeys (R, cap, X) out, mSampleScales (R, cap, 8) u8 out (NVFP4)
    samples_per_run, pages_per_run   slots per run, pages a run spans"""
    return (
        *KEY_CACHE_ARGS,
        TensorArg("mBlockTable", "i32", shape=(None, None), stride=(None, 1)),
        TensorArg("mOffsets", "u8", shape=(None,), stride=(1,)),
        TensorArg("mSampleEnds", "i32", shape=(None,), stride=(1,)),
        TensorArg("mSampleKeys", "input", shape=(None, None, None), stride=(None, None, 1),
                  divisibility=16, output=True),
        TensorArg("mSampleScales", "u8", shape=(None, None, KEY_DIM // NVFP4_GROUP),
                  stride=(None, KEY_DIM // NVFP4_GROUP, 1), output=True),
        ScalarArg("samples_per_run", "i32"),
        ScalarArg("pages_per_run", "i32"),
    )  # fmt: skip


def thresholds_abi(head_dim=None):
    """mSampleScores (rows, S) f32, mSampleTop (rows, K) i32 (positions, -1: none),
    mThresholds (rows,) f32 out, mCounters (rows, 2) i32 out"""
    return (
        TensorArg("mSampleScores", "f32", shape=(None, None), stride=(None, 1)),
        TensorArg("mSampleTop", "i32", shape=(None, None), stride=(None, 1)),
        TensorArg("mThresholds", "f32", shape=(None,), stride=(1,), output=True),
        TensorArg("mCounters", "i32", shape=(None, 2), stride=(None, 1), output=True),
    )


def select_abi(head_dim=KEY_DIM, repair=False):
    """The scores' query and key arguments (scores_abi), then
    mBlockTable (B, W) i32, mRowEnds (rows,) i32, mTileRequests (tiles,) i32: table row of
    each 128-row tile, mThresholds (rows,) f32 (repair: out), mCounters (rows, 2) i32 out
    (added to), mCandidates (rows, slots, 2) i32 out, repair only: mRanges (2, rows) i32
    out (each row's [first, end) slots of ties and candidates); max_context, top_k"""
    keys = scores_abi(head_dim)[:4]
    ranges = TensorArg("mRanges", "i32", shape=(2, None), stride=(None, 1), output=True)
    return (
        *keys,
        TensorArg("mBlockTable", "i32", shape=(None, None), stride=(None, 1)),
        TensorArg("mRowEnds", "i32", shape=(None,), stride=(1,)),
        TensorArg("mTileRequests", "i32", shape=(None,), stride=(1,)),
        TensorArg("mThresholds", "f32", shape=(None,), stride=(1,), output=repair),
        TensorArg("mCounters", "i32", shape=(None, 2), stride=(None, 1), output=True),
        TensorArg("mCandidates", "i32", shape=(None, None, 2), stride=(None, 2, 1), output=True),
        *((ranges,) if repair else ()),
        ScalarArg("max_context", "i32"),
        ScalarArg("top_k", "i32"),
    )


def repair_abi(head_dim=KEY_DIM):
    return select_abi(head_dim, repair=True)


def topk_abi(head_dim=None):
    """The rows as a (T, R) grid of any strides (a caller takes the live rows of 128-row
    tiles as strided views of all three; a plain list of rows is T x 1):
    mCandidates (T, R, slots, 2) i32: (key, stored value bits) pairs
    mRanges     (2, T, R) i32: each row's [first, end) slots
    mTopKeys    (T, R, K) i32 out"""
    return (
        TensorArg("mCandidates", "i32", shape=(None, None, None, 2), stride=(None, None, 2, 1)),
        TensorArg("mRanges", "i32", shape=(2, None, None), stride=(None, None, None)),
        TensorArg("mTopKeys", "i32", shape=(None, None, None), stride=(None, None, 1), output=True),
    )


# The SDSA kernels that multiply on tensor cores (mma.sync); the others use CUDA cores.
MMA_FAMILIES = ("sdsa_scores", "sdsa_select", "sdsa_repair")


def _family(name, doc, abi, dtypes=KEY_DTYPES, constants=None):
    """One SDSA family: a portable template of the same name (module sdsa_<op>) on every
    arch, one variant per dtype (none: a single variant)."""
    configs = tuple(dict(dtype=t, head_dim=KEY_DIM) for t in dtypes) or ({},)
    return Family(
        name=name,
        doc=doc,
        abi=abi,
        dtypes=dtypes,
        constants={"page_keys": PAGE_KEYS, "key_dim": KEY_DIM, **(constants or {})},
        templates=(
            Template(
                name,
                f"generator.kernels.portable.{name}",
                archs=ALL_ARCHS,
                configs=configs,
                portable=True,
                mma="mma.sync" if name in MMA_FAMILIES else None,
            ),
        ),
    )


FAMILIES = (
    _family(
        "sdsa_quantize",
        "SDSA keys and queries to NVFP4 (quantize_write_index_qk_nvfp4)",
        quantize_abi,
        dtypes=DTYPES,
    ),
    _family(
        "sdsa_scores",
        "SDSA scores q . k over paged BF16 / NVFP4 keys (indexer_scores)",
        scores_abi,
    ),
    _family("sdsa_sample", "SDSA key sample rows (gather_key_sample)", sample_abi),
    _family(
        "sdsa_thresholds",
        "SDSA thresholds from a scored sample (thresholds_from_sample)",
        thresholds_abi,
        dtypes=(),
    ),
    _family("sdsa_select", "SDSA threshold select over paged BF16 / NVFP4 keys", select_abi),
    _family(
        "sdsa_repair",
        "SDSA threshold select's repair mode (exact thresholds for rows that do not fit)",
        repair_abi,
    ),
    _family(
        "sdsa_topk",
        "SDSA top-K keys from candidates (top_k_from_candidates)",
        topk_abi,
        dtypes=(),
        constants={"max_top_k": 65535},
    ),
)
