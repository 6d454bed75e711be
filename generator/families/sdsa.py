"""SDSA indexer (sparseforge.sdsa, flashinfer.sdsa's contract): one index head, FP32 q.k
scores over 64-key pages of 128-dim keys, BF16 or NVFP4 (one e4m3 scale per 16 values, no
global scale).

    sdsa_quantize   quantize_write_index_qk_nvfp4: keys into a paged NVFP4 key cache at
                    int64 slots, queries into NVFP4 rows, one launch (negative slots / rows
                    skipped)
"""

from generator.abi import TensorArg
from generator.family import ALL_ARCHS, Family, Template

PAGE_KEYS = 64
KEY_DIM = 128
NVFP4_GROUP = 16
DTYPES = ("bf16", "fp16")


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


FAMILIES = (
    Family(
        name="sdsa_quantize",
        doc="SDSA keys and queries to NVFP4 (quantize_write_index_qk_nvfp4)",
        abi=quantize_abi,
        dtypes=DTYPES,
        constants={"page_keys": PAGE_KEYS, "key_dim": KEY_DIM},
        templates=(
            Template(
                "sdsa_quantize",
                "generator.kernels.portable.sdsa_quantize",
                archs=ALL_ARCHS,
                configs=tuple(dict(dtype=t, head_dim=KEY_DIM) for t in DTYPES),
                portable=True,
            ),
        ),
    ),
)
