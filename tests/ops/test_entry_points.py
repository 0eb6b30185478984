"""Every `python -m` entry point of the repo starts: `--help` exits 0.

A module-level name that moved (a constant used only in argparse setup) passes every import-time check and
every unit test, then breaks `make up` inside the container; running each main's `--help` catches it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ragcore", "retrieval_service", "generation_service", "gateway", "tools", "bench", "loadtests")


def entry_points() -> list[str]:
    """Dotted names of every module with a `__main__` block in the product and bench packages."""
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if 'if __name__ == "__main__"' in path.read_text(encoding="utf-8"):
                found.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return found


def test_discovery_finds_the_servers():
    names = entry_points()
    assert "retrieval_service.server" in names and "generation_service.server" in names
    assert "retrieval_service.knowledge.build" in names  # the one that once broke only in the container
    assert not any(n.startswith("tests.") for n in names)


def run_help(module: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=180)


@pytest.fixture(scope="module")
def helps(request) -> Iterator[dict[str, Future]]:
    """The `--help` of every entry point this session tests, started at once on as many processes as there are
    cores: each spends ~3 s importing torch and friends; one after another they took ~50 s of the suite, two at a
    time ~30."""
    selected = [item.callspec.params["module"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_help_exits_zero"]
    pool = ThreadPoolExecutor(max_workers=max(1, len(os.sched_getaffinity(0))))
    yield {m: pool.submit(run_help, m) for m in selected}
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("module", entry_points())
def test_help_exits_zero(helps, module):
    out = helps[module].result()
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout.lower(), out.stdout[:500]


# The worker's libgomp spin count (ragcore.process.worker_openmp_spin): libgomp reads it once, when torch loads
# it, so what matters is its value at torch's first import. (scenario, GOMP_SPINCOUNT given, run as, expected)
SPIN = [
    ("the entry point's default", None, "__main__", "30000"),
    ("the user's value wins", "500", "__main__", "500"),
    ("imported as a library: the environment untouched", None, "generation_service.server", "None"),
]
SPIN_PROBE = """
import builtins, os, runpy, sys
sys.argv = ["generation_service.server", "--help"]
seen, real = {}, builtins.__import__
def spy(name, *args, **kwargs):
    if name == "torch" and "torch" not in sys.modules and "spin" not in seen:
        seen["spin"] = os.environ.get("GOMP_SPINCOUNT")
    return real(name, *args, **kwargs)
builtins.__import__ = spy
try:
    runpy.run_module("generation_service.server", run_name=RUN_AS, alter_sys=True)
except SystemExit:
    pass
print(seen.get("spin", "torch imported elsewhere"))
"""


@pytest.mark.parametrize("scenario, given, run_as, expected", SPIN, ids=[c[0] for c in SPIN])
def test_worker_sets_the_openmp_spin_before_torch_loads(scenario, given, run_as, expected):
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    code = SPIN_PROBE.replace("RUN_AS", repr(run_as))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expected, scenario
