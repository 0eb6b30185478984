"""Every `python -m bench.X` entry point is run by some test at a tiny size, so an import or flag break fails
`make test` instead of the next real run. The ones still without such a test are listed here, by name: the list
may only shrink (a bench that gains a smoke test must leave it), and a new bench cannot join it silently."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Entry points whose main() no test runs yet (none: every bench has one; bench.contention's runs in the slow tier,
# three service start-ups being its point).
WITHOUT_SMOKE_TEST: frozenset[str] = frozenset()


def entry_points(root: Path = ROOT) -> set[str]:
    return {p.stem for p in (root / "bench").glob("*.py")
            if re.search(r"^if __name__ == \"__main__\":", p.read_text(), re.M)}


def smoke_tested(root: Path = ROOT) -> set[str]:
    """Benches whose main() a test calls, or whose module a test runs with -m."""
    found = set()
    for path in (root / "tests").rglob("*.py"):
        text = path.read_text()
        called = set(re.findall(r"\b(\w+)\.main\(", text))
        aliases = dict((alias, name) for name, alias in re.findall(r"from bench import (\w+) as (\w+)", text))
        found |= {aliases.get(c, c) for c in called}
        found |= {m for pair in re.findall(r"\"bench\.(\w+)\"|bench\.(\w+) import main", text) for m in pair if m}
    return found


def test_the_scan_finds_the_entry_points():
    points = entry_points()
    assert {"step", "report", "draft_retrieval", "serving"} <= points
    assert "load_stats" not in points and "crest_stores" not in points  # libraries, Not entry points


def test_every_entry_point_has_a_smoke_test():
    points, tested = entry_points(), smoke_tested()
    missing = sorted(points - tested - WITHOUT_SMOKE_TEST)
    assert missing == [], f"bench entry points without a smoke test in tests/: {missing}"


def test_the_list_of_exceptions_only_shrinks():
    points, tested = entry_points(), smoke_tested()
    stale = sorted(WITHOUT_SMOKE_TEST & tested) + sorted(WITHOUT_SMOKE_TEST - points)
    assert stale == [], f"remove from WITHOUT_SMOKE_TEST (tested now, or gone): {stale}"
