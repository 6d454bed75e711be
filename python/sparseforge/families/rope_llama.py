"""rope_llama: q and k rotated into a plan's buffers before attention
(pos_encoding_mode="ROPE_LLAMA"; generator/families/rope_llama.py has the contract)."""

from __future__ import annotations

import math

import torch

from sparseforge import families
from sparseforge.arch import arch_for_device
from sparseforge.dtypes import NAME_OF

FAMILIES = ("rope_llama",)
CONSTANTS = ()
CONSTRAINTS = ()


def bind(shapes, options, device):
    """(launch of q, launch of k, q buffer, k buffer) of a plan: q at positions
    i + Sk - Sq and k at j (the sequences end together, as the causal mask aligns them);
    `shapes`: a Plan with the attention's shapes, dtype and layout."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    kernel = families.choose(
        FAMILIES[0],
        arch_for_device(index),
        dtype=NAME_OF[shapes.dtype],
        head_dim=shapes.head_dim,
    )
    kernel.prepare()
    scalars = (1.0 / options.rope_scale, math.log2(options.rope_theta))
    return (
        kernel.bind(shapes.seq_k - shapes.seq_q, *scalars),
        kernel.bind(0, *scalars),
        torch.empty(shapes.q_shape, dtype=shapes.dtype, device=device),
        torch.empty(shapes.kv_shape, dtype=shapes.dtype, device=device),
    )
