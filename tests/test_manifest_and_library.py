"""The installed build: manifest schema, and the compile matrix read off the library itself.

cuobjdump does not see the cubins that export_to_c embeds, so the library file is scanned
for CUDA ELF images (e_machine 190; SM number in bits 8-15 of e_flags).
"""

import struct
from collections import defaultdict

import pytest

from sparseforge import _library
from sparseforge.arch import ARCH_FOR_CAPABILITY

EXPECTED_ARCHS = sorted(set(ARCH_FOR_CAPABILITY.values()))
ARCH_SM = {"sm_90a": 90, "sm_100a": 100, "sm_120a": 120}
# Kernel class name of each template, as it appears in its cubin's symbols.
TEMPLATE_KERNEL = {"warp_mma": b"BlockSparseFwdWarpMma", "sm90_wgmma": b"BlockSparseFwdSm90"}


def cuda_elf_images(data: bytes):
    """(sm, image bytes) of every embedded 64-bit CUDA ELF image."""
    images = []
    pos = data.find(b"\x7fELF")
    while pos >= 0:
        if data[pos + 4] == 2 and struct.unpack_from("<H", data, pos + 18)[0] == 190:
            flags = struct.unpack_from("<I", data, pos + 48)[0]
            shoff, = struct.unpack_from("<Q", data, pos + 40)
            shentsize, shnum = struct.unpack_from("<HH", data, pos + 58)
            end = pos + shoff + shentsize * shnum
            images.append(((flags >> 8) & 0xFF, data[pos:end]))
        pos = data.find(b"\x7fELF", pos + 1)
    return images


def test_manifest_schema():
    m = _library.manifest()
    assert m["schema"] == _library.MANIFEST_SCHEMA
    assert m["archs"] and set(m["archs"]) <= set(ARCH_SM)
    for index, v in enumerate(m["variants"]):
        assert set(v) == {"name", "family", "template", "arch", "params", "entry", "abi"}
        assert v["entry"] == index and v["arch"] in m["archs"]
        assert v["name"] == f"{v['family']}__{v['template']}__{v['params']['dtype']}_d{v['params']['head_dim']}__{v['arch']}"
        for arg in v["abi"]:
            assert arg["kind"] in ("tensor", "scalar")
            if arg["kind"] == "tensor":
                assert len(arg["shape"]) == len(arg["stride"])


def test_default_build_has_every_arch():
    assert sorted(_library.build_archs()) == EXPECTED_ARCHS


def test_library_holds_code_for_every_family_and_arch():
    m = _library.manifest()
    data = (_library.PACKAGE_DIR / _library.LIBRARY_NAME).read_bytes()
    images = cuda_elf_images(data)
    assert len(images) == len(m["variants"]), "one cubin per variant"
    found = defaultdict(int)
    for sm, image in images:
        for template, symbol in TEMPLATE_KERNEL.items():
            if symbol in image:
                found[(template, sm)] += 1
    expected = defaultdict(int)
    for v in m["variants"]:
        expected[(v["template"], ARCH_SM[v["arch"]])] += 1
    assert dict(found) == dict(expected)
    families = {v["family"] for v in m["variants"]}
    for family in families:
        sms = {ARCH_SM[v["arch"]] for v in m["variants"] if v["family"] == family}
        assert sms == {90, 100, 120}, family


def test_library_exports_only_the_c_api():
    import subprocess

    path = _library.PACKAGE_DIR / _library.LIBRARY_NAME
    try:
        out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("nm not available")
    names = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert names == sorted(
        ["sf_abi_version", "sf_variant_count", "sf_variant_name", "sf_prepare", "sf_launch", "sf_error_name", "sf_error_string"]
    )


def test_library_needs_only_libc():
    import subprocess

    path = _library.PACKAGE_DIR / _library.LIBRARY_NAME
    try:
        out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("readelf not available")
    needed = [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
    assert not [n for n in needed if "cuda" in n or "cutlass" in n or "torch" in n], needed


def test_library_loads_and_matches_manifest():
    lib = _library.library()  # checks ABI version and variant names against the manifest
    assert lib.sf_variant_count() == len(_library.manifest()["variants"])


def test_variant_not_built_error():
    from sparseforge.errors import VariantNotBuiltError

    with pytest.raises(VariantNotBuiltError, match="head_dim 96 is not built for block_sparse_fwd on sm_90a; built head_dims: 64, 128"):
        _library.find_kernel("block_sparse_fwd", "sm_90a", dtype="bf16", head_dim=96)
    with pytest.raises(VariantNotBuiltError, match="not built for sm_90a"):
        _library.find_kernel("block_sparse_fwd", "sm_90a", template="no_such_template", dtype="bf16", head_dim=128)
