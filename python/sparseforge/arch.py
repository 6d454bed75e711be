"""Which compiled architecture serves which GPU.

The compute capability comes from the CUDA driver through cuda-bindings; torch is not asked,
so the answer does not depend on how torch was built.
"""

from __future__ import annotations

import functools

from sparseforge.errors import NoGPUError, UnsupportedArchError

# compute capability -> the arch whose code runs on it. Blackwell code is built for the family
# targets: sm_100f code loads on 10.0 and 10.3, sm_120f on 12.0 and 12.1, where the
# arch-specific sm_100a / sm_120a would load on 10.0 / 12.0 only. Hopper has one compute
# capability, and its wgmma needs the arch-specific sm_90a.
ARCH_FOR_CAPABILITY = {
    (9, 0): "sm_90a",
    (10, 0): "sm_100f",
    (10, 3): "sm_100f",
    (12, 0): "sm_120f",
    (12, 1): "sm_120f",
}

SUPPORTED_TEXT = (
    "Hopper (9.0), Blackwell B200/B300 (10.0, 10.3) and Blackwell RTX / DGX Spark (12.0, 12.1)"
)


def arch_for_capability(major: int, minor: int) -> str:
    try:
        return ARCH_FOR_CAPABILITY[(major, minor)]
    except KeyError:
        raise UnsupportedArchError(
            f"compute capability {major}.{minor} (sm_{major}{minor}) is not supported: "
            f"sparseforge has kernels for {SUPPORTED_TEXT}"
        ) from None


def require_arch_in_build(arch: str, capability: tuple[int, int], build_archs: list[str]) -> str:
    if arch not in build_archs:
        major, minor = capability
        raise UnsupportedArchError(
            f"this build has {', '.join(build_archs) or 'no archs'} only; this GPU is "
            f"sm_{major}{minor} (compute capability {major}.{minor}) and needs {arch}. Install "
            f"the fat wheel (all archs), the {arch} wheel, or build from source with "
            f"SPARSEFORGE_ARCHS={arch} pip install ."
        )
    return arch


def _driver():
    from cuda.bindings import driver

    return driver


def _check(result, what: str):
    err, *values = result
    if int(err) != 0:
        raise NoGPUError(f"no CUDA GPU: {what} failed ({err})")
    return values[0] if len(values) == 1 else values


@functools.cache
def device_capability(device_index: int) -> tuple[int, int]:
    """(major, minor) of a CUDA device, from the driver."""
    try:
        driver = _driver()
        _check(driver.cuInit(0), "cuInit")
        count = _check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
    except NoGPUError:
        raise
    except Exception as exc:  # no driver library, no cuda-bindings: the same to a user
        raise NoGPUError(f"no CUDA GPU: the CUDA driver is not available ({exc})") from None
    if count == 0:
        raise NoGPUError("no CUDA GPU: the driver reports no devices")
    if not 0 <= device_index < count:
        raise NoGPUError(f"no CUDA GPU with index {device_index}; the driver reports {count}")
    dev = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
    attr = driver.CUdevice_attribute
    major = _check(
        driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
        "cuDeviceGetAttribute",
    )
    minor = _check(
        driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
        "cuDeviceGetAttribute",
    )
    return int(major), int(minor)


@functools.cache
def arch_for_device(device_index: int) -> str:
    """The build's arch for this device, or NoGPUError / UnsupportedArchError."""
    from sparseforge._library import build_archs

    capability = device_capability(device_index)
    return require_arch_in_build(arch_for_capability(*capability), capability, build_archs())


def multiprocessors(device_index: int | None) -> int:
    """The SM count of a CUDA device (what launches size their grids by), from the driver;
    None (a torch.device("cuda") without an index): the current device."""
    if device_index is None:
        import torch

        device_index = torch.cuda.current_device()
    return _multiprocessors(device_index)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    device_capability(device_index)  # the device exists
    driver = _driver()
    dev = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    return int(_check(driver.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute"))
