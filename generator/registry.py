"""Emit the C registry (one uniform launcher per variant) and manifest.json.

    python -m generator.registry --archs "sm_90a;sm_100f" --out DIR
    python -m generator.registry --archs ... --list          # variant names, for CMake

Every launcher has the signature `int launch(const int64_t *words, cudaStream_t)`: the
runtime packs each argument of the family ABI into 64-bit words (generator/abi.py) and the
launcher unpacks them into the typed structs of the exported header.

manifest.json carries everything the runtime needs to choose, bind and launch: per family
its dtypes, templates per arch in preference order, required archs and constants; per
variant its parameters, constraints, ABI and kernel class (the compile matrix finds its
cubin by that name); and the source revision the build was made from (benchmarks name it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

from generator.abi import ScalarArg, TensorArg
from generator.aot import c_prefix
from generator.catalog import catalog, families
from generator.family import ALL_ARCHS, Variant

MANIFEST_SCHEMA = 2
ROOT = Path(__file__).resolve().parents[1]  # the source tree


def source_revision() -> str | None:
    """The commit of the tree being built (`git describe --always --dirty`: "-dirty" when it
    has uncommitted changes), or None outside a git checkout (a build from an sdist)."""
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            cwd=ROOT, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def abi_json(variant: Variant) -> list[dict]:
    dtype = variant.params.get("dtype")
    out = []
    for arg in variant.abi:
        if isinstance(arg, ScalarArg):
            out.append({"kind": "scalar", "name": arg.name, "dtype": arg.dtype})
        else:
            out.append(
                {
                    "kind": "tensor",
                    "name": arg.name,
                    "dtype": arg.element(dtype),
                    "shape": list(arg.shape),
                    "stride": list(arg.stride),
                    "narrow_strides": arg.narrow_strides,
                    "output": arg.output,
                    "align": arg.align_bytes(dtype),
                }
            )
    return out


def kernel_class(variant: Variant) -> str:
    """The class of the variant's kernel: its name is in the cubin's kernel symbol."""
    return type(importlib.import_module(variant.template.module).make_kernel(variant)).__name__


def manifest(variants: list[Variant], archs) -> dict:
    """Every family's spec (also of families with no variant in this build: a development
    build of a few variants still knows every family's constants) and the variants."""
    return {
        "schema": MANIFEST_SCHEMA,
        "archs": list(archs),
        "source": source_revision(),
        "families": {
            family.name: {
                "doc": family.doc,
                "dtypes": list(family.dtypes),
                "required_archs": list(family.required_archs),
                "templates": {arch: [t.name for t in family.templates_for(arch)] for arch in archs},
                "portable_templates": [t.name for t in family.templates if t.portable],
                "mma": {t.name: t.mma for t in family.templates if t.mma},
                "constants": dict(family.constants),
            }
            for family in families().values()
        },
        "variants": [
            {
                "name": v.name,
                "family": v.family.name,
                "template": v.template.name,
                "arch": v.arch,
                "params": v.params,
                "constraints": v.constraints,
                "kernel_class": kernel_class(v),
                "entry": index,
                "abi": abi_json(v),
            }
            for index, v in enumerate(variants)
        ],
    }


def _launcher(variant: Variant) -> str:
    p = c_prefix(variant)
    lines = [f'#include "{variant.name}.h"', f"static {p}_Kernel_Module_t {p}_module;"]
    lines.append(f"static int {p}_load(void) {{")
    lines.append(f"    return sf_load_library(_mlir_{p}_cuda_init, _mlir_{p}_cuda_load_to_device,")
    lines.append(f"                           &{p}_module.module);")
    lines.append("}")
    lines.append(f"static int {p}_launch(const int64_t *w, cudaStream_t stream) {{")
    call_args, word = [], 0
    for arg in variant.abi:
        if isinstance(arg, ScalarArg):
            ctype = "float" if arg.dtype == "f32" else "int32_t"
            lines.append(f"    {ctype} {arg.name} = sf_word_{arg.dtype}(w[{word}]);")
            call_args.append(arg.name)
            word += 1
            continue
        assert isinstance(arg, TensorArg)
        fields = [f".data = (void *)w[{word}]"]
        word += 1
        shapes = [f"(int32_t)w[{word + i}]" for i in range(len(arg.dynamic_shape_modes))]
        word += len(shapes)
        strides = [f"w[{word + i}]" for i in range(len(arg.dynamic_stride_modes))]
        word += len(strides)
        if shapes:
            fields.append(".dynamic_shapes = {" + ", ".join(shapes) + "}")
        if strides:
            fields.append(".dynamic_strides = {" + ", ".join(strides) + "}")
        lines.append(f"    {p}_Tensor_{arg.name}_t {arg.name} = {{{', '.join(fields)}}};")
        call_args.append("&" + arg.name)
    call = ", ".join([f"&{p}_module", *call_args, "stream"])
    lines.append(f"    return cute_dsl_{p}_wrapper({call});")
    lines.append("}")
    return "\n".join(lines)


def registry_c(variants: list[Variant]) -> str:
    parts = [
        "/* Generated by generator/registry.py: do not edit. */",
        '#include "sparseforge_registry.h"',
        "",
    ]
    parts += [_launcher(v) + "\n" for v in variants]
    parts.append("const sf_variant_entry sf_registry[] = {")
    for v in variants:
        p = c_prefix(v)
        parts.append(f'    {{"{v.name}", {p}_load, {p}_launch}},')
    if not variants:
        parts.append("    {0, 0, 0},")
    parts.append("};")
    parts.append(f"const int sf_registry_size = {len(variants)};")
    parts.append(f"atomic_int sf_registry_loaded[{max(len(variants), 1)}];")
    return "\n".join(parts) + "\n"


def select(archs, names=None) -> list[Variant]:
    """The variants of a build: every one for `archs`, or only those called `names`."""
    variants = catalog(archs)
    if names:
        unknown = set(names) - {v.name for v in variants}
        if unknown:
            raise SystemExit(f"no variant(s) {sorted(unknown)} for archs {list(archs)}")
        variants = [v for v in variants if v.name in names]
    return variants


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=";".join(ALL_ARCHS))
    parser.add_argument("--variants", default="", help="only these variants (names, ';' or ',')")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--list", action="store_true", help="print variant names and exit")
    args = parser.parse_args(argv)
    archs = [a for a in args.archs.replace(",", ";").split(";") if a]
    names = [n for n in args.variants.replace(",", ";").split(";") if n]
    variants = select(archs, names)
    if args.list:
        print(";".join(v.name for v in variants))
        return 0
    if args.out is None:
        parser.error("--out is required unless --list is given")
    (args.out / "params").mkdir(parents=True, exist_ok=True)
    for v in variants:
        # One stamp per variant: its object is rebuilt when its own row or ABI changes.
        stamp = json.dumps(abi_json(v)) + json.dumps(v.params) + json.dumps(v.constraints) + "\n"
        _write_if_changed(args.out / "params" / f"{v.name}.json", stamp)
    _write_if_changed(args.out / "registry.c", registry_c(variants))
    _write_if_changed(
        args.out / "manifest.json", json.dumps(manifest(variants, archs), indent=1) + "\n"
    )
    return 0


def _write_if_changed(path: Path, text: str) -> None:
    """Keep the timestamp of unchanged outputs so the build does not redo their dependents."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
