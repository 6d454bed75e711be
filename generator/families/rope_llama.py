"""RoPE LLaMA: q or k rotated into a plan's buffer before block-sparse attention (the BSR
and variable wrappers' pos_encoding_mode="ROPE_LLAMA").

Channel i < D / 2 pairs with i + D / 2, the pair rotated by the angle
(token + position_offset) * inv_rope_scale * rope_theta^(-2i / D) (sparseforge.reference.
rope_llama), in fp32, written back in the input's dtype (what the attention MMAs take).
"""

from generator.abi import ScalarArg, TensorArg
from generator.family import ALL_ARCHS, Family, Template

DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 128, 256)  # the block-sparse attention family's
CHANNELS_PER_THREAD = 8  # of each half: 16-byte loads and stores


def abi(head_dim: int):
    """mX   (S, H, D)  q or k, any token and head strides
    mY      (S, H, D)  out: mX rotated
    position_offset    token t sits at position t + position_offset
    inv_rope_scale     1 / rope_scale
    log2_theta         log2(rope_theta)"""
    x = dict(shape=(None, None, head_dim), stride=(None, None, 1), divisibility=8)
    return (
        TensorArg("mX", "input", **x),
        TensorArg("mY", "input", **x, output=True),
        ScalarArg("position_offset", "i32"),
        ScalarArg("inv_rope_scale", "f32"),
        ScalarArg("log2_theta", "f32"),
    )


FAMILIES = (
    Family(
        name="rope_llama",
        doc="RoPE LLaMA rotation of q or k (the wrappers' pos_encoding_mode='ROPE_LLAMA')",
        abi=abi,
        dtypes=DTYPES,
        constants={"channels_per_thread": CHANNELS_PER_THREAD},
        templates=(
            Template(
                "rope_llama",
                "generator.kernels.portable.rope_llama",
                archs=ALL_ARCHS,
                configs=tuple(dict(dtype=t, head_dim=d) for t in DTYPES for d in HEAD_DIMS),
                portable=True,
            ),
        ),
    ),
)
