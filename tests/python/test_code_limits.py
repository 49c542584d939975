"""Size and shape limits of the Python package (issue #64), read from the source: no module over 600 lines, no
function over 80 lines, no import cycle among ettkit's modules.

The source is parsed with ``ast``, never imported, so the test runs without the built extension and says
which file breaks a limit rather than what importing it did.

Import cycles: every import is an edge, at module level or inside a function (a function-level import
that closes a cycle only defers it: the two modules still need each other, which is what #64 asks to break),
except imports under ``if TYPE_CHECKING:``, which never run. Relative imports are resolved against
the importing module's package. ``from . import x`` is an edge to the submodule ``x`` when ``x`` is one, else
to the package itself (its ``__init__``: a submodule that reads a name from its package's ``__init__`` is a
back-edge, and a cycle when that ``__init__`` imports it); ``from .a import b`` is an edge to ``a.b`` when
that is a submodule, else to ``a``. The parent packages Python loads before a submodule are not edges: a
package's ``__init__`` importing its own submodules is the normal shape, not a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from graph_cycles import cycles

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "ettkit"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80

# Functions allowed over MAX_FUNCTION_LINES: only tables of error messages, where one entry per line reads
# better than a split. Each entry: ("path/relative/to/python/ettkit.py", "qualified.function", "why").
# Empty: no table has needed it.
FUNCTION_LENGTH_ALLOWED: list[tuple[str, str, str]] = []

# Modules of the package that have no .py in the tree: the pybind11 extension built from python/csrc. An
# import of one is a leaf (it imports no Python module of ettkit), not a read from the package's __init__.
EXTENSION_MODULES = {"ettkit._C"}


def _sources(package: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _long_functions(path: Path) -> list[tuple[str, int]]:
    """``(qualified name, lines)`` of every function or method in ``path`` longer than the limit; a
    function's lines are ``end_lineno - lineno + 1`` (nested functions count in their parent too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = child.end_lineno - child.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        found.append((name, lines))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_no_module_is_over_the_line_limit():
    over = {_rel(p): n for p in _sources() if (n := _line_count(p)) > MAX_FILE_LINES}
    assert not over, f"modules over {MAX_FILE_LINES} lines (split them by what they do): {over}"


def test_no_function_is_over_the_line_limit():
    allowed = {(path, name) for path, name, _ in FUNCTION_LENGTH_ALLOWED}
    over = {
        f"{_rel(p)}::{name}": lines
        for p in _sources()
        for name, lines in _long_functions(p)
        if (_rel(p), name) not in allowed
    }
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"


def test_the_allow_list_names_only_functions_that_exist_and_need_it():
    for path, name, why in FUNCTION_LENGTH_ALLOWED:
        assert why, f"{path}::{name}: say why it may be long (an error-message table)"
        assert name in dict(_long_functions(PACKAGE / path)), f"{path}::{name} is not over the limit: drop it"


# ---- import cycles ---------------------------------------------------------------------------------------


def _module_name(path: Path, package: Path) -> str:
    parts = ["ettkit", *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import of the module, at module level or in a function, except under ``if TYPE_CHECKING:``."""
    found: list = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]))
            else:
                visit(child)

    visit(tree)
    return found


def _import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the ettkit modules its imports load (see the module docstring)."""
    files = {_module_name(p, package): p for p in _sources(package)}
    modules = set(files) | EXTENSION_MODULES
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    base_name = ".".join(base + ([node.module] if node.module else []))
                else:
                    base_name = node.module or ""
                # A name that is a submodule loads that submodule; any other name is read from base's module
                # (a package's __init__ included: a submodule that does that waits on its package).
                targets = [f"{base_name}.{a.name}" if f"{base_name}.{a.name}" in modules else base_name
                           for a in node.names]
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def _a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One closed path through ``component``, for the failure message: a -> b -> ... -> a."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    node = start
    while True:
        following = sorted(graph[node] & members)
        if start in following and len(path) > 1:
            return path + [start]
        nxt = next((m for m in following if m not in seen), None)
        if nxt is None:
            return path + [following[0]] if following else path
        path.append(nxt)
        seen.add(nxt)
        node = nxt


def test_the_cycle_finder_finds_a_cycle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert _a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_resolve_to_ettkit_modules():
    graph = _import_graph()
    # startup/__init__.py: "from .cache import CompileCache" is an edge to ettkit.startup.cache.
    assert "ettkit.startup.cache" in graph["ettkit.startup"]
    # ett/live.py: "from ..errors import InvalidArgumentError" resolves two levels up.
    assert "ettkit.errors" in graph["ettkit.ett.live"]


def test_a_cycle_through_a_function_level_import_or_a_package_init_is_found(tmp_path):
    # The two shapes #64 found in the checkpoint package: a ↔ b through an import inside a function, and a
    # submodule reading a name from its package's __init__, which imports it. TYPE_CHECKING imports never run.
    package = tmp_path / "ettkit"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import errors\n")
    (package / "errors.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .reader import read\n")
    (package / "sub" / "reader.py").write_text("def read():\n    from . import latest\n")
    (package / "sub" / "walk.py").write_text("from . import kinds\nfrom ..errors import Error\n")
    (package / "sub" / "kinds.py").write_text("def f():\n    from .walk import g\n")
    (package / "sub" / "plan.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import kinds\n"
        "from ettkit.sub import walk\n")
    graph = _import_graph(package)
    assert graph["ettkit.sub.walk"] == {"ettkit.sub.kinds", "ettkit.errors"}
    assert graph["ettkit.sub.plan"] == {"ettkit.sub.walk"}
    assert graph["ettkit"] == {"ettkit.errors"}
    assert cycles(graph) == [["ettkit.sub", "ettkit.sub.reader"], ["ettkit.sub.kinds", "ettkit.sub.walk"]]


def test_no_import_cycle_among_ettkit_modules():
    graph = _import_graph()
    found = [" -> ".join(_a_cycle(graph, c)) for c in cycles(graph)]
    assert not found, "import cycles among ettkit's modules:\n  " + "\n  ".join(found)


if __name__ == "__main__":  # a quick look without pytest: python tests/python/test_code_limits.py
    raise SystemExit(pytest.main([__file__, "-q"]))
