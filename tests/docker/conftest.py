"""Fixtures for the real-container tests: a Docker engine (skip with a clear reason when
none answers, fail instead when GEOLOCO_REQUIRE_DOCKER=1), the images built once per
session by the same script as `make images`, and a Lab per test (see dockerlab.py).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from dockerlab import Lab

REQUIRE_DOCKER_ENV = "GEOLOCO_REQUIRE_DOCKER"
IMAGE_ENV = "GEOLOCO_TEST_IMAGE"
SKIP_BUILD_ENV = "GEOLOCO_TEST_SKIP_BUILD"  # reuse an image built by `make images`
ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "docker" / "build_images.sh"
BUILD_TIMEOUT_S = 1800


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.docker)


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_DOCKER_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_DOCKER_ENV}=1 makes the Docker tests required)", pytrace=False)
    pytest.skip(f"{reason}; start dockerd (or set {REQUIRE_DOCKER_ENV}=1 to fail instead)")


@pytest.fixture(scope="session")
def docker_client():
    try:
        import docker
    except ImportError:
        _unavailable("the docker Python SDK is not installed")
    try:
        client = docker.from_env(timeout=300)
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means: no engine here
        _unavailable(f"no Docker engine reachable: {exc}")
    yield client
    client.close()


@pytest.fixture(scope="session")
def geoloco_image(docker_client) -> str:
    """geoloco:latest (or $GEOLOCO_TEST_IMAGE), built once per session with build_images.sh."""
    image = os.environ.get(IMAGE_ENV, "geoloco:latest")
    if os.environ.get(SKIP_BUILD_ENV) != "1":
        env = dict(os.environ, GEOLOCO_IMAGE=image)
        result = subprocess.run([str(BUILD_SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=BUILD_TIMEOUT_S, check=False)
        print(result.stderr)
        assert result.returncode == 0, f"building the images failed:\n{result.stdout}\n{result.stderr}"
    docker_client.images.get(image)  # raises ImageNotFound with the name
    return image


@pytest.fixture
def lab(docker_client, geoloco_image) -> Iterator[Lab]:
    lab = Lab(docker_client, geoloco_image)
    try:
        yield lab
    finally:
        lab.cleanup()


@pytest.fixture(scope="module")
def module_lab(docker_client, geoloco_image) -> Iterator[Lab]:
    lab = Lab(docker_client, geoloco_image)
    try:
        yield lab
    finally:
        lab.cleanup()
