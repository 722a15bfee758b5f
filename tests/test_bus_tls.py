"""Kafka over TLS (SASL_SSL, as k8s/ runs Strimzi's listener): the clients verify the broker's certificate
against the cluster's CA (`kafka_ssl_cafile`), host name included, and refuse a broker their CA did not sign.

The TLS handshake is real: a local TLS server with a certificate signed by a CA made here, and kafka-python's own
SSL context built from the settings (its transport's `_build_ssl_context`, the one each broker connection uses). A
Kafka broker that speaks TLS cannot run here (the embedded broker has no TLS), so the handshake stands in for it.
"""

from __future__ import annotations

import datetime
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kafka.net.transport import KafkaSSLTransport

from flywheel.bus import client_security
from flywheel.bus.confluent import _librdkafka_config
from flywheel.settings import Settings

HOST = "flywheel-kafka-bootstrap"  # the name the certificate is for, as Strimzi's brokers' are


def _cert(subject: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None, ca: bool,
          dns: str | None = None) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, issuer_key = issuer or (name, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if dns:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns)]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()), key


def _pem(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> Path:
    data = cert.public_bytes(serialization.Encoding.PEM)
    if key is not None:
        data += key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())  # fmt: skip
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def broker_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, Path]]:
    """(port of a TLS server presenting a certificate for HOST signed by the cluster CA, the CA's PEM, another CA's)."""
    tmp = tmp_path_factory.mktemp("tls")
    ca, ca_key = _cert("cluster-ca", None, ca=True)
    other, _ = _cert("another-ca", None, ca=True)
    leaf, leaf_key = _cert(HOST, (ca.subject, ca_key), ca=False, dns=HOST)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(_pem(tmp / "broker.pem", leaf, leaf_key))
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                try:
                    with server.wrap_socket(conn, server_side=True) as tls_conn:
                        tls_conn.recv(1)
                except (ssl.SSLError, OSError):  # the client refused our certificate, or closed
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1], _pem(tmp / "ca.crt", ca), _pem(tmp / "other-ca.crt", other)
    stop.set()
    thread.join()
    listener.close()


def _handshake(settings: Settings, port: int, host: str = HOST) -> None:
    """A TLS handshake with kafka-python's context for these settings, to `host` (resolved to the local server)."""
    config = {**KafkaSSLTransport.DEFAULT_CONFIG, **client_security(settings)}
    context = KafkaSSLTransport._build_ssl_context(config)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname=host) as tls:  # fmt: skip
        assert tls.version() in ("TLSv1.2", "TLSv1.3")


def _sasl_ssl(cafile: str = "") -> Settings:
    return Settings(kafka_security_protocol="SASL_SSL", kafka_sasl_username="flywheel-serving",
                    kafka_sasl_password="a-password-from-the-kafka-user", kafka_ssl_cafile=cafile)  # fmt: skip


def test_a_client_given_the_cluster_ca_completes_the_handshake(broker_tls: tuple[int, Path, Path]) -> None:
    port, ca, _ = broker_tls
    _handshake(_sasl_ssl(str(ca)), port)


def test_a_broker_the_ca_did_not_sign_or_another_name_is_refused(broker_tls: tuple[int, Path, Path]) -> None:
    port, ca, other = broker_tls
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(_sasl_ssl(str(other)), port)  # another CA
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(_sasl_ssl(), port)  # the system's CAs do not know the cluster's
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(_sasl_ssl(str(ca)), port, host="kafka.elsewhere")  # the host name is checked


def test_the_ca_reaches_both_clients_in_their_own_names_and_only_with_tls() -> None:
    kafka_python = client_security(_sasl_ssl("/etc/flywheel/kafka-ca/ca.crt"))
    assert kafka_python["security_protocol"] == "SASL_SSL"
    assert kafka_python["ssl_cafile"] == "/etc/flywheel/kafka-ca/ca.crt"
    assert _librdkafka_config(kafka_python)["ssl.ca.location"] == "/etc/flywheel/kafka-ca/ca.crt"
    plain = Settings(kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_username="u", kafka_sasl_password="p",
                     kafka_ssl_cafile="/etc/flywheel/kafka-ca/ca.crt")  # fmt: skip
    assert "ssl_cafile" not in client_security(plain)
