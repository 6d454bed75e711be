"""The MiniMax-M3 index-context-parallel (ICP) indexer, call-compatible with the ICP part of
`flashinfer.msa_ops` (exported there: sparseforge.msa_ops).

The index keys of a long context are sharded over a TP2 or TP4 group; every rank holds the
FP8 queries of all four index heads, scores them against its shard (the raw fp32 max of q.k
per 128-token block, B128), keeps a local top-16 per (token, head) in a carrier row, and the
rank that owns a head (h // (4 / W)) merges every rank's rows into the exact global top-16.

Layouts (page size P, world size W, rank r, local page c):
    P128          local row i = key 128 c + i W + r (rows interleaved over the ranks)
    P256, W = 2   keys 256 c + 128 r + [0, 128): the whole block 2 c + r
    P256, W = 4   keys 256 c + 64 r + [0, 64): half of block 2 c + r // 2
Scores: no scale; NaN ignored; -0 written as +0; -inf where the token sees no key of the
rank's part of the block. Columns: P128 and P256 (not compact) the global block id; compact
P256 the local page c (global block 2 c + 2 r // W).

Top-16 of a (token, head): candidates are blocks below min(nvp, 8192) with a score above
-inf (NaN counts as -inf); the forced ones (ids < force_begin_blocks and >= nvp -
force_end_blocks) first, the rest by score descending, exact ties to the lower id. A carrier
row is 33 int32: 16 score words, 16 ascending ids ((-inf, -1) padding), a ready flag; a
tagged row 32 int64 words generation << 32 | word. The merge drops ids outside [0, min(nvp,
8192)), keeps a duplicate id's largest score and ranks the same way; it reproduces exactly
the single-GPU top-16 of the global block maxima.

Chains:
    prefill  msa_icp_index_score_sharded -> msa_icp_topk_select_prefill (carrier [4, T, 33])
             -> the caller's all-to-all by owner ([W, hpr, T, 33]) -> msa_icp_merge_candidates
             (prefill=True)
    decode   msa_icp_decode_index_score_sharded -> msa_icp_topk_select_publish (into the
             owners' receive rows, MSAIcpComm) -> msa_icp_merge_candidates (waits for them)
prepare_msa_icp_indexer returns a plan that runs either chain with caller-owned buffers.
An engine sets a rank up once per process group and runs the decode chain per sparse layer,
using the three slot sets in turn:

    plan = prepare_msa_icp_indexer(world_size=W, rank=r, num_index_heads=4, page_size=128,
                                   init_blocks=1, local_blocks=2, ..., device=device)
    plan.warmup()
    comm = MSAIcpComm.from_process_group(group, capacity=max_decode_tokens)
    scores = torch.empty(max_decode_tokens, 4, plan.decode_score_columns, device=device)
    ...
    plan.decode(index_q, index_k, block_table, seq_lens, num_valid_pages, scores[:T],
                selected[:T], comm=comm, slot=layer % 3, tagged=False, decode_query_len=1)

The fused paths are an option (the plan takes them when given a pool):
msa_icp_prefill_score_select and msa_icp_decode_score_publish write the same carrier /
receive rows as the score plane and the select, without the plane: the scorer keeps each
(token, head) row's 16 best blocks as it scores them (in shared memory; a list per run of
pages a CTA scores, into the caller's pool: msa_icp_prefill_pool_bytes,
msa_icp_decode_pool_bytes) and a list merge ranks a row's lists and writes the row. Prefill
scores a row tile's pages in one CTA (one list); decode splits them over up to four CTAs
(the plane path over as many as fill one wave), so the fused decode of a few requests
runs on fewer CTAs.

Every call is a kernel launch on the current stream with no host synchronisation and no
allocation, so the chains can be captured in a CUDA graph after warmup(). enable_pdl is
accepted and has no effect (the launches are ordered as usual). Kernels:
generator/kernels/sm90/msa_icp_score.py (FP8 wgmma, Hopper),
generator/kernels/portable/msa_icp_score.py (mma.sync, every arch: SM100 and SM120 score
with it; both also as the fused paths' list scorer) and
generator/kernels/portable/msa_icp_{select,merge,list_merge}.py (every arch); reference:
sparseforge.reference_icp.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from sparseforge import ops
from sparseforge.arch import multiprocessors
from sparseforge.checks import check_writable, describe
from sparseforge.families import msa_icp as icp_family
from sparseforge.reference_icp import BLOCK, CARRIER_WORDS, HEADS, MAX_BLOCKS, SLOT_SETS, TOPK
from sparseforge.sparsity import uniform_offsets

HEAD_DIM = 128
MAX_COLUMNS = 12288  # score columns a select takes (exclusive)
MAX_DECODE_COLUMNS = 8192
TAGGED_WORDS = 2 * TOPK
MAX_DECODE_ROWS = 32  # 4 x max_decode_query_len
LIST_WORDS = 2 * TOPK  # a list of the fused paths: 16 score words, 16 ids
MAX_LIST_SPLITS = 4  # lists per (token, head) the fused decode path splits pages into
DEFAULT_SPIN_LIMIT = 1 << 26
BACKENDS = ("auto", "cake")  # the reference system's name for this route, accepted


# ---- sizes ------------------------------------------------------------------------------


def msa_icp_index_score_columns(max_seq_len: int, page_size: int) -> int:
    """Prefill score columns: ceil(max_seq_len / 128) for P128, half of it (rounded up) for
    compact P256 scores."""
    _check_int("max_seq_len", max_seq_len, 0)
    _check_page_size(page_size)
    blocks = -(-max_seq_len // BLOCK)
    return blocks if page_size == 128 else -(-blocks // 2)


def msa_icp_decode_score_columns(max_model_len: int, page_size: int) -> int:
    """Decode score columns: min(8192, ceil(max_model_len / (4 * page_size)) * 4)."""
    _check_int("max_model_len", max_model_len, 1)
    _check_page_size(page_size)
    return min(MAX_DECODE_COLUMNS, -(-max_model_len // (4 * page_size)) * 4)


def msa_icp_comm_layout(world_size: int, heads_per_rank: int, capacity: int) -> dict:
    """Layout of the caller's decode receive storage (one allocation per rank, peer-visible):
    storage_words (int32 words of it), legacy_offset_bytes (0) and legacy_shape (int32
    [3, W, hpr, capacity, 33]), tagged_offset_bytes and tagged_shape (int64 [3, W, hpr,
    capacity, 32]), and the shapes of the int32 counters each rank keeps apart:
    generations_shape [3, W * hpr, capacity] (the publisher's) and expected_shape [3, hpr,
    capacity] (the merge's). Zero the storage and the counters once, on every rank, and never
    reset them. Tagged rows need at least two sparse layers between uses of one slot set
    (including across steps); legacy rows are safe at any distance."""
    _check_world(world_size)
    if heads_per_rank != HEADS // world_size:
        raise ValueError(
            f"heads_per_rank must be {HEADS // world_size} (4 index heads over {world_size} "
            f"ranks), got {heads_per_rank!r}"
        )
    _check_int("capacity", capacity, 1)
    rows = SLOT_SETS * world_size * heads_per_rank * capacity
    legacy_bytes = rows * CARRIER_WORDS * 4
    tagged_offset = -(-legacy_bytes // 256) * 256
    tagged_bytes = rows * TAGGED_WORDS * 8
    return {
        "storage_words": (tagged_offset + tagged_bytes) // 4,
        "legacy_offset_bytes": 0,
        "legacy_shape": (SLOT_SETS, world_size, heads_per_rank, capacity, CARRIER_WORDS),
        "tagged_offset_bytes": tagged_offset,
        "tagged_shape": (SLOT_SETS, world_size, heads_per_rank, capacity, TAGGED_WORDS),
        "generations_shape": (SLOT_SETS, world_size * heads_per_rank, capacity),
        "expected_shape": (SLOT_SETS, heads_per_rank, capacity),
    }


def msa_icp_index_score_plan_storage(*, num_qo_heads: int, total_q: int, batch: int, device):
    """Sizes of a prefill plan's storage: work_range_numel (int64), work_info_numel (int64)
    and workspace_bytes (uint8). This scorer keeps the plan's per-sequence vectors in
    packed_work_info (3 B + 1 int32) and needs neither of the others (sizes 0; larger
    tensors are accepted)."""
    _check_heads(num_qo_heads)
    _check_int("total_q", total_q, 0)
    _check_int("batch", batch, 1)
    return {
        "work_range_numel": 0,
        "work_info_numel": -(-(3 * batch + 1) // 2),
        "workspace_bytes": 0,
    }


def msa_icp_prefill_pool_bytes(*, total_q: int, batch: int, device, num_heads: int = 4) -> int:
    """Bytes of the fused prefill path's pool (msa_icp_prefill_score_select) for a query
    window of at most total_q tokens: one list of the 16 best blocks (32 int32 words) per
    (token, head). batch and device are checked and do not change the size (a row tile's
    pages are not split in prefill)."""
    _check_int("total_q", total_q, 0)
    _check_int("batch", batch, 1)
    _check_heads(num_heads)
    torch.device(device)
    return total_q * num_heads * LIST_WORDS * 4


def msa_icp_decode_pool_bytes(*, max_decode_tokens: int) -> int:
    """Bytes of the fused decode path's pool (msa_icp_decode_score_publish) for up to
    max_decode_tokens query tokens: up to four lists of the 16 best blocks (32 int32 words)
    per (token, head), one per run of pages a request's scorer CTAs split."""
    _check_int("max_decode_tokens", max_decode_tokens, 0)
    return max_decode_tokens * HEADS * MAX_LIST_SPLITS * LIST_WORDS * 4


# ---- prefill -----------------------------------------------------------------------------


@dataclass(frozen=True)
class MSAIcpScorePlan:
    """A prefill window's sequences for msa_icp_index_score_sharded, kept in caller storage
    (device int32 views): query offsets (B + 1), key lengths (B), first query positions
    (B); and the host bounds the launch is sized by."""

    cu_q: torch.Tensor
    seq_lens: torch.Tensor
    q_offset: torch.Tensor
    total_q: int
    max_query_len: int
    max_seq_len: int

    @property
    def batch(self) -> int:
        return self.seq_lens.shape[0]


def msa_icp_index_score_sharded_plan(
    qo_segment_lens, kv_segment_lens, num_qo_heads: int, *, qo_offset, device=None,
    backend: str = "cake",
):  # fmt: skip
    """Plan the sharded prefill scorer from host segment lengths (eager only): int32 CPU [B]
    query tokens, key lengths and query start positions of every segment (read here). The
    plan's storage is allocated on `device` (default: the current CUDA device); use
    msa_icp_index_score_sharded_plan_device for CUDA graphs."""
    _check_backend(backend)
    _check_heads(num_qo_heads)
    vectors = {}
    for name, t in (
        ("qo_segment_lens", qo_segment_lens),
        ("kv_segment_lens", kv_segment_lens),
        ("qo_offset", qo_offset),
    ):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"{name} must be an int32 tensor [B], got {describe(t)}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU (its values are read), got {t.device}")
        vectors[name] = t
    batch = qo_segment_lens.shape[0]
    if batch == 0 or any(t.shape[0] != batch for t in vectors.values()):
        raise ValueError(
            "qo_segment_lens, kv_segment_lens and qo_offset must have the same length B >= 1, "
            f"got {[t.shape[0] for t in vectors.values()]}"
        )
    for name, t in vectors.items():
        if bool((t < 0).any()):
            raise ValueError(f"{name} must be >= 0, got {t.tolist()}")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    device = torch.device(device)
    zero = torch.zeros(1, dtype=torch.int32)
    cu_q = torch.cat([zero, qo_segment_lens.cumsum(0, dtype=torch.int32)])
    cu_k = torch.cat([zero, kv_segment_lens.cumsum(0, dtype=torch.int32)])
    total_q = int(cu_q[-1])
    sizes = msa_icp_index_score_plan_storage(
        num_qo_heads=num_qo_heads, total_q=total_q, batch=batch, device=device
    )
    return msa_icp_index_score_sharded_plan_device(
        qo_segment_lens.to(device), kv_segment_lens.to(device), cu_q.to(device),
        cu_k.to(device), qo_offset.to(device), num_qo_heads, total_q=total_q,
        max_query_len=int(qo_segment_lens.max()), max_seq_len=int(kv_segment_lens.max()),
        packed_work_range=torch.empty(sizes["work_range_numel"], dtype=torch.int64, device=device),
        packed_work_info=torch.empty(sizes["work_info_numel"], dtype=torch.int64, device=device),
        workspace=torch.empty(sizes["workspace_bytes"], dtype=torch.uint8, device=device),
        backend=backend,
    )  # fmt: skip


def msa_icp_index_score_sharded_plan_device(
    qo_segment_lens, kv_segment_lens, qo_segment_offsets, kv_segment_offsets, qo_offset,
    num_qo_heads: int, *, total_q: int, max_query_len: int, max_seq_len: int,
    packed_work_range, packed_work_info, workspace, backend: str = "cake",
):  # fmt: skip
    """Plan the sharded prefill scorer on the device into caller storage (graph safe: no
    device value is read on the host; three copies on the current stream). qo_segment_lens,
    kv_segment_lens, qo_offset: int32 CUDA [B]; qo_segment_offsets, kv_segment_offsets:
    int32 CUDA [B + 1] prefix sums (kv_segment_offsets is not needed: keys are paged);
    total_q, max_query_len, max_seq_len: host upper bounds. The plan is reused by every
    layer of the step: keep the storage of each concurrently live plan distinct."""
    _check_backend(backend)
    _check_heads(num_qo_heads)
    for name, value in (
        ("total_q", total_q), ("max_query_len", max_query_len), ("max_seq_len", max_seq_len)
    ):  # fmt: skip
        _check_int(name, value, 0)
    device = qo_segment_offsets.device if isinstance(qo_segment_offsets, torch.Tensor) else None
    batch = qo_segment_lens.shape[0] if isinstance(qo_segment_lens, torch.Tensor) else 0
    for name, t, length in (
        ("qo_segment_lens", qo_segment_lens, batch),
        ("kv_segment_lens", kv_segment_lens, batch),
        ("qo_offset", qo_offset, batch),
        ("qo_segment_offsets", qo_segment_offsets, batch + 1),
        ("kv_segment_offsets", kv_segment_offsets, batch + 1),
    ):
        _check_vector(name, t, length, torch.int32, device)
    if batch == 0:
        raise ValueError("qo_segment_lens must have B >= 1 segments")
    if device.type != "cuda":
        raise ValueError(f"the plan's tensors must be on a CUDA device, got {device}")
    sizes = msa_icp_index_score_plan_storage(
        num_qo_heads=num_qo_heads, total_q=total_q, batch=batch, device=device
    )
    for name, t, dtype, numel in (
        ("packed_work_range", packed_work_range, torch.int64, sizes["work_range_numel"]),
        ("packed_work_info", packed_work_info, torch.int64, sizes["work_info_numel"]),
        ("workspace", workspace, torch.uint8, sizes["workspace_bytes"]),
    ):
        _check_storage(name, t, dtype, numel, device, "msa_icp_index_score_plan_storage")
    words = packed_work_info.view(torch.int32)
    cu_q, rest = words[: batch + 1], words[batch + 1 :]
    seq_lens, q_offset = rest[:batch], rest[batch : 2 * batch]
    cu_q.copy_(qo_segment_offsets)
    seq_lens.copy_(kv_segment_lens)
    q_offset.copy_(qo_offset)
    return MSAIcpScorePlan(cu_q, seq_lens, q_offset, total_q, max_query_len, max_seq_len)


def msa_icp_index_score_sharded(
    q, k, block_table, plan, *, rank: int, max_score, sm_scale: float = 1.0,
    initialize: bool = True, tp: int = 2, compact: bool = False, enable_pdl: bool = False,
    backend: str = "cake",
):  # fmt: skip
    """Score a prefill query chunk against this rank's index-K shard: for every token t, head
    h and score column c, max_score[t, h, c] = the raw fp32 max of q[t, h] . key over this
    rank's keys of the column's B128 block that the token may see (causal: key position <=
    qo_offset + i), -inf when it sees none.

    q: float8_e4m3fn [T, 4, 128] contiguous, T = plan.total_q. k: float8_e4m3fn [pages,
    P / tp, 128], rows of 128 bytes, page pitch a multiple of 16 bytes. block_table: int32
    [B, >= pages per segment], unit last stride, physical page ids (an id outside k's pages
    holds no key). max_score: float32 [T, 4, K] with unit last stride and a token stride of
    four head strides, K at least msa_icp_index_score_columns(plan.max_seq_len, P). Columns
    no page of the token fills (past its causal prefix; with P256 not compact, the other
    ranks' blocks) are written -inf only when initialize. sm_scale must be 1.0 (raw scores).
    """
    _check_backend(backend)
    if sm_scale != 1.0:
        raise ValueError(f"sm_scale must be 1.0: ICP scores are raw q.k maxima, got {sm_scale!r}")
    device, page_size, shard_rows = _check_prefill_inputs(q, k, block_table, plan, rank, tp)
    columns = msa_icp_index_score_columns(plan.max_seq_len, page_size if compact else 128)
    out_rows = _score_rows("max_score", max_score, plan.total_q, columns, device)
    check_writable("max_score", max_score, (("q", q), ("k", k), ("block_table", block_table)))
    scale, offset = _page_columns(page_size, tp, rank, compact)
    base, step = _key_layout(page_size, shard_rows, tp, rank)
    fill = max_score.shape[2] if initialize else 0
    if plan.total_q and plan.max_query_len:
        _launch_score(
            device, shard_rows, q, k, plan.cu_q, plan.seq_lens, plan.q_offset, block_table,
            out_rows, plan.max_query_len, 0, page_size, base, step, scale, offset, fill, 0, 1,
        )  # fmt: skip


def msa_icp_topk_select_prefill(
    scores, num_valid_pages, carrier, *, force_begin_blocks: int = 0,
    force_end_blocks: int = 0, index_scale: int = 1, index_offset: int = 0,
    backend: str = "cake",
):  # fmt: skip
    """Write each (head, token) row's local top-16 into a prefill carrier. scores: float32
    [T, 4, K], 0 < K < 12288, unit last stride. num_valid_pages: int32 [T], each token's
    global B128 block count (0 for padding rows); local column c is global block c *
    index_scale + index_offset ((1, 0) for P128, (2, 2 rank // tp) for compact P256).
    carrier: int32 [4, T, 33], unit last stride (a token slice of a larger head-major buffer
    is allowed): row [h, t] receives 16 raw score words, 16 ascending ids ((-inf, -1)
    padding) and 1."""
    _check_backend(backend)
    tokens, device = _check_scores("scores", scores)
    _check_vector("num_valid_pages", num_valid_pages, tokens, torch.int32, device)
    _check_carrier("carrier", carrier, tokens, device)
    _check_forced(force_begin_blocks, force_end_blocks)
    _check_index_map(index_scale, index_offset)
    check_writable("carrier", carrier, (("scores", scores), ("num_valid_pages", num_valid_pages)))
    if tokens:
        dummy = _dummies(device)
        _launch_select(
            device, scores, num_valid_pages, carrier, dummy["bases"], dummy["errors"],
            dummy["generations"], index_scale, index_offset, force_begin_blocks,
            force_end_blocks, HEADS, 0, 0, icp_family.mode("local"), 0,
        )  # fmt: skip


def msa_icp_prefill_score_select(
    q, k, block_table, plan, num_valid_pages, pool, carrier, *, rank: int, tp: int = 2,
    compact: bool = False, force_begin_blocks: int = 0, force_end_blocks: int = 0,
    enable_pdl: bool = False, backend: str = "cake",
):  # fmt: skip
    """The fused prefill score and local top-16 of one query window: carrier rows equal to
    those of msa_icp_index_score_sharded followed by msa_icp_topk_select_prefill (with the
    layout's index map), without the score rows. The list scorer keeps each (token, head)
    row's 16 best blocks as it scores them (in shared memory, written to pool), and the list
    merge writes the carrier rows.

    q, k, block_table, plan, rank, tp: as msa_icp_index_score_sharded's. num_valid_pages:
    int32 [T], each token's global B128 block count (0 for padding rows). pool: contiguous,
    16-byte aligned uint8 scratch of at least msa_icp_prefill_pool_bytes() bytes for the
    plan's window; never zeroed (every call writes what it reads), one pool serves every
    window and layer of a stream. carrier: int32 [4, T, 33] as msa_icp_topk_select_prefill's.
    compact changes nothing here (the rows hold global ids either way)."""
    _check_backend(backend)
    device, page_size, shard_rows = _check_prefill_inputs(q, k, block_table, plan, rank, tp)
    if not isinstance(compact, bool):
        raise ValueError(f"compact must be a bool, got {compact!r}")
    tokens = plan.total_q
    _check_vector("num_valid_pages", num_valid_pages, tokens, torch.int32, device)
    _check_carrier("carrier", carrier, tokens, device)
    _check_forced(force_begin_blocks, force_end_blocks)
    needed = msa_icp_prefill_pool_bytes(total_q=tokens, batch=plan.batch, device=device)
    lists = _pool_lists("pool", pool, needed, 1, tokens, device, "msa_icp_prefill_pool_bytes")
    inputs = (
        ("q", q),
        ("k", k),
        ("block_table", block_table),
        ("num_valid_pages", num_valid_pages),
    )
    check_writable("pool", pool, inputs)
    check_writable("carrier", carrier, (*inputs, ("pool", pool)))
    if tokens and plan.max_query_len:
        scale, offset = _page_columns(page_size, tp, rank, compact=False)  # global block ids
        _launch_list_score(
            device, shard_rows, q, k, plan.cu_q, plan.seq_lens, plan.q_offset, block_table,
            num_valid_pages, lists, plan.max_query_len, 0, page_size,
            *_key_layout(page_size, shard_rows, tp, rank), scale, offset, force_begin_blocks,
            force_end_blocks, 1,
        )  # fmt: skip
        merge_lists_into_carrier(
            lists, num_valid_pages, carrier, force_begin_blocks, force_end_blocks
        )


# ---- decode ------------------------------------------------------------------------------


def msa_icp_decode_index_score_sharded(
    index_q, index_k, block_table, seq_lens, score_out, *, rank: int, world_size: int,
    page_size: int, decode_query_len: int, max_decode_query_len: int,
    enable_pdl: bool = False, backend: str = "cake",
):  # fmt: skip
    """Score decode queries against this rank's index-K shard: score_out[t, h, c] for the
    local page columns c of the request's ceil(seq_len / page_size) pages, rounded up to a
    multiple of four (P128: column = global B128 block; P256: column = local page, global
    block 2 c + 2 rank // world_size); other columns are not written.

    index_q: float8_e4m3fn [B * decode_query_len, 4, 128] contiguous, token j of a request at
    position seq_len - decode_query_len + j. index_k: float8_e4m3fn [pages, page_size /
    world_size, 128]. block_table: int32 [B, >= ceil(seq_len / page_size)], unit last stride.
    seq_lens: int32 [B]. score_out: float32 [T, 4, cols], 0 < cols <= 8192, cols % 4 == 0,
    unit last stride (msa_icp_decode_score_columns). 1 <= decode_query_len <=
    max_decode_query_len, 4 max_decode_query_len <= 32."""
    _check_backend(backend)
    _check_decode_lengths(decode_query_len, max_decode_query_len)
    device, batch, shard_rows = _check_decode_inputs(
        index_q, index_k, block_table, seq_lens, rank, world_size, page_size, decode_query_len
    )
    tokens = batch * decode_query_len
    if not isinstance(score_out, torch.Tensor) or score_out.dim() != 3:
        raise ValueError(f"score_out must be float32 [T, 4, cols], got {describe(score_out)}")
    columns = score_out.shape[2]
    if not 0 < columns <= MAX_DECODE_COLUMNS or columns % 4:
        raise ValueError(
            f"score_out must have 0 < cols <= {MAX_DECODE_COLUMNS} columns, a multiple of 4 "
            f"(msa_icp_decode_score_columns), got {columns}"
        )
    out_rows = _score_rows("score_out", score_out, tokens, columns, device)
    check_writable("score_out", score_out, (("index_q", index_q), ("index_k", index_k)))
    base, step = _key_layout(page_size, shard_rows, world_size, rank)
    if tokens:
        offsets = uniform_offsets(batch, decode_query_len, device)
        splits = _decode_page_splits(device, batch, columns, shard_rows)
        _launch_score(
            device, shard_rows, index_q, index_k, offsets, seq_lens, seq_lens, block_table,
            out_rows, decode_query_len, -decode_query_len, page_size, base, step, 1, 0, 0, 4,
            splits,
        )  # fmt: skip


def msa_icp_topk_select_publish(
    scores, num_valid_pages, recv_bases, errors, *, slot: int, rank: int, world_size: int,
    heads_per_rank: int, capacity: int, force_begin_blocks: int, force_end_blocks: int,
    spin_limit: int = DEFAULT_SPIN_LIMIT, enable_pdl: bool = False, generations=None,
    index_scale: int = 1, index_offset: int = 0, backend: str = "cake",
):  # fmt: skip
    """Select each decode (token, head) row's local top-16 and store it into the receive row
    of the head's owner: row (t, h) goes to rank h // heads_per_rank, at row ((slot *
    world_size + rank) * heads_per_rank + h % heads_per_rank) * capacity + t of its legacy
    rows (int32, 33 words; the publish first waits until the owner's last merge of the slot
    set has cleared the row's ready flag, then sets it) or, with generations, its tagged rows
    (int64, 32 words of generation << 32 | word, the generation one more than the row's last,
    kept in generations int32 [3, world_size * heads_per_rank, >= T]). Every row is written,
    padding rows included.

    scores: float32 [T, 4, K], 0 < K < 12288, unit last stride. num_valid_pages: int32 [T]
    global B128 block counts. recv_bases: int64 [world_size] on the device, the address of
    every rank's legacy rows (the tagged rows' with generations): msa_icp_comm_layout,
    MSAIcpComm. errors: int32 [>= 1]; a wait of spin_limit polls adds one and traps."""
    _check_backend(backend)
    _check_world(world_size)
    if heads_per_rank != HEADS // world_size:
        raise ValueError(f"heads_per_rank must be {HEADS // world_size}, got {heads_per_rank!r}")
    tokens, device = _check_scores("scores", scores)
    mode, counters = _check_publish(
        num_valid_pages, recv_bases, errors, generations, tokens, device, slot=slot, rank=rank,
        world_size=world_size, capacity=capacity, spin_limit=spin_limit,
    )  # fmt: skip
    _check_forced(force_begin_blocks, force_end_blocks)
    _check_index_map(index_scale, index_offset)
    if tokens:
        _launch_select(
            device, scores, num_valid_pages, _dummies(device)["carrier"], recv_bases, errors,
            counters, index_scale, index_offset, force_begin_blocks, force_end_blocks,
            heads_per_rank, capacity, _publish_row_offset(slot, world_size, rank, capacity),
            mode, spin_limit,
        )  # fmt: skip


def msa_icp_decode_score_publish(
    index_q, index_k, block_table, seq_lens, num_valid_pages, pool, recv_bases, errors, *,
    rank: int, world_size: int, page_size: int, decode_query_len: int, slot: int,
    capacity: int, force_begin_blocks: int, force_end_blocks: int,
    spin_limit: int = DEFAULT_SPIN_LIMIT, generations=None, enable_pdl: bool = True,
    backend: str = "cake",
):  # fmt: skip
    """The fused decode score and publish: receive rows equal to those of
    msa_icp_decode_index_score_sharded followed by msa_icp_topk_select_publish, without the
    score rows. The list scorer keeps each (token, head) row's 16 best blocks of a run of the
    request's pages (up to four runs, split over CTAs) as it scores them, into pool; the list
    merge ranks a row's lists and publishes the row as the select does.

    pool: contiguous, 16-byte aligned uint8 scratch of at least
    msa_icp_decode_pool_bytes(max_decode_tokens=T) bytes, never zeroed. The other parameters
    are as in those two functions (4 decode_query_len <= 32)."""
    _check_backend(backend)
    _check_int("decode_query_len", decode_query_len, 1)
    if HEADS * decode_query_len > MAX_DECODE_ROWS:
        raise ValueError(
            f"4 x decode_query_len must be <= {MAX_DECODE_ROWS}, got {decode_query_len}"
        )
    device, batch, shard_rows = _check_decode_inputs(
        index_q, index_k, block_table, seq_lens, rank, world_size, page_size, decode_query_len
    )
    tokens = batch * decode_query_len
    mode, counters = _check_publish(
        num_valid_pages, recv_bases, errors, generations, tokens, device, slot=slot, rank=rank,
        world_size=world_size, capacity=capacity, spin_limit=spin_limit,
    )  # fmt: skip
    _check_forced(force_begin_blocks, force_end_blocks)
    # Runs of pages a request's rows are scored in: the score rows' split (columns: the
    # block table's width bounds a request's pages), at most the four lists the merge takes.
    pages = block_table.shape[1]
    splits = min(MAX_LIST_SPLITS, _decode_page_splits(device, batch, pages, shard_rows))
    needed = msa_icp_decode_pool_bytes(max_decode_tokens=tokens) * splits // MAX_LIST_SPLITS
    lists = _pool_lists("pool", pool, needed, splits, tokens, device, "msa_icp_decode_pool_bytes")
    check_writable(
        "pool", pool,
        (("index_q", index_q), ("index_k", index_k), ("block_table", block_table),
         ("seq_lens", seq_lens), ("num_valid_pages", num_valid_pages)),
    )  # fmt: skip
    if tokens:
        scale, offset = _page_columns(page_size, world_size, rank, compact=False)  # block ids
        _launch_list_score(
            device, shard_rows, index_q, index_k, uniform_offsets(batch, decode_query_len, device),
            seq_lens, seq_lens, block_table, num_valid_pages, lists, decode_query_len,
            -decode_query_len, page_size, *_key_layout(page_size, shard_rows, world_size, rank),
            scale, offset, force_begin_blocks, force_end_blocks, splits,
        )  # fmt: skip
        heads_per_rank = HEADS // world_size
        _launch_list_merge(
            device, lists, num_valid_pages, _dummies(device)["carrier"], recv_bases, errors,
            counters, force_begin_blocks, force_end_blocks, heads_per_rank, capacity,
            _publish_row_offset(slot, world_size, rank, capacity), mode, spin_limit,
        )  # fmt: skip


def merge_lists_into_carrier(lists, num_valid_pages, carrier, force_begin: int, force_end: int):
    """The fused prefill's second step alone (tests and self-checks): each (token, head)
    row's top-16 of lists (S <= 4, 4, T, 32) int32 (16 score words, 16 ids a list, -1 for
    an empty entry, no id twice in a row) into carrier [4, T, 33]."""
    if (
        not isinstance(lists, torch.Tensor)
        or lists.dtype != torch.int32
        or lists.dim() != 4
        or not 1 <= lists.shape[0] <= MAX_LIST_SPLITS
        or tuple(lists.shape[1::2]) != (HEADS, LIST_WORDS)
        or not lists.is_contiguous()
    ):
        raise ValueError(
            f"lists must be a contiguous int32 tensor [S <= {MAX_LIST_SPLITS}, {HEADS}, T, "
            f"{LIST_WORDS}], got {describe(lists)}"
        )
    device, tokens = lists.device, lists.shape[2]
    _check_vector("num_valid_pages", num_valid_pages, tokens, torch.int32, device)
    _check_carrier("carrier", carrier, tokens, device)
    _check_forced(force_begin, force_end)
    dummy = _dummies(device)
    _launch_list_merge(
        device, lists, num_valid_pages, carrier, dummy["bases"], dummy["errors"],
        dummy["generations"], force_begin, force_end, HEADS, 0, 0, icp_family.mode("local"), 0,
    )  # fmt: skip


def msa_icp_merge_candidates(
    recv_slot, num_valid_pages, output, errors, *, init_blocks: int, local_blocks: int,
    spin_limit: int = DEFAULT_SPIN_LIMIT, enable_pdl: bool = False, expected_generations=None,
    prefill: bool = False, backend: str = "cake",
):  # fmt: skip
    """Merge every rank's top-16 candidates of the heads this rank owns. Per (token, owned
    head): ids outside [0, min(num_valid_pages, 8192)) are dropped, a duplicate id keeps its
    largest score (NaN counts as -inf), ids < init_blocks or >= num_valid_pages - local_blocks
    rank first, exact ties go to the lower id; the top-16 ids are written ascending with a -1
    tail. A prefill row with num_valid_pages == 0 is written [0, -1, ...]; a decode one all
    -1.

    recv_slot: one slot set of the receive rows, legacy int32 [W, hpr, capacity, 33] (decode:
    waits for each row's ready flag, then clears it; prefill: the exchanged carrier, read as
    it is) or tagged int64 [W, hpr, capacity, 32] (decode, with expected_generations int32
    [hpr, >= T]: waits until every word carries the row's next generation). Unit last stride.
    num_valid_pages: int32 [T]. output: int32 [T, hpr, 16], unit last stride, T <= capacity.
    errors: int32 [>= 1]; a wait of spin_limit polls adds one and traps."""
    _check_backend(backend)
    _check_int("spin_limit", spin_limit, 1)
    if spin_limit >= 2**31:
        raise ValueError(f"spin_limit must be below 2^31, got {spin_limit}")
    _check_int("init_blocks", init_blocks, 0)
    _check_int("local_blocks", local_blocks, 0)
    if init_blocks + local_blocks > TOPK:
        raise ValueError(
            f"init_blocks + local_blocks = {init_blocks + local_blocks} exceeds {TOPK}"
        )
    if not isinstance(recv_slot, torch.Tensor) or recv_slot.dim() != 4:
        raise ValueError(
            "recv_slot must be int32 [W, hpr, capacity, 33] or int64 [W, hpr, capacity, 32], "
            f"got {describe(recv_slot)}"
        )
    device = recv_slot.device
    world, per_rank, capacity, words = recv_slot.shape
    tagged = recv_slot.dtype == torch.int64
    want = (torch.int64, TAGGED_WORDS) if tagged else (torch.int32, CARRIER_WORDS)
    if (
        (recv_slot.dtype, words) != want
        or world not in (2, 4)
        or per_rank != HEADS // world
        or recv_slot.stride(3) != 1
    ):
        raise ValueError(
            "recv_slot must be int32 [W, 4 / W, capacity, 33] or int64 [W, 4 / W, capacity, "
            f"32] with W 2 or 4 and unit last stride, got {describe(recv_slot)}"
        )
    if tagged != (expected_generations is not None):
        raise ValueError(
            "expected_generations must be given exactly for tagged (int64) receive rows, got "
            f"{'tagged' if tagged else 'legacy'} rows and expected_generations "
            f"{describe(expected_generations)}"
        )
    if tagged and prefill:
        raise ValueError("prefill carriers are legacy int32 rows; tagged rows are decode's")
    if not isinstance(output, torch.Tensor) or output.dim() != 3:
        raise ValueError(f"output must be int32 [T, hpr, 16], got {describe(output)}")
    tokens = output.shape[0]
    if tokens > capacity:
        raise ValueError(f"output has {tokens} tokens (T); recv_slot holds {capacity}")
    if (
        output.dtype != torch.int32
        or tuple(output.shape[1:]) != (per_rank, TOPK)
        or output.device != device
        or output.stride(2) != 1
        or output.stride(1) != TOPK
    ):
        raise ValueError(
            f"output must be int32 [T, {per_rank}, {TOPK}] on {device} with rows of 16 "
            f"contiguous ids, got {describe(output)}"
        )
    _check_vector("num_valid_pages", num_valid_pages, tokens, torch.int32, device)
    _check_errors(errors, device)
    rows = recv_slot.view(torch.int32) if tagged else recv_slot
    expected = _dummies(device)["generations"]
    mode = icp_family.mode("read") if prefill else icp_family.mode("wait")
    if tagged:
        _check_counters("expected_generations", expected_generations, (per_rank,), tokens, device)
        expected, mode = expected_generations, icp_family.mode("wait_tagged")
    check_writable(
        "output", output, (("recv_slot", recv_slot), ("num_valid_pages", num_valid_pages))
    )
    if tokens:
        launch = icp_family.launch(
            device.index, "msa_icp_merge", None, init_blocks, local_blocks, mode, int(prefill),
            spin_limit,
        )  # fmt: skip
        with torch.cuda.device(device):
            ops.launch(launch, (rows, num_valid_pages, output, errors, expected))


# ---- the decode receive storage ----------------------------------------------------------


@dataclass
class MSAIcpComm:
    """A rank's decode exchange state: its receive storage (peer-visible; `legacy` int32
    [3, W, hpr, capacity, 33] and `tagged` int64 [3, W, hpr, capacity, 32] views of it, as
    msa_icp_comm_layout lays it out), every rank's row addresses (`legacy_bases`,
    `tagged_bases`: int64 [W] on the device), its own counters (`generations` [3, 4,
    capacity], `expected` [3, hpr, capacity]) and the error counter. Built once per process
    group by from_process_group (PyTorch symmetric memory) or, for W ranks simulated on one
    GPU, by simulated."""

    world_size: int
    rank: int
    capacity: int
    storage: torch.Tensor
    legacy: torch.Tensor
    tagged: torch.Tensor
    legacy_bases: torch.Tensor
    tagged_bases: torch.Tensor
    generations: torch.Tensor
    expected: torch.Tensor
    errors: torch.Tensor

    @property
    def heads_per_rank(self) -> int:
        return HEADS // self.world_size

    @classmethod
    def _from_storage(cls, world_size, rank, capacity, storage, base_addresses):
        layout = msa_icp_comm_layout(world_size, HEADS // world_size, capacity)
        device = storage.device
        legacy_words = math.prod(layout["legacy_shape"])
        legacy = storage[:legacy_words].view(layout["legacy_shape"])
        first = layout["tagged_offset_bytes"] // 4
        tagged = storage[first:].view(torch.int64).view(layout["tagged_shape"])
        bases = torch.tensor(base_addresses, dtype=torch.int64)
        return cls(
            world_size, rank, capacity, storage, legacy, tagged,
            bases.to(device), (bases + layout["tagged_offset_bytes"]).to(device),
            torch.zeros(layout["generations_shape"], dtype=torch.int32, device=device),
            torch.zeros(layout["expected_shape"], dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
        )  # fmt: skip

    @classmethod
    def simulated(cls, world_size: int, capacity: int, device=None) -> list[MSAIcpComm]:
        """W ranks' exchange state on one GPU (tests, single-GPU simulation): each rank's
        receive storage a plain allocation, its address every rank's base."""
        layout = msa_icp_comm_layout(world_size, HEADS // world_size, capacity)
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        storages = [
            torch.zeros(layout["storage_words"], dtype=torch.int32, device=device)
            for _ in range(world_size)
        ]
        addresses = [s.data_ptr() for s in storages]
        return [
            cls._from_storage(world_size, r, capacity, storages[r], addresses)
            for r in range(world_size)
        ]

    @classmethod
    def from_process_group(cls, group, capacity: int, device=None) -> MSAIcpComm:
        """This rank's exchange state for the ranks of a torch.distributed process group (2
        or 4, NCCL, one GPU each; None: the default group): the receive storage in PyTorch
        symmetric memory, whose rendezvous gives every peer's address (collective: every
        rank calls it, once)."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD if group is None else group
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        layout = msa_icp_comm_layout(world_size, HEADS // world_size, capacity)
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        storage = symm_mem.empty(layout["storage_words"], dtype=torch.int32, device=device)
        storage.zero_()
        handle = symm_mem.rendezvous(storage, group.group_name)
        offset = storage.data_ptr() - handle.buffer_ptrs[handle.rank]
        addresses = [ptr + offset for ptr in handle.buffer_ptrs]
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's storage is zero before any publish
        return cls._from_storage(world_size, rank, capacity, storage, addresses)


# ---- the per-layer plan ------------------------------------------------------------------


@dataclass(frozen=True)
class MSAIcpIndexerPlan:
    """One rank's ICP indexer for given serving limits (prepare_msa_icp_indexer): runs one
    layer's chains with caller-owned buffers.

        decode(index_q, index_k, block_table, seq_lens, num_valid_pages, scores, output, *,
               comm, slot, tagged, decode_query_len, enable_pdl=True, pool=None)
            score plane -> top-16 select and publish -> the owner's merge into output
            [T, hpr, 16]; scores: float32 [T, 4, decode_score_columns]. With pool
            (msa_icp_decode_pool_bytes) the fused msa_icp_decode_score_publish replaces the
            first two steps and scores is not used; without one the plane chain runs
            (fused_decode_min_batch is None: the plan never picks the fused path itself)
        prefill_window_plan(qo_segment_lens, kv_segment_lens, qo_segment_offsets,
               kv_segment_offsets, qo_offset, *, total_q, max_query_len, max_seq_len,
               storage=None)
            the scorer's plan of one query window (<= prefill_window_tokens()), in
            storage: int64 of msa_icp_index_score_plan_storage's work_info_numel (None:
            allocated here, so not inside a CUDA-graph capture)
        prefill_local(query, index_k, block_table, window_plan, score_scratch,
               num_valid_pages, carrier, *, compact=False, pool=None)
            score -> local top-16 into carrier [4, T, 33] (then the caller's all-to-all);
            with pool (uint8 of prefill_pool_shape()) the fused
            msa_icp_prefill_score_select, score_scratch not used (fused_prefill is False:
            the fused path runs only when asked for)
        prefill_merge(received, num_valid_pages, output, errors)
            the owner's merge of the exchanged carriers [W, hpr, T, 33]
        warmup()  loads every kernel (call on every rank before the first exchange and
                  before CUDA-graph capture)
    """

    world_size: int
    rank: int
    page_size: int
    init_blocks: int
    local_blocks: int
    max_decode_tokens: int
    max_decode_query_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    num_sparse_layers: int
    device: torch.device
    fused_decode_min_batch: None = None  # decode runs the fused path only when given a pool
    fused_prefill: bool = False  # prefill_local runs the fused path only when given a pool

    @property
    def heads_per_rank(self) -> int:
        return HEADS // self.world_size

    @property
    def decode_score_columns(self) -> int:
        return msa_icp_decode_score_columns(self.max_model_len, self.page_size)

    @property
    def prefill_score_columns(self) -> int:
        return msa_icp_index_score_columns(self.max_model_len, 128)

    def prefill_window_tokens(self) -> int:
        return min(MAX_BLOCKS, self.max_num_batched_tokens)

    def prefill_pool_shape(self) -> tuple:
        """The shape of a uint8 pool for prefill_local's fused path (any window of the plan)."""
        bytes_ = msa_icp_prefill_pool_bytes(
            total_q=self.prefill_window_tokens(), batch=self.max_num_seqs, device=self.device
        )
        return (bytes_,)

    def warmup(self) -> None:
        index = self.device.index
        with torch.cuda.device(self.device):
            for shard_rows in icp_family.shard_rows_built(index):
                icp_family.load(index, "msa_icp_score", shard_rows)
                icp_family.load(index, "msa_icp_list_score", shard_rows)
            for family in ("msa_icp_select", "msa_icp_merge", "msa_icp_list_merge"):
                icp_family.load(index, family, None)

    def decode(
        self, index_q, index_k, block_table, seq_lens, num_valid_pages, scores, output, *,
        comm: MSAIcpComm, slot: int, tagged: bool, decode_query_len: int,
        enable_pdl: bool = True, pool=None,
    ):  # fmt: skip
        if not isinstance(comm, MSAIcpComm) or comm.rank != self.rank:
            raise ValueError(f"comm must be this rank's ({self.rank}) MSAIcpComm, got {comm!r}")
        bases = comm.tagged_bases if tagged else comm.legacy_bases
        generations = comm.generations if tagged else None
        if pool is not None:
            _check_decode_lengths(decode_query_len, self.max_decode_query_len)
            msa_icp_decode_score_publish(
                index_q, index_k, block_table, seq_lens, num_valid_pages, pool, bases,
                comm.errors, rank=self.rank, world_size=self.world_size,
                page_size=self.page_size, decode_query_len=decode_query_len, slot=slot,
                capacity=comm.capacity, force_begin_blocks=self.init_blocks,
                force_end_blocks=self.local_blocks, generations=generations,
            )  # fmt: skip
        else:
            msa_icp_decode_index_score_sharded(
                index_q, index_k, block_table, seq_lens, scores, rank=self.rank,
                world_size=self.world_size, page_size=self.page_size,
                decode_query_len=decode_query_len,
                max_decode_query_len=self.max_decode_query_len,
            )  # fmt: skip
            scale, offset = _column_blocks(self.page_size, self.world_size, self.rank, True)
            msa_icp_topk_select_publish(
                scores, num_valid_pages, bases, comm.errors, slot=slot, rank=self.rank,
                world_size=self.world_size, heads_per_rank=self.heads_per_rank,
                capacity=comm.capacity, force_begin_blocks=self.init_blocks,
                force_end_blocks=self.local_blocks, generations=generations,
                index_scale=scale, index_offset=offset,
            )  # fmt: skip
        rows = comm.tagged[slot] if tagged else comm.legacy[slot]
        msa_icp_merge_candidates(
            rows, num_valid_pages, output, comm.errors, init_blocks=self.init_blocks,
            local_blocks=self.local_blocks,
            expected_generations=comm.expected[slot] if tagged else None,
        )  # fmt: skip

    def prefill_window_plan(
        self, qo_segment_lens, kv_segment_lens, qo_segment_offsets, kv_segment_offsets,
        qo_offset, *, total_q: int, max_query_len: int, max_seq_len: int, storage=None,
    ):  # fmt: skip
        if total_q > self.prefill_window_tokens():
            raise ValueError(
                f"total_q {total_q} exceeds the window of {self.prefill_window_tokens()} tokens"
            )
        batch = qo_segment_lens.shape[0]
        sizes = msa_icp_index_score_plan_storage(
            num_qo_heads=HEADS, total_q=total_q, batch=batch, device=self.device
        )
        if storage is None:
            storage = torch.empty(sizes["work_info_numel"], dtype=torch.int64, device=self.device)
        empty64 = storage[:0]
        return msa_icp_index_score_sharded_plan_device(
            qo_segment_lens, kv_segment_lens, qo_segment_offsets, kv_segment_offsets, qo_offset,
            HEADS, total_q=total_q, max_query_len=max_query_len, max_seq_len=max_seq_len,
            packed_work_range=empty64, packed_work_info=storage,
            workspace=empty64.view(torch.uint8),
        )  # fmt: skip

    def prefill_local(
        self, query, index_k, block_table, window_plan, score_scratch, num_valid_pages,
        carrier, *, compact: bool = False, pool=None,
    ):  # fmt: skip
        if pool is not None:
            msa_icp_prefill_score_select(
                query, index_k, block_table, window_plan, num_valid_pages, pool, carrier,
                rank=self.rank, tp=self.world_size, compact=compact,
                force_begin_blocks=self.init_blocks, force_end_blocks=self.local_blocks,
            )  # fmt: skip
            return
        msa_icp_index_score_sharded(
            query, index_k, block_table, window_plan, rank=self.rank, max_score=score_scratch,
            tp=self.world_size, compact=compact,
        )  # fmt: skip
        scale, offset = _column_blocks(self.page_size, self.world_size, self.rank, compact)
        msa_icp_topk_select_prefill(
            score_scratch, num_valid_pages, carrier, force_begin_blocks=self.init_blocks,
            force_end_blocks=self.local_blocks, index_scale=scale, index_offset=offset,
        )  # fmt: skip

    def prefill_merge(self, received, num_valid_pages, output, errors):
        msa_icp_merge_candidates(
            received, num_valid_pages, output, errors, init_blocks=self.init_blocks,
            local_blocks=self.local_blocks, prefill=True,
        )  # fmt: skip


def prepare_msa_icp_indexer(
    *, world_size: int, rank: int, num_index_heads: int, page_size: int, init_blocks: int,
    local_blocks: int, max_decode_tokens: int, max_decode_query_len: int,
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
    num_sparse_layers: int, device, backend: str = "cake",
) -> MSAIcpIndexerPlan:  # fmt: skip
    """This rank's ICP indexer from the serving limits (MSAIcpIndexerPlan runs the chains)."""
    _check_backend(backend)
    _check_world(world_size)
    _check_rank(rank, world_size)
    _check_heads(num_index_heads)
    _check_page_size(page_size)
    _check_forced(init_blocks, local_blocks, ("init_blocks", "local_blocks"))
    _check_decode_lengths(1, max_decode_query_len)
    for name, value in (
        ("max_decode_tokens", max_decode_tokens),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("max_num_seqs", max_num_seqs),
        ("max_model_len", max_model_len),
        ("num_sparse_layers", num_sparse_layers),
    ):
        _check_int(name, value, 1)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return MSAIcpIndexerPlan(
        world_size, rank, page_size, init_blocks, local_blocks, max_decode_tokens,
        max_decode_query_len, max_num_batched_tokens, max_num_seqs, max_model_len,
        num_sparse_layers, device,
    )  # fmt: skip


# ---- launches and checks -----------------------------------------------------------------


def _launch_score(
    device, shard_rows, q, k, cu_q, seq_lens, q_offset, block_table, out_rows, max_seqlen_q,
    position_shift, page_size, base, step, scale, offset, fill, fill_multiple, page_splits,
):  # fmt: skip
    _check_shard_rows(device, shard_rows)
    launch = icp_family.launch(
        device.index, "msa_icp_score", shard_rows, max_seqlen_q, position_shift, page_size,
        base, step, scale, offset, fill, fill_multiple, page_splits,
    )  # fmt: skip
    with torch.cuda.device(device):
        ops.launch(
            launch, (q.view(-1, 1, HEAD_DIM), k, cu_q, seq_lens, q_offset, block_table, out_rows)
        )


def _launch_list_score(
    device, shard_rows, q, k, cu_q, seq_lens, q_offset, block_table, num_valid, lists,
    max_seqlen_q, position_shift, page_size, base, step, id_scale, id_offset, force_begin,
    force_end, page_splits,
):  # fmt: skip
    _check_shard_rows(device, shard_rows)
    launch = icp_family.launch(
        device.index, "msa_icp_list_score", shard_rows, max_seqlen_q, position_shift, page_size,
        base, step, id_scale, id_offset, force_begin, force_end, page_splits,
    )  # fmt: skip
    with torch.cuda.device(device):
        ops.launch(
            launch,
            (q.view(-1, 1, HEAD_DIM), k, cu_q, seq_lens, q_offset, block_table, num_valid, lists),
        )


def _check_shard_rows(device, shard_rows: int) -> None:
    """Both scorers are built for the same shard rows a page (the family's constant)."""
    if shard_rows not in icp_family.shard_rows_built(device.index):
        raise ValueError(
            f"the ICP scorer is not built for {shard_rows} shard rows a page; built: "
            f"{icp_family.shard_rows_built(device.index)}"
        )


def _launch_list_merge(
    device, lists, num_valid, carrier, bases, errors, generations, force_begin, force_end,
    heads_per_owner, head_rows, row_offset, mode, spin_limit,
):  # fmt: skip
    launch = icp_family.launch(
        device.index, "msa_icp_list_merge", None, force_begin, force_end, heads_per_owner,
        head_rows, row_offset, mode, spin_limit,
    )  # fmt: skip
    with torch.cuda.device(device):
        ops.launch(launch, (lists, num_valid, carrier, bases, errors, generations))


def _launch_select(
    device, scores, num_valid, carrier, bases, errors, generations, index_scale, index_offset,
    force_begin, force_end, heads_per_owner, head_rows, row_offset, mode, spin_limit,
):  # fmt: skip
    launch = icp_family.launch(
        device.index, "msa_icp_select", None, index_scale, index_offset, force_begin,
        force_end, heads_per_owner, head_rows, row_offset, mode, spin_limit,
    )  # fmt: skip
    with torch.cuda.device(device):
        ops.launch(launch, (scores, num_valid, carrier, bases, errors, generations))


# A decode batch has one row tile a request (4 x decode_query_len <= 32 rows): its pages are
# split over CTAs so that the launch fills one wave at the sm_90a scorer's CTAs an SM (three
# with 32 rows a page, else two), each run at least MIN_SPLIT_PAGES pages of the longest
# context. Measured on the H200 against ceil(2 SMs / requests) and other counts
# (bench/results/2026-12-05_a01319b_h200_icp_first_run.md): a second, partial wave costs more
# than the longer runs of one.
MIN_SPLIT_PAGES = 8


def _decode_page_splits(device: torch.device, requests: int, columns: int, shard_rows: int) -> int:
    """CTAs a decode request's pages are split over (columns: the score plane's, at least
    the longest request's pages)."""
    per_sm = 3 if shard_rows == 32 else 2
    wanted = max(1, per_sm * multiprocessors(device.index) // requests)
    return max(1, min(wanted, columns // MIN_SPLIT_PAGES))


@functools.lru_cache(maxsize=16)
def _dummies(device: torch.device) -> dict:
    """Stand-ins for the tensors a launch's mode does not read (kept per device: a call
    allocates nothing)."""
    return {
        "bases": torch.zeros(1, dtype=torch.int64, device=device),
        "errors": torch.zeros(1, dtype=torch.int32, device=device),
        "generations": torch.zeros(1, 1, dtype=torch.int32, device=device),
        "carrier": torch.zeros(1, 1, CARRIER_WORDS, dtype=torch.int32, device=device),
    }


def _key_layout(page_size: int, shard_rows: int, world_size: int, rank: int) -> tuple:
    """(key_base, key_step): local row i of page c holds key page_size c + base + i step."""
    return (rank, world_size) if page_size == 128 else (rank * shard_rows, 1)


def _page_columns(page_size: int, world_size: int, rank: int, compact: bool) -> tuple:
    """(scale, offset): the scorer writes local page c's maxima to column c scale + offset
    (its global block id, or with compact P256 scores the page itself)."""
    if page_size == 256 and not compact:
        return 2, 2 * rank // world_size
    return 1, 0


def _column_blocks(page_size: int, world_size: int, rank: int, compact: bool) -> tuple:
    """(index_scale, index_offset): score column c is global block c scale + offset (compact
    P256 columns are local pages, block 2 c + 2 rank // W)."""
    if page_size == 256 and compact:
        return 2, 2 * rank // world_size
    return 1, 0


def _publish_row_offset(slot: int, world_size: int, rank: int, capacity: int) -> int:
    """The first receive row a rank's publish of slot set `slot` writes at an owner: row
    ((slot W + rank) hpr + h % hpr) capacity + t holds (t, h), so the rows of head h % hpr
    start head_rows = capacity later each."""
    return (slot * world_size + rank) * (HEADS // world_size) * capacity


def _check_prefill_inputs(q, k, block_table, plan, rank, tp) -> tuple:
    """(device, page size, shard rows a page) of a prefill scorer call's inputs."""
    _check_world(tp, "tp")
    _check_rank(rank, tp)
    if not isinstance(plan, MSAIcpScorePlan):
        raise TypeError(
            f"plan must come from msa_icp_index_score_sharded_plan(_device), got {plan!r}"
        )
    device = _check_queries("q", q, plan.total_q)
    page_size, shard_rows = _check_shard("k", k, tp, device)
    _check_table("block_table", block_table, plan.batch, device)
    return device, page_size, shard_rows


def _check_decode_inputs(
    index_q, index_k, block_table, seq_lens, rank, world_size, page_size, decode_query_len
) -> tuple:
    """(device, batch, shard rows a page) of a decode scorer call's inputs."""
    _check_world(world_size)
    _check_rank(rank, world_size)
    _check_page_size(page_size)
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be an int32 tensor [B], got {describe(seq_lens)}")
    batch = seq_lens.shape[0]
    device = _check_queries("index_q", index_q, batch * decode_query_len)
    _check_vector("seq_lens", seq_lens, batch, torch.int32, device)
    shard_page, shard_rows = _check_shard("index_k", index_k, world_size, device)
    if shard_page != page_size:
        raise ValueError(
            f"index_k has {shard_rows} rows a page: page_size {shard_page} over {world_size} "
            f"ranks, not page_size {page_size}"
        )
    _check_table("block_table", block_table, batch, device)
    return device, batch, shard_rows


def _check_publish(
    num_valid_pages, recv_bases, errors, generations, tokens: int, device, *, slot: int,
    rank: int, world_size: int, capacity: int, spin_limit: int,
) -> tuple:  # fmt: skip
    """(the select's mode, the generation counters it keeps) of a publish of `tokens` rows."""
    _check_rank(rank, world_size)
    _check_int("capacity", capacity, 1)
    _check_int("slot", slot, 0)
    if slot >= SLOT_SETS:
        raise ValueError(f"slot must be in [0, {SLOT_SETS}), got {slot}")
    _check_int("spin_limit", spin_limit, 1)
    if spin_limit >= 2**31:
        raise ValueError(f"spin_limit must be below 2^31, got {spin_limit}")
    if tokens > capacity:
        raise ValueError(f"{tokens} tokens (T) to publish; the receive rows hold {capacity}")
    _check_vector("num_valid_pages", num_valid_pages, tokens, torch.int32, device)
    _check_vector("recv_bases", recv_bases, world_size, torch.int64, device)
    _check_errors(errors, device)
    if generations is None:
        return icp_family.mode("publish"), _dummies(device)["generations"]
    _check_counters("generations", generations, (SLOT_SETS, HEADS), tokens, device)
    return icp_family.mode("publish_tagged"), generations[slot]


def _pool_lists(name, pool, needed: int, splits: int, tokens: int, device, sizer: str):
    """The (splits, 4, T, 32) int32 lists in the first `needed` bytes of a fused path's pool."""
    _check_storage(name, pool, torch.uint8, needed, device, sizer)
    if pool.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned")
    return pool[:needed].view(torch.int32).view(splits, HEADS, tokens, LIST_WORDS)


def _check_storage(name, t, dtype, numel: int, device, sizer: str) -> None:
    """Caller storage: a contiguous tensor of dtype on device, at least numel elements (as
    the function `sizer` says)."""
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != dtype
        or t.device != device
        or not t.is_contiguous()
        or t.numel() < numel
    ):
        raise ValueError(
            f"{name} must be a contiguous {dtype} tensor of at least {numel} elements on "
            f"{device} ({sizer}), got {describe(t)}"
        )


def _check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_world(world_size, name: str = "world_size") -> None:
    if world_size not in (2, 4) or isinstance(world_size, bool):
        raise ValueError(f"{name} must be 2 or 4, got {world_size!r}")


def _check_rank(rank, world_size: int) -> None:
    _check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


def _check_heads(num_heads) -> None:
    if num_heads != HEADS or isinstance(num_heads, bool):
        raise ValueError(f"the ICP indexer has {HEADS} index heads; got {num_heads!r}")


def _check_page_size(page_size) -> None:
    if page_size not in (128, 256) or isinstance(page_size, bool):
        raise ValueError(f"page_size must be 128 or 256, got {page_size!r}")


def _check_decode_lengths(decode_query_len, max_decode_query_len) -> None:
    _check_int("max_decode_query_len", max_decode_query_len, 1)
    if HEADS * max_decode_query_len > MAX_DECODE_ROWS:
        raise ValueError(
            f"4 x max_decode_query_len must be <= {MAX_DECODE_ROWS}, got max_decode_query_len "
            f"{max_decode_query_len}"
        )
    _check_int("decode_query_len", decode_query_len, 1)
    if decode_query_len > max_decode_query_len:
        raise ValueError(
            f"decode_query_len {decode_query_len} exceeds max_decode_query_len "
            f"{max_decode_query_len}"
        )


def _check_forced(begin, end, names=("force_begin_blocks", "force_end_blocks")) -> None:
    _check_int(names[0], begin, 0)
    _check_int(names[1], end, 0)
    if begin + end > TOPK:
        raise ValueError(f"{names[0]} + {names[1]} = {begin + end} exceeds {TOPK}")


def _check_index_map(scale, offset) -> None:
    if (scale, offset) not in ((1, 0), (2, 0), (2, 1)):
        raise ValueError(
            "index_scale, index_offset must be (1, 0) (P128) or (2, 2 rank // tp) (compact "
            f"P256), got ({scale!r}, {offset!r})"
        )


def _check_vector(name, t, length: int, dtype, device) -> None:
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != dtype
        or tuple(t.shape) != (length,)
        or (device is not None and t.device != device)
        or not t.is_contiguous()
    ):
        where = f" on {device}" if device is not None else ""
        raise ValueError(
            f"{name} must be a contiguous {dtype} tensor [{length}]{where}, got {describe(t)}"
        )


def _check_errors(errors, device) -> None:
    if (
        not isinstance(errors, torch.Tensor)
        or errors.dtype != torch.int32
        or errors.dim() != 1
        or errors.numel() < 1
        or errors.device != device
        or not errors.is_contiguous()
    ):
        raise ValueError(
            f"errors must be a contiguous int32 tensor [>= 1] on {device}, got {describe(errors)}"
        )


def _check_counters(name, t, leading: tuple, tokens: int, device) -> None:
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != torch.int32
        or tuple(t.shape[:-1]) != leading
        or t.shape[-1] < tokens
        or t.device != device
        or t.stride(-1) != 1
    ):
        shape = ", ".join(map(str, (*leading, f">= {tokens}")))
        raise ValueError(
            f"{name} must be an int32 tensor [{shape}] on {device} with unit last stride, "
            f"got {describe(t)}"
        )


def _check_queries(name, q, tokens: int) -> torch.device:
    if (
        not isinstance(q, torch.Tensor)
        or q.dtype != torch.float8_e4m3fn
        or tuple(q.shape) != (tokens, HEADS, HEAD_DIM)
        or not q.is_contiguous()
    ):
        raise ValueError(
            f"{name} must be a contiguous float8_e4m3fn tensor [{tokens}, {HEADS}, {HEAD_DIM}], "
            f"got {describe(q)}"
        )
    if q.device.type != "cuda":
        raise ValueError(f"{name} is on {q.device}; the ICP indexer needs a CUDA device")
    if q.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned")
    return q.device


def _check_shard(name, k, world_size: int, device) -> tuple:
    """(page size, rows a page) of a rank's shard [pages, P / W, 128]."""
    if not isinstance(k, torch.Tensor) or k.dtype != torch.float8_e4m3fn or k.dim() != 3:
        raise ValueError(
            f"{name} must be a float8_e4m3fn tensor [pages, P / W, 128], got {describe(k)}"
        )
    pages, rows, dim = k.shape
    page_size = rows * world_size
    if dim != HEAD_DIM or page_size not in (128, 256):
        raise ValueError(
            f"{name} must be [pages, P / {world_size}, {HEAD_DIM}] with P 128 or 256, got "
            f"{describe(k)}"
        )
    if k.device != device:
        raise ValueError(f"{name} is on {k.device}, the queries on {device}")
    if k.stride(2) != 1 or k.stride(1) != HEAD_DIM or k.stride(0) % 16 or k.data_ptr() % 16:
        raise ValueError(
            f"{name} must hold dense rows of {HEAD_DIM} bytes, a page pitch a multiple of 16 "
            f"bytes and a 16-byte aligned start, got {describe(k)}"
        )
    if pages >= 2**31:
        raise ValueError(f"{name} has {pages} pages; fewer than 2^31 are supported")
    return page_size, rows


def _check_table(name, table, batch: int, device) -> None:
    if (
        not isinstance(table, torch.Tensor)
        or table.dtype != torch.int32
        or table.dim() != 2
        or table.shape[0] != batch
        or table.shape[1] < 1
        or table.stride(1) != 1
        or table.device != device
    ):
        raise ValueError(
            f"{name} must be an int32 tensor [{batch}, >= 1] on {device} with unit last "
            f"stride, got {describe(table)}"
        )


def _score_rows(name, scores, tokens: int, columns: int, device) -> torch.Tensor:
    """The (4 T, K) view of scores [T, 4, K] the scorer writes (rows 4 t + h)."""
    if (
        not isinstance(scores, torch.Tensor)
        or scores.dtype != torch.float32
        or scores.dim() != 3
        or tuple(scores.shape[:2]) != (tokens, HEADS)
        or scores.shape[2] < columns
        or scores.device != device
    ):
        raise ValueError(
            f"{name} must be float32 [{tokens}, {HEADS}, >= {columns}] on {device}, got "
            f"{describe(scores)}"
        )
    if scores.stride(2) != 1 or (tokens > 1 and scores.stride(0) != HEADS * scores.stride(1)):
        raise ValueError(
            f"{name} must have a unit last stride and a token stride of four head strides (rows "
            f"4 t + h at one pitch), got {describe(scores)}"
        )
    return scores.as_strided((tokens * HEADS, scores.shape[2]), (scores.stride(1), 1))


def _check_scores(name, scores) -> tuple:
    if not isinstance(scores, torch.Tensor) or scores.dtype != torch.float32 or scores.dim() != 3:
        raise ValueError(f"{name} must be float32 [T, 4, K], got {describe(scores)}")
    tokens, heads, columns = scores.shape
    if heads != HEADS or not 0 < columns < MAX_COLUMNS or scores.stride(2) != 1:
        raise ValueError(
            f"{name} must be float32 [T, {HEADS}, K] with 0 < K < {MAX_COLUMNS} and unit last "
            f"stride, got {describe(scores)}"
        )
    if scores.device.type != "cuda":
        raise ValueError(f"{name} is on {scores.device}; the ICP indexer needs a CUDA device")
    return tokens, scores.device


def _check_carrier(name, carrier, tokens: int, device) -> None:
    if (
        not isinstance(carrier, torch.Tensor)
        or carrier.dtype != torch.int32
        or carrier.dim() != 3
        or tuple(carrier.shape) != (HEADS, tokens, CARRIER_WORDS)
        or carrier.stride(2) != 1
        or carrier.stride(1) != CARRIER_WORDS
        or carrier.device != device
    ):
        raise ValueError(
            f"{name} must be int32 [{HEADS}, {tokens}, {CARRIER_WORDS}] on {device} with rows of "
            f"{CARRIER_WORDS} contiguous words, got {describe(carrier)}"
        )
