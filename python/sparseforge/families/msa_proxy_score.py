"""msa_proxy_score: the launches of sparseforge.msa_ops.msa_proxy_score and
msa_proxy_score_fp4 (that module has the contract)."""

from __future__ import annotations

from sparseforge import families
from sparseforge.arch import arch_for_device
from sparseforge.errors import VariantNotBuiltError

FAMILIES = ("msa_proxy_score", "msa_proxy_score_nvfp4")
CONSTANTS = ("block_keys", "head_dim")
CONSTRAINTS = ()


def constant(key: str):
    return families.spec(FAMILIES[0]).constant(key)


@families.launch_cache(maxsize=64)
def launch(
    device_index: int,
    dtype: str,  # "nvfp4": the NVFP4 family (q and k codes with scales)
    key_layout: str,
    max_seqlen_q: int,
    kv_heads: int,
    causal: bool,
    has_q_offset: bool,
    reduce_heads: bool,
    logit_scale: float = 1.0,  # NVFP4 only
    fp32_sums: bool = True,  # use_fp32_acc
):
    head_dim = constant("head_dim")
    arch = arch_for_device(device_index)
    flags = (max_seqlen_q, kv_heads, int(causal), int(has_q_offset), int(reduce_heads))
    if dtype == "nvfp4":
        kernel = families.choose(FAMILIES[1], arch, head_dim=head_dim, key_layout=key_layout)
        kernel.prepare()
        return kernel.bind(*flags, logit_scale)
    kernel = _choose(arch, dtype, head_dim, key_layout, fp32_sums)
    kernel.prepare()
    return kernel.bind(*flags)


def _choose(arch: str, dtype: str, head_dim: int, key_layout: str, fp32_sums: bool):
    """The variant for these inputs. Without fp32_sums, e4m3 takes a variant that sums on the
    FP8 tensor cores (accumulate "fp8": faster, fewer bits) where one is built; otherwise,
    and where none is, one that sums in fp32."""
    params = dict(dtype=dtype, head_dim=head_dim, key_layout=key_layout)
    if not fp32_sums and dtype == "e4m3":
        try:
            return families.choose(FAMILIES[0], arch, **params, accumulate="fp8")
        except VariantNotBuiltError:
            pass
    return families.choose(FAMILIES[0], arch, **params, accumulate="fp32")
