"""Compile one catalog variant with the CuTe DSL and export it as a C header + object.

    python -m generator.aot VARIANT_NAME --out DIR

writes DIR/VARIANT_NAME.h, DIR/VARIANT_NAME.o and DIR/VARIANT_NAME.d (a depfile listing the
source files the object depends on: the exporter's and the template's import closures, so
that an edit rebuilds only the variants that import the edited module). No GPU is needed:
the arch comes from the variant, and fake tensors built from the family ABI stand in for
the arguments.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import importlib
import os
import re
import sys
import time
from pathlib import Path

from generator.abi import ScalarArg, TensorArg
from generator.catalog import by_name
from generator.family import Variant

GENERATOR_ROOT = Path(__file__).resolve().parent


def _load_dsl_runtime():
    """export_to_c for an arch other than the host default needs the DSL runtime loaded."""
    from cutlass.base_dsl import env_manager

    ctypes.CDLL(env_manager.get_prefix_dsl_libs("CUTE_DSL"), mode=ctypes.RTLD_GLOBAL)


def fake_args(variant: Variant) -> list:
    """Fake tensors and scalars in ABI order, then a fake stream."""
    import cutlass
    import cutlass.cute as cute

    from generator.kernels.common.entry import element_type

    dtype_name = variant.params.get("dtype")
    args = []
    for arg in variant.abi:
        if isinstance(arg, ScalarArg):
            args.append(cutlass.Float32(0.0) if arg.dtype == "f32" else cutlass.Int32(0))
            continue
        shape = tuple(cute.sym_int() if s is None else s for s in arg.shape)
        stride = tuple(
            cute.sym_int64(divisibility=arg.divisibility) if s is None else s for s in arg.stride
        )
        args.append(
            cute.runtime.make_fake_tensor(
                element_type(arg.element(dtype_name)),
                shape,
                stride,
                assumed_align=arg.align_bytes(dtype_name),
            )
        )
    args.append(cute.runtime.make_fake_stream())
    return args


def c_prefix(variant: Variant) -> str:
    return "sf_" + variant.name


def header_dynamic_counts(header: str, prefix: str) -> dict[str, tuple[int, int]]:
    """{tensor name: (dynamic shapes, dynamic strides)} as the exported header declares."""
    counts = {}
    pattern = re.compile(
        r"typedef struct \{(.*?)\} " + re.escape(prefix) + r"_Tensor_(\w+)_t;", re.S
    )
    for body, name in pattern.findall(header):
        shapes = re.search(r"dynamic_shapes\[(\d+)\]", body)
        strides = re.search(r"dynamic_strides\[(\d+)\]", body)
        counts[name] = (
            int(shapes.group(1)) if shapes else 0,
            int(strides.group(1)) if strides else 0,
        )
    return counts


def check_header_matches_abi(variant: Variant, header: str) -> None:
    """The runtime packs arguments from the ABI; the header must agree or launches go wrong."""
    counts = header_dynamic_counts(header, c_prefix(variant))
    for arg in variant.abi:
        if not isinstance(arg, TensorArg):
            continue
        want = (len(arg.dynamic_shape_modes), len(arg.dynamic_stride_modes))
        got = counts.get(arg.name)
        if got != want:
            raise RuntimeError(
                f"{variant.name}: exported tensor {arg.name!r} has (dynamic shapes, strides) "
                f"{got}, the family ABI says {want}"
            )


def module_file(name: str) -> Path | None:
    """The source file of a generator module (None for other packages)."""
    if name != "generator" and not name.startswith("generator."):
        return None
    base = GENERATOR_ROOT.parent.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def import_closure(module: str) -> list[Path]:
    """Source files of `module` and of every generator module it imports, transitively
    (read from the import statements; packages' __init__ files included)."""
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # a module's packages run first
            prefix = ".".join(parts[:i])
            path = module_file(prefix)
            if path is None or prefix in seen:
                continue
            seen[prefix] = path
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    todo += [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    todo.append(node.module)
                    todo += [f"{node.module}.{alias.name}" for alias in node.names]
    return sorted(seen.values())


def dependencies(variant: Variant) -> list[Path]:
    """What a variant's object is made from: this exporter's and the template's closures."""
    return sorted(
        set(import_closure(__name__ if __name__ != "__main__" else "generator.aot"))
        | set(import_closure(variant.template.module))
    )


def compile_variant(variant: Variant, out_dir: Path, build_root: Path | None = None) -> Path:
    import cutlass.cute as cute

    from generator.kernels.common.entry import entry_point

    _load_dsl_runtime()
    kernel = importlib.import_module(variant.template.module).make_kernel(variant)
    compiled = cute.compile(
        entry_point(kernel, variant.abi), *fake_args(variant), options=f"--gpu-arch {variant.arch}"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    compiled.export_to_c(
        file_path=str(out_dir), file_name=variant.name, function_prefix=c_prefix(variant)
    )
    header = out_dir / f"{variant.name}.h"
    check_header_matches_abi(variant, header.read_text())
    deps = " ".join(str(p) for p in dependencies(variant))
    target = out_dir / f"{variant.name}.o"
    if build_root is not None:  # ninja runs there and names the object relative to it
        target = Path(os.path.relpath(target, build_root))
    (out_dir / f"{variant.name}.d").write_text(f"{target}: {deps}\n")
    return header


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--build-root", type=Path, help="the depfile names the object relative to this directory"
    )
    args = parser.parse_args(argv)
    start = time.time()
    root = args.build_root.resolve() if args.build_root else None
    compile_variant(by_name(args.variant), args.out.resolve(), root)
    print(f"compiled {args.variant} in {time.time() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
