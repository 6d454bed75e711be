"""The host entry point of every template, built from its family's ABI.

`entry_point(kernel, abi)` is a @cute.jit function whose parameters are the ABI's arguments
in order (then the stream), so the exported C header names its tensor structs after them;
it narrows the strides of the tensors whose TensorArg says so and calls
`kernel.launch(args, stream)` with one struct (a named tuple, field per argument). The
templates read `args.mQ`, `args.scale_log2`, ...: the argument list is written only in the
family spec (generator/families/).
"""

import collections
import functools
import inspect

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from generator.abi import ScalarArg

ELEMENT_TYPES = {
    "bf16": cutlass.BFloat16,
    "fp16": cutlass.Float16,
    "e4m3": cutlass.Float8E4M3FN,
    "f32": cutlass.Float32,
    "i32": cutlass.Int32,
    "i64": cutlass.Int64,
    "u8": cutlass.Uint8,
}


def element_type(name: str):
    """The cutlass numeric type of a dtype name (generator/abi.py)."""
    return ELEMENT_TYPES[name]


@functools.cache
def args_struct(names: tuple[str, ...]):
    """The struct a template receives: a named tuple with one field per ABI argument."""
    return collections.namedtuple("Args", names)


def with_narrow_strides(t: cute.Tensor, divisibility: int = 1) -> cute.Tensor:
    """t with 32-bit run-time strides (the ABI passes 64-bit ones). `divisibility`: the
    ABI's, which the narrowed strides would otherwise lose (it keeps 16-byte loads)."""
    strides = tuple(
        s if isinstance(s, int) else cute.assume(cutlass.Int32(s), divby=divisibility)
        for s in t.stride
    )
    return cute.make_tensor(t.iterator, cute.make_layout(t.shape, stride=strides))


def entry_point(kernel, abi):
    """The jit function cute.compile exports for one variant (module docstring)."""
    Args = args_struct(tuple(arg.name for arg in abi))

    def entry(*values):
        *args, stream = values
        args = [
            with_narrow_strides(value, arg.divisibility)
            if getattr(arg, "narrow_strides", False)
            else value
            for arg, value in zip(abi, args, strict=True)
        ]
        kernel.launch(Args(*args), stream)

    params = [
        inspect.Parameter(
            arg.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            annotation=element_type(arg.dtype) if isinstance(arg, ScalarArg) else cute.Tensor,
        )
        for arg in abi
    ]
    params.append(
        inspect.Parameter(
            "stream", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=cuda.CUstream
        )
    )
    entry.__signature__ = inspect.Signature(params)
    # No AST rewriting: the body has no device control flow, and it is a closure.
    return cute.jit(preprocess=False)(entry)


def unit_launch_options(mWork, units_per_cta: int, num_threads: int, ctas_per_sm: int,
                        SharedStorage, stream) -> dict:  # fmt: skip
    """The launch of a template over units and tiles: one CTA per `units_per_cta` entries of
    mWork, registers capped for `ctas_per_sm` CTAs a SM (min_blocks_per_mp; the carveout lets
    it compile without a GPU)."""
    return dict(
        grid=[mWork.shape[0] // units_per_cta, 1, 1],
        block=[num_threads, 1, 1],
        smem=SharedStorage.size_in_bytes(),
        stream=stream,
        min_blocks_per_mp=ctas_per_sm,
        preferred_smem_carveout=100,
    )
