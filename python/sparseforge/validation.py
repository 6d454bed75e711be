"""Checks of plan() inputs that need their values, without stalling the host.

Inputs on the host are checked on the host: plan() raises at once. For inputs on the GPU
sparsity.py computes error bits with torch ops (sparsity.ERR_*) next to the block mask, and
ignores whatever is invalid, so no kernel ever reads out of bounds. The bits travel to pinned
host memory asynchronously; they are raised
  - by `check_plan()`, which waits for them (one synchronisation), and
  - by the first `run()` that finds them already on the host (a non-blocking event query).
A plan built while a CUDA graph is being captured is not checked: validate an eager plan of
the same shapes first.
"""

from __future__ import annotations

import torch

from sparseforge import sparsity

_MESSAGES = {
    sparsity.ERR_INDEX_RANGE: "a block index is out of range [0, {num_col_blocks})",
    sparsity.ERR_DUPLICATE: "a row lists the same block more than once",
    sparsity.ERR_INDPTR: "indptr must start at 0, be non-decreasing and end at len(indices)",
    sparsity.ERR_KV_BLOCK_LENS: "kv_block_lens values must lie in [1, C]",
    sparsity.ERR_Q2K_NUM: "q2k_num values must lie in [0, topk]",
    sparsity.ERR_STALE_SIZES: (
        "a block-size tensor was changed in place without torch noticing (through .data or "
        "another library's kernel) since plan() read it: pass a new tensor, or clone() it"
    ),
    sparsity.ERR_GROUP_SELECTIONS: (
        "the query heads of a GQA group select different blocks (selections are per kv head: "
        "give the same rows for every query head of a group, or a mask per kv head)"
    ),
}


def error_text(bits: int, source: str, num_col_blocks: int) -> str:
    problems = [
        m.format(num_col_blocks=num_col_blocks) for bit, m in _MESSAGES.items() if bits & bit
    ]
    return f"invalid {source}: " + "; ".join(problems)


class DeferredCheck:
    """The error bits of the latest plan, copied to the host without blocking."""

    def __init__(self):
        self._host = None
        self._event = None
        self._pending = False
        self._text = ("", 0)

    def start(self, bits: torch.Tensor, source: str, num_col_blocks: int) -> None:
        self._pending = False
        if torch.cuda.is_current_stream_capturing():
            return
        if self._host is None:
            self._host = torch.zeros((), dtype=torch.int32, pin_memory=True)
            self._event = torch.cuda.Event()
        self._host.copy_(bits, non_blocking=True)
        self._event.record()
        self._pending = True
        self._text = (source, num_col_blocks)

    def clear(self) -> None:
        self._pending = False

    def raise_if_found(self, wait: bool = False) -> None:
        """Raise ValueError if the checks found a problem; with wait=False only if done."""
        if not self._pending:
            return
        if wait:
            self._event.synchronize()
        elif torch.cuda.is_current_stream_capturing() or not self._event.query():
            return
        bits = int(self._host)
        if bits:
            raise ValueError(error_text(bits, *self._text))
        self._pending = False


def raise_host_errors(bits: torch.Tensor, source: str, num_col_blocks: int) -> None:
    """Raise at once for error bits computed on the host."""
    value = int(bits)
    if value:
        raise ValueError(error_text(value, source, num_col_blocks))
