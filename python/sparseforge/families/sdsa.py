"""sdsa: the launches of sparseforge.sdsa (that module has the contract)."""

from __future__ import annotations

from sparseforge import families
from sparseforge.arch import arch_for_device

FAMILIES = (
    "sdsa_quantize",
    "sdsa_scores",
    "sdsa_sample",
    "sdsa_thresholds",
    "sdsa_topk",
    "sdsa_select",
    "sdsa_repair",
)
CONSTANTS = ("page_keys", "key_dim")
CONSTRAINTS = ()


def constant(key: str):
    return families.spec(FAMILIES[0]).constant(key)


@families.launch_cache(maxsize=32)
def launch(device_index: int, family: str, dtype: str | None, *scalars):
    """The bound launch of one of FAMILIES (dtype None: the family has one variant)."""
    params = {} if dtype is None else dict(dtype=dtype, head_dim=constant("key_dim"))
    kernel = families.choose(family, arch_for_device(device_index), **params)
    kernel.prepare()
    return kernel.bind(*scalars)
