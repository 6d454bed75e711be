"""torch dtypes by the names the manifest uses (generator/abi.py): the runtime's one table."""

from __future__ import annotations

import torch

BY_NAME = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "e4m3": torch.float8_e4m3fn,
    "f32": torch.float32,
    "i32": torch.int32,
    "i64": torch.int64,
    "u8": torch.uint8,
}
NAME_OF = {dtype: name for name, dtype in BY_NAME.items()}
# What a user may write for an attention dtype (FlashInfer accepts strings too).
ALIASES = {
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "e4m3": torch.float8_e4m3fn,
}


def as_dtype(value, argument: str, allowed) -> torch.dtype:
    """`value` (a torch.dtype or one of ALIASES, "torch." prefix allowed) as a torch.dtype
    from `allowed`; errors name the argument."""
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.removeprefix("torch.") in ALIASES:
        dtype = ALIASES[value.removeprefix("torch.")]
    else:
        names = ", ".join(str(d) for d in allowed)
        raise ValueError(f"{argument}={value!r} is not a dtype; use one of {names}")
    if dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise ValueError(f"{argument}={dtype} is not supported; use one of {names}")
    return dtype
