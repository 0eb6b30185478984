"""kNN-LM requests in the continuous-batching engine: their single-token passes (with the hidden rows that query
the datastore) share the passes of everything else running, and each output equals the same request run alone
(fp32: the fused pass computes every row as it would alone)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from generation_service.engine.model_thread import ModelThread
from generation_service.engine.scheduler import Engine
from generation_service.engine.speculative import decode
from generation_service.knnlm.loop import KnnRequest, generate_tokens
from generation_service.knnlm.options import KnnLmOptions
from generation_service.model.sampling import SamplingParams
from generation_service.server import Job

pytestmark = pytest.mark.model
N = 16


@pytest.fixture(scope="module")
def tm32():
    from tests.conftest import real_model

    return real_model("fp32")


def _collect(job: Job, timeout_s: float = 300) -> tuple[list[int], str, object]:
    tokens, last, t_end = [], None, time.monotonic() + timeout_s
    while True:
        item = job.chunks.get(timeout=max(1.0, t_end - time.monotonic()))
        if item is None:
            return tokens, last.finish_reason, last
        if isinstance(item, BaseException):
            raise item
        tokens += item.token_ids
        last = item


@pytest.mark.parametrize("spec", [
    [dict(speculate=False), dict(speculate=True, stride=3, async_verify=False), dict(speculate=True, stride=0)],
])
def test_knnlm_requests_share_passes_and_equal_their_solo_runs(tm32, backend, doc_tokens, spec):
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    prompts = [doc_tokens[i][:24 + 8 * i].astype(np.int64) for i in range(len(spec))]
    opts = [KnnLmOptions(k=16, lam=0.9, **kw) for kw in spec]
    solo = [generate_tokens(tm32, p, params, o, backend) for p, o in zip(prompts, opts)]
    solo_ar = [t for out, _ in decode(tm32, prompts[0], params) for t in out]
    engine = Engine(tm32, max_batch=8, prefill_chunk=256, kv_cache_mb=512, queue_size=16, drafter=lambda job: None,
                    loop=lambda job: KnnRequest(tm32, job.prompt_ids, job.params, job.knnlm, backend,
                                                is_cancelled=job.is_cancelled),
                    model_thread=ModelThread("test-knn-engine"))
    try:
        jobs = [Job(p, params, "knnlm", 0, None, knnlm=o) for p, o in zip(prompts, opts)]
        jobs.append(Job(prompts[0], params, "ar", 0, None))
        for job in jobs:
            engine.submit(job)
        got = [_collect(j) for j in jobs]
    finally:
        engine.stop()
    for (want, _), (tokens, finish, last), o in zip(solo, got, opts):
        assert finish == "length" and tokens == want, o  # Not a neighbour set from another request's hidden rows
        assert last.knnlm is not None and last.knnlm.tokens == N
    assert got[-1][0] == solo_ar
    assert engine.peak_batch >= 3  # kNN-LM rows in the same passes as the others, Not one request at a time
    assert engine.passes < sum(st.tokens + st.wasted_passes for _, st in solo) + N
