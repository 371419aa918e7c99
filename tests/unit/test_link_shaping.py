"""tc command building for the container link shaping (geoloco.links.tc): the netem,
tbf, htb and ifb paths, clear and the netem fallback decision. No root needed: nothing
here runs tc."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import pytest

from geoloco.links import tc as ls
from geoloco.profiles import LinkProfile

FULL = LinkProfile.parse("20mbit/50ms/5ms/0.1%")


def _find(commands: list[list[str]], *words: str) -> list[str]:
    """The one command containing ``words`` as a contiguous run."""
    hits = [c for c in commands if any(c[i:i + len(words)] == list(words) for i in range(len(c)))]
    assert len(hits) == 1, f"{words} in {len(hits)} commands: {commands}"
    return hits[0]


def _after(cmd: list[str], word: str) -> str:
    return cmd[cmd.index(word) + 1]


def test_netem_args_carry_delay_jitter_and_loss_exactly() -> None:
    args = ls.netem_args(FULL)
    assert args[:5] == ["delay", "50000us", "5000us", "distribution", "normal"]
    assert _after(args, "loss") == "0.1%"
    assert int(_after(args, "limit")) >= ls.NETEM_MIN_LIMIT


def test_netem_queue_limit_grows_with_the_bandwidth_delay_product() -> None:
    slow = int(_after(ls.netem_args(LinkProfile.parse("10mbit/20ms")), "limit"))
    fast = int(_after(ls.netem_args(LinkProfile.parse("10gbit/200ms")), "limit"))
    assert slow == ls.NETEM_MIN_LIMIT
    # 10 Gbit/s for 200 ms is 250 MB in flight: far more than 1000 packets
    assert fast * ls.MTU_BYTES >= 10e9 / 8 * 0.2


def test_delay_without_jitter_or_loss_has_no_extra_words() -> None:
    args = ls.netem_args(LinkProfile.parse("unlimited/30ms"))
    assert args == ["delay", "30000us"]


def test_tbf_chained_under_netem_on_egress() -> None:
    cmds = ls.shaping_commands("eth0", FULL, netem=True, rate_qdisc="tbf")
    assert len(cmds) == 2
    root, child = cmds
    assert root[:7] == ["tc", "qdisc", "add", "dev", "eth0", "root", "handle"]
    assert root[7:9] == ["1:", "netem"] and "loss" in root
    # tbf hangs off netem's only class, so packets are delayed, then rate limited
    assert child[5:9] == ["parent", "1:1", "handle", "10:"]
    assert child[9] == "tbf" and _after(child, "rate") == "20000000bit"
    assert int(_after(child, "burst")) >= ls.MIN_BURST_BYTES
    assert int(_after(child, "limit")) == ls.queue_bytes(20e6) == 250_000


def test_htb_class_with_netem_leaf() -> None:
    cmds = ls.shaping_commands("eth0", FULL, netem=True, rate_qdisc="htb")
    root, klass, leaf = cmds
    assert root[5:] == ["root", "handle", "1:", "htb", "default", "10"]
    assert klass[:3] == ["tc", "class", "add"] and _after(klass, "classid") == "1:10"
    assert _after(klass, "rate") == _after(klass, "ceil") == "20000000bit"
    assert leaf[5:10] == ["parent", "1:10", "handle", "10:", "netem"]
    assert _after(leaf, "delay") == "50000us" and _after(leaf, "loss") == "0.1%"


def test_htb_without_netem_gets_a_byte_fifo_leaf() -> None:
    cmds = ls.shaping_commands("eth0", FULL, netem=False, rate_qdisc="htb")
    assert [c for c in cmds if "netem" in c] == []
    assert cmds[-1][9:] == ["bfifo", "limit", "250000"]


def test_rate_only_profile_never_uses_netem() -> None:
    cmds = ls.shaping_commands("eth0", LinkProfile.parse("8mbit"), netem=True)
    assert cmds == [["tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "tbf",
                     "rate", "8000000bit", "burst", str(ls.MIN_BURST_BYTES), "limit", "100000"]]


def test_delay_only_profile_is_netem_alone() -> None:
    cmds = ls.shaping_commands("eth0", LinkProfile.parse("unlimited/40ms/2ms"), netem=True)
    assert len(cmds) == 1 and cmds[0][8] == "netem"
    assert ls.shaping_commands("eth0", LinkProfile.parse("unlimited/40ms/2ms"), netem=False) == []


def test_unknown_rate_qdisc_is_refused() -> None:
    with pytest.raises(ValueError, match="tbf, htb"):
        ls.shaping_commands("eth0", FULL, netem=True, rate_qdisc="cake")


def test_ingress_goes_through_ifb_with_the_same_chain() -> None:
    plan = ls.plan_shaping("eth0", FULL, netem=True, rate_qdisc="tbf")
    cmds = plan.commands
    assert _find(cmds, "ip", "link", "add", "ifb0", "type", "ifb")
    assert _find(cmds, "ip", "link", "set", "dev", "ifb0", "up")
    assert _find(cmds, "dev", "eth0", "handle", "ffff:", "ingress")
    redirect = _find(cmds, "u32")
    assert redirect[redirect.index("u32"):] == [
        "u32", "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", "ifb0"]
    # ifb0 carries exactly the egress chain, and comes after the redirect is in place
    egress = ls.shaping_commands("eth0", FULL, True, "tbf")
    ifb = ls.shaping_commands("ifb0", FULL, True, "tbf")
    assert cmds[:2] == egress and cmds[-2:] == ifb
    assert cmds.index(redirect) < cmds.index(ifb[0])
    assert plan.emulate is None and plan.notes == []


def test_egress_only_plan_has_no_ifb() -> None:
    plan = ls.plan_shaping("eth0", FULL, netem=True, ingress=False)
    assert all("ifb0" not in c for c in plan.commands)


def test_fallback_without_netem_keeps_the_rate_and_hands_delay_to_the_emulator() -> None:
    plan = ls.plan_shaping("eth0", FULL, netem=False)
    assert all("netem" not in c for c in plan.commands)
    assert sum(1 for c in plan.commands if "tbf" in c) == 2  # eth0 and ifb0
    assert plan.emulate == LinkProfile(rate_bps=None, delay_s=0.05, jitter_s=0.005)
    assert LinkProfile.parse(str(plan.emulate)) == plan.emulate  # what the worker is given
    assert plan.notes[0] == ls.NETEM_UNAVAILABLE
    assert "loss 0.1%" in plan.notes[1]


def test_fallback_is_silent_when_the_profile_needs_no_netem() -> None:
    plan = ls.plan_shaping("eth0", LinkProfile.parse("20mbit"), netem=False)
    assert plan.emulate is None and plan.notes == [] and len(plan.commands) == 2 + 4


def test_unlimited_profile_changes_nothing() -> None:
    plan = ls.plan_shaping("eth0", LinkProfile.parse("unlimited"), netem=True)
    assert plan.commands == [] and plan.emulate is None


def test_clear_removes_root_ingress_and_ifb() -> None:
    assert ls.clear_commands("eth1") == [
        ["tc", "qdisc", "del", "dev", "eth1", "root"],
        ["tc", "qdisc", "del", "dev", "eth1", "ingress"],
        ["ip", "link", "del", "ifb0"],
    ]


class RecordingRunner:
    """Stands in for the kernel: records argv lists, fails the commands it is told to."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.calls: list[list[str]] = []
        self.fail = fail

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        self.calls.append(argv)
        failed = any(word in argv for word in self.fail)
        err = "Error: Specified qdisc kind is unknown." if failed else ""
        return subprocess.CompletedProcess(argv, 2 if failed else 0, "", err)


def test_probe_decides_netem_from_the_kernel_answer() -> None:
    missing = RecordingRunner(fail=("netem",))
    assert ls.probe_netem("eth0", missing) is False
    assert len(missing.calls) == 1  # nothing to delete after a failed add
    present = RecordingRunner()
    assert ls.probe_netem("eth0", present) is True
    assert present.calls == list(ls.netem_probe_commands("eth0"))


def test_shape_without_netem_clears_probes_then_applies_the_rate_only_plan(caplog) -> None:
    runner = RecordingRunner(fail=("netem",))
    with caplog.at_level("WARNING", logger="geoloco.links.tc"):
        plan = ls.shape("eth0", FULL, run=runner)
    assert runner.calls[:3] == ls.clear_commands("eth0")
    assert runner.calls[3] == ls.netem_probe_commands("eth0")[0]
    assert runner.calls[4:] == ls.plan_shaping("eth0", FULL, netem=False).commands
    assert plan.emulate is not None and ls.NETEM_UNAVAILABLE in caplog.text


def test_shape_skips_the_probe_for_a_rate_only_profile() -> None:
    runner = RecordingRunner()
    ls.shape("eth0", LinkProfile.parse("5mbit"), run=runner)
    assert not any("netem" in c for c in runner.calls)


def test_a_failing_command_stops_with_its_stderr() -> None:
    plan = ls.plan_shaping("eth0", FULL, netem=False)
    with pytest.raises(ls.LinkShapingError, match=r"ip link add ifb0 type ifb.*qdisc kind is unknown"):
        ls.apply_plan(plan, RecordingRunner(fail=("ifb",)))


def test_dry_run_prints_the_plan(capsys) -> None:
    assert ls.main(["apply", "--iface", "eth0", "--profile", "10mbit/20ms", "--netem", "no", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"# {ls.NETEM_UNAVAILABLE}"
    assert "tc qdisc add dev eth0 root handle 1: tbf rate 10000000bit" in out[1]
    assert out[-1] == "# emulate: unlimited/20ms/0ms"


def test_cli_rejects_a_bad_profile() -> None:
    code = ls.main(["apply", "--iface", "eth0", "--profile", "20mbps", "--dry-run"])
    assert code == ls.EXIT_SHAPING_FAILED
