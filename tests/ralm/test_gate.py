"""RoundGate: the cheapest measured kind of round, probes of the others at doubling intervals."""

import math

import pytest

from generation_service.augment.round_gate import ASYNC, MIN_SEARCH_SHARE, SEQUENTIAL, SYNC, RoundGate, SharedRoundCosts


def measured(arms, costs, probe=4, **kw):
    gate = RoundGate(arms, window=5, probe=probe, **kw)
    for arm, c in costs.items():
        gate.record(arm, c)
    return gate


@pytest.mark.parametrize("arms, costs, want", [
    # Speculation costs 10x a sequential step per committed step: sequential.
    ((SYNC, SEQUENTIAL), {SEQUENTIAL: 0.03, SYNC: 0.30}, SEQUENTIAL),
    # Cheap speculation: sync.
    ((SYNC, SEQUENTIAL), {SEQUENTIAL: 0.03, SYNC: 0.01}, SYNC),
    # async slowed by the search beside its step: sync, Not async.
    ((ASYNC, SYNC, SEQUENTIAL), {SEQUENTIAL: 0.05, SYNC: 0.02, ASYNC: 0.03}, SYNC),
    # An arm not measured yet is tried before any verdict, in the given order.
    ((ASYNC, SYNC, SEQUENTIAL), {SEQUENTIAL: 0.01}, ASYNC),
    ((ASYNC, SYNC, SEQUENTIAL), {SEQUENTIAL: 0.01, ASYNC: 0.5}, SYNC),
    # One arm only: always it.
    ((SYNC,), {}, SYNC),
    # Speculation measured 3 % cheaper, within the rounds' noise: RaLMSeq's steps. Not sync.
    ((SYNC, SEQUENTIAL), {SEQUENTIAL: 0.100, SYNC: 0.097}, SEQUENTIAL),
    ((ASYNC, SYNC, SEQUENTIAL), {SEQUENTIAL: 0.100, SYNC: 0.099, ASYNC: 0.097}, SEQUENTIAL),
    # 6 % cheaper: beyond the margin, speculation.
    ((SYNC, SEQUENTIAL), {SEQUENTIAL: 0.100, SYNC: 0.094}, SYNC),
    # Without a sequential arm there is no baseline to prefer: the cheapest.
    ((ASYNC, SYNC), {SYNC: 0.100, ASYNC: 0.099}, ASYNC),
])
def test_choice(arms, costs, want):
    assert measured(arms, costs).choose() == want


# Rounds as (seconds per committed step, committed steps), from a 400 K trace: sequential steps at 0.155 s; sync
# rounds of 4-5 steps at 0.06-0.10 s and one wrong guess's round of 1 step at 0.77 s.
@pytest.mark.parametrize("sync_rounds, want, mean", [
    # 0.32 + 0.35 + 0.77 + 0.4 = 1.84 s for 14 steps = 0.131 s/step: sync. Not the mean of the rounds' figures
    # (0.27 s/step: sequential), which one short bad round dominates.
    ([(0.08, 4), (0.07, 5), (0.77, 1), (0.10, 4)], SYNC, 1.84 / 14),
    # The bad rounds are most of the steps: sequential.
    ([(0.08, 1), (0.30, 4), (0.77, 1)], SEQUENTIAL, (0.08 + 1.2 + 0.77) / 6),
])
def test_an_arm_costs_its_rounds_seconds_over_their_steps(sync_rounds, want, mean):
    gate = RoundGate((SYNC, SEQUENTIAL), window=5)
    for _ in range(5):
        gate.record(SEQUENTIAL, 0.155)
    for cost, steps in sync_rounds:
        gate.record(SYNC, cost, steps)
    assert gate.mean(SYNC) == pytest.approx(mean)
    assert gate.choose() == want


def test_pooled_costs_weigh_rounds_by_their_steps():
    shared = SharedRoundCosts(decay=0.5)
    shared.add("k", SYNC, 0.77, 1)
    shared.add("k", SYNC, 0.08, 4)  # averaged round: (0.5 * 0.77 + 0.5 * 0.32 s, 0.5 * 1 + 0.5 * 4 steps)
    assert shared.prior_round("k", SYNC) == pytest.approx((0.545, 2.5))
    assert shared.prior("k", SYNC) == pytest.approx(0.218)  # Not 0.425, the mean of the two rounds' figures
    assert RoundGate((SYNC, SEQUENTIAL), shared=shared, key="k").mean(SYNC) == pytest.approx(0.218)


def test_probes_double_while_the_winner_holds_and_rotate_over_the_losers():
    gate = measured((ASYNC, SYNC, SEQUENTIAL), {SEQUENTIAL: 0.01, SYNC: 0.011, ASYNC: 0.012}, probe=2)
    picks = [gate.choose() for _ in range(12)]
    # 2 winners, a probe (async), 4 winners, a probe (sync), then the interval is 8
    assert picks == [SEQUENTIAL, SEQUENTIAL, ASYNC, SEQUENTIAL, SEQUENTIAL, SEQUENTIAL, SEQUENTIAL, SYNC,
                     SEQUENTIAL, SEQUENTIAL, SEQUENTIAL, SEQUENTIAL]  # Not a probe every 2 rounds


def test_a_new_winner_resets_the_probe_interval():
    gate = measured((SYNC, SEQUENTIAL), {SEQUENTIAL: 0.01, SYNC: 0.012}, probe=1)
    assert [gate.choose() for _ in range(3)] == [SEQUENTIAL, SYNC, SEQUENTIAL]  # interval now 2
    for _ in range(5):
        gate.record(SYNC, 0.009)  # the cache started guessing right: speculation wins now
    assert [gate.choose() for _ in range(3)] == [SYNC, SEQUENTIAL, SYNC]  # probed after 1 again, Not after 2


def test_cache_wanted_only_before_speculation():
    gate = RoundGate((SYNC, SEQUENTIAL), window=5, probe=2)
    assert gate.cache_wanted()  # no verdict yet
    gate.record(SEQUENTIAL, 0.03)
    gate.record(SYNC, 0.033)
    wanted = []
    for _ in range(5):
        if gate.choose() == SEQUENTIAL:
            wanted.append(gate.cache_wanted())
    assert wanted == [False, True, False, False]  # a fill only before the probe, Not every sequential step


@pytest.mark.parametrize("arms", [(), ("sync", "sync"), ("speculate",)])
def test_bad_arms(arms):
    with pytest.raises(ValueError, match="arms"):
        RoundGate(arms)


def test_exploring_marks_measuring_rounds_only():
    gate = RoundGate((SYNC, SEQUENTIAL), window=5, probe=1)
    gate.record(SEQUENTIAL, 0.01)
    seen = []
    for _ in range(4):
        arm = gate.choose()
        seen.append((arm, gate.exploring))
        if arm == SYNC:
            gate.record(SYNC, 0.012)
    # sync not measured yet, then the winner, a probe of sync, the winner again
    assert seen == [(SYNC, True), (SEQUENTIAL, False), (SYNC, True), (SEQUENTIAL, False)]


def test_a_new_request_starts_from_the_workers_pooled_costs():
    shared = SharedRoundCosts(decay=0.5)
    first = RoundGate((SYNC, SEQUENTIAL), shared=shared, key="edr")
    assert first.choose() == SYNC and first.exploring  # nothing known yet: measure speculation
    first.record(SYNC, 0.30)
    first.record(SEQUENTIAL, 0.03)
    second = RoundGate((SYNC, SEQUENTIAL), shared=shared, key="edr")
    assert second.choose() == SEQUENTIAL and not second.exploring  # Not another losing speculative round
    other = RoundGate((SYNC, SEQUENTIAL), shared=shared, key="sr")
    assert other.choose() == SYNC  # another key (retriever, round settings) learns for itself
    second.record(SEQUENTIAL, 0.05)
    assert shared.prior("edr", SEQUENTIAL) == pytest.approx(0.04)  # pooled: 0.5 * 0.03 + 0.5 * 0.05


def test_explore_measures_each_arm_n_rounds_round_robin_and_counts_the_pooled_ones():
    shared = SharedRoundCosts()
    first = RoundGate((ASYNC, SYNC, SEQUENTIAL), shared=shared, key="knn", explore=2)
    seen = []
    for _ in range(6):
        arm = first.choose()
        seen.append(arm)
        first.record(arm, {ASYNC: 0.03, SYNC: 0.02, SEQUENTIAL: 0.05}[arm])
    # Interleaved, not ASYNC, ASYNC, SYNC, ...: an arm's rounds are spread over the request.
    assert seen == [ASYNC, SYNC, SEQUENTIAL] * 2
    assert first.choose() == SYNC and not first.exploring
    # A later request of the worker: 2 pooled rounds per arm are enough, nothing to explore again.
    assert RoundGate((ASYNC, SYNC, SEQUENTIAL), shared=shared, key="knn", explore=2).choose() == SYNC
    third = RoundGate((ASYNC, SYNC, SEQUENTIAL), shared=shared, key="knn", explore=3)
    assert third.choose() == ASYNC and third.exploring  # 2 pooled rounds are fewer than 3
    with pytest.raises(ValueError, match="explore"):
        RoundGate((SYNC,), explore=6)  # more than the window of 5 rounds


def test_requests_of_a_worker_share_one_probe_schedule():
    shared = SharedRoundCosts()
    shared.add("k", SEQUENTIAL, 0.01)
    shared.add("k", SYNC, 0.011)
    picks = []
    for _ in range(4):  # four short requests of 3 rounds each
        gate = RoundGate((SYNC, SEQUENTIAL), probe=2, shared=shared, key="k")
        picks += [gate.choose() for _ in range(3)]
    # probes after 2, then 4 more winning rounds across requests; Not a probe in every request
    assert picks == [SEQUENTIAL, SEQUENTIAL, SYNC, SEQUENTIAL, SEQUENTIAL, SEQUENTIAL, SEQUENTIAL, SYNC,
                     SEQUENTIAL, SEQUENTIAL, SEQUENTIAL, SEQUENTIAL]


# (cost of sync relative to sequential, the gate's far_behind, rounds until the first probe of sync)
FAR_CASES = [
    (1.2, 1.25, 3),     # within FAR_BEHIND: probed after 2 winning rounds
    (3.0, 1.25, 67),    # far behind: the probes due at rounds 3, 8, 17 and 34 are skipped; the one that doubles
                        # the interval to MAX_PROBE is not
    (3.0, math.inf, 3),  # no far_behind (kNN-LM's gate): probed like a close arm
]


@pytest.mark.parametrize("ratio, far_behind, first_probe", FAR_CASES)
def test_arms_far_behind_are_probed_only_at_the_longest_interval(ratio, far_behind, first_probe):
    from generation_service.augment.round_gate import MAX_PROBE

    gate = measured((SYNC, SEQUENTIAL), {SEQUENTIAL: 0.01, SYNC: 0.01 * ratio}, probe=2, far_behind=far_behind)
    picks = [gate.choose() for _ in range(MAX_PROBE + 40)]
    assert picks.index(SYNC) + 1 == first_probe  # Not after 3 rounds when it is 3x the winner's cost
    assert gate.schedule.probe == MAX_PROBE or ratio < far_behind


def test_probe_interval_is_capped():
    from generation_service.augment.round_gate import MAX_PROBE, ProbeSchedule

    s = ProbeSchedule(4)
    probes = [i for i in range(2000) if s.tick(SEQUENTIAL)]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert max(gaps) == MAX_PROBE + 1  # Not an interval that grows without bound


# Concurrent requests whose own measurements name different winners in turn: each winner keeps its interval.
# A single interval reset at every change of name probed 86 times in 600 rounds of six-to-one, and never when
# the names alternated (the losing arms went unmeasured).
@pytest.mark.parametrize("winners, max_probes", [
    ([SEQUENTIAL], 12),  # one winner: intervals 4, 8, 16, 32, 64, 64 ... over 600 rounds
    ([SEQUENTIAL] * 6 + [ASYNC], 24),
    ([SEQUENTIAL] * 10 + [SYNC], 24),
    ([SEQUENTIAL, ASYNC], 24),
])
def test_requests_that_disagree_on_the_winner_do_not_reset_the_probe_interval(winners, max_probes):
    from generation_service.augment.round_gate import ProbeSchedule

    s = ProbeSchedule(4)
    probes = sum(s.tick(winners[i % len(winners)]) for i in range(600))
    assert 1 <= probes <= max_probes


def test_a_winner_back_after_a_long_absence_probes_soon_again():
    from generation_service.augment.round_gate import MAX_PROBE, ProbeSchedule

    s = ProbeSchedule(4)
    for _ in range(200):
        s.tick(SEQUENTIAL)
    assert s.probe == MAX_PROBE
    for _ in range(MAX_PROBE + 1):  # the costs changed: another arm won for a while
        s.tick(SYNC)
    probed = [s.tick(SEQUENTIAL) for _ in range(5)]
    assert probed == [False] * 4 + [True]  # probe0 again; Not after another MAX_PROBE rounds


@pytest.mark.parametrize("hits, misses, prefill_s, verify_s, hold", [
    # Nothing scored yet (accuracy 0.5): a 0.45 s prefill gambled against a 40 ms search: hold.
    (0, 0, 0.45, 0.04, True),
    # ... but Not where the prefill costs less than two searches (1 M-passage exact search beside a short prompt).
    (0, 0, 0.20, 0.15, False),
    # Change guesses right 20 of 20: acting on them wastes ~0.02 s per guess, less than a 0.15 s search: act.
    (20, 0, 0.45, 0.15, False),
    # Right 10 of 20: half the guesses throw away a prefill: hold, even against the slow search.
    (10, 10, 0.45, 0.15, True),
])
def test_hold_change(hits, misses, prefill_s, verify_s, hold):
    gate = RoundGate((SYNC, SEQUENTIAL))
    for hit in [True] * hits + [False] * misses:
        gate.record_change_guess(hit)
    assert gate.hold_change(prefill_s, verify_s) is hold


def test_brute_force_change_waste():
    """change_waste is the expected prefill thrown away under Laplace's estimate, counted by hand."""
    from generation_service.augment.round_gate import change_waste

    for hits in range(5):
        for n in range(hits, 8):
            p_wrong = (n - hits + 1) / (n + 2)  # Laplace: one imagined miss and one imagined hit
            assert change_waste(hits, n, 0.3) == pytest.approx(p_wrong * 0.3)


def test_change_guesses_are_pooled_across_a_workers_requests():
    shared = SharedRoundCosts()
    first = RoundGate((SYNC, SEQUENTIAL), shared=shared, key="edr")
    assert first.hold_change(0.45, 0.15)  # nothing known: hold
    for _ in range(30):
        first.record_change_guess(True)
    second = RoundGate((SYNC, SEQUENTIAL), shared=shared, key="edr")
    assert not second.hold_change(0.45, 0.15)  # the first request's guesses were right: act on them
    assert RoundGate((SYNC, SEQUENTIAL), shared=shared, key="sr").hold_change(0.45, 0.15)  # Not another key's


def test_a_workers_requests_share_one_os3_scheduler():
    from generation_service.augment.os3 import OS3Config

    shared = SharedRoundCosts()
    cfg = OS3Config(window=5, gamma_max=0.9, s_init=1, s_max=16)
    first = shared.scheduler("edr", cfg)
    assert first.next_stride() == 1  # nothing measured in this worker yet
    for _ in range(5):  # the first request: every guess right, 40 ms steps, 300 ms verifications
        first.record_verification(2, 2)
        first.record_latency(speculation_s=0.04, verification_s=0.3)
    second = shared.scheduler("edr", cfg)
    assert second is first and second.next_stride() > 2  # Not back to s = 1 for every request
    assert shared.scheduler("sr", cfg).next_stride() == 1  # another key learns for itself
    assert shared.scheduler("edr", OS3Config(window=5, gamma_max=0.5)) is not first  # so do other settings


# wall s, prefill s (all of the round's), committed steps, prefill thrown away after a mismatch, expected waste of
# each step's change guess -> seconds per committed step
@pytest.mark.parametrize("name, wall, prefill, n, thrown, guesses, want", [
    ("three hits, no passage change", 0.30, 0.0, 3, 0.0, (0.0, 0.0, 0.0), 0.10),
    # A right change guess: its prefill is RaLMSeq's own work, Not the arm's; its expected waste is.
    ("right change guess", 0.75, 0.45, 3, 0.0, (0.0, 0.05, 0.0), (0.30 + 0.05) / 3),
    # A wrong one at the first step: 0.45 thrown away + 0.45 for the KB's passage. It counts 0.05, Not 0.45.
    ("wrong change guess", 1.10, 0.90, 1, 0.0, (0.05, 0.0), (0.20 + 0.05) / 1),
    # A prefill after the mismatch is thrown away whatever its guess was: counted as measured.
    ("prefill after a miss", 1.00, 0.45, 1, 0.45, (0.0, 0.05), 1.00 / 1),
])
def test_round_cost(name, wall, prefill, n, thrown, guesses, want):
    from generation_service.augment.round_gate import round_cost

    assert round_cost(wall, prefill, n, thrown_prefill_s=thrown, guess_waste=guesses) == pytest.approx(want)


@pytest.mark.parametrize("round_ms, round_tokens, base_ms, base_tokens, want", [
    (600.0, 400, 450.0, 300, 1.0),    # 1.5 ms/token as in the sequential steps: nothing to charge
    (750.0, 400, 450.0, 300, 1.25),   # 25 % slower beside a search: the excess is the arm's, Not RaLMSeq's
    (300.0, 400, 450.0, 300, 1.0),    # faster (a shorter context): Not a credit to the arm
    (750.0, 0, 450.0, 300, 1.0),      # no prefill this round
    (750.0, 400, 0.0, 0, 1.0),        # no sequential prefill measured yet
])
def test_prefill_slowdown(round_ms, round_tokens, base_ms, base_tokens, want):
    from generation_service.augment.round_gate import prefill_slowdown

    assert prefill_slowdown(round_ms, round_tokens, base_ms, base_tokens) == pytest.approx(want)


# (search s, sequential step s incl. prefill) of the recent sequential steps -> the next round. Sync measured at
# half the sequential cost per step in every case: only the share of the searches differs.
@pytest.mark.parametrize("arms, searches, want, cache", [
    ((ASYNC, SYNC, SEQUENTIAL), [(0.006, 0.13)] * 3, SEQUENTIAL, False),  # adr at 400 K: 5 %; Not sync
    # adr at 100 K: a step with a passage prefill, then six without: 5 % over all of them, though the last five
    # alone are 11 %: Not sync
    ((SYNC, SEQUENTIAL), [(0.005, 0.45)] + [(0.005, 0.045)] * 6, SEQUENTIAL, False),
    ((SYNC, SEQUENTIAL), [(0.12, 0.25)] * 3, SYNC, True),                 # edr at 400 K: 48 %
    ((SYNC, SEQUENTIAL), [(0.015, 0.10)] * 3, SEQUENTIAL, False),         # edr at 100 K: 15 %; Not sync
    ((SYNC, SEQUENTIAL), [], SYNC, True),                                 # nothing measured: the costs decide
    ((SYNC,), [(0.006, 0.13)] * 3, SYNC, True),                           # one arm (adaptive off): as configured
])
def test_cheap_searches_mean_sequential_steps_without_probes(arms, searches, want, cache):
    gate = RoundGate(arms, window=5, probe=1)
    for a in arms:
        gate.record(a, 0.05 if a == SEQUENTIAL else 0.025)
    for s, t in searches:
        gate.record_search(s, t)
    picks = [gate.choose() for _ in range(8)]  # probe=1: a probe would come within these
    assert picks == [want] * 8 if want == SEQUENTIAL else want in picks
    assert gate.cache_wanted() == cache
    assert gate.exploring is False or want != SEQUENTIAL


def test_a_new_request_knows_the_workers_search_share():
    shared = SharedRoundCosts(decay=0.5)
    first = RoundGate((SYNC, SEQUENTIAL), shared=shared, key="adr")
    first.record_search(0.004, 0.1)
    first.record_search(0.006, 0.1)
    second = RoundGate((SYNC, SEQUENTIAL), shared=shared, key="adr")
    # pooled: (0.95 * 0.004 + 0.05 * 0.006) / 0.1
    assert second.search_share() == pytest.approx(0.041) and second.search_share() < MIN_SEARCH_SHARE
    assert second.choose() == SEQUENTIAL  # Not a first sync round to measure it


# (search s, sequential step s) of the sequential steps and (seconds, queries) of batched verifications -> the next
# round. Speculation is measured cheaper per step in every case: only what a batch saves differs.
@pytest.mark.parametrize("arms, searches, verifications, want", [
    # PostgreSQL full-text search: 0.5 s a query alone or batched, a 0.06 s model step: at most 11 % saveable
    # (async hides the step) though the search is 89 % of the step. Not a speculative round.
    ((ASYNC, SYNC, SEQUENTIAL), [(0.5, 0.56)] * 3, [(1.5, 3)], SEQUENTIAL),
    ((SYNC, SEQUENTIAL), [(0.5, 0.56)] * 3, [(1.5, 3)], SEQUENTIAL),
    # PostgreSQL exact search: 55 ms alone, 20 ms a query in a batch of 3: sync saves 37 % of a step.
    ((SYNC, SEQUENTIAL), [(0.055, 0.095)] * 3, [(0.06, 3)], SYNC),
    # A KB that does not batch beside a slow model step: sync saves nothing, async hides a search behind the
    # step (a third of it). Async allowed: the costs decide; sync only: sequential.
    ((ASYNC, SYNC, SEQUENTIAL), [(0.1, 0.3)] * 3, [(0.3, 3)], ASYNC),
    ((SYNC, SEQUENTIAL), [(0.1, 0.3)] * 3, [(0.3, 3)], SEQUENTIAL),
    # Verifications of one query say nothing about batching: ignored, the costs decide.
    ((SYNC, SEQUENTIAL), [(0.5, 0.56)] * 3, [(0.5, 1)] * 3, SYNC),
])
def test_speculation_where_the_kb_does_not_batch(arms, searches, verifications, want):
    gate = RoundGate(arms, window=5, probe=1)
    for a in arms:
        gate.record(a, 0.05 if a == SEQUENTIAL else (0.02 if a == ASYNC else 0.025))
    for s, t in searches:
        gate.record_search(s, t)
    for seconds, queries in verifications:
        gate.record_verification(seconds, queries)
    picks = [gate.choose() for _ in range(8)]
    assert picks == [want] * 8 if want == SEQUENTIAL else want in picks
    assert gate.cache_wanted() is (want != SEQUENTIAL)


def test_a_new_request_knows_the_workers_verification_cost():
    shared = SharedRoundCosts()
    first = RoundGate((SYNC, SEQUENTIAL), shared=shared, key="sr")
    first.record_search(0.5, 0.56)
    first.record_verification(1.5, 3)
    second = RoundGate((SYNC, SEQUENTIAL), shared=shared, key="sr")
    assert second.saveable_share() == pytest.approx(0.0)
    assert second.choose() == SEQUENTIAL  # Not a first sync round to measure it


def _asked_brute_force(accuracy: float, stride: int) -> float:
    """Expected searches of an in-order verification, over every pattern of right/wrong guesses."""
    import itertools

    total = 0.0
    for pattern in itertools.product((True, False), repeat=stride):
        p = math.prod(accuracy if ok else 1.0 - accuracy for ok in pattern)
        first_wrong = pattern.index(False) if False in pattern else stride - 1
        total += p * (first_wrong + 1)
    return total


@pytest.mark.parametrize("accuracy", [0.0, 0.3, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("stride", [2, 3, 5])
@pytest.mark.parametrize("search_s,per_query_s", [(0.5, 0.5), (0.5, 0.2), (0.02, 0.005), (0.4, 0.45)])
def test_in_order_pays_against_a_brute_force(accuracy, stride, search_s, per_query_s):
    from generation_service.augment.round_gate import in_order_pays

    want = search_s * _asked_brute_force(accuracy, stride) < per_query_s * stride
    assert in_order_pays(search_s, per_query_s, accuracy, stride) == want


# search alone s, per query inside a batched verification s, (hits, guesses) of step guesses, stride -> in order?
IN_ORDER = [
    ("full-text search in a database: no batching", 0.5, 0.5, (7, 10), 3, True),
    ("no batching, every guess right so far", 0.5, 0.5, (40, 40), 3, True),  # Laplace: never certain
    ("the float16 scan: a batch of 8 for two searches", 0.02, 0.005, (7, 10), 8, False),
    ("batches a little, guesses mostly wrong", 0.5, 0.4, (1, 10), 3, True),
    ("batches a little, guesses mostly right", 0.5, 0.4, (9, 10), 3, False),
    ("a stride of one: nothing to stop early", 0.5, 0.5, (7, 10), 1, False),
]


@pytest.mark.parametrize("name,search_s,per_query_s,guesses,stride,want", IN_ORDER, ids=[c[0] for c in IN_ORDER])
def test_verify_in_order(name, search_s, per_query_s, guesses, stride, want):
    gate = RoundGate((SYNC, SEQUENTIAL))
    assert not gate.verify_in_order(stride)  # batching not measured yet: RaLMSpec's batched verification
    gate.record_search(search_s, search_s + 0.05)
    gate.record_verification(per_query_s * 4, 4)
    hits, n = guesses
    for i in range(n):
        gate.record_step_guess(i < hits)
    assert gate.verify_in_order(stride) == want


def test_step_guesses_are_pooled_per_key():
    shared = SharedRoundCosts()
    first = RoundGate((SYNC, SEQUENTIAL), shared=shared, key="sr")
    for _ in range(20):
        first.record_step_guess(False)
    second = RoundGate((SYNC, SEQUENTIAL), shared=shared, key="sr")
    other = RoundGate((SYNC, SEQUENTIAL), shared=shared, key="edr")
    for g in (second, other):
        g.record_search(0.5, 0.55)
        g.record_verification(0.25 * 3, 3)
    assert second.verify_in_order(3)  # the worker's guesses were wrong: stop at the first
    assert not other.verify_in_order(3)  # Not another key's: unknown accuracy (0.5), and the batch halves a query
