"""msa_proxy_score: the launches of sparseforge.msa_ops.msa_proxy_score and
msa_proxy_score_fp4 (that module has the contract)."""

from __future__ import annotations

import functools

from sparseforge import families
from sparseforge.arch import arch_for_device

FAMILIES = ("msa_proxy_score", "msa_proxy_score_nvfp4")
CONSTANTS = ("block_keys", "head_dim")
CONSTRAINTS = ()


def constant(key: str):
    return families.spec(FAMILIES[0]).constant(key)


@functools.lru_cache(maxsize=64)
def launch(
    device_index: int,
    dtype: str,  # "nvfp4": the NVFP4 family (q and k codes with scales)
    key_layout: str,
    max_seqlen_q: int,
    kv_heads: int,
    causal: bool,
    has_q_offset: bool,
    reduce_heads: bool,
    logit_scale: float = 1.0,  # NVFP4 only
):
    head_dim = constant("head_dim")
    arch = arch_for_device(device_index)
    flags = (max_seqlen_q, kv_heads, int(causal), int(has_q_offset), int(reduce_heads))
    if dtype == "nvfp4":
        kernel = families.choose(FAMILIES[1], arch, head_dim=head_dim, key_layout=key_layout)
        kernel.prepare()
        return kernel.bind(*flags, logit_scale)
    kernel = families.choose(
        FAMILIES[0], arch, dtype=dtype, head_dim=head_dim, key_layout=key_layout
    )
    kernel.prepare()
    return kernel.bind(*flags)
