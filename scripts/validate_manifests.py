#!/usr/bin/env python3
"""Offline checks of the Kubernetes manifests in k8s/ (CI runs them through tests/deploy/).

1. Render each kustomization: `kubectl kustomize` when kubectl is on PATH, else a small Python renderer
   that supports exactly what k8s/ uses (resources, components, patches: strategic merge with
   `$patch: delete` and JSON 6902, namespace, labels without selectors/templates, images). Anything
   else in a kustomization is an error here, so a new kustomize feature cannot slip past CI.
2. Validate core kinds with kubernetes-validate in strict mode (unknown fields are errors).
3. Validate RayClusters against the KubeRay CRD vendored in k8s/vendor/kuberay, with
   `additionalProperties: false` injected so that unknown fields (typos) are errors there too.

    python scripts/validate_manifests.py                       # every overlay and example
    python scripts/validate_manifests.py --renderer python k8s/overlays/gpu
"""

from __future__ import annotations

import argparse
import copy
import functools
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
KUBERNETES_VERSION = "1.32.0"
RAYCLUSTER_CRD = K8S / "vendor" / "kuberay" / "ray.io_rayclusters.yaml"
KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")

Doc = dict[str, Any]
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class RenderError(Exception):
    """A kustomization that cannot be rendered (or uses what the Python renderer does not support)."""


def kustomizations() -> list[Path]:
    """The folders an operator applies: every overlay and example."""
    found = [p.parent for sub in ("overlays", "examples") for p in sorted((K8S / sub).glob("*/kustomization.yaml"))]
    return sorted(found)


def load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.load_all(path.read_text(), Loader=_Loader) if d]


def render(path: Path, renderer: str = "auto") -> list[Doc]:
    """Rendered documents of a kustomization folder. renderer: auto (kubectl if present) | kubectl | python."""
    if renderer == "auto":
        renderer = "kubectl" if shutil.which("kubectl") else "python"
    if renderer == "kubectl":
        done = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise RenderError(f"kubectl kustomize {path}: {done.stderr.strip()}")
        return [d for d in yaml.load_all(done.stdout, Loader=_Loader) if d]
    return _build(Path(path), [])


# --------------------------------------------------------------------------- the Python renderer
_SUPPORTED = {"apiVersion", "kind", "namespace", "labels", "resources", "components", "patches", "images"}
# Kinds kustomize knows the schema of; their lists merge by key. Lists of other kinds (CRDs) are replaced.
_BUILTIN_GROUPS = {"", "apps", "batch", "autoscaling", "policy", "networking.k8s.io", "rbac.authorization.k8s.io",
                   "storage.k8s.io", "scheduling.k8s.io", "coordination.k8s.io"}
_CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                   "PersistentVolume", "StorageClass", "PriorityClass", "IngressClass"}
_CONTAINER_LISTS = {"containers", "initContainers", "ephemeralContainers"}
_NAME_KEYED = _CONTAINER_LISTS | {"volumes", "env", "imagePullSecrets", "resourceClaims"}


def _kustomization(folder: Path) -> Doc:
    for name in KUSTOMIZATION_FILES:
        if (folder / name).is_file():
            k = yaml.load((folder / name).read_text(), Loader=_Loader) or {}
            unknown = set(k) - _SUPPORTED
            if unknown:
                raise RenderError(f"{folder}: the Python renderer does not support {sorted(unknown)}")
            return k
    raise RenderError(f"{folder}: no kustomization file")


def _id(doc: Doc) -> tuple[str, str, str, str]:
    meta = doc.get("metadata", {})
    return doc.get("apiVersion", ""), doc.get("kind", ""), meta.get("namespace", ""), meta.get("name", "")


def _build(folder: Path, incoming: list[Doc]) -> list[Doc]:
    k = _kustomization(folder)
    docs = list(incoming)
    for entry in k.get("resources", []):
        path = (folder / entry).resolve()
        docs += _build(path, []) if path.is_dir() else load_docs(path)
    seen: set[tuple[str, str, str, str]] = set()
    for doc in docs:
        if _id(doc) in seen:
            raise RenderError(f"{folder}: {doc['kind']}/{doc['metadata']['name']} is defined twice")
        seen.add(_id(doc))
    for entry in k.get("components", []):
        docs = _build((folder / entry).resolve(), docs)
    for patch in k.get("patches", []):
        docs = _patch(folder, docs, patch)
    if "namespace" in k:
        for doc in docs:
            if doc["kind"] == "Namespace":
                doc["metadata"]["name"] = k["namespace"]
            elif doc["kind"] not in _CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = k["namespace"]
    for entry in k.get("labels", []):
        if entry.get("includeSelectors") or entry.get("includeTemplates"):
            raise RenderError(f"{folder}: labels with includeSelectors/includeTemplates are not supported")
        for doc in docs:
            doc["metadata"].setdefault("labels", {}).update(entry["pairs"])
    for image in k.get("images", []):
        for doc in docs:
            _set_image(doc, image)
    return docs


def _patch(folder: Path, docs: list[Doc], entry: Doc) -> list[Doc]:
    text = (folder / entry["path"]).read_text() if "path" in entry else entry["patch"]
    parsed = [d for d in yaml.load_all(text, Loader=_Loader) if d is not None]
    target = entry.get("target")
    if len(parsed) == 1 and isinstance(parsed[0], list):          # JSON 6902
        if not target:
            raise RenderError(f"{folder}: a JSON 6902 patch needs a target")
        hits = [d for d in docs if _matches(d, target)]
        if not hits:
            raise RenderError(f"{folder}: patch target {target} matches nothing")
        for doc in hits:
            for op in parsed[0]:
                _json_op(doc, op)
        return docs
    for smp in parsed:                                             # strategic merge
        hits = [d for d in docs if _matches(d, target)] if target else [d for d in docs if _same(d, smp)]
        if not hits:
            raise RenderError(f"{folder}: patch {smp.get('kind')}/{smp.get('metadata', {}).get('name')} "
                              "matches nothing")
        if smp.get("$patch") == "delete":
            docs = [d for d in docs if all(d is not h for h in hits)]
            continue
        body = {k: v for k, v in smp.items() if k not in ("apiVersion", "kind")}
        body["metadata"] = {k: v for k, v in body.get("metadata", {}).items() if k not in ("name", "namespace")}
        for doc in hits:
            builtin = doc["apiVersion"].rpartition("/")[0] in _BUILTIN_GROUPS
            _merge(doc, body, [], builtin, doc["kind"])
    return docs


def _same(doc: Doc, patch: Doc) -> bool:
    meta = patch.get("metadata", {})
    return (doc["kind"] == patch.get("kind") and doc["metadata"]["name"] == meta.get("name")
            and doc["apiVersion"].rpartition("/")[0] == patch.get("apiVersion", "").rpartition("/")[0]
            and meta.get("namespace", doc["metadata"].get("namespace")) == doc["metadata"].get("namespace"))


def _matches(doc: Doc, target: Doc) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    actual = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"],
              "namespace": doc["metadata"].get("namespace", "")}
    if set(target) - set(actual):
        raise RenderError(f"unsupported patch target fields: {sorted(set(target) - set(actual))}")
    return all(re.fullmatch(str(v), actual[k]) for k, v in target.items())


def _merge_key(path: list[str], field: str, kind: str) -> str | None:
    if field in _NAME_KEYED:
        return "name"
    if field == "volumeMounts":
        return "mountPath"
    if field == "topologySpreadConstraints":
        return "topologyKey"
    if field == "ports" and path and path[-1] in _CONTAINER_LISTS:
        return "containerPort"
    if field == "ports" and kind == "Service" and path == ["spec"]:
        return "port"
    return None


def _merge(dest: Doc, patch: Doc, path: list[str], builtin: bool, kind: str) -> None:
    for key, value in patch.items():
        if key.startswith("$"):
            raise RenderError(f"unsupported strategic-merge directive {key} at {'.'.join(path)}")
        if value is None:
            dest.pop(key, None)
        elif isinstance(value, dict) and isinstance(dest.get(key), dict):
            _merge(dest[key], value, [*path, key], builtin, kind)
        elif isinstance(value, list) and isinstance(dest.get(key), list) and builtin:
            merge_key = _merge_key(path, key, kind)
            merged = _merge_list(dest[key], value, merge_key, [*path, key], kind) if merge_key else None
            dest[key] = merged if merged is not None else copy.deepcopy(value)
        else:
            dest[key] = copy.deepcopy(value)


def _merge_list(dest: list[Doc], patch: list[Doc], key: str, path: list[str], kind: str) -> list[Doc]:
    """kustomize's order: the patch's items first (merged into their match), then the rest of dest."""
    existing = {item.get(key): item for item in dest}
    out = []
    for item in patch:
        if item.get(key) in existing:
            merged = existing[item[key]]
            _merge(merged, item, path, True, kind)
            out.append(merged)
        else:
            out.append(copy.deepcopy(item))
    taken = {item.get(key) for item in patch}
    return out + [item for item in dest if item.get(key) not in taken]


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def _json_op(doc: Doc, op: Doc) -> None:
    *parents, last = _pointer(op["path"])
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    name = op["op"]
    if name == "test":
        actual = node[int(last)] if isinstance(node, list) else node.get(last)
        if actual != op["value"]:
            raise RenderError(f"JSON patch test failed at {op['path']}: {actual!r} != {op['value']!r}")
    elif name == "remove":
        del node[int(last) if isinstance(node, list) else last]
    elif name in ("add", "replace"):
        value = copy.deepcopy(op["value"])
        if isinstance(node, list):
            if last == "-":
                node.append(value)
            elif name == "add":
                node.insert(int(last), value)
            else:
                node[int(last)] = value
        else:
            if name == "replace" and last not in node:
                raise RenderError(f"JSON patch replace of missing {op['path']}")
            node[last] = value
    else:
        raise RenderError(f"unsupported JSON patch op {name}")


def _walk_containers(node: Any) -> Iterator[Doc]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _walk_containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk_containers(item)


def _set_image(doc: Doc, image: Doc) -> None:
    for container in _walk_containers(doc):
        ref = container.get("image", "")
        name, digest = ref.split("@", 1) if "@" in ref else (ref, None)
        tag = None
        if ":" in name.rsplit("/", 1)[-1]:
            name, tag = name.rsplit(":", 1)
        if name != image["name"]:
            continue
        name = image.get("newName", name)
        if "digest" in image:
            container["image"] = f"{name}@{image['digest']}"
        elif "newTag" in image:
            container["image"] = f"{name}:{image['newTag']}"
        else:
            container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


# --------------------------------------------------------------------------- validation
def name_of(doc: Doc) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def validate_core(doc: Doc, version: str = KUBERNETES_VERSION) -> list[str]:
    """kubernetes-validate --strict on one document; [] when valid."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = "/".join(str(p) for p in e.path)
        return [f"{name_of(doc)}: {e.message} (at {where or '<root>'})"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{name_of(doc)}: {e.message}"]
    return []


def _forbid_unknown(schema: Any) -> None:
    """additionalProperties: false on every object schema that lists its properties and does not
    declare x-kubernetes-preserve-unknown-fields (CRD schemas leave unknown fields open otherwise)."""
    if isinstance(schema, dict):
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        for value in schema.values():
            _forbid_unknown(value)
    elif isinstance(schema, list):
        for item in schema:
            _forbid_unknown(item)


@functools.cache
def raycluster_validator(strict: bool = True) -> jsonschema.protocols.Validator:
    crd = yaml.load(RAYCLUSTER_CRD.read_text(), Loader=_Loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    if strict:
        _forbid_unknown(schema)
    return jsonschema.Draft7Validator(schema)


def validate_raycluster(doc: Doc, strict: bool = True) -> list[str]:
    if doc.get("apiVersion") != "ray.io/v1":
        return [f"{name_of(doc)}: apiVersion must be ray.io/v1, not {doc.get('apiVersion')}"]
    errors = sorted(raycluster_validator(strict).iter_errors(doc), key=lambda e: list(e.path))
    return [f"{name_of(doc)}: {e.message} (at {'/'.join(str(p) for p in e.path) or '<root>'})" for e in errors]


def validate(doc: Doc) -> list[str]:
    """Every error of one rendered document, whatever its kind."""
    if not doc.get("metadata", {}).get("name"):
        return [f"{doc.get('kind')}: no metadata.name"]
    if doc.get("kind") == "RayCluster":
        return validate_raycluster(doc)
    return validate_core(doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="kustomization folders (default: every overlay)")
    parser.add_argument("--renderer", choices=["auto", "kubectl", "python"], default="auto")
    args = parser.parse_args(argv)
    failed = 0
    for path in args.paths or kustomizations():
        try:
            docs = render(path, args.renderer)
        except RenderError as e:
            print(f"FAIL {path}: {e}")
            failed += 1
            continue
        errors = [err for doc in docs for err in validate(doc)]
        print(f"{'FAIL' if errors else 'ok  '} {path}: {len(docs)} documents")
        for err in errors:
            print(f"     {err}")
        failed += bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
