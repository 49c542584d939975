"""A wrong checkpoint directory must not start from scratch silently (#47 item 5): load_latest that finds
nothing logs "starting from scratch" with the directory on the "ettkit" logger (INFO on a first start, WARNING
on a torchrun restart), and warns naming a direct subdirectory that holds steps."""

import logging

import pytest
import torch

from ettkit.checkpoint import AsyncCheckpointer


def test_steps_in_a_subdirectory_are_named_and_scratch_is_logged(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with AsyncCheckpointer(tmp_path / "ckpt", recorder=None) as ck:
        ck.save(7, {"w": torch.ones(2)}).wait()
    (tmp_path / "ett").mkdir()
    state = {"w": torch.zeros(2)}
    with caplog.at_level(logging.INFO, logger="ettkit"):
        with AsyncCheckpointer(tmp_path, recorder=None, read_only=True) as ck:
            with pytest.warns(RuntimeWarning) as rec:
                assert ck.load_latest(state) is None
    msgs = [str(w.message) for w in rec if "holds no checkpoint" in str(w.message)]
    assert len(msgs) == 1 and f"subdirectory {tmp_path / 'ckpt'} holds step 7" in msgs[0], msgs
    assert f"AsyncCheckpointer({str(tmp_path / 'ckpt')!r})" in msgs[0]
    scratch = [r for r in caplog.records if "starting from scratch" in r.getMessage()]
    assert len(scratch) == 1 and str(tmp_path) in scratch[0].getMessage() and scratch[0].levelno == logging.INFO


def test_every_empty_load_logs_scratch_warning_on_a_restart_without_subdirectory_warning(tmp_path, caplog,
                                                                                         monkeypatch):
    import warnings

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with caplog.at_level(logging.INFO, logger="ettkit"):
        with AsyncCheckpointer(tmp_path / "ckpt", recorder=None) as ck, warnings.catch_warnings():
            warnings.simplefilter("error")  # no subdirectory holds steps: nothing to warn about
            assert ck.load_latest({"w": torch.zeros(2)}) is None
            assert ck.load_latest({"w": torch.zeros(2)}) is None
    scratch = [r for r in caplog.records if "starting from scratch" in r.getMessage()]
    assert len(scratch) == 2 and all(r.levelno == logging.WARNING for r in scratch)
    assert str(tmp_path / "ckpt") in scratch[0].getMessage()
