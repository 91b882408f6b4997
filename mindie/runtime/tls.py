"""TLS of the HTTP planes: MindIE's ``tls*`` / ``managementTls*`` / ``metricsTls*`` keys made
into checked files and an ``ssl.SSLContext`` per plane.

Each plane names a certificate, a private key (optionally encrypted: ``tlsPkPwd`` names a file
holding its password in plain text, where MindIE keeps it KMC-encrypted), CA files inside
``tlsCaPath`` (client certificates: mutual TLS; an empty list = server-only TLS, logged) and CRL
files inside the plane's CRL directory (revoked client certificates). ``check_plane`` reads
every file and fails with a ``TlsError`` naming the config key: missing, unreadable, too open
(private key or password readable by others, any file writable by others), not PEM, expired or
not yet valid, key not matching the certificate, key too small, wrong password.

Built by the launcher (``mindie.ops.launch_plan``: a bad file stops the start), again by every front
end as it boots (so ``SIGHUP``, which restarts the front ends, loads renewed files), and by
``python -m mindie.ops.tls_check check LISTENERS`` in the launcher before it forwards a ``SIGHUP``
(a broken renewal is refused and the running front ends keep their certificates).

``MINDIE_TLS_CHECK_PERMISSIONS=0`` turns the permission checks off (a warning is logged), e.g.
for certificates mounted from a Kubernetes Secret without ``defaultMode: 0400``.
"""
from __future__ import annotations

import datetime
import logging
import os
import ssl
import stat
from typing import Optional

import msgspec

from mindie.runtime.curve import permission_checks_on  # one override for TLS and CURVE files

log = logging.getLogger("mindie.tls")

# TLS 1.2 suites: forward secrecy and AEAD only (TLS 1.3 suites are all of that kind).
CIPHERS_TLS12 = "ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:DHE+CHACHA20:!aNULL:!eNULL:!MD5:!DSS:!SHA1"
MIN_RSA_BITS = 2048  # refused below; MindIE asks for 3072 (warned below that)
MINDIE_RSA_BITS = 3072
EXPIRY_WARNING_DAYS = 30


class TlsError(Exception):
    """A TLS file problem, worded ``<dotted key>: <what is wrong>``."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class PlaneTls(msgspec.Struct, kw_only=True, frozen=True):
    """The TLS files of one plane, absolute paths, and the config keys that named them."""

    plane: str  # business | management | metrics
    cert: str
    key: str
    key_password_file: str = ""  # "" = the key is not encrypted
    ca_files: list[str] = []  # [] = no client certificate asked for (server-only TLS)
    crl_files: list[str] = []
    cert_key: str = "ServerConfig.tlsCert"
    key_key: str = "ServerConfig.tlsPk"
    password_key: str = "ServerConfig.tlsPkPwd"
    ca_key: str = "ServerConfig.tlsCaFile"
    crl_key: str = "ServerConfig.tlsCrlFiles"


def plane_tls(server, plane: str) -> PlaneTls:
    """The ``PlaneTls`` of ``plane`` from a loaded ``ServerConfig`` (paths already absolute)."""
    prefix = {"business": "", "management": "management_", "metrics": "metrics_"}[plane]
    key_prefix = {"business": "tls", "management": "managementTls", "metrics": "metricsTls"}[plane]
    crl_dir = getattr(server, f"{prefix}tls_crl_path")
    return PlaneTls(
        plane=plane,
        cert=getattr(server, f"{prefix}tls_cert"),
        key=getattr(server, f"{prefix}tls_pk"),
        key_password_file=getattr(server, f"{prefix}tls_pk_pwd"),
        ca_files=[os.path.join(server.tls_ca_path, f) for f in getattr(server, f"{prefix}tls_ca_file")],
        crl_files=[os.path.join(crl_dir, f) for f in getattr(server, f"{prefix}tls_crl_files")],
        cert_key=f"ServerConfig.{key_prefix}Cert", key_key=f"ServerConfig.{key_prefix}Pk",
        password_key=f"ServerConfig.{key_prefix}PkPwd", ca_key=f"ServerConfig.{key_prefix}CaFile",
        crl_key=f"ServerConfig.{key_prefix}CrlFiles")


# -- file checks ---------------------------------------------------------------------------------
def _read(path: str, key: str, *, secret: bool) -> bytes:
    """The bytes of ``path``; refuses a missing, unreadable or (when checks are on) too open file.

    Secret files (private key, password) must not be readable or writable by others nor
    writable by the group (at most 0640); the others must not be writable by group or others.
    Owner: this user or root.
    """
    if not path:
        raise TlsError(key, "not set")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise TlsError(key, f"{path} does not exist") from None
    except OSError as e:
        raise TlsError(key, f"cannot access {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise TlsError(key, f"{path} is not a regular file")
    if permission_checks_on():
        mode = stat.S_IMODE(st.st_mode)
        too_open = mode & (0o027 if secret else 0o022)
        if too_open:
            what = "a private file (key or password)" if secret else "a certificate file"
            limit = "0640 (no access for others, no write for the group)" if secret else "0644 (no write for group or others)"
            raise TlsError(key, f"{path} has mode {mode:04o}: {what} must be at most {limit}; "
                           "chmod it, or set MINDIE_TLS_CHECK_PERMISSIONS=0 to skip this check")
        if st.st_uid not in (os.getuid(), 0):
            raise TlsError(key, f"{path} is owned by uid {st.st_uid}, not by this user ({os.getuid()}) or root")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TlsError(key, f"cannot read {path}: {e.strerror or e}") from None


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _check_validity(cert, key: str, path: str, warnings: list[str]) -> None:
    now = _now()
    if cert.not_valid_after_utc <= now:
        raise TlsError(key, f"{path}: the certificate expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
    if cert.not_valid_before_utc > now:
        raise TlsError(key, f"{path}: the certificate is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC")
    if cert.not_valid_after_utc - now < datetime.timedelta(days=EXPIRY_WARNING_DAYS):
        warnings.append(f"{key}: {path} expires on {cert.not_valid_after_utc:%Y-%m-%d} UTC")


def _load_certs(data: bytes, key: str, path: str) -> list:
    from cryptography import x509

    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        certs = []
    if not certs:
        raise TlsError(key, f"{path} holds no PEM certificate")
    return certs


def _load_key(data: bytes, password: Optional[bytes], t: PlaneTls, warnings: list[str]):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    try:
        pk = serialization.load_pem_private_key(data, password=password)
    except TypeError:  # encrypted without a password, or a password for a clear key
        if password is None:
            raise TlsError(t.key_key, f"{t.key} is encrypted: name a file holding its password in "
                           f"{t.password_key}") from None
        raise TlsError(t.password_key, f"{t.key} is not encrypted: remove {t.password_key}") from None
    except ValueError as e:
        # A wrong password usually fails the decryption; about 1 in 170 times (PKCS8 with AES-CBC) the
        # padding happens to check and the garbage then fails to parse, with no word of a password.
        encrypted = b"ENCRYPTED" in data
        if password is not None and (encrypted or "password" in str(e).lower() or "decrypt" in str(e).lower()):
            raise TlsError(t.password_key, f"wrong password for {t.key}") from None
        raise TlsError(t.key_key, f"{t.key} is not a PEM private key") from None
    except Exception as e:  # unsupported algorithms and the like
        raise TlsError(t.key_key, f"{t.key}: cannot load the private key ({e})") from None
    if isinstance(pk, rsa.RSAPrivateKey):
        if pk.key_size < MIN_RSA_BITS:
            raise TlsError(t.key_key, f"{t.key}: an RSA key of {pk.key_size} bits is too small "
                           f"(at least {MIN_RSA_BITS}; MindIE asks for {MINDIE_RSA_BITS})")
        if pk.key_size < MINDIE_RSA_BITS:
            warnings.append(f"{t.key_key}: an RSA key of {pk.key_size} bits (MindIE asks for {MINDIE_RSA_BITS})")
    elif isinstance(pk, ec.EllipticCurvePrivateKey) and pk.curve.key_size < 256:
        raise TlsError(t.key_key, f"{t.key}: an EC key of {pk.curve.key_size} bits is too small (at least 256)")
    return pk


def check_plane(t: PlaneTls) -> tuple[ssl.SSLContext, list[str]]:
    """Every file of ``t`` checked, and the server context built from them; returns (context,
    warnings). Raises ``TlsError`` naming the key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    warnings: list[str] = []
    cert_data = _read(t.cert, t.cert_key, secret=False)
    chain = _load_certs(cert_data, t.cert_key, t.cert)
    _check_validity(chain[0], t.cert_key, t.cert, warnings)
    password: Optional[bytes] = None
    if t.key_password_file:
        password = _read(t.key_password_file, t.password_key, secret=True).rstrip(b"\r\n")
        if not password:
            raise TlsError(t.password_key, f"{t.key_password_file} is empty")
    pk = _load_key(_read(t.key, t.key_key, secret=True), password, t, warnings)
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if (pk.public_key().public_bytes(serialization.Encoding.PEM, pub)
            != chain[0].public_key().public_bytes(serialization.Encoding.PEM, pub)):
        raise TlsError(t.key_key, f"{t.key} does not match the certificate {t.cert} ({t.cert_key})")

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(CIPHERS_TLS12)
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_RENEGOTIATION
    try:
        # password given (even None): OpenSSL never prompts on a terminal for an encrypted key
        ctx.load_cert_chain(t.cert, t.key, password=password or b"")
    except ssl.SSLError as e:
        raise TlsError(t.cert_key, f"{t.cert} cannot be used with {t.key}: {e.reason or e}") from None

    if t.ca_files:
        for path in t.ca_files:
            data = _read(path, t.ca_key, secret=False)
            for ca in _load_certs(data, t.ca_key, path):
                _check_validity(ca, t.ca_key, path, warnings)
            try:
                ctx.load_verify_locations(cadata=data.decode("ascii", "replace"))
            except ssl.SSLError as e:
                raise TlsError(t.ca_key, f"{path}: {e.reason or e}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    else:
        warnings.append(f"{t.ca_key} is empty: the {t.plane} plane does not ask for client certificates "
                        "(server-only TLS, no mutual TLS)")
    if t.crl_files:
        if not t.ca_files:
            raise TlsError(t.crl_key, f"CRL files need CA files to check client certificates against ({t.ca_key})")
        for path in t.crl_files:
            data = _read(path, t.crl_key, secret=False)
            try:
                crl = x509.load_pem_x509_crl(data)
            except ValueError:
                raise TlsError(t.crl_key, f"{path} is not a PEM certificate revocation list") from None
            if crl.next_update_utc is not None and crl.next_update_utc < _now():
                warnings.append(f"{t.crl_key}: {path} is past its next update "
                                f"({crl.next_update_utc:%Y-%m-%d}): clients are refused until it is renewed")
            try:
                ctx.load_verify_locations(cafile=path)  # a file lookup loads CRLs too (cadata does not)
            except ssl.SSLError as e:
                raise TlsError(t.crl_key, f"{path}: {e.reason or e}") from None
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return ctx, warnings


def server_context(t: PlaneTls) -> ssl.SSLContext:
    """The checked context of a plane, its warnings logged."""
    ctx, warnings = check_plane(t)
    for w in warnings:
        log.warning("%s", w)
    return ctx
