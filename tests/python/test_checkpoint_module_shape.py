"""The shape of the Python checkpoint layer (issue #64): its modules import one another without a cycle and
never reach back into the package's ``__init__`` (the facade imports them, not the other way round), no file
is over 600 lines and no function over 80. Read from the sources, nothing imported: a module that grew back
fails here naming itself."""

from __future__ import annotations

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "python", "ettkit", "checkpoint")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80


def _modules() -> dict[str, ast.Module]:
    out = {}
    for name in sorted(os.listdir(PACKAGE)):
        if name.endswith(".py"):
            with open(os.path.join(PACKAGE, name)) as f:
                out[name[:-3]] = ast.parse(f.read(), name)
    return out


def _package_imports(tree: ast.Module, modules: set) -> set:
    """The modules of the package that `tree` imports (relative imports, at any depth: a lazy import is an
    edge too)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:  # from . import x: a module, or a name of the package's __init__
                out.update(a.name if a.name in modules else "__init__" for a in node.names)
    return out


def test_no_module_imports_in_a_cycle_or_back_into_the_facade():
    modules = _modules()
    edges = {m: _package_imports(t, set(modules)) for m, t in modules.items()}
    back = sorted(m for m, e in edges.items() if m != "__init__" and "__init__" in e)
    assert not back, f"modules importing the package's __init__: {back}"
    # Depth-first search for a cycle; the path names it.
    state: dict = {}

    def visit(m: str, path: list) -> None:
        state[m] = "open"
        for n in sorted(edges.get(m, ())):
            assert state.get(n) != "open", f"import cycle: {' -> '.join(path + [m, n])}"
            if n not in state:
                visit(n, path + [m])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [])


def test_the_save_walk_and_the_leaf_modules_import_no_load_code():
    # The leaf module of value kinds imports nothing of the package; the save walk knows nothing of loads.
    modules = _modules()
    assert _package_imports(modules["_tensor_kinds"], set(modules)) == set()
    assert not _package_imports(modules["_flatten"], set(modules)) & {"_restore", "_load_plan", "__init__"}


@pytest.mark.parametrize("name", sorted(_modules()))
def test_files_and_functions_stay_within_their_limits(name):
    with open(os.path.join(PACKAGE, name + ".py")) as f:
        lines = f.read().count("\n")
    assert lines <= MAX_FILE_LINES, f"{name}.py has {lines} lines"
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(_modules()[name])
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{name}.py: {long}"
