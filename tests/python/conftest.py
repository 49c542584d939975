"""Shared pytest configuration.

GPU tests carry ``@pytest.mark.needs_cuda``: they skip without a GPU, except when ETTKIT_REQUIRE_CUDA=1
(set wherever a GPU is expected), which turns a missing GPU into a failure so a GPU job can never pass
by skipping everything.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # test helpers (ledger_script)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_collection_modifyitems(config, items):
    require = os.environ.get("ETTKIT_REQUIRE_CUDA") == "1"
    have = torch.cuda.is_available()
    for item in items:
        if "needs_cuda" in item.keywords and not have:
            if require:
                item.add_marker(pytest.mark.xfail(reason="ETTKIT_REQUIRE_CUDA=1 but no GPU", strict=True,
                                                  run=False))
            else:
                item.add_marker(pytest.mark.skip(reason="no CUDA device"))


@pytest.fixture(autouse=True)
def _restore_rng():
    state = torch.random.get_rng_state()
    yield
    torch.random.set_rng_state(state)


@pytest.fixture
def repo() -> str:
    return REPO
