"""The SDSA (simplified DSA) indexer, call-compatible with `flashinfer.sdsa`: one index head,
FP32 q.k scores over 64-key pages of 128-dim keys, BF16 or NVFP4 (one e4m3 scale per 16
values, no global scale).

    quantize_write_index_qk_nvfp4   keys into a paged NVFP4 key cache and queries into NVFP4
                                    rows, one launch
    indexer_scores                  FP32 q . k of groups of query rows over their request's
                                    paged keys
    gather_key_sample               strided samples of each request's keys as dense rows
    thresholds_from_sample          each row's threshold from its sample's top scores
    indexer_threshold_select        each row's keys above / at its threshold into its slots,
                                    in one pass over its keys (no score matrix)
    top_k_from_candidates           each row's exact top-K keys from its candidate slots

Each is one launch on the current stream (the threshold select's repair mode: two), no host
synchronisation (CUDA-graph capturable);
index values (slots, page ids, offsets, positions) are not checked on the GPU, which would
need a host synchronisation. Kernels: generator/kernels/portable/sdsa_*.py (every arch;
scores, select and repair on tensor cores (mma.sync), each computing a score with the same
bits). PyTorch references of the whole indexer (repair mode included):
sparseforge.reference.
"""

from __future__ import annotations

import math

import torch

from sparseforge import ops
from sparseforge.checks import check_writable, describe, positive_int
from sparseforge.dtypes import NAME_OF
from sparseforge.families import sdsa as sdsa_family


def quantize_write_index_qk_nvfp4(
    key, slots, query, query_rows, *, key_cache, key_scales, packed_query, query_scales
):
    """Quantize key (T, 128) bf16 / fp16 to NVFP4 into key_cache (pages, 64, 64) uint8 and
    key_scales (pages, 64, 8) (uint8 or float8_e4m3fn) at slots (int64 (T,): page s // 64,
    row s % 64), and query (Q, 128) (key's dtype) into packed_query (R, 64) uint8 and
    query_scales (R, 8) at query_rows (int64 (Q,)); negative slots and rows are skipped. One
    launch, no host synchronisation. Rounding: scale = e4m3(amax / 6) to nearest even
    (saturating at 448), each value the nearest E2M1 with ties to the even code (|x| beyond
    2688 saturates), 0 where the scale is 0; bit for bit reference.quantize_write_index_qk_nvfp4.
    The cache's pages may be strided (data: a page stride that is a multiple of 16 bytes,
    scales: of 8, so both can be views of one allocation); rows are contiguous. Slot and row
    values are not checked on the GPU (that would need a host synchronisation): one past the
    cache writes out of bounds."""
    dim = sdsa_family.constant("key_dim")
    page = sdsa_family.constant("page_keys")
    for name, x in (("key", key), ("query", query)):
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{name} must be a bf16 or fp16 tensor, got {describe(x)}")
        if x.dim() != 2 or x.shape[1] != dim or x.stride(1) != 1:
            raise ValueError(
                f"{name} must be (rows, {dim}) with unit stride on the last dim, got {describe(x)}"
            )
    if query.dtype != key.dtype:
        raise ValueError(f"query must have key's dtype {key.dtype}, got {query.dtype}")
    device = key.device
    _tensor("slots", slots, torch.int64, (key.shape[0],), device)
    _tensor("query_rows", query_rows, torch.int64, (query.shape[0],), device)
    key_scales = _bytes("key_scales", key_scales, (None, page, dim // 16), 8, device)
    key_cache = _bytes("key_cache", key_cache, (key_scales.shape[0], page, dim // 2), 16, device)
    query_scales = _bytes("query_scales", query_scales, (None, dim // 16), 8, device)
    packed_query = _bytes(
        "packed_query", packed_query, (query_scales.shape[0], dim // 2), 16, device
    )
    if query.device != device:
        raise ValueError(f"query is on {query.device}, key on {device}")
    inputs = (("key", key), ("slots", slots), ("query", query), ("query_rows", query_rows))
    outputs = (
        ("key_cache", key_cache),
        ("key_scales", key_scales),
        ("packed_query", packed_query),
        ("query_scales", query_scales),
    )
    for name, t in outputs:
        check_writable(name, t, inputs + tuple(o for o in outputs if o[0] != name))
    if device.type != "cuda":
        raise ValueError(f"key is on {device}; quantize_write_index_qk_nvfp4 needs a CUDA device")
    if key.shape[0] + query.shape[0]:
        launch = sdsa_family.launch(device.index, "sdsa_quantize", NAME_OF[key.dtype])
        with torch.cuda.device(device):
            ops.launch(
                launch,
                (key, slots, query, query_rows, key_cache, key_scales, packed_query, query_scales),
            )


def indexer_scores(
    query, key_cache, block_table, context_lengths, *, requests, scores, query_scales=None,
    key_scales=None,
):  # fmt: skip
    """scores[q, k] = q . k in fp32 (dequantized values; products exact, summed in fp32 by
    the tensor cores, 16 channels a step) for the G = len(requests) groups of R = rows / G
    consecutive query rows (R in 1..8): group g's rows against the first context_lengths[g]
    keys of table row requests[g]; other entries of `scores` (fp32 (rows, max_context), rows
    contiguous) are untouched. BF16: query (rows, 128) bf16, key_cache (pages, 64, 128)
    bf16. NVFP4: query (rows, 64) uint8 with query_scales (rows, 8), key_cache (pages, 64,
    64) uint8 with key_scales (pages, 64, 8) (uint8 or float8_e4m3fn), both scale tensors
    at even addresses. block_table (B, W), context_lengths and requests (G,): int32. Needs
    max_context <= 64 x W. Returns scores."""
    page = sdsa_family.constant("page_keys")
    nvfp4, device, cache, q = _query_and_keys(
        "indexer_scores", query, key_cache, query_scales, key_scales
    )
    groups = _int32_vector("requests", requests, None, device)
    _int32_vector("context_lengths", context_lengths, groups, device)
    table = _block_table(block_table, None, device)
    rows = q.shape[0]
    if groups == 0 or rows % groups or not 1 <= rows // groups <= 8:
        raise ValueError(
            f"query has {rows} rows for {groups} requests: each group must have 1 to 8 rows"
        )
    _tensor("scores", scores, torch.float32, (rows, None), device)
    if scores.shape[1] > page * table.shape[1]:
        raise ValueError(
            f"scores has {scores.shape[1]} columns; the block table holds at most "
            f"{page * table.shape[1]} keys (64 x W)"
        )
    query_scales, key_scales = _scales_pair(nvfp4, query_scales, key_scales, rows, cache, device)
    inputs = (("query", query), ("key_cache", key_cache), ("block_table", block_table))
    check_writable("scores", scores, inputs)
    _need_cuda(device, "indexer_scores")
    if rows and scores.shape[1]:
        launch = sdsa_family.launch(device.index, "sdsa_scores", "u8" if nvfp4 else "bf16")
        tensors = (q, query_scales, cache, key_scales, table, context_lengths, requests, scores)
        with torch.cuda.device(device):
            ops.launch(launch, tensors)
    return scores


def gather_key_sample(
    key_cache, block_table, offsets, sample_ends, *, sample_keys, samples_per_run: int,
    pages_per_run: int, key_scales=None, sample_scales=None,
):  # fmt: skip
    """Slot s < sample_ends[r] of sample row r gets logical key
    (s // samples_per_run) * 64 * pages_per_run + offsets[s] of block_table row r (and, for
    NVFP4 keys, its scales into sample_scales); other slots are untouched. sample_keys
    (R, cap, 128) bf16 or (R, cap, 64) uint8 (the cache's dtype), cap a multiple of 128;
    offsets uint8 (cap,); sample_ends int32 (R,). Viewed as 64-key pages, the sample is
    scored by indexer_scores. Returns sample_keys."""
    nvfp4 = _key_format("gather_key_sample", sample_scales, key_scales)
    dim = sdsa_family.constant("key_dim")
    width = dim // 2 if nvfp4 else dim
    element = torch.uint8 if nvfp4 else torch.bfloat16
    device = _device_of(key_cache, "key_cache")
    cache = _keys("key_cache", key_cache, element, width, device)
    if (
        not isinstance(sample_keys, torch.Tensor)
        or sample_keys.dtype != element
        or sample_keys.dim() != 3
        or sample_keys.shape[2] != width
        or sample_keys.shape[1] % 128
        or sample_keys.stride()[1:] != (width, 1)
        or sample_keys.device != device
    ):
        raise ValueError(
            f"sample_keys must be {element} (R, cap, {width}) with contiguous rows and cap a "
            f"multiple of 128 on {device}, got {describe(sample_keys)}"
        )
    rows, cap = sample_keys.shape[:2]
    table = _block_table(block_table, rows, device)
    _int32_vector("sample_ends", sample_ends, rows, device)
    _tensor("offsets", offsets, torch.uint8, (cap,), device)
    for name, value in (("samples_per_run", samples_per_run), ("pages_per_run", pages_per_run)):
        positive_int(name, value)
    _, key_scales = _scales_pair(nvfp4, None, key_scales, 0, cache, device)
    scales_out = key_scales  # (BF16: a stand-in the kernel does not write)
    if nvfp4:
        scales_out = _bytes("sample_scales", sample_scales, (rows, cap, dim // 16), 8, device)
    inputs = (("key_cache", key_cache), ("block_table", block_table), ("offsets", offsets))
    check_writable("sample_keys", sample_keys, inputs)
    _need_cuda(device, "gather_key_sample")
    if rows and cap:
        launch = sdsa_family.launch(
            device.index, "sdsa_sample", "u8" if nvfp4 else "bf16", samples_per_run, pages_per_run
        )
        tensors = (cache, key_scales, table, offsets, sample_ends, sample_keys, scales_out)
        with torch.cuda.device(device):
            ops.launch(launch, tensors)
    return sample_keys


def thresholds_from_sample(sample_scores, sample_top, *, thresholds, counters):
    """thresholds[r] = the min of sample_scores[r, p] (fp32 (rows, S)) over the positions p
    in sample_top[r] (int32 (rows, K)); a position of -1 (or >= S) or a NaN score counts as
    -inf, a row with K = 0 gets +inf. Sets counters[r] (int32 (rows, 2)) to 0. One launch."""
    device = _device_of(sample_scores, "sample_scores")
    _tensor("sample_scores", sample_scores, torch.float32, (None, None), device)
    _tensor("sample_top", sample_top, torch.int32, (None, None), device)
    rows = sample_scores.shape[0]
    if sample_top.shape[0] != rows:
        raise ValueError(
            f"sample_top must have {rows} rows (sample_scores'), got {sample_top.shape[0]}"
        )
    _tensor("thresholds", thresholds, torch.float32, (rows,), device)
    _counters(counters, rows, device)
    inputs = (("sample_scores", sample_scores), ("sample_top", sample_top))
    check_writable("thresholds", thresholds, inputs + (("counters", counters),))
    check_writable("counters", counters, inputs)
    _need_cuda(device, "thresholds_from_sample")
    if rows:
        launch = sdsa_family.launch(device.index, "sdsa_thresholds", None)
        with torch.cuda.device(device):
            ops.launch(launch, (sample_scores, sample_top, thresholds, counters))


def indexer_threshold_select(
    query, key_cache, row_ends, tile_requests, block_table, *, thresholds, counters,
    candidates, max_context: int, top_k: int, query_scales=None, key_scales=None,
    arrivals=None, ranges=None,
):  # fmt: skip
    """Row r of tile t = r // 128 (table row tile_requests[t]) against its keys
    < min(row_ends[r], max_context), scored as indexer_scores does, without writing scores:
    a key is a candidate when score > thresholds[r], a tie when neither above nor below
    (equal, or NaN). counters[r] (int32 (rows, 2), zeroed by the caller) += (candidates,
    ties), including pairs not stored; the n-th candidate goes to slot top_k + n of
    candidates[r] (int32 (rows, slots, 2)) if n < cap = slots - top_k, the n-th tie to slot
    top_k - 1 - n if n < top_k, as (key, bits of the stored value: score - thr where score <=
    2 thr, else the score); the order within a class is unspecified. A row fits when
    cands <= cap and cands + min(ties, top_k) >= min(row_end, top_k).

    Repair mode (`arrivals` int32 (tiles,), `ranges` int32 (2, rows), cap >= top_k - 1):
    every row that does not fit gets the exact min(row_end, top_k)-th largest of its scores
    (in float-bit order; +inf when that is 0 keys) as its threshold (written to
    thresholds[r]), its counters restart and it is selected again, so every row fits; then
    ranges[:, r] = (top_k - min(ties, top_k), top_k + min(cands, cap)), the slots
    top_k_from_candidates reads. The repair is a second launch with a cluster of CTAs per
    512 rows (16 on SM90, 8 on SM100, 1 on SM120) that repairs its rows one after the
    other (the select's scores recomputed on chip, no score matrix), so `arrivals` is
    checked but neither read nor written: it stays zeroed.

    query / key formats as indexer_scores (rows = 128 x tiles); thresholds fp32 (rows,),
    row_ends int32 (rows,), tile_requests int32 (tiles,). Needs max_context <= 64 x W."""
    if (arrivals is None) != (ranges is None):
        raise ValueError("give both arrivals and ranges (repair mode) or neither")
    page = sdsa_family.constant("page_keys")
    nvfp4, device, cache, q = _query_and_keys(
        "indexer_threshold_select", query, key_cache, query_scales, key_scales
    )
    tiles = _int32_vector("tile_requests", tile_requests, None, device)
    rows = q.shape[0]
    if rows != 128 * tiles:
        raise ValueError(f"query has {rows} rows; it needs 128 per tile ({tiles} tiles)")
    _int32_vector("row_ends", row_ends, rows, device)
    table = _block_table(block_table, None, device)
    _tensor("thresholds", thresholds, torch.float32, (rows,), device)
    _counters(counters, rows, device)
    _tensor("candidates", candidates, torch.int32, (rows, None, 2), device)
    if candidates.stride(1) != 2:
        raise ValueError(f"candidates must have contiguous rows, got {describe(candidates)}")
    slots = candidates.shape[1]
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k < slots:
        raise ValueError(f"top_k = {top_k!r} must be an int in [0, {slots}) (candidate slots)")
    repair = arrivals is not None
    if repair:
        _int32_vector("arrivals", arrivals, tiles, device)
        _tensor("ranges", ranges, torch.int32, (2, rows), device)
        if slots - top_k < top_k - 1:
            raise ValueError(
                f"repair mode needs cap = slots - top_k >= top_k - 1; candidates has {slots} "
                f"slots for top_k = {top_k}"
            )
    positive_int("max_context", max_context)
    if max_context > page * table.shape[1]:
        raise ValueError(
            f"max_context = {max_context} exceeds the block table's {page * table.shape[1]} keys"
        )
    query_scales, key_scales = _scales_pair(nvfp4, query_scales, key_scales, rows, cache, device)
    inputs = (("query", query), ("key_cache", key_cache), ("thresholds", thresholds))
    check_writable("counters", counters, inputs + (("candidates", candidates),))
    check_writable("candidates", candidates, inputs)
    if repair:
        outputs = (("counters", counters), ("candidates", candidates), ("ranges", ranges))
        check_writable("thresholds", thresholds, inputs[:2] + outputs)
        check_writable("ranges", ranges, inputs + outputs[:2])
    _need_cuda(device, "indexer_threshold_select")
    if rows:
        dtype = "u8" if nvfp4 else "bf16"
        tensors = (
            q, query_scales, cache, key_scales, table, row_ends, tile_requests, thresholds,
            counters, candidates,
        )  # fmt: skip
        with torch.cuda.device(device):
            select = sdsa_family.launch(device.index, "sdsa_select", dtype, max_context, top_k)
            ops.launch(select, tensors)
            if repair:
                fix = sdsa_family.launch(device.index, "sdsa_repair", dtype, max_context, top_k)
                ops.launch(fix, (*tensors, ranges))


def _counters(counters, rows: int, device) -> None:
    _tensor("counters", counters, torch.int32, (rows, 2), device)


def top_k_from_candidates(candidates, ranges, *, top_keys):
    """Row r's (key, stored value) pairs in slots [ranges[0, r], ranges[1, r]) of
    candidates (int32 (rows, slots, 2), as indexer_threshold_select stores them): with at
    most K = top_keys.shape[-1] of them, their keys in slot order, then -1; otherwise the
    exact top-K by stored value in float-bit order (a positive NaN above +inf): the keys
    strictly above the K-th value first, then tied keys up to K (which ones, and the order
    within each part, unspecified). K < 65536; ranges int32 (2, rows) of any strides, within
    [0, slots] (not checked on the GPU). One launch. Returns top_keys.

    Rows of any stride in all three tensors let a caller pick the live rows of
    indexer_threshold_select's 128-row tiles: with one decode row a request at the top of
    its tile, `candidates.view(-1, 128, slots, 2)[:, 0]`, `ranges.view(2, -1, 128)[:, :, 0]`;
    the other rows see no key, and their -1 rows of K keys would be most of the bytes
    written. With several rows a request, the rows may also be a (tiles, rows) grid, each
    dim of any stride: candidates (T, R, slots, 2), ranges (2, T, R), top_keys (T, R, K),
    e.g. `candidates.view(-1, 128, slots, 2)[:, :4]` for the first four rows of every tile,
    still one launch."""
    device = _device_of(candidates, "candidates")
    if (
        candidates.dtype != torch.int32
        or candidates.dim() not in (3, 4)
        or candidates.shape[-1] != 2
        or candidates.stride()[-2:] != (2, 1)
    ):
        raise ValueError(
            f"candidates must be int32 (rows, slots, 2) or (tiles, rows, slots, 2) with "
            f"contiguous rows, got {describe(candidates)}"
        )
    grid = tuple(candidates.shape[:-2])
    _tensor("ranges", ranges, torch.int32, (2, *grid), device, unit_stride=False)
    _tensor("top_keys", top_keys, torch.int32, (*grid, None), device)
    if top_keys.shape[-1] >= 65536:
        raise ValueError(f"top_keys has {top_keys.shape[-1]} columns; K must be < 65536")
    check_writable("top_keys", top_keys, (("candidates", candidates), ("ranges", ranges)))
    _need_cuda(device, "top_k_from_candidates")
    operands = (candidates, ranges, top_keys)
    if len(grid) == 1:  # a plain list of rows: a grid of one row a tile
        operands = (candidates[:, None], ranges[:, :, None], top_keys[:, None])
    if math.prod(grid) and top_keys.shape[-1]:
        launch = sdsa_family.launch(device.index, "sdsa_topk", None)
        with torch.cuda.device(device):
            ops.launch(launch, operands)
    return top_keys


def _query_and_keys(function: str, query, key_cache, query_scales, key_scales):
    """(NVFP4?, device, key cache, query) of the scoring functions, checked: BF16 query rows
    and keys, or NVFP4 codes with both scale tensors."""
    dim = sdsa_family.constant("key_dim")
    nvfp4 = _key_format(function, query_scales, key_scales)
    width = dim // 2 if nvfp4 else dim
    element = torch.uint8 if nvfp4 else torch.bfloat16
    device = _device_of(key_cache, "key_cache")
    cache = _keys("key_cache", key_cache, element, width, device)
    return nvfp4, device, cache, _keys("query", query, element, width, device, paged=False)


def _key_format(function: str, query_scales, key_scales) -> bool:
    """True for NVFP4 (both scale tensors given), False for BF16 (neither)."""
    if (query_scales is None) != (key_scales is None):
        raise ValueError(f"{function}: give both scale tensors (NVFP4 keys) or neither (BF16 keys)")
    return key_scales is not None


def _device_of(t, name: str) -> torch.device:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {describe(t)}")
    return t.device


def _need_cuda(device, function: str) -> None:
    if device.type != "cuda":
        raise ValueError(f"the tensors are on {device}; {function} needs a CUDA device")


def _keys(name: str, t, element, width: int, device, paged: bool = True) -> torch.Tensor:
    """A key cache (pages, 64, width) or query rows (rows, width) of `element` (bf16, or
    uint8 NVFP4 codes), rows contiguous, the outer stride a multiple of 16 bytes."""
    page = sdsa_family.constant("page_keys")
    shape = (None, page, width) if paged else (None, width)
    if not isinstance(t, torch.Tensor) or t.dtype != element:
        kind = "NVFP4 codes (uint8)" if element == torch.uint8 else "bf16"
        raise ValueError(f"{name} must be {kind}, got {describe(t)}")
    return _layout(name, t, shape, 16, device)


def _scales_pair(nvfp4: bool, first, keys, first_rows: int, cache, device):
    """The two scale tensors as uint8 (NVFP4), or one-element stand-ins (BF16)."""
    dim = sdsa_family.constant("key_dim")
    page = sdsa_family.constant("page_keys")
    if not nvfp4:
        stand_in = torch.zeros(1, page, dim // 16, dtype=torch.uint8, device=device)
        return stand_in[0, :1], stand_in
    keys = _bytes("key_scales", keys, (cache.shape[0], page, dim // 16), 8, device)
    if first is not None and first.dim() == 2:
        first = _bytes("query_scales", first, (first_rows, dim // 16), 8, device)
    for name, t in (("key_scales", keys), ("query_scales", first)):
        # The kernels read a key's or a query row's scales two bytes at a time.
        if t is not None and t.data_ptr() % 2:
            raise ValueError(f"{name} must start at an even address, got {t.data_ptr():#x}")
    return first, keys


def _tensor(name: str, t, dtype, shape: tuple, device, unit_stride: bool = True) -> torch.Tensor:
    """t checked: `dtype`, `shape` (None = any extent), unit stride on the last dim (a
    vector: contiguous) unless not `unit_stride` (any strides), on `device`."""
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != dtype
        or t.dim() != len(shape)
        or any(s is not None and n != s for n, s in zip(t.shape, shape, strict=True))
        or (unit_stride and t.stride(-1) != 1)
        or t.device != device
    ):
        kind = str(dtype).removeprefix("torch.")
        if len(shape) == 1:
            length = "" if shape[0] is None else f" of length {shape[0]}"
            want = f"a contiguous {kind} vector{length}"
        else:
            dims = ", ".join("N" if s is None else str(s) for s in shape)
            want = f"{kind} ({dims})" + (" with unit stride on the last dim" if unit_stride else "")
        raise ValueError(f"{name} must be {want} on {device}, got {describe(t)}")
    return t


def _int32_vector(name: str, t, length, device) -> int:
    return _tensor(name, t, torch.int32, (length,), device).shape[0]


def _block_table(t, rows, device) -> torch.Tensor:
    return _tensor("block_table", t, torch.int32, (rows, None), device)


def _bytes(name: str, t, shape: tuple, outer_bytes: int, device) -> torch.Tensor:
    """t (uint8, or float8_e4m3fn scales) as uint8, laid out as _layout says."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"{name} must be a uint8 (or float8_e4m3fn) tensor, got {describe(t)}")
    return _layout(name, t, shape, outer_bytes, device).view(torch.uint8)


def _layout(name: str, t, shape: tuple, outer_bytes: int, device) -> torch.Tensor:
    """t itself, checked: `shape` (None = any extent), the dims after the first contiguous,
    the first stride a multiple of outer_bytes bytes, on `device`."""
    want_inner = tuple(
        int(torch.tensor(shape[i + 2 :] or (1,)).prod()) for i in range(len(shape) - 1)
    )
    if (
        t.dim() != len(shape)
        or any(s is not None and n != s for n, s in zip(t.shape, shape, strict=True))
        or t.stride()[1:] != want_inner
        or (t.stride(0) * t.element_size()) % outer_bytes
        or t.device != device
    ):
        want = ", ".join("N" if s is None else str(s) for s in shape)
        raise ValueError(
            f"{name} must be ({want}) with contiguous rows and a first stride that is a "
            f"multiple of {outer_bytes} bytes on {device}, got {describe(t)}"
        )
    return t
