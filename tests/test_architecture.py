"""The package structure ``docs/ARCHITECTURE.md`` describes, checked on the source tree.

- the serving core (every package but the research ones, and the top-level modules) keeps files
  under 500 lines and functions under 80;
- nothing in the serving core imports research code (``bench``, ``eval``, ``train``);
- no import cycles between packages;
- the offloading core names no selection policy (policies plug in through
  ``herald.offload.policies``);
- comments and docs cite nothing outside the repository.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "herald"
RESEARCH = {"bench", "eval", "train"}
NOT_CORE = RESEARCH | {"cli"}  # the command line registers the research subcommands
OFFLOAD_CORE = ["offload/engine.py", "offload/prefill.py", "offload/handoff.py"]
POLICY_NAMES = re.compile(r"herald|mage|infinigen|proxy|representative", re.IGNORECASE)
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80


def _package(path: Path) -> str:
    """``herald.<first part>`` of a source file (a top-level module is its own package)."""
    first = path.relative_to(ROOT).parts[0]
    return "herald." + first.removesuffix(".py")


def _core_files() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if _package(p).split(".")[1] not in NOT_CORE]


def _imports(tree: ast.AST) -> list[str]:
    """Every module an ``import`` / ``from ... import`` names, at any depth."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_core_files_and_functions_are_small() -> None:
    too_long = []
    for path in _core_files():
        src = path.read_text()
        if src.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n}")
    assert not too_long


def test_serving_core_never_imports_research_code() -> None:
    bad = []
    for path in _core_files():
        for name in _imports(ast.parse(path.read_text())):
            parts = name.split(".")
            if parts[0] == "herald" and len(parts) > 1 and parts[1] in RESEARCH:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    packages = {_package(p) for p in ROOT.rglob("*.py")}
    for path in ROOT.rglob("*.py"):
        src = _package(path)
        for name in _imports(ast.parse(path.read_text())):
            parts = name.split(".")
            dst = ".".join(parts[:2])
            if parts[0] == "herald" and len(parts) > 1 and dst in packages and dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


def test_no_import_cycles_between_packages() -> None:
    graph = _package_graph()
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in stack:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif len(stack) < 20:
                visit(nxt, [*stack, nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, cycles[:3]


def test_the_graph_check_sees_a_cycle() -> None:
    """The cycle check is not vacuous: the tree's real edges include engine -> kv."""
    assert "herald.kv" in _package_graph()["herald.engine"]


@pytest.mark.parametrize("rel", OFFLOAD_CORE)
def test_offload_core_names_no_policy(rel: str) -> None:
    """Identifiers and string literals (docstrings aside) of the core never name a policy."""
    tree = ast.parse((ROOT / rel).read_text())
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    named = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        text = None
        if isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            text = node.name
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = None if id(node) in docstrings else node.value
        if text and POLICY_NAMES.search(text):
            named.append(text)
    assert not named


EXTERNAL = re.compile(
    r"DESIGN §|DESIGN\.md|model spec|model-specs|device\.md|PERF\.md|STYLE\.md|shared/|"
    r"\bissue \d+|\bissues? #\d+"
)


def test_comments_and_docs_cite_nothing_outside_the_repository() -> None:
    bad = []
    files = [*ROOT.rglob("*.py"), *ROOT.rglob("*.cpp"), *ROOT.rglob("*.h")]
    docs = Path(__file__).resolve().parents[1] / "docs"
    files += [*docs.glob("*.md"), docs.parent / "README.md"]
    for path in files:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if EXTERNAL.search(line):
                bad.append(f"{path.name}:{i}: {line.strip()[:80]}")
    assert not bad, f"{len(bad)} lines, e.g. {bad[:5]}"


def test_the_citation_check_is_not_vacuous() -> None:
    assert EXTERNAL.search("see DESIGN §2") and EXTERNAL.search("(issue 6)")
    assert not EXTERNAL.search("HERALD §IV-B1")
