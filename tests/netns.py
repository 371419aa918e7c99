"""A multi-host test bed on one machine: a hub network namespace holding a bridge, and one
namespace per host, each joined to the hub by a veth pair. Both ends of a host's pair are
shaped to its link profile with ``tc`` (geoloco.links.tc: tbf, with netem where the kernel
has it): the host end's egress is its upload, the hub end's its download. Addresses come
from TESTBED_SUBNET, used only inside these namespaces, so no traffic leaves them.

    with TestBed({"a": "20mbit", "b": "5mbit"}) as bed:
        server = bed.popen("hub", ["python", "-m", "http.server", "--bind", bed.hub_address])
        bed.run("a", ["curl", f"http://{bed.hub_address}:8000/"])

Everything is removed at exit: by the context manager, by atexit for an interpreter that
ends otherwise, and namespaces left by a process that was killed are removed when the next
test bed starts. It needs root and ``ip netns``; ``unavailable()`` says why not, and tests
skip with that reason unless GEOLOCO_REQUIRE_NETNS=1 (set in CI) makes it a failure.
Without netem (this project's test machines) the links have their rates but no added
delay: ``TestBed.netem`` says which.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from geoloco.links import tc
from geoloco.profiles import LinkProfile

REQUIRE_ENV = "GEOLOCO_REQUIRE_NETNS"
PREFIX = "geoloco-tb"  # namespace names: geoloco-tb-<pid>-<bed>-<role>
TESTBED_SUBNET = "10.213.0"  # a /24 that exists only inside the test bed
HOST_IFACE = "eth0"  # the host end of its veth pair, inside its namespace
_beds = itertools.count()


def unavailable() -> str | None:
    """Why a test bed cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` (Debian package iproute2)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def require_testbed() -> None:
    """In a test: skip with the reason a test bed cannot be built here, or fail with it
    when REQUIRE_ENV=1 (CI)."""
    import pytest

    reason = unavailable()
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1 makes the test bed required)", pytrace=False)
    pytest.skip(f"{reason}; run as root (or set {REQUIRE_ENV}=1 to fail instead)")


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str
    profile: LinkProfile
    hub_iface: str  # the hub end of its veth pair


class TestBed:
    """A hub and one namespace per host of ``profiles`` ({name: link profile}), shaped; see
    the module docstring. ``netem``: None probes the kernel for it."""

    __test__ = False  # a helper, not a pytest test class

    def __init__(self, profiles: dict[str, str | LinkProfile], netem: bool | None = None) -> None:
        if not 1 <= len(profiles) <= 200:
            raise ValueError(f"{len(profiles)} hosts: a test bed holds 1 to 200")
        self.profiles = {name: p if isinstance(p, LinkProfile) else LinkProfile.parse(p)
                         for name, p in profiles.items()}
        self.netem_choice = netem
        self.netem = False
        self.tag = f"{os.getpid()}-{next(_beds)}"
        self.hub = f"{PREFIX}-{self.tag}-hub"
        self.hub_address = f"{TESTBED_SUBNET}.1"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []

    def __enter__(self) -> TestBed:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        remove_stale()
        atexit.register(self.close)
        self._add_namespace(self.hub)
        self._ip(self.hub, "link", "add", "br0", "type", "bridge")
        self._ip(self.hub, "addr", "add", f"{self.hub_address}/24", "dev", "br0")
        self._ip(self.hub, "link", "set", "br0", "up")
        for i, (name, profile) in enumerate(self.profiles.items()):
            host = Host(name, f"{PREFIX}-{self.tag}-h{i}", f"{TESTBED_SUBNET}.{10 + i}", profile,
                        f"v{os.getpid() % 10**7}{self.tag.split('-')[1]}x{i}"[:15])
            self._add_namespace(host.namespace)
            subprocess.run(["ip", "link", "add", host.hub_iface, "netns", self.hub, "type", "veth",
                            "peer", "name", HOST_IFACE, "netns", host.namespace], check=True,
                           capture_output=True, text=True)
            self._ip(self.hub, "link", "set", host.hub_iface, "master", "br0", "up")
            self._ip(host.namespace, "addr", "add", f"{host.address}/24", "dev", HOST_IFACE)
            self._ip(host.namespace, "link", "set", HOST_IFACE, "up")
            self.hosts[name] = host
        if self.netem_choice is None:
            first = next(iter(self.hosts.values()))
            self.netem = tc.probe_netem(HOST_IFACE, run=self._runner(first.namespace))
        else:
            self.netem = self.netem_choice
        for host in self.hosts.values():
            for namespace, iface in ((host.namespace, HOST_IFACE), (self.hub, host.hub_iface)):
                for command in tc.shaping_commands(iface, host.profile, self.netem):
                    self._exec(namespace, command)

    def close(self) -> None:
        """Remove every namespace (and with them the veth pairs and qdiscs); idempotent."""
        while self._namespaces:
            subprocess.run(["ip", "netns", "del", self._namespaces.pop()], capture_output=True)
        atexit.unregister(self.close)

    # ------------------------------------------------------------------ running things

    def namespace(self, where: str) -> str:
        return self.hub if where == "hub" else self.hosts[where].namespace

    def address(self, where: str) -> str:
        return self.hub_address if where == "hub" else self.hosts[where].address

    def command(self, where: str, argv: list[str]) -> list[str]:
        """``argv`` to run inside ``where`` (a host's name, or "hub")."""
        return ["ip", "netns", "exec", self.namespace(where), *argv]

    def popen(self, where: str, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(self.command(where, argv), **kwargs)

    def run(self, where: str, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(where, argv), **kwargs)

    def link_bytes(self, host: str) -> tuple[int, int]:
        """(bytes sent, bytes received) on ``host``'s interface so far (``ip -s link``)."""
        out = self.run(host, ["ip", "-s", "-j", "link", "show", HOST_IFACE], check=True).stdout
        stats = json.loads(out)[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]

    # ------------------------------------------------------------------ helpers

    def _add_namespace(self, name: str) -> None:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, text=True)
        self._namespaces.append(name)
        self._ip(name, "link", "set", "lo", "up")

    def _ip(self, namespace: str, *args: str) -> None:
        self._exec(namespace, ["ip", *args])

    def _exec(self, namespace: str, argv: list[str]) -> None:
        done = subprocess.run(["ip", "netns", "exec", namespace, *argv], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(argv)} in {namespace} failed: {done.stderr.strip()}")

    def _runner(self, namespace: str) -> tc.Runner:
        return lambda argv: subprocess.run(["ip", "netns", "exec", namespace, *argv],
                                           capture_output=True, text=True)


def remove_stale() -> None:
    """Remove the namespaces of test beds whose process is gone (it was killed)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX + "-"):
            continue
        pid = name[len(PREFIX) + 1:].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
