"""Build a few variants into a kernel library of their own, without the full build.

    python -m generator.dev VARIANT [VARIANT ...] --out DIR

compiles the named variants (CuTe DSL, ~2 s each) and the planner kernels (tile_compact,
unit_order, selection_mask) of each variant's arch (attention plans need them), and links
them with the C runtime into DIR/libsparseforge_kernels.so with DIR/manifest.json. The
installed runtime uses them with

    SPARSEFORGE_LIBRARY_DIR=DIR python -m sparseforge.check     # each variant vs the reference
    SPARSEFORGE_LIBRARY_DIR=DIR python -m pytest tests -m gpu ...

on a machine with the GPU (no CuTe DSL needed there). Objects are cached in DIR/build: a
second run recompiles only the variants whose sources changed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from generator.catalog import by_name
from generator.registry import ROOT


def variants_with_planner(names: list[str]) -> list[str]:
    """The variants, plus the planner kernels of each of their archs."""
    archs = {by_name(name).arch for name in names}
    extra = [
        f"{kernel}__{kernel}__any__{arch}"
        for arch in sorted(archs)
        for kernel in ("tile_compact", "unit_order", "selection_mask")
    ]
    return names + [name for name in extra if name not in names]


def build(names: list[str], out: Path) -> Path:
    names = variants_with_planner(names)
    archs = sorted({by_name(name).arch for name in names})
    build_dir = out / "build"
    subprocess.run(
        [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DSPARSEFORGE_ARCHS={';'.join(archs)}",
            f"-DSPARSEFORGE_VARIANTS={';'.join(names)}",
        ],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    subprocess.run(["cmake", "--build", str(build_dir)], check=True)
    shutil.copy2(build_dir / "libsparseforge_kernels.so", out / "libsparseforge_kernels.so")
    shutil.copy2(build_dir / "generated" / "manifest.json", out / "manifest.json")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    out = build(args.variants, args.out.resolve())
    print(f"built {out}: SPARSEFORGE_LIBRARY_DIR={out} python -m sparseforge.check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
