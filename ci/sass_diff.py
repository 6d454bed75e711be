"""Compare the SASS of two builds' kernel objects, variant by variant.

    python -m ci.sass_diff OLD_GENERATED_DIR NEW_GENERATED_DIR [variant ...]

The directories hold the exporter's objects (build/<tag>/generated/<variant>.o). Each
object's cubin is disassembled with nvdisasm; constant-bank offsets (where the kernel's
parameters sit) and symbol names are normalised, since a change of a kernel's parameter
list moves them without changing the code. Prints one line per variant and exits 1 if any
differs: a refactor that claims "same kernels" shows it here before any GPU run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from ci.compile_matrix import cuda_elf_images, nvdisasm

CONSTANT = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")
SYMBOL = re.compile(r"`\([^)]*\)")
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?);")


def sass(obj: Path, tool: str) -> list[str]:
    """The normalised instructions of the object's one cubin."""
    (_, image), *rest = cuda_elf_images(obj.read_bytes())
    assert not rest, f"{obj}: more than one cubin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(image)
        f.flush()
        run = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True)
    found = INSTRUCTION.finditer(run.stdout)
    return [SYMBOL.sub("SYM", CONSTANT.sub("c[0x0][X]", m.group(1))) for m in found]


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    old, new = Path(args[0]), Path(args[1])
    both = {p.stem for p in old.glob("*.o")} & {p.stem for p in new.glob("*.o")}
    names = args[2:] or sorted(both)
    tool = nvdisasm()
    if tool is None:
        print("no nvdisasm (CUDA toolkit or pip nvidia-cuda-nvdisasm)", file=sys.stderr)
        return 2
    differ = 0
    for name in names:
        a, b = sass(old / f"{name}.o", tool), sass(new / f"{name}.o", tool)
        changed = sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))
        differ += changed > 0
        verdict = "identical" if not changed else f"{changed} instructions differ"
        print(f"{name}: {len(a)} -> {len(b)} instructions, {verdict}")
    print(f"{len(names)} variants, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
