"""token_sparse_kv_indices / group_union_masks: the launches of sparseforge.token_sparse
(that module has the contract)."""

from __future__ import annotations

from sparseforge import families
from sparseforge.arch import arch_for_device

FAMILIES = ("token_sparse_kv_indices", "group_union_masks")
CONSTANTS = ("page_keys", "positions_multiple", "max_union_keys", "mask_tile")
CONSTRAINTS = ()


def constant(key: str):
    return families.spec(FAMILIES[0]).constant(key)


@families.launch_cache(maxsize=64)
def kv_indices_launch(device_index: int, requests_per_token: int):
    kernel = families.choose(FAMILIES[0], arch_for_device(device_index))
    kernel.prepare()
    return kernel.bind(requests_per_token)


@families.launch_cache(maxsize=64)
def group_union_launch(device_index: int, num_keys: int):
    """Bound per num_keys (a scalar of the kernel's ABI); decode steps that grow the
    sequence each bind once (a few microseconds of host work)."""
    kernel = families.choose(FAMILIES[1], arch_for_device(device_index))
    kernel.prepare()
    return kernel.bind(num_keys)
