"""The root step of a worker container: join the coordinator (which assigns the worker id
and with it the worker's WAN profile), shape the container's link to that profile with
``tc`` (geoloco.links.tc), and write the identity file that the unprivileged worker
process then reclaims. ``python -m geoloco.worker.container --coordinator HOST:PORT ...``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from geoloco import transport
from geoloco.config import (
    TOKEN_ENV,
    ConfigError,
    RunConfig,
    TlsConfig,
    require_token,
    resolve_token,
)
from geoloco.links import tc
from geoloco.profiles import LinkProfile, LinkProfileError
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc as pb_grpc
from geoloco.tls import channel_security
from geoloco.transport import ChannelSecurity, CoordinatorUnreachable, JoinRefused

log = logging.getLogger(__name__)

EXIT_FAILED = 3


@dataclass
class Identity:
    """What the coordinator assigned at Join; the worker reclaims this id and session."""

    worker_id: int
    session: str
    wan_profile: str
    straggler_profile: str
    emulate: str | None = None

    def write(self, path: Path, owner: str | None = None) -> None:
        """Write atomically as JSON, readable by its owner only, and hand the file (not its
        folder) to ``owner`` (a user name) if given: `write_private_file`."""
        uid = gid = None
        if owner is not None:
            import pwd

            user = pwd.getpwnam(owner)
            uid, gid = user.pw_uid, user.pw_gid
        write_private_file(path, (json.dumps(self.__dict__, indent=2) + "\n").encode(), uid, gid)


class UnsafeFolder(OSError):
    """The folder of a file the root step writes is one another user could change."""


def write_private_file(path: Path, data: bytes, uid: int | None = None, gid: int | None = None) -> None:
    """Write ``data`` to ``path`` (mode 0600, then owned by ``uid``:``gid`` if given) so
    that no other user can steer the write: the folder must belong to this process's user
    and be writable by nobody else (UnsafeFolder otherwise), the temp file is created anew
    (O_EXCL) and never through a link (O_NOFOLLOW), its owner is changed through the open
    file, and the rename happens inside that same folder, opened once."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        st = os.fstat(folder)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise UnsafeFolder(f"{path.parent} belongs to uid {st.st_uid} (mode {st.st_mode & 0o777:o}); "
                               f"the identity folder must belong to uid {os.geteuid()} and be writable "
                               "by it alone")
        tmp = f".{path.name}.tmp"
        with contextlib.suppress(FileNotFoundError):  # left by a cut-off write: ours to remove
            os.unlink(tmp, dir_fd=folder)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if uid is not None:
                os.fchown(f.fileno(), uid, gid if gid is not None else -1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path.name, src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        os.close(folder)


def join_coordinator(address: str, token: str, timeout_s: float = 120.0,
                     security: ChannelSecurity | None = None) -> Identity:
    """Join ``address`` once (transport.join_with_backoff while it is not up) and return
    the assigned identity; a refusal (bad token, full run) raises JoinRefused."""
    request = pb.JoinRequest(token=token, protocol_version=transport.PROTOCOL_VERSION, capabilities=pb.Capabilities(
        device="pending", hostname=socket.gethostname(), version=_version(), threads=1))

    def call(channel: grpc.Channel, deadline_s: float) -> pb.JoinReply:
        return pb_grpc.CoordinatorStub(channel).Join(request, timeout=deadline_s)

    reply, channel = transport.join_with_backoff(address, call, timeout_s, security=security)
    channel.close()
    mismatch = transport.protocol_mismatch("worker", "coordinator", reply.protocol_version)
    if mismatch is not None:
        raise JoinRefused(mismatch)
    return Identity(worker_id=reply.worker_id, session=reply.session,
                    wan_profile=reply.wan_profile, straggler_profile=reply.straggler_profile)


def join_and_shape(args: argparse.Namespace) -> Identity:
    """Join (or reuse the identity a restarted container already has), shape the link,
    write the identity with what the link emulator must still do."""
    if args.identity_file.is_file():  # a restarted container: same id, shape again
        identity = Identity(**json.loads(_read_own(args.identity_file)))
        log.info("reusing %s: worker %d", args.identity_file, identity.worker_id)
    else:
        identity = join_coordinator(args.coordinator, _token(args), args.timeout,
                                    channel_security(_tls(args), args.coordinator))
        log.info("joined %s as worker %d: link %s, straggler %s", args.coordinator,
                 identity.worker_id, identity.wan_profile or "unlimited",
                 identity.straggler_profile or "none")
    netem = {"auto": None, "yes": True, "no": False}[args.netem]
    plan = tc.shape(args.iface, LinkProfile.parse(identity.wan_profile or "unlimited"),
                    args.rate_qdisc, netem, not args.no_ingress)
    identity = replace(identity, emulate=str(plan.emulate) if plan.emulate else None)
    identity.write(args.identity_file, args.owner)
    log.info("identity written to %s", args.identity_file)
    return identity


def _read_own(path: Path) -> str:
    """The text of ``path``, never through a link (the worker's user owns the file)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        return f.read()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m geoloco.worker.container", allow_abbrev=False,
                                description="Join the coordinator, shape IFACE to the assigned "
                                "WAN profile, write the identity file.")
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p.add_argument("--token-file", metavar="FILE", help=f"the run's token (default: ${TOKEN_ENV})")
    p.add_argument("--tls-ca", metavar="PEM", help="check the coordinator's certificate with this CA")
    p.add_argument("--tls-cert", metavar="PEM", help="this worker's certificate (mutual TLS)")
    p.add_argument("--tls-key", metavar="PEM", help="its private key")
    p.add_argument("--tls-server-name", metavar="NAME", help="the name in the coordinator's certificate")
    p.add_argument("--insecure", action="store_true", help="allow plaintext to a non-loopback address")
    p.add_argument("--identity-file", required=True, type=Path)
    p.add_argument("--owner", help="user to own the identity file (the worker's user)")
    p.add_argument("--timeout", type=float, default=120.0, help="give up joining after this long")
    p.add_argument("--iface", default="eth0", help="interface to shape (default eth0)")
    p.add_argument("--rate-qdisc", choices=tc.RATE_QDISCS, default="tbf", help="rate limiter (default tbf)")
    p.add_argument("--netem", choices=("auto", "yes", "no"), default="auto",
                   help="use netem: auto probes the kernel")
    p.add_argument("--no-ingress", action="store_true", help="shape egress only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        join_and_shape(args)
    except (tc.LinkShapingError, LinkProfileError, JoinRefused, CoordinatorUnreachable,
            ConfigError, UnsafeFolder) as exc:
        log.error("%s", exc)
        return EXIT_FAILED
    return 0


def _token(args: argparse.Namespace) -> str:
    """From --token-file, else $GEOLOCO_TOKEN (never a flag: ps shows command lines)."""
    cfg = RunConfig()
    cfg.coordinator.token_file = args.token_file
    resolve_token(cfg, os.environ)
    return require_token(cfg)


def _tls(args: argparse.Namespace) -> TlsConfig:
    return TlsConfig(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key,
                     server_name=args.tls_server_name, insecure=args.insecure)


def _version() -> str:
    from geoloco import __version__

    return __version__


if __name__ == "__main__":
    sys.exit(main())
