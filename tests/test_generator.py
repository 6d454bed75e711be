"""The generator: family specs as data, deterministic exports, header/ABI agreement, the
registry, and each variant's build dependencies."""

import json
from pathlib import Path

import pytest

from generator import aot, catalog, registry
from generator.abi import TensorArg, words
from generator.family import ALL_ARCHS


def test_catalog_names_unique_and_stable():
    variants = catalog.catalog()
    names = [v.name for v in variants]
    assert len(names) == len(set(names))
    assert names == [v.name for v in catalog.catalog()]
    for v in variants:
        assert catalog.by_name(v.name) == v
        assert v.name.split("__")[1] == v.template.name and v.name.endswith(v.arch)


def test_every_family_covers_the_archs_it_requires():
    variants = catalog.catalog()
    for family in catalog.families().values():
        archs = {v.arch for v in variants if v.family is family}
        assert set(family.required_archs) <= archs, family.name
        assert all(
            v.params.get("dtype") in (None, *family.dtypes) for v in variants if v.family is family
        )


def test_each_arch_prefers_its_native_template():
    family = catalog.families()["block_sparse_fwd"]
    assert [t.name for t in family.templates_for("sm_90a")] == [
        "sm90_wgmma",
        "tma_warp_mma",
        "warp_mma",
    ]
    assert [t.name for t in family.templates_for("sm_100f")] == [
        "sm100_tcgen05",
        "tma_warp_mma",
        "warp_mma",
    ]
    assert [t.name for t in family.templates_for("sm_120f")] == ["tma_warp_mma", "warp_mma"]
    sage = catalog.families()["sage_fp8_fwd"]
    assert [t.name for t in sage.templates_for("sm_100f")] == [
        "sm100_tcgen05_fp8",
        "tma_warp_mma_fp8",
        "warp_mma_fp8",
    ]
    logits = catalog.families()["block_sparse_fwd_logits"]
    assert [t.name for t in logits.templates_for("sm_120f")] == ["warp_mma"]


def test_catalog_arch_selection():
    only = catalog.catalog(["sm_120f"])
    assert only and {v.arch for v in only} == {"sm_120f"}
    with pytest.raises(ValueError, match="unknown arch"):
        catalog.catalog(["sm_80"])


def test_registry_and_manifest_deterministic():
    variants = catalog.catalog()
    assert registry.registry_c(variants) == registry.registry_c(catalog.catalog())
    m = registry.manifest(variants, ALL_ARCHS)
    assert json.dumps(m) == json.dumps(registry.manifest(catalog.catalog(), ALL_ARCHS))
    assert [v["entry"] for v in m["variants"]] == list(range(len(variants)))


def test_manifest_carries_each_family_spec():
    m = registry.manifest(catalog.catalog(), ALL_ARCHS)
    sage = m["families"]["sage_fp8_fwd"]
    assert sage["templates"]["sm_90a"] == ["sm90_sage_fp8", "tma_warp_mma_fp8", "warp_mma_fp8"]
    assert sage["constants"] == {"unit_rows": 64, "tile_keys": 64, "keys_per_scale": 16}
    v = next(
        v for v in m["variants"] if v["name"] == "sage_fp8_fwd__sm90_sage_fp8__e4m3_d128__sm_90a"
    )
    assert v["constraints"] == {"units_per_cta": 1, "layouts": {"mK": "heads_in_whole_tiles"}}
    assert v["kernel_class"] == "SageFp8FwdSm90"
    assert [a["name"] for a in v["abi"] if a.get("output")] == ["mO", "mLSE"]


def test_variant_filter_for_development_builds():
    names = [
        "tile_compact__tile_compact__any__sm_90a",
        "block_sparse_fwd__warp_mma__bf16_d64__sm_90a",
    ]
    assert sorted(v.name for v in registry.select(["sm_90a"], names)) == sorted(names)
    with pytest.raises(SystemExit, match="no variant"):
        registry.select(["sm_90a"], ["no_such_variant"])


def test_registry_launcher_unpacks_every_abi_word():
    v = catalog.catalog(["sm_90a"])[0]
    code = registry.registry_c([v])
    n = words(v.abi)
    assert f"w[{n - 1}]" in code and f"w[{n}]" not in code
    assert f'{{"{v.name}",' in code


def test_header_abi_check_detects_mismatch():
    v = catalog.catalog(["sm_90a"])[0]
    prefix = aot.c_prefix(v)
    header = (
        f"typedef struct {{\n    void *data;\n    int32_t dynamic_shapes[1];\n}} "
        f"{prefix}_Tensor_mQ_t;\n"
    )
    with pytest.raises(RuntimeError, match="exported tensor 'mQ'"):
        aot.check_header_matches_abi(v, header)


def test_dependencies_follow_the_template_import_closure():
    """A variant's object depends on its template's modules, not on other templates'."""

    def deps(name):
        return {
            str(p.relative_to(aot.GENERATOR_ROOT)) for p in aot.dependencies(catalog.by_name(name))
        }

    sage_sm90 = deps("sage_fp8_fwd__sm90_sage_fp8__e4m3_d128__sm_90a")
    assert {
        "kernels/sm90/sage_fp8_fwd.py",
        "kernels/sm90/block_sparse_fwd.py",
        "kernels/common/sage_math.py",
        "families/sage_quantize.py",
        "aot.py",
    } <= sage_sm90
    assert "kernels/portable/block_sparse_fwd.py" not in sage_sm90
    compact = deps("tile_compact__tile_compact__any__sm_120f")
    assert "kernels/portable/tile_compact.py" in compact
    assert not {p for p in compact if "sm90" in p or "softmax" in p}


def test_abi_words_and_alignment():
    arg = TensorArg("mQ", "input", shape=(None, None, 128), stride=(None, None, 1), divisibility=8)
    assert arg.words == 5 and arg.align_bytes("bf16") == 16
    assert TensorArg("mLSE", "f32", (None,), (1,)).align_bytes(None) == 4


def test_depfile_names_the_object_as_ninja_does(tmp_path):
    """Relative to the build root (ninja's name for the output, with the depfiles read in
    place: CMP0116 OLD), listing the exporter and the template among its inputs."""
    pytest.importorskip("cutlass")
    v = catalog.by_name("tile_compact__tile_compact__any__sm_90a")
    aot.compile_variant(v, tmp_path / "build" / "generated", tmp_path / "build")
    target, inputs = (tmp_path / "build" / "generated" / f"{v.name}.d").read_text().split(": ")
    assert target == f"generated/{v.name}.o"
    assert str(Path(aot.__file__).resolve()) in inputs.split()
    assert any(p.endswith("kernels/portable/tile_compact.py") for p in inputs.split())


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_export_is_deterministic(tmp_path, arch):
    pytest.importorskip("cutlass")
    v = next(v for v in catalog.catalog([arch]) if v.template.name == "warp_mma")
    aot.compile_variant(v, tmp_path / "a")
    aot.compile_variant(v, tmp_path / "b")
    for suffix in (".h", ".o"):
        a = (tmp_path / "a" / f"{v.name}{suffix}").read_bytes()
        b = (tmp_path / "b" / f"{v.name}{suffix}").read_bytes()
        assert a == b, suffix


def test_the_build_needs_the_cuda_13_dsl_libraries(monkeypatch):
    """With only the CUDA 12 DSL libraries the kernels come out for "sm_13": configure says
    so. Beside the CUDA 13 ones (as in pip's build isolation) they do no harm."""
    from generator import toolchain

    if toolchain.installed("nvidia-cutlass-dsl"):
        assert toolchain.dsl_libs_problem() is None  # this environment's
    both = {
        toolchain.DSL_LIBS: toolchain.PINNED_DSL_VERSION,
        "nvidia-cutlass-dsl-libs-cu12": "4.8.1",
    }
    monkeypatch.setattr(toolchain, "installed", both.get)
    assert toolchain.dsl_libs_problem() is None
    monkeypatch.setattr(toolchain, "installed", {"nvidia-cutlass-dsl-libs-cu12": "4.8.1"}.get)
    problem = toolchain.dsl_libs_problem()
    assert f"pip install {toolchain.DSL_LIBS}==" in problem
    assert "delete the build directory" in problem
