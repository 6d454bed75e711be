"""From a selection to a launch: the attention family and variant, the tile lists, binding.

    plan_attention(selection, ...) -> Plan      choose, build the tile lists, bind
    run_attention(plan, q, k, v, out, lse)      operands in the family's layout, launch

The family is the one whose manifest dtypes hold the plan's dtype; the variant is chosen by
families.choose (preference order per arch, units per CTA the plan's groups allow). Tile
lists come from the planner (pure torch), compacted and ordered on the GPU by the planner
kernels (tile_compact, unit_order).
Plans with logit options, or whose blocks are not multiples of the tile, run the family's
logits variants (16-bit; logit_options.py) where it has them. Backends: "auto" runs our
kernels where one applies and otherwise the PyTorch reference with a warning; "torch"
always the reference; "warp_mma" the portable templates; the kernel backends ("sparseforge"
and its FlashInfer synonyms) refuse what no kernel covers.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

from sparseforge import families, logit_options, ops, planner, reference, sparsity
from sparseforge.arch import arch_for_device
from sparseforge.dtypes import NAME_OF
from sparseforge.families import (
    block_sparse_fwd,
    rope_llama,
    sage_fp8_fwd,
    tile_compact,
    unit_order,
)
from sparseforge.plan import LogitOptions, Plan
from sparseforge.sparsity import Selection

KERNEL_BACKENDS = ("sparseforge", "fa2", "fa3", "cake", "cake_cute")
BACKENDS = ("auto", "torch", "warp_mma", *KERNEL_BACKENDS)
LOG2_E = math.log2(math.e)
ATTENTION_FAMILIES = (block_sparse_fwd, sage_fp8_fwd)


def attention_family(dtype: torch.dtype):
    """The runtime module of the attention family whose kernels take `dtype` operands."""
    name = NAME_OF[dtype]
    for module in ATTENTION_FAMILIES:
        if name in families.spec(module.FAMILIES[0]).dtypes:
            return module
    raise ValueError(f"no attention family of this build takes {dtype}")


def plan_attention(
    selection: Selection,
    *,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    sm_scale: float,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hnd: bool,
    scales,
    backend: str,
    device: torch.device,
    blocks: str,
    logits: LogitOptions,
) -> Plan:
    """The plan of one attention problem; `blocks` describes the blocks for errors."""
    common = dict(
        dtype=dtype,
        out_dtype=out_dtype,
        sm_scale=sm_scale,
        seq_q=selection.seq_q,
        seq_k=selection.seq_k,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hnd=hnd,
        scales=scales,
    )
    if backend == "torch":
        return _reference_plan(selection, logits, common)
    family = attention_family(dtype)
    spec = families.spec(family.FAMILIES[0])
    unit_rows, tile_keys = spec.constant("unit_rows"), spec.constant("tile_keys")
    rows, cols = selection.host_row_sizes, selection.host_col_sizes
    aligned = planner.sizes_tile_aligned(rows, unit_rows) and planner.sizes_tile_aligned(
        cols, tile_keys
    )
    logit_family = getattr(family, "LOGITS_FAMILY", None)
    # What no kernel of this family takes: any option, or blocks that are not multiples of
    # the tile, where the family has no logits variants (Sage FP8).
    why = None
    if logit_family is None and logits.named():
        why = f"{', '.join(logits.named())}: not in the {NAME_OF[dtype]} kernels"
    elif logit_family is None and not aligned:
        why = f"{blocks} are not multiples of {tile_keys} tokens"
    if why is not None:
        if backend != "auto":
            raise NotImplementedError(f"{why}; backend={backend!r} has no kernel for it")
        warnings.warn(f"{why}: running the PyTorch reference (slow, dense memory)", stacklevel=4)
        return _reference_plan(selection, logits, common)
    rope = logits.pos_encoding_mode == "ROPE_LLAMA"  # q and k rotated first, any kernel
    logit_args = None
    if (len(logits.named()) > rope) or not aligned:
        bits = logits.mask_bits
        if not aligned:  # 64-token tiles, the blocks' edges (and the options' masks) as bits
            selection, bits = logit_options.token_tiles(
                logit_options.shared_head(selection),
                bits,
                logits.causal,
                heads=selection.mask.shape[0],
            )
            rows, cols = selection.host_row_sizes, selection.host_col_sizes
        elif logits.causal and bits is None:
            selection = logit_options.causal_blocks(selection)
        spec = families.spec(logit_family)
        logit_args = logit_options.kernel_arguments(
            logits,
            bits,
            flags=spec.constants,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            sm_scale=sm_scale,
            seq_q=selection.seq_q,
            seq_k=selection.seq_k,
            device=device,
        )
    family.check_sm_scale(sm_scale)
    hkv = selection.mask.shape[0]
    units, tiles = (
        planner.num_tiles(selection.seq_q, unit_rows),
        planner.num_tiles(selection.seq_k, tile_keys),
    )
    if hkv * units * tiles >= 2**31:
        raise ValueError(
            f"this plan's tile lists would hold {hkv * units * tiles} entries ({hkv} kv heads x "
            f"{units} query units x {tiles} key tiles), past the kernels' 32-bit indexing "
            "(2^31): plan fewer heads or shorter sequences per call"
        )
    if device.type != "cuda":
        raise ValueError(
            f"the workspace buffer is on {device}; sparseforge kernels need a CUDA device"
        )
    group = num_qo_heads // num_kv_heads

    def fits(units: int) -> bool:
        """A CTA of `units` units needs them to share a tile list: query heads of one kv
        group, or consecutive units of one row block (planner.longest_first)."""
        return group % units == 0 or planner.rows_fit_units(rows, units, unit_rows)

    arch = arch_for_device(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    kind = {}
    if logit_args is not None:  # the smaller kernel unless a score option is in use
        scores = logits.soft_cap or logits.pos_encoding_mode == "ALIBI"
        kind = dict(logits="scores" if scores else "masks")
    kernel = families.choose(
        spec.name,
        arch,
        portable=backend == "warp_mma",
        fits=fits,
        dtype=NAME_OF[dtype],
        head_dim=head_dim,
        **kind,
    )
    kernel.prepare()
    # The size recheck rides on the unit order's launch (families/unit_order.py).
    size_errors = (
        torch.empty((), dtype=torch.int32, device=device) if selection.size_checks else None
    )
    order = functools.partial(
        unit_order.order,
        tiles=tiles,
        size_checks=selection.size_checks,
        errors=None if size_errors is None else size_errors.view(1),
    )
    tiles = planner.plan_tiles(
        selection.mask,
        selection.row_sizes,
        selection.col_sizes,
        selection.seq_q,
        selection.seq_k,
        num_qo_heads,
        unit_rows=unit_rows,
        tile_keys=tile_keys,
        kv_block_lens=selection.kv_block_lens,
        kv_block_size=selection.kv_block_size,
        units_per_cta=kernel.units_per_cta,
        blocks_are_tiles=planner.sizes_are_tiles(rows, unit_rows)
        and planner.sizes_are_tiles(cols, tile_keys),
        compact=tile_compact.compact,
        order=order,
    )
    launch, refresh = family.bind(kernel, tiles, sm_scale * LOG2_E, scales, logit_args)
    if rope:
        shapes = Plan(path=kernel.template, **common)
        common["rope"] = rope_llama.bind(shapes, logits, device)
    return Plan(
        path=kernel.template,
        family=family,
        kernel=kernel,
        launch=launch,
        refresh=refresh,
        lse_scratch=torch.empty(
            (num_qo_heads, selection.seq_q) if hnd else (selection.seq_q, num_qo_heads),
            dtype=torch.float32,
            device=device,
        ),
        errors=_device_errors(selection, size_errors),
        **common,
    )


def _device_errors(selection: Selection, size_errors):
    """The error bits the GPU computes for a plan: the selection's checks made there (those
    made on the host were raised before planning) and the size recheck."""
    errors = selection.errors
    if errors is not None and errors.device.type == "cpu":
        errors = None
    return sparsity.combine_errors(errors, size_errors)


def run_attention(plan: Plan, q, k, v, out, lse, same_layout: bool = False) -> None:
    """Fill out and lse (in the plan's layout) on the current stream. `same_layout`: q, k,
    v, out and lse are contiguous tensors of the plan's shapes (checks.contiguous_operands),
    so the kernel's operands have the same shapes and strides at every such call."""
    if plan.path == "torch":
        o_ref, lse_ref = _reference(
            plan, *((q, k, v) if plan.hnd else (t.transpose(0, 1) for t in (q, k, v)))
        )
        out.copy_(o_ref if plan.hnd else o_ref.transpose(0, 1))
        lse.copy_(lse_ref if plan.hnd else lse_ref.transpose(0, 1))
        return
    if plan.refresh is not None:
        plan.refresh()
    if plan.rope is not None:
        rotate_q, rotate_k, q_rotated, k_rotated = plan.rope
        ops.launch(rotate_q, (q, q_rotated), plan.hnd)
        ops.launch(rotate_k, (k, k_rotated), plan.hnd)
        q, k = q_rotated, k_rotated
    tensors, swap01 = plan.family.operands(plan.kernel, q, k, v, out, lse, plan.hnd)
    ops.launch(plan.launch, tensors, swap01, same_layout)


def _reference(plan: Plan, q, k, v):
    """The reference path on HND tensors (Sage FP8 ones dequantized with the plan's scales),
    with the plan's logit options."""
    if plan.scales is not None:
        q, k, v = reference.sage_dequantize(q, k, v, *plan.scales)
    options, seq_q, seq_k = plan.logits, q.shape[1], k.shape[1]
    if options.pos_encoding_mode == "ROPE_LLAMA":
        # Positions as the causal mask aligns them: the sequences end together.
        rope = (options.rope_scale, options.rope_theta)
        q = reference.rope_llama(q, torch.arange(seq_q) + (seq_k - seq_q), *rope)
        k = reference.rope_llama(k, torch.arange(seq_k), *rope)
    slopes = None
    if options.pos_encoding_mode == "ALIBI":
        slopes = reference.alibi_slopes(q.shape[0])
    return reference.attention(
        q, k, v, plan.token_mask, plan.sm_scale, logits_soft_cap=options.soft_cap or None,
        alibi_slopes=slopes,
    )  # fmt: skip


def _reference_plan(selection: Selection, logits: LogitOptions, common: dict) -> Plan:
    return Plan(
        path="torch",
        token_mask=_token_mask(selection, logits),
        logits=logits,
        errors=_device_errors(selection, sparsity.size_checks_errors(selection.size_checks)),
        **common,
    )


def _token_mask(selection: Selection, logits: LogitOptions) -> torch.Tensor:
    """(Hkv, Sq, Sk) token mask for the reference path: the selected blocks, and within them
    the masks inside blocks or else, if asked, the causal mask (FlashInfer applies causal
    only without a mask)."""
    lens = selection.kv_block_lens
    mask = reference.block_mask_to_token_mask(
        selection.mask.cpu(),
        selection.row_sizes.cpu(),
        selection.col_sizes.cpu(),
        None if lens is None else lens.cpu(),
    )
    seq_q, seq_k = mask.shape[1:]
    if logits.mask_bits is not None:
        return mask & logit_options.unpack_mask_bits(logits.mask_bits.cpu(), seq_k)
    if logits.causal:
        return mask & reference.causal_mask(seq_q, seq_k)
    return mask
