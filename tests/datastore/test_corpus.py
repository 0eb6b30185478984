"""Which files make the site-packages corpus, and what its key depends on."""

import os

import pytest

from retrieval_service.datastore.corpus import FileSource, corpus_key, site_packages_files


def _tree(root, files):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


# (name, files in site-packages, expected in the corpus, not expected)
SCENARIOS = [
    ("package modules", {"pkg/__init__.py": "", "pkg/mod.py": "x = 1"}, ["pkg/__init__.py", "pkg/mod.py"], []),
    ("editable shim", {"pkg/mod.py": "", "__editable___proj_0_1_0_finder.py": "MAPPING = {}"},
     ["pkg/mod.py"], ["__editable___proj_0_1_0_finder.py"]),
    ("bytecode and non-python", {"pkg/mod.py": "", "pkg/__pycache__/mod.py": "", "pkg/data.txt": "t"},
     ["pkg/mod.py"], ["pkg/__pycache__/mod.py", "pkg/data.txt"]),
    ("a module merely named editable", {"pkg/editable_finder.py": ""}, ["pkg/editable_finder.py"], []),
]


@pytest.mark.parametrize("name,files,expected,not_expected", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_site_packages_files(tmp_path, name, files, expected, not_expected):
    _tree(tmp_path, files)
    got = {f.relative_to(tmp_path).as_posix() for f in site_packages_files([tmp_path])}
    assert set(expected) <= got
    assert not got & set(not_expected)


def test_reinstalling_the_project_keeps_the_corpus_key(tmp_path):
    """pip install -e . rewrites the shim (new mtime): the datastore built before must still match."""
    _tree(tmp_path, {"pkg/mod.py": "x = 1", "__editable___proj_0_1_0_finder.py": "MAPPING = {'a': '/one'}"})
    key = corpus_key([FileSource(p) for p in site_packages_files([tmp_path])])
    shim = tmp_path / "__editable___proj_0_1_0_finder.py"
    shim.write_text("MAPPING = {'a': '/another/checkout'}")
    os.utime(shim, ns=(1, 1))
    assert corpus_key([FileSource(p) for p in site_packages_files([tmp_path])]) == key
    (tmp_path / "pkg/mod.py").write_text("x = 22")  # a real corpus file changing does change it
    assert corpus_key([FileSource(p) for p in site_packages_files([tmp_path])]) != key
