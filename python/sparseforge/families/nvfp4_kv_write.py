"""nvfp4_kv_write: the launch of sparseforge.msa_ops.quantize_write_kv_nvfp4 (that module has
the contract)."""

from __future__ import annotations

from sparseforge import families
from sparseforge.arch import arch_for_device

FAMILIES = ("nvfp4_kv_write",)
CONSTANTS = ("page_tokens", "head_dim", "page_bytes_per_head")
CONSTRAINTS = ()


def constant(key: str):
    return families.spec(FAMILIES[0]).constant(key)


@families.launch_cache(maxsize=64)
def launch(device_index: int, dtype: str, k_global_scale: float, v_global_scale: float):
    kernel = families.choose(
        FAMILIES[0], arch_for_device(device_index), dtype=dtype, head_dim=constant("head_dim")
    )
    kernel.prepare()
    return kernel.bind(k_global_scale, v_global_scale)
