"""Passage extraction and storage: chunking, reST cleanup, docstrings, dedupe, random access."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from retrieval_service.knowledge import passages as P


@pytest.mark.parametrize("sections, words, min_words, expected", [
    # Short sections are packed together up to the budget.
    (["a b", "c d"], 4, 1, ["a b c d"]),
    # A section that does not fit starts a new block; it is not split to fill the previous one.
    (["a b", "c d e"], 4, 1, ["a b", "c d e"]),  # Not ["a b c d", "e"]
    # A long section is cut into word windows.
    (["a b c d e f g h i"], 4, 1, ["a b c d", "e f g h", "i"]),
    # A leftover shorter than min_words is glued to the previous block.
    (["a b c d e f g h i"], 4, 2, ["a b c d", "e f g h i"]),  # Not [..., "i"]
    # Empty sections vanish; a lone block below min_words is dropped.
    (["", "  ", "x"], 4, 2, []),
])
def test_pack_sections(sections, words, min_words, expected):
    assert P.pack_sections(sections, words, min_words) == expected


@given(st.lists(st.text(alphabet="ab ", max_size=40), max_size=12), st.integers(1, 9))
@settings(max_examples=200, deadline=None)
def test_pack_sections_keeps_every_word_in_order(sections, words):
    blocks = P.pack_sections(sections, words, min_words=1)
    assert " ".join(blocks).split() == " ".join(sections).split()
    # Only a glued leftover can exceed the budget, and by less than min_words (1 -> never).
    assert all(len(b.split()) <= words for b in blocks)


def test_docstring_sections_names_objects_in_order():
    src = '''"""Module doc."""
class A:
    """Class doc."""
    def f(self, x, y=2):
        """Method doc."""
def g():
    """Function doc."""
def undocumented():
    pass
'''
    assert P.docstring_sections(src) == ["Module doc.", "class A: Class doc.", "A.f(self, x, y=2): Method doc.",
                                         "g(): Function doc."]
    assert P.docstring_sections("def broken(:\n") == []  # Not a SyntaxError


def test_rst_document_strips_markup():
    text = """:mod:`json` --- JSON encoder
============================

.. module:: json
   :synopsis: Encode and decode JSON.

.. _anchor:

Use :func:`~json.dumps` with ``indent``; see `the spec <https://json.org>`_ and **bold** text::

    >>> json.dumps(1)
"""
    doc = P.rst_document(text, "rst:library/json")
    assert doc.title == "json --- JSON encoder"
    body = " ".join(doc.sections)
    assert "json.dumps with indent; see the spec and bold text:" in body
    for markup in (":func:", "``", "<https", "**", ".. module", "====", "_anchor"):
        assert markup not in body


def test_iter_passages_drops_duplicates_and_respects_limit():
    docs = [P.Document("py:a", "a", ("same text here",)), P.Document("py:b", "b", ("Same   text HERE",)),
            P.Document("py:c", "c", ("other words",))]
    got = list(P.iter_passages(docs, words=10, min_words=1))
    assert [(p.key, p.title) for p in got] == [("py:a#0", "a"), ("py:c#0", "c")]  # Not py:b (a duplicate)
    assert len(list(P.iter_passages(docs, words=10, min_words=1, limit=1))) == 1


def test_passage_store_roundtrip(tmp_path):
    items = [P.Passage(f"k{i}", f"title {i}", f"text é {i} " * (i + 1)) for i in range(7)]
    n, fp = P.write_passages(tmp_path, items)
    assert n == 7 and fp == P.fingerprint(tmp_path / P.PASSAGES_FILE)
    store = P.PassageStore(tmp_path)
    assert len(store) == 7
    assert store.get([6, 0]) == [("title 6", items[6].text), ("title 0", items[0].text)]
    assert store.record(3) == {"id": 3, "key": "k3", "title": "title 3", "text": items[3].text}
    lines = (tmp_path / P.PASSAGES_FILE).read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["id"] for line in lines] == list(range(7))
    store.close()


def test_passage_store_refuses_mismatched_offsets(tmp_path):
    P.write_passages(tmp_path, [P.Passage("k", "t", "some text")])
    np.save(tmp_path / P.OFFSETS_FILE, np.array([0, 3], dtype=np.int64))
    with pytest.raises(ValueError, match="offsets do not match"):
        P.PassageStore(tmp_path)


@pytest.mark.parametrize("source, expected", [
    # One section per definition; module-level code between definitions is its own section.
    ("x = 1\ndef f():\n    return x\n", ["x = 1", "def f():\n    return x"]),
    # A decorator starts its definition: the def below it does not cut again.
    ("@dec\ndef f():\n    pass\n", ["@dec\ndef f():\n    pass"]),  # Not ["@dec", "def f(): ..."]
    # Methods are definitions too; the class line keeps what precedes its first method.
    ("class A:\n    n = 1\n    async def g(self):\n        pass\n",
     ["class A:\n    n = 1", "async def g(self):\n        pass"]),
    # A name that merely starts with "def" is not a definition.
    ("default = 1\nclassic = 2\n", ["default = 1\nclassic = 2"]),
    ("", []),
])
def test_code_sections(source, expected):
    assert P.code_sections(source) == expected


@given(st.lists(st.sampled_from(["x = 1", "def f():", "    return 2", "@d", "class C:", "", "# c"]), max_size=20))
@settings(max_examples=200, deadline=None)
def test_code_sections_keep_every_line(lines):
    source = "\n".join(lines)
    assert " ".join(P.code_sections(source)).split() == source.split()


@pytest.mark.parametrize("roff, expected, not_expected", [
    # Requests are dropped, font escapes removed, \- is a dash; a section heading starts a paragraph.
    ('.TH LS 1\n.SH NAME\nls \\- list\n.SH DESCRIPTION\n\\fB\\-a\\fR, \\fB\\-\\-all\\fR\ndo not ignore\n',
     ("NAME ls - list", "DESCRIPTION -a, --all do not ignore"), "TH"),
    # Comments vanish; a macro's arguments are text.
    ('.\\" a comment\n.B bold words\nplain\n', ("bold words plain",), "comment"),
])
def test_man_document(roff, expected, not_expected):
    doc = P.man_document(roff, "man:x.1", "x(1)")
    assert doc.sections == expected
    assert not_expected not in " ".join(doc.sections)


def test_extra_sources_follow_the_docs_corpus(tmp_path):
    """The docs corpus is a prefix of the large one: rst, docstrings, then code, man pages, headers."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "m.py").write_text('"""Doc of m."""\ndef f(a):\n    """F doc."""\n    return a + 1\n')
    man = tmp_path / "man" / "man1"
    man.mkdir(parents=True)
    (man / "tool.1").write_text(".SH NAME\ntool - does things\n")
    inc = tmp_path / "include"
    inc.mkdir()
    (inc / "x.h").write_text("/* a header */\nint x(void);\n\nint y(void);\n")
    kw = dict(rst=False, roots=[lib], man_root=tmp_path / "man", include_root=inc)
    docs = [d.key for d in P.iter_documents(**kw)]
    large = [d.key for d in P.iter_documents(code=True, man=True, headers=True, **kw)]
    assert docs == ["py:m"] and large[:1] == docs
    assert large == ["py:m", "code:m", "man:tool.1", "h:x.h"]
