"""Compute capability -> arch, and the error texts a user sees."""

import pytest
from sparseforge import arch
from sparseforge.errors import NoGPUError, UnsupportedArchError


@pytest.mark.parametrize(
    "capability, expected",
    [
        ((9, 0), "sm_90a"),
        ((10, 0), "sm_100f"),
        ((10, 3), "sm_100f"),
        ((12, 0), "sm_120f"),
        ((12, 1), "sm_120f"),
    ],
)
def test_arch_for_capability(capability, expected):
    assert arch.arch_for_capability(*capability) == expected


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (11, 0), (9, 1)])
def test_unsupported_capability_error(capability):
    with pytest.raises(UnsupportedArchError) as info:
        arch.arch_for_capability(*capability)
    major, minor = capability
    text = str(info.value)
    assert f"compute capability {major}.{minor} (sm_{major}{minor}) is not supported" in text
    assert "Hopper (9.0)" in text and "12.1" in text


def test_arch_missing_from_build_error():
    with pytest.raises(UnsupportedArchError) as info:
        arch.require_arch_in_build("sm_100f", (10, 0), ["sm_90a"])
    text = str(info.value)
    assert "this build has sm_90a only; this GPU is sm_100 (compute capability 10.0)" in text
    assert "needs sm_100f" in text and "SPARSEFORGE_ARCHS=sm_100f pip install ." in text


def test_arch_in_build_passes():
    assert arch.require_arch_in_build("sm_90a", (9, 0), ["sm_90a", "sm_120f"]) == "sm_90a"


def test_no_driver_is_no_gpu(monkeypatch):
    def broken():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(arch, "_driver", broken)
    arch.device_capability.cache_clear()
    try:
        with pytest.raises(NoGPUError, match="no CUDA GPU: the CUDA driver is not available"):
            arch.device_capability(0)
    finally:
        arch.device_capability.cache_clear()


def test_driver_without_devices_is_no_gpu(monkeypatch):
    class FakeDriver:
        @staticmethod
        def cuInit(flags):
            return (0,)

        @staticmethod
        def cuDeviceGetCount():
            return (0, 0)

    monkeypatch.setattr(arch, "_driver", lambda: FakeDriver)
    arch.device_capability.cache_clear()
    try:
        with pytest.raises(NoGPUError, match="no CUDA GPU: the driver reports no devices"):
            arch.device_capability(0)
    finally:
        arch.device_capability.cache_clear()
