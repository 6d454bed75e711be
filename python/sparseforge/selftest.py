"""First-use self-checks of kernels built for archs our GPU suite has never run.

Every variant of an arch in RUN_ON has run our whole GPU test suite (the H200 for sm_90a).
The others (sm_100f and sm_120f today) are compiled and inspected but were never run.
Before such a variant's first launch in a process, families.choose runs its case of
`python -m sparseforge.check` (small problems against the PyTorch reference, check.py) on
the current GPU, once, when that GPU is of the variant's arch. A variant that fails is not
chosen again in the process: choose takes the next variant that fits (a native kernel gives
way to the portable one) with a warning, and raises errors.VariantSelfCheckError when none
is left. Families without checks of their own run inside the checks of the kernels that
use them (check.CHECKED_FAMILIES says where).

Not checked: inside CUDA-graph capture or torch.compile tracing (a check launches and
synchronises: run once eagerly first, as a warm-up does) and with SPARSEFORGE_SELFTEST=0.
`python -m sparseforge info --selftest` runs every check of this GPU's variants.
"""

from __future__ import annotations

import os
import warnings

import torch

from sparseforge import _library, families
from sparseforge.arch import arch_for_device

RUN_ON = frozenset({"sm_90a"})  # archs whose variants our GPU suite runs (the H200)

# variant name -> None (passed) or what failed; a process's results.
_results: dict[str, str | None] = {}
_checking: set[str] = set()  # variants whose check is running (their own launches pass)


def self_check(kernel: _library.Kernel, arch: str) -> str | None:
    """What keeps `kernel` (of `arch`) from running: None when its arch is in RUN_ON or its
    self-check passed (run now if it has not run in this process and can), else what the
    check found (families.choose's self_check)."""
    if arch in RUN_ON or kernel.name in _checking or not _may_check(arch):
        return None
    if kernel.name not in _results:
        _results[kernel.name] = _run_check(kernel)
        if _results[kernel.name] is not None:
            warnings.warn(
                f"{kernel.name} failed its first-use self-check on this GPU "
                f"({_results[kernel.name]}); it will not be chosen in this process",
                RuntimeWarning,
                stacklevel=4,
            )
    return _results[kernel.name]


families.self_check = self_check


def _may_check(arch: str) -> bool:
    """Whether a check of an `arch` variant can run now: on a GPU of that arch (a choice for
    another arch launches nothing here), outside capture and tracing, not switched off."""
    if os.environ.get("SPARSEFORGE_SELFTEST") == "0" or not torch.cuda.is_available():
        return False
    if arch_for_device(torch.cuda.current_device()) != arch:
        return False
    return not (torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing())


def _run_check(kernel: _library.Kernel) -> str | None:
    """None if every case of the kernel's check passes on the current GPU, else what failed
    (a case, or the exception a launch raised)."""
    from sparseforge import check

    if kernel.family not in check.CHECKED_FAMILIES:
        return None
    entry = next(v for v in _library.manifest()["variants"] if v["name"] == kernel.name)
    forced = os.environ.get("SPARSEFORGE_VARIANT")  # the checks force their variant
    _checking.add(kernel.name)
    try:
        failed = [what for what, ok in check.check_variant(entry, small=True) if not ok]
    except Exception as exc:  # a launch error is a failed check, not the caller's error
        failed = [f"{type(exc).__name__}: {exc}"]
    finally:
        _checking.discard(kernel.name)
        if forced is None:
            os.environ.pop("SPARSEFORGE_VARIANT", None)
        else:
            os.environ["SPARSEFORGE_VARIANT"] = forced
    return "; ".join(failed) if failed else None
