"""Fixtures for the real-container tests: a Docker engine (skip with a clear reason when
none answers, fail instead when GEOLOCO_REQUIRE_DOCKER=1), the images built once per
session by the same script as `make images`, and a Lab per test (see dockerlab.py).

The build starts in the background when collection ends, and the container tests run last
(tests/conftest.py): on a fresh machine the offline base image (debootstrap) and the
wheelhouse take minutes, which overlap the rest of the suite instead of counting against
the 600 s timeout of whichever container test comes first. A lock file serializes builds
(under pytest-xdist the first worker builds and the others wait for it), and `.ci/run`
takes the same lock to start the build before the virtual environment.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from dockerlab import Lab

REQUIRE_DOCKER_ENV = "GEOLOCO_REQUIRE_DOCKER"
IMAGE_ENV = "GEOLOCO_TEST_IMAGE"
SKIP_BUILD_ENV = "GEOLOCO_TEST_SKIP_BUILD"  # reuse an image built by `make images`
ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "docker" / "build_images.sh"
BUILD_TIMEOUT_S = 1800
HERE = Path(__file__).parent
BUILD_LOCK = Path(tempfile.gettempdir()) / "geoloco-test-images.lock"
_build: dict[str, tuple[subprocess.Popen, IO[str]]] = {}  # image -> the session's build and its log


def _is_container_test(item: pytest.Item) -> bool:
    return HERE in Path(item.fspath).parents


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the first container test may wait for the build (a fresh machine, a short run)
    timeout = BUILD_TIMEOUT_S + float(config.getini("timeout") or 0)
    for item in filter(_is_container_test, items):
        item.add_marker(pytest.mark.docker)
        item.add_marker(pytest.mark.timeout(timeout))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the images when a container test is to run and an engine answers
    (without one the fixtures skip or fail with the reason)."""
    if session.config.option.collectonly or os.environ.get(SKIP_BUILD_ENV) == "1" or not any(map(_is_container_test, session.items)):
        return
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return  # the first worker builds; geoloco_image waits on the lock
    try:
        import docker
        docker.from_env(timeout=10).ping()
    except Exception:  # noqa: BLE001 - no SDK or no engine: docker_client says which
        return
    image = _image()
    log = tempfile.NamedTemporaryFile("w+", prefix="geoloco-images-", suffix=".log")  # noqa: SIM115 - read by the fixture
    _build[image] = (subprocess.Popen(["flock", str(BUILD_LOCK), str(BUILD_SCRIPT)], cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, env=dict(os.environ, GEOLOCO_IMAGE=image),
                                      start_new_session=True), log)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"building {image} in the background for the container tests, which run last "
                            f"({BUILD_SCRIPT.relative_to(ROOT)}; its output: {log.name})")


def pytest_sessionfinish() -> None:
    """A build still running when the session ends (Ctrl-C, -x) is stopped with it."""
    for build, _log in _build.values():
        if build.poll() is None:
            os.killpg(build.pid, signal.SIGTERM)  # flock and the script under it
            build.wait()


def _image() -> str:
    return os.environ.get(IMAGE_ENV, "geoloco:latest")


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
    """geoloco:latest (or $GEOLOCO_TEST_IMAGE), once the session's build has ended."""
    image = _image()
    if image in _build:
        build, log = _build[image]
        try:
            build.wait(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            build.kill()
            build.wait()
        log.seek(0)
        output = log.read()
        print(output)
        if build.returncode != 0:
            pytest.fail(f"building the images failed (exit {build.returncode}):\n{output[-6000:]}", pytrace=False)
    elif os.environ.get(SKIP_BUILD_ENV) != "1":
        with open(BUILD_LOCK, "a") as lock:  # another worker's build, or .ci/run's, holds it until done
            fcntl.flock(lock, fcntl.LOCK_EX)
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
