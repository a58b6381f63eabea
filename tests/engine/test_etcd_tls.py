"""etcd over TLS with client certificates, beside user/password (issue 22, item 3).

A real etcd serving its client port over TLS with ``--client-cert-auth``; the certificates
(a CA, etcd's server certificate, client certificates, and a stranger's CA with a client
certificate of its own) are made by the test (``etcd_support.make_certificates``, with
``cryptography``). The certificate is the gate to the port (no certificate of the CA, no
connection, whatever the password); the etcd user is the password's: etcd's JSON gateway,
which kvxfer speaks, cannot take a certificate's Common Name as the user, and with auth on
it refuses every request whose client certificate carries one ("CommonName of client
sending a request against gateway will be ignored", HTTP 400; checked here), so kvxfer's
client certificates carry none. Then the whole engine path: a prefill and a decode process
whose only way to etcd is that TLS port, token-exact against co-located generation.
"""

from __future__ import annotations

import os

import pytest

from engine_integration.control_plane import open_control_plane
from engine_integration.control_plane.etcd.gateway import EtcdError, EtcdHttpClient, EtcdUnavailable
from engine_integration.control_plane.etcd.server import EtcdServer
from engine_integration.control_plane.etcd.store import EtcdConfig, EtcdStore, parse_etcd_url
from engine_integration.launch import ClusterConfig, DisaggCluster, generate_colocated
from etcd_support import make_certificates, password_file, register_stand_in

pytestmark = [pytest.mark.usefixtures("etcd_required"), pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    pki = make_certificates(tmp_path_factory.mktemp("pki"))
    server = EtcdServer(tls=pki["tls"]).start()   # probes with the first client certificate (root)
    password = "kv-" + os.urandom(8).hex()
    server.secure(root_password=os.urandom(8).hex(), user="kvxfer", password=password)
    try:
        yield server, pki, password
    finally:
        server.stop()


def _config(server, pki, **over) -> EtcdConfig:
    cert, key = pki["client"]["kvxfer"]
    kw = dict(endpoints=(server.endpoint,), cluster="tls", ca_file=pki["ca"], cert_file=cert, key_file=key,
              cluster_key=b"k" * 32, ttl_s=2, timeout_s=1.0)
    kw.update(over)
    return EtcdConfig(**kw)


def test_tls_with_a_client_certificate_beside_user_and_password(tls_etcd):
    server, pki, password = tls_etcd
    store = EtcdStore(_config(server, pki, user="kvxfer", password=password))
    try:
        me = register_stand_in(store, "p0", "prefill", b"k" * 32)
        assert store.snapshot().instances["p0"].incarnation == me.incarnation and store.health().ok
        with pytest.raises(EtcdError, match="permission denied"):   # the kvxfer role: /kvxfer/ only
            store.client.put(b"/elsewhere", b"x")
        tls = _config(server, pki).tls_context()
        wrong = EtcdHttpClient([server.endpoint], user="kvxfer", password="wrong", tls=tls)
        with pytest.raises(EtcdError, match="authentication"):
            wrong.put(b"/kvxfer/x", b"1")
        certificate_only = EtcdHttpClient([server.endpoint], tls=tls)   # no password: no etcd user
        with pytest.raises(EtcdError, match="user name is empty|permission denied"):
            certificate_only.put(b"/kvxfer/x", b"1")
        import ssl

        cn = ssl.create_default_context(cafile=pki["ca"])
        cn.load_cert_chain(*pki["client_with_cn"])
        with_cn = EtcdHttpClient([server.endpoint], user="kvxfer", password=password, tls=cn)
        with pytest.raises(EtcdError, match="CommonName .* will be ignored"):   # etcd's gateway rule
            with_cn.put(b"/kvxfer/x", b"1")
        wrong.close(), certificate_only.close(), with_cn.close()
    finally:
        store.deregister(), store.close()


@pytest.mark.parametrize("who", ["no certificate", "a stranger's certificate", "plain http", "an untrusted server"])
def test_refused_without_the_right_certificates_whatever_the_password(tls_etcd, who):
    import ssl

    server, pki, password = tls_etcd
    user = {"user": "kvxfer", "password": password}
    if who == "plain http":
        client = EtcdHttpClient([server.endpoint], timeout_s=1.0, **user)
    else:
        context = ssl.create_default_context(cafile=pki["rogue_ca"] if who == "an untrusted server" else pki["ca"])
        if who == "a stranger's certificate":
            context.load_cert_chain(*pki["rogue_client"])
        elif who == "an untrusted server":
            context.load_cert_chain(*pki["client"]["kvxfer"])
        client = EtcdHttpClient([server.endpoint], timeout_s=1.0, tls=context, **user)
    with pytest.raises(EtcdError) as refused:
        client.range_prefix(b"/kvxfer/")
    if who == "an untrusted server":   # never retried: said at once, with the reason
        assert isinstance(refused.value, EtcdUnavailable) and "does not trust" in str(refused.value)
    client.close()


@pytest.mark.parametrize("which, says", [("expired_client", "expired on"), ("future_client", "is not valid before")])
def test_an_out_of_date_client_certificate_is_named_before_connecting(tls_etcd, tmp_path, which, says):
    """Issue 26: etcd refuses an expired client certificate with a bare TLS alert ("bad certificate",
    no name, no reason). The client reads its own certificate's dates first and says which one and why."""
    import ssl

    from engine_integration.control_plane.etcd.certs import CertificateDateError

    server, pki, password = tls_etcd
    cert, key = pki[which]
    context = ssl.create_default_context(cafile=pki["ca"])   # what etcd itself answers: no reason given
    context.load_cert_chain(cert, key)
    raw = EtcdHttpClient([server.endpoint], user="kvxfer", password=password, timeout_s=1.0, tls=context)
    with pytest.raises(EtcdError) as refused:
        raw.range_prefix(b"/kvxfer/")
    raw.close()
    assert "expired" not in str(refused.value) and cert not in str(refused.value)
    with pytest.raises(CertificateDateError, match=f"etcd client certificate {cert} {says}"):
        EtcdStore(_config(server, pki, cert_file=cert, key_file=key, user="kvxfer", password=password))
    url = f"etcd://kvxfer@{server.endpoint}/tls?ca={pki['ca']}&cert={cert}&key={key}"
    with pytest.raises(CertificateDateError, match=says):   # the URL way (kvxfer generate --control-plane)
        open_control_plane(url, cluster_key=b"k" * 32, password_file=password_file(tmp_path, password))


def test_the_url_carries_the_certificate_paths(tls_etcd, tmp_path):
    server, pki, password = tls_etcd
    cert, key = pki["client"]["kvxfer"]
    url = f"etcd://kvxfer@{server.endpoint}/tls?ttl=2&ca={pki['ca']}&cert={cert}&key={key}"
    config = parse_etcd_url(url)
    assert (config.ca_file, config.cert_file, config.key_file) == (pki["ca"], cert, key)
    plane = open_control_plane(url, cluster_key=b"k" * 32, password_file=password_file(tmp_path, password))
    try:
        assert plane.health().ok
    finally:
        plane.close()
    with pytest.raises(ValueError, match="both cert_file and key_file"):
        parse_etcd_url(f"etcd://{server.endpoint}/tls?ca={pki['ca']}&cert={cert}").tls_context()
    with pytest.raises(ValueError, match="unknown etcd URL option"):
        parse_etcd_url(f"etcd://{server.endpoint}/tls?tls=yes")


def test_engines_over_tls_generate_token_exact(tls_etcd, tmp_path):
    server, pki, password = tls_etcd
    cert, key = pki["client"]["kvxfer"]
    url = f"etcd://kvxfer@{server.endpoint}/engines?ttl=2&poll=0.1&ca={pki['ca']}&cert={cert}&key={key}"
    prompts = [[(7 * i + j) % 256 for j in range(3 + 5 * i)] for i in range(5)]
    config = ClusterConfig(backend="ucx", decode_blocks=64, prefill_blocks=256, control_plane=url,
                           etcd_password_file=password_file(tmp_path, password))
    with DisaggCluster(config) as cluster:
        assert cluster.service.server is None, "the TLS etcd answered: no private etcd may be started"
        results = cluster.generate(prompts, 4, timeout_s=60)
    assert [r.error for r in results] == [None] * len(prompts)
    assert [r.tokens for r in results] == [r.tokens for r in generate_colocated(prompts, 4)]
