"""The CUDA gate, as a pytest plugin (tests/python/conftest.py imports its hooks; a test loads it with
``-p cuda_gate`` to check the gate itself).

GPU tests carry ``@pytest.mark.needs_cuda``. Without a GPU they are skipped, except when ETTKIT_REQUIRE_CUDA=1
(set wherever a GPU is expected: tools/gpu_check.sh), which makes the run fail when
- torch sees no CUDA device: every needs_cuda test fails at setup, and the session fails even when it
  selected no such test;
- a needs_cuda test skips itself (``pytest.skip``, a ``skipif``) for any reason: its skip is a failure.
So a GPU job can never pass by skipping everything.
"""

from __future__ import annotations

import os

import pytest
import torch

_NO_GPU = "ETTKIT_REQUIRE_CUDA=1 but torch sees no CUDA device (torch.cuda.is_available() is False)"


def _required() -> bool:
    return os.environ.get("ETTKIT_REQUIRE_CUDA") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_cuda: requires a CUDA device (a failure without one when "
                                       "ETTKIT_REQUIRE_CUDA=1)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or _required():
        return
    for item in items:
        if "needs_cuda" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))


def pytest_runtest_setup(item):
    if _required() and "needs_cuda" in item.keywords and not torch.cuda.is_available():
        pytest.fail(_NO_GPU, pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if _required() and rep.skipped and "needs_cuda" in item.keywords and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"ETTKIT_REQUIRE_CUDA=1: a CUDA test may not skip ({reason})"


def pytest_sessionfinish(session, exitstatus):
    if _required() and not torch.cuda.is_available():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _required() and not torch.cuda.is_available():
        terminalreporter.write_line(f"FAILED: {_NO_GPU}", red=True, bold=True)
