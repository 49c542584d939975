"""TorchRec for the tests that compare ettkit with TorchRec itself, or a skip that says why.

`make build` installs TorchRec's CPU wheels (requirements-torchrec-cpu.txt) for the default torch and leaves a
stamp file in the virtual environment. Where that stamp is present TorchRec is expected, so a failed import
fails the test instead of skipping it: a broken install can never pass by skipping every comparison.
Elsewhere (another torch, e.g. the GPU machine's 2.11, or ETTKIT_NO_TORCHREC=1) the tests skip, saying so.
"""

from __future__ import annotations

import glob
import importlib
import os
import sys

import pytest


def torchrec_expected() -> bool:
    return bool(glob.glob(os.path.join(sys.prefix, ".ettkit-torchrec-*")))


def import_torchrec():
    """The ``torchrec`` module; skips (or fails, where TorchRec is expected) when it cannot be imported."""
    try:
        return importlib.import_module("torchrec")
    except Exception as e:  # ImportError, or fbgemm's ops failing to load against this torch
        if torchrec_expected():
            pytest.fail(f"TorchRec was installed by `make build` ({sys.prefix}) but does not import: {e!r}")
        pytest.skip(
            f"TorchRec is not installed for this torch ({e!r}); `make build` installs it for the default torch "
            "from requirements-torchrec-cpu.txt",
            allow_module_level=True,
        )
