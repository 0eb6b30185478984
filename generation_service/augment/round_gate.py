"""Which kind of RaLMSpec round pays for this request: measured, not assumed (never slower than RaLMSeq).

Arms: `sequential` (one step with RaLMSeq's own search, s = 0), `sync` (s speculative steps, then one batched
verification) and `async` (the verification runs during the round's last step). What each costs depends on the
deployment: where the KB runs (on the model's cores, a verification in flight slows the step it overlaps), how
slow its search is, how often the cache guesses right. So each arm is timed whole, per committed step:

    cost = (wall time of the round - prefill time of the committed steps) / committed steps

The committed prefills (a new passage means a new prompt prefill) are the same work whichever arm ran — the
committed passages are RaLMSeq's — and they vary tenfold between steps, so they are taken out; everything an arm
changes stays in: retrieval on the critical path, generation thrown away by rollbacks, a step slowed by a
search running beside it.

The cheapest arm over its last rounds (their seconds over their committed steps) is used. Arms not measured yet
are tried first, in the order given; while one arm wins, another is probed every `probe` rounds, the interval
doubling (up to MAX_PROBE) while the winner stays the same, so costs that change (the KB gets busy, the cache
starts guessing right) are noticed without paying for many losing probes. In a worker (SharedRoundCosts)
requests start from the costs pooled over earlier ones and share one probe schedule: with 16-32 rounds per
request, measuring every arm in every request was most of what speculation lost where retrieval is cheap.

Where the searches are a small share of a sequential step (under MIN_SEARCH_SHARE of its wall time, prefill
included, pooled like the costs) no other arm is measured: speculation could at most save that share, and the
rounds' differences there are smaller than their noise, so probing them only paid for wrong guesses. The same
bound holds once verifications are measured and the KB turns out not to batch: a round saves at most, per step,
a search minus what a query costs inside a batched verification (sync), plus the step's generation a verification
in flight can hide (async). Where that is under MIN_SEARCH_SHARE of a step (PostgreSQL's full-text search, which
costs the same per query in a batch of 8 as alone, beside a cheap model step), speculation cannot pay and
RaLMSeq's steps run. Only batches of MIN_BATCH queries or more say what batching gives, so OS³'s stride-1 rounds
(a one-query verification each) do not trigger it.

Inside a speculative round, a guessed passage *change* is the expensive guess: acting on it prefills a new prompt
(hundreds of tokens, on a CPU tens of decode steps' worth), thrown away if the guess is wrong, while a guess that
the passage stays costs nothing but the round's steps. So a guessed change may end the round instead: its query
joins the round's verification and the step then runs with the KB's passage (hold_change). Whether to hold is
decided from measured costs — the expected waste of acting on the guess, (1 - accuracy of change guesses) x
prefill time, against one verification not overlapped — and held guesses are still scored against the KB's
answer, so their accuracy keeps being measured (pooled per key, like the round costs).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import astuple
from typing import Hashable, Sequence

from generation_service.augment.os3 import OS3Config, StrideScheduler
from ragcore.machine import usable_cores

log = logging.getLogger(__name__)

SEQUENTIAL, SYNC, ASYNC = "sequential", "sync", "async"
CHANGE, STEP = "change", "step"  # kinds of guesses whose accuracy is counted
CHANGE_DECAY = 0.95  # weight of the old change-guess counts per new guess: the guesses' accuracy may drift
ARMS = (ASYNC, SYNC, SEQUENTIAL)
# Below this share of a sequential step's wall time in its search (RagParams.min_search_share's default),
# RaLMSpec runs RaLMSeq's steps without measuring the other arms: speculation can at most hide the search (less:
# a batched verification costs about two single searches with the float16 scan kernel), and its rollbacks, the
# searches beside the model's steps and the gate's own probes cost more than that: served, knowledge bases whose
# searches were a tenth of the step or less gained nothing from speculation and lost a few percent while the gate
# kept trying it.
MIN_SEARCH_SHARE = 0.2
# Sequential steps the share is taken over (and the pooled share's decay per step): a step that prefills a new
# passage takes many times one that does not, so over a few steps a search's share swung by a factor of two or more
# depending on whether a prefill fell in the window.
SEARCH_WINDOW = 32
SEARCH_DECAY = 0.95
# Batched verifications of at least this many queries say what a query costs inside a batch (one query alone is a
# single search, which says nothing about batching).
MIN_BATCH = 2

# Cores a worker needs before async rounds are tried by default. On 2 cores an async round's LM passes share
# them with the verification's scan, and served on 2 cores OS³ with async rounds allowed gained clearly less than
# with sync rounds only (bench.knnlm). Four cores leave the passes (2 threads) a pair of cores beside a scan's 2.
ASYNC_MIN_CORES = 4


def async_by_default(cores: int | None = None) -> bool:
    """Whether async rounds are tried when a request leaves async_verify unset (KnnLmOptions): this
    worker has ASYNC_MIN_CORES."""
    return (usable_cores() if cores is None else cores) >= ASYNC_MIN_CORES


MAX_PROBE = 64  # rounds between probes at most: costs drift (load, a KB growing), a probe must still come
# A speculative arm replaces RaLMSeq's steps only when it measured at least this much cheaper per committed step.
# Rounds' costs scatter (a prefill landing in one, the other process on the cores), so the cheapest mean was often
# a speculative arm by chance: with a large KB and the float16 scan kernel, an async arm against sequential steps
# ran a third of its rounds async and came out slower than RaLMSeq (bench.ralm).
SWITCH_MARGIN = 0.05
# A losing arm measured more than this factor of the winner's cost is probed only once the probe interval has
# reached MAX_PROBE: a probe costs the arm's excess (with a large KB an async probe round cost a multiple of a
# sequential step per step, and a wrong guess in it re-prefills a passage), and an arm that far behind
# rarely turns out cheaper: early, frequent probes of such an arm were most of what a config lost to RaLMSeq.
FAR_BEHIND = 1.25


class ProbeSchedule:
    """When to try a losing arm: after `probe` rounds of the same winner, the interval doubling up to MAX_PROBE.

    A worker's concurrent requests share one schedule, and where two arms cost about the same their own
    measurements name different winners from round to round. So each winner keeps its own interval, and only a
    winner that had not won for MAX_PROBE rounds starts again from probe0 (the costs changed): with one interval
    reset whenever the winner named changed, requests that disagreed now and then probed every few rounds, each
    probe's wrong guesses a re-prefill, and requests that disagreed every round never probed."""

    def __init__(self, probe0: int):
        self.probe0 = probe0
        self.best: str | None = None  # the winner of the last round
        self.probes = 0  # probes run (rotates through the losing arms)
        self._ticks = 0
        self._state: dict[str, list[int]] = {}  # winner -> [interval, rounds since its last probe, last round won]

    @property
    def probe(self) -> int:
        """The current winner's interval."""
        return self._state[self.best][0] if self.best in self._state else self.probe0

    @probe.setter
    def probe(self, interval: int) -> None:
        """Set the current winner's interval (a schedule restored as after that winner's long run)."""
        st = self._state.setdefault(self.best, [self.probe0, 0, self._ticks])
        st[0], st[2] = interval, self._ticks

    @property
    def since(self) -> int:
        return self._state[self.best][1] if self.best in self._state else 0

    def tick(self, best: str) -> bool:
        """One round with `best` winning; True = probe this round."""
        self._ticks += 1
        st = self._state.get(best)
        if st is None or self._ticks - st[2] > MAX_PROBE:
            st = self._state[best] = [self.probe0, 0, self._ticks]
        st[2] = self._ticks
        st[1] += 1
        self.best = best
        if st[1] > st[0]:
            st[1], st[0] = 0, min(2 * st[0], MAX_PROBE)
            self.probes += 1
            return True
        return False

    def due(self) -> bool:
        return self.since >= self.probe


class SharedRoundCosts:
    """A worker's costs per arm, pooled over its requests (exponential average per key: retriever and the
    settings that shape a round). A new request starts from them instead of paying to measure every arm again:
    with 16-32 rounds per request and a wrong guess costing a re-prefill, exploring is most of what speculation
    loses where retrieval is cheap."""

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self._sums: dict[tuple[Hashable, str], tuple[float, float]] = {}  # (key, arm) -> averaged (seconds, steps)
        self._rounds: dict[tuple[Hashable, str], int] = {}  # (key, arm) -> rounds pooled
        self._schedules: dict[Hashable, ProbeSchedule] = {}
        self._guesses: dict[tuple[Hashable, str], tuple[float, float]] = {}  # (key, kind) -> decayed (hits, n)
        self._search: dict[Hashable, tuple[float, float]] = {}  # key -> averaged (search s, sequential step s)
        self._verify: dict[Hashable, tuple[float, float]] = {}  # key -> averaged (verification s, its queries)
        self._strides: dict[tuple[Hashable, tuple], StrideScheduler] = {}
        self._lock = threading.Lock()  # requests of a worker may run on other threads (solo streams)

    def scheduler(self, key: Hashable, cfg: OS3Config) -> StrideScheduler:
        """The worker's OS³ scheduler for `key`: its accuracy and latencies pooled over requests. Per request, each
        one started at s = 1 and its first rounds, measuring that stride, cost as much as sequential steps."""
        with self._lock:
            return self._strides.setdefault((key, astuple(cfg)), StrideScheduler(cfg))

    def schedule(self, key: Hashable, probe0: int) -> ProbeSchedule:
        """The worker's probe schedule for `key`: probes are spread over its requests, not repeated in each."""
        with self._lock:
            return self._schedules.setdefault(key, ProbeSchedule(probe0))

    def guesses(self, key: Hashable, kind: str) -> tuple[float, float]:
        """(hits, guesses) pooled for `key`, decayed counts: kind CHANGE (passage-change guesses) or STEP (every
        speculated step's passage)."""
        with self._lock:
            return self._guesses.get((key, kind), (0.0, 0.0))

    def add_guess(self, key: Hashable, kind: str, hit: bool) -> None:
        with self._lock:
            self._guesses[(key, kind)] = counted_guess(self._guesses.get((key, kind), (0.0, 0.0)), hit)

    def search_prior(self, key: Hashable) -> tuple[float, float] | None:
        """The pooled average sequential step: (seconds in its search, seconds in all), or None before any."""
        with self._lock:
            return self._search.get(key)

    def add_search(self, key: Hashable, search_s: float, step_s: float) -> None:
        with self._lock:
            self._search[key] = decayed(self._search.get(key), (search_s, step_s), SEARCH_DECAY)

    def verification_prior(self, key: Hashable) -> tuple[float, float] | None:
        """The pooled average batched verification: (seconds, queries), or None before any."""
        with self._lock:
            return self._verify.get(key)

    def add_verification(self, key: Hashable, seconds: float, queries: int) -> None:
        with self._lock:
            self._verify[key] = decayed(self._verify.get(key), (seconds, float(queries)), SEARCH_DECAY)

    def prior_round(self, key: Hashable, arm: str) -> tuple[float, float] | None:
        """The pooled average round of `arm`: (seconds, committed steps), or None before any."""
        with self._lock:
            return self._sums.get((key, arm))

    def prior(self, key: Hashable, arm: str) -> float | None:
        """Pooled seconds per committed step of `arm` (a ratio of averaged sums), or None before any round."""
        r = self.prior_round(key, arm)
        return None if r is None else r[0] / r[1]

    def rounds(self, key: Hashable, arm: str) -> int:
        """Rounds of `arm` pooled for `key`."""
        with self._lock:
            return self._rounds.get((key, arm), 0)

    def add(self, key: Hashable, arm: str, cost: float, steps: int = 1) -> None:
        """A round of `arm` that committed `steps` steps at `cost` seconds each."""
        with self._lock:
            self._sums[(key, arm)] = decayed(self._sums.get((key, arm)), (cost * steps, float(steps)), self.decay)
            self._rounds[(key, arm)] = self._rounds.get((key, arm), 0) + 1


def decayed(old: tuple[float, float] | None, new: tuple[float, float], decay: float) -> tuple[float, float]:
    """Exponential average of a (numerator, denominator) pair: their ratio weighs each sample by its denominator."""
    return new if old is None else (decay * old[0] + (1 - decay) * new[0], decay * old[1] + (1 - decay) * new[1])


def counted_guess(counts: tuple[float, float], hit: bool) -> tuple[float, float]:
    """(hits, guesses) decayed by CHANGE_DECAY, plus one guess."""
    return CHANGE_DECAY * counts[0] + hit, CHANGE_DECAY * counts[1] + 1


def in_order_pays(search_s: float, per_query_s: float, accuracy: float, stride: int) -> bool:
    """Is asking a round's queries one at a time, stopping after the first wrong guess, expected to cost less than
    one batched search of all `stride`? The queries after a wrong guess are thrown away (those steps run again,
    with other queries), so in order a round asks 1 + a + ... + a^(s-1) searches on average (a: the chance a
    guess is right), each at a search's cost alone, against s queries at their cost inside a batch. Where the KB
    does not batch (PostgreSQL's full-text search costs as much per query in a batch as alone) that is always
    cheaper; where it batches well (the float16 scan: a batch of 8 for about two searches) it never is."""
    if stride < 2 or search_s <= 0:
        return False
    expected_asked = stride if accuracy >= 1.0 else (1.0 - accuracy ** stride) / (1.0 - accuracy)
    return search_s * expected_asked < per_query_s * stride


def change_waste(hits: float, guesses: float, prefill_s: float) -> float:
    """Expected seconds thrown away by acting on a guessed passage change: a wrong guess's prefill. The accuracy is
    Laplace's estimate (hits + 1) / (guesses + 2): 0.5 before any guess is scored, so an unmeasured guess is not
    trusted where a prefill costs more than two verifications."""
    return (1.0 - (hits + 1.0) / (guesses + 2.0)) * prefill_s


def round_cost(wall_s: float, prefill_s: float, committed: int, *, thrown_prefill_s: float = 0.0,
               guess_waste: Sequence[float] = ()) -> float:
    """Seconds per committed step of a round, the figure arms are compared by: its wall time without its prefills
    (prefill_s: all of them; a committed passage's prefill is RaLMSeq's own work), plus the prefills thrown away
    for a reason other than the guess that made them (thrown_prefill_s: steps after a mismatch), plus each
    committed step's change guess at its expected waste (guess_waste[i]) in place of what it happened to waste."""
    return (wall_s - prefill_s + thrown_prefill_s + sum(guess_waste[:committed])) / committed


def prefill_slowdown(round_ms: float, round_tokens: int, base_ms: float, base_tokens: int) -> float:
    """How much slower a round's prefills ran per token than the sequential steps' (>= 1; 1 when either is
    unmeasured). A prefill beside a search in flight pays for the shared cores; RaLMSeq's does not, so only the
    baseline part of a committed prefill is RaLMSeq's work and the rest is the arm's."""
    if round_tokens <= 0 or base_tokens <= 0 or base_ms <= 0:
        return 1.0
    return max(1.0, (round_ms / round_tokens) / (base_ms / base_tokens))


class RoundGate:
    def __init__(self, arms: Sequence[str], window: int = 5, probe: int = 4,
                 shared: SharedRoundCosts | None = None, key: Hashable = None,
                 min_search_share: float = MIN_SEARCH_SHARE, explore: int = 1, far_behind: float = FAR_BEHIND):
        if not arms or any(a not in ARMS for a in arms) or len(set(arms)) != len(arms):
            raise ValueError(f"arms: {list(arms)!r} must be distinct names from {ARMS}")
        self.arms = tuple(arms)
        # Per arm, its last `window` rounds as (seconds, committed steps): an arm costs the ratio of the sums, so a
        # round that committed five steps counts five times a round that committed one. A mean of per-round
        # figures let one bad short round (a wrong guess: a long round for its one step, beside cheap rounds of
        # four steps) outweigh the rest, and speculation that paid on the whole lost the gate for good.
        self.costs: dict[str, deque[tuple[float, float]]] = {a: deque(maxlen=window) for a in self.arms}
        self.schedule = shared.schedule(key, probe) if shared is not None else ProbeSchedule(probe)
        self.exploring = False  # the last choice only measures: an arm not measured yet, or a probe
        self.shared, self.key = shared, key
        self.min_search_share = min_search_share
        # Rounds (a pooled prior counts as one) each arm gets before the cheapest is picked. One suits RaLMSpec's
        # rounds; kNN-LM's are a few tokens each and scatter more, so one unlucky first round could shut an arm
        # out until FAR_BEHIND's long probe interval.
        if explore < 1 or explore > window:
            raise ValueError(f"explore: {explore} must be in [1, window={window}]")
        self.explore = explore
        self.far_behind = far_behind  # a losing arm beyond this factor of the winner waits for MAX_PROBE
        self.measured = {a: 0 for a in self.arms}  # rounds per arm, this request's and the worker's pooled ones
        self._guesses = {CHANGE: (0.0, 0.0), STEP: (0.0, 0.0)}  # (hits, guesses) when no worker pools them
        self.searches: deque[tuple[float, float]] = deque(maxlen=SEARCH_WINDOW)  # sequential: (search s, all s)
        self.verifications: deque[tuple[float, float]] = deque(maxlen=SEARCH_WINDOW)  # batched: (s, queries)
        if shared is not None:
            p = shared.search_prior(key)
            if p is not None:
                self.searches.append(p)
            p = shared.verification_prior(key)
            if p is not None:
                self.verifications.append(p)
            for a in self.arms:  # one pseudo-measurement each: this request's own ones soon outweigh it
                p = shared.prior_round(key, a)
                if p is not None:
                    self.costs[a].append(p)
                    self.measured[a] = shared.rounds(key, a)

    def record(self, arm: str, seconds_per_step: float, steps: int = 1) -> None:
        """A round of `arm` that committed `steps` steps at `seconds_per_step` each (ralm_gate.round_cost)."""
        if arm in self.costs:
            self.costs[arm].append((seconds_per_step * steps, float(steps)))
            self.measured[arm] += 1
            if self.shared is not None:
                self.shared.add(self.key, arm, seconds_per_step, steps)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("round gate %s: %s%s %.3f s/step; means %s", self.key, arm,
                          " (measuring)" if self.exploring else "", seconds_per_step,
                          {a: round(m, 3) for a in self.arms if (m := self.mean(a)) is not None})

    def record_search(self, search_s: float, step_s: float) -> None:
        """A sequential step spent search_s of its step_s seconds (prefill included) in its search."""
        self.searches.append((search_s, step_s))
        if self.shared is not None:
            self.shared.add_search(self.key, search_s, step_s)

    def record_verification(self, seconds: float, queries: int) -> None:
        """A batched verification of `queries` queries took `seconds` (only batches of MIN_BATCH or more count)."""
        if queries >= MIN_BATCH:
            self.verifications.append((seconds, float(queries)))
            if self.shared is not None:
                self.shared.add_verification(self.key, seconds, queries)

    def saveable_share(self) -> float | None:
        """The most a speculative round saves per step, as a share of a sequential step: a search less a query's
        cost inside a batched verification, plus (async) the generation a verification in flight hides; None
        before both a sequential step and a batched verification are measured."""
        costs = self._measured_costs()
        if costs is None:
            return None
        step, search, per_query = costs
        hidden = min(per_query, max(step - search, 0.0)) if ASYNC in self.arms else 0.0
        return (max(search - per_query, 0.0) + hidden) / step if step > 0 else None

    def _measured_costs(self) -> tuple[float, float, float] | None:
        """(sequential step s, its search s, a query's s inside a batched verification), recent means; None before
        both a sequential step and a batched verification are measured."""
        if not self.searches or not self.verifications:
            return None
        step = sum(t for _, t in self.searches) / len(self.searches)
        search = sum(s for s, _ in self.searches) / len(self.searches)
        per_query = sum(s for s, _ in self.verifications) / sum(q for _, q in self.verifications)
        return step, search, per_query

    def search_share(self) -> float | None:
        """Share of the recent sequential steps' time in their searches: the most speculation could save."""
        total = sum(t for _, t in self.searches)
        return sum(s for s, _ in self.searches) / total if total > 0 else None

    def retrieval_too_cheap(self) -> bool:
        """Speculation could save less than min_search_share of a sequential step: the searches are cheap, or the
        KB does not batch them."""
        if SEQUENTIAL not in self.arms:
            return False
        share, saveable = self.search_share(), self.saveable_share()
        return any(x is not None and x < self.min_search_share for x in (share, saveable))

    def mean(self, arm: str) -> float | None:
        xs = self.costs[arm]
        return sum(t for t, _ in xs) / sum(n for _, n in xs) if xs else None

    def _unmeasured(self) -> list[str]:
        return [a for a in self.arms if self.measured[a] < self.explore]

    def _winner(self) -> str | None:
        if self._unmeasured():
            return None
        best = min(self.arms, key=lambda a: self.mean(a))  # ties: the earlier arm
        if SEQUENTIAL in self.arms and best != SEQUENTIAL \
                and self.mean(best) > (1.0 - SWITCH_MARGIN) * self.mean(SEQUENTIAL):
            return SEQUENTIAL  # within the noise of RaLMSeq's own cost: keep RaLMSeq's steps
        return best

    def choose(self) -> str:
        if self.retrieval_too_cheap():
            self.exploring = False
            return SEQUENTIAL
        unmeasured = self._unmeasured()
        self.exploring = bool(unmeasured) and len(self.arms) > 1  # one arm: nothing to choose, nothing to learn
        if unmeasured:
            return min(unmeasured, key=lambda a: self.measured[a])  # the least measured, in arm order
        best = self._winner()
        if len(self.arms) > 1 and self.schedule.tick(best):
            others = [a for a in self.arms if a != best and self._worth_probing(a, best)]
            if others:
                self.exploring = True
                return others[(self.schedule.probes - 1) % len(others)]
        return best

    def _worth_probing(self, arm: str, best: str) -> bool:
        return self.schedule.probe >= MAX_PROBE or self.mean(arm) <= self.far_behind * self.mean(best)

    def change_waste(self, prefill_s: float) -> float:
        """Expected seconds thrown away by acting on a guessed passage change (its prefill, when wrong)."""
        return change_waste(*self._counts(CHANGE), prefill_s)

    def hold_change(self, prefill_s: float, verify_s: float) -> bool:
        """A guessed passage change: end the round and verify first (True), or prefill the guess (False)?"""
        return self.change_waste(prefill_s) > verify_s

    def record_change_guess(self, hit: bool) -> None:
        """A passage-change guess (acted on or held) was the KB's passage (hit) or not."""
        self._add_guess(CHANGE, hit)

    def record_step_guess(self, hit: bool) -> None:
        """A speculated step's passage was the KB's (hit) or not (only steps up to a round's first wrong one)."""
        self._add_guess(STEP, hit)

    def _counts(self, kind: str) -> tuple[float, float]:
        return self.shared.guesses(self.key, kind) if self.shared is not None else self._guesses[kind]

    def _add_guess(self, kind: str, hit: bool) -> None:
        if self.shared is not None:
            self.shared.add_guess(self.key, kind, hit)
        else:
            self._guesses[kind] = counted_guess(self._guesses[kind], hit)

    def verify_in_order(self, stride: int) -> bool:
        """Verify a round of `stride` guesses one query at a time, stopping at the first wrong guess (True), or in
        one batched search (False)? See in_order_pays."""
        costs = self._measured_costs()
        if costs is None:
            return False  # batching unmeasured: RaLMSpec's batched verification
        _, search, per_query = costs
        hits, n = self._counts(STEP)
        return in_order_pays(search, per_query, (hits + 1.0) / (n + 2.0), stride)

    def cache_wanted(self) -> bool:
        """Will the next round (probably) read the speculation cache? Asked during a sequential step."""
        if self.retrieval_too_cheap():
            return False
        winner = self._winner()
        return winner is None or winner != SEQUENTIAL or self.schedule.due()
