"""A lab certificate authority for tinydist nodes (mutual TLS), built on `cryptography`.

    tinydist certs init DIR [--trust-domain tinydist.lab]   # CA, server certificate, starter policy
    tinydist certs issue DIR --name alice [--days N]         # a client certificate + key

Layout of DIR:

    ca/ca.key                  the lab CA's key (folder 0700, key 0600): what `certs issue` signs with and
                               a node never needs; copy DIR to a node without ca/ (the node refuses a
                               DIR that holds ca.key itself, and warns while DIR/ca/ is there)
    ca.pem                     the lab CA's certificate: what the node and every client trust
    server.pem server.key      the node's (or the cluster scheduler's) certificate: DNS localhost, IP
                               127.0.0.1 and ::1, each `--server-san` (`certs init` or `certs server`: a
                               node on a LAN address), and with `--this-host` this host's names and the
                               addresses they resolve to (`this_host_sans`: a scheduler the nodes dial
                               at its host's name or address)
    etcd/server.pem server.key an etcd server's certificate (`certs etcd`, for the scheduler's membership
                               store over mutual TLS: docs/cluster.md), serverAuth and clientAuth
    policy.toml                identities → roles, method table, quotas (docs/remote.md)
    revoked.txt                sha256 fingerprints refused on every call (reloaded when it changes)
    clients/NAME.pem NAME.key  client certificates; identity spiffe://<trust-domain>/user/NAME

Keys are ECDSA P-256. Client certificates carry exactly one URI SAN (the identity) and the
clientAuth extended key usage; the server certificate carries serverAuth.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import socket
import stat
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tinydist.base.errors import TinydistError

if TYPE_CHECKING:
    import grpc

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
TRUST_DOMAIN_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{0,250}$")
DEFAULT_TRUST_DOMAIN = "tinydist.lab"


class PKIError(TinydistError):
    """A certificate directory is missing something or holds something invalid."""


@dataclass(frozen=True)
class ClientCredentials:
    """A client's certificate, its key and the lab CA (PEM bytes): mutual TLS to a node or to the
    cluster scheduler. `load` reads explicit paths, else TINYDIST_CERT / TINYDIST_KEY / TINYDIST_CA."""

    cert: bytes
    key: bytes
    ca: bytes
    # where each came from ("lab/clients/alice.pem (TINYDIST_CERT)"), for messages that name the file to fix
    sources: tuple[str, str, str] = field(default=("the client certificate", "the client key", "the CA certificate"),
                                          compare=False)

    @classmethod
    def load(cls, cert: str | Path | None = None, key: str | Path | None = None,
             ca: str | Path | None = None) -> ClientCredentials:
        paths = {"certificate": (cert, "TINYDIST_CERT"), "key": (key, "TINYDIST_KEY"), "CA": (ca, "TINYDIST_CA")}
        found: dict[str, bytes] = {}
        sources: list[str] = []
        for what, (explicit, env) in paths.items():
            path = explicit if explicit is not None else os.environ.get(env)
            if not path:
                raise PKIError(f"mutual TLS needs a client {what}: pass it, or set {env}")
            try:
                found[what] = Path(path).read_bytes()
            except OSError as exc:
                raise PKIError(f"cannot read the client {what} {path}: {exc.strerror}") from exc
            sources.append(f"{path}" if explicit is not None else f"{path} ({env})")
        return cls(found["certificate"], found["key"], found["CA"], (sources[0], sources[1], sources[2]))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        import grpc  # only a channel needs gRPC; the certificate tools do not

        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)


@dataclass(frozen=True)
class Issued:
    cert_path: Path
    key_path: Path
    identity: str
    fingerprint: str


def identity_uri(trust_domain: str, name: str) -> str:
    return f"spiffe://{trust_domain}/user/{name}"


def fingerprint(cert_pem_or_der: bytes) -> str:
    """sha256 of the certificate's DER encoding, lowercase hex (what revoked.txt lists)."""
    if cert_pem_or_der.lstrip().startswith(b"-----BEGIN"):
        cert = x509.load_pem_x509_certificate(cert_pem_or_der)
    else:
        cert = x509.load_der_x509_certificate(cert_pem_or_der)
    return cert.fingerprint(hashes.SHA256()).hex()


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def check_private(path: Path, what: str, secret: bool = False) -> None:
    """Refuse a file or folder the node trusts that someone else could change: writable by group
    or others, or owned by another user — and, for a `secret` (a private key), readable by them.
    Whoever can rewrite the policy, a key or the CA enrols themselves."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # a missing file is its reader's error, with its own message
    problems, fixes = [], []
    if st.st_uid != os.geteuid():
        problems.append(f"owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}")
        fixes.append(f"chown {os.geteuid()} {path}")
    if st.st_mode & 0o022:
        problems.append(f"writable by {'group and others' if st.st_mode & 0o022 == 0o022 else 'group' if st.st_mode & 0o020 else 'others'}")
        fixes.append(f"chmod go-w {path}")
    if secret and st.st_mode & 0o044:
        problems.append("readable by group or others")
        fixes.append(f"chmod 600 {path}")
    if problems:
        raise PKIError(f"refusing {what} {path} (mode {stat.S_IMODE(st.st_mode):o}): it is {' and '.join(problems)}, so another "
                       f"user could change what this node trusts; fix: {'; '.join(dict.fromkeys(fixes))}")


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600)


CA_KEY = Path("ca") / "ca.key"  # inside the directory `certs init` wrote; never in what a node serves from


def refuse_ca_key(directory: Path) -> None:
    """A node's PKI directory must not hold the CA key: whoever reads it (the node's user, a
    compromised node) mints certificates for any identity. Raises PKIError naming the fix."""
    directory = Path(directory)
    if (directory / "ca.key").exists():
        raise PKIError(f"refusing to serve from {directory}: it holds the CA key ({directory / 'ca.key'}), which a node never "
                       f"needs; move it away (mkdir -m 700 {directory / 'ca'} && mv {directory / 'ca.key'} {directory / CA_KEY}, "
                       "better off this machine); `tinydist certs issue` finds it there")


def load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    directory = Path(directory)
    if (directory / "ca.key").exists() and not (directory / CA_KEY).exists():
        raise PKIError(f"{directory} keeps its CA key at {directory / 'ca.key'}, the old layout a node would serve next to; "
                       f"move it: mkdir -m 700 {directory / 'ca'} && mv {directory / 'ca.key'} {directory / CA_KEY}")
    try:
        cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
        key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), password=None)
    except FileNotFoundError as exc:
        raise PKIError(f"{directory} has no CA ({exc.filename}); run `tinydist certs init {directory}` first") from exc
    except (ValueError, TypeError) as exc:   # cryptography: not PEM, or a key that wants a password
        raise PKIError(f"{directory}: ca.pem / {CA_KEY} do not parse ({exc}); restore them, or "
                       f"`tinydist certs init --force {directory}` (every issued certificate stops working)") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PKIError(f"{directory / CA_KEY} is not an EC private key")
    return cert, key


def make_certificate(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, common_name: str, *,
                     uris: Sequence[str] = (), dns: Sequence[str] = (), ips: Sequence[str] = (),
                     eku: Sequence[x509.ObjectIdentifier] = (ExtendedKeyUsageOID.CLIENT_AUTH,),
                     not_before: dt.datetime | None = None, not_after: dt.datetime | None = None,
                     days: float = 30.0) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) signed by the CA. Tests use the knobs to make bad certificates."""
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or (_now() - dt.timedelta(minutes=5))
    end = not_after or (_now() + dt.timedelta(days=days))
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    names += [x509.DNSName(d) for d in dns]
    names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca_cert.subject)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(start)
               .not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if eku:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(eku)), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def make_ca(common_name: str = "tinydist lab CA", days: float = 3650.0) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - dt.timedelta(minutes=5)).not_valid_after(_now() + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def init(directory: Path, trust_domain: str = DEFAULT_TRUST_DOMAIN, *, server_dns: Sequence[str] = ("localhost",),
         server_ips: Sequence[str] = ("127.0.0.1", "::1"), days: float = 365.0, force: bool = False) -> Path:
    """Create the CA (its key alone in `directory`/ca/), the server certificate, an empty deny-list
    and a starter policy in `directory`."""
    directory = Path(directory)
    if not TRUST_DOMAIN_RE.match(trust_domain):
        raise PKIError(f"trust domain {trust_domain!r} must be lowercase letters, digits, dots and dashes")
    if ((directory / CA_KEY).exists() or (directory / "ca.key").exists()) and not force:
        raise PKIError(f"{directory} already holds a CA; pass --force to replace it (every issued certificate stops working)")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CA_KEY).parent.mkdir(mode=0o700, exist_ok=True)
    ca_cert, ca_key = make_ca(f"tinydist lab CA ({trust_domain})")
    (directory / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(directory / CA_KEY, _key_pem(ca_key))
    (directory / "ca.key").unlink(missing_ok=True)  # --force over the old layout: no second copy left behind
    _write_server(directory, ca_cert, ca_key, server_dns, server_ips, days)
    revoked = directory / "revoked.txt"
    if not revoked.exists():
        revoked.write_text("# sha256 fingerprints (hex) of revoked client certificates, one a line\n")
    policy = directory / "policy.toml"
    if not policy.exists() or force:
        from tinydist.security.policy import starter_policy  # the policy format lives with the service
        policy.write_text(starter_policy(trust_domain))
    return directory


def split_sans(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """`--server-san` values (comma-separated or repeated) as (DNS names, IP addresses); each checked."""
    dns: list[str] = []
    ips: list[str] = []
    for name in (n.strip() for value in names for n in value.split(",")):
        if not name:
            continue
        try:
            ips.append(str(ipaddress.ip_address(name.strip("[]"))))
            continue
        except ValueError:
            pass
        if not re.fullmatch(r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*", name):
            raise PKIError(f"server name {name!r} is neither an IP address nor a DNS name (letters, digits, dashes, dots)")
        dns.append(name.lower())
    return list(dict.fromkeys(dns)), list(dict.fromkeys(ips))


def this_host_sans() -> list[str]:
    """The names a client may dial a server on this host by (`--this-host`): socket.gethostname() and
    getfqdn(), and every address they resolve to now (an IPv6 scope `%eth0` dropped), as `--server-san`
    values. A multi-host job dials its scheduler at the first node's name or address, which a
    certificate for localhost alone fails ("Hostname Verification Check failed")."""
    names = list(dict.fromkeys(n for n in (socket.gethostname(), socket.getfqdn()) if n))
    addresses: list[str] = []
    for name in names:
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except OSError:
            continue  # a name with no address is still what a client may dial through its own resolver
        addresses += [str(info[4][0]).partition("%")[0] for info in infos]
    return names + list(dict.fromkeys(addresses))


def _write_server(directory: Path, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
                  dns: Sequence[str], ips: Sequence[str], days: float) -> None:
    if not dns and not ips:
        raise PKIError("the server certificate needs at least one name (DNS or IP) a client dials")
    cert, key = make_certificate(ca_cert, ca_key, "tinydist node", dns=dns, ips=ips,
                                 eku=(ExtendedKeyUsageOID.SERVER_AUTH,), days=days)
    (directory / "server.pem").write_bytes(cert)
    _write_private(directory / "server.key", key)


def issue_server(directory: Path, dns: Sequence[str] = ("localhost",), ips: Sequence[str] = ("127.0.0.1", "::1"),
                 days: float = 365.0) -> list[str]:
    """A new server certificate and key in `directory` (server.pem, server.key) for these names, signed by
    its CA (`tinydist certs server`): a node reached on a LAN address needs that address in it.
    Returns the names, as `DNS:...` / `IP:...`; the node serves the new one after a restart."""
    directory = Path(directory)
    ca_cert, ca_key = load_ca(directory)
    _write_server(directory, ca_cert, ca_key, dns, ips, days)
    return [f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips]


ETCD_DIR = Path("etcd")


def issue_etcd(directory: Path, dns: Sequence[str] = ("localhost",), ips: Sequence[str] = ("127.0.0.1", "::1"),
               days: float = 365.0) -> list[str]:
    """A certificate and key for an etcd server (DIR/etcd/server.pem, server.key) for these names, signed by
    the lab's CA (`tinydist certs etcd`), for etcd's --cert-file / --key-file with --trusted-ca-file DIR/ca.pem.
    Why clientAuth besides serverAuth: with --client-cert-auth etcd's JSON gateway (what scheduler.etcd
    speaks) dials etcd's own gRPC server presenting this certificate as a client; with serverAuth alone
    etcd 3.4 logs "tls: failed to verify client certificate: x509: certificate specifies an
    incompatible key usage" and every call answers HTTP 503 "connection closed". Returns the names,
    as `DNS:...` / `IP:...`."""
    directory = Path(directory)
    if not dns and not ips:
        raise PKIError("the etcd certificate needs at least one name (DNS or IP) its clients dial")
    ca_cert, ca_key = load_ca(directory)
    cert, key = make_certificate(ca_cert, ca_key, "tinydist etcd", dns=dns, ips=ips,
                                 eku=(ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH), days=days)
    (directory / ETCD_DIR).mkdir(mode=0o700, exist_ok=True)
    (directory / ETCD_DIR / "server.pem").write_bytes(cert)
    _write_private(directory / ETCD_DIR / "server.key", key)
    return [f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips]


def trust_domain_of(directory: Path) -> str:
    policy = Path(directory) / "policy.toml"
    try:
        return str(tomllib.loads(policy.read_text()).get("trust_domain", DEFAULT_TRUST_DOMAIN))
    except FileNotFoundError:
        return DEFAULT_TRUST_DOMAIN


def issue(directory: Path, name: str, days: float = 30.0, trust_domain: str | None = None) -> Issued:
    """A client certificate for `name` (identity spiffe://<trust-domain>/user/<name>) in DIR/clients/."""
    directory = Path(directory)
    if not NAME_RE.match(name):
        raise PKIError(f"client name {name!r} must match {NAME_RE.pattern}")
    if not 0 < days <= 825:
        raise PKIError(f"--days must be in (0, 825], got {days}")
    ca_cert, ca_key = load_ca(directory)
    identity = identity_uri(trust_domain or trust_domain_of(directory), name)
    cert, key = make_certificate(ca_cert, ca_key, name, uris=[identity], days=days)
    cert_path, key_path = directory / "clients" / f"{name}.pem", directory / "clients" / f"{name}.key"
    cert_path.parent.mkdir(parents=True, exist_ok=True)
    cert_path.write_bytes(cert)
    _write_private(key_path, key)
    return Issued(cert_path, key_path, identity, fingerprint(cert))


@dataclass(frozen=True)
class ServerCredentials:
    """A server's mutual-TLS material from `tinydist certs init DIR`: the lab CA, the server certificate and its key
    (DIR/ca.pem, server.pem, server.key); the node service and the cluster coordinator both serve with it."""

    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, directory: Path) -> ServerCredentials:
        directory = Path(directory)
        missing = [name for name in ("ca.pem", "server.pem", "server.key") if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{directory} lacks {', '.join(missing)}; refusing to start without a CA and server "
                                    f"certificate (create them with `tinydist certs init {directory}`)")
        check_private(directory, "the PKI directory")
        refuse_ca_key(directory)
        check_private(directory / "ca.pem", "the CA certificate")
        check_private(directory / "server.pem", "the server certificate")
        check_private(directory / "server.key", "the server key", secret=True)
        return cls((directory / "ca.pem").read_bytes(), (directory / "server.pem").read_bytes(),
                   (directory / "server.key").read_bytes())
