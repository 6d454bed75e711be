"""The generator: catalog as data, deterministic exports, header/ABI agreement, registry."""

import json

import pytest

from generator import catalog, registry
from generator.catalog import ALL_ARCHS


def test_catalog_names_unique_and_stable():
    variants = catalog.catalog()
    names = [v.name for v in variants]
    assert len(names) == len(set(names))
    assert names == [v.name for v in catalog.catalog()]
    for v in variants:
        assert catalog.by_name(v.name) == v
        assert v.name.split("__")[1] == v.template and v.name.endswith(v.arch)


def test_every_family_covers_every_arch():
    variants = catalog.catalog()
    for family in catalog.FAMILY_ABI:
        archs = {v.arch for v in variants if v.family == family}
        assert archs == set(ALL_ARCHS), family


def test_catalog_arch_selection():
    only = catalog.catalog(["sm_120a"])
    assert only and {v.arch for v in only} == {"sm_120a"}
    with pytest.raises(ValueError, match="unknown arch"):
        catalog.catalog(["sm_80"])


def test_registry_and_manifest_deterministic():
    variants = catalog.catalog()
    assert registry.registry_c(variants) == registry.registry_c(catalog.catalog())
    m = registry.manifest(variants, ALL_ARCHS)
    assert json.dumps(m) == json.dumps(registry.manifest(catalog.catalog(), ALL_ARCHS))
    assert [v["entry"] for v in m["variants"]] == list(range(len(variants)))


def test_registry_launcher_unpacks_every_abi_word():
    v = catalog.catalog(["sm_90a"])[0]
    code = registry.registry_c([v])
    words = sum(
        1 + len(a.dynamic_shape_modes) + len(a.dynamic_stride_modes) if isinstance(a, catalog.TensorArg) else 1
        for a in v.abi
    )
    assert f"w[{words - 1}]" in code and f"w[{words}]" not in code
    assert f'{{"{v.name}",' in code


def test_header_abi_check_detects_mismatch():
    from generator import aot

    v = catalog.catalog(["sm_90a"])[0]
    prefix = aot.c_prefix(v)
    header = f"typedef struct {{\n    void *data;\n    int32_t dynamic_shapes[1];\n}} {prefix}_Tensor_mQ_t;\n"
    with pytest.raises(RuntimeError, match="exported tensor 'mQ'"):
        aot.check_header_matches_abi(v, header)


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_export_is_deterministic(tmp_path, arch):
    pytest.importorskip("cutlass")
    from generator import aot

    v = next(v for v in catalog.catalog([arch]) if v.template == "warp_mma")
    aot.compile_variant(v, tmp_path / "a")
    aot.compile_variant(v, tmp_path / "b")
    for suffix in (".h", ".o"):
        a = (tmp_path / "a" / f"{v.name}{suffix}").read_bytes()
        b = (tmp_path / "b" / f"{v.name}{suffix}").read_bytes()
        assert a == b, suffix
