"""deploy/kubernetes gives each pod no more than it needs (issue 24), read through the
`kubernetes` client's models: no service-account token, every container without
capabilities, privilege escalation or a writable root, memory limits, a NetworkPolicy for
every pod, source ranges on the public endpoint, and no CA key in any Secret."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kubernetes import client
from test_kubernetes_manifests import KUBE, OVERLAYS, build

API = client.ApiClient()


def model(obj: dict[str, Any]) -> Any:
    return API._ApiClient__deserialize(copy.deepcopy(obj), f"V1{obj['kind']}")


@pytest.fixture(params=OVERLAYS)
def objects(request) -> list[Any]:
    return [model(o) for o in build(KUBE / "overlays" / request.param)]


def pods(objects: list[Any]) -> list[Any]:
    return [o for o in objects if isinstance(o, client.V1Deployment | client.V1StatefulSet)]


def test_no_pod_mounts_a_service_account_token(objects) -> None:
    assert pods(objects)
    for o in pods(objects):
        assert o.spec.template.spec.automount_service_account_token is False, o.metadata.name


def test_every_container_drops_every_capability_and_cannot_gain_any(objects) -> None:
    for o in pods(objects):
        spec = o.spec.template.spec
        assert spec.security_context.run_as_non_root and spec.security_context.seccomp_profile.type == "RuntimeDefault"
        for c in spec.containers + (spec.init_containers or []):
            sc = c.security_context
            assert sc is not None, c.name
            assert sc.capabilities.drop == ["ALL"] and not sc.capabilities.add, c.name
            assert sc.allow_privilege_escalation is False and sc.read_only_root_filesystem is True, c.name
            assert not sc.privileged, c.name


def test_every_long_running_container_has_a_memory_limit(objects) -> None:
    for o in pods(objects):
        for c in o.spec.template.spec.containers:
            assert c.resources.limits and "memory" in c.resources.limits, c.name


def test_a_network_policy_selects_every_pod_both_ways(objects) -> None:
    policies = [o for o in objects if isinstance(o, client.V1NetworkPolicy)]
    for o in pods(objects):
        labels = o.spec.template.metadata.labels
        chosen = [p for p in policies if p.spec.pod_selector.match_labels.items() <= labels.items()]
        assert chosen, o.metadata.name
        assert {"Ingress", "Egress"} <= {t for p in chosen for t in p.spec.policy_types}


def test_the_public_endpoint_takes_only_the_given_source_ranges(objects) -> None:
    for svc in (o for o in objects if isinstance(o, client.V1Service)):
        if svc.spec.type == "LoadBalancer":
            assert svc.spec.load_balancer_source_ranges, svc.metadata.name


def test_no_secret_holds_a_ca_key_and_workers_hold_no_coordinator_key(objects) -> None:
    for secret in (o for o in objects if isinstance(o, client.V1Secret)):
        assert not any(k.endswith(("ca.key", "ca-key.pem")) for k in secret.data), secret.metadata.name
        if "worker" in secret.metadata.name:
            assert "tls.key" not in secret.data and "coordinator.key" not in secret.data
