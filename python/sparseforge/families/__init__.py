"""The kernel families as the build describes them (manifest.json), and the choice of a
variant.

    spec(name)            a family's dtypes, templates per arch in preference order, required
                          archs and constants (from its spec in generator/families/)
    choose(name, arch)    the variant a call runs
    has_variant           whether the build has one for these parameters
    launch_cache          the cache of a family module's bound launches
    missing_requirements  what a runtime family module needs that the manifest lacks

One module per family (or per family of launches made together) beside this one binds its
variants and prepares their operands; each names its FAMILIES and declares the constants
and constraints it reads (CONSTANTS, CONSTRAINTS), and a CPU test checks that the manifest
has them.
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from dataclasses import dataclass

from sparseforge import _library
from sparseforge.errors import NotBuiltError, VariantNotBuiltError, VariantSelfCheckError


@dataclass(frozen=True)
class FamilySpec:
    name: str
    doc: str
    dtypes: tuple[str, ...]
    required_archs: tuple[str, ...]
    templates: dict  # arch -> template names in preference order
    portable_templates: tuple[str, ...]
    constants: dict

    def constant(self, key: str):
        try:
            return self.constants[key]
        except KeyError:
            raise NotBuiltError(
                f"manifest.json has no constant {key!r} for family {self.name}: the kernel library "
                "is older than this runtime; reinstall sparseforge"
            ) from None


@functools.cache
def spec(name: str) -> FamilySpec:
    families = _library.manifest()["families"]
    if name not in families:
        raise VariantNotBuiltError(
            f"family {name} is not in this build; built: {', '.join(sorted(families))}"
        )
    f = families[name]
    return FamilySpec(
        name=name,
        doc=f["doc"],
        dtypes=tuple(f["dtypes"]),
        required_archs=tuple(f["required_archs"]),
        templates={arch: tuple(names) for arch, names in f["templates"].items()},
        portable_templates=tuple(f["portable_templates"]),
        constants=dict(f["constants"]),
    )


def _matches(kernel: _library.Kernel, params: dict) -> bool:
    return all(kernel.params.get(k) == want for k, want in params.items())


def _not_built(family: str, arch: str, candidates: list, params: dict) -> VariantNotBuiltError:
    """The clearest error for a choice with no match: the parameter that is not built."""
    if not candidates:
        return VariantNotBuiltError(f"{family} is not built for {arch}")
    for key, want in params.items():
        values = sorted({k.params.get(key) for k in candidates}, key=lambda x: (str(type(x)), x))
        if want not in values:
            return VariantNotBuiltError(
                f"{key} {want} is not built for {family} on {arch}; "
                f"built {key}s: {', '.join(map(str, values))}"
            )
    return VariantNotBuiltError(f"no built {family} variant on {arch} has {params}")


def forced_variant() -> _library.Kernel | None:
    """The variant SPARSEFORGE_VARIANT names (see choose), or None."""
    name = os.environ.get("SPARSEFORGE_VARIANT")
    if not name:
        return None
    entry = next((v for v in _library.manifest()["variants"] if v["name"] == name), None)
    if entry is None:
        raise VariantNotBuiltError(
            f"SPARSEFORGE_VARIANT={name}: no variant of that name in this build"
        )
    return _library.Kernel.from_manifest(entry)


def launch_cache(maxsize: int | None = 64):
    """functools.lru_cache for what a family module binds after choose(), keyed also by
    SPARSEFORGE_VARIANT as it stands at each call: the choice depends on it, and a process
    that forces variants one after another (the bench, sparseforge.check, the tests) must
    run each of them, not the launch cached for the first."""

    def decorate(bind):
        cached = functools.lru_cache(maxsize)(lambda forced, *a, **kw: bind(*a, **kw))

        @functools.wraps(bind)
        def bound(*args, **kwargs):
            return cached(os.environ.get("SPARSEFORGE_VARIANT"), *args, **kwargs)

        bound.cache_clear = cached.cache_clear
        return bound

    return decorate


def has_variant(family: str, arch: str, **params) -> bool:
    """Whether this build has a variant of `family` for `arch` with these parameters among
    the templates choose() prefers (whatever SPARSEFORGE_VARIANT forces)."""
    return bool(_preferred(family, arch, False, tuple(sorted(params.items()))))


def _unchecked(kernel: _library.Kernel, arch: str) -> str | None:
    return None


# What keeps a chosen variant from running (None: nothing): sparseforge.selftest installs its
# first-use self-check here when sparseforge is imported (this package cannot import it: the
# checks import the families).
self_check = _unchecked


def choose(
    family: str, arch: str, *, portable: bool = False, fits=None, **params
) -> _library.Kernel:
    """The variant of `family` for `arch` with these parameters: the first template in the
    family's preference order (only its portable ones with `portable`) that has one; of
    its variants, the one with the most units per CTA that `fits(units)` allows.

    SPARSEFORGE_VARIANT=<name> forces a variant of the family it belongs to (tuning,
    debugging): it must exist in this build, and for its family's calls be of this arch,
    match the parameters and fit. Other families' choices are not affected.

    On an arch our GPU suite has not run, a variant is chosen only once its first-use
    self-check passed (self_check, sparseforge.selftest): one that fails gives way to the
    next that fits.
    """
    fits = fits or (lambda units: True)
    built = _library.kernels(family, arch)
    forced = forced_variant()
    if forced is not None and forced.family == family:
        if forced not in built or not _matches(forced, params):
            raise VariantNotBuiltError(
                f"SPARSEFORGE_VARIANT={forced.name} does not fit: this call needs {family} on "
                f"{arch} with {params}"
            )
        if not fits(forced.units_per_cta):
            raise ValueError(
                f"SPARSEFORGE_VARIANT={forced.name} runs units in groups of "
                f"{forced.units_per_cta} with one tile list; this plan has none"
            )
        why = self_check(forced, arch)
        if why is not None:
            raise VariantSelfCheckError(
                f"SPARSEFORGE_VARIANT={forced.name} failed its self-check on this GPU: {why}"
            )
        return forced
    failed = []
    for kernel in _preferred(family, arch, portable, tuple(sorted(params.items()))):
        if fits(kernel.units_per_cta):
            why = self_check(kernel, arch)
            if why is None:
                return kernel
            failed.append(f"{kernel.name}: {why}")
    if failed:
        raise VariantSelfCheckError(
            f"every {family} variant for this call failed its self-check on this GPU ("
            + "; ".join(failed)
            + "); SPARSEFORGE_SELFTEST=0 runs them unchecked"
        )
    order = _templates(family, arch, portable)
    raise _not_built(family, arch, [k for k in built if k.template in order], params)


def _templates(family: str, arch: str, portable: bool) -> tuple[str, ...]:
    order = spec(family).templates.get(arch, ())
    if portable:
        order = tuple(t for t in order if t in spec(family).portable_templates)
    return order


@functools.cache
def _preferred(family: str, arch: str, portable: bool, params: tuple) -> tuple:
    """The built variants with these parameters in choose()'s order: by template preference,
    then most units per CTA first (found once: plan() asks on every call)."""
    built = _library.kernels(family, arch)
    return tuple(
        kernel
        for template in _templates(family, arch, portable)
        for kernel in sorted(
            (k for k in built if k.template == template and _matches(k, dict(params))),
            key=lambda k: -k.units_per_cta,
        )
    )


def runtime_modules() -> dict:
    """{family name: its runtime module} for every module in this package."""
    modules = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        modules.update(dict.fromkeys(module.FAMILIES, module))
    return modules


def missing_requirements(manifest: dict | None = None) -> list[str]:
    """What the runtime family modules read that the manifest does not carry (empty when the
    build and the runtime agree)."""
    manifest = manifest or _library.manifest()
    missing = []
    for name, module in runtime_modules().items():
        family = manifest["families"].get(name)
        if family is None:
            missing.append(f"{name}: family not in the manifest")
            continue
        missing += [
            f"{name}: constant {c}" for c in module.CONSTANTS if c not in family["constants"]
        ]
        rules = getattr(module, "LAYOUT_RULES", {})
        for v in manifest["variants"]:
            if v["family"] == name:
                missing += [
                    f"{v['name']}: constraint {c}"
                    for c in module.CONSTRAINTS
                    if c not in v["constraints"]
                ]
                layouts = v["constraints"].get("layouts", {})
                missing += [
                    f"{v['name']}: layout rule {r}" for r in layouts.values() if r not in rules
                ]
    return missing
