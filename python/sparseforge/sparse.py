"""Block-sparse attention wrappers, call-compatible with `flashinfer.sparse`.

    BlockSparseAttentionWrapper          BSR / per-head block mask / direct selections, NHD
    VariableBlockSparseAttentionWrapper  per-kv-head block masks with variable block sizes, HND
    plan_cake_vsa / run_cake_vsa         the BSR wrapper as a plan object and a function

This module is the API: signatures, refusals of what is not supported, shapes and layouts.
The sparsity forms become one per-kv-head mask in sparsity.py; dispatch.py chooses the kernel,
builds the tile lists and launches. plan() checks its arguments and plans on the GPU without
a host synchronisation; checks that need the values of GPU index tensors finish on the GPU
and are raised by check_plan() or the next run() (validation.py). run() checks the tensors
it is given and launches on the current stream, allocating nothing when out= (and lse=, if
return_lse) are given.

SPARSEFORGE_VARIANT=<variant name> (see `python -m sparseforge info` / manifest.json) forces
one kernel variant, for tuning and debugging; it must fit the plan.

Backends: "auto" (default) runs our kernels wherever one applies and otherwise the PyTorch
reference (`sparseforge.reference`, dense masked attention: correct, O(Sq*Sk) memory, slow)
with a warning; "sparseforge" (FlashInfer's "fa2", "fa3", "cake" and "cake_cute" are
accepted as its synonyms) refuses those plans instead; "torch" always runs the reference;
"warp_mma" forces the portable mma.sync kernels (on sm_90a the default is the wgmma kernel
when it is built). The 16-bit kernels take every block size (blocks that are not multiples
of 64 run as 64-token tiles with bit masks, built on the GPU at plan() time) and every
option: causal, mask / packed_mask, logits_soft_cap, ALiBi and RoPE LLaMA (q and k rotated
into plan-time buffers by a kernel before the attention); Sage FP8 with any option or with
such blocks runs the reference.
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import torch

from sparseforge import dispatch, logit_options, planner, reference, sparsity, validation
from sparseforge.checks import (
    check_heads,
    check_index_tensor,
    check_tensor,
    check_writable,
    contiguous_operands,
    positive_int,
    reject,
)
from sparseforge.dtypes import as_dtype
from sparseforge.families import sage_fp8_fwd, selection_mask
from sparseforge.plan import NO_LOGIT_OPTIONS, LogitOptions, Plan

BACKENDS = dispatch.BACKENDS
SAGE_DTYPE = torch.float8_e4m3fn
ATTENTION_DTYPES = (torch.float16, torch.bfloat16, SAGE_DTYPE)
FP32_MAX = torch.finfo(torch.float32).max


POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")


def _logit_options(
    causal, pos_encoding_mode, use_fp16_qk_reduction, logits_soft_cap, rope_scale, rope_theta
) -> LogitOptions:
    """FlashInfer's logit options of plan(), checked. use_fp16_qk_reduction is accepted
    and changes nothing: q.k always accumulates in fp32. rope_scale / rope_theta are used
    with pos_encoding_mode="ROPE_LLAMA" only (FlashInfer ignores them otherwise too)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(use_fp16_qk_reduction, bool):
        raise TypeError(
            f"use_fp16_qk_reduction must be a bool, got {type(use_fp16_qk_reduction).__name__}"
        )
    if pos_encoding_mode not in POS_ENCODING_MODES:
        raise ValueError(
            f"pos_encoding_mode={pos_encoding_mode!r} is not one of {POS_ENCODING_MODES}"
        )

    def number(name, value, default, allow_zero):
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            least = ">= 0" if allow_zero else "> 0"
            raise ValueError(f"{name}={value!r} must be a finite number {least}")
        return float(value)

    return LogitOptions(
        causal=causal,
        soft_cap=number("logits_soft_cap", logits_soft_cap, 0.0, allow_zero=True),
        pos_encoding_mode=pos_encoding_mode,
        rope_scale=number("rope_scale", rope_scale, 1.0, allow_zero=False),
        rope_theta=number("rope_theta", rope_theta, 1e4, allow_zero=False),
    )


def _mask_bits(mask, packed_mask, indptr, indices, M: int, N: int, R: int, C: int):
    """The BSR blocks' per-element masks (packed_mask, bits of the (nnz, R, C) mask flattened,
    little-endian, wins over mask) as (1, M, W) int32 bit rows on the indices' device
    (logit_options.py), or None."""
    if mask is None and packed_mask is None:
        return None
    if indptr is None or indices is None:
        raise ValueError("mask / packed_mask need the BSR form (indptr and indices)")
    nnz = indices.shape[0]
    if packed_mask is not None:
        need = -(-nnz * R * C // 8)
        check_tensor("packed_mask", packed_mask, (need,), torch.uint8)
        mask = reference.unpack_bits(packed_mask, nnz * R * C).view(nnz, R, C)
    else:
        check_tensor("mask", mask, (nnz, R, C))
        if mask.dtype not in (torch.bool, torch.uint8, torch.int32, torch.int64):
            raise ValueError(f"mask has dtype {mask.dtype}, expected bool (or 0/1 integers)")
    return logit_options.bsr_mask_bits(indptr, indices, mask != 0, M, N, R, C)


def _sm_scale(sm_scale, head_dim: int) -> float:
    """1 / sqrt(head_dim) by default; any given scale must be a finite number whose product
    with log2(e) (the kernels' unit) is a finite fp32."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a number, got {type(sm_scale).__name__}")
    largest = FP32_MAX / dispatch.LOG2_E
    if not math.isfinite(sm_scale) or abs(sm_scale) > largest:
        raise ValueError(f"sm_scale={sm_scale} must be a finite number below {largest:.3g} in size")
    return float(sm_scale)


def _output_dtype(dtype):
    """Sage FP8 writes bf16; 16-bit plans write their input dtype."""
    return torch.bfloat16 if dtype == SAGE_DTYPE else dtype


class _BlockSparseBase:
    def __init__(self, float_workspace_buffer: torch.Tensor, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise TypeError("float_workspace_buffer must be a torch.Tensor")
        self._workspace = float_workspace_buffer
        self._device = float_workspace_buffer.device
        self._backend = backend
        self._plan: Plan | None = None
        self._checks = validation.DeferredCheck()

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None) -> None:
        """Kept for API compatibility: sparseforge keeps its plan in its own tensors."""
        self._workspace = float_workspace_buffer

    def check_plan(self) -> None:
        """Wait for the GPU checks of the latest plan()'s inputs; raise ValueError if any
        failed. run() raises the same error without waiting once the checks are done."""
        self._checks.raise_if_found(wait=True)

    @property
    def backend_in_use(self) -> str:
        """The kernel template of the current plan (e.g. 'sm90_wgmma', 'warp_mma'), or 'torch'."""
        if self._plan is None:
            raise RuntimeError("plan() has not been called")
        return self._plan.path

    def _plan_attention(
        self,
        selection,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        sm_scale,
        q_data_type,
        kv_data_type,
        o_data_type,
        scales,
        hnd: bool,
        blocks: str,
        logits: LogitOptions = NO_LOGIT_OPTIONS,
    ) -> None:
        """The checks every plan shares, then the plan (dispatch.py)."""
        dtype = as_dtype(q_data_type, "q_data_type", ATTENTION_DTYPES)
        kv_dtype = (
            dtype
            if kv_data_type is None
            else as_dtype(kv_data_type, "kv_data_type", ATTENTION_DTYPES)
        )
        if kv_dtype != dtype:
            raise NotImplementedError(
                f"kv_data_type {kv_dtype} differs from q_data_type {dtype}: not supported"
            )
        out_dtype = _output_dtype(dtype)
        if (
            o_data_type is not None
            and as_dtype(o_data_type, "o_data_type", ATTENTION_DTYPES) != out_dtype
        ):
            raise NotImplementedError(
                f"o_data_type {o_data_type} is not supported for q_data_type {dtype}: the output "
                f"is written in {out_dtype}"
            )
        q_scale, k_scale, v_scale = scales
        if dtype == SAGE_DTYPE:
            scales = sage_fp8_fwd.check_scales(
                q_scale,
                k_scale,
                v_scale,
                num_qo_heads,
                num_kv_heads,
                selection.seq_q,
                selection.seq_k,
                head_dim,
                self._device,
            )
        else:
            extra = [
                name
                for name, value in zip(("q_scale", "k_scale", "v_scale"), scales, strict=True)
                if value is not None
            ]
            if extra:
                raise ValueError(
                    f"{', '.join(extra)} are for q_data_type=torch.float8_e4m3fn (Sage FP8) only"
                )
            scales = None
        errors, num_col_blocks = selection.errors, selection.mask.shape[-1]
        if errors is not None and errors.device.type == "cpu":
            validation.raise_host_errors(errors, selection.source, num_col_blocks)
        plan = dispatch.plan_attention(
            selection,
            dtype=dtype,
            out_dtype=out_dtype,
            sm_scale=_sm_scale(sm_scale, head_dim),
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hnd=hnd,
            scales=scales,
            backend=self._backend,
            device=self._device,
            blocks=blocks,
            logits=logits,
        )
        # The plan and its GPU checks are committed together: a plan() that raised above left
        # the wrapper as it was (its previous plan, and that plan's checks).
        self._plan = plan
        if plan.errors is None:
            self._checks.clear()
        else:
            self._checks.start(plan.errors, selection.source, num_col_blocks)

    def _run(self, q, k, v, out, lse, return_lse: bool, enable_pdl):
        reject("enable_pdl", enable_pdl, (None, False), "is not supported (no PDL launches)")
        plan = self._plan
        if plan is None:
            raise RuntimeError("plan() must be called before run()")
        eager = not torch.compiler.is_compiling()
        if eager:
            self._checks.raise_if_found()
        kernel = plan.path != "torch"
        # The quick check reads addresses: eager only (traced tensors have none).
        contiguous = (
            eager and kernel and contiguous_operands(plan, self._device.index, q, k, v, out, lse)
        )
        if not contiguous:
            self._check_operands(plan, kernel, q, k, v, out, lse)
        if out is None:
            out = torch.empty(plan.q_shape, dtype=plan.out_dtype, device=self._device)
        if lse is None:
            lse = (
                plan.lse_scratch
                if kernel and not return_lse
                else torch.empty(plan.lse_shape, dtype=torch.float32, device=self._device)
            )
        # A new out or lse is contiguous too; the scratch lse is, by construction.
        dispatch.run_attention(plan, q, k, v, out, lse, same_layout=contiguous)
        return (out, lse) if return_lse else out

    def _check_operands(self, plan, kernel: bool, q, k, v, out, lse) -> None:
        """run()'s checks of its tensors (out and lse where given), each error naming the
        argument."""
        for name, t, shape in (
            ("q", q, plan.q_shape),
            ("k", k, plan.kv_shape),
            ("v", v, plan.kv_shape),
        ):
            check_tensor(name, t, shape, plan.dtype, self._device)
            if kernel:
                plan.family.check_operand(name, t)
        if out is not None:
            check_tensor("out", out, plan.q_shape, plan.out_dtype, self._device)
            check_writable("out", out, (("q", q), ("k", k), ("v", v)))
            if kernel:
                plan.family.check_operand("out", out)
        if lse is not None:
            inputs = (("q", q), ("k", k), ("v", v)) + ((("out", out),) if out is not None else ())
            check_tensor("lse", lse, plan.lse_shape, torch.float32, self._device)
            check_writable("lse", lse, inputs)


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
        logits = _logit_options(
            causal, pos_encoding_mode, use_fp16_qk_reduction, logits_soft_cap, rope_scale,
            rope_theta,
        )  # fmt: skip
        reject("kv_splits", kv_splits, (None, 1), "is not supported (no split-KV path)")
        reject("use_clc", use_clc, (None,), "is an SM100 scheduler option; not supported")
        for name, value in (("M", M), ("N", N), ("R", R), ("C", C)):
            positive_int(name, value)
        check_heads(num_qo_heads, num_kv_heads, head_dim)
        if N % C:
            raise ValueError(f"N ({N}) must be divisible by C ({C})")
        selection = sparsity.from_bsr_wrapper(
            indptr=indptr,
            indices=indices,
            block_mask=block_mask,
            q2k_indices=q2k_indices,
            q2k_num=q2k_num,
            kv_block_lens=kv_block_lens,
            M=M,
            N=N,
            R=R,
            C=C,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            device=self._device,
            non_blocking=non_blocking,
            mask_of_selections=selection_mask.selection_block_mask,
        )
        mask_bits = _mask_bits(mask, packed_mask, indptr, indices, M, N, R, C)
        if mask_bits is not None:
            logits = dataclasses.replace(logits, mask_bits=mask_bits)
        self._plan_attention(
            selection,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            sm_scale,
            q_data_type,
            kv_data_type,
            o_data_type,
            (q_scale, k_scale, v_scale),
            hnd=False,
            blocks=f"blocks of {R}x{C} tokens",
            logits=logits,
        )

    def run(
        self,
        q,
        k,
        v,
        scale_q=None,
        scale_k=None,
        scale_v=None,
        out=None,
        lse=None,
        return_lse: bool = False,
        enable_pdl=None,
    ):
        """q (M, Hq, D), k/v (N, Hkv, D) -> out (M, Hq, D)[, lse (M, Hq)]."""
        if scale_q is not None or scale_k is not None or scale_v is not None:  # (host time)
            for name, value in (("scale_q", scale_q), ("scale_k", scale_k), ("scale_v", scale_v)):
                reject(name, value, (None,), "(per-head FP8 scales) is not supported")
        return self._run(q, k, v, out, lse, return_lse, enable_pdl)


class VariableBlockSparseAttentionWrapper(_BlockSparseBase):
    """Per-kv-head block masks with variable block sizes; q/k/v in HND."""

    def __init__(self, float_workspace_buffer: torch.Tensor, backend: str = "auto"):
        super().__init__(float_workspace_buffer, backend)
        self._size_cache = {}

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
        logits = _logit_options(
            causal, pos_encoding_mode, use_fp16_qk_reduction, logits_soft_cap, rope_scale,
            rope_theta,
        )  # fmt: skip
        check_heads(num_qo_heads, num_kv_heads, head_dim)
        device = self._device
        if not isinstance(block_mask_map, torch.Tensor) or block_mask_map.dim() != 3:
            raise ValueError("block_mask_map must be a bool tensor of shape (num_kv_heads, MB, NB)")
        _, mb, nb = block_mask_map.shape
        if mb == 0 or nb == 0:
            raise ValueError(
                f"block_mask_map has shape {tuple(block_mask_map.shape)}: it needs at least one "
                "block row and one block column"
            )
        check_index_tensor(
            "block_mask_map", block_mask_map, (num_kv_heads, mb, nb), torch.bool, device
        )
        check_index_tensor("block_row_sz", block_row_sz, (num_kv_heads, mb), torch.int32, device)
        check_index_tensor("block_col_sz", block_col_sz, (num_kv_heads, nb), torch.int32, device)
        # The sizes fix the sequence lengths, so the host needs their values: read once per
        # GPU size tensor (one synchronisation), then reused while it is unmodified.
        host_rows, row_values, check_rows = self._host_sizes(block_row_sz)
        if block_col_sz is block_row_sz:  # one tensor for both: read and checked once
            host_cols, col_values, check_cols = host_rows, row_values, None
        else:
            host_cols, col_values, check_cols = self._host_sizes(block_col_sz)
        selection = sparsity.from_block_mask_map(
            block_mask_map=block_mask_map,
            block_row_sz=row_values,
            block_col_sz=col_values,
            host_rows=host_rows,
            host_cols=host_cols,
            size_checks=[pair for pair in (check_rows, check_cols) if pair is not None],
            num_kv_heads=num_kv_heads,
            device=device,
            non_blocking=non_blocking,
        )
        self._plan_attention(
            selection,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            sm_scale,
            q_data_type,
            kv_data_type,
            None,
            (q_scale, k_scale, v_scale),
            hnd=True,
            blocks="block sizes (but each head's last)",
            logits=logits,
        )

    def _host_sizes(self, sizes: torch.Tensor):
        """(host values of a block-size tensor, the same values as int64 on its device,
        (tensor, values) to recheck or None). A GPU tensor is read once and both copies
        reused while it is the same tensor at the same version, which keeps plan() free of
        host synchronisation; because a write that bypasses the version counter (through
        .data, or by another library's kernel) would leave the copies stale, each reuse also
        has the plan compare the tensor with the values read, on the GPU, and set
        ERR_STALE_SIZES (raised by check_plan() / run()) if they differ (for a tensor made under
        torch.inference_mode(), which has no version counter, that comparison is the only
        check)."""
        if sizes.device.type == "cpu":
            host = sizes.to(torch.int64)
            return host, host, None
        cached = self._size_cache.get(id(sizes))
        if cached is not None:
            ref, version, host, values = cached
            if ref() is sizes and version == planner.tensor_version(sizes):
                return host, values, (sizes, values)
        host = sizes.to("cpu", torch.int64)
        values = sizes.to(torch.int64)
        if len(self._size_cache) > 8:
            self._size_cache.clear()
        version = planner.tensor_version(sizes)
        self._size_cache[id(sizes)] = (weakref.ref(sizes), version, host, values)
        return host, values, None

    def run(self, q, k, v, out=None, lse=None, return_lse: bool = False, enable_pdl=None):
        """q (Hq, Sq, D), k/v (Hkv, Sk, D) -> out (Hq, Sq, D)[, lse (Hq, Sq)]."""
        return self._run(q, k, v, out, lse, return_lse, enable_pdl)


class CakeVSAPlan:
    """What plan_cake_vsa() returns and run_cake_vsa() takes: one planned block-sparse
    attention problem. It holds its own tile lists and scratch, so keep it for as many runs
    (and CUDA graph captures) as the sparsity stays the same; plan again when it changes."""

    __slots__ = ("_wrapper",)

    def __init__(self, wrapper: BlockSparseAttentionWrapper):
        self._wrapper = wrapper

    def check(self) -> None:
        """Wait for the plan's GPU checks of its index inputs; raise ValueError if any failed."""
        self._wrapper.check_plan()

    @property
    def backend_in_use(self) -> str:
        return self._wrapper.backend_in_use

    def __repr__(self) -> str:
        plan = self._wrapper._plan
        return (
            f"CakeVSAPlan(q={plan.q_shape}, kv={plan.kv_shape}, dtype={plan.dtype}, "
            f"kernel={plan.path!r})"
        )


CAKE_BACKENDS = ("cake", "sparseforge")


def plan_cake_vsa(
    indptr,
    indices,
    block_mask,
    kv_block_lens=None,
    q2k_indices=None,
    q2k_num=None,
    *,
    M: int,
    N: int,
    R: int,
    C: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_data_type=torch.float16,
    sm_scale=None,
    device=None,
    q_scale=None,
    k_scale=None,
    v_scale=None,
) -> CakeVSAPlan:
    """Plan block-sparse attention once, as BlockSparseAttentionWrapper.plan() with
    backend="cake" would: the same sparsity forms (indptr/indices, block_mask, or
    q2k_indices/q2k_num; kv_block_lens) and the same checks. Runs only our kernels (no
    reference fallback): what no kernel covers (Sage FP8 blocks that are not multiples of
    64) raises NotImplementedError.
    `device` defaults to the device of the first index tensor given, else the current CUDA
    device. q_data_type=torch.float8_e4m3fn plans Sage FP8 and takes the three scales."""
    if device is None:
        given = [t for t in (block_mask, q2k_indices, indptr) if isinstance(t, torch.Tensor)]
        device = given[0].device if given else torch.device("cuda", torch.cuda.current_device())
    wrapper = BlockSparseAttentionWrapper(
        torch.empty(0, dtype=torch.uint8, device=device), backend="sparseforge"
    )
    wrapper.plan(
        indptr,
        indices,
        M,
        N,
        R,
        C,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        sm_scale=sm_scale,
        q_data_type=q_data_type,
        block_mask=block_mask,
        kv_block_lens=kv_block_lens,
        q2k_indices=q2k_indices,
        q2k_num=q2k_num,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return CakeVSAPlan(wrapper)


def run_cake_vsa(plan, q, k, v, *, out=None, lse=None, return_lse: bool = False, backend="cake"):
    """Run a plan from plan_cake_vsa(): q (M, Hq, D), k/v (N, Hkv, D) -> out (M, Hq, D)
    [, lse (M, Hq)], as BlockSparseAttentionWrapper.run(). `backend` must be "cake" (or
    "sparseforge"): there is no other route to fall back to."""
    if not isinstance(plan, CakeVSAPlan):
        raise TypeError(f"plan must be what plan_cake_vsa() returned, got {type(plan).__name__}")
    if backend not in CAKE_BACKENDS:
        raise ValueError(f"backend={backend!r}: run_cake_vsa runs {CAKE_BACKENDS} only")
    return plan._wrapper.run(q, k, v, out=out, lse=lse, return_lse=return_lse)
