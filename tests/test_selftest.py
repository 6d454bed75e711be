"""First-use self-checks (sparseforge.selftest) through families.choose, on the CPU: the check
itself and the GPU are stood in for; which variants get checked, once, and what a failure
does (the next variant that fits, a warning; an error when none is left)."""

import warnings

import pytest
import torch
from sparseforge import check, families, selftest
from sparseforge.errors import VariantNotBuiltError, VariantSelfCheckError


@pytest.fixture
def unrun_h200(monkeypatch):
    """sm_90a treated as an arch our GPU suite has not run, on a stand-in GPU of that arch;
    returns the list of variants checked, and a set of variant names whose checks fail."""
    checked, failing = [], set()

    def fake_check(kernel):
        checked.append(kernel.name)
        return "stand-in failure" if kernel.name in failing else None

    monkeypatch.setattr(selftest, "RUN_ON", frozenset())
    monkeypatch.setattr(selftest, "_results", {})
    monkeypatch.setattr(selftest, "_run_check", fake_check)
    monkeypatch.setattr(selftest, "_may_check", lambda arch: arch == "sm_90a")
    monkeypatch.delenv("SPARSEFORGE_VARIANT", raising=False)
    return checked, failing


def choose_bf16(**kw):
    return families.choose("block_sparse_fwd", "sm_90a", dtype="bf16", head_dim=128, **kw)


def test_archs_the_suite_runs_are_not_checked(monkeypatch):
    def no_check(kernel):
        raise AssertionError(f"{kernel.name} checked")

    monkeypatch.setattr(selftest, "_run_check", no_check)
    monkeypatch.setattr(selftest, "_may_check", lambda arch: True)
    assert "sm_90a" in selftest.RUN_ON
    assert choose_bf16().name == "block_sparse_fwd__sm90_wgmma__bf16_d128_w4__sm_90a"


def test_a_variant_is_checked_once_before_its_first_use(unrun_h200):
    checked, _ = unrun_h200
    first = choose_bf16()
    assert choose_bf16() == first
    assert checked == [first.name]


def test_a_failed_variant_gives_way_to_the_next_that_fits(unrun_h200):
    checked, failing = unrun_h200
    failing.update(k.name for k in families._library.kernels("block_sparse_fwd", "sm_90a"))
    failing.discard("block_sparse_fwd__warp_mma__bf16_d128__sm_90a")
    with pytest.warns(RuntimeWarning, match="failed its first-use self-check on this GPU"):
        kernel = choose_bf16()
    assert kernel.name == "block_sparse_fwd__warp_mma__bf16_d128__sm_90a"
    # The wgmma variants (4, 2 and 1 units a CTA), then the TMA mma.sync ones (2 and 1) were
    # tried first, each checked once.
    assert checked[-1] == kernel.name and len(checked) == 6
    assert [name.split("__")[1] for name in checked[:-1]] == ["sm90_wgmma"] * 3 + [
        "tma_warp_mma"
    ] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_bf16() == kernel
    assert len(checked) == 6


def test_when_every_variant_fails_the_error_names_them(unrun_h200):
    _, failing = unrun_h200
    failing.update(k.name for k in families._library.kernels("block_sparse_fwd", "sm_90a"))
    with pytest.warns(RuntimeWarning), pytest.raises(VariantSelfCheckError) as info:
        choose_bf16()
    text = str(info.value)
    assert "block_sparse_fwd__warp_mma__bf16_d128__sm_90a: stand-in failure" in text
    assert "SPARSEFORGE_SELFTEST=0" in text
    assert isinstance(info.value, VariantNotBuiltError)


def test_a_forced_variant_that_fails_raises(unrun_h200, monkeypatch):
    _, failing = unrun_h200
    name = "block_sparse_fwd__warp_mma__bf16_d128__sm_90a"
    failing.add(name)
    monkeypatch.setenv("SPARSEFORGE_VARIANT", name)
    with pytest.warns(RuntimeWarning), pytest.raises(VariantSelfCheckError, match=name):
        choose_bf16()


def test_a_choice_for_another_arch_checks_nothing(unrun_h200):
    checked, _ = unrun_h200
    families.choose("block_sparse_fwd", "sm_120f", dtype="bf16", head_dim=128)
    assert checked == []


def test_may_check_only_on_a_gpu_of_the_arch_outside_capture(monkeypatch):
    monkeypatch.delenv("SPARSEFORGE_SELFTEST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(selftest, "arch_for_device", lambda index: "sm_120f")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert selftest._may_check("sm_120f")
    assert not selftest._may_check("sm_100f")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not selftest._may_check("sm_120f")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not selftest._may_check("sm_120f")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setenv("SPARSEFORGE_SELFTEST", "0")
    assert not selftest._may_check("sm_120f")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("SPARSEFORGE_SELFTEST")
    assert not selftest._may_check("sm_120f")


def test_the_check_runs_the_variant_case_and_restores_the_environment(monkeypatch):
    kernel = families._library.kernels("msa_topk_select", "sm_120f")[0]
    seen = []

    def fake_cases(v, small):
        seen.append((v["name"], small, kernel.name in selftest._checking))
        monkeypatch.setenv("SPARSEFORGE_VARIANT", v["name"])  # as the attention checks do
        return [("case a", True), ("case b", False)]

    monkeypatch.setattr(check, "check_variant", fake_cases)
    monkeypatch.setenv("SPARSEFORGE_VARIANT", "users_choice")
    assert selftest._run_check(kernel) == "case b"
    assert seen == [(kernel.name, True, True)]
    assert kernel.name not in selftest._checking
    assert selftest.os.environ["SPARSEFORGE_VARIANT"] == "users_choice"

    def launch_error(v, small):
        raise RuntimeError("illegal instruction")

    monkeypatch.setattr(check, "check_variant", launch_error)
    monkeypatch.delenv("SPARSEFORGE_VARIANT")
    assert selftest._run_check(kernel) == "RuntimeError: illegal instruction"
    assert "SPARSEFORGE_VARIANT" not in selftest.os.environ
    combine = families._library.kernels("msa_attention_combine", "sm_120f")[0]
    assert selftest._run_check(combine) is None  # checked inside the MSA attention checks


def test_every_family_is_checked_or_named_as_not():
    """A new family needs a check (check.check_variant) or a line saying where it runs."""
    from sparseforge import _library

    without = set(_library.manifest()["families"]) - set(check.CHECKED_FAMILIES)
    assert without == {
        "tile_compact",
        "unit_order",
        "selection_mask",
        "msa_attention_combine",
        "sage_quantize_kv",
    }


@pytest.mark.parametrize("arch_name, told", [("sm_100f", True), ("sm_90a", False)])
def test_info_says_when_variants_check_themselves(monkeypatch, arch_name, told):
    from sparseforge import arch, info

    monkeypatch.setattr(arch, "device_capability", lambda index: (10, 0))
    monkeypatch.setattr(arch, "arch_for_device", lambda index: arch_name)
    monkeypatch.setattr(info, "device_name", lambda index: "stand-in")
    line = info.gpu_summary()
    assert line.startswith(f"GPU 0: stand-in, compute capability 10.0 -> runs {arch_name}")
    assert ("each variant checks itself before its first use" in line) == told
