"""deploy/k8s/ checked offline (no cluster, no kubectl): the cpu overlay rendered the way `kubectl apply -k` would
(tools/kustomize_render.py, its own semantics tested here against hand-worked cases), every object validated
against the Kubernetes API schemas of kubernetes-validate (strict: unknown fields fail) for the oldest and newest
versions we state, plus what a schema cannot see: probes and resources on every container, selectors that match
their pods, Services whose ports exist, references that resolve, config variables that are real config fields,
and the NetworkPolicies evaluated as a CNI would: only the gateway reaches the workers, only the workers reach
retrieval."""

from __future__ import annotations

import base64
import dataclasses
import importlib.util
import re
import shutil
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from gateway.config import GatewayConfig
from generation_service.config import GenerationConfig
from retrieval_service.config import RetrievalConfig
from tools.kustomize_render import KustomizeError, render, strategic_merge

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# Native gRPC probes are GA since 1.27; we state 1.29 (the oldest minor still patched by most providers in 2026)
# up to the newest schema kubernetes-validate ships.
K8S_VERSIONS = ("1.29", "1.37")
CONFIGS = {"RAGSERVE_RETRIEVAL_": RetrievalConfig, "RAGSERVE_GENERATION_": GenerationConfig}
TOKEN = "test-token-" + "0" * 32


@pytest.fixture(scope="module")
def objects(tmp_path_factory) -> list[dict]:
    """The cpu overlay rendered from a copy holding the secret files `make k8s-secrets` writes."""
    copy = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copy)
    (copy / "overlays/cpu/secrets/auth-token").write_text(TOKEN)
    (copy / "overlays/cpu/secrets/api-keys").write_text("key-one\nkey-two\n")
    return render(copy / "overlays/cpu")


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def matches(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels + matchExpressions In/NotIn/Exists/DoesNotExist) against a label set."""
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        op, key, values = e["operator"], e["key"], e.get("values") or []
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def ingress_allowed(policies: list[dict], src: dict, dst: dict, port: int, src_ns: str = "ragserve",
                    dst_ns: str = "ragserve", ns_labels: dict | None = None) -> bool:
    """Would a NetworkPolicy-enforcing CNI let a pod labelled `src` open TCP `port` on a pod labelled `dst`?"""
    ns_labels = ns_labels or {"kubernetes.io/metadata.name": src_ns}
    selecting = [p for p in policies if p["metadata"].get("namespace") == dst_ns
                 and matches(p["spec"]["podSelector"], dst) and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True  # a pod no policy selects is not isolated
    for p in selecting:
        for rule in p["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(pp.get("protocol", "TCP") == "TCP" and pp.get("port") == port for pp in ports):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                ns_ok = (matches(peer["namespaceSelector"], ns_labels) if "namespaceSelector" in peer
                         else src_ns == dst_ns)
                pod_ok = matches(peer["podSelector"], src) if "podSelector" in peer else True
                if "ipBlock" not in peer and ns_ok and pod_ok:
                    return True
    return False


# ------------------------------------------------------------------------------------------- the renderer

MERGE_CASES = [
    # (base, patch, expected, not expected)
    ({"a": 1, "b": {"c": 2}}, {"b": {"d": 3}}, {"a": 1, "b": {"c": 2, "d": 3}}, {"a": 1, "b": {"d": 3}}),
    ({"a": 1, "b": 2}, {"b": None}, {"a": 1}, {"a": 1, "b": None}),
    ({"args": ["x", "y"]}, {"args": ["z"]}, {"args": ["z"]}, {"args": ["x", "y", "z"]}),  # plain lists replace
    ({"containers": [{"name": "a", "image": "i", "env": [{"name": "X", "value": "1"}]}, {"name": "b"}]},
     {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}, {"name": "X", "value": "3"}]}]},
     {"containers": [{"name": "a", "image": "i", "env": [{"name": "X", "value": "3"}, {"name": "Y", "value": "2"}]},
                     {"name": "b"}]},
     {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}, {"name": "X", "value": "3"}]}]}),
    ({"volumeMounts": [{"mountPath": "/a", "name": "x"}]}, {"volumeMounts": [{"mountPath": "/b", "name": "y"}]},
     {"volumeMounts": [{"mountPath": "/a", "name": "x"}, {"mountPath": "/b", "name": "y"}]},
     {"volumeMounts": [{"mountPath": "/b", "name": "y"}]}),
]


@pytest.mark.parametrize("base,patch,expected,not_expected", MERGE_CASES)
def test_strategic_merge(base, patch, expected, not_expected):
    got = strategic_merge(base, patch)
    assert got == expected
    assert got != not_expected


def test_strategic_merge_leaves_its_inputs_alone():
    base = {"containers": [{"name": "a", "env": []}]}
    strategic_merge(base, {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}]}]})
    assert base == {"containers": [{"name": "a", "env": []}]}


def _write(directory: Path, files: dict[str, object]) -> None:
    for name, content in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else yaml.safe_dump_all(content))


def _deployment(name: str, image: str) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": name, "image": image}]}}}}


def test_render_overlay_with_images_replicas_namespace_and_secrets(tmp_path):
    _write(tmp_path, {
        "base/kustomization.yaml": "resources: [app.yaml]\n",
        "base/app.yaml": [_deployment("web", "web:1"), _deployment("db", "registry.local:5000/db:2")],
        "over/kustomization.yaml": yaml.safe_dump({
            "resources": ["../base", "ns.yaml"], "namespace": "prod",
            "images": [{"name": "web", "newName": "reg.example/web", "newTag": "9"},
                       {"name": "registry.local:5000/db", "newTag": "3"}],
            "replicas": [{"name": "web", "count": 4}],
            "patches": [{"path": "p.yaml"}],
            "secretGenerator": [{"name": "s", "files": ["k=secret.txt"], "options": {"disableNameSuffixHash": True}}]}),
        "over/ns.yaml": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "prod"}}],
        "over/p.yaml": [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "db"},
                         "spec": {"template": {"spec": {"containers": [{"name": "db", "args": ["--x"]}]}}}}],
        "over/secret.txt": "hunter2",
    })
    out = render(tmp_path / "over")
    deps = by_kind(out, "Deployment")
    assert pod_spec(deps["web"])["containers"][0]["image"] == "reg.example/web:9"  # Not web:1
    assert pod_spec(deps["db"])["containers"][0] == {"name": "db", "image": "registry.local:5000/db:3",
                                                     "args": ["--x"]}
    assert deps["web"]["spec"]["replicas"] == 4 and deps["db"]["spec"]["replicas"] == 1
    assert all(o["metadata"].get("namespace") == "prod" for o in out if o["kind"] != "Namespace")
    assert "namespace" not in by_kind(out, "Namespace")["prod"]["metadata"]  # cluster-scoped
    assert base64.b64decode(by_kind(out, "Secret")["s"]["data"]["k"]) == b"hunter2"


@pytest.mark.parametrize("kustomization,error", [
    ({"resources": ["a.yaml"], "commonLabels": {"x": "y"}}, "commonLabels"),
    ({"resources": ["a.yaml"], "patches": [{"path": "p.yaml", "target": {"kind": "Deployment"}}]}, "targets"),
    ({"resources": ["a.yaml"], "patches": [{"patch": "kind: Deployment\nmetadata: {name: nope}\n"}]}, "matches 0"),
    ({"resources": ["a.yaml"], "secretGenerator": [{"name": "s", "files": ["a.yaml"]}]}, "disableNameSuffixHash"),
    ({"resources": ["a.yaml"], "secretGenerator": [{"name": "s", "files": ["gone"],
                                                    "options": {"disableNameSuffixHash": True}}]}, "does not exist"),
])
def test_render_refuses_what_it_does_not_implement(tmp_path, kustomization, error):
    _write(tmp_path, {"kustomization.yaml": yaml.safe_dump(kustomization), "a.yaml": [_deployment("web", "w:1")],
                      "p.yaml": [_deployment("web", "w:2")]})
    with pytest.raises(KustomizeError, match=error):
        render(tmp_path)


def test_deploy_k8s_uses_only_what_the_renderer_implements():
    for kfile in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        assert set(k) <= {"apiVersion", "kind", "resources", "namespace", "images", "replicas", "patches",
                          "secretGenerator"}, kfile


# ------------------------------------------------------------------------------------------------ schemas

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schema(objects, version):
    kinds = set()
    for o in objects:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{o['kind']}/{o['metadata']['name']} on {version}: {'.'.join(map(str, e.path))}: {e.message}")
        kinds.add(o["kind"])
    assert {"Deployment", "Service", "PersistentVolumeClaim", "Job", "Secret", "NetworkPolicy", "Namespace"} <= kinds


def test_the_schema_check_catches_mistakes(objects):
    bad = yaml.safe_load(yaml.safe_dump(by_kind(objects, "Deployment")["generation"]))
    pod_spec(bad)["containers"][0]["readinessProbe"]["grpc"]["prot"] = 50052  # typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    bad = yaml.safe_load(yaml.safe_dump(by_kind(objects, "Deployment")["generation"]))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


# ----------------------------------------------------------------------------------------- what we require

def test_the_overlay_has_the_three_deployments_and_the_worker_services(objects):
    deps = by_kind(objects, "Deployment")
    assert set(deps) == {"retrieval", "generation", "gateway"}
    assert deps["generation"]["spec"]["replicas"] == 2  # the cpu overlay's fleet
    services = by_kind(objects, "Service")
    assert services["generation-workers"]["spec"]["clusterIP"] == "None"  # headless: one DNS record per pod
    assert services["retrieval"]["spec"]["clusterIP"] == "None"  # the workers' dns:/// round-robins the replicas
    assert services["gateway"]["spec"].get("clusterIP") != "None"
    assert all(o["metadata"].get("namespace") == "ragserve" for o in objects if o["kind"] != "Namespace")


def _containers(obj: dict) -> list[dict]:
    spec = pod_spec(obj)
    return spec.get("initContainers", []) + spec["containers"]


def test_every_container_has_resources_and_every_server_has_probes(objects):
    for o in [*by_kind(objects, "Deployment").values(), *by_kind(objects, "Job").values()]:
        for c in _containers(o):
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c.get("resources", {}).get(kind, {})), \
                    f"{o['metadata']['name']}/{c['name']}: resources.{kind}"
            sc = c.get("securityContext") or {}
            assert sc.get("allowPrivilegeEscalation") is False and sc["capabilities"]["drop"] == ["ALL"]
        assert pod_spec(o)["securityContext"]["runAsNonRoot"] is True
    deps = by_kind(objects, "Deployment")
    for name, port in (("retrieval", 50051), ("generation", 50052)):
        c = pod_spec(deps[name])["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == port, f"{name}: {probe} is not a native gRPC probe of {port}"
        assert {"containerPort": port, "name": "grpc"} in c["ports"]
    gw = pod_spec(deps["gateway"])["containers"][0]
    assert gw["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gw["livenessProbe"]["httpGet"]["path"] == "/health"


def test_startup_budget_covers_calibration_and_grace_covers_the_drain(objects):
    deps = by_kind(objects, "Deployment")
    gen = pod_spec(deps["generation"])
    startup = gen["containers"][0]["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # first start calibrates (compose: 600 s)
    for name, cls in (("retrieval", RetrievalConfig), ("generation", GenerationConfig)):
        spec = pod_spec(deps[name])
        grace = cls.from_env(env_of(spec["containers"][0])).grace_s
        assert grace < spec["terminationGracePeriodSeconds"] <= grace + 30, name


def test_selectors_match_their_pods_and_services_find_ports(objects):
    deps = by_kind(objects, "Deployment")
    for name, d in deps.items():
        assert matches(d["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"]), name
    for o in by_kind(objects, "Job").values():
        assert o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "init"
    for name, svc in by_kind(objects, "Service").items():
        targets = [d for d in deps.values()
                   if matches({"matchLabels": svc["spec"]["selector"]}, d["spec"]["template"]["metadata"]["labels"])]
        assert len(targets) == 1, f"service {name} selects {len(targets)} Deployments"
        ports = {p["name"]: p["containerPort"] for c in pod_spec(targets[0])["containers"] for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports and ports[p["targetPort"]] == p["port"], f"{name}: {p}"


def test_references_resolve(objects):
    secrets = by_kind(objects, "Secret")
    claims = set(by_kind(objects, "PersistentVolumeClaim"))
    for o in [*by_kind(objects, "Deployment").values(), *by_kind(objects, "Job").values()]:
        volumes = {v["name"]: v for v in pod_spec(o)["volumes"]}
        for c in _containers(o):
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{o['metadata']['name']}/{c['name']}: volume {m['name']}"
        for v in volumes.values():
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
    assert base64.b64decode(secrets["ragserve-auth"]["data"]["token"]).decode() == TOKEN
    assert base64.b64decode(secrets["ragserve-gateway"]["data"]["api-keys"]).decode().split() == ["key-one",
                                                                                                "key-two"]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _secret_files(o: dict, container: dict) -> set[str]:
    """Paths of files the container sees from Secret volumes."""
    volumes = {v["name"]: v for v in pod_spec(o)["volumes"]}
    out = set()
    for m in container.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "secret" in v:
            secret = v["secret"]["secretName"]
            keys = {"ragserve-auth": ["token"], "ragserve-gateway": ["api-keys"]}[secret]
            out |= {f"{m['mountPath']}/{k}" for k in keys}
    return out


def test_config_variables_are_real_fields_and_token_files_are_mounted(objects):
    deps = by_kind(objects, "Deployment")
    for name, cls in (("retrieval", RetrievalConfig), ("generation", GenerationConfig)):
        c = pod_spec(deps[name])["containers"][0]
        env = env_of(c)
        prefix = next(p for p, k in CONFIGS.items() if k is cls)
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in env:
            if key.startswith(prefix):
                assert key.removeprefix(prefix).lower() in fields, f"{name}: {key} is not a config field"
        cfg = cls.from_env(env)  # casts and validates every value
        assert cfg.host == "0.0.0.0" and cfg.port == cls().port
        assert cfg.auth_token_file in _secret_files(deps[name], c), f"{name}: its token file is not mounted"
        assert cfg.metrics_port == 9100
    gen = GenerationConfig.from_env(env_of(pod_spec(deps["generation"])["containers"][0]))
    assert gen.retrieval == "dns:///retrieval:50051"
    assert gen.retrieval_auth_token_file in _secret_files(deps["generation"], pod_spec(deps["generation"])["containers"][0])
    assert GenerationConfig.from_env(env_of(pod_spec(deps["generation"])["containers"][0])).device == "cpu"  # overlay


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_gateway_finds_the_workers_through_the_headless_service(objects, tmp_path):
    gw = by_kind(objects, "Deployment")["gateway"]
    c = pod_spec(gw)["containers"][0]
    argv = c["command"]
    assert argv[:3] == ["python", "-m", "gateway.server"]
    cfg = GatewayConfig.from_args(argv[3:])  # the gateway's own parser: every flag exists, every value is valid
    assert (cfg.host, cfg.port, cfg.workers_dns, cfg.workers) == ("0.0.0.0", 8000, "generation-workers:50052", "")
    # The API keys Secret as the gateway reads its file.
    keys = tmp_path / "api-keys"
    keys.write_bytes(base64.b64decode(by_kind(objects, "Secret")["ragserve-gateway"]["data"]["api-keys"]))
    assert GatewayConfig(api_keys_file=str(keys)).keys() == {"key-one", "key-two"}
    assert _flag(argv, "--workers-dns") == "generation-workers:50052"
    assert _flag(argv, "--port") == "8000" and _flag(argv, "--host") == "0.0.0.0"
    files = _secret_files(gw, c)
    assert _flag(argv, "--api-keys-file") in files and _flag(argv, "--worker-auth-token-file") in files
    svc = by_kind(objects, "Service")["generation-workers"]
    assert [p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc"] == [50052]


def test_commands_name_modules_that_exist(objects):
    for o in [*by_kind(objects, "Deployment").values(), *by_kind(objects, "Job").values()]:
        for c in pod_spec(o)["containers"]:
            text = " ".join(c["command"])
            for module in re.findall(r"python -m ([\w.]+)", text):
                spec = importlib.util.find_spec(module)
                assert spec is not None and 'if __name__ == "__main__"' in Path(spec.origin).read_text(), module
            if "ragserve-init" in text:
                assert "install -m 0755 /tmp/init.sh /usr/local/bin/ragserve-init" in \
                    (ROOT / "Dockerfile.retrieval").read_text()
                assert c["image"].startswith("ragserve-retrieval")


def test_init_marker_is_what_the_servers_wait_for(objects):
    job = by_kind(objects, "Job")["ragserve-init"]
    marker = re.search(r"touch (\S+)", " ".join(pod_spec(job)["containers"][0]["command"])).group(1)
    for name in ("retrieval", "generation"):
        waits = " ".join(pod_spec(by_kind(objects, "Deployment")[name])["initContainers"][0]["command"])
        assert f"[ -f {marker} ]" in waits, name


# Scenario table: (from, to, port, allowed). Labels as the pods carry them.
def _labels(component: str) -> dict:
    return {"app.kubernetes.io/name": "ragserve", "app.kubernetes.io/part-of": "ragserve",
            "app.kubernetes.io/component": component}


TRAFFIC = [
    ("gateway", "generation", 50052, True),
    ("retrieval", "generation", 50052, False),  # Not allowed: only the gateway reaches workers
    ("generation", "generation", 50052, False),
    ("other", "generation", 50052, False),  # any other pod in the namespace
    ("generation", "retrieval", 50051, True),
    ("gateway", "retrieval", 50051, False),  # Not allowed: the gateway talks to workers only
    ("other", "retrieval", 50051, False),
    ("other", "gateway", 8000, True),  # the front door
    ("other", "gateway", 9100, False),
    ("gateway", "generation", 9100, False),
]


@pytest.mark.parametrize("src,dst,port,allowed", TRAFFIC)
def test_network_policy(objects, src, dst, port, allowed):
    policies = list(by_kind(objects, "NetworkPolicy").values())
    src_labels = {"app": "something-else"} if src == "other" else _labels(src)
    assert ingress_allowed(policies, src_labels, _labels(dst), port) is allowed


def test_network_policy_covers_every_pod_and_metrics_come_from_monitoring(objects):
    policies = list(by_kind(objects, "NetworkPolicy").values())
    for o in [*by_kind(objects, "Deployment").values(), *by_kind(objects, "Job").values()]:
        labels = o["spec"]["template"]["metadata"]["labels"]
        assert any(matches(p["spec"]["podSelector"], labels) for p in policies), o["metadata"]["name"]
    mon = {"kubernetes.io/metadata.name": "monitoring"}
    for dst in ("generation", "retrieval"):
        assert ingress_allowed(policies, {"app": "prometheus"}, _labels(dst), 9100, src_ns="monitoring",
                               ns_labels=mon)
        assert not ingress_allowed(policies, {"app": "prometheus"}, _labels(dst), 50052 if dst == "generation"
                                   else 50051, src_ns="monitoring", ns_labels=mon)
    assert not ingress_allowed(policies, {"app": "x"}, _labels("generation"), 9100, src_ns="default",
                               ns_labels={"kubernetes.io/metadata.name": "default"})
