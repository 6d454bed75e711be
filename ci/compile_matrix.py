"""The compile matrix, read off the built library itself.

    python ci/compile_matrix.py [path/to/libsparseforge_kernels.so]

cuobjdump does not see the cubins that export_to_c embeds, so the file is scanned for CUDA
ELF images (64-bit ELF, e_machine 190 = EM_CUDA, SM number in bits 8-15 of e_flags). Each
image is attributed to a template by the kernel class name in its symbols. Prints one row per
template with the number of cubins per SM; exits 1 unless every family in the manifest has
code for sm_90, sm_100 and sm_120.
"""

from __future__ import annotations

import json
import struct
import sys
from collections import Counter
from pathlib import Path

EM_CUDA = 190
REQUIRED_SMS = (90, 100, 120)
# Kernel class of each template, as it appears in its cubin's symbol names.
TEMPLATE_KERNEL = {
    "warp_mma": b"BlockSparseFwdWarpMma",
    "warp_mma_fp8": b"SageFp8FwdWarpMma",
    "sm90_wgmma": b"BlockSparseFwdSm90",
    "sm90_sage_fp8": b"SageFp8FwdSm90",
    "sage_quantize": b"SageQuantize",
    "tile_compact": b"TileCompact",
}
ARCH_SM = {"sm_90a": 90, "sm_100a": 100, "sm_120a": 120}


def cuda_elf_images(data: bytes) -> list[tuple[int, bytes]]:
    """(SM number, image bytes) of every 64-bit CUDA ELF image embedded in `data`."""
    images = []
    pos = data.find(b"\x7fELF")
    while pos >= 0:
        if data[pos + 4] == 2 and struct.unpack_from("<H", data, pos + 18)[0] == EM_CUDA:
            flags = struct.unpack_from("<I", data, pos + 48)[0]
            (section_offset,) = struct.unpack_from("<Q", data, pos + 40)
            entry_size, count = struct.unpack_from("<HH", data, pos + 58)
            images.append(((flags >> 8) & 0xFF, data[pos : pos + section_offset + entry_size * count]))
        pos = data.find(b"\x7fELF", pos + 1)
    return images


def matrix(library: Path) -> Counter:
    """Counter of (template, SM) over the library's cubins; template None if unrecognised."""
    found = Counter()
    for sm, image in cuda_elf_images(library.read_bytes()):
        names = [t for t, symbol in TEMPLATE_KERNEL.items() if symbol in image]
        found[(names[0] if len(names) == 1 else None, sm)] += 1
    return found


def expected(manifest: dict) -> Counter:
    return Counter((v["template"], ARCH_SM[v["arch"]]) for v in manifest["variants"])


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args:
        library = Path(args[0])
    else:
        import sparseforge

        library = Path(sparseforge.__file__).parent / "libsparseforge_kernels.so"
    manifest = json.loads((library.parent / "manifest.json").read_text())
    found = matrix(library)
    sms = sorted({sm for _, sm in found})
    print("template".ljust(14) + "".join(f"sm_{sm}".rjust(9) for sm in sms))
    for template in sorted({t for t, _ in found}, key=str):
        print(str(template).ljust(14) + "".join(str(found[(template, sm)]).rjust(9) for sm in sms))
    ok = found == expected(manifest)
    families = {v["family"] for v in manifest["variants"]}
    for family in sorted(families):
        templates = {v["template"] for v in manifest["variants"] if v["family"] == family}
        have = {sm for (t, sm), n in found.items() if t in templates and n}
        missing = [sm for sm in REQUIRED_SMS if sm not in have]
        if missing:
            print(f"{family}: no code for {', '.join(f'sm_{m}' for m in missing)}")
            ok = False
    print("compile matrix OK" if ok else "compile matrix MISMATCH (see manifest.json)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
