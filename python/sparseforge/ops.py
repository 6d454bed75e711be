"""torch.library custom ops around the kernel launches, for torch.compile.

Eager run() calls the bound launch directly (fewer microseconds per call); under
torch.compile it calls `torch.ops.sparseforge.block_sparse_fwd`, whose fake implementation
lets the compiler trace it. The op mutates `out` and `lse` and returns nothing. The plan's
tensors (tile lists, Sage scales) are passed too, so the compiler sees every buffer the kernel
reads.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_launches: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_ids = itertools.count()


def register(launch) -> int:
    """An id under which the op finds `launch` (a BoundLaunch) while its plan lives."""
    launch_id = next(_ids)
    _launches[launch_id] = launch
    return launch_id


@torch.library.custom_op("sparseforge::block_sparse_fwd", mutates_args=("out", "lse"))
def block_sparse_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan_tensors: list[torch.Tensor],
    launch_id: int,
    hnd: bool,
) -> None:
    launch = _launches.get(launch_id)
    if launch is None:
        raise RuntimeError("the plan this compiled call was traced with no longer exists; call plan() again")
    launch((q, k, v, out, lse), hnd)


@block_sparse_fwd.register_fake
def _(q, k, v, out, lse, plan_tensors, launch_id, hnd) -> None:
    return None
