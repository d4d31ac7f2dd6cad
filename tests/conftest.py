"""Test setup: on a machine without a CUDA GPU, run the real kernels in Triton's interpreter.

The switch must happen before Triton's JIT decorates anything, so it is made here,
before codetta is imported by any test module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device():
    return DEVICE
