"""The PyTorch reference of the MiniMax-M3 index-context-parallel (ICP) indexer: the contract
the per-rank kernels will be checked against, on any device.

The index keys of a context are sharded over W ranks (W = 2 or 4) by one of three layouts; every
rank scores the queries of all four index heads against its shard, keeps a local top-16 per
(token, head) in a carrier row, the rows go to the rank that owns the head (an all-to-all in
prefill, a publish in decode), and the owner merges them into the exact top-16 of the blocks'
global maxima (`global_top16`). This module computes each step from per-key scores computed
once (float64 products rounded to fp32), so that shards and the unsharded problem see the same
numbers and the merge can be compared id for id.

    shard_keys(num_keys, world_size, rank, page_size)   the global keys a rank holds
    rank_scores(key_scores, ...)                         a rank's per-block maxima (its columns)
    local_top16(scores, block_ids, ...)                  carrier rows (T, 4, 33)
    all_to_all(carriers)                                 rows by owner rank (prefill)
    publish / collect                                    the same through receive rows (decode)
    merge(received, ...)                                 the owner's top-16 (T, heads / rank, 16)
    global_top16(key_scores, ...)                        what the merge must reproduce
    top16_of_maxima(maxima, nvp, ...)                    the same from given block maxima
    tag_rows / untag_rows                                generation-tagged rows (decode)

Choices where the contract is silent (kept consistent with msa_topk_select): a block whose
score is -inf (no visible key, or only NaN scores) is never selected, forced or not; forced
blocks rank first, in ascending id order.
"""

from __future__ import annotations

import math

import torch

HEADS = 4  # index heads (version 1 of the contract)
BLOCK = 128  # keys per scored block (B128)
TOPK = 16
MAX_BLOCKS = 8192  # candidates are blocks < min(nvp, MAX_BLOCKS)
CARRIER_WORDS = 2 * TOPK + 1  # 16 score words, 16 ascending ids, a ready flag


def shard_keys(num_keys: int, world_size: int, rank: int, page_size: int) -> torch.Tensor:
    """(pages, page_size / world_size) int64: the global key index of each local row of each
    local page of `rank` (keys past num_keys included: the caller masks them as invisible).

    P128: local row i of page c is key 128 c + i W + r (rows interleaved over the ranks).
    P256, W = 2: page c holds keys 256 c + 128 r + [0, 128), the whole block 2 c + r.
    P256, W = 4: page c holds 64 keys from 256 c + 64 r: half of block 2 c + r // 2.
    """
    if world_size not in (2, 4):
        raise ValueError(f"world_size must be 2 or 4, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if page_size not in (128, 256):
        raise ValueError(f"page_size must be 128 or 256, got {page_size}")
    pages = -(-num_keys // page_size)
    rows = page_size // world_size
    page = torch.arange(pages)[:, None]
    row = torch.arange(rows)[None, :]
    if page_size == 128:
        return page_size * page + row * world_size + rank
    return page_size * page + rows * rank + row


def block_ids(num_keys: int, world_size: int, rank: int, page_size: int) -> torch.Tensor:
    """(columns,) int64: the global block id of each of a rank's score columns. P128 scores
    every global block (a rank holds rows of each); compact P256 scores its local pages,
    page c being block 2 c + 2 r // W."""
    pages = -(-num_keys // page_size)
    if page_size == 128:
        return torch.arange(pages)
    return 2 * torch.arange(pages) + 2 * rank // world_size


def key_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(T, HEADS, L) fp32 q . k of every query head and key (float64 products and sums,
    rounded once): q (T, HEADS, D), k (L, D), e.g. e4m3 values."""
    return torch.einsum("thd,ld->thl", q.double(), k.double()).float()


def _visible(positions: torch.Tensor, keys: torch.Tensor, num_keys: int) -> torch.Tensor:
    """(T, ...) bool: key index `keys` exists and lies at or before the token's position."""
    return (keys < num_keys) & (keys <= positions.reshape(-1, *([1] * keys.dim())))


def _block_max(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Max over the last dim of the visible scores; NaN ignored, -inf where none is left,
    -0 written as +0."""
    keep = visible & ~scores.isnan()
    best = scores.masked_fill(~keep, -math.inf).amax(-1)
    return best + 0.0  # -0 + 0 = +0


def rank_scores(
    scores: torch.Tensor, positions: torch.Tensor, world_size: int, rank: int, page_size: int
) -> torch.Tensor:
    """(T, HEADS, columns) fp32: a rank's raw score maxima per B128 block over its visible
    keys (key_scores of all keys, sliced by the rank's shard; block_ids names the columns)."""
    num_keys = scores.shape[-1]
    keys = shard_keys(num_keys, world_size, rank, page_size)  # (pages, rows): a column a page
    gathered = scores[..., keys.clamp(max=num_keys - 1)]  # (T, H, columns, rows)
    return _block_max(gathered, _visible(positions, keys, num_keys)[:, None])


def global_block_max(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(T, HEADS, blocks) fp32: the unsharded maxima per B128 block."""
    num_keys = scores.shape[-1]
    blocks = -(-num_keys // BLOCK)
    keys = torch.arange(blocks * BLOCK).reshape(blocks, BLOCK)
    gathered = scores[..., keys.clamp(max=num_keys - 1)]
    return _block_max(gathered, _visible(positions, keys, num_keys)[:, None])


def _rank16(scores, ids, nvp, force_begin, force_end, max_blocks):
    """The top-16 of candidates (T, H, N) with scores and global ids: ids in
    [0, min(nvp, max_blocks)) with a score above -inf (NaN counts as -inf); the forced ones
    ([0, fb) and [nvp - fe, nvp)) first, then by score descending, ties to the lower id.
    Returns (ids, scores) (T, H, 16), ascending ids, padded with (-1, -inf)."""
    scores = scores.masked_fill(scores.isnan(), -math.inf)
    lim = nvp.long().clamp(min=0, max=max_blocks)[:, None, None]
    usable = (ids >= 0) & (ids < lim) & (scores > -math.inf)
    end_start = (nvp.long()[:, None, None] - force_end).clamp(min=0)
    in_end = (ids >= end_start) & (ids < nvp.long()[:, None, None])
    forced = usable & ((ids < force_begin) | in_end)
    # Forced first, then score descending, then id ascending: stable sorts by the id, then
    # the score, then the forced flag (unusable candidates last, masked below).
    order = ids.masked_fill(~usable, torch.iinfo(torch.int64).max).argsort(dim=-1, stable=True)
    for key in (scores.masked_fill(~usable, -math.inf), forced.to(torch.int8)):
        order = order.gather(
            -1, key.gather(-1, order).argsort(dim=-1, descending=True, stable=True)
        )
    top = order[..., :TOPK]
    chosen = usable.gather(-1, top)
    out_ids = torch.where(chosen, ids.gather(-1, top), -1)
    out_scores = torch.where(chosen, scores.gather(-1, top), -math.inf)
    if out_ids.shape[-1] < TOPK:
        pad = TOPK - out_ids.shape[-1]
        out_ids = torch.nn.functional.pad(out_ids, (0, pad), value=-1)
        out_scores = torch.nn.functional.pad(out_scores, (0, pad), value=-math.inf)
    # Ascending ids, -1 (unused) last.
    asc = torch.where(out_ids >= 0, out_ids, torch.iinfo(torch.int64).max).argsort(-1)
    return out_ids.gather(-1, asc), out_scores.gather(-1, asc)


def local_top16(
    scores: torch.Tensor,
    ids: torch.Tensor,
    nvp: torch.Tensor,
    force_begin: int = 0,
    force_end: int = 0,
    max_blocks: int = MAX_BLOCKS,
) -> torch.Tensor:
    """(T, HEADS, 33) int32 carrier rows of one rank: its top-16 blocks among its columns
    (`scores` (T, HEADS, columns), `ids` their global block ids) below min(nvp, max_blocks):
    16 score words (fp32 bits), 16 ascending ids (unused: (-inf, -1)), ready flag 1."""
    t, h, n = scores.shape
    top_ids, top_scores = _rank16(
        scores, ids.expand(t, h, n), nvp, force_begin, force_end, max_blocks
    )
    rows = torch.empty(t, h, CARRIER_WORDS, dtype=torch.int32)
    rows[..., :TOPK] = top_scores.float().view(torch.int32)
    rows[..., TOPK : 2 * TOPK] = top_ids.to(torch.int32)
    rows[..., -1] = 1
    return rows


def lists_top16(
    lists: torch.Tensor, nvp: torch.Tensor, force_begin: int = 0, force_end: int = 0
) -> torch.Tensor:
    """(HEADS, T, 33) carrier rows from the fused paths' lists (S, HEADS, T, 32) int32 (16
    score words, 16 ids a list; id -1 for an empty entry): each row's top-16 among its S
    lists' entries, ranked as local_top16 ranks."""
    splits, heads, t, _ = lists.shape
    rows = lists.permute(2, 1, 0, 3)  # (T, HEADS, S, 32)
    scores = rows[..., :TOPK].contiguous().view(torch.float32).reshape(t, heads, -1)
    ids = rows[..., TOPK:].reshape(t, heads, -1).long()
    return local_top16(scores, ids, nvp, force_begin, force_end).transpose(0, 1)


def all_to_all(carriers: list[torch.Tensor]) -> list[torch.Tensor]:
    """The prefill exchange: rank r's rows (T, HEADS, 33) go to the owner of each head (rank
    h // (HEADS / W)); returns each owner's receive buffer (W, HEADS / W, T, 33), indexed by
    source rank."""
    world = len(carriers)
    per_rank = HEADS // world
    return [
        torch.stack(
            [c[:, owner * per_rank : (owner + 1) * per_rank].transpose(0, 1) for c in carriers]
        )
        for owner in range(world)
    ]


SLOT_SETS = 3  # decode receive rows: three slot sets, used in turn


def receive_rows(world_size: int, cap: int) -> torch.Tensor:
    """An owner's zeroed decode receive storage: (SLOT_SETS * W * HEADS / W * cap, 33) int32
    carrier rows, `cap` tokens per (slot set, source rank, owned head)."""
    return torch.zeros(SLOT_SETS * HEADS * cap, CARRIER_WORDS, dtype=torch.int32)


def publish(rows: torch.Tensor, receive: list[torch.Tensor], rank: int, slot: int) -> None:
    """Decode: rank `rank`'s carrier rows (T, HEADS, 33) written into the owners' receive
    storage, row (t, h) at owner h // hpr, row ((slot W + rank) hpr + h % hpr) cap + t."""
    world = len(receive)
    per_rank = HEADS // world
    cap = receive[0].shape[0] // (SLOT_SETS * HEADS)
    if not 0 <= slot < SLOT_SETS:
        raise ValueError(f"slot must be in [0, {SLOT_SETS}), got {slot}")
    if rows.shape[0] > cap:
        raise ValueError(f"{rows.shape[0]} tokens do not fit {cap} receive rows")
    for h in range(HEADS):
        first = ((slot * world + rank) * per_rank + h % per_rank) * cap
        receive[h // per_rank][first : first + rows.shape[0]] = rows[:, h]


def collect(receive: torch.Tensor, world_size: int, slot: int, tokens: int) -> torch.Tensor:
    """Decode, at an owner: its receive rows of slot set `slot` as merge's input (W, HEADS / W,
    T, 33), every row's ready flag checked and then cleared (ValueError for a row never
    published: the kernels count it as an error after a timeout)."""
    per_rank = HEADS // world_size
    cap = receive.shape[0] // (SLOT_SETS * HEADS)
    view = receive.view(SLOT_SETS, world_size, per_rank, cap, CARRIER_WORDS)[slot, :, :, :tokens]
    if not bool((view[..., -1] == 1).all()):
        raise ValueError(f"a receive row of slot set {slot} was not published")
    rows = view.clone()
    view[..., -1] = 0
    return rows


def merge(
    received: torch.Tensor,
    nvp: torch.Tensor,
    force_begin: int = 0,
    force_end: int = 0,
    max_blocks: int = MAX_BLOCKS,
    prefill: bool = True,
) -> torch.Tensor:
    """(T, HEADS / W, 16) int32: an owner's top-16 per (token, owned head) from every rank's
    carrier rows (`received` (W, HEADS / W, T, 33), rows or untag_rows of tagged ones). Ids
    outside [0, min(nvp, max_blocks)) are dropped, a duplicate id keeps its max score, the
    ranking is local_top16's; ascending, -1 tail. A prefill row with nvp = 0 gives
    [0, -1, ...]."""
    world, per_rank, t, _ = received.shape
    words = received.permute(2, 1, 0, 3)  # (T, heads, W, 33)
    scores = words[..., :TOPK].contiguous().view(torch.float32).reshape(t, per_rank, -1)
    ids = words[..., TOPK : 2 * TOPK].reshape(t, per_rank, -1).long()
    scores = scores.masked_fill(scores.isnan(), -math.inf)  # NaN counts as -inf
    # Duplicates keep their max: sort by (id, score descending) and keep the first of each id.
    by_score = scores.argsort(dim=-1, descending=True, stable=True)
    ids_s, scores_s = ids.gather(-1, by_score), scores.gather(-1, by_score)
    by_id = ids_s.argsort(dim=-1, stable=True)
    ids_s, scores_s = ids_s.gather(-1, by_id), scores_s.gather(-1, by_id)
    first = torch.ones_like(ids_s, dtype=torch.bool)
    first[..., 1:] = ids_s[..., 1:] != ids_s[..., :-1]
    ids_s = ids_s.masked_fill(~first, -1)
    out, _ = _rank16(scores_s, ids_s, nvp, force_begin, force_end, max_blocks)
    out = out.to(torch.int32)
    if prefill:
        empty = nvp.long() <= 0
        out[empty] = -1
        out[empty, :, 0] = 0
    return out


def global_top16(
    scores: torch.Tensor,
    positions: torch.Tensor,
    nvp: torch.Tensor,
    force_begin: int = 0,
    force_end: int = 0,
    max_blocks: int = MAX_BLOCKS,
) -> torch.Tensor:
    """(T, HEADS, 16) int32: the single-GPU top-16 of the global block maxima, ranked as
    local_top16 ranks, ascending, -1 tail; what the ICP merge reproduces."""
    return top16_of_maxima(
        global_block_max(scores, positions), nvp, force_begin, force_end, max_blocks
    )


def top16_of_maxima(
    maxima: torch.Tensor,
    nvp: torch.Tensor,
    force_begin: int = 0,
    force_end: int = 0,
    max_blocks: int = MAX_BLOCKS,
) -> torch.Tensor:
    """(T, HEADS, 16) int32: the top-16 of block maxima (T, HEADS, blocks), column = block id,
    ranked as local_top16 ranks; ascending, -1 tail."""
    t, h, n = maxima.shape
    ids = torch.arange(n).expand(t, h, n)
    out, _ = _rank16(maxima, ids, nvp, force_begin, force_end, max_blocks)
    return out.to(torch.int32)


def tag_rows(rows: torch.Tensor, generation: int) -> torch.Tensor:
    """Generation-tagged rows: each of a carrier row's 32 words (no ready flag) as the int64
    generation << 32 | word (the word's 32 bits)."""
    words = rows[..., : 2 * TOPK].long() & 0xFFFFFFFF
    return (generation << 32) | words


def untag_rows(tagged: torch.Tensor, generation: int) -> torch.Tensor:
    """Carrier rows from tagged ones, with the ready flag set where every word carries
    `generation` (0 where a word is stale)."""
    words = (tagged & 0xFFFFFFFF).to(torch.int64)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    ready = ((tagged >> 32) == generation).all(-1, keepdim=True).to(torch.int32)
    return torch.cat([words, ready], dim=-1)
