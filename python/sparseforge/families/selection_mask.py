"""selection_mask: the BSR wrapper's direct selections (q2k_indices, q2k_num) as a block mask
and its error bits on the GPU, in one launch where sparsity.selection_block_mask takes about
twenty torch launches (20-35 us of host time each on the machines we measured)."""

from __future__ import annotations

import torch

from sparseforge import families, sparsity
from sparseforge.arch import arch_for_device

FAMILIES = ("selection_mask",)
CONSTANTS = ("max_columns",)
CONSTRAINTS = ()


@families.launch_cache(maxsize=None)
def _launch(device_index: int, has_counts: bool):
    kernel = families.choose(FAMILIES[0], arch_for_device(device_index))
    kernel.prepare()
    bits = (sparsity.ERR_INDEX_RANGE, sparsity.ERR_DUPLICATE, sparsity.ERR_Q2K_NUM)
    return kernel.bind(int(has_counts), *bits)


def selection_block_mask(q2k_indices, q2k_num, num_col_blocks: int):
    """sparsity.selection_block_mask, on the GPU for selections there with at most
    max_columns column blocks (others: the torch ops)."""
    device = q2k_indices.device
    max_columns = families.spec(FAMILIES[0]).constant("max_columns")
    if device.type != "cuda" or num_col_blocks > max_columns:
        return sparsity.selection_block_mask(q2k_indices, q2k_num, num_col_blocks)
    if q2k_indices.stride(-1) != 1:
        q2k_indices = q2k_indices.contiguous()
    h, mb, _ = q2k_indices.shape
    mask = torch.empty((h, mb, num_col_blocks), dtype=torch.bool, device=device)
    errors = torch.zeros((), dtype=torch.int32, device=device)
    counts = q2k_indices[..., 0] if q2k_num is None else q2k_num  # not read without q2k_num
    _launch(device.index, q2k_num is not None)(
        (q2k_indices, counts, mask.view(torch.uint8), errors.view(1))
    )
    return mask, errors
