"""The prebuilt kernel library: manifest, ctypes loading, argument packing and launch.

Nothing here imports the CuTe DSL: the library was compiled ahead of time. The shared
library is loaded only when a kernel is first needed, so `import sparseforge` and
`python -m sparseforge info` work on machines with no GPU and no driver.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import json
import os
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from sparseforge.errors import KernelLaunchError, NotBuiltError

# The kernel library and its manifest: installed beside this module, or (a development build
# of a few variants, CONTRIBUTING.md) in the directory SPARSEFORGE_LIBRARY_DIR names.
PACKAGE_DIR = Path(os.environ.get("SPARSEFORGE_LIBRARY_DIR") or Path(__file__).resolve().parent)
LIBRARY_NAME = "libsparseforge_kernels.so"
ABI_VERSION = 1
MANIFEST_SCHEMA = 2


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
    # sf_launch(int index, const int64_t *words, void *stream) is called without argtypes,
    # its arguments made C ones by the caller (BoundLaunch._launch): ctypes converting three
    # declared ones took 1.6 us a call against 0.9 on a 2-core host, on every launch.
    lib.sf_launch.restype = ctypes.c_int
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
    """One prebuilt variant (a manifest entry): packs arguments per its ABI and launches."""

    name: str
    family: str
    template: str
    entry: int
    params: dict
    constraints: dict
    abi: tuple

    @classmethod
    def from_manifest(cls, v: dict) -> Kernel:
        return cls(
            v["name"],
            v["family"],
            v["template"],
            v["entry"],
            v["params"],
            v["constraints"],
            tuple(v["abi"]),
        )

    @property
    def units_per_cta(self) -> int:
        """Units a CTA runs on one tile list (its warpgroups): consecutive entries of the
        plan's work list, which must share their tiles."""
        return self.constraints["units_per_cta"]

    def layout(self, argument: str) -> str | None:
        """The operand layout rule this template needs for `argument` beyond its ABI."""
        return self.constraints["layouts"].get(argument)

    def prepare(self) -> None:
        """Load the module (outside graph capture; launch() would otherwise do it)."""
        code = library().sf_prepare(self.entry)
        if code:
            raise KernelLaunchError(f"loading {self.name} failed: {_error_text(code)}")

    def bind(self, *static_args) -> BoundLaunch:
        """Fix the trailing arguments (plan tensors, scalars) once; see BoundLaunch."""
        return BoundLaunch(self, static_args)


@functools.cache
def kernels(family: str, arch: str) -> tuple[Kernel, ...]:
    """The built variants of `family` for `arch`, in manifest order (found once, like the
    manifest: plan() asks on every call)."""
    return tuple(
        Kernel.from_manifest(v)
        for v in manifest()["variants"]
        if v["family"] == family and v["arch"] == arch
    )


def _tensor_words(spec: dict, tensor) -> list[int]:
    """Pointer, run-time extents, run-time strides; compile-time ones must match the ABI."""
    shape, stride = tensor.shape, tensor.stride()
    for i, (want_extent, want_stride) in enumerate(zip(spec["shape"], spec["stride"], strict=True)):
        if (want_extent is not None and shape[i] != want_extent) or (
            want_stride is not None and stride[i] != want_stride
        ):
            raise ValueError(
                f"{spec['name']}: shape {tuple(shape)} / strides {stride} do not fit the kernel's "
                f"{spec['shape']} / {spec['stride']}"
            )
    span = sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n)
    if spec.get("narrow_strides") and span >= 2**31:
        raise ValueError(
            f"{spec['name']}: shape {tuple(shape)} / strides {stride} reach past 2^31 elements; "
            "the "
            "kernel indexes it with 32-bit offsets (a plan this large is not supported)"
        )
    return (
        [tensor.data_ptr()]
        + [shape[i] for i, s in enumerate(spec["shape"]) if s is None]
        + [stride[i] for i, s in enumerate(spec["stride"]) if s is None]
    )


def _scalar_word(spec: dict, value) -> int:
    if spec["dtype"] == "f32":
        return struct.unpack("<i", struct.pack("<f", value))[0]
    return int(value)


_layouts: dict[tuple[int, int], tuple] = {}


def _leading_layout(kernel: Kernel, num_dynamic: int) -> tuple:
    """(output positions, dynamic modes, words, packer, address words) of a kernel's first
    `num_dynamic` (leading) arguments, worked out once per variant (plan() binds on every
    call):
    - dynamic modes: per leading tensor, the modes whose extents and strides are run-time
      words, as read from the tensor itself ([False]) or from its (1, 0)-transposed view
      ([True]), with its name and alignment;
    - words: how many the leading tensors take, packed by one C call per run;
    - address words: the word index of each leading tensor's address (its shape and stride
      words follow)."""
    key = (kernel.entry, num_dynamic)
    if key not in _layouts:
        leading = kernel.abi[:num_dynamic]
        outputs = [i for i, spec in enumerate(leading) if spec.get("output")]
        swap = lambda modes: [{0: 1, 1: 0}.get(i, i) for i in modes]  # noqa: E731
        modes = {False: [], True: []}
        addresses, words = [], 0
        for spec in leading:
            shape = [i for i, s in enumerate(spec["shape"]) if s is None]
            stride = [i for i, s in enumerate(spec["stride"]) if s is None]
            modes[False].append((shape, stride, spec["name"], spec["align"]))
            modes[True].append((swap(shape), swap(stride), spec["name"], spec["align"]))
            addresses.append(words)
            words += 1 + len(shape) + len(stride)
        _layouts[key] = (outputs, modes, words, struct.Struct(f"<{words}q").pack_into, addresses)
    return _layouts[key]


_bound_launches: weakref.WeakValueDictionary[int, BoundLaunch] = weakref.WeakValueDictionary()
_launch_ids = itertools.count()


def bound_launch(launch_id: int) -> BoundLaunch | None:
    """The live BoundLaunch with this id (torch.compile's op finds its launch by id)."""
    return _bound_launches.get(launch_id)


class BoundLaunch:
    """A kernel with its trailing arguments packed at plan time.

    A call then packs only the leading tensors (q, k, v, out, lse for attention) into a
    preallocated word buffer and makes one C call: no allocation, no host synchronisation.
    """

    def __init__(self, kernel: Kernel, static_args: tuple):
        self.kernel = kernel
        self.launch_id = next(_launch_ids)
        _bound_launches[self.launch_id] = self
        self.num_dynamic = len(kernel.abi) - len(static_args)
        (
            self.output_positions,
            self.dynamic_modes,
            self.dynamic_len,
            self.pack_dynamic,
            self.address_words,
        ) = _leading_layout(kernel, self.num_dynamic)
        static_words = []
        for spec, value in zip(kernel.abi[self.num_dynamic :], static_args, strict=True):
            if spec["kind"] == "scalar":
                static_words.append(_scalar_word(spec, value))
            else:
                static_words.extend(_tensor_words(spec, value))
        self.words = (ctypes.c_int64 * (self.dynamic_len + len(static_words)))()
        self.words[self.dynamic_len :] = static_words
        self.static_args = static_args  # keeps the plan tensors alive while bound
        self.static_tensors = tuple(a for a in static_args if hasattr(a, "data_ptr"))
        self.layout_packed = None  # swap01 of the layout call_same_layout() packed, if any
        # (swap01, each leading tensor's (shape, strides)) the words were last packed with by
        # __call__, which then writes only addresses for tensors of that layout.
        self.words_layout = None

    def split(self, tensors) -> tuple[list, list]:
        """The leading tensors as (inputs, outputs) by the ABI's output flags."""
        outputs = [tensors[i] for i in self.output_positions]
        inputs = [t for i, t in enumerate(tensors) if i not in self.output_positions]
        return inputs, outputs

    def join(self, inputs, outputs) -> list:
        """split()'s inverse: the leading tensors in ABI order."""
        inputs, outputs = iter(inputs), iter(outputs)
        return [
            next(outputs) if i in self.output_positions else next(inputs)
            for i in range(self.num_dynamic)
        ]

    def __call__(self, tensors, swap01: bool = False) -> None:
        """Launch on the current stream with `tensors` as the leading arguments; swap01 passes
        each as its (1, 0)-transposed view. When the tensors have the shapes and strides of
        the last call, only their addresses are written (decode calls, for one, repeat
        their layouts)."""
        layout = (swap01, tuple((tensor.shape, tensor.stride()) for tensor in tensors))
        if layout != self.words_layout:
            words = []
            for (shape_modes, stride_modes, _, _), (shape, stride) in zip(
                self.dynamic_modes[swap01], layout[1], strict=True
            ):
                words.append(0)  # the address: _write_addresses checks and writes it
                for i in shape_modes:
                    words.append(shape[i])
                for i in stride_modes:
                    words.append(stride[i])
            self.pack_dynamic(self.words, 0, *words)
            self.words_layout = layout
        self._write_addresses(tensors, swap01)
        self.layout_packed = None
        self._launch(tensors[0].get_device())

    def call_same_layout(self, tensors, swap01: bool = False) -> None:
        """__call__ for callers whose leading tensors have the same shapes and strides at
        every call (run() with contiguous operands of its plan's shapes): after the first
        call only their addresses are packed (some microseconds of host time less)."""
        if self.layout_packed is not swap01:
            self(tensors, swap01)
            self.layout_packed = swap01
            return
        self._write_addresses(tensors, swap01)
        self._launch(tensors[0].get_device())

    def _write_addresses(self, tensors, swap01: bool) -> None:
        """The leading tensors' addresses into the words (their other words as packed)."""
        words = self.words
        for position, (_, _, name, align), tensor in zip(
            self.address_words, self.dynamic_modes[swap01], tensors, strict=True
        ):
            pointer = tensor.data_ptr()
            if pointer % align:
                raise ValueError(f"{name} must be {align}-byte aligned, got address {pointer:#x}")
            words[position] = pointer

    def _launch(self, device_index: int) -> None:
        # The entry a Python int (a C int), the words a ctypes array (its address), the
        # stream a void pointer (library(): sf_launch has no argtypes).
        stream = ctypes.c_void_p(_current_stream(device_index))
        code = library().sf_launch(self.kernel.entry, self.words, stream)
        if code:
            raise KernelLaunchError(f"launching {self.kernel.name} failed: {_error_text(code)}")


def _current_stream(device_index: int) -> int:
    """The current torch stream's handle, without building a torch.cuda.Stream object."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream
