"""A worker container's shaped link, measured: `python -m geoloco.links.tc apply` in a
container with NET_ADMIN, then bulk transfers both ways and echo round trips to a second
container. The rate must come out within 15 % of the profile; the added delay too, from
netem where the kernel has it and otherwise from the link emulator the plan hands over."""

from __future__ import annotations

import json
import statistics

import pytest
from dockerlab import NETPROBE, wait_for

from geoloco.links.tc import NETEM_UNAVAILABLE
from geoloco.profiles import LinkProfile

PORT = 5201
TOLERANCE = 0.15
TRANSFER_S = 4.0
RTT_SAMPLES = 30
NO_HEALTHCHECK = {"test": ["NONE"]}

# The relay the worker runs when netem is missing, fed the plan's `emulate` profile; the
# same relay with no delay gives the baseline, so only the emulated delay is measured.
RELAY_RTT = """
import json, sys
sys.path.insert(0, "/tmp")
import netprobe
from geoloco.links.emulator import RelayThread
from geoloco.profiles import LinkProfile
rtts = {{}}
for name, profile in (("base", "unlimited"), ("emulated", "{profile}")):
    with RelayThread(target=("coordinator", {port}), profile=LinkProfile.parse(profile)) as relay:
        rtts[name] = netprobe.rtt("127.0.0.1", relay.port, {count})["rtt_s"]
print(json.dumps(rtts))
"""


@pytest.fixture
def pair(lab):
    """A netprobe server ("coordinator") and a sleeping container to shape ("worker")."""
    net = lab.network("link")
    server = lab.run("coordinator", net, entrypoint=["sleep", "infinity"], healthcheck=NO_HEALTHCHECK)
    worker = lab.run("worker", net, entrypoint=["sleep", "infinity"], cap_add=["NET_ADMIN"],
                     healthcheck=NO_HEALTHCHECK)
    for container in (server, worker):
        lab.put_file(container, NETPROBE)
    server.exec_run(["python", "/tmp/netprobe.py", "serve", str(PORT)], detach=True)
    wait_for(lambda: _probe(lab, worker, "rtt", 1, check=False), 30, "the netprobe server")
    return lab, worker


def _probe(lab, worker, verb: str, amount: float, check: bool = True) -> dict | None:
    out, _ = lab.exec(worker, ["python", "/tmp/netprobe.py", verb, "coordinator", str(PORT), str(amount)],
                      check=check)
    return json.loads(out) if out.strip() else None


def _median_rtt(samples: list[float]) -> float:
    return statistics.median(samples[1:])  # the first echo pays for slow start


@pytest.mark.parametrize("rate_qdisc", ["tbf", "htb"])
def test_shaped_rate_both_ways_and_added_delay(pair, rate_qdisc: str) -> None:
    lab, worker = pair
    profile = LinkProfile.parse("16mbit/40ms/2ms" if rate_qdisc == "tbf" else "8mbit/25ms")
    base_rtt = _median_rtt(_probe(lab, worker, "rtt", RTT_SAMPLES)["rtt_s"])

    out, err = lab.exec(worker, ["python", "-m", "geoloco.links.tc", "apply", "--iface", "eth0",
                                 "--profile", str(profile), "--rate-qdisc", rate_qdisc])
    applied = json.loads(out.splitlines()[-1])
    qdiscs, _ = lab.exec(worker, ["tc", "qdisc", "show"])
    assert f"qdisc {rate_qdisc} 1: dev ifb0" in qdiscs or f"qdisc {rate_qdisc} 10: dev ifb0" in qdiscs, qdiscs
    assert "qdisc ingress ffff: dev eth0" in qdiscs

    # TCP goodput counts payload only: 1448 of every 1514 bytes on the wire (-4.4 %)
    up = _probe(lab, worker, "upload", TRANSFER_S)["rate_bps"]
    down = _probe(lab, worker, "download", TRANSFER_S)["rate_bps"]
    for direction, rate in (("egress", up), ("ingress", down)):
        assert abs(rate / profile.rate_bps - 1) <= TOLERANCE, (
            f"{direction}: {rate / 1e6:.2f} Mbit/s measured for a {profile.rate_bps / 1e6:g} Mbit/s profile")

    if applied["netem"]:
        rtt = _median_rtt(_probe(lab, worker, "rtt", RTT_SAMPLES)["rtt_s"])
    else:
        assert NETEM_UNAVAILABLE in err
        assert LinkProfile.parse(applied["emulate"]) == LinkProfile(
            delay_s=profile.delay_s, jitter_s=profile.jitter_s)
        script = RELAY_RTT.format(port=PORT, profile=applied["emulate"], count=RTT_SAMPLES)
        out, _ = lab.exec(worker, ["python", "-c", script])
        rtts = json.loads(out)
        base_rtt, rtt = _median_rtt(rtts["base"]), _median_rtt(rtts["emulated"])
    added = rtt - base_rtt
    print(f"{rate_qdisc} {profile}: up {up / 1e6:.2f} Mbit/s, down {down / 1e6:.2f} Mbit/s, "
          f"added rtt {added * 1e3:.1f} ms ({'netem' if applied['netem'] else 'link emulator'})")
    assert abs(added / profile.rtt_s - 1) <= TOLERANCE, (
        f"added round trip {added * 1e3:.1f} ms for a profile of {profile.rtt_s * 1e3:g} ms")


def test_clear_restores_the_unshaped_link(pair) -> None:
    lab, worker = pair
    lab.exec(worker, ["python", "-m", "geoloco.links.tc", "apply", "--profile", "4mbit"])
    slow = _probe(lab, worker, "upload", 2.5)["rate_bps"]
    lab.exec(worker, ["python", "-m", "geoloco.links.tc", "clear"])
    fast = _probe(lab, worker, "upload", 2.5)["rate_bps"]
    qdiscs, _ = lab.exec(worker, ["tc", "qdisc", "show", "dev", "eth0"])
    assert "tbf" not in qdiscs and "ingress" not in qdiscs
    assert slow < 4.6e6 < 10 * 4e6 < fast


def test_shaping_without_net_admin_fails_clearly(lab) -> None:
    net = lab.network("nocap")
    worker = lab.run("worker", net, entrypoint=["sleep", "infinity"], healthcheck=NO_HEALTHCHECK)
    code, output = worker.exec_run(["python", "-m", "geoloco.links.tc", "apply", "--profile", "10mbit"])
    assert code == 3
    assert b"NET_ADMIN" in output and b"Operation not permitted" in output
