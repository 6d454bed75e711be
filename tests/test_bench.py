"""The benchmark's helpers that need no GPU: its charts (from rows made up here), MP1's
selections and the K/V bytes its kernels stream (from selections made up here), the order
of a timed run's stream operations (CUDA calls replaced by a log), the SDSA timings'
argument check and SD2's window fit."""

import functools

import pytest
import torch
from sparseforge import bench
from sparseforge.bench import mp1_streamed_bytes, plot


def test_plot_writes_two_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    sweep = [
        dict(workload=f"{kind}@{topk}", density=topk / 512, tflops=300 + topk, dense_tflops=600)
        for kind in "WF"
        for topk in (4, 16, 64)
    ]
    rows = [dict(workload=w, ms=1.0 + i, dense_ms=8.0) for i, w in enumerate(["W1", "W3", "F1"])]
    paths = plot(rows, sweep, str(tmp_path), "test")
    assert len(paths) == 2
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_mp1_streamed_bytes_counts_each_4_token_union_once():
    """Tokens 0-3 select blocks {0, 1}, {0, 1}, {0, 2} and nothing (union {0, 1, 2}: 3
    blocks), tokens 4-7 block 3 each (union {3}): 2 union blocks a CTA on average, 10 / 8
    selected blocks a token; a block is 64 KiB of bf16 K and V."""
    ids = torch.tensor([[0, 1], [0, 1], [0, 2], [-1, -1], [3, -1], [3, -1], [3, -1], [3, -1]])
    ids = ids[None].int()  # (Hkv 1, 8 tokens, topk 2)
    line = mp1_streamed_bytes(ids, "random", {"wgmma union": 1e-6, "one-token": 1e-6})
    assert "union is 2.0 blocks for 1.2 a token (1.60x)" in line
    # Bytes in 1e-6 ms, in TB/s: union 2 blocks x 2 CTAs, one-token 10 blocks.
    assert f"wgmma union 0 GB in 0.00 ms = {4 * 65536 / 1e3:.1f} TB/s" in line
    assert f"one-token 0 GB in 0.00 ms = {10 * 65536 / 1e3:.1f} TB/s" in line


@pytest.mark.parametrize("mode", ["random", "chunked", "shared:0", "shared:13", "shared:14"])
def test_mp1_selections_are_causal_and_shared_as_their_mode_says(mode):
    """Each token lists block 0, its own block and blocks it sees, ascending with a -1 tail;
    a 16-token group (inside one 128-token block) lists at most 2 + N + 16 x (14 - N)
    distinct blocks for "shared:N", its first token's alone where all 14 are shared."""
    seq, hkv, topk = 2048, 2, 16
    ids, useful = bench.mp1_selections(seq, 64, hkv, topk, mode, torch.Generator().manual_seed(1))
    assert ids.shape == (hkv, seq, topk) and ids.dtype == torch.int32 and useful > 0
    own = torch.arange(seq) // 128
    valid = ids >= 0
    assert (valid[..., :-1] >= valid[..., 1:]).all()  # -1 only as a tail
    assert ((ids[..., 1:] > ids[..., :-1]) | ~valid[..., 1:]).all()  # ascending
    assert (ids <= own[None, :, None]).all()  # causal
    assert (ids[..., 0] == 0).all() and ((ids == own[None, :, None]).any(-1)).all()
    shared = {"random": 0, "chunked": 14}[mode] if ":" not in mode else int(mode[7:])
    groups = ids.view(hkv, seq // 16, 16 * topk)
    for group in groups.flatten(0, 1)[::7]:
        union = group[group >= 0].unique()
        assert len(union) <= 2 + shared + 16 * (14 - shared)
        if shared == 14:
            assert len(union) == int((group[:topk] >= 0).sum())


def test_mp1_selections_reject_an_unknown_mode():
    gen = torch.Generator()
    for mode in ("shared:15", "blocks"):
        with pytest.raises(ValueError, match="mode"):
            bench.mp1_selections(1024, 64, 1, 16, mode, gen)


def test_timed_runs_start_after_the_flush_and_a_gpu_spin(monkeypatch):
    """Each timed run enqueues before() (the L2 flush), then the spin, then its start event,
    the call and its end event: the GPU reaches the start event only after the host has had
    the spin's time to queue the call, so host work stays out of the timing."""
    log, made = [], []

    class Event:  # made in pairs: start, end
        def __init__(self, enable_timing):
            self.name = ("start", "end")[len(made) % 2]
            made.append(self)

        def record(self):
            log.append(self.name)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 1.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("spin", cycles)))
    ms = bench.cuda_time_ms(
        lambda: log.append("call"), warmup=1, iters=2, before=lambda: log.append("flush")
    )
    spin = ("spin", bench.HOST_LEAD_CYCLES)
    assert ms == 1.0
    assert log == ["call"] + ["flush", spin, "start", "call", "end"] * 2


@pytest.mark.parametrize("keys", [(), ("fp8",), ("nvfp4", "bf8")])
def test_sdsa_times_names_unknown_key_formats(keys):
    """--sdsa-keys: anything but bf16 / nvfp4 (or none) is refused before any GPU work."""
    with pytest.raises(ValueError, match="keys = "):
        bench.sdsa_times(keys=keys)


def test_sdsa_window_fit_follows_the_contracts_fit_rule():
    """Scores 64 .. 1 (one row), the sample every 4th key (64, 60, ..., 4), top_k 8, cap 8:
    the r-th sample score leaves 4 (r - 1) candidates and one tie, so only r = 3 fits (too
    few with r = 2, more than the cap with r = 4); ties and NaNs fill a row; a row shorter
    than top_k needs all its keys."""
    descending = torch.arange(64, 0, -1, dtype=torch.float32)[None]
    fit = functools.partial(bench.sdsa_window_fit, cap=8, top_k=8, sample_every=4)
    assert fit(descending, 2) == (1, 4.0)
    assert fit(descending, 3) == (0, 8.0)
    assert fit(descending, 4) == (1, 12.0)
    assert fit(torch.full((2, 64), 5.0), 7) == (0, 0.0)
    assert fit(torch.full((1, 64), float("nan")), 1) == (0, 0.0)
    short = torch.arange(6, 0, -1, dtype=torch.float32)[None]
    assert bench.sdsa_window_fit(short, 6, 8, top_k=8, sample_every=1) == (0, 5.0)
    assert bench.sdsa_window_fit(short, 3, 8, top_k=8, sample_every=1) == (1, 2.0)
    with pytest.raises(ValueError, match="sample_rank = 17"):
        fit(descending, 17)
