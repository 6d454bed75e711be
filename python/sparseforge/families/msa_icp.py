"""msa_icp: the launches of sparseforge.msa_icp (that module has the contract)."""

from __future__ import annotations

import functools

from sparseforge import families
from sparseforge.arch import arch_for_device

FAMILIES = ("msa_icp_score", "msa_icp_select", "msa_icp_merge")
CONSTANTS = (
    "topk",
    "heads",
    "max_blocks",
    "max_columns",
    "carrier_words",
    "tagged_words",
    "max_world",
)
CONSTRAINTS = ()
# The select's and the merge's modes (generator/families/msa_icp.py).
LOCAL, PUBLISH, PUBLISH_TAGGED = 0, 1, 2
READ, WAIT, WAIT_TAGGED = 0, 1, 2


def constant(key: str):
    return families.spec(FAMILIES[1]).constant(key)


def shard_rows_built(device_index: int) -> tuple:
    """The shard rows per page (page_size / world_size) the scorer is built for here."""
    return tuple(families.spec(FAMILIES[0]).constant("shard_rows"))


@functools.lru_cache(maxsize=64)
def launch(device_index: int, family: str, shard_rows: int | None, *scalars):
    """The bound launch of one of FAMILIES (shard_rows: the scorer's variant)."""
    params = {} if shard_rows is None else dict(shard_rows=shard_rows)
    kernel = families.choose(family, arch_for_device(device_index), **params)
    kernel.prepare()
    return kernel.bind(*scalars)
