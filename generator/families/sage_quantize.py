"""The Sage FP8 quantizer (sparseforge.sage_fp8_quantize): two launches, two families.

Launch 1 (sage_quantize_stats) takes column statistics of k and v per chunk of tokens and
quantizes q; launch 2 (sage_quantize_kv) quantizes k and v with them. The tokens of each kv
head are cut into P = ceil(Sk / chunk_tokens) chunks; chunk_tokens is a multiple of
CHUNK_MULTIPLE (whole launch-2 tiles), chosen by the host.
"""

from generator.abi import ScalarArg, TensorArg
from generator.family import ALL_ARCHS, Family, Template

KEYS_PER_SCALE = 16  # k_scale granularity: one scale per 16 tokens of a kv head
SCALE_STEPS = 16  # scale search candidates (amax / 448) * (16 + c) / 16, c < SCALE_STEPS
AMAX_MIN = 2.0**-100  # amax floor: all-zero sets get a finite positive scale
CHUNK_MULTIPLE = 256  # chunk_tokens is a multiple of this (launch-2 tiles: 128 or 256 tokens)
DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 128)
CONSTANTS = {
    "keys_per_scale": KEYS_PER_SCALE,
    "scale_steps": SCALE_STEPS,
    "amax_min": AMAX_MIN,
    "chunk_multiple": CHUNK_MULTIPLE,
}
TEMPLATE = Template(
    "sage_quantize",
    "generator.kernels.portable.sage_quantize",
    archs=ALL_ARCHS,
    configs=tuple(dict(dtype=t, head_dim=d) for t in DTYPES for d in HEAD_DIMS),
    portable=True,
)

_IO = dict(stride=(None, None, 1), divisibility=8)


def _partial(head_dim, output):
    return TensorArg(
        "mPartial",
        "f32",
        shape=(None, None, 2, head_dim),
        stride=(None, None, head_dim, 1),
        output=output,
    )


def _scalars():
    """chunk_tokens (tokens per chunk), smooth_k (0: k is not smoothed), scale_steps
    (candidates searched per q row / k group; 1: the amax scale)."""
    return (
        ScalarArg("chunk_tokens", "i32"),
        ScalarArg("smooth_k", "i32"),
        ScalarArg("scale_steps", "i32"),
    )


def abi_stats(head_dim: int):
    """mQ        (Hq, Sq, D)      bf16/fp16, unit stride on D, strides multiples of 8
    mK, mV    (Hkv, Sk, D)     the same
    mQ8       (Hq, Sq, D)      e4m3 out: q codes
    mQScale   (Hq, Sq)         fp32 out: per q row
    mPartial  (Hkv, P, 2, D)   fp32 out: per chunk, the sums of k (0) and max |v| (1)"""
    io = dict(shape=(None, None, head_dim), **_IO)
    return (
        TensorArg("mQ", "input", **io),
        TensorArg("mK", "input", **io),
        TensorArg("mV", "input", **io),
        TensorArg(
            "mQ8",
            "e4m3",
            shape=(None, None, head_dim),
            stride=(None, None, 1),
            divisibility=16,
            output=True,
        ),
        TensorArg("mQScale", "f32", shape=(None, None), stride=(None, 1), output=True),
        _partial(head_dim, output=True),
        *_scalars(),
    )


def abi_kv(head_dim: int):
    """mK, mV    (Hkv, Sk, D)      bf16/fp16, unit stride on D, strides multiples of 8
    mPartial  (Hkv, P, 2, D)    fp32: launch 1's chunk statistics
    mK8       (Hkv, Sk, D)      e4m3 out: codes of k - k_mean
    mKScale   (Hkv, G)          fp32 out: per 16 tokens, G = ceil(Sk / 16)
    mVt       (Hkv, D, Sk_pad)  e4m3 out: v codes transposed, zero past Sk (Sk_pad = 16 G)
    mVScale   (Hkv, D)          fp32 out: per channel
    mKMean    (Hkv, D)          fp32 out: mean of k over the tokens (0 unless smooth_k)"""
    io = dict(shape=(None, None, head_dim), **_IO)
    per_channel = dict(shape=(None, head_dim), stride=(None, 1))
    return (
        TensorArg("mK", "input", **io),
        TensorArg("mV", "input", **io),
        _partial(head_dim, output=False),
        TensorArg(
            "mK8",
            "e4m3",
            shape=(None, None, head_dim),
            stride=(None, None, 1),
            divisibility=16,
            output=True,
        ),
        TensorArg("mKScale", "f32", shape=(None, None), stride=(None, 1), output=True),
        TensorArg(
            "mVt",
            "e4m3",
            shape=(None, head_dim, None),
            stride=(None, None, 1),
            divisibility=16,
            output=True,
        ),
        TensorArg("mVScale", "f32", **per_channel, output=True),
        TensorArg("mKMean", "f32", **per_channel, output=True),
        *_scalars(),
    )


FAMILIES = (
    Family(
        name="sage_quantize_stats",
        doc="Sage FP8 quantizer, launch 1: k/v chunk statistics and q codes",
        abi=abi_stats,
        dtypes=DTYPES,
        constants=CONSTANTS,
        templates=(TEMPLATE,),
    ),
    Family(
        name="sage_quantize_kv",
        doc="Sage FP8 quantizer, launch 2: k and v codes",
        abi=abi_kv,
        dtypes=DTYPES,
        constants=CONSTANTS,
        templates=(TEMPLATE,),
    ),
)
