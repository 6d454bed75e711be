"""Block-sparse attention wrappers, call-compatible with `flashinfer.sparse`.

    BlockSparseAttentionWrapper          BSR / per-head block mask / direct selections, NHD
    VariableBlockSparseAttentionWrapper  per-kv-head block masks with variable block sizes, HND

plan() checks its arguments and builds the kernels' tile lists on the GPU without a host
synchronisation; checks that need the values of GPU index tensors finish on the GPU and are
raised by check_plan() or the next run() (validation.py). run() checks the tensors it is
given and launches on the current stream, allocating nothing when out= (and lse=, if
return_lse) are given.

SPARSEFORGE_VARIANT=<variant name> (see `python -m sparseforge info` / manifest.json) forces
one kernel variant, for tuning and debugging; it must fit the plan.

Backends: "auto" (default) runs our kernels when the block sizes are multiples of 64 and
otherwise the PyTorch reference (`sparseforge.reference`, dense masked attention: correct,
O(Sq*Sk) memory, slow) with a warning; "sparseforge" (FlashInfer's "fa2", "fa3", "cake"
and "cake_cute" are accepted as its synonyms) refuses those block sizes instead; "torch"
always runs the reference; "warp_mma" forces the portable mma.sync kernels (on sm_90a the
default is the wgmma kernel when it is built).
"""

from __future__ import annotations

import math
import os
import warnings
import weakref

import torch

from sparseforge import ops, planner, reference, validation
from sparseforge._library import built_values, find_kernel, find_kernel_by_name
from sparseforge.arch import arch_for_device
from sparseforge.errors import VariantNotBuiltError
from sparseforge.sage import KEYS_PER_SCALE

LOG2_E = math.log2(math.e)
FAMILY = "block_sparse_fwd"
SAGE_FAMILY = "sage_fp8_fwd"
SAGE_DTYPE = torch.float8_e4m3fn
# Preferred template of each family on sm_90a, then the portable one.
_TEMPLATES = {FAMILY: ("sm90_wgmma", "warp_mma"), SAGE_FAMILY: ("sm90_sage_fp8", "warp_mma_fp8")}
KERNEL_BACKENDS = ("sparseforge", "fa2", "fa3", "cake", "cake_cute")
BACKENDS = ("auto", "torch", "warp_mma", *KERNEL_BACKENDS)

_DTYPES = {
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "e4m3": torch.float8_e4m3fn,
}
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", SAGE_DTYPE: "e4m3"}


def _as_dtype(value, name: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.replace("torch.", "") in _DTYPES:
        dtype = _DTYPES[value.replace("torch.", "")]
    else:
        raise ValueError(
            f"{name}={value!r} is not a dtype; use torch.float16, torch.bfloat16 or torch.float8_e4m3fn"
        )
    if dtype not in _DTYPE_NAMES:
        raise ValueError(
            f"{name}={dtype} is not supported; use torch.float16, torch.bfloat16 or "
            "torch.float8_e4m3fn (Sage FP8)"
        )
    return dtype


def _reject(name: str, value, allowed=(None,), why: str = "is not supported by sparseforge"):
    if not any(value is a or (a is not None and value == a) for a in allowed):
        raise NotImplementedError(f"{name}={value!r} {why}")


def _sage_scales(dtype, q_scale, k_scale, v_scale, num_qo_heads, num_kv_heads, seq_q, seq_k, head_dim, device):
    """The checked Sage FP8 scales (q_scale, k_scale, v_scale), or None for 16-bit plans.

    The three are given with q_data_type=torch.float8_e4m3fn, or none of them at all."""
    given = {"q_scale": q_scale, "k_scale": k_scale, "v_scale": v_scale}
    if dtype != SAGE_DTYPE:
        extra = [name for name, value in given.items() if value is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} are for q_data_type=torch.float8_e4m3fn (Sage FP8) only")
        return None
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise ValueError(
            f"q_data_type=float8_e4m3fn (Sage FP8) needs q_scale, k_scale and v_scale; missing "
            f"{', '.join(missing)} (sparseforge.sage_fp8_quantize makes all three)"
        )
    _check_tensor("q_scale", q_scale, (1, num_qo_heads, seq_q), torch.float32, device)
    _check_tensor("k_scale", k_scale, (1, num_kv_heads, -(-seq_k // KEYS_PER_SCALE)), torch.float32, device)
    _check_tensor("v_scale", v_scale, (num_kv_heads, head_dim), torch.float32, device)
    return q_scale, k_scale, v_scale


def _check_common_options(
    causal, pos_encoding_mode, use_fp16_qk_reduction, logits_soft_cap, rope_scale, rope_theta
):
    _reject("causal", causal, (False,), "is not supported (no causal block-sparse kernels are built)")
    _reject(
        "pos_encoding_mode",
        pos_encoding_mode,
        ("NONE",),
        "is not supported: apply RoPE before calling; ALiBi is not available",
    )
    _reject("use_fp16_qk_reduction", use_fp16_qk_reduction, (False,), "is not supported (QK^T accumulates in fp32)")
    _reject("logits_soft_cap", logits_soft_cap, (None, 0, 0.0), "is not supported (no soft-capping kernels are built)")
    _reject("rope_scale", rope_scale, (None,), "is not used: RoPE (pos_encoding_mode='ROPE_LLAMA') is not supported")
    _reject("rope_theta", rope_theta, (None,), "is not used: RoPE (pos_encoding_mode='ROPE_LLAMA') is not supported")


def _check_tensor(name, t, shape, dtype=None, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _check_index_tensor(name, t, shape, dtype, device):
    """Plan inputs may live on the host (checked there) or on the wrapper's device."""
    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
        device = t.device
    _check_tensor(name, t, shape, dtype, device)


def _check_kernel_operand(name, t):
    """Strides the kernels can load with 16-byte vectors (the launch checks the address)."""
    stride = t.stride()
    if stride[-1] != 1:
        raise ValueError(f"{name} must have unit stride on head_dim, got strides {stride}")
    per_16_bytes = 16 // t.element_size()
    if stride[0] % per_16_bytes or stride[1] % per_16_bytes:
        raise ValueError(
            f"{name} must have strides that are multiples of {per_16_bytes} elements (16 bytes), got {stride}"
        )


def _keys_contiguous(v):
    """Sage V (Sk, Hkv, D) with unit stride on the keys, as e4m3 MMAs need V K-major.

    sparseforge.sage_fp8_quantize returns v in that layout (a transposed view), which is used
    as is; any other layout is transposed here into a new buffer (one extra pass over V)."""
    sk, hkv, d = v.shape
    if v.stride(0) == 1 and v.stride(1) % 16 == 0 and v.stride(2) % 16 == 0:  # 16 bytes
        return v
    keys = -(-sk // KEYS_PER_SCALE) * KEYS_PER_SCALE
    buf = torch.empty((hkv, d, keys), dtype=v.dtype, device=v.device)
    buf[:, :, sk:].zero_()  # the row padding only: 16-byte reads past the last key see zeros
    buf[:, :, :sk].copy_(v.permute(1, 2, 0))
    return buf[:, :, :sk].permute(2, 0, 1)


def _heads_in_whole_tiles(k):
    """Sage K (Sk, Hkv, D) as sm90_sage_fp8 loads it: one TMA view over every head's keys
    (k_tma_view in generator/kernels/sm90_sage_fp8.py), so each head must start a whole number
    of 64-key tiles after the one before, and the padding after the last head's keys up to
    that must lie in k's storage (read, never used).

    sparseforge.sage_fp8_quantize returns k so (a view of a buffer padded to 64 keys), which
    is used as is; any other k is copied here into such a buffer (one extra pass over K)."""
    sk, hkv, d = k.shape
    row, head = k.stride(0), k.stride(1)
    span = k.storage_offset() + hkv * head  # elements from the storage's start
    if row >= d and head > 0 and head % (planner.TILE * row) == 0 and span * k.element_size() <= k.untyped_storage().nbytes():
        return k
    buf = planner.tile_padded_keys(hkv, sk, d, k.dtype, k.device)
    buf[:, :sk].copy_(k.transpose(0, 1))
    return buf[:, :sk].transpose(0, 1)


class _BlockSparseBase:
    def __init__(self, float_workspace_buffer: torch.Tensor, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise TypeError("float_workspace_buffer must be a torch.Tensor")
        self._workspace = float_workspace_buffer
        self._device = float_workspace_buffer.device
        self._backend = backend
        self._plan = None
        self._checks = validation.DeferredCheck()
        self._size_cache = {}

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None) -> None:
        """Kept for API compatibility: sparseforge keeps its plan in its own tensors."""
        self._workspace = float_workspace_buffer

    def check_plan(self) -> None:
        """Wait for the GPU checks of the latest plan()'s inputs; raise ValueError if any
        failed. run() raises the same error without waiting once the checks are done."""
        self._checks.raise_if_found(wait=True)

    def _report(self, errors, source: str, num_col_blocks: int) -> None:
        """Host error bits raise now; device ones are checked without blocking (validation.py)."""
        if errors is None:
            self._checks.clear()
        elif errors.device.type == "cpu":
            self._checks.clear()
            validation.raise_host_errors(errors, source, num_col_blocks)
        else:
            self._checks.start(errors, source, num_col_blocks)

    @property
    def backend_in_use(self) -> str:
        """'sm90_wgmma', 'warp_mma' or 'torch' for the current plan."""
        if self._plan is None:
            raise RuntimeError("plan() has not been called")
        return self._plan["path"]

    # --- plan helpers ---
    def _plan_common(self, num_qo_heads, num_kv_heads, head_dim, sm_scale, q_data_type, kv_data_type):
        if num_qo_heads <= 0 or num_kv_heads <= 0 or num_qo_heads % num_kv_heads:
            raise ValueError(
                f"num_qo_heads {num_qo_heads} must be a positive multiple of num_kv_heads {num_kv_heads}"
            )
        dtype = _as_dtype(q_data_type, "q_data_type")
        kv_dtype = dtype if kv_data_type is None else _as_dtype(kv_data_type, "kv_data_type")
        if kv_dtype != dtype:
            raise NotImplementedError(f"kv_data_type {kv_dtype} differs from q_data_type {dtype}: not supported")
        scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        return dtype, scale

    def _choose_path(self, kernel_ok: bool, why_not: str, dtype, head_dim, group: int, rows_fit):
        """(path, kernel) for this plan; errors or warns per the backend rules above.

        float8_e4m3fn plans use the sage_fp8_fwd family, 16-bit ones block_sparse_fwd.
        The sm90 kernels run n units per CTA, one per warpgroup, sharing its K/V loads, when
        the plan's units come in groups of n with one tile list: query heads of a kv group
        (group % n == 0) or consecutive 64-row units of one row block (rows_fit(n)); see
        planner.longest_first."""
        if self._backend == "torch":
            return "torch", None
        if not kernel_ok:
            if self._backend != "auto":
                raise NotImplementedError(f"{why_not}; backend={self._backend!r} has no kernel for it")
            warnings.warn(f"{why_not}: running the PyTorch reference (slow, dense memory)", stacklevel=3)
            return "torch", None
        if self._device.type != "cuda":
            raise ValueError(f"the workspace buffer is on {self._device}; sparseforge kernels need a CUDA device")
        arch = arch_for_device(self._device.index if self._device.index is not None else torch.cuda.current_device())
        params = dict(dtype=_DTYPE_NAMES[dtype], head_dim=head_dim)
        family = SAGE_FAMILY if dtype == SAGE_DTYPE else FAMILY
        native, portable = _TEMPLATES[family]

        def fits(units):
            return group % units == 0 or rows_fit(units)

        forced = os.environ.get("SPARSEFORGE_VARIANT")
        if forced:
            kernel = find_kernel_by_name(forced, family, arch, **params)
            units = kernel.units_per_cta
            if not fits(units):
                raise ValueError(
                    f"variant {forced} runs units in groups of {units} with one tile list; this "
                    f"plan has none (GQA group {group}, row blocks not multiples of {planner.TILE * units} tokens)"
                )
        elif self._backend == "warp_mma":
            kernel = find_kernel(family, arch, template=portable, **params)
        else:
            # The most warpgroups per CTA (units sharing one K/V ring) that is built and that
            # the plan allows; the catalog builds up to the count measured fastest.
            built = built_values("warpgroups", family, arch, native, **params)
            warpgroups = next((n for n in built if fits(n)), 1)
            try:
                kernel = find_kernel(family, arch, template=native, warpgroups=warpgroups, **params)
            except VariantNotBuiltError:
                kernel = find_kernel(family, arch, template=portable, **params)
        kernel.prepare()
        return kernel.template, kernel

    def _bind(self, plan, kernel, tiles, lse_shape) -> None:
        """Pack the plan's arguments once; a scratch LSE lets run() without lse allocate nothing."""
        scales = ()
        if plan["sage"] is not None:  # the Sage ABI's (tokens or channels, heads) views
            q_scale, k_scale, v_scale = plan["sage"]
            scales = (q_scale[0].t(), planner.tile_key_scales(k_scale[0], KEYS_PER_SCALE).t(), v_scale.t())
        plan["launch"] = kernel.bind(*scales, *tiles.tensors(), plan["scale_log2"])
        plan["launch_id"] = ops.register(plan["launch"])
        plan["lse_scratch"] = torch.empty(lse_shape, dtype=torch.float32, device=self._device)

    # --- run helpers ---
    def _run_kernel(self, q, k, v, out, lse, hnd: bool):
        """Launch on the current stream; hnd: the tensors are (heads, seq, ...) views."""
        launch = self._plan["launch"]
        if self._plan["sage"] is not None:
            # The Sage ABI takes V transposed, (D, Sk, Hkv) with unit key stride; the others
            # are passed as (seq, heads, ...) views.
            v = _keys_contiguous(v.transpose(0, 1) if hnd else v).permute(2, 0, 1)
            if hnd:
                q, k, out, lse = q.transpose(0, 1), k.transpose(0, 1), out.transpose(0, 1), lse.t()
            hnd = False
            if self._plan["path"] == "sm90_sage_fp8":
                k = _heads_in_whole_tiles(k)
        if torch.compiler.is_compiling():
            torch.ops.sparseforge.block_sparse_fwd(
                q, k, v, out, lse, list(launch.static_tensors), self._plan["launch_id"], hnd
            )
        else:
            launch((q, k, v, out, lse), swap01=hnd)

    def _check_run_inputs(self, q, k, v, q_shape, kv_shape):
        """After run() has checked that a plan exists."""
        plan = self._plan
        if not torch.compiler.is_compiling():
            self._checks.raise_if_found()
        for name, t, shape in (("q", q, q_shape), ("k", k, kv_shape), ("v", v, kv_shape)):
            _check_tensor(name, t, shape, plan["dtype"], self._device)
            if plan["path"] != "torch" and not (name == "v" and plan["sage"] is not None):
                _check_kernel_operand(name, t)

    def _outputs(self, out, lse, out_shape, lse_shape, return_lse):
        plan = self._plan
        if out is None:
            out = torch.empty(out_shape, dtype=plan["out_dtype"], device=self._device)
        else:
            _check_tensor("out", out, out_shape, plan["out_dtype"], self._device)
            if plan["path"] != "torch":
                _check_kernel_operand("out", out)
        if lse is None and not return_lse and plan["path"] != "torch":
            lse = plan["lse_scratch"]
        elif lse is None:
            lse = torch.empty(lse_shape, dtype=torch.float32, device=self._device)
        else:
            _check_tensor("lse", lse, lse_shape, torch.float32, self._device)
        return out, lse

    @staticmethod
    def _check_run_options(enable_pdl):
        _reject("enable_pdl", enable_pdl, (None, False), "is not supported (no PDL launches)")


class BlockSparseAttentionWrapper(_BlockSparseBase):
    """Block-sparse attention over a BSR matrix of (R x C)-token blocks; q/k/v in NHD."""

    def plan(
        self,
        indptr,
        indices,
        M: int,
        N: int,
        R: int,
        C: int,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        mask=None,
        packed_mask=None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        logits_soft_cap=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking: bool = True,
        block_mask=None,
        kv_block_lens=None,
        q2k_indices=None,
        q2k_num=None,
        kv_splits=None,
        use_clc=None,
        q_scale=None,
        k_scale=None,
        v_scale=None,
    ) -> None:
        _check_common_options(causal, pos_encoding_mode, use_fp16_qk_reduction, logits_soft_cap, rope_scale, rope_theta)
        _reject("mask", mask, (None,), "(masks inside blocks) is not supported: give whole blocks")
        _reject("packed_mask", packed_mask, (None,), "(masks inside blocks) is not supported: give whole blocks")
        _reject("kv_splits", kv_splits, (None, 1), "is not supported (no split-KV path)")
        _reject("use_clc", use_clc, (None,), "is an SM100 scheduler option; not supported")
        dtype, scale = self._plan_common(num_qo_heads, num_kv_heads, head_dim, sm_scale, q_data_type, kv_data_type)
        out_dtype = _output_dtype(dtype)
        if o_data_type is not None and _as_dtype(o_data_type, "o_data_type") != out_dtype:
            raise NotImplementedError(
                f"o_data_type {o_data_type} is not supported for q_data_type {dtype}: the output is "
                f"written in {out_dtype}"
            )
        for name, value in (("M", M), ("N", N), ("R", R), ("C", C)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        sage = _sage_scales(dtype, q_scale, k_scale, v_scale, num_qo_heads, num_kv_heads, M, N, head_dim, self._device)
        if N % C:
            raise ValueError(f"N ({N}) must be divisible by C ({C})")
        mb, nb = -(-M // R), N // C
        device = self._device
        group = num_qo_heads // num_kv_heads
        if kv_block_lens is not None:
            _check_index_tensor("kv_block_lens", kv_block_lens, (nb,), torch.int32, device)

        if q2k_num is not None and q2k_indices is None:
            raise ValueError("q2k_num is given without q2k_indices")
        if q2k_indices is not None:
            if block_mask is not None or indptr is not None or indices is not None:
                raise ValueError("q2k_indices is mutually exclusive with block_mask and indptr/indices")
            _check_index_tensor("q2k_indices", q2k_indices, (num_qo_heads, mb, q2k_indices.shape[-1]), torch.int32, device)
            if q2k_num is not None:
                _check_index_tensor("q2k_num", q2k_num, (num_qo_heads, mb), torch.int32, q2k_indices.device)
            # GQA: the first query head of each group selects for the group; the others must agree.
            head_mask, errors = planner.selection_block_mask(
                q2k_indices[::group], None if q2k_num is None else q2k_num[::group], nb
            )
            if group > 1:
                errors = errors + planner.group_selection_errors(planner.sorted_selections(q2k_indices, q2k_num), group)
            source = "q2k_indices / q2k_num"
        elif block_mask is not None:
            if block_mask.dtype != torch.bool or block_mask.dim() != 3 or block_mask.shape[0] not in (num_qo_heads, num_kv_heads) or tuple(block_mask.shape[1:]) != (mb, nb):
                raise ValueError(
                    f"block_mask must be bool of shape ({num_qo_heads} or {num_kv_heads}, {mb}, {nb}), "
                    f"got {block_mask.dtype} {tuple(block_mask.shape)}"
                )
            _check_index_tensor("block_mask", block_mask, block_mask.shape, torch.bool, device)
            head_mask, errors, source = block_mask, None, "block_mask"
            if block_mask.shape[0] == num_qo_heads and group > 1:
                head_mask = block_mask[::group]
                errors = planner.group_selection_errors(block_mask, group)
        else:
            if indptr is None or indices is None:
                raise ValueError("give indptr and indices, or block_mask, or q2k_indices")
            _check_index_tensor("indptr", indptr, (mb + 1,), torch.int32, device)
            _check_index_tensor("indices", indices, (indices.numel(),), torch.int32, indptr.device)
            head_mask, errors = planner.bsr_block_mask(indptr, indices, mb, nb)
            head_mask = head_mask.expand(num_kv_heads, -1, -1)
            source = "indptr / indices"
        if kv_block_lens is not None:
            lens_errors = planner.kv_block_lens_errors(kv_block_lens, C)
            if errors is None or lens_errors.device != errors.device:
                self._report(lens_errors, "kv_block_lens", nb)
            else:
                errors = errors + lens_errors
            kv_block_lens = kv_block_lens.to(device, non_blocking=non_blocking)
        self._report(errors, source, nb)
        head_mask = head_mask.to(device, non_blocking=non_blocking)

        tiled = R % planner.TILE == 0 and C % planner.TILE == 0
        path, kernel = self._choose_path(
            tiled, f"blocks of {R}x{C} tokens are not multiples of 64", dtype, head_dim,
            group, rows_fit=lambda units: R % (planner.TILE * units) == 0,
        )
        plan = dict(path=path, kernel=kernel, dtype=dtype, out_dtype=out_dtype, sage=sage, scale=scale, scale_log2=scale * LOG2_E,
                    M=M, N=N, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
        row_sizes = planner.uniform_block_sizes(M, R, num_kv_heads, device)
        col_sizes = planner.uniform_block_sizes(N, C, num_kv_heads, device)
        if path == "torch":
            plan["token_mask"] = _token_mask(head_mask, row_sizes, col_sizes, kv_block_lens)
        else:
            tiles = planner.plan_tiles(
                head_mask, row_sizes, col_sizes, M, N, num_qo_heads, kv_block_lens, C,
                blocks_are_tiles=R == C == planner.TILE, units_per_cta=kernel.units_per_cta,
            )
            self._bind(plan, kernel, tiles, (M, num_qo_heads))
        self._plan = plan

    def run(self, q, k, v, scale_q=None, scale_k=None, scale_v=None, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None):
        """q (M, Hq, D), k/v (N, Hkv, D) -> out (M, Hq, D)[, lse (M, Hq)]."""
        for name, value in (("scale_q", scale_q), ("scale_k", scale_k), ("scale_v", scale_v)):
            _reject(name, value, (None,), "(per-head FP8 scales) is not supported")
        self._check_run_options(enable_pdl)
        p = self._plan
        if p is None:
            raise RuntimeError("plan() must be called before run()")
        hd = p["head_dim"]
        self._check_run_inputs(q, k, v, (p["M"], p["num_qo_heads"], hd), (p["N"], p["num_kv_heads"], hd))
        out, lse = self._outputs(out, lse, (p["M"], p["num_qo_heads"], hd), (p["M"], p["num_qo_heads"]), return_lse)
        if p["path"] == "torch":
            o_ref, lse_ref = _reference(p, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
            out.copy_(o_ref.transpose(0, 1))
            lse.copy_(lse_ref.transpose(0, 1))
        else:
            self._run_kernel(q, k, v, out, lse, hnd=False)
        return (out, lse) if return_lse else out


class VariableBlockSparseAttentionWrapper(_BlockSparseBase):
    """Per-kv-head block masks with variable block sizes; q/k/v in HND."""

    def plan(
        self,
        block_mask_map,
        block_row_sz,
        block_col_sz,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        logits_soft_cap=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        non_blocking: bool = True,
        q_data_type="float16",
        kv_data_type=None,
        q_scale=None,
        k_scale=None,
        v_scale=None,
    ) -> None:
        _check_common_options(causal, pos_encoding_mode, use_fp16_qk_reduction, logits_soft_cap, rope_scale, rope_theta)
        dtype, scale = self._plan_common(num_qo_heads, num_kv_heads, head_dim, sm_scale, q_data_type, kv_data_type)
        device = self._device
        if not isinstance(block_mask_map, torch.Tensor) or block_mask_map.dim() != 3:
            raise ValueError("block_mask_map must be a bool tensor of shape (num_kv_heads, MB, NB)")
        _, mb, nb = block_mask_map.shape
        _check_index_tensor("block_mask_map", block_mask_map, (num_kv_heads, mb, nb), torch.bool, device)
        _check_index_tensor("block_row_sz", block_row_sz, (num_kv_heads, mb), torch.int32, device)
        _check_index_tensor("block_col_sz", block_col_sz, (num_kv_heads, nb), torch.int32, device)
        # The sizes fix the sequence lengths, so the host needs their values: read once per
        # size tensor (one synchronisation if it lives on the GPU), cached while unmodified.
        host_rows, host_cols = self._host_sizes(block_row_sz), self._host_sizes(block_col_sz)
        if bool((host_rows < 1).any()) or bool((host_cols < 1).any()):
            raise ValueError("block_row_sz and block_col_sz must be >= 1")
        seq_q, seq_k = host_rows.sum(-1), host_cols.sum(-1)
        if bool((seq_q != seq_q[0]).any()) or bool((seq_k != seq_k[0]).any()):
            raise ValueError(
                "every kv head's block_row_sz (and block_col_sz) must sum to the same length, got "
                f"{seq_q.tolist()} and {seq_k.tolist()}"
            )
        seq_q, seq_k = int(seq_q[0]), int(seq_k[0])
        sage = _sage_scales(dtype, q_scale, k_scale, v_scale, num_qo_heads, num_kv_heads, seq_q, seq_k, head_dim, device)
        row_sizes = block_row_sz.to(device, torch.int64, non_blocking=non_blocking)
        col_sizes = block_col_sz.to(device, torch.int64, non_blocking=non_blocking)
        block_mask_map = block_mask_map.to(device, non_blocking=non_blocking)
        self._checks.clear()
        tiled = planner.sizes_tile_aligned(host_rows) and planner.sizes_tile_aligned(host_cols)
        path, kernel = self._choose_path(
            tiled, "block sizes that are not multiples of 64 (except each head's last block)", dtype, head_dim,
            num_qo_heads // num_kv_heads, rows_fit=lambda units: planner.rows_fit_units(host_rows, units),
        )
        plan = dict(path=path, kernel=kernel, dtype=dtype, out_dtype=_output_dtype(dtype), sage=sage, scale=scale, scale_log2=scale * LOG2_E,
                    seq_q=seq_q, seq_k=seq_k, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                    head_dim=head_dim)
        if path == "torch":
            plan["token_mask"] = _token_mask(block_mask_map, row_sizes, col_sizes, None)
        else:
            tiles = planner.plan_tiles(
                block_mask_map, row_sizes, col_sizes, seq_q, seq_k, num_qo_heads,
                blocks_are_tiles=planner.sizes_are_tiles(host_rows) and planner.sizes_are_tiles(host_cols),
                units_per_cta=kernel.units_per_cta,
            )
            self._bind(plan, kernel, tiles, (num_qo_heads, seq_q))
        self._plan = plan

    def _host_sizes(self, sizes: torch.Tensor) -> torch.Tensor:
        """Host copy of a block-size tensor, reused while it is the same, unmodified tensor."""
        cached = self._size_cache.get(id(sizes))
        if cached is not None:
            ref, version, host = cached
            if ref() is sizes and version == sizes._version:
                return host
        host = sizes.to("cpu", torch.int64)
        if len(self._size_cache) > 8:
            self._size_cache.clear()
        self._size_cache[id(sizes)] = (weakref.ref(sizes), sizes._version, host)
        return host

    def run(self, q, k, v, out=None, lse=None, return_lse: bool = False, enable_pdl=None):
        """q (Hq, Sq, D), k/v (Hkv, Sk, D) -> out (Hq, Sq, D)[, lse (Hq, Sq)]."""
        self._check_run_options(enable_pdl)
        p = self._plan
        if p is None:
            raise RuntimeError("plan() must be called before run()")
        hd, hq, hkv = p["head_dim"], p["num_qo_heads"], p["num_kv_heads"]
        self._check_run_inputs(q, k, v, (hq, p["seq_q"], hd), (hkv, p["seq_k"], hd))
        out, lse = self._outputs(out, lse, (hq, p["seq_q"], hd), (hq, p["seq_q"]), return_lse)
        if p["path"] == "torch":
            o_ref, lse_ref = _reference(p, q, k, v)
            out.copy_(o_ref)
            lse.copy_(lse_ref)
        else:
            self._run_kernel(q, k, v, out, lse, hnd=True)
        return (out, lse) if return_lse else out


def _output_dtype(dtype):
    """Sage FP8 writes bf16; 16-bit plans write their input dtype."""
    return torch.bfloat16 if dtype == SAGE_DTYPE else dtype


def _reference(plan, q, k, v):
    """The reference path on HND tensors (Sage FP8 ones dequantized with the plan's scales)."""
    if plan["sage"] is not None:
        q, k, v = reference.sage_dequantize(q, k, v, *plan["sage"])
    return reference.attention(q, k, v, plan["token_mask"], plan["scale"])


def _token_mask(head_mask, row_sizes, col_sizes, kv_block_lens):
    """(Hkv, Sq, Sk) token mask for the reference path."""
    return reference.block_mask_to_token_mask(
        head_mask.cpu(), row_sizes.cpu(), col_sizes.cpu(), None if kv_block_lens is None else kv_block_lens.cpu()
    )
