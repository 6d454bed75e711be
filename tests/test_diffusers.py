"""The diffusers integration: a small WanTransformer3DModel with random weights (nothing is
downloaded) whose self-attentions run through sparseforge. Every tile selected gives the
model's own dense attention; fewer run end to end. CPU (the reference backend) and GPU (the
kernels)."""

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from sparseforge.diffusers_processor import enable_sparse_attention  # noqa: E402


def tiny_wan(head_dim: int, device, dtype):
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head_dim, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64,
    )  # fmt: skip
    return model.to(device, dtype).eval()


def forward(model, frames, side, device, dtype):
    gen = torch.Generator(device=device).manual_seed(1)
    latents = torch.randn(1, 4, frames, side, side, generator=gen, device=device).to(dtype)
    text = torch.randn(1, 8, 32, generator=gen, device=device).to(dtype)
    with torch.no_grad():
        return model(
            latents, timestep=torch.tensor([500], device=device), encoder_hidden_states=text
        ).sample


def test_every_tile_selected_matches_the_models_dense_attention_on_the_cpu():
    model = tiny_wan(32, "cpu", torch.bfloat16)
    dense = forward(model, 2, 16, "cpu", torch.bfloat16)  # 128 tokens: two tiles
    assert enable_sparse_attention(model, topk=99, backend="torch") == 2
    sparse = forward(model, 2, 16, "cpu", torch.bfloat16)
    err = float((sparse.float() - dense.float()).norm() / dense.float().norm())
    assert err < 2e-2, err
    enable_sparse_attention(model, topk=1, backend="torch")
    fewer = forward(model, 2, 16, "cpu", torch.bfloat16)
    assert torch.isfinite(fewer.float()).all() and not torch.equal(fewer, sparse)


@pytest.mark.gpu
def test_every_tile_selected_matches_dense_and_sparse_runs_on_the_gpu():
    model = tiny_wan(128, "cuda", torch.bfloat16)
    dense = forward(model, 4, 32, "cuda", torch.bfloat16)  # 1024 tokens: 16 tiles
    enable_sparse_attention(model, topk=16)
    full = forward(model, 4, 32, "cuda", torch.bfloat16)
    err = float((full.float() - dense.float()).norm() / dense.float().norm())
    assert err < 2e-2, err
    enable_sparse_attention(model, topk=4)
    assert torch.isfinite(forward(model, 4, 32, "cuda", torch.bfloat16).float()).all()
