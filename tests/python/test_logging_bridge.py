"""The C++ core's log messages arrive in Python's logging (logger "ettkit"), and user-facing error messages
carry no C++ source locations (the debug log keeps them)."""

from __future__ import annotations

import logging
import subprocess
import sys

import ettkit
import pytest
from ettkit import _C, _logging, ett
from ledger_script import worked_example


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def ettkit_log():
    logger = logging.getLogger("ettkit")
    handler = ListHandler()
    level = logger.level
    _logging.flush()  # start clean: what earlier tests logged is delivered before the handler is added
    logger.addHandler(handler)
    try:
        yield logger, handler
    finally:
        _logging.flush()
        logger.removeHandler(handler)
        logger.setLevel(level)


def a_run_with_a_stray_ledger_file(path):
    worked_example(path).save()
    # Named like a ledger, but not one (a rank with a leading zero): the report skips it with a warning.
    (path / "ett" / "rank-007.jsonl").write_text("")
    return path


def test_a_cpp_warning_reaches_a_logging_handler(tmp_path, ettkit_log):
    logger, handler = ettkit_log
    ett.build_report(a_run_with_a_stray_ledger_file(tmp_path))  # the C++ report logs the warning
    _logging.flush()
    got = [r for r in handler.records if "rank-007.jsonl" in r.getMessage()]
    assert len(got) == 1
    record = got[0]
    assert record.name == "ettkit" and record.levelno == logging.WARNING
    assert record.pathname.endswith("ett/ledger_reader.cpp") and record.lineno > 0  # for debugging only
    assert ".cpp" not in record.getMessage()
    assert record.cpp_thread_id > 0


def test_the_ettkit_logger_level_silences_cpp_messages(tmp_path, ettkit_log):
    logger, handler = ettkit_log
    logger.setLevel(logging.ERROR)
    ett.build_report(a_run_with_a_stray_ledger_file(tmp_path))
    _logging.flush()
    assert not [r for r in handler.records if "rank-007.jsonl" in r.getMessage()]


def test_threads_that_log_while_the_gil_is_held_never_deadlock(ettkit_log):
    logger, handler = ettkit_log
    # Four C++ threads log 50 messages each and are joined by a thread that holds the GIL throughout.
    _C._logging._log_from_threads_for_testing(4, 50)
    _logging.flush()
    got = [r for r in handler.records if r.getMessage().startswith("test message ")]
    assert len(got) == 200
    for t in range(4):  # each thread's messages in its order
        mine = [r.getMessage() for r in got if r.getMessage().startswith(f"test message {t}/")]
        assert mine == [f"test message {t}/{i}" for i in range(50)]


def test_delivery_without_flush_and_at_interpreter_exit():
    code = (
        "import logging, sys, threading, time\n"
        "import ettkit\n"
        "from ettkit import _C\n"
        "seen = threading.Event()\n"
        "class H(logging.Handler):\n"
        "    def emit(self, r):\n"
        "        sys.stderr.write('got: ' + r.getMessage() + '\\n')\n"
        "        if r.getMessage() == 'early': seen.set()\n"
        "logging.getLogger('ettkit').addHandler(H())\n"
        "_C._logging.log(3, 'early')\n"
        "assert seen.wait(60), 'the bridge thread never delivered the message'\n"
        "_C._logging.log(3, 'at exit')\n"  # no flush: the atexit hook delivers it
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "got: early" in p.stderr and "got: at exit" in p.stderr


def test_user_messages_carry_no_source_location_and_the_debug_log_does(tmp_path, ettkit_log):
    logger, handler = ettkit_log
    logger.setLevel(logging.DEBUG)
    with pytest.raises(ettkit.InvalidArgumentError) as raised:
        ett.Recorder(tmp_path, heartbeat_s=-1.0)
    message = str(raised.value)
    assert "heartbeat_s" in message
    assert ".cpp" not in message and "[src/" not in message
    _logging.flush()
    debug = [r.getMessage() for r in handler.records if r.levelno == logging.DEBUG]
    assert any("heartbeat_s" in m and "ett/recorder.cpp:" in m for m in debug), debug


def test_errors_from_background_threads_and_stages_carry_no_source_location(tmp_path):
    from ettkit import startup

    graph = startup.StageGraph(recorder=None)

    def bad_stage():
        ett.Recorder(tmp_path, flush_interval_s=0.0)  # a C++ InvalidArgument inside a stage

    graph.add("device_init", bad_stage)
    with pytest.raises(ettkit.StageError) as raised:
        graph.run()
    assert "device_init" in str(raised.value) and ".cpp" not in str(raised.value)
    assert "flush_interval_s" in str(raised.value.__cause__) and ".cpp" not in str(raised.value.__cause__)
