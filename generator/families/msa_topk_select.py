"""MSA top-16 block selection: per (token, query head), the 16 blocks a token attends to,
from the proxy scores (max of q.k per 128-key block, msa_proxy_score).

Blocks [0, fb) and [nvp - fe, nvp) are forced (nvp: the token's valid blocks); the other
16 - fb - fe slots go to the middle blocks by descending score, ties to the lower id. A
selected block whose score is -inf (or NaN) becomes -1. Output: ascending ids, -1 tail.
"""

from generator.abi import ScalarArg, TensorArg
from generator.family import ALL_ARCHS, Family, Template

TOPK = 16


def abi(head_dim=None):
    """mScore     (Hq, P, S)   f32: block scores of each token
    mNumValid  (S,)         i32: each token's valid blocks (stride 0: one for all), in [0, P]
    mOut       (S, Hq, 16)  i32 out: block ids, ascending, -1 tail
    force_begin, force_end  fb, fe (fb + fe <= 16)"""
    return (
        TensorArg("mScore", "f32", shape=(None, None, None), stride=(None, None, 1)),
        TensorArg("mNumValid", "i32", shape=(None,), stride=(None,)),
        TensorArg("mOut", "i32", shape=(None, None, TOPK), stride=(None, TOPK, 1), output=True),
        ScalarArg("force_begin", "i32"),
        ScalarArg("force_end", "i32"),
    )


FAMILIES = (
    Family(
        name="msa_topk_select",
        doc="MSA top-16 block selection from proxy scores (msa_topk_select)",
        abi=abi,
        constants={"topk": TOPK},
        templates=(
            Template(
                "msa_topk_select",
                "generator.kernels.portable.msa_topk_select",
                archs=ALL_ARCHS,
                portable=True,
            ),
        ),
    ),
)
