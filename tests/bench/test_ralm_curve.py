"""The RaLMSpec curve's targets: judged per point, None where nothing can be judged."""

import pytest

from bench.ralm_curve import points, targets


def run(passages, retriever, b, backend=None, **configs):
    """A bench.ralm result with B's (R, G) and each config's latency; identical unless latency is negative."""
    def cfg(lat, r=0.0):
        return {"latency_s": abs(lat), "retrieval_s": r, "generation_s": abs(lat) - r, "identical": 2 if lat > 0 else 1,
                "n": 2, "speedup": (b[0] + b[1]) / abs(lat)}
    return {"kb": {"passages": passages, **({"backend": backend} if backend else {})},
            "retrievers": {retriever: {"B": cfg(b[0] + b[1], b[0]), **{c: cfg(v) for c, v in configs.items()}}}}


@pytest.mark.parametrize("runs, psa_met, never_slower_met, identical_met", [
    # Retrieval-bound (share 0.6): PSA 2x meets 1.75; P at 0.99 is not slower than 0.98.
    ([run(1_000_000, "edr", (6.0, 4.0), PSA=5.0, P=10.1)], True, True, True),
    # Same share, PSA only 1.5x: missed. (Not judged "met" because another KB size is fine.)
    ([run(1_000_000, "edr", (6.0, 4.0), PSA=6.6), run(100_000, "edr", (1.0, 9.0), PSA=9.9)], False, True, True),
    # Cheap retrieval only: the PSA target has no point to judge (None, not True); A at 0.90 is slower.
    ([run(100_000, "edr", (1.0, 9.0), PSA=9.9, A=11.1)], None, False, True),
    # A differing output anywhere fails identity.
    ([run(100_000, "sr", (1.0, 9.0), PSA=-10.0)], None, True, False),
])
def test_targets(runs, psa_met, never_slower_met, identical_met):
    t = targets(points(runs))
    assert t["psa_edr_at_share_0.5"]["met"] is psa_met
    assert t["never_slower"]["met"] is never_slower_met
    assert t["identical"]["met"] is identical_met


def test_main_skips_the_curve_and_other_files_a_glob_matches(tmp_path):
    """`bench.ralm_curve bench/results/ralm-*.json --json bench/results/ralm-curve.json` matches its own output."""
    import json

    from bench.ralm_curve import main

    (tmp_path / "ralm-100000.json").write_text(json.dumps(run(100_000, "edr", (1.0, 9.0), PSA=9.9)))
    (tmp_path / "ralm-notes.json").write_text(json.dumps({"comment": "not a bench.ralm run"}))
    curve = tmp_path / "ralm-curve.json"
    curve.write_text(json.dumps({"points": [{"passages": 1}]}))  # an older curve
    main([str(p) for p in sorted(tmp_path.glob("ralm-*.json"))] + ["--json", str(curve)])
    out = json.loads(curve.read_text())
    assert out["sources"] == [str(tmp_path / "ralm-100000.json")]
    assert {p["passages"] for p in out["points"]} == {100_000}  # not 1 (the old curve's point)


@pytest.mark.parametrize("pairs, lo, hi", [
    # Every question 2x faster: no spread, the interval is the point.
    ([(2.0, 1.0)] * 6, 2.0, 2.0),
    # Half the questions 10 % slower, half 10 % faster: the interval straddles 1 (Not shown slower).
    ([(1.0, 1.1), (1.0, 0.9)] * 4, None, None),
])
def test_speedup_ci(pairs, lo, hi):
    from bench.ralm_curve import speedup_ci

    a, b = speedup_ci(pairs, reps=500)
    if lo is not None:
        assert (a, b) == pytest.approx((lo, hi))
    else:
        assert a < 1.0 < b


def test_speedup_ci_matches_a_brute_force_bootstrap():
    """The interval's ends are order statistics of ratio-of-means over question resamples, recomputed here."""
    import random

    from bench.ralm_curve import speedup_ci

    pairs = [(2.0, 2.1), (1.5, 1.4), (3.0, 3.3), (2.2, 2.0), (1.8, 1.9)]
    rng = random.Random(7)
    ratios = []
    for _ in range(300):
        s = [pairs[rng.randrange(5)] for _ in range(5)]
        ratios.append(sum(b for b, _ in s) / sum(c for _, c in s))
    ratios.sort()
    assert speedup_ci(pairs, reps=300, seed=7) == (ratios[int(0.025 * 299)], ratios[int(0.975 * 299)])


def test_points_carry_the_interval_from_per_question_rows():
    r = run(100_000, "edr", (1.0, 9.0), PSA=10.0)
    r["runs"] = [{"question": q, "retriever": "edr", "config": c, "latency_s": lat}
                 for q in range(4) for c, lat in (("B", 10.0), ("PSA", 12.5))]  # 0.8x on every question
    (psa,) = [p for p in points([r]) if p["config"] == "PSA"]
    assert psa["speedup_ci95"] == pytest.approx([0.8, 0.8])
    t = targets(points([r]))
    assert [p["config"] for p in t["never_slower"]["below_by_more_than_noise"]] == ["PSA"]


def test_backends_stay_apart():
    """The same KB in process and in PostgreSQL: two points per config, each with its own share and speed-up (not
    one point averaging them); the worst point names its backend."""
    pts = points([run(100_000, "edr", (0.5, 9.5), PSA=10.0), run(100_000, "edr", (6.0, 4.0), "postgresql", PSA=5.0)])
    psa = {p["backend"]: p for p in pts if p["config"] == "PSA"}
    assert set(psa) == {"in-process", "postgresql"}
    assert psa["postgresql"]["b_r_share"] == pytest.approx(0.6) and psa["postgresql"]["speedup"] == pytest.approx(2.0)
    assert psa["in-process"]["b_r_share"] == pytest.approx(0.05) and psa["in-process"]["speedup"] == pytest.approx(1.0)
    t = targets(pts)
    assert t["psa_edr_at_share_0.5"]["points"] == [("postgresql", 100_000, pytest.approx(2.0))]
    assert t["never_slower"]["worst"]["backend"] == "in-process"


def test_the_plot_and_the_report_take_both_backends(tmp_path):
    import json

    from bench.ralm_curve import main
    from bench.report import ralm_curve

    for name, r in (("a", run(100_000, "edr", (0.5, 9.5), PSA=10.0)),
                    ("b", run(100_000, "edr", (6.0, 4.0), "postgresql", PSA=5.0))):
        (tmp_path / f"ralm-{name}.json").write_text(json.dumps(r))
    curve, png = tmp_path / "curve.json", tmp_path / "curve.png"
    main([str(tmp_path / "ralm-a.json"), str(tmp_path / "ralm-b.json"), "--json", str(curve), "--png", str(png)])
    assert png.stat().st_size > 0
    table = ralm_curve("curve.json", json.loads(curve.read_text()))
    assert "| postgresql | 100,000 | edr | 0.60 |" in table and "| in-process | 100,000 | edr | 0.05 |" in table
