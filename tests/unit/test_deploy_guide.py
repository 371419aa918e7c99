"""docs/deploy.md as a user pastes it: its ```bash blocks run in order in one shell on a
copy of the checkout, with the real `geoloco` and `openssl` and logging stand-ins for the
commands that need a cloud (kubectl, docker, aws, gcloud, and nothing else). Then what
they leave is checked: the overlays `kubectl apply -k` gets resolve and round-trip through
the `kubernetes` client's models, every Secret file exists with mode 0600 in a git-ignored
0700 folder, no CA key is in the checkout, the pushed images are the ones the manifests
name, the run config validates against the task layer, and the certificates made pass a
real mutual-TLS gRPC health check. Every `geoloco` command line in docs/deploy.md and
docs/docker.md parses with the CLI."""

from __future__ import annotations

import inspect
import json
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import tomllib
import yaml
from grpc_health.v1 import health, health_pb2_grpc
from test_kubernetes_hardening import model
from test_kubernetes_manifests import ROOT, build, by_kind

from geoloco import healthcheck
from geoloco.cli import build_parser
from geoloco.config import RunConfig, TlsConfig, validate
from geoloco.tls import server_credentials
from geoloco.worker.admission import Admission

GUIDE = ROOT / "docs" / "deploy.md"
STAND_INS = ("kubectl", "docker", "aws", "gcloud")  # need a cloud: logged, not run
STUB = """#!/bin/sh
exec "{python}" -c 'import json, os, sys; print(json.dumps([os.getcwd(), *sys.argv[1:]]))' "$(basename "$0")" "$@" >> "{log}"
"""


def blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), flags=re.S | re.M)


@pytest.fixture(scope="module")
def pasted(tmp_path_factory) -> tuple[Path, Path, list[list[str]]]:
    """The checkout copy, the fake home, and each stand-in call as [cwd, program, args...].
    It runs bash, the real `geoloco certs` and openssl (about 7 s): its tests are marked slow."""
    tmp = tmp_path_factory.mktemp("guide")
    tree, home, stubs, log = tmp / "checkout", tmp / "home", tmp / "stubs", tmp / "calls.jsonl"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    home.mkdir()
    stubs.mkdir()
    for prog in STAND_INS:
        (stubs / prog).write_text(STUB.format(python=sys.executable, log=log))
        (stubs / prog).chmod(0o755)
    script = "set -euo pipefail\n" + "\n".join(blocks(GUIDE, "bash"))
    env = {"HOME": str(home), "PATH": f"{stubs}:{Path(sys.executable).parent}:/usr/bin:/bin", "LANG": "C.UTF-8"}
    out = subprocess.run(["bash", "-c", script], cwd=tree, env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return tree, home, calls


@pytest.mark.slow
def test_only_the_cloud_commands_are_stood_in_for(pasted) -> None:
    _, _, calls = pasted
    assert {c[1] for c in calls} == set(STAND_INS)  # anything else ran for real (or failed)
    assert all(Path(c[0]) == pasted[0] for c in calls), "a command ran outside the checkout root"


def applied(pasted) -> list[Path]:
    tree, _, calls = pasted
    dirs = [Path(c[0]) / c[c.index("-k") + 1] for c in calls if c[1] == "kubectl" and "apply" in c]
    assert {d.name for d in dirs} == {"region-a", "region-b"}
    return dirs


@pytest.mark.slow
def test_the_applied_overlays_build_and_round_trip_through_the_models(pasted) -> None:
    for overlay in applied(pasted):
        objects = build(overlay)
        for obj in objects:
            model(obj)  # raises on a field the API does not have
        assert by_kind(objects, "StatefulSet")


def secret_files(overlay: Path) -> list[Path]:
    found = []
    for folder in {overlay, *(overlay / r for r in yaml.safe_load((overlay / "kustomization.yaml").read_text())
                              .get("resources", []))}:
        k = yaml.safe_load((folder / "kustomization.yaml").read_text())
        found += [(folder / f).resolve() for g in k.get("secretGenerator", []) for f in g["files"]]
    return found


@pytest.mark.slow
def test_secrets_exist_private_and_git_ignored_and_no_ca_key_in_the_checkout(pasted) -> None:
    tree, home, _ = pasted
    ca_key = (home / "geoloco-ca" / "ca.key").read_bytes()
    assert (home / "geoloco-ca").stat().st_mode & 0o777 == 0o700
    assert (home / "geoloco-ca" / "ca.key").stat().st_mode & 0o777 == 0o600
    for overlay in applied(pasted):
        for f in secret_files(overlay):
            assert f.stat().st_mode & 0o777 == 0o600 and f.parent.stat().st_mode & 0o777 == 0o700, f
            assert f.stat().st_size > 0
            rel = f.relative_to(tree.resolve())
            ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", str(rel)], cwd=ROOT, check=False)
            assert ignored.returncode == 0, f"{rel} is not git-ignored"
    for f in tree.rglob("*"):
        assert not (f.is_file() and f.read_bytes() == ca_key), f"the CA key is in the checkout: {f}"


@pytest.mark.slow
def test_the_pushed_images_are_the_ones_the_pods_run(pasted) -> None:
    _, _, calls = pasted
    pushed = {c[3] for c in calls if c[1:3] == ["docker", "push"]}
    built = {c[c.index("-t") + 1]: Path(c[0]) / c[-1] for c in calls if c[1:3] == ["docker", "build"]}
    assert pushed <= built.keys()
    for ref, context in built.items():
        call = next(c for c in calls if c[1:3] == ["docker", "build"] and ref in c)
        dockerfile = Path(call[0]) / call[call.index("-f") + 1] if "-f" in call else context / "Dockerfile"
        for src in re.findall(r"^COPY (?!--from)(?:--\S+ )*(\S+) ", dockerfile.read_text(), flags=re.M):
            if "[" not in src:  # the Dockerfile's optional wheelhouse glob
                assert (context / src).exists(), (ref, src)
        for arg in call:
            if arg.startswith("BASE="):
                assert arg[5:] in built, f"{ref} is built on {arg[5:]}, which no step builds"
    for overlay in applied(pasted):
        for o in build(overlay):
            spec = o.get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                assert c["image"] in pushed, c["image"]


@pytest.mark.slow
def test_the_run_config_validates_against_the_task_layer_the_workers_allow(pasted) -> None:
    tree, home, _ = pasted
    task = home / "geoloco-task"
    layer = {src: dst for src, dst in re.findall(r"^COPY (\S+) (\S+)", (task / "Dockerfile").read_text(), flags=re.M)}
    mapped = lambda text: text.replace("/opt/task", str(task)) if layer else text  # noqa: E731
    assert layer == {"model": "/opt/task/model", "data": "/opt/task/data"}
    run = tomllib.loads(mapped((tree / "deploy/kubernetes/coordinator/config.toml").read_text()))
    cfg = validate(RunConfig.from_dict(run))
    worker = tomllib.loads(mapped((tree / "deploy/kubernetes/base/config.toml").read_text()))["worker"]
    Admission(worker.get("allow_config_code", False), tuple(worker["allowed_paths"])).check(cfg)


@pytest.mark.slow
def test_the_certificates_pass_a_mutual_tls_health_check(pasted) -> None:
    """The coordinator's files serve mutual TLS; a worker's files and the readiness probe's
    flags get SERVING for both names the workers dial; no client certificate, no answer."""
    tree, _, _ = pasted
    coord, workers = tree / "deploy/kubernetes/coordinator/credentials", tree / "deploy/kubernetes/base/credentials"
    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    creds = server_credentials(TlsConfig(ca=str(coord / "ca.crt"), cert=str(coord / "tls.crt"),
                                         key=str(coord / "tls.key")), "127.0.0.1:0")
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        for name in ("coordinator.geoloco.example.org", "geoloco-coordinator.geoloco.svc.cluster.local"):
            assert healthcheck.main([address, "--tls-ca", str(workers / "ca.crt"), "--tls-server-name", name,
                                     "--tls-cert", str(workers / "client.crt"),
                                     "--tls-key", str(workers / "client.key")]) == healthcheck.EXIT_HEALTHY
        (deployment,) = [o for o in build(applied(pasted)[0]) if o["kind"] == "Deployment"]
        probe = deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
        args = [a.replace("/etc/geoloco/tls", str(coord)) for a in probe[3:]]
        assert healthcheck.main([address, *args[1:]]) == healthcheck.EXIT_HEALTHY
        assert healthcheck.main([address, "--tls-ca", str(workers / "ca.crt"), "--tls-server-name",
                                 "coordinator.geoloco.example.org"]) == healthcheck.EXIT_UNHEALTHY
    finally:
        server.stop(None)


def command_lines(path: Path) -> list[list[str]]:
    """Each shell command of a doc's bash/sh blocks, continuation lines joined, split at
    pipes and `;`/`&&`."""
    lines = []
    for block in blocks(path, "bash") + blocks(path, "sh"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"\|\s|&&|;", line):
                words = shlex.split(part, comments=True)
                if words:
                    lines.append(words)
    return lines


@pytest.mark.parametrize("doc", ["deploy.md", "docker.md"])
def test_every_geoloco_command_line_in_the_guides_parses(doc) -> None:
    parser, checked = build_parser(), 0
    subcommands = {"local", "coordinator", "worker", "certs", "export", "warmup", "report", "config"}
    for words in command_lines(ROOT / "docs" / doc):
        words = [w.replace("$(nproc)", "8") for w in words]
        for i, w in enumerate(words):
            if w == "geoloco" and i + 1 < len(words) and words[i + 1] in subcommands:
                parser.parse_args(words[i + 1:])  # exits on a flag the CLI does not have
                checked += 1
            if w == "geoloco.healthcheck":
                flags = set(re.findall(r'add_argument\("(--[\w-]+)"', inspect.getsource(healthcheck)))
                assert {a for a in words[i + 1:] if a.startswith("--")} <= flags, words
                checked += 1
    assert checked, f"no geoloco command line in {doc}"
