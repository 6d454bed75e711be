"""tile_compact: the planner's row compaction on the GPU (one warp per row, ballot and
popcount), in place of planner.compact_rows's prefix sum and search."""

from __future__ import annotations

import torch

from sparseforge import families
from sparseforge.arch import arch_for_device

FAMILIES = ("tile_compact",)
CONSTANTS = ()
CONSTRAINTS = ()


@families.launch_cache(maxsize=None)
def _launch(device_index: int):
    kernel = families.choose(FAMILIES[0], arch_for_device(device_index))
    kernel.prepare()
    return kernel.bind()


def compact(listed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_idx, tile_cnt) of a (Hkv, R, NT) bool tile mask on a GPU: as
    planner.compact_rows. Any strides on the heads and rows (a head mode of stride 0: BSR
    plans); the kernel reads each row's flags with unit stride, so a mask whose last mode
    is not (a transposed or expanded view) is copied first."""
    if listed.stride(-1) != 1:
        listed = listed.contiguous()
    tile_idx = torch.empty(listed.shape, device=listed.device, dtype=torch.int32)
    tile_cnt = torch.empty(listed.shape[:2], device=listed.device, dtype=torch.int32)
    _launch(listed.device.index)((listed.view(torch.uint8), tile_idx, tile_cnt))
    return tile_idx, tile_cnt
