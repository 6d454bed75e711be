"""unit_order: the units' launch order on the GPU (planner.longest_first's rule, one CTA)
and, in the same launch, the recheck of block-size tensors that plan() read on the host
earlier: one launch where torch takes a dozen (20-35 us of host time each) per plan()."""

from __future__ import annotations

import torch

from sparseforge import families, planner, sparsity
from sparseforge.arch import arch_for_device

FAMILIES = ("unit_order",)
CONSTANTS = ("max_count",)
CONSTRAINTS = ()


@families.launch_cache(maxsize=None)
def _launch(device_index: int, per_head: int, per_item: int, step: int):
    kernel = families.choose(FAMILIES[0], arch_for_device(device_index))
    kernel.prepare()
    return kernel.bind(per_head, per_item, step, sparsity.ERR_STALE_SIZES)


def _unchecked(device_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(size tensor, values read, error word) for plans without a recheck: a pair that
    agrees, and a word the kernel writes 0 to. Kept per device, except from a CUDA graph
    capture (planner.device_constant), whose fills run only when the graph replays."""
    device = torch.device("cuda", device_index)

    def make():
        read = torch.zeros((1, 1), dtype=torch.int64, device=device)
        return read.to(torch.int32), read, torch.empty(1, dtype=torch.int32, device=device)

    return planner.device_constant(("unchecked sizes",), device, make)


def order(
    tile_cnt: torch.Tensor,
    group: int,
    units_per_cta: int = 1,
    *,
    tiles: int,
    size_checks=(),
    errors: torch.Tensor | None = None,
) -> torch.Tensor:
    """planner.longest_first(tile_cnt, group, units_per_cta) on tile_cnt's GPU (`tiles`: the
    most tiles a unit lists). With `size_checks`, one or two (size tensor as it is now
    (int32), its values read earlier (int64)) pairs on the same GPU, also sets errors[0]
    (int32) to ERR_STALE_SIZES if a pair differs, else 0. Lists of max_count tiles or more
    are ordered, and the sizes checked, with torch ops."""
    if tiles >= families.spec(FAMILIES[0]).constant("max_count"):
        if size_checks:
            errors.copy_(sparsity.size_checks_errors(size_checks))
        return planner.longest_first(tile_cnt, group, units_per_cta)
    index = tile_cnt.device.index
    n = units_per_cta
    if n == 1 or group % n == 0:  # a CTA's units: n query heads of one row
        per_head, step = group // n, 1
    else:  # n consecutive rows of one head
        per_head, step = group, n
    if size_checks:
        (rows_now, rows_read), (cols_now, cols_read) = size_checks[0], size_checks[-1]
    else:
        rows_now, rows_read, errors = _unchecked(index)
        cols_now, cols_read = rows_now, rows_read
    heads, rows = tile_cnt.shape
    work = torch.empty(
        heads * per_head * -(-rows // step) * n, dtype=torch.int32, device=tile_cnt.device
    )
    _launch(index, per_head, n, step)(
        (tile_cnt, work, rows_now, rows_read, cols_now, cols_read, errors)
    )
    return work
