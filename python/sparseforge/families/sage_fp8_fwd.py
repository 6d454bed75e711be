"""sage_fp8_fwd: Sage FP8 block-sparse attention (e4m3 q/k/v with fp32 scales, bf16 out).

plan() binds the scales; run() passes V transposed (the ABI's mVt, keys contiguous: e4m3
MMAs need V K-major) and K as the chosen template's layout rules ask.
"""

from __future__ import annotations

import torch

from sparseforge import families, planner
from sparseforge.checks import check_tensor, check_vector_operand

FAMILIES = ("sage_fp8_fwd",)
CONSTANTS = ("unit_rows", "tile_keys", "keys_per_scale")
CONSTRAINTS = ("units_per_cta", "layouts")


def constant(key: str):
    return families.spec(FAMILIES[0]).constant(key)


def check_scales(
    q_scale, k_scale, v_scale, num_qo_heads, num_kv_heads, seq_q, seq_k, head_dim, device
):
    """The three scales of a Sage FP8 plan, as sage_fp8_quantize returns them."""
    given = {"q_scale": q_scale, "k_scale": k_scale, "v_scale": v_scale}
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise ValueError(
            f"q_data_type=float8_e4m3fn (Sage FP8) needs q_scale, k_scale and v_scale; missing "
            f"{', '.join(missing)} (sparseforge.sage_fp8_quantize makes all three)"
        )
    groups = -(-seq_k // constant("keys_per_scale"))
    check_tensor("q_scale", q_scale, (1, num_qo_heads, seq_q), torch.float32, device)
    check_tensor("k_scale", k_scale, (1, num_kv_heads, groups), torch.float32, device)
    check_tensor("v_scale", v_scale, (num_kv_heads, head_dim), torch.float32, device)
    return q_scale, k_scale, v_scale


def tile_scales_view(k_scale):
    """k_scale (1, Hkv, G) as the kernels read it, (Hkv, G_pad) with each tile's scales side
    by side (G_pad = the groups of whole tiles; entries past G are never used: they belong to
    keys past the sequence, which are masked): a view of the same memory when its rows are
    G_pad-or-more apart, 16-byte aligned, with the padding of the last row allocated (as
    sage_fp8_quantize lays it out), else None."""
    keys = k_scale[0]
    hkv, groups = keys.shape
    per_tile = constant("tile_keys") // constant("keys_per_scale")
    padded = -(-groups // per_tile) * per_tile
    row, unit = keys.stride()
    end = keys.storage_offset() + (hkv - 1) * row + padded
    if unit != 1 or row < padded or row % per_tile or keys.data_ptr() % 16:
        return None
    if end * keys.element_size() > keys.untyped_storage().nbytes():
        return None
    return keys.as_strided((hkv, padded), (row, 1))


def bind(kernel, tiles, scale_log2: float, scales, logit_args=None):
    """(launch, refresh): the scales as the ABI's (tokens or channels, heads) views, then the
    tile lists and the softmax scale. The kernels read every scale from the caller's tensors
    at each run, so scales written in place (re-quantized K/V) take effect; a k_scale whose
    memory cannot be read per tile in place (tile_scales_view) is read from a copy that
    `refresh()` (called before each launch) brings up to date: one small copy per run."""
    q_scale, k_scale, v_scale = scales
    per_tile = tile_scales_view(k_scale)
    refresh = None
    if per_tile is None:
        per_scale = constant("keys_per_scale")
        hkv, groups = k_scale.shape[1:]
        copy = planner.tile_padded_scales(
            hkv, groups * per_scale, per_scale, constant("tile_keys"), k_scale.device
        )
        per_tile = copy[0]

        def refresh():
            copy[0, :, :groups].copy_(k_scale[0])

        refresh()
    launch = kernel.bind(q_scale[0].t(), per_tile.t(), v_scale.t(), *tiles.tensors(), scale_log2)
    return launch, refresh


def check_sm_scale(sm_scale: float) -> None:
    """Any finite scale: the Sage kernels scale the scores before taking row maxima."""


def check_operand(name: str, t) -> None:
    """q, k and out as the kernels load and store them; v has a layout of its own."""
    if name != "v":
        check_vector_operand(name, t)


def keys_contiguous(v):
    """V (Sk, Hkv, D) with unit stride on the keys. sparseforge.sage_fp8_quantize returns v
    in that layout (a transposed view), which is used as is; any other layout is transposed
    here into a new buffer (one extra pass over V)."""
    sk, hkv, d = v.shape
    if v.stride(0) == 1 and v.stride(1) % 16 == 0 and v.stride(2) % 16 == 0:  # 16 bytes
        return v
    per_scale = constant("keys_per_scale")
    keys = -(-sk // per_scale) * per_scale
    buf = torch.empty((hkv, d, keys), dtype=v.dtype, device=v.device)
    buf[:, :, sk:].zero_()  # the row padding only: 16-byte reads past the last key see zeros
    buf[:, :, :sk].copy_(v.permute(1, 2, 0))
    return buf[:, :, :sk].permute(2, 0, 1)


def heads_in_whole_tiles(k):
    """K (Sk, Hkv, D) whose heads start a whole number of tiles apart, with the padding after
    the last head's keys allocated (read, never used): the layout of a template that loads
    every head's keys through one view. sparseforge.sage_fp8_quantize returns k so (a view
    of a buffer padded to whole tiles), which is used as is; any other k is copied here into
    such a buffer (one extra pass over K)."""
    sk, hkv, d = k.shape
    tile = constant("tile_keys")
    row, head = k.stride(0), k.stride(1)
    span = k.storage_offset() + hkv * head  # elements from the storage's start
    if (
        row >= d
        and head > 0
        and head % (tile * row) == 0
        and span * k.element_size() <= k.untyped_storage().nbytes()
    ):
        return k
    buf = planner.tile_padded_keys(hkv, sk, d, k.dtype, k.device, tile)
    buf[:, :sk].copy_(k.transpose(0, 1))
    return buf[:, :sk].transpose(0, 1)


LAYOUT_RULES = {"heads_in_whole_tiles": heads_in_whole_tiles}


def operands(kernel, q, k, v, out, lse, hnd: bool):
    """(leading tensors in ABI order, swap01 = False): q, k, out, lse as (seq, heads, ...)
    views, V as the ABI's (D, Sk, Hkv) with unit key stride, and K as the template's layout
    rule asks."""
    v = keys_contiguous(v.transpose(0, 1) if hnd else v).permute(2, 0, 1)
    if hnd:
        q, k, out, lse = q.transpose(0, 1), k.transpose(0, 1), out.transpose(0, 1), lse.t()
    rule = kernel.layout("mK")
    if rule is not None:
        k = LAYOUT_RULES[rule](k)
    return (q, k, v, out, lse), False
