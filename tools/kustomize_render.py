"""Render a kustomization offline, for the subset of kustomize that deploy/k8s/ uses (no kustomize binary needed).

    python -m tools.kustomize_render deploy/k8s/overlays/cpu > rendered.yaml

`kubectl apply -k` is what users run; this renderer exists so `make test` can validate what that command would
apply on a machine without kubectl or network. It implements, with kustomize's semantics:
- `resources`: YAML files (several documents each) and directories holding a kustomization.yaml (recursively);
- `namespace`: set on every namespaced object;
- `images`: `name` -> `newName` / `newTag` on every container and init container;
- `replicas`: `name` + `count` on Deployments;
- `patches` with a `path` or an inline `patch`: strategic merge patches, matched by kind + metadata.name
  (maps merge; `null` deletes a key; the lists Kubernetes merges by key -- containers, env, volumes, ports, ... --
  merge by that key; any other list is replaced);
- `secretGenerator` with `files` (key = file name, or `key=path`) and `options.disableNameSuffixHash: true`.
Any other kustomization field, a patch `target`, a JSON 6902 patch or a `$patch` directive is refused with an
error naming it, rather than rendered differently from kustomize.
"""

from __future__ import annotations

import argparse
import base64
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "images", "replicas", "patches", "secretGenerator"}
# Kinds that live outside namespaces (the ones a deployment like ours may carry).
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
                  "CustomResourceDefinition", "PriorityClass"}
# Strategic merge keys of the lists Kubernetes merges item by item (from the API's patchMergeKey markers).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name", "env": "name",
              "volumes": "name", "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name",
              "tolerations": "key", "hostAliases": "ip"}


class KustomizeError(ValueError):
    pass


def _kustomization_file(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            return directory / name
    raise KustomizeError(f"{directory}: no kustomization.yaml")


def _documents(path: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "metadata" not in d:
            raise KustomizeError(f"{path}: a document without kind/metadata")
    return docs


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """kustomize's strategic merge of `patch` into `base` (both plain YAML data); returns a new object."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if "$patch" in patch or any(k.startswith("$") for k in patch):
            raise KustomizeError(f"{field or 'patch'}: $-directives are not supported by this renderer")
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(patch, list) and isinstance(base, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        out = copy.deepcopy(base)
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise KustomizeError(f"{field}: an item without its merge key {key!r}")
            if any(k.startswith("$") for k in item):
                raise KustomizeError(f"{field}: $-directives are not supported by this renderer")
            at = next((i for i, old in enumerate(out) if isinstance(old, dict) and old.get(key) == item[key]), None)
            if at is None:
                out.append(copy.deepcopy(item))
            else:
                out[at] = strategic_merge(out[at], item, field)
        return out
    return copy.deepcopy(patch)


def _pod_spec(obj: dict) -> dict | None:
    spec = obj.get("spec") or {}
    if obj["kind"] == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    template = spec.get("template")
    return (template or {}).get("spec") if isinstance(template, dict) else None


def _set_image(image: str, rule: dict) -> str:
    name, tag = image, ""
    if "@" in image:
        name = image.split("@", 1)[0]
    elif ":" in image.rsplit("/", 1)[-1]:
        name, tag = image.rsplit(":", 1)
    if name != rule["name"]:
        return image
    new = rule.get("newName", name)
    if rule.get("digest"):
        return f"{new}@{rule['digest']}"
    new_tag = rule.get("newTag", tag)
    return f"{new}:{new_tag}" if new_tag else new


def _secret(spec: dict, base_dir: Path) -> dict:
    unknown = set(spec) - {"name", "files", "type", "options"}
    if unknown:
        raise KustomizeError(f"secretGenerator {spec.get('name')}: unsupported fields {sorted(unknown)}")
    if not (spec.get("options") or {}).get("disableNameSuffixHash"):
        raise KustomizeError(f"secretGenerator {spec['name']}: only options.disableNameSuffixHash: true is "
                             "supported (name suffix hashes would need every reference rewritten)")
    data = {}
    for entry in spec.get("files") or []:
        key, _, rel = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
        path = base_dir / rel
        if not path.is_file():
            raise KustomizeError(f"secretGenerator {spec['name']}: {path} does not exist")
        data[key] = base64.b64encode(path.read_bytes()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": spec["name"]},
            "type": spec.get("type", "Opaque"), "data": data}


def render(directory: str | Path) -> list[dict]:
    """The objects `kubectl kustomize DIRECTORY` prints (kubectl sorts them by kind; these keep resource order)."""
    directory = Path(directory)
    kfile = _kustomization_file(directory)
    k = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(k) - SUPPORTED
    if unknown:
        raise KustomizeError(f"{kfile}: fields not supported by this renderer: {sorted(unknown)}")
    objects: list[dict] = []
    for res in k.get("resources") or []:
        path = directory / res
        objects += render(path) if path.is_dir() else _documents(path)
    for spec in k.get("secretGenerator") or []:
        objects.append(_secret(spec, directory))
    for entry in k.get("patches") or []:
        if set(entry) - {"path", "patch"} or len(entry) != 1:
            raise KustomizeError(f"{kfile}: a patch must have exactly one of path / patch (targets unsupported)")
        text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
        for patch in yaml.safe_load_all(text):
            if not patch:
                continue
            if isinstance(patch, list):
                raise KustomizeError(f"{kfile}: JSON 6902 patches are not supported by this renderer")
            at = [i for i, o in enumerate(objects) if o["kind"] == patch.get("kind")
                  and o["metadata"].get("name") == (patch.get("metadata") or {}).get("name")]
            if len(at) != 1:
                raise KustomizeError(f"{kfile}: patch for {patch.get('kind')}/"
                                     f"{(patch.get('metadata') or {}).get('name')} matches {len(at)} objects")
            objects[at[0]] = strategic_merge(objects[at[0]], patch)
    for rule in k.get("replicas") or []:
        hits = [o for o in objects
                if o["kind"] in ("Deployment", "StatefulSet") and o["metadata"]["name"] == rule["name"]]
        if not hits:
            raise KustomizeError(f"{kfile}: replicas for {rule['name']}: no such Deployment")
        for o in hits:
            o["spec"]["replicas"] = int(rule["count"])
    for rule in k.get("images") or []:
        for o in objects:
            pod = _pod_spec(o)
            for c in (pod or {}).get("containers", []) + (pod or {}).get("initContainers", []):
                c["image"] = _set_image(c["image"], rule)
    if k.get("namespace"):
        for o in objects:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]
    return objects


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.kustomize_render", description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", help="a directory with a kustomization.yaml (e.g. deploy/k8s/overlays/cpu)")
    args = ap.parse_args(argv)
    try:
        objects = render(args.directory)
    except KustomizeError as e:
        raise SystemExit(f"kustomize_render: {e}")
    yaml.safe_dump_all(objects, sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
