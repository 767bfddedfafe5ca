"""The Kubernetes manifests (k8s/), checked offline: every overlay renders (kubectl kustomize and the
Python fallback agree), every document passes schema validation (kubernetes-validate --strict; the
KubeRay CRD for RayClusters), each validator rejects a deliberately broken manifest, and the pieces
fit together (selectors, ports, references, probes, GPU and PD-disaggregated layouts)."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml
from yamllint import config as yamllint_config
from yamllint import linter

from .conftest import ROOT, load_validator

vm = load_validator()
K8S = ROOT / "k8s"
NAMES = [p.name for p in vm.kustomizations()]
OVERLAYS = ["cpu-demo", "gpu", "pd-disaggregated"]
IMAGE = "raincheck-serve"
# Secrets that no kustomization creates (the operator does; templates in k8s/secrets/), with their keys.
EXTERNAL_SECRETS = {"raincheck-api-keys": {"api-keys"}, "raincheck-redis": {"url"}}
GENERATED_SECRETS = {"raincheck-ray"}   # KubeRay creates it for RayCluster raincheck-ray (authOptions)
RENDERERS = ["python", *(["kubectl"] if shutil.which("kubectl") else [])]
YAMLLINT = """
extends: default
ignore: |
  vendor/
rules:
  document-start: disable
  line-length: {max: 120}
  comments: {min-spaces-from-content: 1}
  truthy: {check-keys: false}
  indentation: {spaces: 2, indent-sequences: whatever}
"""


# ------------------------------------------------------------------------------------------ helpers
def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = find(docs, kind, name)
    return doc


def pod_templates(docs: list[dict]) -> list[tuple[str, dict]]:
    """(owner, pod template) of every workload, RayCluster head and worker groups included."""
    out = []
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            out.append((vm.name_of(doc), doc["spec"]["template"]))
        elif doc["kind"] == "RayCluster":
            out.append((f"{vm.name_of(doc)}/head", doc["spec"]["headGroupSpec"]["template"]))
            out += [(f"{vm.name_of(doc)}/{g['groupName']}", g["template"]) for g in doc["spec"]["workerGroupSpecs"]]
    return out


def pod_labels(doc_owner: str, template: dict, docs: list[dict]) -> dict[str, str]:
    labels = dict(template.get("metadata", {}).get("labels", {}))
    if doc_owner.startswith("RayCluster/"):       # labels KubeRay adds to the pods it creates
        labels["ray.io/cluster"] = doc_owner.split("/")[1]
    return labels


def selects(selector: dict, labels: dict[str, str]) -> bool:
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return bool(selector)


def config(docs: list[dict]) -> dict[str, str]:
    return one(docs, "ConfigMap", "raincheck-config")["data"]


def container(docs: list[dict], kind: str, name: str) -> dict:
    return one(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]


def env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def by_id(docs: list[dict]) -> dict:
    return {vm._id(d): d for d in docs}


# ------------------------------------------------------------------------------------------ rendering
def test_every_overlay_and_example_is_found() -> None:
    assert set(OVERLAYS) | {"managed-redis", "multi-gpu-decode"} <= set(NAMES)


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl is not installed: only the Python renderer runs")
@pytest.mark.parametrize("name", NAMES)
def test_python_renderer_matches_kubectl(rendered: dict, name: str) -> None:
    """The fallback renderer (CI machines without kubectl) produces exactly what kubectl does."""
    path = dict(zip(NAMES, vm.kustomizations(), strict=True))[name]
    assert by_id(vm.render(path, "python")) == by_id(rendered[name])     # `rendered` used kubectl


# ------------------------------------------------------------------------------------------ schemas
@pytest.mark.parametrize("name", NAMES)
def test_every_document_validates(rendered: dict, name: str) -> None:
    docs = rendered[name]
    assert docs
    errors = [err for doc in docs for err in vm.validate(doc)]
    assert errors == []


def test_secret_templates_validate() -> None:
    templates = sorted((K8S / "secrets").glob("*.yaml"))
    assert {d["metadata"]["name"]: set(d["stringData"]) for p in templates for d in vm.load_docs(p)} == EXTERNAL_SECRETS
    assert [err for p in templates for d in vm.load_docs(p) for err in vm.validate(d)] == []


def _frontend(rendered: dict) -> dict:
    return copy.deepcopy(one(rendered["gpu"], "Deployment", "raincheck-frontend"))


def _raycluster(rendered: dict) -> dict:
    return copy.deepcopy(one(rendered["gpu"], "RayCluster", "raincheck-ray"))


def _typo_replica(d: dict) -> None:
    d["spec"]["replica"] = 2


def _wrong_type(d: dict) -> None:
    d["spec"]["revisionHistoryLimit"] = "five"


def _probe_typo(d: dict) -> None:
    d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["servce"] = "raincheck"


def _bad_api_version(d: dict) -> None:
    d["apiVersion"] = "apps/v1beta9"


@pytest.mark.parametrize("breakage, expected", [
    (_typo_replica, "'replica' was unexpected"),
    (_wrong_type, "'five' is not of type 'integer'"),
    (_probe_typo, "'servce' was unexpected"),
    (_bad_api_version, "Couldn't find schema"),
])
def test_core_validator_rejects_a_broken_manifest(rendered: dict, breakage, expected: str) -> None:
    doc = _frontend(rendered)
    assert vm.validate(doc) == []
    breakage(doc)
    errors = vm.validate(doc)
    assert errors and expected in errors[0], errors


def _max_replica_typo(d: dict) -> None:
    group = d["spec"]["workerGroupSpecs"][0]
    group["maxReplica"] = group.pop("maxReplicas")


def _replicas_string(d: dict) -> None:
    d["spec"]["workerGroupSpecs"][0]["replicas"] = "one"


def _no_group_name(d: dict) -> None:
    del d["spec"]["workerGroupSpecs"][0]["groupName"]


def _int_start_param(d: dict) -> None:
    d["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0


def _container_typo(d: dict) -> None:
    d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"


@pytest.mark.parametrize("breakage, expected", [
    (_max_replica_typo, "'maxReplica' was unexpected"),
    (_replicas_string, "'one' is not of type 'integer'"),
    (_no_group_name, "'groupName' is a required property"),
    (_int_start_param, "0 is not of type 'string'"),
    (_container_typo, "'imagePullPolicyy' was unexpected"),
])
def test_raycluster_validator_rejects_a_broken_manifest(rendered: dict, breakage, expected: str) -> None:
    doc = _raycluster(rendered)
    assert vm.validate(doc) == []
    breakage(doc)
    errors = vm.validate(doc)
    assert any(expected in e for e in errors), errors


def test_raycluster_typos_pass_without_the_injected_additional_properties(rendered: dict) -> None:
    """Why the validator injects `additionalProperties: false`: the CRD's own schema lets typos through."""
    doc = _raycluster(rendered)
    doc["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert vm.validate_raycluster(doc, strict=False) == []
    assert any("'maxReplica' was unexpected" in e for e in vm.validate_raycluster(doc))


@pytest.mark.parametrize("renderer", RENDERERS)
def test_the_pipeline_rejects_a_broken_overlay(tmp_path: Path, renderer: str) -> None:
    """End to end: an overlay with a Deployment typo and a RayCluster typo renders, then fails validation."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(K8S / "overlays" / "gpu", tmp_path)],
        "patches": [
            {"target": {"kind": "Deployment", "name": "raincheck-frontend"},
             "patch": yaml.safe_dump([{"op": "add", "path": "/spec/replica", "value": 3}])},
            {"target": {"group": "ray.io", "kind": "RayCluster", "name": "raincheck-ray"},
             "patch": yaml.safe_dump([{"op": "add", "path": "/spec/workerGroupSpecs/0/maxReplica", "value": 3}])},
        ],
    }))
    errors = [err for doc in vm.render(tmp_path, renderer) for err in vm.validate(doc)]
    assert any("Deployment/raincheck-frontend" in e and "'replica' was unexpected" in e for e in errors), errors
    assert any("RayCluster/raincheck-ray" in e and "'maxReplica' was unexpected" in e for e in errors), errors
    assert vm.main([str(tmp_path), "--renderer", renderer]) == 1


@pytest.mark.parametrize("renderer", RENDERERS)
def test_renderers_reject_a_patch_that_matches_nothing(tmp_path: Path, renderer: str) -> None:
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(K8S / "overlays" / "cpu-demo", tmp_path)],
        "patches": [{"patch": yaml.safe_dump({"apiVersion": "apps/v1", "kind": "Deployment",
                                              "metadata": {"name": "raincheck-frontnd"}, "spec": {"replicas": 1}})}],
    }))
    with pytest.raises(vm.RenderError):
        vm.render(tmp_path, renderer)


def test_python_renderer_refuses_what_it_does_not_support(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(K8S / "overlays" / "cpu-demo", tmp_path)],
        "configMapGenerator": [{"name": "x", "literals": ["a=b"]}],
    }))
    with pytest.raises(vm.RenderError, match="configMapGenerator"):
        vm.render(tmp_path, "python")


def _yamllint(text: str, path: str) -> list[str]:
    conf = yamllint_config.YamlLintConfig(YAMLLINT)
    return [f"{path}:{p.line}: {p.message}" for p in linter.run(text, conf, path) if p.level == "error"]


def test_yaml_files_are_lint_clean() -> None:
    files = [p for p in sorted(K8S.rglob("*.yaml")) if "vendor" not in p.parts]
    assert len(files) > 10
    assert [e for p in files for e in _yamllint(p.read_text(), str(p.relative_to(K8S)))] == []


def test_yamllint_catches_a_duplicate_key() -> None:
    """PyYAML silently keeps the last of two equal keys; the linter does not."""
    text = (K8S / "overlays" / "cpu-demo" / "small.yaml").read_text()
    assert "  replicas: 1\n" in text
    broken = text.replace("  replicas: 1\n", "  replicas: 1\n  replicas: 3\n")
    assert any("duplication of key" in e for e in _yamllint(broken, "small.yaml"))


# ------------------------------------------------------------------------------------------ fit
@pytest.mark.parametrize("name", NAMES)
def test_namespace_and_labels(rendered: dict, name: str) -> None:
    for doc in rendered[name]:
        labels = doc["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/part-of") == "raincheck", vm.name_of(doc)
        if doc["kind"] == "Namespace":
            assert doc["metadata"]["name"] == "raincheck"
        else:
            assert doc["metadata"].get("namespace") == "raincheck", vm.name_of(doc)
    for owner, template in pod_templates(rendered[name]):
        labels = template["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "raincheck" and labels["app.kubernetes.io/part-of"] == "raincheck"
        assert labels.get("app.kubernetes.io/component"), owner


@pytest.mark.parametrize("name", NAMES)
def test_selectors_services_and_references_resolve(rendered: dict, name: str) -> None:
    docs = rendered[name]
    templates = pod_templates(docs)
    all_labels = [pod_labels(owner, t, docs) for owner, t in templates]
    for doc in find(docs, "Deployment") + find(docs, "StatefulSet"):
        assert selects(doc["spec"]["selector"], doc["spec"]["template"]["metadata"]["labels"]), vm.name_of(doc)
    for svc in find(docs, "Service"):
        if svc["spec"].get("type") == "ExternalName":
            continue
        matched = [t for owner, t in templates if selects({"matchLabels": svc["spec"]["selector"]},
                                                           pod_labels(owner, t, docs))]
        assert len(matched) == 1, vm.name_of(svc)
        port_names = {p["name"] for c in matched[0]["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names, vm.name_of(svc)
    for sts in find(docs, "StatefulSet"):
        assert find(docs, "Service", sts["spec"]["serviceName"]), vm.name_of(sts)
    for pdb in find(docs, "PodDisruptionBudget"):
        assert any(selects(pdb["spec"]["selector"], labels) for labels in all_labels), vm.name_of(pdb)
    for hpa in find(docs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        target = one(docs, ref["kind"], ref["name"])
        assert "replicas" not in target["spec"], "the HPA owns the replica count"
        assert all("cpu" in c["resources"]["requests"] for c in target["spec"]["template"]["spec"]["containers"])
    for policy in find(docs, "NetworkPolicy"):
        selector = policy["spec"]["podSelector"]
        assert selector == {} or any(selects(selector, labels) for labels in all_labels), vm.name_of(policy)
    secrets = {d["metadata"]["name"] for d in find(docs, "Secret")}
    configmaps = {d["metadata"]["name"] for d in find(docs, "ConfigMap")}
    claims = {d["metadata"]["name"] for d in find(docs, "PersistentVolumeClaim")}
    volume_claim_templates = {vm.name_of(d): d["spec"].get("volumeClaimTemplates", [])
                              for d in find(docs, "StatefulSet")}
    for owner, template in templates:
        spec = template["spec"]
        assert spec.get("serviceAccountName") in (None, "raincheck"), owner
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets | set(EXTERNAL_SECRETS), owner
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps, owner
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, owner
        for c in spec["containers"]:
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            claim_templates = {t["metadata"]["name"] for t in volume_claim_templates.get(owner, [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])} | claim_templates, owner
            for source in c.get("envFrom", []):
                assert source["configMapRef"]["name"] in configmaps, owner
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] in GENERATED_SECRETS:
                    assert ref.get("optional") is True, owner
                elif ref and ref["name"] not in secrets:
                    assert ref["key"] in EXTERNAL_SECRETS[ref["name"]], owner


@pytest.mark.parametrize("name", NAMES)
def test_containers_are_sized_and_hardened(rendered: dict, name: str) -> None:
    for owner, template in pod_templates(rendered[name]):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, owner
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", owner
        assert spec.get("automountServiceAccountToken") is False or owner.endswith("/head"), owner
        for c in spec["containers"]:
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][part]), (owner, part)
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, owner
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], owner
            assert c.get("readinessProbe") and c.get("livenessProbe"), owner
            if c["image"].startswith(IMAGE):
                assert re.fullmatch(rf"{IMAGE}:\d+\.\d+\.\d+(-cuda)?", c["image"]), c["image"]


@pytest.mark.parametrize("name", NAMES)
def test_grpc_probes_and_graceful_drain(rendered: dict, name: str) -> None:
    docs = rendered[name]
    servers = (("Deployment", "raincheck-frontend", 50051), ("StatefulSet", "raincheck-decode", 50061))
    for kind, workload, port in servers:
        c = container(docs, kind, workload)
        assert c["command"] == ["raincheck"] and f"{port}" in c["args"]
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"] == port
        assert c["readinessProbe"]["grpc"] == {"port": port}
        # liveness must not follow gRPC health: a draining server is NOT_SERVING but must not be killed
        assert c["livenessProbe"]["tcpSocket"] == {"port": port}
    # a frontend is NOT_SERVING until a worker has registered: its startup must not wait for that
    assert container(docs, "Deployment", "raincheck-frontend")["startupProbe"]["tcpSocket"] == {"port": 50051}
    assert container(docs, "StatefulSet", "raincheck-decode")["startupProbe"]["grpc"] == {"port": 50061}
    drain = float(config(docs)["RAINCHECK_DRAIN_TIMEOUT_S"])
    for kind, workload, _ in servers:
        pod = one(docs, kind, workload)["spec"]["template"]["spec"]
        pre_stop = pod["containers"][0].get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        delay = float(pre_stop[1]) if pre_stop else 0.0
        assert pod["terminationGracePeriodSeconds"] >= delay + drain + 30, workload
    assert "preStop" in container(docs, "Deployment", "raincheck-frontend")["lifecycle"]
    headless = one(docs, "Service", "raincheck-decode")["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    advertise = env(container(docs, "StatefulSet", "raincheck-decode"))["RAINCHECK_ADVERTISE"]["value"]
    assert advertise == "$(POD_NAME).raincheck-decode.$(POD_NAMESPACE).svc:50061"


@pytest.mark.parametrize("name", NAMES)
def test_network_policies(rendered: dict, name: str) -> None:
    docs = rendered[name]
    policies = {p["metadata"]["name"]: p["spec"] for p in find(docs, "NetworkPolicy")}
    assert policies["raincheck-default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    open_rules = [(n, r) for n, spec in policies.items() for r in spec.get("ingress", []) if "from" not in r]
    assert [(n, [p["port"] for p in r["ports"]]) for n, r in open_rules] == [("raincheck-frontend", [50051])]
    if "raincheck-redis" in policies:
        (rule,) = policies["raincheck-redis"]["ingress"]
        (peer,) = rule["from"]
        clients = peer["podSelector"]["matchExpressions"][0]["values"]
        assert sorted(clients) == ["decode-worker", "frontend"]
    has_ray = bool(find(docs, "RayCluster"))
    assert ("raincheck-ray" in policies) == has_ray


def test_raycluster_matches_the_image_and_the_ray_pin(rendered: dict) -> None:
    pin = re.search(r"^ray==([\d.]+)", (ROOT / "requirements" / "runtime.txt").read_text(), re.M).group(1)
    for name, docs in rendered.items():
        for cluster in find(docs, "RayCluster"):
            spec = cluster["spec"]
            assert spec["rayVersion"] == pin
            assert spec["authOptions"] == {"mode": "token"}
            images = {c["image"] for _, t in pod_templates([cluster]) for c in t["spec"]["containers"]}
            assert images == {container(docs, "StatefulSet", "raincheck-decode")["image"]}, name
            for group in spec["workerGroupSpecs"]:
                assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
                assert group["resources"] == {"raincheck_deferred": "1"}
            head = spec["headGroupSpec"]
            assert head["rayStartParams"]["num-cpus"] == "0"
            client = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
            assert config(docs)["RAY_ADDRESS"] == f"ray://{cluster['metadata']['name']}-head-svc:{client['client']}"


def test_cpu_demo_needs_no_gpu_no_kuberay_and_no_secret(rendered: dict) -> None:
    docs = rendered["cpu-demo"]
    assert not find(docs, "RayCluster") and not find(docs, "PersistentVolumeClaim")
    assert "nvidia.com/gpu" not in yaml.safe_dump(docs)
    cfg = config(docs)
    assert cfg["RAY_ADDRESS"] == "" and cfg["RAINCHECK_RECOVERY_MODES"] == "colocated"
    assert cfg["RAINCHECK_DEVICE"] == "cpu" and cfg["RAINCHECK_MODEL"] == "/app/models/demo-v2"
    assert [s["metadata"]["name"] for s in find(docs, "Secret")] == ["raincheck-api-keys"]
    for name in ("gpu", "pd-disaggregated", "managed-redis"):
        assert find(rendered[name], "Secret") == [], f"{name} must not ship a Secret (re-applying would overwrite it)"


@pytest.mark.parametrize("name", ["gpu", "pd-disaggregated", "managed-redis"])
def test_gpu_layout(rendered: dict, name: str) -> None:
    docs = rendered[name]
    cfg = config(docs)
    assert cfg["RAINCHECK_DEVICE"] == "cuda" and cfg["RAINCHECK_DTYPE"] == "bfloat16"
    assert cfg["RAINCHECK_DEFERRED_NUM_GPUS"] == "1"
    cluster = one(docs, "RayCluster", "raincheck-ray")
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert group["rayStartParams"]["num-gpus"] == "1"
    decode = one(docs, "StatefulSet", "raincheck-decode")["spec"]["template"]
    for owner, template in (("decode", decode), ("deferred", group["template"])):
        spec = template["spec"]
        c = spec["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1", owner
        assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true", owner
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"], owner
        mount = {m["name"]: m for m in c["volumeMounts"]}["models"]
        assert mount["readOnly"] is True and cfg["RAINCHECK_MODEL"].startswith(mount["mountPath"] + "/"), owner
        volume = {v["name"]: v for v in spec["volumes"]}["models"]
        assert volume["persistentVolumeClaim"]["claimName"] == "raincheck-models", owner
    assert one(docs, "PersistentVolumeClaim", "raincheck-models")["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert not any(t["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
                   for owner, t in pod_templates(docs) if "frontend" in owner or "head" in owner or "redis" in owner)


def test_multi_gpu_decode_example(rendered: dict) -> None:
    """A decode worker pod with as many GPUs as tensor-parallel ranks, NCCL's environment, a memory-backed
    /dev/shm, and the gpu overlay's model volume still mounted."""
    docs = rendered["multi-gpu-decode"]
    spec = one(docs, "StatefulSet", "raincheck-decode")["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    tp = env["RAINCHECK_TENSOR_PARALLEL_SIZE"]
    resources = c["resources"]
    assert int(tp) > 1 and resources["limits"]["nvidia.com/gpu"] == tp == resources["requests"]["nvidia.com/gpu"]
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and env["NCCL_SOCKET_IFNAME"] == "lo"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert mounts["models"] == "/models" and "persistentVolumeClaim" in volumes["models"]
    assert config(docs)["RAINCHECK_RECOVERY_MODES"] == "colocated"


def test_pd_disaggregated_layout(rendered: dict) -> None:
    docs = rendered["pd-disaggregated"]
    cfg = config(docs)
    assert cfg["RAINCHECK_RECOVERY_MODE"] == "disaggregated"
    assert "disaggregated" in cfg["RAINCHECK_RECOVERY_MODES"].split(",")
    assert config(rendered["gpu"])["RAINCHECK_RECOVERY_MODE"] == "colocated"
    decode = one(docs, "StatefulSet", "raincheck-decode")
    (group,) = one(docs, "RayCluster", "raincheck-ray")["spec"]["workerGroupSpecs"]
    assert decode["spec"]["replicas"] == 4 and (group["minReplicas"], group["maxReplicas"]) == (4, 8)
    assert decode["spec"]["template"]["spec"]["nodeSelector"]["raincheck.io/pool"] == "decode"
    assert group["template"]["spec"]["nodeSelector"]["raincheck.io/pool"] == "prefill"


@pytest.mark.parametrize("name", ["gpu", "pd-disaggregated", "managed-redis"])
def test_the_deferred_worker_pool_is_autoscaled_within_the_raycluster(rendered: dict, name: str) -> None:
    """Each decode worker keeps its floor of deferred workers and grows to its ceiling while residuals wait;
    every actor is one Ray worker pod (one `raincheck_deferred` each), so the RayCluster's bounds hold the
    floors and the ceilings of all decode workers; each actor keeps resident contexts on its GPU."""
    docs = rendered[name]
    cfg = config(docs)
    floor, ceiling = int(cfg["RAINCHECK_DEFERRED_WORKERS"]), int(cfg["RAINCHECK_DEFERRED_MAX_WORKERS"])
    decode = one(docs, "StatefulSet", "raincheck-decode")["spec"]["replicas"]
    (group,) = one(docs, "RayCluster", "raincheck-ray")["spec"]["workerGroupSpecs"]
    assert 1 <= floor < ceiling
    assert group["minReplicas"] <= decode * floor and decode * ceiling <= group["maxReplicas"]
    assert one(docs, "RayCluster", "raincheck-ray")["spec"]["enableInTreeAutoscaling"] is True
    assert float(cfg["RAINCHECK_DEFERRED_RESIDENT_MIB"]) >= 4096


def test_managed_redis_replaces_the_statefulset(rendered: dict) -> None:
    docs = rendered["managed-redis"]
    assert not find(docs, "StatefulSet", "raincheck-redis") and not find(docs, "NetworkPolicy", "raincheck-redis")
    service = one(docs, "Service", "raincheck-redis")["spec"]
    assert service["type"] == "ExternalName" and "selector" not in service
    for kind, workload in (("Deployment", "raincheck-frontend"), ("StatefulSet", "raincheck-decode")):
        ref = env(container(docs, kind, workload))["REDIS_URL"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "raincheck-redis", "key": "url"}
    redis = one(rendered["gpu"], "StatefulSet", "raincheck-redis")
    conf = one(rendered["gpu"], "ConfigMap", "raincheck-redis-config")["data"]["redis.conf"]
    assert "appendonly yes" in conf and redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


# ------------------------------------------------------------------------------------------ the CLI
# What the manifests assume of `raincheck` (services/cli.py): per command, the variables it must read
# (each listed in its `--help`, as services/common/settings.py does for every flag).
CLI_CONTRACT = {
    "frontend": {"REDIS_URL", "RAINCHECK_STORE_PREFIX", "RAINCHECK_API_KEYS_FILE", "RAINCHECK_METRICS_HOST",
                 "RAINCHECK_RECOVERY_MODE", "RAINCHECK_DRAIN_TIMEOUT_S"},
    "decode-worker": {"REDIS_URL", "RAINCHECK_STORE_PREFIX", "RAINCHECK_MODEL", "RAINCHECK_MODEL_NAME",
                      "RAINCHECK_DEVICE", "RAINCHECK_DTYPE", "RAINCHECK_POLICY", "RAINCHECK_RECOVERY_MODES",
                      "RAINCHECK_RAY_NAMESPACE", "RAINCHECK_DEFERRED_NUM_GPUS", "RAINCHECK_DRAIN_TIMEOUT_S",
                      "RAINCHECK_METRICS_HOST", "RAINCHECK_WORKER_ID", "RAINCHECK_ADVERTISE",
                      "RAINCHECK_DEFERRED_WORKERS", "RAINCHECK_DEFERRED_MAX_WORKERS",
                      "RAINCHECK_DEFERRED_SCALE_UP_WAIT_S", "RAINCHECK_DEFERRED_IDLE_S",
                      "RAINCHECK_DEFERRED_RESIDENT_MIB"},
}


# Assumed by the manifests but not in the CLI yet. Until a variable is implemented the service ignores
# it (and keeps its default); remove it from here when it is, and the test below keeps it honest.
PENDING_IN_CLI: dict[str, set[str]] = {}


def test_the_cli_contract_covers_the_config(rendered: dict) -> None:
    for name in OVERLAYS:
        docs = rendered[name]
        names = set(config(docs)) | {n for kind, w in (("Deployment", "raincheck-frontend"),
                                                       ("StatefulSet", "raincheck-decode"))
                                     for n in env(container(docs, kind, w))}
        ours = {n for n in names if n.startswith("RAINCHECK_") or n == "REDIS_URL"}
        assert ours == set().union(*CLI_CONTRACT.values()), name


def _cli_help(command: str) -> str | None:
    """`raincheck <command> --help`, or None while services/cli.py has no such command."""
    from services import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        cli.main([command, "--help"])
    return out.getvalue() if stop.value.code == 0 else None


@pytest.mark.parametrize("command", ["frontend", "decode-worker"])
def test_the_cli_accepts_what_the_manifests_pass(rendered: dict, command: str) -> None:
    """Every flag in the manifests' args, and every variable of the contract, is in the command's help
    (except the ones still pending)."""
    text = _cli_help(command)
    if text is None:
        pytest.skip(f"services/cli.py has no `{command}` command yet")
    docs = rendered["gpu"]
    args = next(c["args"] for c in (container(docs, "Deployment", "raincheck-frontend"),
                                    container(docs, "StatefulSet", "raincheck-decode")) if c["args"][0] == command)
    missing = [a for a in args[1:] if a.startswith("--") and a not in text]
    missing += sorted(n for n in CLI_CONTRACT[command] if n not in text)
    assert missing == sorted(PENDING_IN_CLI.get(command, ()))
