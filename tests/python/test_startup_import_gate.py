"""The import gate (ettkit.startup.serialized_imports, opened by StageGraph.run): threads that import the two ends
of one import cycle cannot deadlock.

Each test writes its own modules into a fresh directory on sys.path. Their bodies make the interleaving that
deadlocks CPython certain instead of likely: a package's body waits until another thread that imports its
submodule waits for the package, or is held back by the gate. Without the gate, CPython raises _DeadlockError in one thread every
time (test_the_cycle_deadlocks_without_the_gate proves the test can fail)."""

from __future__ import annotations

import importlib
import importlib._bootstrap as bootstrap
import os
import sys
import textwrap
import threading
import time
import types
import uuid
import warnings

import pytest
from ettkit.startup import StageGraph, import_gate, serialized_imports

DEADLINE_S = 60.0  # a bound on every wait of these tests: reached only when the code under test is broken


def _wait_until(predicate, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _blocked_on(ident: int) -> list:
    """The names of the module locks thread ``ident`` waits for (CPython 3.11: one lock; 3.12+: a list)."""
    entry = bootstrap._blocking_on.get(ident)
    locks = entry if isinstance(entry, list) else ([] if entry is None else [entry])
    return [getattr(lock, "name", None) for lock in locks]


class Cycle:
    """torch's shape: module ``x`` imports ``pkg.sub``; package ``pkg``'s ``__init__`` imports ``x``. Thread A
    imports ``x`` and holds its lock while the body runs. Thread B imports ``pkg.sub``: it takes the
    submodule's lock, then imports ``pkg``, whose body waits for ``x``. The body of ``x`` waits until B is
    blocked there (or held at the gate), then imports ``pkg.sub``: without the gate, A and B now wait for each
    other and CPython raises ``_DeadlockError`` in A, every time. (``torch._dynamo`` against
    ``torch._inductor.runtime.cache_dir_utils`` is this cycle.)"""

    def __init__(self, tmp_path):
        self.prefix = "ettcycle_" + uuid.uuid4().hex[:12]
        self.ctl = types.SimpleNamespace(started=threading.Event(), b_ident=None, wait_for_b=self._wait_for_b)
        sys.modules[self.prefix + "_ctl"] = self.ctl
        (tmp_path / f"{self.prefix}_x.py").write_text(
            textwrap.dedent(f"""
                import sys
                ctl = sys.modules["{self.prefix}_ctl"]
                ctl.started.set()
                ctl.wait_for_b()
                import {self.prefix}_pkg.sub
                VALUE = "x+" + {self.prefix}_pkg.sub.VALUE
            """)
        )
        pkg = tmp_path / f"{self.prefix}_pkg"
        pkg.mkdir()
        (pkg / "__init__.py").write_text(f"import {self.prefix}_x\n")
        (pkg / "sub.py").write_text("VALUE = 'sub'\n")
        sys.path.insert(0, str(tmp_path))
        importlib.invalidate_caches()

    def _wait_for_b(self) -> None:
        _wait_until(
            lambda: self.ctl.b_ident is not None
            and (f"{self.prefix}_x" in _blocked_on(self.ctl.b_ident) or import_gate.waiting_for_testing() > 0),
            "thread B to wait for x's lock, or at the gate",
        )

    def name(self, which: str) -> str:
        return f"{self.prefix}_x" if which == "a" else f"{self.prefix}_pkg.sub"

    def import_b(self) -> str:
        """Thread B's import: after A is inside the package's body."""
        assert self.ctl.started.wait(DEADLINE_S)
        self.ctl.b_ident = threading.get_ident()
        return importlib.import_module(self.name("b")).VALUE

    def import_both(self) -> dict:
        """Imports on two threads; returns {thread: repr(exception)} for those that failed."""
        errors = {}

        def run(fn):
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - what the test looks at
                errors[fn.__name__] = repr(exc)

        def import_a():
            importlib.import_module(self.name("a"))

        threads = [threading.Thread(target=run, args=(fn,)) for fn in (import_a, self.import_b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
            assert not t.is_alive(), "an import thread hung"
        return errors

    def cleanup(self, tmp_path) -> None:
        for key in [k for k in sys.modules if k.startswith(self.prefix)]:
            del sys.modules[key]
        sys.path.remove(str(tmp_path))


@pytest.fixture
def cycle(tmp_path):
    c = Cycle(tmp_path)
    yield c
    c.cleanup(tmp_path)


def test_the_cycle_deadlocks_without_the_gate(cycle):
    # The premise: without the gate, CPython 3.11/3.12 raises _DeadlockError in one of the two threads.
    if sys.version_info >= (3, 13):
        pytest.skip("CPython 3.13 tolerates concurrent circular imports")
    errors = cycle.import_both()
    assert list(errors) == ["import_a"] and "_DeadlockError" in errors["import_a"], errors


def test_the_cycle_imports_under_the_gate(cycle):
    with serialized_imports():
        errors = cycle.import_both()
    assert errors == {}
    assert sys.modules[cycle.name("a")].VALUE == "x+sub"


def test_stage_graph_runs_stages_that_import_the_cycle(cycle):
    graph = StageGraph(max_workers=2, recorder=None)
    graph.add("import_a", lambda: importlib.import_module(cycle.name("a")).VALUE)
    graph.add("import_b", cycle.import_b)
    graph.run()
    assert graph.results == {"import_a": "x+sub", "import_b": "sub"}
    assert not import_gate.gate_open(), "the gate must close when run() returns"


def test_the_gate_is_removed_when_the_last_block_closes():
    before = bootstrap._find_and_load
    with serialized_imports():
        assert bootstrap._find_and_load is not before
        with serialized_imports():  # re-entrant
            assert import_gate.gate_open()
        assert import_gate.gate_open()
    assert not import_gate.gate_open()
    assert bootstrap._find_and_load is before


def test_a_module_lock_taken_before_the_gate_opened_does_not_hang(tmp_path):
    # Thread B is inside module m's body when the gate opens; thread A then takes the gate for module n, whose
    # body imports m and so waits for B's module lock. B's next first-time import finds the gate held by a
    # thread that waits for B: B imports without the gate (CPython's rules), m finishes, and so does n.
    prefix = "ettgate_" + uuid.uuid4().hex[:12]
    go = threading.Event()
    m_started = threading.Event()
    sys.modules[prefix + "_ctl"] = types.SimpleNamespace(go=go, m_started=m_started)
    (tmp_path / f"{prefix}_m.py").write_text(
        f"import sys\nctl = sys.modules['{prefix}_ctl']\nctl.m_started.set()\nctl.go.wait({DEADLINE_S})\n"
        f"import {prefix}_p\nVALUE = {prefix}_p.VALUE + 1\n"
    )
    (tmp_path / f"{prefix}_n.py").write_text(f"import {prefix}_m\nVALUE = {prefix}_m.VALUE + 1\n")
    (tmp_path / f"{prefix}_p.py").write_text("VALUE = 1\n")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    results, errors = {}, []

    def importer(name):
        try:
            results[name] = importlib.import_module(name).VALUE
        except BaseException as exc:  # noqa: BLE001
            errors.append(repr(exc))

    try:
        b = threading.Thread(target=importer, args=(prefix + "_m",))
        b.start()
        assert m_started.wait(DEADLINE_S)
        with serialized_imports():
            a = threading.Thread(target=importer, args=(prefix + "_n",))
            a.start()
            _wait_until(lambda: a.ident in bootstrap._blocking_on, "thread A to wait for m's module lock")
            go.set()
            for t in (a, b):
                t.join(DEADLINE_S)
                assert not t.is_alive(), "an import hung"
    finally:
        sys.path.remove(str(tmp_path))
        for key in [k for k in sys.modules if k.startswith(prefix)]:
            del sys.modules[key]
    assert errors == []
    assert results == {prefix + "_m": 2, prefix + "_n": 3}


def test_a_module_body_that_waits_for_another_threads_import_is_slow_not_hung(tmp_path, monkeypatch):
    # The one wait the gate adds: module q's body (imported under the gate) joins a thread that imports r.
    # That thread gives up waiting after ETTKIT_IMPORT_GATE_TIMEOUT_S, warns naming both modules, imports r.
    monkeypatch.setenv("ETTKIT_IMPORT_GATE_TIMEOUT_S", "0.5")
    prefix = "ettgate_" + uuid.uuid4().hex[:12]
    (tmp_path / f"{prefix}_r.py").write_text("VALUE = 'r'\n")
    (tmp_path / f"{prefix}_q.py").write_text(
        textwrap.dedent(f"""
            import importlib, threading
            got = []
            t = threading.Thread(target=lambda: got.append(importlib.import_module("{prefix}_r").VALUE))
            t.start()
            t.join({DEADLINE_S})
            VALUE = got[0]
        """)
    )
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        with warnings.catch_warnings(record=True) as caught, serialized_imports():
            warnings.simplefilter("always")
            value = importlib.import_module(prefix + "_q").VALUE
    finally:
        sys.path.remove(str(tmp_path))
        for key in [k for k in sys.modules if k.startswith(prefix)]:
            del sys.modules[key]
    assert value == "r"
    texts = [str(w.message) for w in caught if "import gate" in str(w.message)]
    assert len(texts) == 1, [str(w.message) for w in caught]
    assert f"'{prefix}_r'" in texts[0] and f"'{prefix}_q'" in texts[0]


def test_a_bad_timeout_setting_warns_and_uses_the_default(monkeypatch):
    monkeypatch.setenv("ETTKIT_IMPORT_GATE_TIMEOUT_S", "soon")
    with pytest.warns(RuntimeWarning, match="ETTKIT_IMPORT_GATE_TIMEOUT_S='soon' is not a positive number"):
        assert import_gate._timeout_s() == 120.0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_with_the_gate_closed():
    # A DataLoader worker forked while the gate is open (iter(loader) in a forking stage) must not inherit a
    # gate whose lock a thread of the parent may hold.
    original = bootstrap._find_and_load
    with serialized_imports():
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only if the gate is closed and the hook removed
            ok = not import_gate.gate_open() and bootstrap._find_and_load is original
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
