"""The installed build: manifest schema, and the compile matrix read off the library itself.

cuobjdump does not see the cubins that export_to_c embeds, so the library file is scanned
for CUDA ELF images (e_machine 190; SM number in bits 8-15 of e_flags).
"""

import pytest

from sparseforge import _library
from sparseforge.arch import ARCH_FOR_CAPABILITY

from ci import compile_matrix

EXPECTED_ARCHS = sorted(set(ARCH_FOR_CAPABILITY.values()))
ARCH_SM = compile_matrix.ARCH_SM


def test_manifest_schema():
    m = _library.manifest()
    assert m["schema"] == _library.MANIFEST_SCHEMA
    assert m["archs"] and set(m["archs"]) <= set(ARCH_SM)
    for index, v in enumerate(m["variants"]):
        assert set(v) == {"name", "family", "template", "arch", "params", "entry", "abi"}
        assert v["entry"] == index and v["arch"] in m["archs"]
        config = f"{v['params']['dtype']}_d{v['params']['head_dim']}"
        assert v["name"] == f"{v['family']}__{v['template']}__{config}__{v['arch']}"
        for arg in v["abi"]:
            assert arg["kind"] in ("tensor", "scalar")
            if arg["kind"] == "tensor":
                assert len(arg["shape"]) == len(arg["stride"])


def test_default_build_has_every_arch():
    assert sorted(_library.build_archs()) == EXPECTED_ARCHS


def test_library_holds_code_for_every_family_and_arch():
    m = _library.manifest()
    library = _library.PACKAGE_DIR / _library.LIBRARY_NAME
    images = compile_matrix.cuda_elf_images(library.read_bytes())
    assert len(images) == len(m["variants"]), "one cubin per variant"
    found = compile_matrix.matrix(library)
    assert found == compile_matrix.expected(m)
    for family in {v["family"] for v in m["variants"]}:
        templates = {v["template"] for v in m["variants"] if v["family"] == family}
        sms = {sm for (t, sm) in found if t in templates}
        assert sms == {90, 100, 120}, family


def test_compile_matrix_script_passes():
    assert compile_matrix.main([str(_library.PACKAGE_DIR / _library.LIBRARY_NAME)]) == 0


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
