"""The benchmark's charts draw from its rows (no GPU: rows made up here)."""

import pytest
from sparseforge.bench import plot


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
