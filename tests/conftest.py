import pytest
import torch


def _gpu_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from sparseforge.arch import arch_for_device

        arch_for_device(0)
        return True
    except Exception:
        return False


GPU = _gpu_available()


def pytest_collection_modifyitems(config, items):
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU this build supports")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
