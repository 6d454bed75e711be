"""Facts about the build toolchain that CMake asks for.

python -m generator.toolchain dsl-runtime    # path of the DSL's static runtime library
python -m generator.toolchain dsl-version
"""

import sys
from importlib import metadata
from pathlib import Path

PINNED_DSL_VERSION = "4.8.1"
# The DSL's libraries come in a package per CUDA major; the CUDA 13 one must be there (with
# only the CUDA 12 one the kernels come out for "sm_13"; beside it, the CUDA 13 one is used).
DSL_LIBS = "nvidia-cutlass-dsl-libs-cu13"


def dsl_root() -> Path:
    import cutlass

    # .../nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py
    return Path(cutlass.__file__).resolve().parents[2]


def dsl_runtime_static() -> Path:
    for flavour in ("cu13", "cu12"):
        lib = dsl_root() / flavour / "lib" / "libcuda_dialect_runtime_static.a"
        if lib.exists():
            return lib
    raise FileNotFoundError(f"libcuda_dialect_runtime_static.a not found under {dsl_root()}")


def dsl_version() -> str:
    return metadata.version("nvidia-cutlass-dsl")


def installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def dsl_libs_problem() -> str | None:
    """Why the installed DSL libraries cannot build this package, or None."""
    found = installed(DSL_LIBS)
    if found != PINNED_DSL_VERSION:
        return (
            f"the build needs {DSL_LIBS}=={PINNED_DSL_VERSION} (found {found}): pip install "
            f"{DSL_LIBS}=={PINNED_DSL_VERSION}, then delete the build directory (objects "
            "compiled with other libraries stay there)"
        )
    return None


def main(argv=None) -> int:
    what = (argv or sys.argv[1:] or ["dsl-runtime"])[0]
    if what == "dsl-runtime":
        print(dsl_runtime_static())
    elif what == "dsl-version":
        version = dsl_version()
        if version != PINNED_DSL_VERSION:
            print(
                f"nvidia-cutlass-dsl {version} found, {PINNED_DSL_VERSION} pinned", file=sys.stderr
            )
            return 1
        problem = dsl_libs_problem()
        if problem:
            print(problem, file=sys.stderr)
            return 1
        print(version)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
