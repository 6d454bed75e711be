"""Launches as a torch.library custom op, for torch.compile.

Eager calls launch a BoundLaunch directly (fewer microseconds per call). Under
torch.compile `launch()` calls `torch.ops.sparseforge.launch`, whose fake implementation lets
the compiler trace it: the op writes the ABI's output tensors (`outputs`), returns nothing,
and is also given the bound plan tensors, so the compiler sees every buffer the kernel reads.
Any family's BoundLaunch goes through the same op.
"""

from __future__ import annotations

import torch

from sparseforge import _library


def launch(
    bound: _library.BoundLaunch, tensors, swap01: bool = False, same_layout: bool = False
) -> None:
    """Launch `bound` with its leading tensors, eagerly or through the custom op;
    `same_layout` (eager callers only, outside tracing): they have the same shapes and strides
    at every such call (BoundLaunch.call_same_layout)."""
    if same_layout:  # set by eager callers only
        bound.call_same_layout(tensors, swap01)
    elif torch.compiler.is_compiling():
        inputs, outputs = bound.split(tensors)
        torch.ops.sparseforge.launch(
            inputs, outputs, list(bound.static_tensors), bound.launch_id, swap01
        )
    else:
        bound(tensors, swap01)


@torch.library.custom_op("sparseforge::launch", mutates_args=("outputs",))
def _launch_op(
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
    plan_tensors: list[torch.Tensor],
    launch_id: int,
    swap01: bool,
) -> None:
    bound = _library.bound_launch(launch_id)
    if bound is None:
        raise RuntimeError(
            "the plan this compiled call was traced with no longer exists; call plan() again"
        )
    bound(bound.join(inputs, outputs), swap01)


@_launch_op.register_fake
def _(inputs, outputs, plan_tensors, launch_id, swap01) -> None:
    return None
