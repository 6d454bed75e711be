"""The C ABI of a kernel family: its arguments, as data.

A kernel argument is a tensor or a scalar. The runtime packs each into 64-bit words (a
tensor: data pointer, run-time extents, run-time strides; a scalar: one word) in ABI order;
the registry's launcher unpacks them into the exported header's structs; the templates
receive them as one struct whose fields are named after the arguments
(generator/kernels/common/entry.py). The ABI is the only list of a family's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

# Element types by short name. "input" in a TensorArg means the variant's own dtype.
DTYPE_BITS = {"bf16": 16, "fp16": 16, "e4m3": 8, "f32": 32, "i32": 32, "i64": 64, "u8": 8}


@dataclass(frozen=True)
class TensorArg:
    """One tensor argument. `shape` and `stride` hold an int for a compile-time extent or
    None for a run-time one; `name` is the kernel's name for it (the exported header names
    its struct after it)."""

    name: str
    dtype: str
    shape: tuple
    stride: tuple
    divisibility: int = 1  # of every run-time stride, in elements
    # The kernel narrows the run-time strides to 32 bits (a 64-bit stride costs three IMADs
    # per use in the loops); the ABI still passes 64-bit words, and binding checks that the
    # tensor spans fewer than 2^31 elements.
    narrow_strides: bool = False
    output: bool = False  # the kernel writes it (torch.compile sees it as mutated)

    @property
    def dynamic_shape_modes(self) -> list[int]:
        return [i for i, s in enumerate(self.shape) if s is None]

    @property
    def dynamic_stride_modes(self) -> list[int]:
        return [i for i, s in enumerate(self.stride) if s is None]

    @property
    def words(self) -> int:
        return 1 + len(self.dynamic_shape_modes) + len(self.dynamic_stride_modes)

    def element(self, variant_dtype: str | None) -> str:
        return variant_dtype if self.dtype == "input" else self.dtype

    def align_bytes(self, variant_dtype: str | None) -> int:
        """Byte alignment the kernel assumes for the data pointer: 16 where the strides allow
        16-byte vectors, else one element."""
        bits = DTYPE_BITS[self.element(variant_dtype)]
        return 16 if self.divisibility * bits >= 128 else max(1, bits // 8)


@dataclass(frozen=True)
class ScalarArg:
    name: str
    dtype: str  # "f32" or "i32"

    words = 1


def words(abi) -> int:
    """64-bit words the runtime packs for an argument list."""
    return sum(arg.words for arg in abi)
