"""`import sparseforge` is cheap and touches no GPU: no CUDA initialisation, no kernel
library load, well under a second on top of torch's own import."""

import subprocess
import sys

CODE = """
import time, torch
start = time.perf_counter()
import sparseforge
elapsed = time.perf_counter() - start
from sparseforge import _library
print(elapsed, torch.cuda.is_initialized(), _library.library.cache_info().currsize)
"""


def test_import_is_fast_and_initialises_nothing():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    elapsed, cuda_initialised, libraries_loaded = out.stdout.split()
    assert float(elapsed) < 0.5, f"import sparseforge took {elapsed} s"
    assert cuda_initialised == "False"
    assert libraries_loaded == "0"
