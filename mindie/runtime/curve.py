"""The security of a worker link: which endpoints need ZeroMQ CURVE, and the key files.

A worker endpoint is ``ipc://`` (a socket in the private 0700 run directory: the file system
guards it) or ``tcp://HOST:PORT`` (``BackendConfig.workerHost`` / ``workerPort``). A tcp link
is encrypted and authenticated with CURVE, its keys read from ``BackendConfig.workerCurveKeyDir``;
plain tcp is allowed only with ``BackendConfig.workerInsecureTcp: true``. Both sides decide with
``link_mode`` (the config check, the worker before it binds, the client before it connects),
so a hand-edited launch plan cannot open plain tcp either.

The key directory holds certificate files as ``zmq.auth.create_certificates`` writes them
(``python -m mindie.ops.curve_keys DIR`` makes a complete one):

    worker.key_secret     the workers' keypair (secret: mode 0600 or stricter)
    worker.key            the workers' public key (front ends check the server with it)
    frontend.key_secret   the front ends' keypair (secret)
    clients/*.key         public keys of the front ends allowed to connect (ZAP in the worker)

Secret files readable or writable by group or others are refused unless
``MINDIE_TLS_CHECK_PERMISSIONS=0`` (the override the TLS files use). Standard library only:
the certificate text is parsed here (the same rules as ``zmq.auth.load_certificate``); the
sockets are set up by each side with pyzmq.
"""
from __future__ import annotations

import glob
import os
import stat

__all__ = ["KEY_DIR_KEY", "INSECURE_KEY", "HOST_KEY", "WORKER_SECRET", "WORKER_PUBLIC", "FRONTEND_SECRET",
           "CLIENTS_DIR", "PERMISSIONS_ENV", "CurveKeyError", "permission_checks_on", "is_tcp", "link_mode",
           "read_certificate", "check_key_dir", "check_kv_key_dir", "worker_keys", "kv_keys", "frontend_keys",
           "insecure_warning"]

KEY_DIR_KEY = "BackendConfig.workerCurveKeyDir"
INSECURE_KEY = "BackendConfig.workerInsecureTcp"
HOST_KEY = "BackendConfig.workerHost"
WORKER_SECRET = "worker.key_secret"
WORKER_PUBLIC = "worker.key"
FRONTEND_SECRET = "frontend.key_secret"
CLIENTS_DIR = "clients"
PERMISSIONS_ENV = "MINDIE_TLS_CHECK_PERMISSIONS"
Z85_KEY_LEN = 40  # a 32-byte CURVE key in Z85 text


class CurveKeyError(Exception):
    """A worker-link security problem, worded ``<dotted key>: <what is wrong>``."""

    def __init__(self, message: str, key: str = KEY_DIR_KEY) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def permission_checks_on(env=os.environ) -> bool:
    return env.get(PERMISSIONS_ENV, "1").strip() != "0"


def is_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


def link_mode(endpoint: str, key_dir: str, insecure: bool) -> str:
    """"ipc" (run directory), "curve" (tcp with keys) or "plain" (tcp, insecure flag set).
    Raises ``CurveKeyError`` for tcp with neither keys nor the flag."""
    if not is_tcp(endpoint):
        return "ipc"
    if key_dir:
        return "curve"
    if insecure:
        return "plain"
    raise CurveKeyError(f"worker link {endpoint} is tcp: it needs CURVE keys ({KEY_DIR_KEY}, made by "
                        f"python -m mindie.ops.curve_keys DIR) or {INSECURE_KEY}: true to allow plain tcp")


def insecure_warning(endpoint: str) -> str:
    return (f"worker link {endpoint} is plain tcp without CURVE ({INSECURE_KEY}: true): anyone who can "
            f"reach it can submit jobs and read every output; set {KEY_DIR_KEY} to encrypt and authenticate it")


def read_certificate(path: str, *, secret: bool, env=os.environ) -> tuple[bytes, bytes | None]:
    """(public key, secret key or None) of a certificate file, Z85 text as pyzmq's socket options
    take them. A missing file, a missing key or (``secret``) a file open to others is refused."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CurveKeyError(f"{path} does not exist (python -m mindie.ops.curve_keys DIR makes the key files)") from None
    except OSError as e:
        raise CurveKeyError(f"cannot access {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CurveKeyError(f"{path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if secret and mode & 0o077 and permission_checks_on(env):
        raise CurveKeyError(f"{path} has mode {mode:04o}: a secret key file must not be readable or writable "
                            f"by group or others (chmod 600 it, or set {PERMISSIONS_ENV}=0 to skip this check)")
    public = secret_key = None
    try:
        with open(path, "rb") as f:
            for line in f:
                line = line.strip()
                if line.startswith(b"public-key"):
                    public = line.split(b"=", 1)[-1].strip(b" \t'\"")
                elif line.startswith(b"secret-key"):
                    secret_key = line.split(b"=", 1)[-1].strip(b" \t'\"")
    except OSError as e:
        raise CurveKeyError(f"cannot read {path}: {e.strerror or e}") from None
    for what, value in (("public-key", public), ("secret-key", secret_key if secret else b"x" * Z85_KEY_LEN)):
        if value is None:
            raise CurveKeyError(f"{path} has no {what} (not a ZeroMQ certificate file)")
        if len(value) != Z85_KEY_LEN:
            raise CurveKeyError(f"{path}: the {what} is not a {Z85_KEY_LEN}-character Z85 key")
    return public, secret_key if secret else None


def _clients(key_dir: str) -> str:
    clients = os.path.join(key_dir, CLIENTS_DIR)
    if not os.path.isdir(clients):
        raise CurveKeyError(f"{clients} does not exist: it holds the public keys (*.key) of the front ends "
                            "allowed to connect")
    if not glob.glob(os.path.join(clients, "*.key")):
        raise CurveKeyError(f"{clients} holds no *.key file: no front end could connect")
    return clients


def worker_keys(key_dir: str, env=os.environ) -> tuple[bytes, bytes, str]:
    """What a worker binds with: (public, secret, directory of the allowed clients' keys)."""
    public, secret = read_certificate(os.path.join(key_dir, WORKER_SECRET), secret=True, env=env)
    return public, secret, _clients(key_dir)


def frontend_keys(key_dir: str, env=os.environ) -> tuple[bytes, bytes, bytes]:
    """What a front end connects with: (the workers' public key, its own public, its own secret)."""
    server, _ = read_certificate(os.path.join(key_dir, WORKER_PUBLIC), secret=False, env=env)
    public, secret = read_certificate(os.path.join(key_dir, FRONTEND_SECRET), secret=True, env=env)
    return server, public, secret


def kv_keys(key_dir: str, env=os.environ) -> tuple[bytes, bytes, str]:
    """What a worker's tcp KV transfer endpoint binds with, and its prefill side connects with:
    the workers' keypair (public, secret) and the directory of the keys allowed to connect, which
    must hold the workers' own public key (a prefill worker authenticates with that keypair;
    instances of one fleet share the key directory)."""
    public, secret, clients = worker_keys(key_dir, env)
    for path in glob.glob(os.path.join(clients, "*.key")):
        try:
            if read_certificate(path, secret=False, env=env)[0] == public:
                return public, secret, clients
        except CurveKeyError:
            continue
    raise CurveKeyError(f"{clients} does not hold the workers' public key ({WORKER_PUBLIC}): prefill workers "
                        f"authenticate their KV transfers with it (copy {os.path.join(key_dir, WORKER_PUBLIC)} "
                        "there, or remake the directory with python -m mindie.ops.curve_keys DIR --force)")


def check_kv_key_dir(key_dir: str, env=os.environ) -> None:
    """The key directory of a tcp KV transfer endpoint (``kv_keys``)."""
    if not os.path.isdir(key_dir):
        raise CurveKeyError(f"{key_dir} is not a directory (python -m mindie.ops.curve_keys DIR makes one)")
    kv_keys(key_dir, env)


def check_key_dir(key_dir: str, env=os.environ) -> None:
    """Every file both sides need is there, well-formed and (secrets) private."""
    if not os.path.isdir(key_dir):
        raise CurveKeyError(f"{key_dir} is not a directory (python -m mindie.ops.curve_keys DIR makes one)")
    worker_keys(key_dir, env)
    frontend_keys(key_dir, env)
