"""docker-compose.yml (+ docker-compose.gpu.yml) and the Dockerfiles, checked offline without a Docker engine (the
real deployment runs in `make compose-test`, tests/deploy/compose_e2e.py): the compose-spec schema
(check-jsonschema's vendored copy) plus our cross-references — dependencies, volumes and secrets resolve, every
RAGSERVE_* variable is a real config field with a valid value, ports agree with the config defaults and are
published on loopback only, commands name modules that exist, healthchecks are valid Python that really probes a
server, grace periods match, images are multi-stage and non-root, the CA key stays out of what servers mount."""

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

from gateway.config import GatewayConfig
from generation_service.config import GenerationConfig
from ragcore.draft_tree import DraftTree
from retrieval_service.config import RetrievalConfig

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "docker-compose.gpu.yml"
DOCKERFILES = ("Dockerfile.retrieval", "Dockerfile.generation")
CONFIGS = {"RAGSERVE_RETRIEVAL_": RetrievalConfig, "RAGSERVE_GENERATION_": GenerationConfig}
SERVICE_CONFIG = {"retrieval": RetrievalConfig, "generation": GenerationConfig}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def services(compose):
    return compose["services"].items()


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:+alternative}, with `env` (default: nothing set)."""
    env = env or {}

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        got = env.get(name, "")
        if op == ":-":
            return got or arg
        if op == ":+":
            return arg if got else ""
        return got

    inner = r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\+)([^}$]*))?\}"  # innermost first: ${A:-${B:+x}}
    while re.search(inner, value):
        value = re.sub(inner, sub, value)
    return value


def env_of(svc: dict, env: dict[str, str] | None = None) -> dict[str, str]:
    """A service's environment as the containers get it when `env` is the shell's environment."""
    values = svc.get("environment") or {}
    if isinstance(values, list):
        values = dict(e.split("=", 1) for e in values)
    return {k: interpolate("" if v is None else str(v), env) for k, v in values.items()}


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

@pytest.mark.parametrize("path", [COMPOSE, GPU_OVERRIDE], ids=lambda p: p.name)
def test_compose_file_matches_the_compose_spec_schema(path):
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                          str(path)], capture_output=True, text=True)
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


def test_published_ports_are_loopback_only_and_retrieval_can_scale(compose):
    for name, svc in services(compose):
        for p in svc.get("ports") or []:
            assert isinstance(p, str) and p.startswith("127.0.0.1:"), f"{name}: {p} is not bound to 127.0.0.1"
    for name in ("retrieval", "generation"):
        for p in compose["services"][name]["ports"]:
            assert p.startswith("127.0.0.1::"), f"{name}: {p} fixes a host port, so replicas cannot scale"
    gateway = compose["services"]["gateway"]["ports"]
    assert [interpolate(p) for p in gateway] == ["127.0.0.1:8000:8000"]  # the front door's documented default
    assert [interpolate(p, {"RAGSERVE_GATEWAY_PUBLISH": "18000"}) for p in gateway] == ["127.0.0.1:18000:8000"]


def _flag(argv: list[str], name: str) -> str:
    assert name in argv, f"gateway command lacks {name}"
    return argv[argv.index(name) + 1]


def test_gateway_reaches_every_worker_by_dns_with_tls_and_token(compose, tmp_path):
    gw = compose["services"]["gateway"]
    argv = command_of(gw)
    assert argv[:3] == ["python", "-m", "gateway.server"]
    cfg = GatewayConfig.from_args(argv[3:])  # the gateway's own parser: every flag exists, every value is valid
    assert cfg.workers_dns == "generation:50052" and cfg.port == 8000
    # The secret's file holds RAGSERVE_API_KEYS as given: comma-separated keys are several keys.
    keys = tmp_path / "ragserve_api_keys"
    keys.write_text("sk-one,sk-two")
    assert GatewayConfig(api_keys_file=str(keys)).keys() == {"sk-one", "sk-two"}
    gen_port = GenerationConfig.from_env(env_of(compose["services"]["generation"])).port
    assert _flag(argv, "--workers-dns") == f"generation:{gen_port}"  # every replica of --scale generation=N
    assert "--workers" not in argv  # not a fixed list
    assert _flag(argv, "--host") == "0.0.0.0" and _flag(argv, "--port") == "8000"
    mounted = {f"/run/secrets/{s}" for s in gw["secrets"]}
    assert _flag(argv, "--api-keys-file") in mounted and _flag(argv, "--worker-auth-token-file") in mounted
    assert _flag(argv, "--worker-tls-ca") == "/certs/ca.pem" and "certs:/certs:ro" in gw["volumes"]
    # Replicas are dialled by IP: the certificate's name (init.sh --hosts) must be checked instead.
    hosts = re.search(r"--hosts (\S+)", (ROOT / "docker/init.sh").read_text()).group(1).split(",")
    assert _flag(argv, "--worker-tls-server-name") == "generation" and "generation" in hosts
    assert gw["depends_on"] == {"generation": {"condition": "service_healthy"}}
    assert compose["secrets"]["ragserve_api_keys"] == {"environment": "RAGSERVE_API_KEYS"}
    assert all(v.endswith(":ro") for v in gw["volumes"]) and not any(v.startswith("ca:") for v in gw["volumes"])
    assert gw["image"] == compose["services"]["retrieval"]["image"]  # no third image to build


def test_cpu_host_by_default_gpu_by_override(compose):
    """`docker compose up` must work on a CPU-only host; the GPU reservation and CUDA build live in the override."""
    for name, svc in services(compose):
        assert "devices" not in str(svc.get("deploy", {})), f"{name} reserves a device in the base file"
        args = {k: interpolate(str(v)) for k, v in ((svc.get("build") or {}).get("args") or {}).items()}
        if args:
            assert args["BASE_IMAGE"].startswith("python:3.11-slim") and args["TORCH_INDEX_URL"].endswith("/cpu")
    gpu = yaml.safe_load(GPU_OVERRIDE.read_text())["services"]["generation"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] and d["driver"] == "nvidia" for d in devices)
    args = {k: interpolate(v) for k, v in gpu["build"]["args"].items()}
    assert args["BASE_IMAGE"].startswith("nvidia/cuda:") and "/cu1" in args["TORCH_INDEX_URL"]
    cfg = GenerationConfig.from_env({**env_of(compose["services"]["generation"]), **env_of(gpu)})
    assert (cfg.device, cfg.dtype) == ("cuda", "bf16")
    assert gpu["image"] != compose["services"]["generation"]["image"]  # a CUDA build never replaces the CPU one


# The one volume a server writes: the worker's calibration cache (measured cost curves, reused across restarts).
WRITABLE = {"generation": {"calibration:/data/calibration"}}


def test_data_volumes_are_read_only_and_the_ca_key_stays_with_init(compose):
    for name in SERVICE_CONFIG:
        for v in compose["services"][name]["volumes"]:
            assert v.endswith(":ro") or v in WRITABLE.get(name, ()), f"{name}: {v} is writable"
            assert not v.startswith("ca:"), f"{name} mounts the CA key volume"
    assert "calibration:/data/calibration" in compose["services"]["generation"]["volumes"]
    assert "ca:/ca" in compose["services"]["init"]["volumes"]
    init = (ROOT / "docker/init.sh").read_text()
    assert re.search(r"make-certs --out \"\$CERTS\" --ca-key-dir \"\$CA_KEY_DIR\"", init)
    assert 'CA_KEY_DIR="${RAGSERVE_INIT_CA_KEY_DIR:-/ca}"' in init


def test_make_certs_puts_the_ca_key_where_it_is_told(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    from ragcore.security import make_certs

    files = make_certs(tmp_path / "certs", ["localhost"], ca_key_dir=tmp_path / "ca")
    assert files["ca_key"] == tmp_path / "ca" / "ca.key" and files["ca_key"].exists()
    assert not list((tmp_path / "certs").glob("ca.key")), "the CA key landed in the mounted certs directory"
    stamp = {p: p.stat().st_mtime_ns for p in files.values()}
    assert make_certs(tmp_path / "certs", ["localhost"], ca_key_dir=tmp_path / "ca") == files
    assert {p: p.stat().st_mtime_ns for p in files.values()} == stamp  # idempotent: nothing rewritten


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
            source = m.group(1)
            copied = re.search(rf"^COPY (\S+) {re.escape(source)}$", dockerfile, re.M)  # copied in, then installed
            script = (ROOT / (copied.group(1) if copied else source)).read_text()
            for module in python_modules(script):
                _main_module(module)
                checked.append(module)
    for dockerfile in ("Dockerfile.retrieval", "Dockerfile.generation"):
        text = (ROOT / dockerfile).read_text()
        for module in re.findall(r'CMD \["python", "-m", "([\w.]+)"\]', text):
            _main_module(module)
            checked.append(module)
    assert {"retrieval_service.server", "generation_service.server", "ragcore.model_files",
            "retrieval_service.datastore.build", "ragcore.security"} <= set(checked)


def _stages(text: str) -> list[str]:
    """A Dockerfile's stages (text from one FROM up to the next)."""
    return re.split(r"^(?=FROM )", text, flags=re.M)[1:]


def test_images_build_stubs_and_install_from_pyproject():
    for name in DOCKERFILES:
        text = (ROOT / name).read_text()
        assert "ARG BASE_IMAGE=python:3.11-slim" in text, f"{name}: CPU default base image"
        assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text, f"{name}: CPU torch by default"
        assert "python -m grpc_tools.protoc" in text and "proto/*.proto" in text, f"{name}: stubs"
        # The project goes in through pyproject (a wheel of `.`), never a list of package directories.
        assert "pip wheel --no-deps --wheel-dir /dist ." in text and "tomllib" in text, f"{name}: from pyproject"
        assert "pip install --no-deps /tmp/dist/*.whl" in text
        for src in re.findall(r"^COPY (\S+) ", text, re.M):
            if src not in (".",) and not src.startswith("--from="):
                assert (ROOT / src).exists(), f"{name}: COPY {src} missing"
        assert "USER ragserve" in text  # not root
        instructions = [line for line in text.splitlines() if not line.startswith("#")]
        assert not any(re.match(r"(RUN --mount|COPY --chmod|ADD --chmod)", line) for line in instructions), \
            f"{name}: BuildKit-only syntax (our machines build with the classic builder)"
    assert "nvidia/cuda" in (ROOT / "Dockerfile.generation").read_text()  # the documented CUDA option
    ignored = (ROOT / ".dockerignore").read_text().split()
    for pattern in (".venv", ".git", "proto/*_pb2.py", "var"):
        assert pattern in ignored


def test_images_are_multi_stage_and_share_their_dependency_layers():
    texts = {name: (ROOT / name).read_text() for name in DOCKERFILES}
    stages = {name: _stages(t) for name, t in texts.items()}
    # Each image compiles its CPU kernels in a stage of its own (the compiler stays out of the final): the worker's
    # block linears, the retrieval service's float16 scan.
    expected = {"Dockerfile.retrieval": ["FROM ${BASE_IMAGE} AS deps", "FROM deps AS app", "FROM app AS kernels",
                                         "FROM ${BASE_IMAGE}"],
                "Dockerfile.generation": ["FROM ${BASE_IMAGE} AS deps", "FROM deps AS app", "FROM app AS kernels",
                                          "FROM ${BASE_IMAGE}"]}
    for name, st in stages.items():
        assert [s.split("\n", 1)[0] for s in st] == expected[name], name
        final = st[-1]
        assert "COPY --from=deps /opt/venv /opt/venv" in final and "COPY . " not in final, f"{name}: sources"
        for tool in ("build-essential", "gcc", "g++", "python3-dev", "git "):
            assert tool not in final, f"{name}: {tool} in the final image"
        assert "PIP_NO_CACHE_DIR=1" in final and "rm -rf /tmp/dist" in final, f"{name}: caches left"
    # Same text = the builder reuses the layers, and both images share the ~2 GB dependency layer on disk.
    a, b = (stages[n] for n in DOCKERFILES)
    assert a[:2] == b[:2]
    shared = a[-1].split("COPY --from=deps /opt/venv /opt/venv")[0]
    assert shared == b[-1].split("COPY --from=deps /opt/venv /opt/venv")[0]
    assert "torch/include" not in stages["Dockerfile.generation"][-1]  # the headers stay in the build stages
    for name in DOCKERFILES:
        assert "COPY --from=kernels /kernels/kernels /data/kernels" in stages[name][-1], name


def test_no_secret_is_baked_into_an_image(compose):
    for name in DOCKERFILES:
        text = (ROOT / name).read_text()
        for line in text.splitlines():
            if line.startswith(("ENV ", "ARG ", "COPY ")):
                assert not re.search(r"TOKEN|\.key\b|\.pem\b|SECRET|PASSWORD", line, re.I), f"{name}: {line}"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "var" in ignored and ".git" in ignored
    assert compose["secrets"]["ragserve_token"] == {"environment": "RAGSERVE_AUTH_TOKEN"}  # given at `up`, not built


def test_stand_in_base_images_cover_what_the_build_and_compose_pull():
    """`make compose-test` prepares exactly the images the Dockerfiles start from and compose runs unbuilt."""
    compose = yaml.safe_load(COMPOSE.read_text())
    wanted = {svc["image"] for svc in compose["services"].values() if "build" not in svc}
    for name in DOCKERFILES:
        wanted |= set(re.findall(r"^ARG BASE_IMAGE=(\S+)", (ROOT / name).read_text(), re.M))
    makefile = (ROOT / "Makefile").read_text()
    m = re.search(r"^BASE_IMAGES := (.+)$", makefile, re.M)
    assert m and set(m.group(1).split()) == wanted
    script = (ROOT / "docker/base_images.sh").read_text()
    for image in wanted:
        assert f"{image.split(':')[0]}:*" in script, f"base_images.sh has no stand-in recipe for {image}"


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
    from ragcore.security import make_certs
    from retrieval_service.server import build_server

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


def test_gateway_healthcheck_is_valid_python_that_probes_ready(compose):
    """The gateway's healthcheck passes on 200 from /ready and fails on 503 (no worker SERVING) and on nothing."""
    import http.server
    import threading

    test = compose["services"]["gateway"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    code = test[3]
    imports = {n.names[0].name.split(".")[0] for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Import)}
    assert imports <= {"sys", "urllib"}, imports
    status = {"/ready": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status.get(self.path, 404))
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    local = code.replace("localhost:8000", f"127.0.0.1:{server.server_port}")
    assert local != code
    try:
        ok = subprocess.run([sys.executable, "-c", local], capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
        status["/ready"] = 503
        assert subprocess.run([sys.executable, "-c", local], capture_output=True, timeout=60).returncode != 0
    finally:
        server.shutdown()
        server.server_close()
    assert subprocess.run([sys.executable, "-c", local], capture_output=True, timeout=60).returncode != 0


# ------------------------------------------------------------------------------------------ compose-test scripts

@pytest.mark.parametrize("script,shell", [("docker/engine.sh", "bash"), ("docker/base_images.sh", "bash"),
                                          ("docker/init.sh", "sh")])
def test_scripts_parse(script, shell):
    """The scripts `make compose-test` and the init service run are valid shell (make test needs no Docker)."""
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} not installed")
    run = subprocess.run([shell, "-n", str(ROOT / script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (ROOT / script).stat().st_mode & 0o111, f"{script} is not executable"
