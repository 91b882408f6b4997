"""Certificates made at test time with `cryptography`: a CA, server and client certificates,
a foreign CA, a revoked client with its CRL, and broken variants (expired, mismatched key,
encrypted key with its password file), written the way MindIE lays them out."""
from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

NOW = datetime.datetime.now(datetime.timezone.utc)
DAY = datetime.timedelta(days=1)


def _key(kind: str = "ec"):
    return rsa.generate_private_key(65537, 2048) if kind == "rsa2048" else ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


class Ca:
    def __init__(self, cn: str):
        self.key = _key()
        self.cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(NOW - DAY).not_valid_after(NOW + 365 * DAY)
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.revoked: list[int] = []

    def issue(self, cn: str, *, server: bool, key=None, not_before=None, not_after=None):
        key = key or _key()
        b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(not_before or NOW - DAY).not_valid_after(not_after or NOW + 90 * DAY)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH if server
                                                   else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("127.0.0.2"))]), critical=False)
        return b.sign(self.key, hashes.SHA256()), key

    def crl(self):
        b = (x509.CertificateRevocationListBuilder().issuer_name(self.cert.subject)
             .last_update(NOW - DAY).next_update(NOW + 30 * DAY))
        for serial in self.revoked:
            b = b.add_revoked_certificate(x509.RevokedCertificateBuilder().serial_number(serial)
                                          .revocation_date(NOW - DAY).build())
        return b.sign(self.key, hashes.SHA256())


def pem_cert(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def pem_key(key, password: bytes | None = None) -> bytes:
    enc = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)


def write(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


class Pki:
    """Everything under ``root`` in MindIE's layout (security/ca, security/certs, security/keys)."""

    def __init__(self, root: Path):
        self.root = root
        self.ca = Ca("mindie-test-ca")
        self.other_ca = Ca("someone-else")
        sec = root / "security"
        write(sec / "ca" / "ca.pem", pem_cert(self.ca.cert), 0o644)
        for plane in ("business", "management", "metrics"):
            cert, key = self.ca.issue(f"{plane}-server", server=True)
            write(sec / "certs" / plane / "server.pem", pem_cert(cert), 0o644)
            write(sec / "keys" / plane / "server.key.pem", pem_key(key))
            setattr(self, f"{plane}_cert", cert)
        self.client = self._client("client", self.ca)
        self.stranger = self._client("stranger", self.other_ca)
        self.revoked = self._client("revoked", self.ca)
        self.ca.revoked.append(self.revoked[2].serial_number)
        write(sec / "crl" / "ca_crl.pem", self.ca.crl().public_bytes(serialization.Encoding.PEM), 0o644)

    def _client(self, name: str, ca: Ca) -> tuple[str, str, x509.Certificate]:
        cert, key = ca.issue(name, server=False)
        c = write(self.root / "clients" / f"{name}.pem", pem_cert(cert), 0o644)
        k = write(self.root / "clients" / f"{name}.key.pem", pem_key(key))
        return str(c), str(k), cert

    def server_config(self, *, crl: bool = True) -> dict:
        """ServerConfig TLS keys for the three planes (relative paths: from the config's dir)."""
        out = {"httpsEnabled": True, "tlsCaPath": "security/ca/", "tlsCaFile": ["ca.pem"],
               "managementTlsCaFile": ["ca.pem"], "metricsTlsCaFile": ["ca.pem"]}
        for plane, prefix in (("business", "tls"), ("management", "managementTls"), ("metrics", "metricsTls")):
            out[f"{prefix}Cert"] = f"security/certs/{plane}/server.pem"
            out[f"{prefix}Pk"] = f"security/keys/{plane}/server.key.pem"
            if crl:
                out[f"{prefix}CrlPath"] = "security/crl/"
                out[f"{prefix}CrlFiles"] = ["ca_crl.pem"]
        return out
