"""msa_sparse_attention: the launch of sparseforge.msa_ops.msa_sparse_attention and
msa_sparse_decode_attention (that module has the contract). One family per K/V format."""

from __future__ import annotations

from sparseforge import families
from sparseforge.arch import arch_for_device

FAMILIES = ("msa_sparse_attention", "msa_sparse_attention_fp8kv", "msa_sparse_attention_nvfp4")
FAMILY_OF_FORMAT = dict(zip(("16bit", "e4m3", "nvfp4"), FAMILIES, strict=True))
CONSTANTS = (
    "block_keys",
    "head_dim",
    "tile_rows",
    "max_topk",
    "max_group",
    "wgmma_group",
    "max_blocks",
    "max_splits",
)
CONSTRAINTS = ()


def constant(key: str):
    return families.spec(FAMILIES[0]).constant(key)


def built_for(device_index: int, kv_format: str, tile: str | None = None) -> bool:
    """Whether this build has the K/V format's kernels (of this tile) for the device's arch."""
    return families.has_variant(
        FAMILY_OF_FORMAT[kv_format],
        arch_for_device(device_index),
        dtype="bf16",
        head_dim=constant("head_dim"),
        tile=tile,
    )


def forced_tile(kv_format: str):
    """The tile of the variant SPARSEFORGE_VARIANT forces in the K/V format's family (None
    for the union tile), or "auto" when it forces none of that family."""
    forced = _forced(kv_format)
    return "auto" if forced is None else forced.params.get("tile")


def forced_warpgroups(kv_format: str) -> int | None:
    """The warpgroups a CTA of the wgmma union tile SPARSEFORGE_VARIANT forces in the K/V
    format's family, or None when it forces no such tile."""
    forced = _forced(kv_format)
    if forced is None or forced.params.get("tile") != "wgmma":
        return None
    return forced.params["warpgroups"]


def _forced(kv_format: str):
    forced = families.forced_variant()
    if forced is not None and forced.family == FAMILY_OF_FORMAT[kv_format]:
        return forced
    return None


@families.launch_cache(maxsize=256)
def launch(
    device_index: int,
    kv_format: str,
    dtype: str,
    scale_log2: float,
    out_scale: float,
    temperature: float,
    group: int,
    paged: bool,
    causal: bool,
    has_q_offset: bool,
    want_lse: bool,
    splits: int,
    tile: str | None = None,
    hand_off: float = 0.0,
    warpgroups: int = 1,
    hand_in: bool = False,
):
    """The bound launch; `tile`: None for the union tile kernel (64 // G tokens a CTA),
    "wgmma" for its sm_90a form (G = 16; `warpgroups` a CTA, 4 tokens each), "token" for
    the one-token kernel; `hand_off`, `hand_in`: the ABI's (0: off)."""
    params = dict(dtype=dtype, head_dim=constant("head_dim"), tile=tile)
    if tile == "wgmma":
        params["warpgroups"] = warpgroups
    kernel = families.choose(FAMILY_OF_FORMAT[kv_format], arch_for_device(device_index), **params)
    kernel.prepare()
    return kernel.bind(
        scale_log2,
        out_scale,
        temperature,
        group,
        int(paged),
        int(causal),
        int(has_q_offset),
        int(want_lse),
        splits,
        hand_off,
        int(hand_in),
    )
