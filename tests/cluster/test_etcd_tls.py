"""etcd as the membership store over mutual TLS with the lab's own PKI: a real etcd (Debian's
etcd-server) started with --client-cert-auth --trusted-ca-file --cert-file --key-file on
`tinydist certs etcd`'s certificate; the store works over it, a scheduler configured by the
TINYDIST_ETCD_* settings leads through it, and a client without a certificate, or with one from
another CA, is refused with an error that says what to set. The settings' own errors need no etcd."""

from __future__ import annotations

import time

import pytest

from tests.cluster.helpers import ETCD, Coordinator, Etcd
from tests.cluster.test_journal import _populate, _view
from tinydist.base.config import settings
from tinydist.scheduler.errors import MembershipStoreError
from tinydist.scheduler.etcd import EtcdClient, tls_context
from tinydist.scheduler.membership import Membership
from tinydist.scheduler.store import EtcdStore
from tinydist.security import pki


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lab")
    pki.init(directory)
    pki.issue_etcd(directory)
    pki.issue(directory, "coordinator")
    return directory


@pytest.fixture(scope="module")
def etcd(lab, tmp_path_factory):
    if not ETCD.exists():
        pytest.skip(f"{ETCD} absent: install Debian's etcd-server (deploy/ci/apt-packages.txt)")
    server = Etcd(tmp_path_factory.mktemp("etcd"), pki=lab, client="coordinator")
    yield server
    server.stop()


def _as(lab, name: str | None):
    """The TINYDIST_ETCD_* settings of a client presenting DIR/clients/NAME (None: no certificate)."""
    cert = lab / "clients" / f"{name}.pem" if name else None
    key = lab / "clients" / f"{name}.key" if name else None
    return settings.override(ETCD_CA=lab / "ca.pem", ETCD_CERT=cert, ETCD_KEY=key)


@pytest.mark.integration
def test_membership_store_works_over_mutual_tls(etcd, lab, request):
    assert etcd.url.startswith("https://")
    prefix = f"/test/{request.node.name}/"
    now = [0.0]
    with _as(lab, "coordinator"):
        first = EtcdStore(etcd.url, "a", prefix=prefix, ttl=2)
        second = EtcdStore(etcd.url, "b", prefix=prefix, ttl=2)
    assert first.campaign("127.0.0.1:1", lambda: False)
    m = Membership(0.1, 3, clock=lambda: now[0], store=first)
    m.recover()
    _populate(m, now)
    before = _view(m)
    first.close()
    assert second.campaign("127.0.0.1:2", lambda: False)
    r = Membership(0.1, 3, clock=lambda: now[0], store=second)
    r.recover()
    assert _view(r) == before and before[0] == 5
    second.close()


@pytest.mark.integration
def test_a_client_without_a_certificate_is_refused_saying_what_to_set(etcd, lab):
    with _as(lab, None):
        client = EtcdClient(etcd.url)
    with pytest.raises(MembershipStoreError, match=r"etcd https://127\.0\.0\.1:\d+: /v3/kv/range: the TLS handshake "
                                                   r"failed .*etcd asks for a client certificate .*TINYDIST_ETCD_CERT"):
        client.get(b"/any")


@pytest.mark.integration
def test_a_client_certificate_from_another_ca_is_refused(etcd, lab, tmp_path):
    other = tmp_path / "other"
    pki.init(other)
    pki.issue(other, "intruder")
    context = tls_context(lab / "ca.pem", other / "clients" / "intruder.pem", other / "clients" / "intruder.key")
    with pytest.raises(MembershipStoreError, match=r"the TLS handshake failed .*signed by the CA etcd's --trusted-ca-file"):
        EtcdClient(etcd.url, tls=context).get(b"/any")


@pytest.mark.integration
def test_scheduler_serve_leads_through_an_etcd_over_tls_from_the_settings(etcd, lab, tmp_path, monkeypatch, request):
    monkeypatch.setenv("TINYDIST_ETCD_CA", str(lab / "ca.pem"))
    monkeypatch.setenv("TINYDIST_ETCD_CERT", str(lab / "clients" / "coordinator.pem"))
    monkeypatch.setenv("TINYDIST_ETCD_KEY", str(lab / "clients" / "coordinator.key"))
    c = Coordinator(tmp_path, "--insecure-loopback-only", "--etcd", etcd.url, "--etcd-prefix", f"/test/{request.node.name}/")
    try:
        deadline = time.monotonic() + 20
        while f" leads (etcd {etcd.url}" not in c.log.read_text():
            assert time.monotonic() < deadline, c.log.read_text()
            time.sleep(0.05)
    finally:
        c.stop()


def test_the_etcd_certificate_is_for_server_and_client_auth_from_the_labs_ca(lab):
    """etcd's gateway dials etcd's own gRPC server with it: serverAuth alone made every call HTTP 503."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID
    cert = x509.load_pem_x509_certificate((lab / "etcd" / "server.pem").read_bytes())
    usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert usages == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert cert.issuer == x509.load_pem_x509_certificate((lab / "ca.pem").read_bytes()).subject
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert (lab / "etcd" / "server.key").stat().st_mode & 0o077 == 0


def test_https_without_a_ca_or_with_half_a_client_certificate_is_refused_at_once(tmp_path):
    with settings.override(ETCD_CA=None, ETCD_CERT=None, ETCD_KEY=None), \
            pytest.raises(MembershipStoreError, match="an https:// etcd endpoint needs the CA .*set TINYDIST_ETCD_CA"):
        EtcdClient("https://127.0.0.1:2379")
    with pytest.raises(MembershipStoreError, match="TINYDIST_ETCD_CERT=.*give both"):
        tls_context(tmp_path / "ca.pem", tmp_path / "client.pem", None)
    with pytest.raises(MembershipStoreError, match="etcd TLS material unusable"):
        tls_context(tmp_path / "missing-ca.pem", None, None)
    assert EtcdClient("http://127.0.0.1:2379").tls is None           # plain HTTP needs none of it
