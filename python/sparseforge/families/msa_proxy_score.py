"""msa_proxy_score: the launch of sparseforge.msa_ops.msa_proxy_score (that module has the
contract)."""

from __future__ import annotations

import functools

from sparseforge import families
from sparseforge.arch import arch_for_device

FAMILIES = ("msa_proxy_score",)
CONSTANTS = ("block_keys", "head_dim")
CONSTRAINTS = ()


def constant(key: str):
    return families.spec(FAMILIES[0]).constant(key)


@functools.lru_cache(maxsize=64)
def launch(
    device_index: int,
    dtype: str,
    key_layout: str,
    max_seqlen_q: int,
    kv_heads: int,
    causal: bool,
    has_q_offset: bool,
    reduce_heads: bool,
):
    kernel = families.choose(
        FAMILIES[0],
        arch_for_device(device_index),
        dtype=dtype,
        head_dim=constant("head_dim"),
        key_layout=key_layout,
    )
    kernel.prepare()
    return kernel.bind(max_seqlen_q, kv_heads, int(causal), int(has_q_offset), int(reduce_heads))
