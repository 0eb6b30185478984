"""The npm `openai` SDK (pinned by tests/gateway_api/node/package-lock.json, installed by `make node-sdk`) runs
tests/gateway_api/node/sdk_check.mjs unchanged against the gateway on a free loopback port, in front of a real worker:
chat, completions, streaming with usage, n=2, logprobs and seed. The script checks the shape of every reply; here
its texts are compared with the worker's own gRPC replies (greedy and seeded), token for token."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from generation_service.client import GenerationClient

NODE_DIR = Path(__file__).resolve().parent / "node"
MAX_TOKENS = 12
CHAT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
CODE_PROMPT = "def fibonacci(n):\n"

pytestmark = pytest.mark.model


def node_sdk() -> Path:
    """node_modules of tests/gateway_api/node, installed from the lock file if missing; skips without node/npm."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node/npm not installed: the npm openai SDK test needs Node.js >= 20 and npm "
                    "(Debian: apt-get install nodejs npm)")
    if not (NODE_DIR / "node_modules" / "openai" / "package.json").exists():
        run = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=NODE_DIR,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"npm ci failed (make node-sdk):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    pinned = json.loads((NODE_DIR / "package.json").read_text())["dependencies"]["openai"]
    installed = json.loads((NODE_DIR / "node_modules/openai/package.json").read_text())["version"]
    assert installed == pinned, f"node_modules has openai {installed}, package.json pins {pinned} (make node-sdk)"
    return Path(node)


def test_npm_openai_sdk_against_the_gateway(gateway, worker, model_id):
    node = node_sdk()
    # The session's gateway is open (no keys); the SDK still sends one, as it always does.
    env = {**os.environ, "OPENAI_BASE_URL": f"{gateway.url}/v1", "OPENAI_API_KEY": "sk-unused", "RAGSERVE_MODEL": model_id,
           "RAGSERVE_MAX_TOKENS": str(MAX_TOKENS), "RAGSERVE_PROMPT": CHAT[0]["content"],
           "RAGSERVE_CODE_PROMPT": CODE_PROMPT}
    run = subprocess.run([str(node), "sdk_check.mjs"], cwd=NODE_DIR, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"sdk_check.mjs failed:\n{run.stderr[-4000:]}"
    got = json.loads(run.stdout.strip().splitlines()[-1])

    with GenerationClient(worker.address) as direct:
        greedy_chat = direct.generate(messages=CHAT, max_new_tokens=MAX_TOKENS, decoding="ar", timeout=300)
        greedy_code = direct.generate(CODE_PROMPT, max_new_tokens=MAX_TOKENS, decoding="ar", timeout=300)
        seeded = direct.generate(messages=CHAT, max_new_tokens=MAX_TOKENS, temperature=1.0, seed=1234, timeout=300)
    assert got["chat"]["text"] == greedy_chat.text  # Not another text through the gateway
    assert got["chat"]["usage"]["completion_tokens"] == len(greedy_chat.token_ids)
    assert got["completion"]["text"] == greedy_code.text
    assert got["stream"]["text"] == greedy_chat.text and got["stream"]["usage"] == got["chat"]["usage"]
    assert got["stream"]["chunks"] >= 2  # streamed, not one block
    assert got["seed"] == seeded.text  # the seed reaches the worker unchanged
    assert len(got["n2"]) == 2
    assert "".join(t["token"] for t in got["logprobs"]) == greedy_chat.text
    assert all(t["token"] == t["top"][0] for t in got["logprobs"])  # greedy: each token is the top-1

