"""msa_topk_select: the launch of sparseforge.msa_ops.msa_topk_select (that module has the
contract)."""

from __future__ import annotations

from sparseforge import families
from sparseforge.arch import arch_for_device

FAMILIES = ("msa_topk_select",)
CONSTANTS = ("topk",)
CONSTRAINTS = ()


def constant(key: str):
    return families.spec(FAMILIES[0]).constant(key)


@families.launch_cache(maxsize=64)
def launch(device_index: int, force_begin: int, force_end: int):
    kernel = families.choose(FAMILIES[0], arch_for_device(device_index))
    kernel.prepare()
    return kernel.bind(force_begin, force_end)
