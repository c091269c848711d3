"""Why a mutual-TLS connection to a node failed, in words: the cause and the fix.

gRPC reports a failed connection as UNAVAILABLE with a line about its transport: a key that does
not belong to its certificate is "Failed to create security handshaker", a certificate the node does
not trust is "Socket closed", a CA that did not sign the node's certificate is
"CERTIFICATE_VERIFY_FAILED". None of them says which file is wrong. `explain` checks what can be
checked here — the client's certificate, key and CA against each other (`check_credentials`), and
the certificate the node presents against the CA and the address dialled (`probe_server`, one TLS
handshake without a client certificate: TLS 1.3 sends the server's certificate before it asks for
the client's) — and names the file, the mismatch and what to do.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import socket
import ssl

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from tinydist.security.pki import ClientCredentials


def _subject(cert: x509.Certificate) -> str:
    return cert.subject.rfc4514_string() or "(no subject)"


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception):  # noqa: BLE001 - cryptography's InvalidSignature has no common base
        return False
    return True


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def check_credentials(credentials: ClientCredentials) -> list[str]:
    """What is wrong with a client's certificate, key and CA on their own, each with its fix."""
    cert_src, key_src, ca_src = credentials.sources
    problems: list[str] = []
    try:
        cert = x509.load_pem_x509_certificate(credentials.cert)
    except ValueError:
        problems.append(f"{cert_src} is not a PEM certificate; pass the .pem that `tinydist certs issue` wrote")
        cert = None
    try:
        key = serialization.load_pem_private_key(credentials.key, password=None)
    except (ValueError, TypeError):
        problems.append(f"{key_src} is not a PEM private key without a password; pass the .key that `tinydist certs issue` wrote")
        key = None
    try:
        ca = x509.load_pem_x509_certificate(credentials.ca)
    except ValueError:
        problems.append(f"{ca_src} is not a PEM certificate; pass the lab's ca.pem")
        ca = None
    if cert is not None and key is not None:
        spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        if cert.public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
            problems.append(f"the key {key_src} does not belong to the certificate {cert_src} (their public keys differ); "
                            "pass the .key issued together with that .pem (clients/NAME.key beside clients/NAME.pem)")
    if cert is not None:
        if cert.not_valid_after_utc < _now():
            problems.append(f"the certificate {cert_src} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; "
                            "get a new one (tinydist certs issue DIR --name NAME)")
        elif cert.not_valid_before_utc > _now():
            problems.append(f"the certificate {cert_src} is valid only from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC; "
                            "check this machine's clock")
        try:
            usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
            if ExtendedKeyUsageOID.CLIENT_AUTH not in usages:
                problems.append(f"the certificate {cert_src} is not for clients (no clientAuth usage: a server "
                                "certificate?); pass a client certificate from `tinydist certs issue`")
        except x509.ExtensionNotFound:
            pass
        if ca is not None and not _issued_by(cert, ca):
            problems.append(f"the certificate {cert_src} was issued by '{cert.issuer.rfc4514_string()}', not by the CA in "
                            f"{ca_src} ('{_subject(ca)}'); a node trusts only its own lab's CA: use the ca.pem and the "
                            "certificate of the same lab")
    return problems


def split_target(target: str) -> tuple[str, int] | None:
    """(host, port) of a HOST:PORT or [V6]:PORT target; None for anything else (a dns:/// URI, no port)."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host or "/" in host:
        return None
    return host.strip("[]"), int(port)


def _names(cert: x509.Certificate) -> tuple[list[str], list[str]]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [], []
    return san.get_values_for_type(x509.DNSName), [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]


def _covers(host: str, dns: list[str], ips: list[str]) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return any(name.lower() == host.lower() or (name.startswith("*.") and host.lower().partition(".")[2] == name[2:].lower())
                   for name in dns)
    return any(ipaddress.ip_address(ip) == address for ip in ips)


def server_certificate(host: str, port: int, timeout: float = 3.0) -> bytes | None:
    """The DER certificate the server at host:port presents (not verified), or None if no handshake got that far."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                context.wrap_socket(raw, server_hostname=None if _is_ip(host) else host) as tls:
            return tls.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError):
        return None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def probe_server(host: str, port: int, credentials: ClientCredentials, timeout: float = 3.0) -> list[str]:
    """What is wrong with the certificate the node at host:port presents, seen from here, each with its fix."""
    der = server_certificate(host, port, timeout)
    if der is None:
        return []
    cert = x509.load_der_x509_certificate(der)
    problems = []
    try:
        ca = x509.load_pem_x509_certificate(credentials.ca)
    except ValueError:
        ca = None
    if ca is not None and not _issued_by(cert, ca):
        problems.append(f"the node at {host}:{port} presents a certificate issued by '{cert.issuer.rfc4514_string()}', not by "
                        f"the CA in {credentials.sources[2]} ('{_subject(ca)}'); pass the ca.pem of the node's lab")
    if cert.not_valid_after_utc < _now():
        problems.append(f"the node's certificate expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; its admin renews it "
                        "(tinydist certs server DIR) and restarts the node")
    names = _uncovered(host, cert)
    if names is not None:
        problems.append(f"the node's certificate names {names}, not {host}, the address dialled; connect through one of "
                        f"those, or its admin adds it (tinydist certs server DIR --server-san {host}) and restarts the node")
    return problems


def _uncovered(host: str, cert: x509.Certificate) -> str | None:
    """The names `cert` carries (`DNS:a, IP:b`), when none of them is `host`; None when one is."""
    dns, ips = _names(cert)
    if _covers(host, dns, ips):
        return None
    return ", ".join([f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips]) or "no names"


def names_not_dialled(host: str, port: int, timeout: float = 3.0) -> str | None:
    """The names in the certificate the server at host:port presents (`DNS:a, IP:b`) when none of
    them is `host`, the address dialled (gRPC then says only "Hostname Verification Check failed");
    None when one is, or when no handshake got that far."""
    der = server_certificate(host, port, timeout)
    return None if der is None else _uncovered(host, x509.load_der_x509_certificate(der))


def explain(target: str, credentials: ClientCredentials, details: str) -> str:
    """The cause and the fix of a failed connection to `target`, from gRPC's `details` and the checks above."""
    text = details.lower()
    where = split_target(target)
    if "connection refused" in text:
        return (f"nothing listens at {target} (connection refused): start the node there "
                f"(tinydist node serve --listen {target} ...), or check the address and port")
    if "dns resolution failed" in text or "name or service not known" in text:
        return f"the host of {target} does not resolve; check the name, or use the node's IP address"
    if "deadline" in text or "timed out" in text or "timeout" in text:
        return f"no answer from {target} in time: a firewall, the wrong port, or the node is overloaded"
    problems = check_credentials(credentials)
    if not problems and where is not None:
        problems = probe_server(*where, credentials)
    if problems:
        return "the TLS handshake failed: " + "; ".join(problems)
    if "handshaker" in text:
        return ("the TLS handshake could not start with these credentials (gRPC: 'Failed to create security handshaker'); "
                f"check that {credentials.sources[0]} and {credentials.sources[1]} are a PEM certificate and its key")
    if "socket closed" in text or "connection reset" in text or "handshake" in text or "ssl" in text:
        return (f"the node at {target} closed the TLS handshake: it refused this client certificate "
                f"({credentials.sources[0]}): one issued by another lab's CA, expired on the node's clock, or not for clients; "
                "get one from the node's lab (tinydist certs issue)")
    return f"cannot reach {target}: {details}"
