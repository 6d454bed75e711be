"""sage_quantize_stats / sage_quantize_kv: the two launches of sparseforge.sage_fp8_quantize
(sparseforge/sage.py has the contract)."""

from __future__ import annotations

from sparseforge import _library, families
from sparseforge.arch import arch_for_device

FAMILIES = ("sage_quantize_stats", "sage_quantize_kv")  # launch 1, launch 2
CONSTANTS = ("keys_per_scale", "scale_steps", "amax_min", "chunk_multiple")
CONSTRAINTS = ()


def spec() -> families.FamilySpec:
    return families.spec(FAMILIES[0])


def constant(key: str):
    return spec().constant(key)


def head_dims() -> tuple[int, ...]:
    """The head dims the quantizer is built for (on any arch)."""
    return tuple(
        sorted(
            {
                v["params"]["head_dim"]
                for v in _library.manifest()["variants"]
                if v["family"] in FAMILIES
            }
        )
    )


@families.launch_cache(maxsize=64)
def launches(device_index: int, dtype: str, head_dim: int, chunk: int, smooth_k: int, steps: int):
    """The two launches (statistics + q, then k and v) with chunk_tokens, smooth_k and
    scale_steps bound."""
    arch = arch_for_device(device_index)
    bound = []
    for family in FAMILIES:
        kernel = families.choose(family, arch, dtype=dtype, head_dim=head_dim)
        kernel.prepare()
        bound.append(kernel.bind(chunk, smooth_k, steps))
    return tuple(bound)
