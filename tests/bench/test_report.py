"""docs/benchmarks.md comes from the committed records: every record renders (in a table or in the list of other
records), the committed page is what the report writes, and nothing cites the archive of one-off runs."""

import json
from pathlib import Path

import pytest

from bench import report

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(report.TABLES))
def test_every_table_renders_from_what_is_committed(name):
    text = report.render_table(name)
    files = report.TABLES[name][0]
    present = [f for f in files if (report.RESULTS / f).exists()]
    for f in present:
        assert f"bench/results/{f}" in text  # the source is named under the table
    for f in set(files) - set(present):
        assert "not present" in text  # a missing result is said, never invented


def test_page_has_every_table_and_every_record(tmp_path):
    out = tmp_path / "benchmarks.md"
    report.main(["--out", str(out)])
    text = out.read_text()
    for name in report.TABLES:
        assert f"## {name}\n" in text, name
    for path in sorted(report.RESULTS.glob("*.json")):
        assert f"bench/results/{path.name}" in text, path.name  # Not silently dropped
    assert "bench/results/archive/" in text  # said once, in the lead
    assert not [p.name for p in (report.RESULTS / "archive").glob("*.json") if f"results/archive/{p.name}" in text]


def test_committed_page_is_what_the_report_writes(tmp_path):
    out = tmp_path / "benchmarks.md"
    report.main(["--out", str(out)])
    assert (ROOT / "docs" / "benchmarks.md").read_text() == out.read_text()  # Not hand-edited or stale


def test_no_doc_or_code_cites_the_archive():
    cited = []
    for path in [*ROOT.glob("docs/*.md"), ROOT / "Makefile", ROOT / "README.md",
                 *(p for d in ("bench", "generation_service", "retrieval_service", "ragcore", "tools", "loadtests")
                   for p in (ROOT / d).rglob("*.py"))]:
        cited += [f"{path.relative_to(ROOT)}: {a.name}" for a in (report.RESULTS / "archive").glob("*")
                  if a.name in path.read_text()]
    assert cited == []


def test_stdout_and_unknown_tables(capsys):
    report.main(["--stdout", "--only", "load"])
    assert "## load" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        report.main(["--stdout", "--only", "no-such-table"])  # Not an empty page


def test_draft_retrieval_table_shows_the_json_figures(tmp_path, monkeypatch):
    d = {"sizes": {"1000000": {"p50_ms": 0.02, "mean_ms": 0.03, "p99_ms": 0.1, "numpy_p50_ms": 2.0}},
         "merged_mean_ms": 0.05, "grpc_p50_ms": 0.4, "command": "python -m bench.draft_retrieval"}
    text = report.draft_retrieval("draft-retrieval.json", json.loads(json.dumps(d)))
    assert "| 1 M | 0.020 | 0.030 |" in text and "100×" in text
    assert "0.400 ms" in text and "0.050 ms" in text
    assert "0.010" not in text  # nothing that is not in the JSON


@pytest.mark.parametrize("edr, expected, not_expected", [
    # A resumed build: the summed encoding time and its rows, with the rate they give.
    ({"encode_seconds": 7200.0, "encoded_rows": 432000, "copied_rows": 0, "bytes": 8e8},
     "edr encoding 2.0 h for 432,000 rows (60 passages/s), 800 MB on disk", "copied"),
    # A prefix KB: rows copied from its parent, none encoded (no rate to invent).
    ({"encode_seconds": 0.0, "encoded_rows": 0, "copied_rows": 300000, "bytes": 2.3e8},
     "300,000 rows copied from the parent KB", "passages/s"),
    # An older kb.json: the single encode time only.
    ({"encode_seconds": 2668.0, "bytes": 1.56e8}, "edr encoding 44 min, 156 MB on disk", "rows"),
])
def test_kb_build_line(edr, expected, not_expected):
    line = report._kb_build({"edr": edr, "sr": {"seconds": 9.0, "bytes": 9e5}}, {"python_mb": 2048.0})
    assert expected in line and not_expected not in line
    assert "sr 9 s, 1 MB on disk" in line and "peak RSS builder 2.0 GiB" in line


@pytest.mark.parametrize("targets, expected, not_expected", [
    ({"rest_scaling": {"target": "scaling", "ratio": None, "passed": None}}, "scaling: **not measured**",
     "**not met**"),  # a run without 1 client says so; Not "not met"
    ({"rest_scaling": {"target": "scaling", "ratio": 2.5, "passed": False}}, "scaling: **not met** (2.50×)",
     "scaling: **not measured**"),
    ({"ttft": {"target": "ttft", "passed": None, "per_method": {"ar": {"ratio": None}}}}, "ttft: **not measured**\n",
     "ttft: **not measured** ()"),  # Not an empty figure list
])
def test_concurrency_verdicts(targets, expected, not_expected):
    d = {"machine": {"cpu": "X"}, "settings": {}, "cells": [], "targets": targets, "command": "c"}
    text = report.concurrency("concurrency-x.json", d)
    assert expected in text and not_expected not in text


def test_concurrency_with_rounds_shows_pooled_rows_and_the_rounds_spread():
    def summary(tok_s):
        return {"tokens_per_s": tok_s, "ms_per_token_p50": 10.0, "ms_per_token_p95": 12.0, "ttft_ms_p50": 3.0,
                "ttft_ms_p95": 6.0, "requests_done": 40, "errors": {}, "speculation": None}
    cells = [{"method": m, "concurrency": 8, "round": r, "summary": summary(t)}
             for m, r, t in (("ar", 0, 700.0), ("rest", 0, 770.0), ("rest", 1, 570.0), ("ar", 1, 600.0))]
    # by_method as json.dump leaves it: levels as strings
    d = {"machine": {"cpu": "X"}, "settings": {"rounds": 2, "duration_s": 20}, "cells": cells,
         "by_method": {"ar": {"8": summary(650.0)}, "rest": {"8": summary(670.0)}},
         "targets": {"rest_vs_ar": {"target": "rest vs ar", "passed": True, "per_level": {
             "8": {"ratio": 1.031, "passed": True, "round_ratios": [1.1, 0.95]}}}}, "command": "c"}
    text = report.concurrency("concurrency-x.json", d)
    assert "| ar | 8 | 650.0 |" in text and "| rest | 8 | 670.0 |" in text  # pooled rows
    assert "| ar | 8 | 700.0 |" not in text  # not one row per cell
    assert "2 rounds of 20 s cells" in text
    assert "rest vs ar: **met** (8: 1.03× (rounds 0.95–1.10×))" in text
