"""Test setup: on a machine without a CUDA GPU, run the real kernels in Triton's interpreter.

The switch must happen before Triton's JIT decorates anything, so it is made here,
before codetta is imported by any test module.

TorchInductor's on-disk cache is one of this run's own (unless TORCHINDUCTOR_CACHE_DIR is
set): the tests compile from scratch, as on a fresh machine, whatever was compiled before
(codetta.ops.compile_cache keys the cache on codetta's code, but not on the tests').
"""

import atexit
import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="codetta-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device():
    return DEVICE
