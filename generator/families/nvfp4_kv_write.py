"""NVFP4 K/V cache writes: bf16 / fp16 K and V of new tokens quantized into packed NVFP4 pages
at given slots (msa_ops.quantize_write_kv_nvfp4), what a cache manager runs once per step.

A page holds 128 tokens of every kv head in four byte regions (the MSA contract): K data
(Hkv, 128, 64) e2m1 with the even element in the low nibble, K scales (Hkv, 128, 8) e4m3,
V data, and V scales with the 4x4 swizzle (token t, group s at row (t // 4) * 4 + s // 2,
column (s % 2) * 4 + t % 4). Region offsets and the page size are per kv head times these.
"""

from generator.abi import ScalarArg, TensorArg
from generator.family import ALL_ARCHS, Family, Template

PAGE_TOKENS = 128
HEAD_DIM = 128
GROUP = 16  # values per e4m3 scale
# Byte offsets of the four regions, per kv head (times Hkv in a page).
K_DATA, K_SCALES, V_DATA, V_SCALES, PAGE_BYTES = 0, 8192, 9216, 17408, 18432
DTYPES = ("bf16", "fp16")


def abi(head_dim=HEAD_DIM):
    """mK, mV    (T, Hkv, D)  the new tokens' keys and values
    mSlots    (T,)         i32: each token's slot (page * 128 + row); negative: skipped
    mPages    (P, Hkv * 18432) u8 out: the packed pages
    k_global_scale, v_global_scale   each scale is e4m3(amax / 6 / global scale)"""
    kv = dict(shape=(None, None, head_dim), stride=(None, None, 1))
    return (
        TensorArg("mK", "input", **kv),
        TensorArg("mV", "input", **kv),
        TensorArg("mSlots", "i32", shape=(None,), stride=(1,)),
        TensorArg("mPages", "u8", shape=(None, None), stride=(None, 1), output=True),
        ScalarArg("k_global_scale", "f32"),
        ScalarArg("v_global_scale", "f32"),
    )


FAMILIES = (
    Family(
        name="nvfp4_kv_write",
        doc="bf16 / fp16 K/V into packed NVFP4 pages at slots (quantize_write_kv_nvfp4)",
        abi=abi,
        dtypes=DTYPES,
        constants={
            "page_tokens": PAGE_TOKENS,
            "head_dim": HEAD_DIM,
            "page_bytes_per_head": PAGE_BYTES,
        },
        templates=(
            Template(
                "nvfp4_kv_write",
                "generator.kernels.portable.nvfp4_kv_write",
                archs=ALL_ARCHS,
                configs=tuple(dict(dtype=t, head_dim=HEAD_DIM) for t in DTYPES),
                portable=True,
            ),
        ),
    ),
)
