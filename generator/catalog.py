"""The variant catalog: every kernel the library ships, read off the family specs.

    families()          every Family of generator/families/, by name
    catalog(archs)      every Variant for the given archs, in a stable order
    by_name(name)       one Variant

Adding a family is adding a module to generator/families/; adding a variant is adding a row
to a template's configs there.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from generator import families as _families_package
from generator.family import ALL_ARCHS, Family, Variant


@functools.cache
def families() -> dict[str, Family]:
    found = {}
    for info in sorted(pkgutil.iter_modules(_families_package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{_families_package.__name__}.{info.name}")
        for family in module.FAMILIES:
            if family.name in found:
                raise ValueError(f"family {family.name!r} is declared twice")
            found[family.name] = family
    return found


def catalog(archs=ALL_ARCHS) -> list[Variant]:
    """All variants for the given archs: by family, arch, template preference, config row."""
    unknown = set(archs) - set(ALL_ARCHS)
    if unknown:
        raise ValueError(f"unknown arch(s) {sorted(unknown)}; known: {list(ALL_ARCHS)}")
    out = []
    for family in families().values():
        for arch in ALL_ARCHS:
            if arch not in archs:
                continue
            for template in family.templates_for(arch):
                for config in template.configs:
                    out.append(Variant(family, template, arch, tuple(sorted(config.items()))))
    return out


def by_name(name: str) -> Variant:
    for v in catalog():
        if v.name == name:
            return v
    raise KeyError(f"no variant named {name!r}")
