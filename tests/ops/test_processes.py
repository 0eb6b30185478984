"""Faults with real processes started by the launcher (the docker-compose topology on loopback):

- retrieval replicas are used round-robin;
- every retrieval replica killed with SIGKILL during a load run -> the worker keeps answering (degraded AR),
  recovers once they are restarted, and every reply equals the autoregressive reference;
- SIGTERM on the worker -> health answers NOT_SERVING, no new calls, the in-flight stream finishes, exit 0;
- a corrupted datastore -> the retrieval process exits non-zero with the loader's message;
- the OpenAI-compatible gateway in front of the worker (`make up`): ready only once the worker is, its greedy
  completion equal to the worker's own reply; `down` stops it with the rest.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from generation_service.client import GenerationClient
from tests.integration.conftest import PROMPTS
from tools import launcher

pytestmark = pytest.mark.model
N_TOKENS = 24


@pytest.fixture(scope="module")
def topology(datastore, tmp_path_factory):
    state = tmp_path_factory.mktemp("run") / "launcher.json"
    topo = launcher.up(datastore=str(datastore.path), dtype="fp32", state=state, replicas=2, metrics=True,
                       timeout_s=600, extra_generation=["--retry-after-s", "0.2", "--draft-timeout-ms", "1000",
                                                        "--threads", "2", "--acceptance-state", "off"],
                       extra_retrieval=["--workers", "2"], gateway=True,
                       env={"RAGSERVE_GATEWAY_API_KEYS": API_KEY})
    yield topo, state
    launcher.down(state=state, grace_s=10)
    alive = [p.name for p in topo.procs if launcher._alive(p.pid)]
    assert not alive and not state.exists(), f"still running after down: {alive}"


API_KEY = "sk-launcher-test"


def _draft_calls(proc: launcher.Proc) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "grpc_server_handled_total" and s.labels.get("grpc_method") in ("Draft", "DraftBatch"))


def _generate(client: GenerationClient, prompt: str, mode: str):
    return client.generate(prompt, max_new_tokens=N_TOKENS, decoding=mode, ignore_eos=True, timeout=300)


@pytest.mark.slow
def test_replicas_are_used_round_robin(topology):
    topo, _ = topology
    gen = topo.get("generation")
    with GenerationClient(gen.address) as c:
        for prompt in PROMPTS:
            assert not _generate(c, prompt, "rest").stats.degraded
    counts = [_draft_calls(p) for p in topo.retrieval()]
    assert len(counts) == 2 and all(n > 0 for n in counts), counts  # Not every draft on one replica


@pytest.mark.slow
def test_retrieval_killed_during_load_degrades_and_recovers(topology):
    topo, state = topology
    gen = topo.get("generation")
    with GenerationClient(gen.address) as c:
        want = {p: list(_generate(c, p, "ar").token_ids) for p in PROMPTS}
    replies: list[tuple[str, float, object]] = []  # (prompt, finished at, reply or RpcError)
    lock = threading.Lock()
    stop = threading.Event()

    def user(prompt: str) -> None:
        with GenerationClient(gen.address) as c:
            while not stop.is_set():
                try:
                    r = _generate(c, prompt, "rest")
                except grpc.RpcError as e:
                    r = e
                with lock:
                    replies.append((prompt, time.monotonic(), r))

    def wait_for(n: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while len(replies) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(replies) >= n, f"only {len(replies)} replies"

    users = [threading.Thread(target=user, args=(p,)) for p in PROMPTS]
    for t in users:
        t.start()
    try:
        wait_for(2)
        os.kill(topo.get("retrieval").pid, signal.SIGKILL)  # one replica: the other one takes over
        wait_for(len(replies) + 2)
        os.kill(topo.get("retrieval-1").pid, signal.SIGKILL)  # none left: AR steps
        killed_at = time.monotonic()
        wait_for(len(replies) + 3)
        for proc in topo.retrieval():
            launcher.restart(proc.name, state=state, timeout_s=300)
        restarted_at = time.monotonic()
        deadline = restarted_at + 300
        # Until replies finished after the restart drafted from the replicas again. In a batch the draft gate
        # may prefer plain steps for a while (it measures whether drafting pays), so not every reply drafts.
        while time.monotonic() < deadline:
            with lock:
                recovered = [r for _, t, r in replies if t > restarted_at and not isinstance(r, grpc.RpcError)
                             and not r.stats.degraded and r.stats.draft_tokens_proposed > 0]
            if len(recovered) >= 2 and any(r.stats.draft_tokens_accepted > 0 for r in recovered):
                break
            time.sleep(0.1)
    finally:
        stop.set()
        for t in users:
            t.join(300)
    errors = [r for _, _, r in replies if isinstance(r, grpc.RpcError)]
    assert not errors, [(e.code(), e.details()) for e in errors[:3]]  # no request lost
    for prompt, _, r in replies:
        assert list(r.token_ids) == want[prompt]  # Not a different answer, ever
    degraded = [r for _, t, r in replies if r.stats.degraded]
    assert degraded and all(r.stats.degraded_reason for r in degraded)
    assert any(t > killed_at and r.stats.degraded for _, t, r in replies)
    assert len(recovered) >= 2 and any(r.stats.draft_tokens_accepted > 0 for r in recovered)
    assert sum(_draft_calls(p) for p in topo.retrieval()) > 0  # the restarted replicas served those drafts


def _http(url: str, body: dict | None = None, key: str = API_KEY) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.mark.slow
def test_gateway_started_last_and_serves_the_workers_answer(topology):
    topo, _ = topology
    assert [p.name for p in topo.procs] == ["retrieval", "retrieval-1", "generation", "gateway"]  # dependency order
    gw = topo.get("gateway")
    assert gw.kind == "http" and "--workers" in gw.argv
    assert gw.argv[gw.argv.index("--workers") + 1] == topo.get("generation").address
    url = f"http://{gw.address}"
    assert _http(f"{url}/ready")[0] == 200 and _http(f"{url}/health")[0] == 200
    status, models = _http(f"{url}/v1/models")
    assert status == 200 and models["data"]
    body = {"model": models["data"][0]["id"], "prompt": PROMPTS[0], "max_tokens": N_TOKENS, "temperature": 0}
    status, reply = _http(f"{url}/v1/completions", body)
    assert status == 200, reply
    with GenerationClient(topo.get("generation").address) as c:
        want = c.generate(PROMPTS[0], max_new_tokens=N_TOKENS, decoding="ar", timeout=300)
    assert reply["choices"][0]["text"] == want.text  # Not a different answer through the gateway
    assert reply["usage"]["completion_tokens"] == len(want.token_ids)
    assert _http(f"{url}/v1/completions", body, key="sk-wrong")[0] == 401  # the launcher's keys are enforced


@pytest.mark.slow
def test_sigterm_drains_the_worker(topology):
    topo, _ = topology
    gen = topo.get("generation")
    with GenerationClient(gen.address) as c:
        stream = c.stream(PROMPTS[0], max_new_tokens=64, decoding="ar", ignore_eos=True, timeout=300)
        first = next(stream)
        assert first.token_ids
        os.kill(gen.pid, signal.SIGTERM)
        # Health answers NOT_SERVING (not "connection refused": the port stays open while draining) and new
        # calls are refused ...
        with grpc.insecure_channel(gen.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 30
            serving = True
            while serving and time.monotonic() < deadline:
                serving = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                    health_pb2.HealthCheckResponse.SERVING
                time.sleep(0.05)
            assert not serving
        with GenerationClient(gen.address) as fresh:
            with pytest.raises(grpc.RpcError) as err:
                fresh.generate(PROMPTS[1], max_new_tokens=2, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # ... while the in-flight stream runs to its end.
        rest = list(stream)
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 64
    _, status = os.waitpid(gen.pid, 0)  # the launcher started it: our child
    assert os.waitstatus_to_exitcode(status) == 0


def test_corrupted_datastore_exits_with_the_loaders_message(datastore, tmp_path):
    bad = tmp_path / "ds"
    shutil.copytree(datastore.path, bad)
    shard = next(bad.glob("shard-*.rsa"))
    with open(shard, "r+b") as f:  # truncate: a copy that did not finish
        f.truncate(shard.stat().st_size // 2)
    port = launcher.free_port()
    proc = subprocess.run([sys.executable, "-m", "retrieval_service.server", "--datastore", str(bad),
                           "--port", str(port)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "cannot serve" in last and "corrupted" in last and str(shard) in last, last
    assert "Traceback" not in proc.stderr  # a clear one-line error, not a stack dump
    # The launcher (and `make up`) stop at once with the same message instead of waiting for a timeout.
    with pytest.raises(RuntimeError, match="corrupted"):
        launcher.up(datastore=str(bad), state=tmp_path / "run" / "launcher.json", timeout_s=300)
