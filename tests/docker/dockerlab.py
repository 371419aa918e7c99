"""The Docker test lab: every container and network of a test gets a unique name prefix and
one label, sits on `internal` networks (containers reach each other and nothing else, so
test traffic stays between the test's own containers), and is removed at teardown."""

from __future__ import annotations

import io
import tarfile
import time
import uuid
from pathlib import Path

import pytest

LABEL = "geoloco.test"
NETPROBE = Path(__file__).with_name("netprobe.py")


class Lab:
    """Containers and networks of one test: unique names, one label, removed at the end."""

    def __init__(self, client, image: str) -> None:
        self.client = client
        self.image = image
        self.prefix = f"gltest-{uuid.uuid4().hex[:8]}"
        self.labels = {LABEL: self.prefix}

    def network(self, name: str):
        return self.client.networks.create(f"{self.prefix}-{name}", driver="bridge", internal=True,
                                           labels=self.labels)

    def run(self, name: str, network, command: list[str] | None = None, entrypoint: list[str] | None = None,
            aliases: tuple[str, ...] = (), **kwargs):
        """Start a detached container on ``network`` (reachable there by ``name``)."""
        from docker.types import EndpointConfig

        endpoint = EndpointConfig(self.client.api._version, aliases=[name, *aliases])
        return self.client.containers.run(
            self.image, command=command, entrypoint=entrypoint, name=f"{self.prefix}-{name}",
            hostname=name, labels=self.labels, detach=True, network=network.name,
            networking_config={network.name: endpoint}, **kwargs)

    def put_file(self, container, path: Path, dest_dir: str = "/tmp") -> str:
        data = path.read_bytes()
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(path.name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        container.put_archive(dest_dir, buf.getvalue())
        return f"{dest_dir}/{path.name}"

    def exec(self, container, cmd: list[str], user: str = "root", check: bool = True) -> tuple[str, str]:
        """Run ``cmd`` in ``container``; (stdout, stderr). ``check``: fail on a non-zero exit."""
        code, (out, err) = container.exec_run(cmd, user=user, demux=True)
        stdout, stderr = (out or b"").decode(errors="replace"), (err or b"").decode(errors="replace")
        if check:
            assert code == 0, f"{' '.join(cmd)} in {container.name} exited {code}:\n{stdout}\n{stderr}"
        return stdout, stderr

    def cleanup(self) -> None:
        for container in self.client.containers.list(all=True, filters={"label": f"{LABEL}={self.prefix}"}):
            container.remove(force=True, v=True)
        for network in self.client.networks.list(filters={"label": f"{LABEL}={self.prefix}"}):
            network.remove()


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
