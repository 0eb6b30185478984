"""OpenAI's error JSON with the right HTTP status, from the gateway's own checks and from the worker's gRPC status."""

from __future__ import annotations

import grpc
import httpx2 as httpx
import pytest

from gateway.errors import from_grpc
from tests.gateway_api.conftest import start_gateway

MSG = [{"role": "user", "content": "hi"}]

# (name, path, body (model filled in), HTTP status, param). Each row: the status expected, never 200.
CASES = [
    ("temperature out of range", "/v1/chat/completions", {"messages": MSG, "temperature": 5}, 400, "temperature"),
    ("n zero", "/v1/chat/completions", {"messages": MSG, "n": 0}, 400, "n"),
    ("top_logprobs > 5", "/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 6}, 400,
     "top_logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("no messages", "/v1/chat/completions", {}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]"),
    ("stream_options without stream", "/v1/chat/completions", {"messages": MSG, "stream_options": {}}, 400,
     "stream_options"),
    ("penalty not implemented", "/v1/chat/completions", {"messages": MSG, "presence_penalty": 0.5}, 400,
     "presence_penalty"),
    ("unknown ragserve key", "/v1/chat/completions", {"messages": MSG, "ragserve": {"decodng": "ar"}}, 400,
     "ragserve.decodng"),
    ("logprobs > 5 (completions)", "/v1/completions", {"prompt": "x", "logprobs": 9}, 400, "logprobs"),
    ("prompt of dicts", "/v1/completions", {"prompt": [{"a": 1}]}, 400, "prompt"),
    ("negative seed", "/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed"),
    # The worker's INVALID_ARGUMENT, its field named.
    ("worker: unknown decoding", "/v1/completions", {"prompt": "x", "ragserve": {"decoding": "zzz"}}, 400,
     "decoding"),
    ("worker: max_tokens over its limit", "/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400,
     "max_new_tokens"),
    ("worker: logprobs with knnlm", "/v1/completions", {"prompt": "x", "logprobs": 1,
                                                        "ragserve": {"decoding": "knnlm"}}, 400, "logprobs"),
]


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_error_table(gateway, model_id, name, path, body, status, param):
    r = httpx.post(gateway.url + path, json={"model": model_id, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == status, r.text  # Not 200, not 500
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param.split("[")[0] in err["message"]


def test_unknown_fields_are_ignored(gateway, model_id):
    r = httpx.post(gateway.url + "/v1/chat/completions", timeout=60,
                   json={"model": model_id, "messages": MSG, "max_tokens": 2, "no_such_field": {"x": 1},
                         "presence_penalty": 0, "user": "someone"})
    assert r.status_code == 200, r.text


def test_model_path_json_and_size(gateway, model_id):
    r = httpx.post(gateway.url + "/v1/chat/completions", json={"model": "gpt-9", "messages": MSG})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(gateway.url + "/v1/nothing").status_code == 404
    assert httpx.get(gateway.url + f"/v1/models/{model_id}").json()["id"] == model_id
    r = httpx.post(gateway.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    big = {"model": model_id, "prompt": "x" * (5 << 20)}
    assert httpx.post(gateway.url + "/v1/completions", json=big).status_code == 413


def test_auth(worker, tmp_path, model_id):
    keys = tmp_path / "keys"
    keys.write_text("# clients\nkey-one\nkey-two\n")
    gw = start_gateway(worker.address, api_keys_file=str(keys), api_keys="key-three")
    try:
        body = {"model": model_id, "messages": MSG, "max_tokens": 1}
        for header, status in [(None, 401), ("Bearer wrong", 401), ("key-one", 401), ("Bearer key-one", 200),
                               ("Bearer key-two", 200), ("Bearer key-three", 200)]:
            headers = {"authorization": header} if header else {}
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == status, (header, r.text)
            if status == 401:
                assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(gw.url + "/v1/models").status_code == 401
        assert httpx.get(gw.url + "/health").status_code == 200  # probes need no key
        assert httpx.get(gw.url + "/ready").status_code == 200
    finally:
        gw.stop()


def test_no_worker_503_and_deadline_504(worker, model_id):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: connections are refused
    gw = start_gateway(dead, wait=None, model_name=model_id)
    try:
        assert httpx.get(gw.url + "/ready").status_code == 503
        assert httpx.get(gw.url + "/health").status_code == 200
        r = httpx.post(gw.url + "/v1/completions", json={"model": model_id, "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
    finally:
        gw.stop()
        s.close()
    gw = start_gateway(worker.address, request_timeout_s=0.05)
    try:
        r = httpx.post(gw.url + "/v1/completions", timeout=60,
                       json={"model": model_id, "prompt": "x", "max_tokens": 400, "ragserve": {"ignore_eos": True}})
        assert r.status_code == 504, r.text
    finally:
        gw.stop()


class _Failed(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code,status,param", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "top_p"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, None),
    (grpc.StatusCode.UNAVAILABLE, 503, None),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, None),
    (grpc.StatusCode.UNAUTHENTICATED, 502, None),  # the gateway's credentials, not the client's key
    (grpc.StatusCode.INTERNAL, 500, None),
])
def test_grpc_status_mapping(code, status, param):
    e = from_grpc(_Failed(code, "top_p: must lie in (0, 1], got 2.0"), "w:1")
    assert (e.status, e.param) == (status, param)
    assert e.body()["error"]["message"].startswith("top_p: must lie")
