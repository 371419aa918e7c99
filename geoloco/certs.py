"""A run's credentials for ``geoloco certs``: its own CA, a coordinator certificate with the
SANs given, one client certificate per worker, and a random run token, written as PEM
files with the secrets readable by their owner only (X.509, RFC 5280; docs/security.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from geoloco.run_dir import write_atomic

CA_CERT, CA_KEY = "ca.pem", "ca.key"
COORDINATOR_CERT, COORDINATOR_KEY = "coordinator.pem", "coordinator.key"
TOKEN_FILE = "token"
WORKER_TOKENS_FILE = "worker-tokens"  # the coordinator's: "<worker id> <token>" per line
MIN_TOKEN_CHARS = 16  # a per-worker token shorter than this is refused
DEFAULT_SANS = ("localhost", "127.0.0.1")
DEFAULT_DAYS = 365
TOKEN_BYTES = 32
PRIVATE_MODE = 0o600  # keys and the token: their owner only
DIR_MODE = 0o700


def worker_cert(i: int) -> str:
    return f"worker-{i}.pem"


def worker_key(i: int) -> str:
    return f"worker-{i}.key"


def worker_token(i: int) -> str:
    return f"worker-{i}.token"


class WorkerTokensError(ValueError):
    """A per-worker tokens file that cannot be used; the message says why and where."""


def load_worker_tokens(path: str | Path, workers: int) -> dict[int, str]:
    """Worker id -> token from ``path`` (lines "<id> <token>"; blank lines and # comments
    skipped). Refused: a file others can read, an id outside 0..workers-1 or given twice,
    a token shorter than MIN_TOKEN_CHARS or shared by two ids, and no token at all."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o777
        text = path.read_text()
    except OSError as exc:
        raise WorkerTokensError(f"coordinator.worker_tokens_file: cannot read {path} ({exc.strerror})") from None
    if mode & 0o077:
        raise WorkerTokensError(f"coordinator.worker_tokens_file: {path} is readable by others (mode "
                                f"{mode:o}); chmod 600 {path}")
    tokens: dict[int, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"coordinator.worker_tokens_file: {path} line {number}"
        if len(parts) != 2 or not parts[0].isdigit() or len(parts[0]) > 6:
            raise WorkerTokensError(f"{where}: expected '<worker id> <token>'")
        worker, token = int(parts[0]), parts[1]
        if worker >= workers:
            raise WorkerTokensError(f"{where}: worker {worker}, but the run has {workers} worker slots "
                                    f"(0..{workers - 1})")
        if worker in tokens:
            raise WorkerTokensError(f"{where}: worker {worker} is given twice")
        if len(token) < MIN_TOKEN_CHARS:
            raise WorkerTokensError(f"{where}: the token of worker {worker} is shorter than "
                                    f"{MIN_TOKEN_CHARS} characters")
        if token in tokens.values():
            raise WorkerTokensError(f"{where}: worker {worker} has another worker's token")
        tokens[worker] = token
    if not tokens:
        raise WorkerTokensError(f"coordinator.worker_tokens_file: {path} holds no token")
    return tokens


@dataclass
class Issued:
    """A private key and the certificate that binds it to a name."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    def write(self, cert_path: Path, key_path: Path) -> None:
        write_private(key_path, self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        write_atomic(cert_path, self.cert.public_bytes(serialization.Encoding.PEM))

    @classmethod
    def read(cls, cert_path: Path, key_path: Path) -> Issued:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path} is not an EC private key made by geoloco certs")
        return cls(key, x509.load_pem_x509_certificate(cert_path.read_bytes()))


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, mode 0600 from the first byte, through a temp
    file made anew and never through a link planted at its name (write_atomic)."""
    write_atomic(path, data, mode=PRIVATE_MODE)


def make_ca(name: str = "geoloco run CA", days: int = DEFAULT_DAYS) -> Issued:
    """A self-signed CA that may sign end-entity certificates only."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_builder(subject, subject, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return Issued(key, cert)


def issue(ca: Issued, name: str, sans: list[str], server: bool, days: int = DEFAULT_DAYS) -> Issued:
    """A certificate signed by ``ca`` for ``name`` with the subject alternative names
    ``sans`` (IP addresses or DNS names); ``server``: for the TLS server (which may also be
    a client, for its own health checks under mutual TLS), else for clients only."""
    key = ec.generate_private_key(ec.SECP256R1())
    usage = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
    usage.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    cert = (_builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), ca.cert.subject,
                     key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(x509.SubjectAlternativeName([_general_name(s) for s in sans]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
                           critical=False)
            .sign(ca.key, hashes.SHA256()))
    return Issued(key, cert)


def _builder(subject: x509.Name, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _general_name(text: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(text))
    except ValueError:
        return x509.DNSName(text)


def make_run_credentials(out: Path, sans: list[str] | None, workers: int,
                         days: int = DEFAULT_DAYS) -> list[Path]:
    """Fill ``out`` with what a run needs, keeping what is already there: the CA (reused
    when ``ca.key`` exists), the coordinator certificate (made again when ``sans`` is
    given), ``worker-<i>`` certificates for i < ``workers``, the run token file, a
    ``worker-<i>.token`` for each worker and the coordinator's table of them
    (``worker-tokens``). Returns the files written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(DIR_MODE)
    written: list[Path] = []
    if (out / CA_KEY).exists():
        ca = Issued.read(out / CA_CERT, out / CA_KEY)
    else:
        ca = make_ca(days=days)
        ca.write(out / CA_CERT, out / CA_KEY)
        written += [out / CA_CERT, out / CA_KEY]
    if sans or not (out / COORDINATOR_CERT).exists():
        names = list(sans or DEFAULT_SANS)
        issue(ca, names[0], names, server=True, days=days).write(out / COORDINATOR_CERT, out / COORDINATOR_KEY)
        written += [out / COORDINATOR_CERT, out / COORDINATOR_KEY]
    for i in range(workers):
        if not (out / worker_cert(i)).exists():
            issue(ca, f"worker-{i}", [f"worker-{i}"], server=False, days=days).write(
                out / worker_cert(i), out / worker_key(i))
            written += [out / worker_cert(i), out / worker_key(i)]
    if not (out / TOKEN_FILE).exists():
        write_private(out / TOKEN_FILE, (secrets.token_urlsafe(TOKEN_BYTES) + "\n").encode())
        written.append(out / TOKEN_FILE)
    for i in range(workers):  # per-worker tokens (coordinator.worker_tokens_file), kept once made
        if not (out / worker_token(i)).exists():
            write_private(out / worker_token(i), (secrets.token_urlsafe(TOKEN_BYTES) + "\n").encode())
            written.append(out / worker_token(i))
    lines = [f"{i} {(out / worker_token(i)).read_text().strip()}" for i in range(workers)]
    table = ("# coordinator.worker_tokens_file: worker id, its token\n" + "\n".join(lines) + "\n").encode()
    if workers and (not (out / WORKER_TOKENS_FILE).exists() or (out / WORKER_TOKENS_FILE).read_bytes() != table):
        write_private(out / WORKER_TOKENS_FILE, table)
        written.append(out / WORKER_TOKENS_FILE)
    return written
