"""Shared pytest configuration.

GPU tests carry ``@pytest.mark.needs_cuda``: they skip without a GPU, except when ETTKIT_REQUIRE_CUDA=1
(set wherever a GPU is expected), which turns a missing GPU, and a CUDA test that skips, into a failure so
a GPU job can never pass by skipping everything (the hooks are in cuda_gate.py).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

# Inductor's on-disk caches are shared by every process of a user (/tmp/torchinductor_<user>), so entries
# left by earlier runs, or written by a concurrent one, change what a compile does. Once, with two test runs
# side by side and a cache left by earlier ones, torch 2.14's FxGraphCache.find_guarded_entry failed
# evaluating a cached entry's guards (KeyError: 'batch') in three start-up tests; not reproduced in
# isolation. Each test session compiles into its own fresh directory, inherited by its subprocesses.
if not os.environ.get("ETTKIT_TEST_SHARED_INDUCTOR_CACHE"):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ettkit-tests-inductor-")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "triton")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

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
