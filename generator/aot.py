"""Compile one catalog variant with the CuTe DSL and export it as a C header + object.

    python -m generator.aot VARIANT_NAME --out DIR

writes DIR/VARIANT_NAME.h and DIR/VARIANT_NAME.o. No GPU is needed: the arch comes from
the variant, and fake tensors built from the family ABI stand in for the arguments.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import re
import sys
import time
from pathlib import Path

from generator.catalog import ScalarArg, TensorArg, Variant, by_name


def _load_dsl_runtime():
    """export_to_c for an arch other than the host default needs the DSL runtime loaded."""
    from cutlass.base_dsl import env_manager

    ctypes.CDLL(env_manager.get_prefix_dsl_libs("CUTE_DSL"), mode=ctypes.RTLD_GLOBAL)


def cutlass_dtype(name: str, variant: Variant):
    import cutlass

    if name == "input":
        name = variant.dtype
    return {
        "bf16": cutlass.BFloat16,
        "fp16": cutlass.Float16,
        "e4m3": cutlass.Float8E4M3FN,
        "f32": cutlass.Float32,
        "i32": cutlass.Int32,
        "u8": cutlass.Uint8,
    }[name]


def fake_args(variant: Variant) -> list:
    """Fake tensors and scalars in ABI order, then a fake stream."""
    import cutlass
    import cutlass.cute as cute

    args = []
    for arg in variant.abi:
        if isinstance(arg, ScalarArg):
            args.append(cutlass.Float32(0.0) if arg.dtype == "f32" else cutlass.Int32(0))
            continue
        dtype = cutlass_dtype(arg.dtype, variant)
        shape = tuple(cute.sym_int() if s is None else s for s in arg.shape)
        stride = tuple(
            cute.sym_int64(divisibility=arg.divisibility) if s is None else s for s in arg.stride
        )
        align = 16 if arg.divisibility * dtype.width >= 128 else max(1, dtype.width // 8)
        args.append(cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=align))
    args.append(cute.runtime.make_fake_stream())
    return args


def c_prefix(variant: Variant) -> str:
    return "sf_" + variant.name


def header_dynamic_counts(header: str, prefix: str) -> dict[str, tuple[int, int]]:
    """{tensor name: (dynamic shapes, dynamic strides)} as the exported header declares."""
    counts = {}
    pattern = re.compile(r"typedef struct \{(.*?)\} " + re.escape(prefix) + r"_Tensor_(\w+)_t;", re.S)
    for body, name in pattern.findall(header):
        shapes = re.search(r"dynamic_shapes\[(\d+)\]", body)
        strides = re.search(r"dynamic_strides\[(\d+)\]", body)
        counts[name] = (int(shapes.group(1)) if shapes else 0, int(strides.group(1)) if strides else 0)
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


def compile_variant(variant: Variant, out_dir: Path) -> Path:
    import cutlass.cute as cute

    _load_dsl_runtime()
    template = importlib.import_module(f"generator.kernels.{variant.template}")
    kernel = template.make_kernel(variant)
    compiled = cute.compile(kernel, *fake_args(variant), options=f"--gpu-arch {variant.arch}")
    out_dir.mkdir(parents=True, exist_ok=True)
    compiled.export_to_c(
        file_path=str(out_dir), file_name=variant.name, function_prefix=c_prefix(variant)
    )
    header = out_dir / f"{variant.name}.h"
    check_header_matches_abi(variant, header.read_text())
    return header


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    start = time.time()
    compile_variant(by_name(args.variant), args.out)
    print(f"compiled {args.variant} in {time.time() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
