"""The reference itself, against a loop written the obvious way."""

import math

import torch
from sparseforge import reference


def naive(q, k, v, mask, scale):
    hq, sq, d = q.shape
    group = hq // k.shape[0]
    out = torch.zeros(hq, sq, d, dtype=torch.float64)
    lse = torch.full((hq, sq), float("-inf"), dtype=torch.float64)
    for h in range(hq):
        for i in range(sq):
            keys = mask[h // group, i].nonzero().flatten()
            if keys.numel() == 0:
                continue
            logits = (k[h // group, keys].double() @ q[h, i].double()) * scale
            lse[h, i] = torch.logsumexp(logits, 0)
            out[h, i] = torch.softmax(logits, 0) @ v[h // group, keys].double()
    return out, lse


def test_attention_matches_naive_with_gqa_and_empty_rows():
    torch.manual_seed(0)
    q = torch.randn(4, 9, 16)
    k, v = torch.randn(2, 11, 16), torch.randn(2, 11, 16)
    mask = torch.rand(2, 9, 11) < 0.3
    mask[1, 4] = False
    out, lse = reference.attention(q, k, v, mask)
    want_out, want_lse = naive(q, k, v, mask, 1 / math.sqrt(16))
    assert torch.allclose(out, want_out, atol=1e-12)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse[finite], want_lse[finite], atol=1e-12)
    assert torch.all(out[2:, 4] == 0) and torch.all(lse[2:, 4] == float("-inf"))


def test_token_mask_from_blocks():
    blocks = torch.tensor([[[True, False], [False, True]]])
    mask = reference.block_mask_to_token_mask(
        blocks, torch.tensor([2, 1]), torch.tensor([1, 3]), torch.tensor([1, 2])
    )
    assert mask[0].int().tolist() == [[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 0]]
