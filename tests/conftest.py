import pytest
import torch

# GPU tests run wherever torch sees a GPU: a build that cannot serve it (a missing arch, a
# broken library) then fails them loudly instead of skipping them.
GPU = torch.cuda.is_available() and torch.cuda.device_count() > 0


def pytest_collection_modifyitems(config, items):
    # The compute-sanitizer runs (minutes over every variant) go last, so a run with a time
    # limit has been through every other test when it reaches them.
    items.sort(key=lambda item: item.path.name == "test_gpu_sanitizer.py")
    if GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
