"""In-process benchmarks at a tiny size through their real entry points: the real model, its real passes (one rep,
few cells), a record with the machine block. Any import, flag or code-path break fails here instead of in the next
real run."""

from __future__ import annotations

import json

from bench import kv_dtype


def test_kv_dtype_writes_a_record(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_dtype, "SHAPES", ((1, 1), (2, 2)))  # two cells of the real table, not all of it
    monkeypatch.setattr(kv_dtype, "PASTS", (8,))
    out = tmp_path / "kv.json"
    kv_dtype.main(["--reps", "1", "--threads", "1", "--json", str(out)])
    rec = json.loads(out.read_text())
    assert [(r["sequences"], r["rows"], r["past"]) for r in rec["rows"]] == [(1, 1, 8), (2, 2, 8)]
    assert all(r["fp32_ms"] > 0 and r["fp16_ms"] > 0 for r in rec["rows"])
    assert rec["machine"]["cpu"] and rec["format"] in ("q4_1", "q4_1_bf16")
