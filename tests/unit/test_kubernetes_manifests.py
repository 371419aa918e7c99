"""deploy/kubernetes without a cluster: each region overlay is resolved by a small loader
(resources, configMap and secret generators, images, namespace, JSON patches; `kubectl
kustomize` must agree where
kubectl exists), every object round-trips through the `kubernetes` client's models, and the
cross-references hold: selectors match labels, referenced Secrets, keys, ConfigMaps and PVCs
exist, ports agree with the run config, images and commands are the project's own."""

from __future__ import annotations

import copy
import math
import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml
from kubernetes import client

from geoloco import __version__
from geoloco.cli import build_parser
from geoloco.config import RunConfig, validate
from geoloco.transport import parse_address

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("region-a", "region-b")
REQUIRE_KUBECTL_ENV = "GEOLOCO_REQUIRE_KUBECTL"  # .ci/run: a missing kubectl fails, not skips
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "configMapGenerator", "secretGenerator",
                      "generatorOptions", "images", "namespace", "patches"}
IMAGE_REPOSITORY = "ghcr.io/geoloco/geoloco"  # the manifests' name; each overlay's `images` renames it


def build(path: Path) -> list[dict[str, Any]]:
    """The objects a kustomization makes (the subset of kustomize these manifests use)."""
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    assert set(k) <= KUSTOMIZATION_KEYS, f"{path}: the loader does not know {set(k) - KUSTOMIZATION_KEYS}"
    objects: list[dict[str, Any]] = []
    for resource in k.get("resources", []):
        target = path / resource
        objects += build(target) if target.is_dir() else [d for d in yaml.safe_load_all(target.read_text()) if d]
    assert k.get("generatorOptions", {}).get("disableNameSuffixHash", False) or not (
        k.get("secretGenerator") or k.get("configMapGenerator"))
    for gen in k.get("configMapGenerator", []):
        assert set(gen) <= {"name", "files", "options"} and set(gen.get("options", {})) <= {"labels"}, gen
        data = {Path(f).name: (path / f).read_text() for f in gen["files"]}
        metadata = {"name": gen["name"], **({"labels": gen["options"]["labels"]} if "options" in gen else {})}
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    for gen in k.get("secretGenerator", []):
        keys = {Path(f).name: "" for f in gen["files"]}
        objects.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]},
                        "type": "Opaque", "data": keys})
    for image in k.get("images", []):
        rename_image(objects, image)
    for patch in k.get("patches", []):
        matches = [o for o in objects if o["kind"] == patch["target"]["kind"]
                   and o["metadata"]["name"] == patch["target"]["name"]]
        assert len(matches) == 1, patch["target"]
        for op in yaml.safe_load(patch["patch"]):
            json_patch(matches[0], op)
    if "namespace" in k:
        for o in objects:
            o["metadata"]["namespace"] = k["namespace"]
    return objects


def rename_image(objects: list[dict[str, Any]], image: dict[str, str]) -> None:
    """kustomize's `images` entry: containers whose image is `name[:tag]` get `newName`
    (and `newTag` when given)."""
    assert set(image) <= {"name", "newName", "newTag"}, image
    for o in objects:
        spec = o.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            name, _, tag = c["image"].rpartition(":") if ":" in c["image"].rsplit("/", 1)[-1] else (c["image"], "", "")
            if name == image["name"]:
                tag = image.get("newTag", tag)
                c["image"] = image.get("newName", name) + (f":{tag}" if tag else "")


def json_patch(obj: dict[str, Any], op: dict[str, Any]) -> None:
    """RFC 6902 replace and add on a JSON pointer (RFC 6901: ~1 is /, ~0 is ~)."""
    assert op["op"] in ("replace", "add"), op
    *parents, leaf = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(leaf)] = op["value"]
    else:
        assert op["op"] == "add" or leaf in node, f"replace of a missing {op['path']}"
        node[leaf] = op["value"]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict[str, Any]]]:
    return request.param, build(KUBE / "overlays" / request.param)


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"no {kind} {name!r}"
    return found[0]


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(o, o["spec"]["template"]) for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def test_every_object_round_trips_through_the_kubernetes_models(overlay) -> None:
    api = client.ApiClient()
    for obj in overlay[1]:
        model = api._ApiClient__deserialize(copy.deepcopy(obj), f"V1{obj['kind']}")
        again = api.sanitize_for_serialization(model)
        assert again == obj, f"{obj['kind']} {obj['metadata']['name']}: a field the API does not have"


def test_selectors_match_the_labels_they_select(overlay) -> None:
    objects = overlay[1]
    for owner, template in pod_specs(objects):
        selector = owner["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), owner["metadata"]["name"]
    templates = [t["metadata"]["labels"] for _, t in pod_specs(objects)]
    for svc in by_kind(objects, "Service"):
        assert any(svc["spec"]["selector"].items() <= labels.items() for labels in templates), \
            f"Service {svc['metadata']['name']} selects no pod"
    for sts in by_kind(objects, "StatefulSet"):
        assert named(objects, "Service", sts["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


def test_referenced_secrets_configmaps_and_claims_exist(overlay) -> None:
    objects = overlay[1]
    for owner, template in pod_specs(objects):
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        claims = {c["metadata"]["name"]: c for c in owner.get("spec", {}).get("volumeClaimTemplates", [])}
        assert not volumes.keys() & claims.keys(), owner["metadata"]["name"]
        volumes |= {name: {"volumeClaimTemplate": c} for name, c in claims.items()}
        for v in volumes.values():
            if "secret" in v:
                named(objects, "Secret", v["secret"]["secretName"])
            if "configMap" in v:
                named(objects, "ConfigMap", v["configMap"]["name"])
            if "persistentVolumeClaim" in v:
                named(objects, "PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
        for c in spec["containers"]:
            for mount in c["volumeMounts"]:
                volume = volumes[mount["name"]]
                if "subPath" in mount and "configMap" in volume:
                    assert mount["subPath"] in named(objects, "ConfigMap", volume["configMap"]["name"])["data"]
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in named(objects, "Secret", ref["name"])["data"], ref


def container(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = by_kind(objects, kind)
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def cpus(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def env_value(c: dict[str, Any], env: dict[str, Any]) -> str:
    """What the kubelet gives an env var: its value, a Secret's stand-in, or the container's
    own CPU request in whole CPUs (a resourceFieldRef, rounded up as the kubelet does)."""
    if "value" in env:
        return env["value"]
    ref = env["valueFrom"].get("resourceFieldRef")
    if ref is None:
        return "secret-value"
    assert ref["containerName"] == c["name"] and ref["resource"] == "requests.cpu", ref
    return str(math.ceil(cpus(c["resources"]["requests"]["cpu"]) / cpus(ref.get("divisor", "1"))))


def mounted_config(objects: list[dict[str, Any]], kind: str) -> tuple[list[str], RunConfig]:
    """The container's CLI arguments ($(VAR) filled in from its env) and the run config of
    its --config file, read from the ConfigMap mounted there."""
    (obj,) = by_kind(objects, kind)
    spec = obj["spec"]["template"]["spec"]
    c = container(objects, kind)
    env = {e["name"]: env_value(c, e) for e in c.get("env", [])}
    args = [next((a.replace(f"$({k})", v) for k, v in env.items() if f"$({k})" in a), a) for a in c["args"]]
    path = args[args.index("--config") + 1]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == path)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    text = named(objects, "ConfigMap", volume["configMap"]["name"])["data"][mount["subPath"]]
    return args, validate(RunConfig.from_dict(tomllib.loads(text)))


def test_images_and_commands_are_the_projects_own(overlay) -> None:
    name, objects = overlay
    renamed = yaml.safe_load((KUBE / "overlays" / name / "kustomization.yaml").read_text()).get("images", [])
    expected = next((i["newName"] for i in renamed if i["name"] == IMAGE_REPOSITORY), IMAGE_REPOSITORY)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for kind, role in (("Deployment", "coordinator"), ("StatefulSet", "worker")):
        if not by_kind(objects, kind):
            continue
        c = container(objects, kind)
        repository, tag = c["image"].rsplit(":", 1)
        assert repository == expected and tag.startswith(__version__), c["image"]
        assert c["command"] == ["geoloco"] and "geoloco" in scripts
        args, _ = mounted_config(objects, kind)
        parsed = build_parser().parse_args(args)  # exits on a flag the CLI does not have
        assert parsed.command == role
        probe = c.get("readinessProbe", {}).get("exec", {}).get("command")
        if probe:
            assert probe[:3] == ["python", "-m", "geoloco.healthcheck"]


def test_ports_agree_with_the_run_config(overlay) -> None:
    name, objects = overlay
    worker = container(objects, "StatefulSet")
    _, worker_cfg = mounted_config(objects, "StatefulSet")
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports == {"metrics": worker_cfg.monitoring.worker_metrics_port}
    svc = named(objects, "Service", "geoloco-worker")
    assert svc["spec"]["ports"][0]["port"] == ports["metrics"]
    assert svc["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    env = {e["name"]: e.get("value") for e in worker["env"]}
    host, port = parse_address(env["GEOLOCO_COORDINATOR"])
    assert port == 50051 and "COORDINATOR" not in host
    if name == "region-a":  # the coordinator lives here
        c = container(objects, "Deployment")
        _, cfg = mounted_config(objects, "Deployment")
        cports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert cports == {"grpc": parse_address(cfg.coordinator.listen)[1], "metrics": cfg.monitoring.metrics_port}
        public = named(objects, "Service", "geoloco-coordinator")
        assert public["spec"]["type"] == "LoadBalancer"
        assert [p["port"] for p in public["spec"]["ports"]] == [cports["grpc"]] == [port]
        assert host.startswith(f"{public['metadata']['name']}.{public['metadata']['namespace']}.svc")
        metrics = named(objects, "Service", "geoloco-coordinator-metrics")
        assert metrics["spec"]["type"] == "ClusterIP"  # plaintext /metrics stays in the cluster
        assert metrics["metadata"]["annotations"]["prometheus.io/port"] == str(cfg.monitoring.metrics_port)
        assert c["args"][c["args"].index("--run-dir") + 1].startswith(
            next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "checkpoints"))


def test_each_region_is_its_own_gpu_worker_group_and_they_add_up_to_the_run() -> None:
    built = {name: build(KUBE / "overlays" / name) for name in OVERLAYS}
    regions, replicas = set(), 0
    for objects in built.values():
        (sts,) = by_kind(objects, "StatefulSet")
        spec = sts["spec"]["template"]["spec"]
        regions.add(spec["nodeSelector"]["topology.kubernetes.io/region"])
        replicas += sts["spec"]["replicas"]
        resources = spec["containers"][0]["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "1"
    assert len(regions) == len(OVERLAYS) and "REGION" not in regions
    _, cfg = mounted_config(built["region-a"], "Deployment")
    assert cfg.workers == replicas


def test_kubectl_kustomize_builds_the_same_objects(tmp_path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        # Debian bookworm's kubernetes-client (kubectl 1.20, kustomize 2.0.3) predates the
        # inline `patches` these manifests use, and PyPI has no kubectl; the CI machines'
        # image ships one (kubectl 1.32, kustomize 5.5), so .ci/run makes it required
        if os.environ.get(REQUIRE_KUBECTL_ENV) == "1":
            pytest.fail(f"{REQUIRE_KUBECTL_ENV}=1 but kubectl is not installed")
        pytest.skip(f"kubectl is not installed (its kustomize is the reference; the loader above runs "
                    f"anyway; {REQUIRE_KUBECTL_ENV}=1 fails instead)")
    tree = tmp_path / "kubernetes"
    shutil.copytree(KUBE, tree)
    for folder in ("base", "coordinator"):
        for secret in yaml.safe_load((tree / folder / "kustomization.yaml").read_text())["secretGenerator"]:
            for f in secret["files"]:
                (tree / folder / f).write_text("x\n")
    for name in OVERLAYS:
        out = subprocess.run([kubectl, "kustomize", str(tree / "overlays" / name)], capture_output=True,
                             text=True, check=False)
        assert out.returncode == 0, out.stderr
        theirs = [d for d in yaml.safe_load_all(out.stdout) if d]
        for d in theirs:
            if d["kind"] == "Secret":
                d["data"] = {k: "" for k in d["data"]}
        key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
        assert sorted(theirs, key=key) == sorted(build(KUBE / "overlays" / name), key=key), shlex.join(
            [kubectl, "kustomize", name])


def secret_file(objects: list[dict[str, Any]], kind: str, path: str) -> tuple[str, int]:
    """The Secret key a file path of the container reads, and the volume's file mode."""
    (obj,) = by_kind(objects, kind)
    spec = obj["spec"]["template"]["spec"]
    mount = next(m for m in container(objects, kind)["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert "secret" in volume, f"{path} is not read from a Secret"
    key = path[len(mount["mountPath"]) + 1:]
    assert key in named(objects, "Secret", volume["secret"]["secretName"])["data"], path
    return key, volume["secret"]["defaultMode"]


def test_connections_are_tls_and_the_token_is_a_mounted_file(overlay) -> None:
    """No plaintext, no token on a command line or in the environment; the Secret's files
    are readable by the pod's own group and nobody else."""
    objects = overlay[1]
    wants = {"Deployment": ("--token-file", "--tls-cert", "--tls-key", "--tls-ca"),  # --tls-ca: mutual TLS
             "StatefulSet": ("--token-file", "--tls-ca", "--tls-cert", "--tls-key")}
    for kind, flags in wants.items():
        if not by_kind(objects, kind):
            continue
        c = container(objects, kind)
        args, _ = mounted_config(objects, kind)
        assert "--insecure" not in args and "--token" not in args
        assert not any("TOKEN" in e["name"] for e in c.get("env", [])), c["env"]
        for flag in flags:
            _, mode = secret_file(objects, kind, args[args.index(flag) + 1])
            assert mode & 0o007 == 0, oct(mode)
        context = by_kind(objects, kind)[0]["spec"]["template"]["spec"]["securityContext"]
        assert context["fsGroup"] == context["runAsGroup"] and context["runAsNonRoot"]
        probe = c.get("readinessProbe", {}).get("exec", {}).get("command")
        if probe:  # under mutual TLS the probe presents a certificate too
            for flag in ("--tls-ca", "--tls-cert", "--tls-key"):
                secret_file(objects, kind, probe[probe.index(flag) + 1])


def test_a_worker_uses_the_cpus_it_requests_and_keeps_its_state_on_its_own_volume(overlay) -> None:
    """--threads is the pod's CPU request (not the CLI's default of 1), and --state-dir is a
    per-pod volume claim, so a replaced pod gets its id and local state back."""
    objects = overlay[1]
    (sts,) = by_kind(objects, "StatefulSet")
    worker = container(objects, "StatefulSet")
    args, _ = mounted_config(objects, "StatefulSet")
    parsed = build_parser().parse_args(args)
    assert parsed.threads == math.ceil(cpus(worker["resources"]["requests"]["cpu"])) > 1
    mount = next(m for m in worker["volumeMounts"] if m["mountPath"] == parsed.state_dir)
    (claim,) = [c for c in sts["spec"]["volumeClaimTemplates"] if c["metadata"]["name"] == mount["name"]]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and not mount.get("readOnly")
