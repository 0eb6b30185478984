"""Every `python -m` entry point of the repo starts: `--help` exits 0.

A module-level name that moved (a constant used only in argparse setup) passes every import-time check and
every unit test, then breaks `make up` inside the container; running each main's `--help` catches it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


# One interpreter loads what nearly every entry point imports (torch alone takes seconds of CPU), then forks a
# child per entry point that runs it as `python -m` would (runpy as __main__, fresh argv, its own stdout/stderr):
# a subprocess per entry point spent most of ~30 s of CPU importing torch again and again.
HELP_RUNNER = """
import json, os, runpy, sys, tempfile, traceback
import grpc, numba, numpy, torch
out = {}
for module in sys.argv[1:]:
    with tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
        pid = os.fork()
        if pid == 0:
            os.dup2(o.fileno(), 1)
            os.dup2(e.fileno(), 2)
            code = 1
            try:
                sys.argv = [module, "--help"]
                runpy.run_module(module, run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        o.seek(0)
        e.seek(0)
        out[module] = [code, o.read().decode(errors="replace"), e.read().decode(errors="replace")]
print(json.dumps(out))
"""


def run_helps(modules: list[str]) -> dict[str, subprocess.CompletedProcess]:
    env = {**os.environ, "COLUMNS": "200"}
    run = subprocess.run([sys.executable, "-c", HELP_RUNNER, *modules], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return {m: subprocess.CompletedProcess([m, "--help"], code, stdout, stderr)
            for m, (code, stdout, stderr) in json.loads(run.stdout.splitlines()[-1]).items()}


@pytest.fixture(scope="module")
def helps(request) -> dict[str, subprocess.CompletedProcess]:
    """The `--help` of every entry point this session tests."""
    selected = [item.callspec.params["module"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_help_exits_zero"]
    return run_helps(selected)


@pytest.mark.parametrize("module", entry_points())
def test_help_exits_zero(helps, module):
    out = helps[module]
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
