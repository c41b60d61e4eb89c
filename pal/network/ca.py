"""Certificates for brokered secrets: a CA per tenant, and the leaf certificates the egress
gateway shows a guest for the hosts it terminates TLS for (docs/secrets.md).

The CA's key stays on the host (sealed in the store, pal/scheduler/brokering.py) and in the
gateway's memory. A guest never trusts the tenant's CA certificate as it is: it trusts
:func:`constrained`, a certificate of the same key and name that carries X.509 name
constraints (RFC 5280 4.2.1.10): only the DNS names of that VM's brokered hosts, and no IP
address. Whoever gets hold of the key can then mint certificates a guest accepts for those
hosts only, not for arbitrary sites. Leaves are made on demand per host name, short-lived,
and never written to disk.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
from collections.abc import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
LEAF_DAYS = 7
_BACKDATE = dt.timedelta(hours=1)  # a guest clock a little behind still accepts the leaf


def _pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def new_ca(tenant_id: str) -> tuple[str, str]:
    """(certificate PEM, key PEM) of a new CA for one tenant."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Pal sandbox"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"Pal brokered-secrets CA ({tenant_id[:40]})"),
        ]
    )
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode(), _pem_key(key)


def permitted_names(hosts: Iterable[str]) -> list[str]:
    """The DNS name constraints for brokered ``hosts``: ``api.test`` as itself,
    ``*.example.com`` as ``example.com`` (which RFC 5280 reads as it and its subdomains)."""
    names = {h.lower().rstrip(".").removeprefix("*.") for h in hosts}
    return sorted(n for n in names if n)


def constrained(ca_cert_pem: str, ca_key_pem: str, hosts: Iterable[str]) -> str:
    """The tenant CA's certificate as one VM's guest trusts it (PEM): the same subject, key
    and validity, with name constraints permitting ``hosts``' DNS names and no IP address.
    Deterministic (serial from the CA and the names, RFC 6979 signature): the same CA and
    hosts always give the same bytes, so the gateway's per-CA caches stay small."""
    ca = x509.load_pem_x509_certificate(ca_cert_pem.encode())
    key = serialization.load_pem_private_key(ca_key_pem.encode(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("the tenant CA key must be an EC key")
    names = permitted_names(hosts)
    if not names:
        raise ValueError("a constrained CA needs at least one host")
    seed = hashlib.sha256(ca.fingerprint(hashes.SHA256()) + "\n".join(names).encode()).digest()
    # An IP subtree that holds no usable address: certificates for IP addresses are refused.
    no_address = [x509.IPAddress(ipaddress.ip_network(n)) for n in ("0.0.0.0/32", "::/128")]
    cert = (
        x509.CertificateBuilder()
        .subject_name(ca.subject)
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(int.from_bytes(seed[:19], "big") >> 1 or 1)
        .not_valid_before(ca.not_valid_before_utc)
        .not_valid_after(ca.not_valid_after_utc)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(ca.extensions.get_extension_for_class(x509.KeyUsage).value, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.NameConstraints(
                permitted_subtrees=[*(x509.DNSName(n) for n in names), *no_address], excluded_subtrees=None
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256(), ecdsa_deterministic=True)
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode()


class Issuer:
    """Leaf certificates signed by one CA (the gateway keeps one per tenant)."""

    def __init__(self, ca_cert_pem: str, ca_key_pem: str) -> None:
        self.ca_cert = x509.load_pem_x509_certificate(ca_cert_pem.encode())
        key = serialization.load_pem_private_key(ca_key_pem.encode(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("the tenant CA key must be an EC key")
        self.ca_key = key
        self.ca_cert_pem = ca_cert_pem

    def leaf(self, host: str) -> tuple[str, str]:
        """(certificate chain PEM, key PEM) for ``host``."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self.ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca_key.public_key()), critical=False
            )
            .sign(self.ca_key, hashes.SHA256())
        )
        chain = cert.public_bytes(serialization.Encoding.PEM).decode() + self.ca_cert_pem
        return chain, _pem_key(key)
