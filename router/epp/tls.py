"""The endpoint picker's TLS credentials: the operator's certificate, or a self-signed one.

Why TLS by default: the gateways built on Envoy (Envoy Gateway, kgateway, Istio, GKE)
generate the picker's cluster with an ``UpstreamTlsContext`` and no validation context,
because the Inference Extension's own picker serves TLS by default with a certificate it
makes at start. A plaintext picker behind such a gateway fails every handshake, and every
request then fails open or closed. So kvroute does the same: with no ``--epp-tls-cert`` it
makes an ECDSA P-256 certificate at start (valid for a year, the pod's lifetime in practice),
held in memory only; ``--epp-plaintext`` is the explicit way out.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket

from kvroute.router.config import ConfigError

__all__ = ["self_signed", "server_credentials_pem"]

_VALID_FOR = datetime.timedelta(days=365)


def self_signed(hosts: list[str] | None = None) -> tuple[bytes, bytes]:
    """A self-signed certificate and its private key (PEM), naming ``hosts`` (IP addresses
    or DNS names; default: this host's name, ``localhost`` and ``127.0.0.1``) as subject
    alternative names. A clear ConfigError when the ``cryptography`` package is missing."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError as exc:  # a base dependency: only a broken install lacks it
        raise ConfigError(
            "the endpoint picker's default TLS needs the cryptography package (pip install "
            "cryptography); or give --epp-tls-cert and --epp-tls-key, or --epp-plaintext"
        ) from exc
    names = hosts or [socket.gethostname(), "localhost", "127.0.0.1"]
    alternatives: list[x509.GeneralName] = []
    for name in dict.fromkeys(n for n in names if n):
        try:
            alternatives.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternatives.append(x509.DNSName(name))
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvroute-epp")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks that lag a little
        .not_valid_after(now + _VALID_FOR)
        .add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return (
        certificate.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def server_credentials_pem(
    cert_path: str | None, key_path: str | None, host: str
) -> tuple[bytes, bytes, bool]:
    """(certificate chain, key, generated) for the picker's TLS: the operator's files when
    given, else a fresh self-signed pair that also names ``host`` (the bind address)."""
    if cert_path and key_path:
        try:
            with open(cert_path, "rb") as cert, open(key_path, "rb") as key:
                return cert.read(), key.read(), False
        except OSError as exc:
            raise ConfigError(f"cannot read the endpoint picker's TLS files: {exc}") from exc
    hosts = [socket.gethostname(), "localhost", "127.0.0.1"]
    if host not in ("", "0.0.0.0", "::"):
        hosts.append(host)
    chain, key = self_signed(hosts)
    return chain, key, True
