"""The local launcher runs the compose topology as processes with the same health gating: redis (PING) before
the retrieval replicas, replicas before the worker; `down` stops everything; a state file survives shells."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import redis

from ragcore.grpc_shell import wait_until_serving
from tools import launcher


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_redis_and_replicas_come_up_health_gated_and_go_down(tmp_path):
    state = tmp_path / "launcher.json"
    topo = launcher.up(state=state, replicas=2, redis=True, generation=False, env={"RAGSERVE_RETRIEVAL_WORKERS": "2"},
                       timeout_s=300)
    try:
        assert [p.name for p in topo.procs] == ["redis", "retrieval", "retrieval-1"]  # dependency order
        r = topo.get("redis")
        assert redis.Redis(port=r.port).ping()
        for p in topo.retrieval():
            assert wait_until_serving(p.address, timeout_s=5)
            assert p.env["RAGSERVE_RETRIEVAL_REDIS_URL"] == f"redis://127.0.0.1:{r.port}/0"
            assert p.env["RAGSERVE_RETRIEVAL_WORKERS"] == "2"
        saved = json.loads(state.read_text())
        assert [d["name"] for d in saved] == ["redis", "retrieval", "retrieval-1"]
        assert oct(state.stat().st_mode & 0o777) == "0o600"  # may hold a token
        with pytest.raises(RuntimeError, match="already running"):
            launcher.up(state=state, generation=False)
        # A killed replica comes back on its port with its environment.
        os.kill(topo.get("retrieval-1").pid, signal.SIGKILL)
        back = launcher.restart("retrieval-1", state=state)
        assert back.port == topo.get("retrieval-1").port and wait_until_serving(back.address, timeout_s=5)
    finally:
        launcher.down(state=state, grace_s=10)
    assert not state.exists()
    for p in launcher.Topology([*topo.procs]).procs:
        assert not launcher._alive(p.pid)
