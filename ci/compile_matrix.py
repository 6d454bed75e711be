"""The compile matrix, read off the built library itself.

    python ci/compile_matrix.py [path/to/libsparseforge_kernels.so]

cuobjdump does not see the cubins that export_to_c embeds, so the file is scanned for CUDA
ELF images (64-bit ELF, e_machine 190 = EM_CUDA, SM number in bits 8-15 of e_flags). Each
image is attributed to a template by its kernel class (manifest.json), whose name is in the
image's kernel symbol. Prints one row per template with the number of cubins per SM; exits 1
unless the cubins match the manifest and every family has code for each arch it requires
(manifest.json, from its spec in generator/families/), if an image was compiled for
another target than its SM's arch (the options ptxas records in it: sm_100a code runs only
on compute capability 10.0, the sm_100f the build names on 10.0 and 10.3), if ptxas
serialized the wgmma of a Hopper kernel, or if an image lacks the tensor-core instructions
its template declares (Template.mma: "wgmma" needs HGMMA / QGMMA, "mma.sync" HMMA / QMMA /
IMMA, "tcgen05" UTCHMMA / UTCQMMA) - a kernel built for an arch no machine here runs still
shows that it multiplies on the tensor cores.

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
ARCH_SM = {"sm_90a": 90, "sm_100f": 100, "sm_120f": 120}


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


def kernel_classes(manifest: dict) -> dict[bytes, str]:
    """{kernel class name: template} of the manifest's variants."""
    return {v["kernel_class"].encode(): v["template"] for v in manifest["variants"]}


def template_of(image: bytes, classes: dict[bytes, str]) -> str | None:
    found = {template for name, template in classes.items() if name in image}
    return found.pop() if len(found) == 1 else None


def matrix(library: Path, manifest: dict) -> Counter:
    """Counter of (template, SM) over the library's cubins; template None if unrecognised."""
    classes = kernel_classes(manifest)
    return Counter(
        (template_of(image, classes), sm) for sm, image in cuda_elf_images(library.read_bytes())
    )


def compile_target(image: bytes) -> str | None:
    """The target ptxas compiled an image for, as the image's recorded options say
    ("-arch sm_100f")."""
    found = re.search(rb"-arch (sm_[0-9]+[af]?)\b", image)
    return found.group(1).decode() if found else None


def wrong_targets(library: Path, manifest: dict) -> list[str]:
    """'target on sm_N' of the images not compiled for the build's arch of their SM: an
    arch-specific target (sm_100a) runs on exactly its compute capability (10.0), the
    family one the build names (sm_100f) on the family's (10.0 and 10.3)."""
    want = {ARCH_SM[arch]: arch for arch in manifest["archs"] if arch in ARCH_SM}
    return [
        f"{compile_target(image)} on sm_{sm}"
        for sm, image in cuda_elf_images(library.read_bytes())
        if compile_target(image) != want.get(sm)
    ]


def nvdisasm() -> str | None:
    """nvdisasm from PATH, the CUDA toolkit or the nvidia-cuda-nvdisasm wheel, if any."""
    candidates = [
        shutil.which("nvdisasm"),
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvdisasm"),
    ]
    try:
        import nvidia

        candidates += [os.path.join(p, "cu13", "bin", "nvdisasm") for p in nvidia.__path__]
    except ImportError:
        pass
    return next((c for c in candidates if c and os.path.exists(c)), None)


# SASS opcodes a template's declared tensor-core instructions compile to.
MMA_SASS = {
    "wgmma": re.compile(r"\b[HQ]GMMA\b"),
    "mma.sync": re.compile(r"\b[HQI]MMA\b"),
    "tcgen05": re.compile(r"\bUTC[HQ]MMA\b"),
}


def disassembled(library: Path, manifest: dict, tool: str):
    """(template, SM, SASS text) of every image of the library."""
    classes = kernel_classes(manifest)
    for sm, image in cuda_elf_images(library.read_bytes()):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(image)
            f.flush()
            sass = subprocess.run(
                [tool, "-c", f.name], capture_output=True, text=True, check=True
            ).stdout
        yield template_of(image, classes), sm, sass


def template_mma(manifest: dict) -> dict[str, str]:
    """{template: its tensor-core instructions} over the families (a template name means
    the same kind of kernel in every family that has it)."""
    kinds = {}
    for spec in manifest["families"].values():
        for template, kind in spec["mma"].items():
            assert kinds.setdefault(template, kind) == kind, f"{template}: {kind} and {kinds}"
    return kinds


def sass_findings(library: Path, manifest: dict, tool: str) -> tuple[list[str], list[str]]:
    """(templates of the sm_90 images whose every wgmma carries gsb0 - serialized by ptxas -,
    'template on sm_N' of the images without their template's tensor-core instructions)."""
    serialized, missing = [], []
    kinds = template_mma(manifest)
    for template, sm, sass in disassembled(library, manifest, tool):
        mmas = re.findall(r"[HQ]GMMA\.[^;]*;", sass)
        if sm == 90 and mmas and all("gsb0" in m for m in mmas):
            serialized.append(template or "unknown")
        kind = kinds.get(template)
        if kind is not None and not MMA_SASS[kind].search(sass):
            missing.append(f"{template} on sm_{sm}")
    return serialized, missing


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
    found = matrix(library, manifest)
    sms = sorted({sm for _, sm in found})
    print("template".ljust(14) + "".join(f"sm_{sm}".rjust(9) for sm in sms))
    for template in sorted({t for t, _ in found}, key=str):
        print(str(template).ljust(14) + "".join(str(found[(template, sm)]).rjust(9) for sm in sms))
    ok = found == expected(manifest)
    for family, spec in sorted(manifest["families"].items()):
        templates = {v["template"] for v in manifest["variants"] if v["family"] == family}
        have = {sm for (t, sm), n in found.items() if t in templates and n}
        required = [ARCH_SM[a] for a in spec["required_archs"] if a in manifest["archs"]]
        missing = [sm for sm in required if sm not in have]
        if missing:
            print(f"{family}: no code for {', '.join(f'sm_{m}' for m in missing)}")
            ok = False
    print("compile matrix OK" if ok else "compile matrix MISMATCH (see manifest.json)")
    wrong = wrong_targets(library, manifest)
    if wrong:
        print(f"{len(wrong)} images compiled for another target: {sorted(set(wrong))}")
        ok = False
    else:
        print(f"every image compiled for its arch ({', '.join(manifest['archs'])})")
    tool = nvdisasm()
    if not tool:
        print(
            "SASS NOT checked (wgmma pipelining, tensor-core instructions): no nvdisasm here "
            "(CUDA toolkit or pip nvidia-cuda-nvdisasm)"
        )
        return 0 if ok else 1
    serialized, missing = sass_findings(library, manifest, tool)
    if serialized:
        print(
            f"wgmma serialized by ptxas in {len(serialized)} sm_90 kernels: "
            f"{sorted(set(serialized))}"
        )
        ok = False
    else:
        print("sm_90 wgmma pipelined (no kernel serialized by ptxas)")
    if missing:
        print(f"tensor-core instructions missing in {len(missing)} images: {sorted(set(missing))}")
        ok = False
    else:
        print("every image of a tensor-core template has its MMA instructions")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
