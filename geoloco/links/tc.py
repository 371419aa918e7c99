"""Shape a container's link to a LinkProfile with Linux ``tc``: ``netem`` for delay, jitter
and loss, ``tbf`` or ``htb`` for rate, and an ``ifb`` device for the ingress side.

Egress (``root``) gets ``netem`` (when the kernel has it) chained with the rate limiter;
ingress is redirected (``u32`` match-all + ``mirred egress redirect``) to ``ifb0``, whose
root gets the same chain, so both directions see the profile and the round trip adds
2 x delay, as ``LinkProfile.rtt_s`` says. Kernels without ``netem`` keep the rate shaping
only; the delay and jitter then come from the link emulator (``geoloco.links.emulator``),
which the worker runs in process with the profile returned as ``ShapingPlan.emulate``.

The command builders are pure functions (argv lists); ``apply_plan`` runs them. No gRPC
here: the container's worker joins first (``geoloco.worker.container``), then shapes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from geoloco.profiles import LinkProfile, LinkProfileError

log = logging.getLogger(__name__)

IFB_DEVICE = "ifb0"
RATE_QDISCS = ("tbf", "htb")
MTU_BYTES = 1514
QUEUE_S = 0.1  # rate limiter queue, in seconds of traffic at the profile's rate
MIN_BURST_BYTES = 16 * 1024  # token bucket depth floor (above GSO-sized packets' segments)
BURST_S = 0.004  # token bucket depth as time at the rate (>= one 250 Hz timer tick)
NETEM_MIN_LIMIT = 1000  # netem's default queue, in packets
NETEM_UNAVAILABLE = "netem not available in this kernel: delay/jitter come from the link emulator"
EXIT_SHAPING_FAILED = 3

Command = list[str]
Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


class LinkShapingError(RuntimeError):
    """A ``tc``/``ip`` command failed; the message carries the command and its stderr."""


@dataclass(frozen=True)
class ShapingPlan:
    """What to run for one interface, and what is left to the link emulator.

    ``emulate`` is the part of the profile that ``tc`` does not apply (delay and jitter
    without ``netem``), as a rate-unlimited profile, or ``None`` when ``tc`` does it all.
    """

    iface: str
    profile: LinkProfile
    netem: bool
    commands: list[Command] = field(default_factory=list)
    emulate: LinkProfile | None = None
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- builders


def tc_rate(bps: float) -> str:
    """A ``tc`` rate in bit/s (integer, unit ``bit``: exact for any profile rate)."""
    return f"{max(1, round(bps))}bit"


def tc_time(seconds: float) -> str:
    """A ``tc`` time in microseconds (``us``), exact to the microsecond."""
    return f"{max(0, round(seconds * 1e6))}us"


def burst_bytes(rate_bps: float) -> int:
    """Token bucket depth: BURST_S of traffic at the rate, at least MIN_BURST_BYTES."""
    return max(MIN_BURST_BYTES, math.ceil(rate_bps / 8 * BURST_S))


def queue_bytes(rate_bps: float) -> int:
    """Rate limiter queue: QUEUE_S of traffic at the rate, at least a few bursts."""
    return max(4 * burst_bytes(rate_bps), math.ceil(rate_bps / 8 * QUEUE_S))


def netem_args(profile: LinkProfile) -> list[str]:
    """``netem`` parameters for the delay, jitter and loss of ``profile``.

    The queue limit covers the packets in flight during one delay at the profile's rate,
    so a long delay on a fast link does not drop packets in netem itself.
    """
    args = ["delay", tc_time(profile.delay_s)]
    if profile.jitter_s:
        args += [tc_time(profile.jitter_s), "distribution", "normal"]
    if profile.loss:
        args += ["loss", f"{profile.loss * 100:.6g}%"]
    if profile.rate_bps:
        in_flight = profile.rate_bps / 8 * max(profile.delay_s + 2 * profile.jitter_s, QUEUE_S)
        args += ["limit", str(max(NETEM_MIN_LIMIT, math.ceil(2 * in_flight / MTU_BYTES)))]
    return args


def needs_netem(profile: LinkProfile) -> bool:
    """Whether the profile has anything only ``netem`` can do (delay, jitter, loss)."""
    return bool(profile.delay_s or profile.jitter_s or profile.loss)


def shaping_commands(dev: str, profile: LinkProfile, netem: bool, rate_qdisc: str = "tbf") -> list[Command]:
    """The qdisc chain on ``dev``'s root for ``profile`` (egress of ``dev``).

    tbf:  root netem (handle 1:) -> child tbf (10:) on netem's class 1:1, or tbf alone.
    htb:  root htb (1:) -> class 1:10 at the rate -> leaf netem (10:), or no leaf.
    Without ``netem`` (or nothing for it to do) only the rate limiter is set up.
    """
    if rate_qdisc not in RATE_QDISCS:
        raise ValueError(f"rate qdisc {rate_qdisc!r} is not one of {', '.join(RATE_QDISCS)}")
    use_netem = netem and needs_netem(profile)
    tc = ["tc", "qdisc", "add", "dev", dev]
    rate = profile.rate_bps
    if rate is None:
        return [tc + ["root", "handle", "1:", "netem", *netem_args(profile)]] if use_netem else []
    burst = str(burst_bytes(rate))
    if rate_qdisc == "htb":
        commands = [
            tc + ["root", "handle", "1:", "htb", "default", "10"],
            ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
             "rate", tc_rate(rate), "ceil", tc_rate(rate), "burst", burst, "cburst", burst],
        ]
        leaf = ["netem", *netem_args(profile)] if use_netem else [
            "bfifo", "limit", str(queue_bytes(rate))]
        return commands + [tc + ["parent", "1:10", "handle", "10:", *leaf]]
    tbf = ["tbf", "rate", tc_rate(rate), "burst", burst, "limit", str(queue_bytes(rate))]
    if not use_netem:
        return [tc + ["root", "handle", "1:", *tbf]]
    return [
        tc + ["root", "handle", "1:", "netem", *netem_args(profile)],
        tc + ["parent", "1:1", "handle", "10:", *tbf],
    ]


def ingress_redirect_commands(iface: str, ifb: str = IFB_DEVICE) -> list[Command]:
    """Create ``ifb`` and send everything arriving on ``iface`` through its egress."""
    return [
        ["ip", "link", "add", ifb, "type", "ifb"],
        ["ip", "link", "set", "dev", ifb, "up"],
        ["tc", "qdisc", "add", "dev", iface, "handle", "ffff:", "ingress"],
        ["tc", "filter", "add", "dev", iface, "parent", "ffff:", "protocol", "all", "u32",
         "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", ifb],
    ]


def clear_commands(iface: str, ifb: str = IFB_DEVICE) -> list[Command]:
    """Remove all shaping (each may fail harmlessly when there is nothing to remove)."""
    return [
        ["tc", "qdisc", "del", "dev", iface, "root"],
        ["tc", "qdisc", "del", "dev", iface, "ingress"],
        ["ip", "link", "del", ifb],
    ]


def netem_probe_commands(iface: str) -> tuple[Command, Command]:
    """Add a no-op netem qdisc and remove it again: the first fails without ``netem``."""
    return (
        ["tc", "qdisc", "add", "dev", iface, "root", "handle", "1:", "netem", "delay", "0us"],
        ["tc", "qdisc", "del", "dev", iface, "root"],
    )


def plan_shaping(iface: str, profile: LinkProfile, netem: bool, rate_qdisc: str = "tbf",
                 ingress: bool = True, ifb: str = IFB_DEVICE) -> ShapingPlan:
    """All commands for ``profile`` on ``iface`` (both directions unless ``ingress`` is
    False), and the fallback decision: without ``netem`` the delay and jitter go to
    ``emulate`` for the link emulator, and loss is dropped with a note (a TCP relay
    cannot lose packets)."""
    notes: list[str] = []
    emulate = None
    if not netem and needs_netem(profile):
        notes.append(NETEM_UNAVAILABLE)
        if profile.delay_s or profile.jitter_s:
            emulate = LinkProfile(rate_bps=None, delay_s=profile.delay_s, jitter_s=profile.jitter_s)
        if profile.loss:
            notes.append(f"loss {profile.loss * 100:g}% is not emulated without netem")
    commands = shaping_commands(iface, profile, netem, rate_qdisc)
    if ingress and commands:
        commands += ingress_redirect_commands(iface, ifb) + shaping_commands(ifb, profile, netem, rate_qdisc)
    return ShapingPlan(iface=iface, profile=profile, netem=netem, commands=commands,
                       emulate=emulate, notes=notes)


# ---------------------------------------------------------------------------- running


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run one command, capturing its output (never raises on a non-zero exit)."""
    return subprocess.run(list(argv), capture_output=True, text=True, check=False)


def probe_netem(iface: str, run: Runner = run_command) -> bool:
    """Whether this kernel has ``netem``: try to add one to ``iface``'s root, then remove it.
    ``iface`` must have no root qdisc yet (``clear`` first)."""
    add, delete = netem_probe_commands(iface)
    result = run(add)
    if result.returncode != 0:
        log.info("netem probe failed: %s", (result.stderr or result.stdout).strip())
        return False
    run(delete)
    return True


def clear(iface: str, run: Runner = run_command, ifb: str = IFB_DEVICE) -> None:
    """Remove the shaping of ``iface`` and its ifb device, ignoring what is not there."""
    for argv in clear_commands(iface, ifb):
        run(argv)


def apply_plan(plan: ShapingPlan, run: Runner = run_command) -> None:
    """Run the plan's commands in order; the first failure raises LinkShapingError."""
    for argv in plan.commands:
        result = run(argv)
        if result.returncode != 0:
            raise LinkShapingError(
                f"`{' '.join(argv)}` failed ({result.returncode}): "
                f"{(result.stderr or result.stdout).strip()} (the container needs cap_add NET_ADMIN)"
            )


def shape(iface: str, profile: LinkProfile, rate_qdisc: str = "tbf", netem: bool | None = None,
          ingress: bool = True, run: Runner = run_command) -> ShapingPlan:
    """Clear ``iface``, probe for ``netem`` (unless given), apply ``profile``; returns the plan."""
    clear(iface, run)
    if netem is None:
        netem = probe_netem(iface, run) if needs_netem(profile) else False
    plan = plan_shaping(iface, profile, netem, rate_qdisc, ingress)
    for note in plan.notes:
        log.warning("%s", note)
    apply_plan(plan, run)
    log.info("shaped %s to %s (%s%s)", iface, profile, "netem + " if plan.netem and needs_netem(profile)
             else "", rate_qdisc if profile.rate_bps else "no rate limit")
    return plan


# ---------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m geoloco.links.tc apply|clear``; returns the exit code."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return args.run(args)
    except (LinkShapingError, LinkProfileError) as exc:
        log.error("%s", exc)
        return EXIT_SHAPING_FAILED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m geoloco.links.tc", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    apply_p = sub.add_parser("apply", help="shape IFACE to PROFILE (both directions)")
    apply_p.add_argument("--profile", required=True, help="e.g. 20mbit/50ms/5ms/0.1%%")
    apply_p.add_argument("--dry-run", action="store_true",
                         help="print the commands instead of running them (no probe: see --netem)")
    apply_p.set_defaults(run=_cmd_apply)
    clear_p = sub.add_parser("clear", help="remove all shaping from IFACE")
    clear_p.add_argument("--dry-run", action="store_true", help="print the commands only")
    clear_p.set_defaults(run=_cmd_clear)
    for p in (apply_p, clear_p):
        p.add_argument("--iface", default="eth0", help="interface to shape (default eth0)")
    for p in (apply_p,):
        p.add_argument("--rate-qdisc", choices=RATE_QDISCS, default="tbf", help="rate limiter (default tbf)")
        p.add_argument("--netem", choices=("auto", "yes", "no"), default="auto",
                       help="use netem: auto probes the kernel (dry run: assumes yes)")
        p.add_argument("--no-ingress", action="store_true", help="shape egress only")
    return parser


def _netem_choice(args: argparse.Namespace) -> bool | None:
    return {"auto": None, "yes": True, "no": False}[args.netem]


def _cmd_apply(args: argparse.Namespace) -> int:
    profile = LinkProfile.parse(args.profile)
    if args.dry_run:
        netem = _netem_choice(args)
        plan = plan_shaping(args.iface, profile, True if netem is None else netem, args.rate_qdisc,
                            not args.no_ingress)
        for note in plan.notes:
            print(f"# {note}")
        for argv in plan.commands:
            print(" ".join(argv))
        print(f"# emulate: {plan.emulate or 'none'}")
        return 0
    plan = shape(args.iface, profile, args.rate_qdisc, _netem_choice(args), not args.no_ingress)
    print(json.dumps({"iface": plan.iface, "profile": str(profile), "netem": plan.netem,
                      "emulate": str(plan.emulate) if plan.emulate else None}))
    return 0


def _cmd_clear(args: argparse.Namespace) -> int:
    if args.dry_run:
        for argv in clear_commands(args.iface):
            print(" ".join(argv))
        return 0
    clear(args.iface)
    log.info("cleared shaping on %s", args.iface)
    return 0


if __name__ == "__main__":
    sys.exit(main())
