"""No pickle anywhere in the package: loading a pickle runs arbitrary code, and our files (datastores, n-gram
stores, indexes, caches) come from volumes other people can write. Formats are raw arrays + JSON headers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["ragcore", "retrieval_service", "generation_service", "tools", "proto", "bench", "loadtests"]
FORBIDDEN = [
    (re.compile(r"^\s*(import|from)\s+(c?pickle|_pickle|dill|cloudpickle|shelve|joblib)\b", re.M), "pickle module"),
    (re.compile(r"\b(c?pickle|dill|cloudpickle|joblib)\.loads?\("), "pickle load"),
    (re.compile(r"allow_pickle\s*=\s*True"), "numpy allow_pickle=True"),
    (re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)"), "torch.load without weights_only=True"),
    (re.compile(r"\bpd\.read_pickle\(|\bread_pickle\("), "pandas read_pickle"),
]


def test_no_pickle_loads_in_the_package():
    hits = []
    for pkg in PACKAGES:
        assert (ROOT / pkg).is_dir(), pkg  # a renamed package must not drop out of the check silently
        for path in sorted((ROOT / pkg).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for pattern, what in FORBIDDEN:
                for m in pattern.finditer(text):
                    line = text.count("\n", 0, m.start()) + 1
                    hits.append(f"{path.relative_to(ROOT)}:{line}: {what}: {m.group(0).strip()}")
    assert not hits, "\n".join(hits)


def test_the_check_catches_pickle(tmp_path):
    sample = "import numpy as np\nimport pickle\nx = np.load(p, allow_pickle=True)\ny = torch.load(f)\n"
    found = [what for pattern, what in FORBIDDEN if pattern.search(sample)]
    assert found == ["pickle module", "numpy allow_pickle=True", "torch.load without weights_only=True"]
