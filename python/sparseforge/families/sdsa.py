"""sdsa: the launches of sparseforge.sdsa (that module has the contract)."""

from __future__ import annotations

import functools

from sparseforge import families
from sparseforge.arch import arch_for_device

FAMILIES = ("sdsa_quantize",)
CONSTANTS = ("page_keys", "key_dim")
CONSTRAINTS = ()


def constant(key: str):
    return families.spec(FAMILIES[0]).constant(key)


@functools.lru_cache(maxsize=16)
def quantize_launch(device_index: int, dtype: str):
    kernel = families.choose(
        "sdsa_quantize", arch_for_device(device_index), dtype=dtype, head_dim=constant("key_dim")
    )
    kernel.prepare()
    return kernel.bind()
