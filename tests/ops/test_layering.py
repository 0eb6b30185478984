"""The generation service's packages in layers, checked on the source: every import points down (or stays inside its
package), no two packages import each other round a cycle, and no module grows past MAX_LINES.

    config, metrics          leaf modules every layer may use (they import nothing of the service)
    model                    the target model, its weights, forward and kernels
    drafting                 draft trees and their budget (what the engine verifies)
    engine                   the model thread, the batching scheduler, steps, calibration, output streams
    augment                  what the retrieval-augmented modes share (KB client, OS³, round gate)
    ralm, knnlm              the retrieval-augmented modes (never each other)
    server, client           the top: the gRPC servicer and its client
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICE = "generation_service"
LAYERS: tuple[tuple[str, ...], ...] = (
    ("config", "metrics"),
    ("model",),
    ("drafting",),
    ("engine",),
    ("augment",),
    ("ralm", "knnlm"),
    ("server", "client", ""),  # "": the service package's own __init__
)
MAX_LINES = 800


def _part(module: str, service: str) -> str | None:
    """The package (or top-level module) of `service` a dotted module name belongs to; None outside the service."""
    parts = module.split(".")
    if parts[0] != service:
        return None
    return parts[1] if len(parts) > 1 else ""


def _imported(path: Path, service: str) -> list[tuple[str, int]]:
    """(module, line) for every import of the service from the file, at any depth; `from service import x` counts as
    importing service.x (a module or package of the service)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == service]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == service:
                found += [(f"{service}.{a.name}", node.lineno) for a in node.names]
            elif node.module.split(".")[0] == service:
                found.append((node.module, node.lineno))
    return found


def package_graph(root: Path, service: str = SERVICE) -> dict[str, dict[str, list[str]]]:
    """{package: {imported package: ["path:line", ...]}} over every .py file of root/service."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted((root / service).rglob("*.py")):
        if "_pb2" in path.name:
            continue
        rel = path.relative_to(root)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        src = _part(module, service)
        graph.setdefault(src, {})
        for name, line in _imported(path, service):
            dst = _part(name, service)
            if dst != src:
                graph[src].setdefault(dst, []).append(f"{rel}:{line}")
    return graph


def layer_violations(graph: dict[str, dict[str, list[str]]], layers=LAYERS) -> list[str]:
    """Imports that point up or sideways (same layer, other package), and packages no layer names."""
    rank = {pkg: i for i, layer in enumerate(layers) for pkg in layer}
    bad = [f"{pkg}: in no layer of LAYERS" for pkg in sorted(graph) if pkg not in rank]
    for src, targets in sorted(graph.items()):
        for dst, where in sorted(targets.items()):
            if src in rank and rank.get(dst, len(layers)) >= rank[src]:
                bad += [f"{w}: {src or SERVICE} imports {dst} (layer {rank.get(dst, '?')} >= {rank[src]})"
                        for w in where]
    return bad


def package_cycles(graph: dict[str, dict[str, list[str]]]) -> list[str]:
    """Packages that reach themselves through imports of other packages (brute force: search from each)."""
    on_cycle = []
    for start in sorted(graph):
        seen, todo = set(), list(graph[start])
        while todo:
            pkg = todo.pop()
            if pkg not in seen:
                seen.add(pkg)
                todo += graph.get(pkg, {})
        if start in seen:
            on_cycle.append(start)
    return on_cycle


def long_modules(root: Path, service: str = SERVICE, max_lines: int = MAX_LINES) -> list[str]:
    return [f"{p.relative_to(root)}: {n} lines" for p in sorted((root / service).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > max_lines]


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "svc" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


SYNTHETIC_LAYERS = (("model",), ("engine",), ("ralm", "knnlm"), ("server", ""))
CLEAN = {"__init__.py": "", "model/__init__.py": "", "model/forward.py": "import numpy\n",
         "engine/__init__.py": "", "engine/loop.py": "from svc.model.forward import x\n",
         "ralm/__init__.py": "", "ralm/loop.py": "from svc.engine import loop\nfrom svc.model import forward\n",
         "knnlm/__init__.py": "", "knnlm/loop.py": "from svc.engine.loop import y\n",
         "server.py": "from svc import ralm, knnlm\nfrom svc.engine.loop import z\n"}


@pytest.mark.parametrize("planted, expected", [
    ({}, []),  # Not a violation: every import points down
    ({"model/forward.py": "from svc.engine.loop import Step\n"},  # a planted upward import
     ["svc/model/forward.py:1: model imports engine (layer 1 >= 0)"]),
    ({"model/late.py": "def f():\n    from svc.server import main\n"},  # function-local imports count too
     ["svc/model/late.py:2: model imports server (layer 3 >= 0)"]),
    ({"engine/loop.py": "import svc.ralm.loop\n"},  # plain `import` form
     ["svc/engine/loop.py:1: engine imports ralm (layer 2 >= 1)"]),
    ({"knnlm/loop.py": "from svc import ralm\n"},  # sideways: two modes of one layer
     ["svc/knnlm/loop.py:1: knnlm imports ralm (layer 2 >= 2)"]),
    ({"drafting/__init__.py": ""}, ["drafting: in no layer of LAYERS"]),  # a new package must be placed
])
def test_checker_finds_planted_imports(tmp_path, planted, expected):
    root = _tree(tmp_path, {**CLEAN, **planted})
    assert layer_violations(package_graph(root, "svc"), SYNTHETIC_LAYERS) == expected


@pytest.mark.parametrize("planted, expected", [
    ({}, []),  # Not a cycle: a chain of layers
    ({"model/forward.py": "from svc.engine.loop import Step\n"}, ["engine", "model"]),  # model <-> engine
])
def test_cycle_checker(tmp_path, planted, expected):
    assert package_cycles(package_graph(_tree(tmp_path, {**CLEAN, **planted}), "svc")) == expected


def test_long_module_checker(tmp_path):
    root = _tree(tmp_path, {"short.py": "x = 1\n" * 3, "long.py": "x = 1\n" * 4})
    assert long_modules(root, "svc", max_lines=3) == ["svc/long.py: 4 lines"]  # Not short.py


def test_generation_service_imports_point_down():
    graph = package_graph(ROOT)
    assert {"model", "engine", "drafting", "ralm", "knnlm", "server"} <= set(graph)  # the walk found the packages
    assert layer_violations(graph) == []


def test_generation_service_has_no_package_cycles():
    assert package_cycles(package_graph(ROOT)) == []


def test_no_module_over_max_lines():
    assert long_modules(ROOT) == []  # C++ kernels are not Python modules: not counted
