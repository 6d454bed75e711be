"""First-use self-checks for real on this GPU: its arch treated as one our suite has not run,
the checks of the variants a call chooses run once and pass; a variant whose check is made
to fail gives way to the portable one, whose output still matches the reference."""

import pytest
import torch
from sparseforge import VariableBlockSparseAttentionWrapper, check, reference, selftest
from sparseforge.arch import arch_for_device

pytestmark = pytest.mark.gpu

DEV = "cuda"


@pytest.fixture
def unrun(monkeypatch):
    monkeypatch.setattr(selftest, "RUN_ON", frozenset())
    monkeypatch.setattr(selftest, "_results", {})
    monkeypatch.delenv("SPARSEFORGE_SELFTEST", raising=False)
    monkeypatch.delenv("SPARSEFORGE_VARIANT", raising=False)


def block_sparse_run():
    """A 4-head bf16 problem with 128-token blocks (half of them selected) through the
    variable wrapper: (out, the fp32 reference's out), and the plan's variant name."""
    torch.manual_seed(0)
    hq, hkv, s, d = 4, 2, 512, 128
    q, k, v = (torch.randn(h, s, d, device=DEV, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    mask = torch.rand(hkv, 4, 4, device=DEV) < 0.5
    mask[:, :, 0] = True
    sizes = torch.full((hkv, 4), 128, dtype=torch.int32, device=DEV)
    wrapper = VariableBlockSparseAttentionWrapper(torch.empty(1, device=DEV))
    wrapper.plan(mask, sizes, sizes, hq, hkv, d, q_data_type=torch.bfloat16)
    out = wrapper.run(q, k, v)
    tokens = reference.block_mask_to_token_mask(mask, sizes, sizes)
    want, _ = reference.attention(q, k, v, tokens, compute_dtype=torch.float32)
    return out, want, wrapper.backend_in_use


def test_the_variants_a_call_uses_are_checked_once_and_pass(unrun):
    out, want, _ = block_sparse_run()
    assert selftest._results and all(r is None for r in selftest._results.values())
    arch = arch_for_device(0)
    assert all(name.endswith(arch) for name in selftest._results)
    checked = dict(selftest._results)
    block_sparse_run()
    assert selftest._results == checked
    assert float((out.float() - want).norm() / want.norm()) < 5e-3


def test_a_failing_variant_gives_way_to_the_portable_one(unrun, monkeypatch):
    cases = check.check_variant

    def failing_wgmma(v, small):
        if v["template"] == "sm90_wgmma":
            return [("made to fail", False)]
        return cases(v, small)

    monkeypatch.setattr(check, "check_variant", failing_wgmma)
    with pytest.warns(RuntimeWarning, match="failed its first-use self-check"):
        out, want, backend = block_sparse_run()
    assert "warp_mma" in backend
    assert float((out.float() - want).norm() / want.norm()) < 5e-3
