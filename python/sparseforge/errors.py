"""Exceptions raised by sparseforge. Each message names the offending value and the fix."""


class SparseforgeError(RuntimeError):
    """Base class of sparseforge's run-time errors."""


class NotBuiltError(SparseforgeError):
    """The package has no (or a mismatched) kernel library: reinstall."""


class NoGPUError(SparseforgeError):
    """No usable CUDA GPU (no driver, no device)."""


class UnsupportedArchError(SparseforgeError):
    """The GPU's architecture is not one sparseforge targets, or not in this build."""


class VariantNotBuiltError(SparseforgeError):
    """The requested kernel configuration was not compiled into this build."""


class VariantSelfCheckError(VariantNotBuiltError):
    """Every variant that fits a call failed its first-use self-check on this GPU (an arch our
    GPU suite has not run: sparseforge.selftest)."""


class KernelLaunchError(SparseforgeError):
    """The CUDA runtime reported an error while loading or launching a kernel."""
