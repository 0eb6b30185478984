"""Every flag has a `--help` line: each `add_argument(...)` call that defines an option, in every Python file of the
repo's own folders, passes a non-empty `help=`. An AST scan, so it covers entry points that no test runs (benchmarks,
build tools, the Locust file); the servers' config-driven flags are checked at run time by test_flags_help.py."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The repo's own folders, as tests/ops/test_layout.py lists them; protoc's *_pb2* modules are generated.
FOLDERS = ("ragcore", "retrieval_service", "generation_service", "gateway", "tools", "proto", "bench", "loadtests",
           "tests")


def _files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if "_pb2" not in p.name)


def _is_positional(name: ast.expr) -> bool:
    return isinstance(name, ast.Constant) and isinstance(name.value, str) and not name.value.startswith("-")


def _has_help(call: ast.Call) -> bool:
    """help= is given and, when a literal, non-blank. A computed help (a lookup, an f-string, argparse.SUPPRESS)
    counts as given: the scan cannot evaluate it."""
    value = next((k.value for k in call.keywords if k.arg == "help"), None)
    if value is None:
        return False
    if isinstance(value, ast.Constant):
        return isinstance(value.value, str) and bool(value.value.strip())
    return True


def options(source: str) -> list[tuple[int, str, bool]]:
    """(line, flag, has help?) of every add_argument call of `source` that defines an option. A flag name that is
    computed (not a literal) counts as an option; only literal names without a leading '-' are positionals."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        if all(_is_positional(a) for a in node.args):  # also a call without names: nothing to describe
            continue
        names = [a.value if isinstance(a, ast.Constant) else ast.unparse(a) for a in node.args]
        found.append((node.lineno, max(names, key=len), _has_help(node)))  # the long name: "--out", not "-o"
    return sorted(found)


def missing_help(source: str) -> list[tuple[int, str]]:
    return [(line, flag) for line, flag, ok in options(source) if not ok]


def _argparse_missing(source: str) -> int:
    """Brute force: run the snippet on a real parser; options whose help argparse holds blank or None."""
    ap = argparse.ArgumentParser(add_help=False)
    exec(source, {"ap": ap, "g": ap.add_argument_group("g"), "argparse": argparse, "name": "out", "text": "t"})
    return sum(1 for a in ap._actions
               if a.option_strings and a.help is not argparse.SUPPRESS and not (a.help or "").strip())


# (source, expected (line, flag) findings)
CASES = [
    ('ap.add_argument("--out", help="file to write")', []),
    ('ap.add_argument("--out")', [(1, "--out")]),                            # no help at all
    ('ap.add_argument("--out", help="")', [(1, "--out")]),                   # help that says nothing
    ('ap.add_argument("--out", help="  ")', [(1, "--out")]),
    ('ap.add_argument("--out", help=None)', [(1, "--out")]),
    ('ap.add_argument("--out", default="x", help="file (default %(default)s)")', []),
    ('g.add_argument("-o", "--out", type=int)', [(1, "--out")]),             # an argument group; the long name
    ('ap.add_argument("runs", nargs="+")', []),                              # a positional: Not an option
    ('ap.add_argument("--" + name, help=text)', []),                         # computed help: Not flagged
    ('ap.add_argument("--" + name)', [(1, "'--' + name")]),                  # computed name: still an option
    ('ap.add_argument("--x", help=argparse.SUPPRESS)', []),                  # deliberately hidden
    ('ap.add_argument_group("g")', []),                                      # Not add_argument
    ('ap.add_argument("--a", help="a")\nap.add_argument(\n    "--b",\n    type=int)', [(2, "--b")]),
]


@pytest.mark.parametrize("source, expected", CASES, ids=[c[0].replace("\n", " ")[:48] for c in CASES])
def test_checker(source, expected):
    assert missing_help(source) == expected
    assert _argparse_missing(source) == len(expected)  # argparse itself agrees with the expected answer


def test_every_option_has_help():
    files = _files()
    assert len(files) > 100  # the walk found the repo
    found = {p: options(p.read_text()) for p in files}
    assert sum(map(len, found.values())) > 200  # the scan sees the options, it does not pass by seeing none
    bad = [f"{p.relative_to(ROOT)}:{line}: {flag}" for p, opts in found.items() for line, flag, ok in opts if not ok]
    assert not bad, "options without a help= text (every flag has a --help line):\n" + "\n".join(bad)
