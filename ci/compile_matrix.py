"""The compile matrix, read off the built library itself.

    python ci/compile_matrix.py [path/to/libsparseforge_kernels.so]

cuobjdump does not see the cubins that export_to_c embeds, so the file is scanned for CUDA
ELF images (64-bit ELF, e_machine 190 = EM_CUDA, SM number in bits 8-15 of e_flags). Each
image is attributed to a template by the kernel class name in its symbols. Prints one row per
template with the number of cubins per SM; exits 1 unless every family in the manifest has
code for sm_90, sm_100 and sm_120, or if ptxas serialized the wgmma of a Hopper kernel.

Serialized wgmma (ptxas advisory C7512, e.g. when a change needs more registers than the
CTAs-per-SM bound leaves) still computes the right answer but waits for every MMA before
issuing the next: in the SASS every HGMMA/QGMMA then carries the `gsb0` completion flag,
where a pipelined batch of k-steps carries it only on its last MMA.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
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
            images.append(((flags >> 8) & 0xFF, data[pos : pos + elf_size(data, pos)]))
        pos = data.find(b"\x7fELF", pos + 1)
    return images


def elf_size(data: bytes, pos: int) -> int:
    """Bytes of the 64-bit ELF at `pos`: the furthest of its headers and section contents."""
    phoff, shoff = struct.unpack_from("<QQ", data, pos + 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, pos + 54)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    for i in range(shnum):
        header = pos + shoff + i * shentsize
        kind = struct.unpack_from("<I", data, header + 4)[0]
        offset, size = struct.unpack_from("<QQ", data, header + 24)
        if kind != 8:  # SHT_NOBITS occupies no file bytes
            end = max(end, offset + size)
    return end


def matrix(library: Path) -> Counter:
    """Counter of (template, SM) over the library's cubins; template None if unrecognised."""
    found = Counter()
    for sm, image in cuda_elf_images(library.read_bytes()):
        names = [t for t, symbol in TEMPLATE_KERNEL.items() if symbol in image]
        found[(names[0] if len(names) == 1 else None, sm)] += 1
    return found


def nvdisasm() -> str | None:
    """nvdisasm from PATH, the CUDA toolkit or the nvidia-cuda-nvdisasm wheel, if any."""
    candidates = [shutil.which("nvdisasm"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvdisasm")]
    try:
        import nvidia

        candidates += [os.path.join(p, "cu13", "bin", "nvdisasm") for p in nvidia.__path__]
    except ImportError:
        pass
    return next((c for c in candidates if c and os.path.exists(c)), None)


def serialized_wgmma(library: Path, tool: str) -> list[str]:
    """Templates of the sm_90 images whose every wgmma carries gsb0 (serialized by ptxas)."""
    bad = []
    hopper = [TEMPLATE_KERNEL["sm90_wgmma"], TEMPLATE_KERNEL["sm90_sage_fp8"]]
    for sm, image in cuda_elf_images(library.read_bytes()):
        if sm != 90 or not any(symbol in image for symbol in hopper):
            continue
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(image)
            f.flush()
            sass = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
        mmas = re.findall(r"[HQ]GMMA\.[^;]*;", sass)
        if mmas and all("gsb0" in m for m in mmas):
            bad.append(next((t for t, symbol in TEMPLATE_KERNEL.items() if symbol in image), "unknown"))
    return bad


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
    tool = nvdisasm()
    serialized = serialized_wgmma(library, tool) if tool else []
    if not tool:
        print("sm_90 wgmma NOT checked: no nvdisasm here (CUDA toolkit or pip nvidia-cuda-nvdisasm)")
    elif serialized:
        print(f"wgmma serialized by ptxas in {len(serialized)} sm_90 kernels: {sorted(set(serialized))}")
        ok = False
    else:
        print("sm_90 wgmma pipelined (no kernel serialized by ptxas)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
