"""The README's tables of record come from the committed records, and the README carries the current ones."""

from pathlib import Path

from bench import headline

ROOT = Path(__file__).resolve().parents[2]


def test_every_headline_record_is_committed():
    body = headline.render()
    assert "missing record" not in body and "missing `" not in body  # Not a table quietly left out
    for _, names in headline.HEADLINES:
        for name in names:
            assert f"bench/results/{name}" in body


def test_readme_tables_are_the_generated_ones():
    text = (ROOT / "README.md").read_text()
    start = text.index(headline.MARK_BEGIN) + len(headline.MARK_BEGIN)
    end = text.index(headline.MARK_END)
    assert text[start:end].strip() == headline.render().strip()  # Not hand-edited figures


def test_rewrite_replaces_only_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{headline.MARK_BEGIN}\nold table\n{headline.MARK_END}\nlimits\n")
    headline.rewrite_readme(readme, "new table")
    assert readme.read_text() == f"intro\n{headline.MARK_BEGIN}\nnew table\n{headline.MARK_END}\nlimits\n"


def test_entry_point_rewrites_a_readme(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"{headline.MARK_BEGIN}\n{headline.MARK_END}\n")
    headline.main(["--readme", str(readme)])
    assert "Records: `bench/results/" in readme.read_text()  # Not an empty block
