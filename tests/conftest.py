import pytest
import torch

# GPU tests run wherever torch sees a GPU: a build that cannot serve it (a missing arch, a
# broken library) then fails them loudly instead of skipping them.
GPU = torch.cuda.is_available() and torch.cuda.device_count() > 0


def pytest_collection_modifyitems(config, items):
    if GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
