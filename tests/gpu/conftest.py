"""The GPU lane: every test under tests/gpu is marked ``gpu`` and needs a CUDA device.

    python -m pytest -m gpu tests/gpu          # on a machine with a GPU
    LALR_GPU_LANE=cpu python -m pytest -m gpu tests/gpu   # the lane's own code, on the CPU

Without CUDA (CI) every test here is skipped with that reason, so the suite stays green.
``LALR_GPU_LANE=cpu`` runs the same tests with ``accelerator="cpu"`` (the FSDP cases through
``CPUFSDPStrategy``, since Lightning's FSDPStrategy refuses a CPU accelerator; the three that
compare CUDA with the CPU are skipped): it checks the lane itself, not the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu._lane import ON_CUDA


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = None
    if ON_CUDA and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="the GPU lane needs a CUDA device (pytest -m gpu on a GPU machine; "
                                       "LALR_GPU_LANE=cpu runs the lane's code on the CPU)")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def accelerator() -> str:
    return "gpu" if ON_CUDA else "cpu"


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if ON_CUDA else "cpu")
