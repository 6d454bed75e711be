"""The prebuilt kernel library: manifest, ctypes loading, variant lookup, argument packing.

Nothing here imports the CuTe DSL: the library was compiled ahead of time. The shared
library is loaded only when a kernel is first needed, so `import sparseforge` and
`python -m sparseforge info` work on machines with no GPU and no driver.
"""

from __future__ import annotations

import ctypes
import functools
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from sparseforge.errors import KernelLaunchError, NotBuiltError, VariantNotBuiltError

PACKAGE_DIR = Path(__file__).resolve().parent
LIBRARY_NAME = "libsparseforge_kernels.so"
ABI_VERSION = 1
MANIFEST_SCHEMA = 1


@functools.cache
def manifest() -> dict:
    path = PACKAGE_DIR / "manifest.json"
    if not path.exists():
        raise NotBuiltError(
            f"{path} is missing: this sparseforge was not built. Install it with "
            "`pip install .` (or a wheel) rather than importing the source tree."
        )
    data = json.loads(path.read_text())
    if data.get("schema") != MANIFEST_SCHEMA:
        raise NotBuiltError(f"{path} has schema {data.get('schema')}, expected {MANIFEST_SCHEMA}")
    return data


def build_archs() -> list[str]:
    return list(manifest()["archs"])


@functools.cache
def library() -> ctypes.CDLL:
    path = PACKAGE_DIR / LIBRARY_NAME
    if not path.exists():
        raise NotBuiltError(f"{path} is missing: reinstall sparseforge")
    lib = ctypes.CDLL(str(path))
    lib.sf_abi_version.restype = ctypes.c_int
    lib.sf_variant_count.restype = ctypes.c_int
    lib.sf_variant_name.restype = ctypes.c_char_p
    lib.sf_variant_name.argtypes = [ctypes.c_int]
    lib.sf_prepare.restype = ctypes.c_int
    lib.sf_prepare.argtypes = [ctypes.c_int]
    lib.sf_launch.restype = ctypes.c_int
    lib.sf_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.sf_error_name.restype = ctypes.c_char_p
    lib.sf_error_name.argtypes = [ctypes.c_int]
    lib.sf_error_string.restype = ctypes.c_char_p
    lib.sf_error_string.argtypes = [ctypes.c_int]
    if lib.sf_abi_version() != ABI_VERSION:
        raise NotBuiltError(f"{path} has C ABI {lib.sf_abi_version()}, expected {ABI_VERSION}")
    names = [lib.sf_variant_name(i).decode() for i in range(lib.sf_variant_count())]
    listed = [v["name"] for v in manifest()["variants"]]
    if names != listed:
        raise NotBuiltError(f"{path} does not match manifest.json: reinstall sparseforge")
    return lib


def _error_text(code: int) -> str:
    lib = library()
    return f"{lib.sf_error_name(code).decode()}: {lib.sf_error_string(code).decode()}"


@dataclass(frozen=True)
class Kernel:
    """One prebuilt variant: packs arguments per its ABI and launches."""

    name: str
    template: str
    entry: int
    params: dict
    abi: tuple

    def prepare(self) -> None:
        """Load the module (outside graph capture; launch() would otherwise do it)."""
        code = library().sf_prepare(self.entry)
        if code:
            raise KernelLaunchError(f"loading {self.name} failed: {_error_text(code)}")

    def pack(self, *args) -> ctypes.Array:
        """Argument words: per tensor its pointer, run-time extents, run-time strides."""
        words = []
        for spec, value in zip(self.abi, args, strict=True):
            if spec["kind"] == "scalar":
                if spec["dtype"] == "f32":
                    words.append(struct.unpack("<i", struct.pack("<f", value))[0])
                else:
                    words.append(int(value))
                continue
            words.append(value.data_ptr())
            shape, stride = value.shape, value.stride()
            words.extend(shape[i] for i, s in enumerate(spec["shape"]) if s is None)
            words.extend(stride[i] for i, s in enumerate(spec["stride"]) if s is None)
        return (ctypes.c_int64 * len(words))(*words)

    def launch(self, words: ctypes.Array, stream: int) -> None:
        code = library().sf_launch(self.entry, words, stream)
        if code:
            raise KernelLaunchError(f"launching {self.name} failed: {_error_text(code)}")


def find_kernel(family: str, arch: str, template: str | None = None, **params) -> Kernel:
    """The built variant of `family` for `arch` whose parameters match, or a clear error."""
    candidates = [
        v
        for v in manifest()["variants"]
        if v["family"] == family and v["arch"] == arch and template in (None, v["template"])
    ]
    for v in candidates:
        if all(v["params"].get(k) == want for k, want in params.items()):
            return Kernel(v["name"], v["template"], v["entry"], v["params"], tuple(v["abi"]))
    what = f"{family}" + (f" ({template})" if template else "")
    if not candidates:
        built = sorted({v["template"] for v in manifest()["variants"] if v["family"] == family and v["arch"] == arch})
        raise VariantNotBuiltError(
            f"{what} is not built for {arch}; templates built for it: {built or 'none'}"
        )
    for key, want in params.items():
        values = sorted({v["params"][key] for v in candidates}, key=lambda x: (str(type(x)), x))
        if want not in values:
            raise VariantNotBuiltError(
                f"{key} {want} is not built for {what} on {arch}; built {key}s: "
                + ", ".join(map(str, values))
            )
    raise VariantNotBuiltError(f"no built {what} variant on {arch} has {params}")
