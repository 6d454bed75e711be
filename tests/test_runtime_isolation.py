"""The runtime never needs the CuTe DSL, a GPU or a driver to import or to describe itself."""

import subprocess
import sys

BLOCK_DSL = "import sys; sys.modules['cutlass'] = None; sys.modules['generator'] = None; "


def run(code: str, env_extra=None):
    import os

    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_import_without_dsl():
    result = run(
        BLOCK_DSL
        + "import sparseforge, sparseforge.sparse, sparseforge.planner, sparseforge.reference, "
        "sparseforge.bench, sparseforge.info; print(sparseforge.__version__)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == __import__("sparseforge").__version__


def test_info_without_gpu():
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this checks the no-GPU message everywhere.
    result = run(
        BLOCK_DSL + "from sparseforge.__main__ import main; sys.exit(main(['info']))",
        {"CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "build archs:" in out and "block_sparse_fwd / sm_90a" in out
    assert "GPU: none (no CUDA GPU" in out


def test_demo_without_gpu():
    result = run(
        BLOCK_DSL + "from sparseforge.__main__ import main; sys.exit(main(['demo']))",
        {"CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.stderr
    assert "no GPU run: no CUDA GPU" in result.stdout
    assert "running the PyTorch reference on the CPU" in result.stdout
    assert "build archs:" in result.stdout
