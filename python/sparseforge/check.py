"""`python -m sparseforge.check [--variant NAME]`: every attention variant of the loaded
library (or one) against the fp32 reference on a fresh random problem, on the GPU.

For each variant: a ragged problem it fits (its dtype and head_dim; GQA groups of its units
per CTA; 1000 query rows, 777 keys, 64- and 128-token blocks, an empty and a full row),
outputs poisoned with NaN, relative L2 error and LSE against sparseforge.reference (Sage FP8
on the dequantized e4m3 inputs, quantized by the reference quantizer). Prints one line per
variant; exits 1 if any fails. With SPARSEFORGE_LIBRARY_DIR this checks a development build
of a few variants (generator/dev.py) without the full build.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from sparseforge import _library, reference
from sparseforge.arch import arch_for_device
from sparseforge.dtypes import BY_NAME
from sparseforge.sparse import VariableBlockSparseAttentionWrapper

ATTENTION_FAMILIES = ("block_sparse_fwd", "sage_fp8_fwd")
# Relative L2 error bounds: 16-bit kernels against fp32; Sage against the dequantized inputs
# (what is left is the e4m3 rounding of P).
TOLERANCE = {"block_sparse_fwd": 5e-3, "sage_fp8_fwd": 3e-2}


def ragged_mask(hkv: int, mb: int, nb: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rank = torch.rand(hkv, mb, nb, generator=gen).argsort(-1).argsort(-1)
    mask = rank < torch.randint(0, nb + 1, (hkv, mb, 1), generator=gen)
    mask[0, 0] = False
    mask[-1, -1] = True
    return mask


def check_variant(v: dict, block: int, seed: int = 0) -> tuple[float, bool]:
    """(relative L2 error, passed) of one variant on one problem."""
    p = v["params"]
    group = v["constraints"]["units_per_cta"]
    hkv, hq, d, sq, sk = 2, 2 * group, p["head_dim"], 1000, 777
    torch.manual_seed(seed)
    q, k, v_ = (torch.randn(h, s, d, device="cuda") for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    mb, nb = -(-sq // block), -(-sk // block)
    mask = ragged_mask(hkv, mb, nb, seed)
    rows = reference.uniform_sizes(sq, block).expand(hkv, -1).to(torch.int32)
    cols = reference.uniform_sizes(sk, block).expand(hkv, -1).to(torch.int32)
    wrapper = VariableBlockSparseAttentionWrapper(
        torch.empty(1, device="cuda"), backend="sparseforge"
    )
    scales = {}
    if v["family"] == "sage_fp8_fwd":
        qz = reference.sage_fp8_quantize(q, k, v_)
        scales = dict(q_scale=qz.q_scale, k_scale=qz.k_scale, v_scale=qz.v_scale)
        q, k, v_ = qz.q, qz.k, qz.v
        ref_q, ref_k, ref_v = reference.sage_dequantize(
            q, k, v_, qz.q_scale, qz.k_scale, qz.v_scale
        )
    else:
        q, k, v_ = (t.to(BY_NAME[p["dtype"]]) for t in (q, k, v_))
        ref_q, ref_k, ref_v = q, k, v_
    os.environ["SPARSEFORGE_VARIANT"] = v["name"]
    try:
        wrapper.plan(
            mask.cuda(), rows.cuda(), cols.cuda(), hq, hkv, d, q_data_type=q.dtype, **scales
        )
        wrapper.check_plan()
        out_dtype = torch.bfloat16 if v["family"] == "sage_fp8_fwd" else q.dtype
        out = torch.full((hq, sq, d), float("nan"), device="cuda", dtype=out_dtype)
        lse = torch.full((hq, sq), float("nan"), device="cuda")
        wrapper.run(q, k, v_, out=out, lse=lse, return_lse=True)
        torch.cuda.synchronize()
    finally:
        os.environ.pop("SPARSEFORGE_VARIANT")
    tokens = reference.block_mask_to_token_mask(mask, rows, cols).cuda()
    ref_out, ref_lse = reference.attention(ref_q, ref_k, ref_v, tokens, compute_dtype=torch.float32)
    err = float((out.float() - ref_out).norm() / ref_out.norm())
    empty = torch.isinf(ref_lse)
    ok = (
        err <= TOLERANCE[v["family"]]
        and not torch.isnan(out).any()
        and torch.equal(torch.isinf(lse), empty)
        and bool((out[empty] == 0).all())
        and torch.allclose(lse[~empty], ref_lse[~empty], atol=5e-3, rtol=2e-3)
    )
    return err, ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", help="only this variant")
    args = parser.parse_args(argv)
    arch = arch_for_device(torch.cuda.current_device())
    chosen = [
        v
        for v in _library.manifest()["variants"]
        if v["family"] in ATTENTION_FAMILIES
        and v["arch"] == arch
        and args.variant in (None, v["name"])
    ]
    if not chosen:
        print(
            f"no attention variant for {arch} in {_library.PACKAGE_DIR}"
            + (f" named {args.variant}" if args.variant else "")
        )
        return 1
    failed = 0
    for v in chosen:
        for block in (64, 128):
            err, ok = check_variant(v, block)
            failed += not ok
            print(
                f"{v['name']} blocks {block}: rel. L2 {err:.2e} {'ok' if ok else 'FAILED'}",
                flush=True,
            )
    print(f"{len(chosen)} variants, {failed} failures ({_library.PACKAGE_DIR})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
