"""`python -m sparseforge info [--selftest]`: what this build contains and what GPU it would run
on; with --selftest, every variant of that GPU against the PyTorch reference."""

from __future__ import annotations

import sys
from collections import defaultdict

import sparseforge
from sparseforge import _library, arch, selftest
from sparseforge.errors import SparseforgeError


def build_summary() -> list[str]:
    m = _library.manifest()
    lines = [
        f"build archs: {', '.join(m['archs'])}",
        f"built from: {m.get('source') or 'unknown (not a git checkout)'}",
        "variants (family / arch: template x count, params):",
    ]
    groups = defaultdict(list)
    for v in m["variants"]:
        groups[(v["family"], v["arch"], v["template"])].append(v["params"])
    for (family, arch_name, template), params in sorted(groups.items()):
        keys = sorted({k for p in params for k in p})
        values = "; ".join(
            f"{k} {'/'.join(map(str, _distinct(p.get(k) for p in params)))}" for k in keys
        )
        lines.append(f"  {family} / {arch_name}: {template} x{len(params)} ({values})")
    lib = _library.PACKAGE_DIR / _library.LIBRARY_NAME
    size = f"{lib.stat().st_size / 1e6:.1f} MB" if lib.exists() else "MISSING"
    lines.append(f"kernel library: {lib} ({size})")
    return lines


def _distinct(values) -> list:
    """The distinct values, sorted (of mixed types: by type name first)."""
    return sorted(set(values), key=lambda x: (str(type(x)), x))


def gpu_summary() -> str:
    try:
        major, minor = arch.device_capability(0)
    except SparseforgeError as exc:
        return f"GPU: none ({exc})"
    try:
        chosen = arch.arch_for_device(0)
        line = f"GPU 0: {device_name(0)}, compute capability {major}.{minor} -> runs {chosen}"
        if chosen not in selftest.RUN_ON:
            line += (
                " (an arch our GPU suite has not run: each variant checks itself before its "
                "first use; SPARSEFORGE_SELFTEST=0 skips that)"
            )
        return line
    except SparseforgeError as exc:
        return f"GPU 0: {device_name(0)}, compute capability {major}.{minor}: {exc}"


def device_name(index: int) -> str:
    from cuda.bindings import driver

    err, dev = driver.cuDeviceGet(index)
    err, name = driver.cuDeviceGetName(64, dev)
    return name.split(b"\0", 1)[0].decode() if int(err) == 0 else "unknown"


def distribution_version() -> str:
    """The installed wheel's version: X.Y.Z for the fat wheel, X.Y.Z+sm90a for an arch wheel."""
    from importlib import metadata

    try:
        return metadata.version("sparseforge")
    except metadata.PackageNotFoundError:
        return sparseforge.__version__


def main(argv=None) -> int:
    """With --selftest, also run every check of this GPU's variants (sparseforge.check)."""
    args = argv or []
    if any(a != "--selftest" for a in args):
        print("usage: python -m sparseforge info [--selftest]", file=sys.stderr)
        return 2
    print(f"sparseforge {distribution_version()}")
    try:
        for line in build_summary():
            print(line)
    except SparseforgeError as exc:
        print(f"build: {exc}")
        return 1
    print(gpu_summary())
    if args:
        from sparseforge import check

        return check.main([])
    return 0
