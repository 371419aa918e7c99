"""Keys only where they are needed, in real containers run as docker-compose.yml runs them
(issue 24): the coordinator keeps the CA key and its own key in a volume of its own, a
worker mounts only the CA certificate and the token, every container drops all
capabilities but what its root step needs, cannot gain privileges and has a read-only
root, and the worker's user cannot plant a link where the root step writes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from dockerlab import Lab, wait_for
from test_cluster import IDENTITY, NO_HEALTHCHECK, _health, _identity

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
CONFIG = """
workers = 1
rounds = 50
[task]
model = "gpt-tiny"
seq_len = 32
batch_size = 8
corpus_bytes = 300000
[inner]
steps = 5
[network]
wan = "40mbit/10ms"
[coordinator]
join_timeout_s = 300.0
"""


def hardened(service: str) -> dict:
    """The docker SDK's arguments for what docker-compose.yml gives ``service``."""
    from docker.types import Mount

    svc = COMPOSE["services"][service]
    anonymous = [v for v in svc["volumes"] if ":" not in v]  # the kernel cache, filled from the image
    return {"cap_drop": svc["cap_drop"], "cap_add": svc["cap_add"], "security_opt": svc["security_opt"],
            "read_only": svc["read_only"], "pids_limit": svc["pids_limit"],
            "tmpfs": {t.split(":")[0]: (t.split(":", 1)[1] if ":" in t else "") for t in svc["tmpfs"]},
            "mounts": [Mount(target=v, source=None, type="volume") for v in anonymous]}


@dataclass
class Cluster:
    lab: Lab
    coordinator: object
    worker: object


@pytest.fixture(scope="module")
def cluster(module_lab: Lab, tmp_path_factory) -> Iterator[Cluster]:
    lab = module_lab
    config = tmp_path_factory.mktemp("privileges") / "config.toml"
    config.write_text(CONFIG)
    config.chmod(0o644)
    volumes = [lab.client.volumes.create(f"{lab.prefix}-{name}", labels=lab.labels)
               for name in ("certs", "worker-certs", "runs")]
    certs, worker_certs, runs = (v.name for v in volumes)
    try:
        net = lab.network("region")
        coordinator = lab.run(
            "coordinator", net, command=["coordinator"],
            volumes={certs: {"bind": "/certs", "mode": "rw"}, worker_certs: {"bind": "/worker-certs", "mode": "rw"},
                     runs: {"bind": "/runs", "mode": "rw"},
                     str(config): {"bind": "/etc/geoloco/config.toml", "mode": "ro"}},
            environment={"GEOLOCO_CERTS": "/certs", "GEOLOCO_WORKER_CERTS": "/worker-certs",
                         "GEOLOCO_RUN_DIR": "/runs/run"},
            **hardened("coordinator"))
        wait_for(lambda: _listening(coordinator), 300, "the coordinator to listen")
        worker = lab.run("worker-0", net, command=["worker"], healthcheck=NO_HEALTHCHECK,
                         volumes={worker_certs: {"bind": "/certs", "mode": "ro"}},
                         environment={"GEOLOCO_COORDINATOR": "coordinator:50051", "GEOLOCO_CERTS": "/certs"},
                         **hardened("worker"))
        wait_for(lambda: _identity(lab, worker), 180, "the worker to join and shape under the hardened options")
        yield Cluster(lab, coordinator, worker)
    finally:
        lab.cleanup()
        for v in volumes:
            v.remove(force=True)


def test_a_worker_container_cannot_read_the_ca_key_or_the_coordinators_key(cluster: Cluster) -> None:
    lab, worker = cluster.lab, cluster.worker
    listing, _ = lab.exec(worker, ["ls", "-A", "/certs"])
    assert sorted(listing.split()) == ["ca.pem", "token"]
    for key in ("ca.key", "coordinator.key", "worker-0.key"):
        for user in ("geoloco", "root"):
            _, err = lab.exec(worker, ["cat", f"/certs/{key}"], user=user, check=False)
            assert "No such file" in err, (key, user)
    keys, _ = lab.exec(cluster.coordinator, ["ls", "-A", "/certs"])
    assert "ca.key" in keys.split()  # the coordinator's container holds it, no other


def test_the_worker_user_cannot_plant_a_link_where_the_root_step_writes(cluster: Cluster) -> None:
    lab, worker = cluster.lab, cluster.worker
    owner, _ = lab.exec(worker, ["stat", "-c", "%u %a", "/run/geoloco", IDENTITY])
    folder, identity = owner.splitlines()
    assert folder == "0 755" and identity.split()[1] == "600"
    _, err = lab.exec(worker, ["ln", "-s", "/etc/shadow", "/run/geoloco/.identity.json.tmp"],
                      user="geoloco", check=False)
    assert "Permission denied" in err


def test_containers_have_no_spare_capabilities_and_a_read_only_root(cluster: Cluster) -> None:
    lab = cluster.lab
    for container, role in ((cluster.coordinator, "coordinator"), (cluster.worker, "worker")):
        # PID 1 becomes the geoloco process itself (the entrypoint execs it after the root step)
        wait_for(lambda c=container, r=role: f"geoloco {r}" in lab.exec(
            c, ["sh", "-c", "tr '\\0' ' ' < /proc/1/cmdline"])[0], 180, f"the {role} process to start")
        status, _ = lab.exec(container, ["sh", "-c", "grep -E '^(CapEff|NoNewPrivs)' /proc/1/status"])
        assert "CapEff:\t0000000000000000" in status and "NoNewPrivs:\t1" in status, status
        _, err = lab.exec(container, ["touch", "/opt/geoloco/x"], check=False)
        assert "Read-only file system" in err, err


def _listening(container) -> bool:
    _health(container)  # fails at once if it exited
    return "coordinator listening on" in container.logs().decode(errors="replace")
