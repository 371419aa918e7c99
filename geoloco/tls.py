"""Transport security from the run config: gRPC's TLS credentials for the coordinator's
server and the workers' channels, the rule that plaintext is for loopback only (or an
explicit ``insecure``), and the certificate a caller presented (docs/security.md)."""

from __future__ import annotations

import hashlib
import ipaddress
import logging
from pathlib import Path

import grpc

from geoloco.config import ConfigError, TlsConfig
from geoloco.transport import ChannelSecurity, parse_address

log = logging.getLogger(__name__)

PEER_CERT_KEY = "x509_pem_cert"  # gRPC auth context: the verified client certificate (PEM)
PEER_NAME_KEY = "x509_common_name"  # ... and the common name in it
INSECURE_BANNER = "*" * 72


def is_loopback(host: str) -> bool:
    """``localhost`` or an address in 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_credentials(tls: TlsConfig, listen: str) -> grpc.ServerCredentials | None:
    """TLS for the coordinator's port, mutual when ``tls.ca`` is set; None for plaintext,
    which only a loopback address or ``tls.insecure`` allows (then a loud warning)."""
    if tls.cert:
        ca = _read("tls.ca", tls.ca) if tls.ca else None
        pair = (_read("tls.key", tls.key), _read("tls.cert", tls.cert))
        log.info("serving TLS with %s%s", tls.cert,
                 f"; clients must present a certificate signed by {tls.ca} (mutual TLS)" if ca else "")
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)
    host, _ = parse_address(listen)
    if not is_loopback(host) and not tls.insecure:
        raise ConfigError(
            f"coordinator.listen {listen!r} is not a loopback address and no TLS is configured: "
            "give --tls-cert and --tls-key (and --tls-ca for mutual TLS; `geoloco certs` makes "
            "them), or --insecure to send the token, sessions and frames in plaintext")
    if not is_loopback(host):
        _warn_insecure(f"the coordinator serves PLAINTEXT on {listen}")
    return None


def channel_security(tls: TlsConfig, address: str) -> ChannelSecurity | None:
    """TLS for a worker's channel to ``address``: checked against ``tls.ca`` (the system's
    roots when unset), presenting ``tls.cert`` when given. None (plaintext) only for a
    loopback address without TLS settings, or with ``tls.insecure``."""
    host, _ = parse_address(address)
    if not (tls.ca or tls.cert):
        if tls.insecure or is_loopback(host):
            if not is_loopback(host):
                _warn_insecure(f"this worker talks PLAINTEXT to {address}")
            return None
        log.info("TLS to %s, checked against the system's root certificates (no tls.ca)", address)
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read("tls.ca", tls.ca) if tls.ca else None,
        private_key=_read("tls.key", tls.key) if tls.key else None,
        certificate_chain=_read("tls.cert", tls.cert) if tls.cert else None)
    return ChannelSecurity(creds, tls.server_name)


def peer_fingerprint(context: grpc.ServicerContext) -> str | None:
    """sha256 (hex) of the certificate the caller presented and gRPC verified; None
    without one (plaintext, or TLS without client certificates)."""
    pem = context.auth_context().get(PEER_CERT_KEY)
    return hashlib.sha256(pem[0]).hexdigest() if pem else None


def peer_name(context: grpc.ServicerContext) -> str | None:
    """The common name of the certificate the caller presented and gRPC verified; None
    without one."""
    name = context.auth_context().get(PEER_NAME_KEY)
    return name[0].decode("utf-8", "replace") if name else None


def _read(name: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path!r} ({exc.strerror})") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{name}: {path!r} is not a PEM file")
    return data


def _warn_insecure(what: str) -> None:
    log.warning("%s\nINSECURE: %s: the run token, the worker sessions and every frame can be "
                "read and replayed by anyone on the path. Use TLS (docs/security.md).\n%s",
                INSECURE_BANNER, what, INSECURE_BANNER)
