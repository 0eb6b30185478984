"""kNN-LM decoding against the real retrieval service (faiss exact + HNSW over the tiny datastore):

- the baseline (one Search per token) equals a brute-force kNN-LM (numpy distances to every key);
- RaLMSpec (cache speculation, batched verification, rollback) equals the baseline token for token, for fixed
  strides and OS³, while really speculating (some steps right, some rolled back), each kind of round alone and
  as the round gate mixes them (async, sync, baseline steps);
- k larger than the datastore is rejected before any work; retrieval down is an error, never p_LM's answer.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np
import pytest

from generation_service.augment.os3 import OS3Config
from generation_service.augment.round_gate import ARMS, ASYNC, MAX_PROBE, SEQUENTIAL, SYNC, SharedRoundCosts
from generation_service.knnlm.distribution import mixed_distribution, next_token
from generation_service.knnlm.loop import StepClock, generate_tokens, round_gate
from generation_service.knnlm.options import KNN_GATE_EXPLORE, KnnLmOptions
from generation_service.knnlm.passes import lm_prefill, lm_step
from generation_service.knnlm.search import KnnBackend, KnnRetrievalError
from generation_service.model.sampling import SamplingParams
from generation_service.model.target import new_cache

NEW = 10


def reference_decode(tm, ds, prompt: np.ndarray, n: int, opts: KnnLmOptions) -> list[int]:
    """Brute-force kNN-LM: exact float64 distances to all keys (ties -> smaller id), scores rounded to float32
    as the service returns them, the same single-token LM passes."""
    keys = np.asarray(ds.keys, np.float64)  # [N, D]
    kv = new_cache(tm)
    logits, hidden = lm_prefill(tm, kv, prompt)
    out: list[int] = []
    for _ in range(n):
        d = ((keys - hidden.astype(np.float64)) ** 2).sum(1)  # [N]
        top = np.lexsort((np.arange(ds.size), d))[: opts.k]
        tok = next_token(mixed_distribution(logits, (-d[top]).astype(np.float32), np.asarray(ds.values[top]), opts))
        out.append(tok)
        logits, hidden = lm_step(tm, kv, tok)
    return out


@pytest.fixture(scope="module")
def prompts(tm, doc_tokens) -> dict[str, np.ndarray]:
    other = np.asarray(tm.tokenizer("The weather in Paris in spring is", add_special_tokens=False)["input_ids"])
    return {"doc0": doc_tokens[0][:24].astype(np.int64), "doc2": doc_tokens[2][:40].astype(np.int64),
            "unrelated": other.astype(np.int64)}


def run(tm, backend, prompt, opts, n=NEW, **kw):
    return generate_tokens(tm, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), opts, backend, **kw)


# (prompt, options) scenarios; λ = 0.9 makes the neighbours decide most tokens, so speculation can be wrong.
SCENARIOS = [
    ("doc0", dict(k=16, lam=0.9, temperature=10.0)),
    ("doc2", dict(k=1, lam=0.5, temperature=10.0)),
    ("unrelated", dict(k=64, lam=0.9, temperature=100.0)),
    ("doc2", dict(k=256, lam=0.25, temperature=10.0, retriever="adr")),
]


@pytest.fixture(scope="module")
def baselines(tm, ds, backend, prompts):
    out = {}
    for i, (name, kw) in enumerate(SCENARIOS):
        tokens, stats = run(tm, backend, prompts[name], KnnLmOptions(**kw, speculate=False))
        assert stats.kb_calls == stats.kb_queries == NEW  # one Search per token
        out[i] = tokens
    return out


@pytest.mark.parametrize("i", range(3))  # exact retriever scenarios (HNSW is not the brute force)
def test_baseline_equals_brute_force(tm, ds, prompts, baselines, i):
    name, kw = SCENARIOS[i]
    assert baselines[i] == reference_decode(tm, ds, prompts[name], NEW, KnnLmOptions(**kw, speculate=False))


def test_neighbours_change_the_output(tm, backend, prompts, doc_tokens, baselines):
    # λ = 0.9 on a datastore document's prefix: the kNN-LM continues the document it has memorized ...
    assert baselines[0] == doc_tokens[0][24:24 + NEW].tolist()
    # ... which the LM alone (λ = 0) does not.
    lm_only, _ = run(tm, backend, prompts["doc0"], KnnLmOptions(k=16, lam=0.0, speculate=False))
    assert lm_only != baselines[0]


# (stride, async verification); stride 0 = OS³.
SPECULATION = [(2, True), (4, True), (8, True), (0, True), (4, False), (0, False)]


@pytest.mark.parametrize("stride,async_verify", SPECULATION)
def test_speculative_equals_baseline(tm, backend, prompts, baselines, stride, async_verify):
    speculated = correct = rollbacks = overlapped = 0
    for i, (name, kw) in enumerate(SCENARIOS):
        os3 = OS3Config(s_init=2) if stride == 0 else None  # start above 1 so OS³ rounds speculate from the start
        opts = KnnLmOptions(**kw, speculate=True, stride=stride, async_verify=async_verify, adaptive=False)
        tokens, stats = run(tm, backend, prompts[name], opts, os3=os3)
        assert tokens == baselines[i], (name, kw, stride, async_verify)  # Not the cache's guesses
        assert stats.tokens == NEW and stats.kb_queries >= NEW
        assert stats.kb_calls == stats.verifications <= NEW
        assert stats.correct <= stats.speculated == sum(stats.strides)
        assert stats.mode == ("os3" if stride == 0 else f"s{stride}") + ("" if async_verify else "-sync")
        speculated, correct, rollbacks = speculated + stats.speculated, correct + stats.correct, \
            rollbacks + stats.rollbacks
        overlapped += stats.overlapped
    if stride > 1:
        assert correct > 0 and rollbacks > 0  # both paths (keep, roll back) were exercised
        assert speculated > correct
    # Async: the next round's steps really ran while a Search was in flight (a loopback Search takes far longer
    # than the check right after sending it); sync never overlaps.
    assert (overlapped > 0) if async_verify else (overlapped == 0)


@pytest.mark.parametrize("async_verify", [True, False])
def test_no_step_beyond_the_budget(tm, backend, prompts, baselines, async_verify):
    # One token allowed: a stride-4 round (and an async next round) must not speculate, query or emit position 1.
    opts = KnnLmOptions(**SCENARIOS[0][1], speculate=True, stride=4, async_verify=async_verify, adaptive=False)
    tokens, stats = run(tm, backend, prompts["doc0"], opts, n=1)
    assert tokens == baselines[0][:1]
    assert stats.speculated == stats.kb_queries == 1 and stats.overlapped == 0  # not 4


def fresh(backend: KnnBackend) -> KnnBackend:
    """The same datastore and service as a new worker's: no pooled round costs or OS³ state yet."""
    return replace(backend, round_costs=SharedRoundCosts(), _schedulers={})


@pytest.mark.parametrize("stride,async_verify", [(2, True), (0, True), (4, False)])
def test_gated_rounds_equal_baseline(tm, backend, prompts, baselines, stride, async_verify):
    worker = fresh(backend)
    kinds = set()
    for i, (name, kw) in enumerate(SCENARIOS):
        # Gated (the default); on this tiny datastore a Search is too cheap to hide (under MIN_SEARCH_SHARE of a
        # step), so the floor is off to let the gate weigh every kind of round.
        opts = KnnLmOptions(**kw, speculate=True, stride=stride, async_verify=async_verify, min_search_share=0.0)
        tokens, stats = run(tm, worker, prompts[name], opts, os3=OS3Config(s_init=2) if stride == 0 else None)
        assert tokens == baselines[i], (name, kw, stride, async_verify)
        assert stats.kb_calls == stats.verifications + stats.strides.count(0)  # a baseline step is one Search
        assert stats.speculated == sum(stats.strides)
        kinds |= {"baseline" if s == 0 else "round" for s in stats.strides}
    assert kinds == {"baseline", "round"}  # a new worker measures every kind before it picks one


# (the kind the worker's pooled costs make cheapest, what the request then runs)
CHEAPEST = [
    (SEQUENTIAL, "baseline steps only: one Search per token, nothing speculated"),
    (SYNC, "sync rounds only: nothing speculated beside a Search"),
    (ASYNC, "async rounds: the next round speculated beside the Search"),
]


@pytest.mark.parametrize("cheapest, expected", CHEAPEST)
def test_gate_follows_the_pooled_costs(tm, backend, prompts, baselines, cheapest, expected):
    worker = fresh(backend)
    opts = KnnLmOptions(**SCENARIOS[0][1], speculate=True, stride=2, async_verify=True, min_search_share=0.0)
    key = round_gate(opts, worker).key
    for arm in ARMS:  # what earlier requests measured, per emitted token
        for _ in range(KNN_GATE_EXPLORE):
            worker.round_costs.add(key, arm, 0.001 if arm == cheapest else 1.0, steps=100)
    # ... and as after many requests that arm won: probes of the others are MAX_PROBE rounds apart (kNN-LM's gate
    # probes an arm however far behind, so a fresh schedule would probe within this request).
    schedule = worker.round_costs.schedule(key, 4)
    schedule.best, schedule.probe = cheapest, MAX_PROBE
    tokens, stats = run(tm, worker, prompts["doc0"], opts)
    assert tokens == baselines[0]
    assert stats.strides[0] == 0  # the first token is always a baseline step: nothing is cached before it
    if cheapest == SEQUENTIAL:
        assert stats.strides == [0] * NEW and stats.kb_calls == NEW and stats.speculated == 0, expected
    else:
        assert 0 not in stats.strides[1:] and stats.speculated >= NEW - 1, expected  # Not a baseline step
        assert (stats.overlapped > 0) == (cheapest == ASYNC), expected


# (steps: (seconds, ran an LM pass, a Search in flight), the last step's split (own round, the Search beside it))
STEP_CLOCK = [
    ([(0.010, True, True)], (0.010, 0.0)),                     # nothing measured alone yet: all its own
    ([(0.008, True, False), (0.012, True, True)], (0.008, 0.004)),  # Not (0.012, 0): 4 ms were the Search's
    ([(0.008, True, False), (0.006, True, True)], (0.006, 0.0)),    # faster than alone: no negative charge
    ([(0.008, True, False), (0.002, False, True)], (0.002, 0.0)),   # no LM pass: not comparable with one
    ([(0.008, True, False), (0.018, True, False), (0.012, True, True)], (0.010, 0.002)),  # alone averaged 0.8/0.2
]


@pytest.mark.parametrize("steps, expected", STEP_CLOCK)
def test_step_clock_charges_the_slowdown_to_the_search_beside(steps, expected):
    clock = StepClock()
    for step in steps:
        got = clock.split(*step)
    assert got == pytest.approx(expected)


def test_step_clock_seed_is_only_a_first_estimate():
    clock = StepClock()
    clock.seed(0.008)
    assert clock.split(0.012, True, True) == pytest.approx((0.008, 0.004))
    clock.split(0.010, True, False)
    clock.seed(0.001)  # ignored: a step alone was measured
    assert clock.alone_s == pytest.approx(0.8 * 0.008 + 0.2 * 0.010)


# (the service shares scans, another kNN-LM request decodes meanwhile, what the request runs)
CROWDS = [
    (True, True, "baseline steps only: concurrent Searches already share the scans"),
    (True, False, "speculative rounds: alone"),
    (False, True, "speculative rounds: Searches of concurrent requests do not share scans there"),
]


@pytest.mark.parametrize("shared, others, expected", CROWDS)
def test_crowded_requests_run_baseline_steps(tm, backend, prompts, baselines, shared, others, expected):
    worker = fresh(backend)
    worker.shared_scans = shared
    opts = KnnLmOptions(**SCENARIOS[0][1], speculate=True, stride=2, async_verify=True, min_search_share=0.0)
    key = round_gate(opts, worker).key
    for arm in ARMS:  # earlier requests found sync rounds cheapest
        for _ in range(KNN_GATE_EXPLORE):
            worker.round_costs.add(key, arm, 0.001 if arm == SYNC else 1.0, steps=100)
    with worker.running() if others else contextlib.nullcontext():
        tokens, stats = run(tm, worker, prompts["doc0"], opts)
    assert tokens == baselines[0], expected
    crowded = shared and others
    assert (stats.strides == [0] * NEW) == crowded, expected
    assert (stats.speculated == 0) == crowded, expected
    if crowded:
        assert stats.cache_entries == 0  # Not filled: nothing reads it while crowded
    assert worker._active == 0  # the request is no longer counted once done


def test_stops_at_the_budget_mid_round(tm, backend, prompts, baselines):
    tokens, stats = run(tm, backend, prompts["doc0"], KnnLmOptions(**SCENARIOS[0][1], speculate=True, stride=8), n=5)
    assert tokens == baselines[0][:5]  # Not 8 tokens: the last round is cut to the budget
    assert stats.tokens == 5


def test_k_larger_than_datastore_is_rejected(tm, ds, backend, prompts):
    with pytest.raises(ValueError, match=f"^k: {ds.size + 1} exceeds the datastore size"):
        run(tm, backend, prompts["doc0"], KnnLmOptions(k=ds.size + 1, speculate=False))


def test_k_equal_to_datastore_is_served(tm, ds, backend, prompts):
    tokens, stats = run(tm, backend, prompts["doc0"], KnnLmOptions(k=ds.size, speculate=False), n=2)
    assert len(tokens) == 2 and stats.kb_calls == 2


@pytest.mark.parametrize("speculate", [False, True])
def test_retrieval_down_is_an_error(tm, ds_path, prompts, speculate):
    down = KnnBackend.open(str(ds_path), "127.0.0.1:1", timeout_ms=2000)  # nothing listens on port 1
    try:
        with pytest.raises(KnnRetrievalError, match="127.0.0.1:1"):
            run(tm, down, prompts["doc0"], KnnLmOptions(k=4, speculate=speculate, stride=4))
    finally:
        down.close()


def test_os3_state_is_pooled_per_setting(backend):
    # A worker's requests with the same settings share one OS³ scheduler (γ and latencies learned once); the
    # stride a request asks for is OS³'s own, so it is not part of the key; other settings get their own.
    cfg = OS3Config(s_init=2)
    base = KnnLmOptions(k=16, speculate=True, stride=0, async_verify=True)
    same = [KnnLmOptions(k=16, speculate=True, stride=0, async_verify=True),
            KnnLmOptions(k=16, speculate=True, stride=4, async_verify=True)]
    other = [KnnLmOptions(k=32, speculate=True, stride=0, async_verify=True),
             KnnLmOptions(k=16, lam=0.5, speculate=True, stride=0, async_verify=True),
             KnnLmOptions(k=16, speculate=True, stride=0, async_verify=False)]
    first = backend.scheduler(base, cfg)
    for opts in same:
        assert backend.scheduler(opts, cfg) is first
    for opts in other:
        assert backend.scheduler(opts, cfg) is not first
    assert backend.scheduler(base, OS3Config(s_init=4)) is not first  # another OS³ configuration
    first.record_verification(2, 2)
    first.record_latency(speculation_s=0.01, verification_s=0.2)
    assert backend.scheduler(base, cfg).gamma() is not None  # what one request learned, the next one starts from
