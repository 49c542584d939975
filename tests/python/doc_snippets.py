"""The code blocks of README.md and docs/*.md, with the directives that say how test_doc_snippets.py runs them.

Every fenced block names its language. ``text`` blocks (diagrams, sample output, formulas) are not code;
every other block is run by test_doc_snippets.py, unless the HTML comment on the line right above its fence
says why it cannot run here. That comment is a directive, invisible on GitHub::

    <!-- snippet: skip: <why this block cannot run on a CPU test machine> -->
    <!-- snippet: env ranks 2; replace 'RUN_DIR' '"$RUN_DIR"'; check <python expression or shell command> -->

Clauses, separated by ``;`` (``skip:`` takes the rest of the comment as its reason):

- ``env NAME [ARG]``: the setup the block runs in (doc_snippet_env.py). Python: ``trainer`` (default: a small
  CPU model, optimizer, scheduler, loader and the helpers the snippets call), ``ranks N`` (the trainer
  setup in N gloo processes, the process group initialised), ``bare`` (nothing). Bash: ``tmp`` (default: an
  empty directory), ``repo`` (the repository root), ``ledger`` (``$RUN_DIR`` holds the worked example's
  ledger). C++: ``main`` (default: the block is the body of ``main()``; its ``#include`` and
  ``namespace x = y;`` lines go above), ``program`` (the block is a whole program), ``startup`` (``main``
  plus the names the StageGraph example uses). CMake blocks are pasted into the CMakeLists.txt that builds
  every C++ block, after ``add_executable(trainer ...)``.
- ``replace 'OLD' 'NEW'``: a textual substitution before the run (placeholders such as ``RUN_DIR``, or
  ``"nccl"`` on a machine without a GPU); the directive shows the reader exactly what differs.
- ``check EXPR``: after the block, a Python expression over the block's names that must be true (a shell
  command that must succeed, for bash).
- ``continues``: run after the previous Python block of the same file, in the same process.
- ``compile-only: <why>``: C++ only; built, not run.
- ``output``: on a ``text`` block: it must equal what the previous block printed (stripped lines).
- ``needs MODULE``: Python only; the block needs an optional package (``torchrec``): it skips, saying so,
  where the package is not installed for this torch (torchrec_gate.py; never where `make build` installed it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from typing import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LANGUAGES = {"python", "bash", "cpp", "cmake", "json", "text"}
_FENCE = re.compile(r"^(\s*)(`{3,})([\w+-]*)\s*$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass
class Snippet:
    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    env: list[str] = dataclasses.field(default_factory=list)
    replaces: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    checks: list[str] = dataclasses.field(default_factory=list)
    skip: str | None = None
    compile_only: str | None = None
    continues: bool = False
    output: bool = False
    needs: list[str] = dataclasses.field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    def prepared(self) -> str:
        code = self.code
        for old, new in self.replaces:
            if old not in code:
                raise ValueError(f"{self.id}: replace {old!r}: the block does not contain it")
            code = code.replace(old, new)
        return code


def _split_clauses(text: str) -> list[str]:
    """Splits at ``;`` outside single and double quotes (a check may hold a quoted one-line program)."""
    clauses, current, quote = [], [], None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == ";":
            clauses.append("".join(current))
            current = []
            continue
        current.append(ch)
    return [*clauses, "".join(current)]


def _parse_directive(text: str, where: str, snippet: Snippet) -> None:
    if text.startswith("skip:"):
        snippet.skip = text[len("skip:"):].strip()
        if not snippet.skip:
            raise ValueError(f"{where}: 'skip:' needs a reason")
        return
    for clause in filter(None, (c.strip() for c in _split_clauses(text))):
        word, _, rest = clause.partition(" ")
        if word == "env":
            snippet.env = rest.split()
        elif word == "replace":
            parts = shlex.split(rest)
            if len(parts) != 2:
                raise ValueError(f"{where}: replace takes 'OLD' 'NEW', got {rest!r}")
            snippet.replaces.append((parts[0], parts[1]))
        elif word == "check":
            snippet.checks.append(rest)
        elif word == "continues":
            snippet.continues = True
        elif word == "output":
            snippet.output = True
        elif word == "needs":
            snippet.needs.append(rest.strip())
        elif word == "compile-only:":
            snippet.compile_only = rest.strip() or None
            if not snippet.compile_only:
                raise ValueError(f"{where}: 'compile-only:' needs a reason")
        else:
            raise ValueError(f"{where}: unknown snippet clause {word!r} (env, replace, check, continues, output, "
                             "needs, compile-only:, skip:)")


def doc_files() -> list[str]:
    docs = sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md"))
    return ["README.md", *docs]


def snippets_of(path: str) -> Iterator[Snippet]:
    lines = open(os.path.join(REPO, path), encoding="utf-8").read().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        close = re.compile(r"^\s*" + m.group(2) + r"\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: code block is never closed")
        indent = len(m.group(1))
        body = "\n".join(line[indent:] if line[:indent].isspace() else line for line in lines[i + 1:j])
        snippet = Snippet(path, i + 1, m.group(3), body + "\n")
        d = _DIRECTIVE.match(lines[i - 1]) if i > 0 else None
        if d:
            _parse_directive(d.group(1), f"{path}:{i}", snippet)
        yield snippet
        i = j + 1


def all_snippets() -> list[Snippet]:
    return [s for path in doc_files() for s in snippets_of(path)]


if __name__ == "__main__":  # python tests/python/doc_snippets.py: every block and how it is run
    for s in all_snippets():
        how = f"skip: {s.skip}" if s.skip else " ".join(s.env) or "default"
        print(f"{s.id:28} {s.lang or '(none)':7} {how}")
