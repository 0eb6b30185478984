"""docker-compose.yml and the Dockerfiles, checked offline (no Docker engine here): the compose-spec schema
(check-jsonschema's vendored copy) plus our cross-references — dependencies, volumes and secrets resolve, every
RAGSERVE_* variable is a real config field with a valid value, ports agree with the config defaults, commands
name modules that exist, healthchecks are valid Python that really probes a server, grace periods match."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from generation_service.config import GenerationConfig
from retrieval_service.config import RetrievalConfig
from retrieval_service.datastore.draft_tree import DraftTree

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CONFIGS = {"RAGSERVE_RETRIEVAL_": RetrievalConfig, "RAGSERVE_GENERATION_": GenerationConfig}
SERVICE_CONFIG = {"retrieval": RetrievalConfig, "generation": GenerationConfig}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def services(compose):
    return compose["services"].items()


def env_of(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def command_of(svc: dict) -> list[str]:
    cmd = svc.get("command") or []
    return cmd.split() if isinstance(cmd, str) else list(cmd)


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(a + b for a, b in parts) == duration, duration
    return sum(float(a) * units[b] for a, b in parts)


def python_modules(text: str) -> list[str]:
    return re.findall(r"python3?(?:\.\d+)? -m ([A-Za-z_][\w.]*)", text)


# ------------------------------------------------------------------------------------------------- schema

def test_compose_file_matches_the_compose_spec_schema():
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                          str(COMPOSE)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_schema_check_catches_mistakes(tmp_path):
    bad = yaml.safe_load(COMPOSE.read_text())
    bad["services"]["retrieval"]["healthcheck"]["intervall"] = "5s"  # typo
    bad["services"]["generation"]["depends_on"]["retrieval"]["condition"] = "service_ready"  # no such condition
    path = tmp_path / "compose.yml"
    path.write_text(yaml.safe_dump(bad))
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                          str(path)], capture_output=True, text=True)
    assert run.returncode != 0


# ----------------------------------------------------------------------------------------- cross-references

def test_dependencies_volumes_and_secrets_resolve(compose):
    names = set(compose["services"])
    volumes = set(compose.get("volumes") or {})
    secrets = set(compose.get("secrets") or {})
    used_volumes = set()
    for name, svc in services(compose):
        deps = svc.get("depends_on") or {}
        for dep, spec in (deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps)):
            assert dep in names, f"{name} depends on unknown service {dep}"
            assert dep != name
            cond = spec.get("condition")
            want = "service_completed_successfully" if compose["services"][dep].get("restart") == "no" \
                else "service_healthy"
            assert cond == want, f"{name} -> {dep}: {cond}"
            if cond == "service_healthy":
                assert "healthcheck" in compose["services"][dep], f"{dep} has no healthcheck to wait for"
        for v in svc.get("volumes") or []:
            source = v.split(":")[0] if isinstance(v, str) else v["source"]
            if not source.startswith((".", "/")):
                assert source in volumes, f"{name} mounts undeclared volume {source}"
                used_volumes.add(source)
        for s in svc.get("secrets") or []:
            assert (s if isinstance(s, str) else s["source"]) in secrets
        for key, value in env_of(svc).items():
            if value.startswith("/run/secrets/"):
                assert value.removeprefix("/run/secrets/") in (svc.get("secrets") or []), key
    assert used_volumes == volumes  # no orphan volume
    for needed in ("models", "datastores", "indexes"):
        assert needed in volumes


def test_environment_variables_are_config_fields_with_valid_values(compose):
    seen = set()
    for name, svc in services(compose):
        env = env_of(svc)
        for key in env:
            for prefix, cls in CONFIGS.items():
                if key.startswith(prefix):
                    field = key.removeprefix(prefix).lower()
                    assert field in {f.name for f in dataclasses.fields(cls)}, f"{name}: {key} is not a config field"
                    seen.add(prefix)
        if name in SERVICE_CONFIG:
            cls = SERVICE_CONFIG[name]
            prefix = next(p for p, c in CONFIGS.items() if c is cls)
            assert any(k.startswith(prefix) for k in env), f"{name} is not configured through {prefix}*"
            cfg = cls.from_env(env)  # casts every value and runs the config's own validation
            assert cfg.host == "0.0.0.0"  # reachable from the other containers
    assert seen == set(CONFIGS)


def test_ports_agree_with_the_config_defaults(compose):
    for name, cls in SERVICE_CONFIG.items():
        svc = compose["services"][name]
        cfg = cls.from_env(env_of(svc))
        assert cfg.port == cls().port, f"{name}: compose port {cfg.port} != config default {cls().port}"
        exposed = {str(p) for p in svc.get("expose") or []}
        published = {str(p).rsplit(":", 1)[-1] for p in svc.get("ports") or []}
        assert str(cfg.port) in exposed | published, name
        assert cfg.metrics_port and str(cfg.metrics_port) in exposed | published, name
        assert f"localhost:{cfg.port}'" in svc["healthcheck"]["test"][-1], f"{name}: healthcheck probes another port"
        dockerfile = (ROOT / svc["build"]["dockerfile"]).read_text()
        assert re.search(rf"^EXPOSE .*\b{cfg.port}\b", dockerfile, re.M), f"{name}: Dockerfile does not EXPOSE it"
    retrieval_port = RetrievalConfig.from_env(env_of(compose["services"]["retrieval"])).port
    gen = GenerationConfig.from_env(env_of(compose["services"]["generation"]))
    assert gen.retrieval == f"dns:///retrieval:{retrieval_port}"  # every replica, client-side round_robin


def test_retrieval_scales_out_and_the_worker_gets_a_gpu(compose):
    retrieval = compose["services"]["retrieval"]
    assert retrieval["deploy"]["replicas"] >= 2
    assert not retrieval.get("ports"), "replicas cannot share a published host port"
    devices = compose["services"]["generation"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)


def test_stop_grace_period_covers_the_drain(compose):
    for name, cls in SERVICE_CONFIG.items():
        svc = compose["services"][name]
        grace = cls.from_env(env_of(svc)).grace_s
        stop = seconds(svc["stop_grace_period"])
        assert grace < stop <= grace + 30, f"{name}: stop_grace_period {stop} s vs grace_s {grace} s"


def test_security_is_on_in_the_example(compose):
    for name, cls in SERVICE_CONFIG.items():
        cfg = cls.from_env(env_of(compose["services"][name]))
        assert cfg.auth_token_file and cfg.tls_cert and cfg.tls_key and not cfg.auth_token  # token from a secret
    gen = GenerationConfig.from_env(env_of(compose["services"]["generation"]))
    assert gen.retrieval_auth_token_file and gen.retrieval_tls_ca


# ----------------------------------------------------------------------------------------- images/commands

def _main_module(module: str) -> None:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"module {module} does not exist"
    src = Path(spec.origin).read_text()
    assert 'if __name__ == "__main__"' in src, f"{module} cannot run with python -m"


def test_commands_name_modules_that_exist(compose):
    checked = []
    for name, svc in services(compose):
        if "build" in svc:
            dockerfile = ROOT / svc["build"].get("context", ".") / svc["build"]["dockerfile"]
            assert dockerfile.exists(), f"{name}: {dockerfile} missing"
        cmd = command_of(svc)
        if svc.get("image", "").startswith("redis"):
            continue
        if cmd[:2] == ["python", "-m"]:
            _main_module(cmd[2])
            checked.append(cmd[2])
        else:  # an installed script: the Dockerfile must install it
            dockerfile = (ROOT / svc["build"]["dockerfile"]).read_text()
            m = re.search(rf"install -m 0755 (\S+) /usr/local/bin/{re.escape(cmd[0])}\b", dockerfile)
            assert m, f"{name}: {cmd[0]} is not installed by {svc['build']['dockerfile']}"
            script = (ROOT / m.group(1)).read_text()
            for module in python_modules(script):
                _main_module(module)
                checked.append(module)
    for dockerfile in ("Dockerfile.retrieval", "Dockerfile.generation"):
        text = (ROOT / dockerfile).read_text()
        for module in re.findall(r'CMD \["python", "-m", "([\w.]+)"\]', text):
            _main_module(module)
            checked.append(module)
    assert {"retrieval_service.server", "generation_service.server", "generation_service.model_files",
            "retrieval_service.datastore.build", "serving.security"} <= set(checked)


def test_images_build_stubs_and_install_from_pyproject():
    for name in ("Dockerfile.retrieval", "Dockerfile.generation"):
        text = (ROOT / name).read_text()
        assert "ARG BASE_IMAGE=python:3.11-slim" in text, f"{name}: CPU default base image"
        assert "python -m grpc_tools.protoc" in text and "proto/*.proto" in text, f"{name}: stubs"
        assert "pip install --no-deps ." in text and "tomllib" in text, f"{name}: install from pyproject"
        for src in re.findall(r"^COPY (\S+) ", text, re.M):
            if src != ".":
                assert (ROOT / src).exists(), f"{name}: COPY {src} missing"
        assert "USER ragserve" in text  # not root
    assert "nvidia/cuda" in (ROOT / "Dockerfile.generation").read_text()  # the documented CUDA option
    ignored = (ROOT / ".dockerignore").read_text().split()
    for pattern in (".venv", ".git", "proto/*_pb2.py", "var"):
        assert pattern in ignored


# -------------------------------------------------------------------------------------------- healthchecks

class _TinyDatastore:
    vocab_size = 100

    def draft(self, ctx, **kwargs):
        return DraftTree(np.zeros(0, np.int32), np.zeros(0, np.int32))


@pytest.mark.parametrize("service", ["retrieval", "generation"])
def test_healthcheck_is_valid_python_that_probes_grpc_health(compose, service, tmp_path):
    test = compose["services"][service]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    code = test[3]
    ast.parse(code)
    imports = {n.names[0].name.split(".")[0] for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Import)}
    imports |= {n.module.split(".")[0] for n in ast.walk(ast.parse(code)) if isinstance(n, ast.ImportFrom)}
    assert imports <= {"grpc", "grpc_health", "sys"}, imports  # no downloaded probe binaries, nothing else
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed (needed to make test certificates)")
    # Run it for real against a TLS server with the compose certificate layout.
    from retrieval_service.server import build_server
    from serving.security import make_certs

    certs = make_certs(tmp_path / "certs", ["localhost", "127.0.0.1"])
    running = build_server(RetrievalConfig(port=0, tls_cert=str(certs["cert"]), tls_key=str(certs["key"]),
                                           auth_token="probes-need-no-token"), datastore=_TinyDatastore())
    port = SERVICE_CONFIG[service]().port
    local = code.replace("/certs/ca.pem", str(certs["ca"])).replace(f"localhost:{port}", f"localhost:{running.port}")
    try:
        ok = subprocess.run([sys.executable, "-c", local], capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
        running.set_serving(False)
        down = subprocess.run([sys.executable, "-c", local], capture_output=True, text=True, timeout=60)
        assert down.returncode != 0  # NOT_SERVING is unhealthy
    finally:
        running.stop(0)
    gone = subprocess.run([sys.executable, "-c", local], capture_output=True, text=True, timeout=60)
    assert gone.returncode != 0  # nothing listening is unhealthy, not a hang
