"""What a kernel family declares, and the variants the build compiles from it.

A family is one module in generator/families/ that defines `FAMILIES`, a tuple of `Family`
objects: its ABI, dtypes, templates (each with the archs it is built for and its config
grid; the order of `templates` is the preference order on an arch), the archs it must exist
for, the constants its kernels and its runtime share, and the runtime constraints of each
template. The registry writes all of it into manifest.json; the runtime chooses, binds and
launches from that, so nothing about a family is written twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# The build's targets: sm_90a (wgmma is arch-specific; Hopper is 9.0 only) and the Blackwell
# family targets, whose code runs on every compute capability of the family (sm_100f: 10.0
# B200 and 10.3 B300; sm_120f: 12.0 and 12.1 DGX Spark); sm_100a / sm_120a code would load on
# 10.0 / 12.0 only. Their kernels compile to the same SASS either way (mma.sync, TMA).
ALL_ARCHS = ("sm_90a", "sm_100f", "sm_120f")


@dataclass(frozen=True)
class Template:
    """One kernel template of a family: a module under generator/kernels with a
    `make_kernel(variant)`."""

    name: str  # the name users see (backend_in_use, variant names)
    module: str  # e.g. "generator.kernels.sm90.block_sparse_fwd"
    archs: tuple[str, ...]
    configs: tuple[dict, ...] = ({},)
    # Runs on every arch (mma.sync / CUDA cores): what backend="warp_mma" selects.
    portable: bool = False
    # Operand layouts this template needs beyond its ABI, by argument name; the family's
    # runtime module knows how to meet each rule (sparseforge/families/).
    layouts: dict = field(default_factory=dict)
    # The tensor-core instructions every image of it must contain, "wgmma", "mma.sync" or
    # "tcgen05" (None: CUDA cores only); ci/compile_matrix.py finds them in the SASS, so a
    # kernel compiled for an arch it cannot run on here still shows that it multiplies on
    # them.
    mma: str | None = None


@dataclass(frozen=True)
class Family:
    name: str
    doc: str
    abi: Callable  # abi(head_dim) -> tuple of TensorArg / ScalarArg
    templates: tuple[Template, ...]
    dtypes: tuple[str, ...] = ()
    required_archs: tuple[str, ...] = ALL_ARCHS
    constants: dict = field(default_factory=dict)
    # The config key that says how many units one CTA runs on one tile list (the runtime
    # must hand it work in groups of that many), if any.
    units_per_cta_key: str | None = None

    def templates_for(self, arch: str) -> tuple[Template, ...]:
        """The family's templates built for `arch`, in preference order."""
        return tuple(t for t in self.templates if arch in t.archs)


@dataclass(frozen=True)
class Variant:
    """One (family, template, config, arch) the build compiles."""

    family: Family
    template: Template
    arch: str
    config: tuple = ()  # sorted (key, value) pairs of the template's config row

    @property
    def params(self) -> dict:
        return dict(self.config)

    @property
    def name(self) -> str:
        p = self.params
        config = f"{p['dtype']}_d{p['head_dim']}" if p.get("dtype") else "any"
        if p.get("warpgroups", 1) > 1:
            config += f"_w{p['warpgroups']}"
        if p.get("key_layout"):
            config += f"_{p['key_layout']}"
        if p.get("shard_rows"):
            config += f"_r{p['shard_rows']}"
        if p.get("accumulate", "fp32") != "fp32":
            config += f"_acc_{p['accumulate']}"
        if p.get("logits"):
            config += f"_{p['logits']}"
        return f"{self.family.name}__{self.template.name}__{config}__{self.arch}"

    @property
    def abi(self):
        return self.family.abi(self.params.get("head_dim"))

    @property
    def constraints(self) -> dict:
        """What the runtime must respect when it binds this variant (beyond the ABI and the
        family's constants)."""
        key = self.family.units_per_cta_key
        return {
            "units_per_cta": self.params.get(key, 1) if key else 1,
            "layouts": dict(self.template.layouts),
        }
