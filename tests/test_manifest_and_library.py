"""The installed build: manifest schema, and the compile matrix read off the library itself.

cuobjdump does not see the cubins that export_to_c embeds, so the library file is scanned
for CUDA ELF images (e_machine 190; SM number in bits 8-15 of e_flags).
"""

import json

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
    # The commit the build was made from (git describe; None outside a git checkout).
    assert m["source"] is None or (isinstance(m["source"], str) and m["source"].strip())
    for name, family in m["families"].items():
        assert set(family) == {
            "doc",
            "dtypes",
            "required_archs",
            "templates",
            "portable_templates",
            "mma",
            "constants",
        }
        assert set(family["mma"].values()) <= {"wgmma", "mma.sync", "tcgen05"}, name
        assert set(family["templates"]) == set(m["archs"]), name
    for index, v in enumerate(m["variants"]):
        assert set(v) == {
            "name",
            "family",
            "template",
            "arch",
            "params",
            "constraints",
            "kernel_class",
            "entry",
            "abi",
        }
        assert v["entry"] == index and v["arch"] in m["archs"]
        assert v["template"] in m["families"][v["family"]]["templates"][v["arch"]]
        p = v["params"]
        config = f"{p['dtype']}_d{p['head_dim']}" if p.get("dtype") else "any"
        config += f"_w{p['warpgroups']}" if p.get("warpgroups", 1) > 1 else ""
        config += f"_{p['key_layout']}" if p.get("key_layout") else ""
        config += f"_r{p['shard_rows']}" if p.get("shard_rows") else ""
        config += f"_acc_{p['accumulate']}" if p.get("accumulate", "fp32") != "fp32" else ""
        config += f"_{p['logits']}" if p.get("logits") else ""
        assert v["name"] == f"{v['family']}__{v['template']}__{config}__{v['arch']}"
        for arg in v["abi"]:
            assert arg["kind"] in ("tensor", "scalar")
            if arg["kind"] == "tensor":
                assert len(arg["shape"]) == len(arg["stride"])
                assert isinstance(arg["narrow_strides"], bool)


def test_narrow_stride_tensors_past_2_31_elements_raise():
    """Plan tensors the kernels index with 32-bit offsets (narrow_strides) are checked when
    bound; one element short of 2^31 binds."""
    import torch

    spec = {
        "name": "mTileIdx",
        "shape": [None, None, None],
        "stride": [None, None, 1],
        "narrow_strides": True,
    }
    fits = torch.empty_strided((2, 1, 2), (2**31 - 2, 1, 1), device="meta", dtype=torch.int32)
    too_far = torch.empty_strided((2, 1, 2), (2**31 - 1, 1, 1), device="meta", dtype=torch.int32)
    with pytest.raises(ValueError, match="2\\^31"):
        _library._tensor_words(spec, too_far)
    assert _library._tensor_words(spec, fits) == [0, 2, 1, 2, 2**31 - 2, 1]  # meta: pointer 0
    assert any(
        a.get("narrow_strides")
        for v in _library.manifest()["variants"]
        for a in v["abi"]
        if a["kind"] == "tensor"
    )


def test_default_build_has_every_arch():
    assert sorted(_library.build_archs()) == EXPECTED_ARCHS


def test_library_holds_code_for_every_family_and_arch():
    m = _library.manifest()
    library = _library.PACKAGE_DIR / _library.LIBRARY_NAME
    images = compile_matrix.cuda_elf_images(library.read_bytes())
    assert len(images) == len(m["variants"]), "one cubin per variant"
    found = compile_matrix.matrix(library, m)
    assert found == compile_matrix.expected(m)
    for family, spec in m["families"].items():
        templates = {v["template"] for v in m["variants"] if v["family"] == family}
        sms = {sm for (t, sm) in found if t in templates}
        assert sms >= {ARCH_SM[a] for a in spec["required_archs"]}, family


def test_runtime_finds_every_constant_and_constraint_it_reads():
    """Each runtime family module's CONSTANTS / CONSTRAINTS are in the manifest, and every
    layout rule a template names is one the runtime knows."""
    from sparseforge import families

    m = _library.manifest()
    assert families.missing_requirements(m) == []
    broken = json.loads(json.dumps(m))
    del broken["families"]["sage_fp8_fwd"]["constants"]["keys_per_scale"]
    del next(v for v in broken["variants"] if v["family"] == "block_sparse_fwd")["constraints"][
        "units_per_cta"
    ]
    missing = families.missing_requirements(broken)
    assert "sage_fp8_fwd: constant keys_per_scale" in missing
    assert any(item.endswith("constraint units_per_cta") for item in missing)
    renamed = json.loads(json.dumps(m))
    next(v for v in renamed["variants"] if v["constraints"]["layouts"])["constraints"]["layouts"][
        "mK"
    ] = "new_rule"
    assert any("layout rule new_rule" in item for item in families.missing_requirements(renamed))


def test_every_image_is_compiled_for_its_arch():
    """sm_100f / sm_120f (family targets: 10.0 and 10.3, 12.0 and 12.1), not the
    arch-specific sm_100a / sm_120a, whose code a B300 or a DGX Spark cannot load."""
    m = _library.manifest()
    library = _library.PACKAGE_DIR / _library.LIBRARY_NAME
    assert compile_matrix.wrong_targets(library, m) == []
    images = compile_matrix.cuda_elf_images(library.read_bytes())
    assert {compile_matrix.compile_target(image) for _, image in images} == set(EXPECTED_ARCHS)
    renamed = dict(m, archs=[a.replace("sm_100f", "sm_100a") for a in m["archs"]])
    if "sm_100a" in renamed["archs"]:
        assert compile_matrix.wrong_targets(library, renamed)


def test_compile_matrix_script_passes():
    assert compile_matrix.main([str(_library.PACKAGE_DIR / _library.LIBRARY_NAME)]) == 0


def test_compile_matrix_finds_a_template_without_its_mma_instructions():
    """A CUDA-core template declared as a tensor-core one is caught on every arch."""
    tool = compile_matrix.nvdisasm()
    if tool is None:
        pytest.skip("no nvdisasm here")
    m = json.loads(json.dumps(_library.manifest()))
    m["families"]["tile_compact"]["mma"] = {"tile_compact": "mma.sync"}
    library = _library.PACKAGE_DIR / _library.LIBRARY_NAME
    _, missing = compile_matrix.sass_findings(library, m, tool)
    assert sorted(missing) == [f"tile_compact on sm_{ARCH_SM[a]}" for a in EXPECTED_ARCHS]


def test_library_exports_only_the_c_api():
    import subprocess

    path = _library.PACKAGE_DIR / _library.LIBRARY_NAME
    try:
        out = subprocess.run(
            ["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("nm not available")
    names = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert names == sorted(
        [
            "sf_abi_version",
            "sf_variant_count",
            "sf_variant_name",
            "sf_prepare",
            "sf_launch",
            "sf_error_name",
            "sf_error_string",
        ]
    )


def test_library_needs_only_libc():
    import subprocess

    path = _library.PACKAGE_DIR / _library.LIBRARY_NAME
    try:
        out = subprocess.run(
            ["readelf", "-d", str(path)], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("readelf not available")
    needed = [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
    assert not [n for n in needed if "cuda" in n or "cutlass" in n or "torch" in n], needed


def test_library_loads_and_matches_manifest():
    lib = _library.library()  # checks ABI version and variant names against the manifest
    assert lib.sf_variant_count() == len(_library.manifest()["variants"])


def test_variant_choice_and_not_built_errors(monkeypatch):
    from sparseforge import families
    from sparseforge.errors import VariantNotBuiltError

    with pytest.raises(
        VariantNotBuiltError,
        match="head_dim 96 is not built for block_sparse_fwd on sm_90a; built head_dims: 64, 128",
    ):
        families.choose("block_sparse_fwd", "sm_90a", dtype="bf16", head_dim=96)
    assert families.choose("block_sparse_fwd", "sm_90a", dtype="bf16", head_dim=128).name == (
        "block_sparse_fwd__sm90_wgmma__bf16_d128_w4__sm_90a"
    )
    one = families.choose(
        "block_sparse_fwd", "sm_90a", fits=lambda units: units == 1, dtype="bf16", head_dim=128
    )
    assert one.name == "block_sparse_fwd__sm90_wgmma__bf16_d128__sm_90a"
    portable = families.choose("sage_fp8_fwd", "sm_90a", portable=True, dtype="e4m3", head_dim=64)
    assert portable.template == "tma_warp_mma_fp8"
    assert (
        families.choose("sage_fp8_fwd", "sm_120f", dtype="e4m3", head_dim=64).template
        == "tma_warp_mma_fp8"
    )
    monkeypatch.setenv("SPARSEFORGE_VARIANT", "block_sparse_fwd__warp_mma__fp16_d64__sm_90a")
    assert (
        families.choose("block_sparse_fwd", "sm_90a", dtype="fp16", head_dim=64).template
        == "warp_mma"
    )
    with pytest.raises(VariantNotBuiltError, match="does not fit"):
        families.choose("block_sparse_fwd", "sm_90a", dtype="bf16", head_dim=64)
    # Other families' choices ignore it (plan() also picks the tile_compact kernel).
    assert families.choose("tile_compact", "sm_90a").family == "tile_compact"
    monkeypatch.setenv("SPARSEFORGE_VARIANT", "no_such_variant")
    with pytest.raises(VariantNotBuiltError, match="no variant of that name"):
        families.choose("tile_compact", "sm_90a")


def test_cached_launches_follow_the_forced_variant(monkeypatch):
    """A family module's bound launches are cached per SPARSEFORGE_VARIANT: forcing one
    variant after another in a process binds each (a plain cache kept the first one bound
    for the same arguments), and whether a kernel is built does not depend on it."""
    from sparseforge import families

    binds = []

    @families.launch_cache()
    def launch(device_index, flag):
        forced = families.forced_variant()
        binds.append(forced and forced.name)
        return len(binds)

    plain = "msa_sparse_attention_fp8kv__wgmma__bf16_d128_w2__sm_90a"
    other = "msa_sparse_attention_fp8kv__wgmma__bf16_d128_w4__sm_90a"
    monkeypatch.delenv("SPARSEFORGE_VARIANT", raising=False)
    assert launch(0, 1) == launch(0, 1) == 1
    monkeypatch.setenv("SPARSEFORGE_VARIANT", plain)
    assert launch(0, 1) == launch(0, 1) == 2
    monkeypatch.setenv("SPARSEFORGE_VARIANT", other)
    assert launch(0, 1) == launch(0, flag=1) - 1 == 3
    monkeypatch.delenv("SPARSEFORGE_VARIANT")
    assert launch(0, 1) == 1
    assert binds == [None, plain, other, other]
    launch.cache_clear()
    assert launch(0, 1) == 5
    # The one-token kernel forced: the wgmma tile is still built.
    monkeypatch.setenv(
        "SPARSEFORGE_VARIANT", "msa_sparse_attention_fp8kv__warp_mma_token__bf16_d128__sm_90a"
    )
    params = dict(dtype="bf16", head_dim=128, tile="wgmma")
    assert families.has_variant("msa_sparse_attention_fp8kv", "sm_90a", **params)
    assert not families.has_variant(
        "msa_sparse_attention_fp8kv", "sm_90a", **(params | {"tile": "no"})
    )


@pytest.mark.parametrize(
    "capability, native",
    [
        ((9, 0), ("sm90_wgmma", "sm90_sage_fp8")),
        ((10, 0), ("sm100_tcgen05", "sm100_tcgen05_fp8")),
        ((10, 3), ("sm100_tcgen05", "sm100_tcgen05_fp8")),
        ((12, 0), ("tma_warp_mma", "tma_warp_mma_fp8")),
        ((12, 1), ("tma_warp_mma", "tma_warp_mma_fp8")),
    ],
)
def test_each_gpu_gets_its_native_attention_kernels(monkeypatch, capability, native):
    """The device query mocked: the arch of each supported GPU and the kernels a plan takes
    there (the first-use self-check does not run: no such GPU here)."""
    from sparseforge import arch, families

    monkeypatch.setattr(arch, "device_capability", lambda index: capability)
    arch.arch_for_device.cache_clear()
    try:
        chosen = arch.arch_for_device(0)
    finally:
        arch.arch_for_device.cache_clear()
    assert chosen == ARCH_FOR_CAPABILITY[capability]
    for family, dtype, template in zip(
        ("block_sparse_fwd", "sage_fp8_fwd"), ("bf16", "e4m3"), native, strict=True
    ):
        kernel = families.choose(family, chosen, dtype=dtype, head_dim=128)
        assert kernel.template == template and kernel.name.endswith(f"__{chosen}")


def test_unknown_gpu_gets_the_unsupported_arch_error(monkeypatch):
    from sparseforge import arch
    from sparseforge.errors import UnsupportedArchError

    monkeypatch.setattr(arch, "device_capability", lambda index: (8, 9))
    arch.arch_for_device.cache_clear()
    try:
        with pytest.raises(UnsupportedArchError, match=r"compute capability 8.9 \(sm_89\)"):
            arch.arch_for_device(0)
    finally:
        arch.arch_for_device.cache_clear()


def test_bound_launch_packs_the_abi_words(monkeypatch):
    """The words handed to sf_launch, for NHD tensors and for HND ones passed with swap01."""
    import ctypes
    import struct

    import torch

    calls = []

    class FakeLibrary:
        def sf_launch(self, entry, words, stream):
            calls.append((entry, list(words)))
            return 0

    monkeypatch.setattr(_library, "library", lambda: FakeLibrary())
    monkeypatch.setattr(_library, "_current_stream", lambda index: 7)
    v = next(v for v in _library.manifest()["variants"] if v["params"].get("head_dim") == 128)
    assert [a["align"] for a in v["abi"][:5]] == [16, 16, 16, 16, 4]
    kernel = _library.Kernel.from_manifest(v)
    plan = [
        torch.zeros(3, dtype=torch.int32),
        torch.zeros(2, 3, 4, dtype=torch.int32)[..., :3],
        torch.zeros(2, 3, dtype=torch.int32),
        torch.zeros(5, dtype=torch.int32),
    ]
    with pytest.raises(ValueError, match="mTileCnt: shape"):
        kernel.bind(plan[0], plan[1], torch.zeros(2, 3, 4, dtype=torch.int32)[..., 0], plan[3], 0.5)
    bound = kernel.bind(*plan, 0.5)
    q = torch.zeros(4, 96, 128, dtype=torch.bfloat16)  # HND: 4 heads, 96 tokens
    lse = torch.zeros(4, 96)
    bound((q, q, q, q, lse), swap01=True)
    entry, words = calls[-1]
    assert entry == v["entry"]
    qw = [
        q.data_ptr(),
        96,
        4,
        128,
        96 * 128,
    ]  # (S, H, D) view: extents (96, 4), strides (128, 12288)
    assert words[:20] == qw * 4
    assert words[20:25] == [lse.data_ptr(), 96, 4, 1, 96]
    assert words[25:27] == [plan[0].data_ptr(), 3]
    assert words[27:33] == [plan[1].data_ptr(), 2, 3, 3, 12, 4]
    assert words[-1] == struct.unpack("<i", struct.pack("<f", 0.5))[0]
    assert isinstance(bound.words, ctypes.Array)
    with pytest.raises(ValueError, match="16-byte aligned"):
        shifted = torch.zeros(4 * 96 * 128 + 1, dtype=torch.bfloat16)[1:].view(4, 96, 128)
        bound((shifted, q, q, q, lse), swap01=True)

    # call_same_layout: the first call packs everything, later ones only the addresses.
    k = torch.zeros(4, 96, 128, dtype=torch.bfloat16)
    lse2 = torch.zeros(4, 96)
    bound.call_same_layout((q, q, q, q, lse), swap01=True)
    assert calls[-1][1] == words
    bound.call_same_layout((k, q, k, q, lse2), swap01=True)
    bound((k, q, k, q, lse2), swap01=True)
    assert calls[-2][1] == calls[-1][1] != words
    bound.call_same_layout((q, q, q, q, lse), swap01=False)  # another layout: packed whole
    bound((q, q, q, q, lse), swap01=False)
    assert calls[-2][1] == calls[-1][1]
    with pytest.raises(ValueError, match="16-byte aligned"):
        bound.call_same_layout((q, shifted, q, q, lse), swap01=False)

    # A call whose tensors have the last call's shapes and strides writes only the addresses;
    # another layout (or swap01) packs everything again.
    bound((q, q, q, q, lse), swap01=True)
    assert calls[-1][1] == words
    bound((k, q, k, q, lse2), swap01=True)
    assert calls[-1][1][:5] == [k.data_ptr(), *words[1:5]]
    assert calls[-1][1][20:] == [lse2.data_ptr(), *words[21:]]
    half = q[:, :48]  # (4, 48, 128) HND: 48 tokens, its head stride still 96 x 128
    bound((half, q, q, q, lse), swap01=True)
    assert calls[-1][1][:5] == [half.data_ptr(), 48, 4, 128, 96 * 128]
    bound((q, q, q, q, lse), swap01=True)
    assert calls[-1][1] == words
    with pytest.raises(ValueError, match="16-byte aligned"):
        bound((shifted, q, q, q, lse), swap01=True)  # the same layout: its address checked
