"""Argument checks shared by the public functions: every error names the argument and says
what was expected. Nothing here launches anything or reads a GPU tensor's values."""

from __future__ import annotations

import torch


def describe(t) -> str:
    """A tensor's dtype, shape, device and strides (or the type of anything else), for
    error messages."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}, strides {t.stride()}"


def reject(name: str, value, allowed=(None,), why: str = "is not supported by sparseforge") -> None:
    """NotImplementedError unless `value` is one of `allowed` (None only by identity). A
    plain loop: run() calls this up to four times a call, and any() over a generator costs
    ~1.5 us more each on the CPU of the build machine."""
    for a in allowed:
        if value is a or (a is not None and value == a):
            return
    raise NotImplementedError(f"{name}={value!r} {why}")


def check_tensor(name: str, t, shape, dtype=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_index_tensor(name: str, t, shape, dtype, device) -> None:
    """Plan inputs may live on the host (checked there) or on the wrapper's device."""
    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
        device = t.device
    check_tensor(name, t, shape, dtype, device)


def check_vector_operand(name: str, t: torch.Tensor) -> None:
    """Unit stride on the last dimension and the others multiples of 16 bytes: the kernels
    load such operands with 16-byte vectors (the launch checks the address)."""
    stride = t.stride()
    if stride[-1] != 1:
        raise ValueError(f"{name} must have unit stride on head_dim, got strides {stride}")
    per_16_bytes = 16 // t.element_size()
    if any(s % per_16_bytes for s in stride[:-1]):
        raise ValueError(
            f"{name} must have strides that are multiples of {per_16_bytes} elements (16 bytes), "
            f"got {stride}"
        )


def check_heads(num_qo_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Positive ints, the query heads a multiple of the kv heads."""
    for name, value in (
        ("num_qo_heads", num_qo_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        positive_int(name, value)
    if num_qo_heads % num_kv_heads:
        raise ValueError(
            f"num_qo_heads {num_qo_heads} must be a positive multiple of num_kv_heads "
            f"{num_kv_heads}"
        )


def positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last] byte addresses a tensor's elements occupy (it is not empty)."""
    start = t.data_ptr()
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (extent + 1) * t.element_size() - 1


def _interleaved_apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a and b interleave without sharing memory: the same byte stride P on their
    first dim (pages, rows), each page's elements within P bytes, and the two pages' byte
    ranges apart modulo P (e.g. the data and scale regions of one page allocation)."""
    if a.dim() < 2 or b.dim() < 2:
        return False
    period = a.stride(0) * a.element_size()
    if b.stride(0) * b.element_size() != period or period <= 0:
        return False
    ranges = []
    for t in (a, b):
        first, last = _span(t[0])
        if last - first + 1 > period:
            return False
        ranges.append((first % period, last - first + 1))
    (start_a, length_a), (start_b, length_b) = ranges
    return (start_b - start_a) % period >= length_a and (start_a - start_b) % period >= length_b


def contiguous_operands(plan, device_index: int, q, k, v, out, lse) -> bool:
    """True when q, k, v (and out and lse where given) are plain contiguous tensors of the
    plan's shapes and dtypes (plan.contiguous_layouts) on GPU `device_index`, and out and
    lse share no memory with the tensors before them: all that run()'s checks ask, at a
    few microseconds less host time per run(). Anything else takes the full checks, which
    name what is wrong. (Written for speed: run() calls it every time.)"""
    spans = []
    layouts = plan.contiguous_layouts
    for t, (shape, strides, dtype, size) in zip((q, k, v, out, lse), layouts, strict=True):
        if t is None:  # out or lse, not given
            continue
        if (
            type(t) is not torch.Tensor
            or t.dtype != dtype
            or t.shape != shape
            or t.stride() != strides
            or t.get_device() != device_index
        ):
            return False
        start = t.data_ptr()
        end = start + size
        if len(spans) >= 3:  # an output: apart from every tensor before it
            for other_start, other_end in spans:
                if start < other_end and other_start < end:
                    return False
        spans.append((start, end))
    return True


def overlaps_itself(t: torch.Tensor) -> bool:
    """True when two elements may share memory (e.g. a stride of 0 from expand()): walking
    the dimensions by stride, each must step past all the elements of the smaller ones."""
    covered = 1
    for stride, size in sorted(
        (abs(s), n) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1
    ):
        if stride < covered:
            return True
        covered += stride * (size - 1)
    return False


def check_writable(name: str, t: torch.Tensor, inputs) -> None:
    """An output the kernels write: no element twice (zero or overlapping strides), and the
    memory it spans apart from each input's, `inputs` as (name, tensor) pairs. On run()'s
    path, so the common cases are cheap: a contiguous tensor cannot overlap itself, and
    tensors of different storages cannot share memory."""
    if t.numel() == 0:
        return
    if not t.is_contiguous() and overlaps_itself(t):
        raise ValueError(
            f"{name} overlaps itself (shape {tuple(t.shape)}, strides {t.stride()}): give a "
            "tensor whose elements have memory of their own"
        )
    storage = t.untyped_storage().data_ptr()
    for other_name, other in inputs:
        if other.untyped_storage().data_ptr() != storage or not other.numel():
            continue
        first, last = _span(t)
        a, b = _span(other)
        if a <= last and first <= b and not _interleaved_apart(t, other):
            raise ValueError(
                f"the memory {name} spans overlaps {other_name}'s: an output must not "
                "alias an input"
            )
