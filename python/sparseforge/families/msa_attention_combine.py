"""msa_attention_combine: the launch that merges the splits of msa_sparse_attention
(sparseforge.msa_ops has the contract)."""

from __future__ import annotations

from sparseforge import families
from sparseforge.arch import arch_for_device

FAMILIES = ("msa_attention_combine",)
CONSTANTS = ("head_dim",)
CONSTRAINTS = ()


@families.launch_cache(maxsize=16)
def launch(device_index: int, dtype: str, want_lse: bool):
    kernel = families.choose(
        FAMILIES[0],
        arch_for_device(device_index),
        dtype=dtype,
        head_dim=families.spec(FAMILIES[0]).constant("head_dim"),
    )
    kernel.prepare()
    return kernel.bind(int(want_lse))
