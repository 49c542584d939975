"""Shared pytest configuration.

GPU tests carry ``@pytest.mark.needs_cuda``: they skip without a GPU, except when ETTKIT_REQUIRE_CUDA=1
(set wherever a GPU is expected), which turns a missing GPU, and a CUDA test that skips, into a failure so
a GPU job can never pass by skipping everything (the hooks are in cuda_gate.py).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # test helpers (ledger_script, cuda_gate)

from cuda_gate import (  # noqa: E402,F401 - pytest finds the hooks by name in this module
    pytest_collection_modifyitems,
    pytest_runtest_makereport,
    pytest_runtest_setup,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _restore_rng():
    state = torch.random.get_rng_state()
    yield
    torch.random.set_rng_state(state)


@pytest.fixture
def repo() -> str:
    return REPO
