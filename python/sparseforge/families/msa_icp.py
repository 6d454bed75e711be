"""msa_icp: the launches of sparseforge.msa_icp (that module has the contract)."""

from __future__ import annotations

from sparseforge import families
from sparseforge.arch import arch_for_device

# The score rows' chains, then the fused paths' list scorer and list merge.
FAMILIES = (
    "msa_icp_score",
    "msa_icp_select",
    "msa_icp_merge",
    "msa_icp_list_score",
    "msa_icp_list_merge",
)
CONSTANTS = (
    "modes",
    "topk",
    "heads",
    "max_blocks",
    "max_columns",
    "carrier_words",
    "list_words",
    "max_list_splits",
    "tagged_words",
    "max_world",
)
CONSTRAINTS = ()


def constant(key: str):
    return families.spec(FAMILIES[1]).constant(key)


def mode(name: str) -> int:
    """The select's ("local", "publish", "publish_tagged") or the merge's ("read", "wait",
    "wait_tagged") mode scalar."""
    return constant("modes")[name]


def shard_rows_built(device_index: int) -> tuple:
    """The shard rows per page (page_size / world_size) the scorer is built for here."""
    return tuple(families.spec(FAMILIES[0]).constant("shard_rows"))


def load(device_index: int, family: str, shard_rows: int | None):
    """The variant of one of FAMILIES a launch uses (shard_rows: the scorers'), its module
    loaded into the device's context."""
    params = {} if shard_rows is None else dict(shard_rows=shard_rows)
    kernel = families.choose(family, arch_for_device(device_index), **params)
    kernel.prepare()
    return kernel


@families.launch_cache(maxsize=64)
def launch(device_index: int, family: str, shard_rows: int | None, *scalars):
    """The bound launch of one of FAMILIES with its scalars."""
    return load(device_index, family, shard_rows).bind(*scalars)
