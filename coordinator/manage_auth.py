"""A bearer token on the manage port (as vLLM's ``--api-key`` protects its API).

Whoever reaches the manage port can add instances (and so read every prompt routed to them),
take instances offline and stop the fleet. Besides mutual TLS (``tls_config.controller_server_*``,
a client certificate), the port can require ``Authorization: Bearer <token>``:

- ``MINDIE_MS_COORDINATOR_MANAGE_TOKEN_FILE``: a file holding the token (trailing newline
  ignored), readable by its owner only (``chmod 600``; ``MINDIE_TLS_CHECK_PERMISSIONS=0`` skips
  the check as for TLS files) -- the way to deploy it (a Kubernetes Secret mounted as a file);
- ``MINDIE_MS_COORDINATOR_MANAGE_TOKEN``: the token itself (simpler; visible in the process's
  environment to its owner and root).

Neither set: no token, as before. The probes (``/v1/startup``, ``/v1/health``,
``/v1/readiness``, ``/v2/health/live``, ``/v2/health/ready``) stay open, so kubelet and
``scripts/health_check.sh --coordinator`` need nothing; every other route answers 401 in the
coordinator's shape (``{"error", "error_type": "Unauthorized"}``, ``WWW-Authenticate: Bearer``).
"""
from __future__ import annotations

import hmac
import logging
import os
import stat
import time
from typing import Mapping, Optional

import falcon

log = logging.getLogger("mindie.coordinator.manage")

ENV_TOKEN = "MINDIE_MS_COORDINATOR_MANAGE_TOKEN"
ENV_TOKEN_FILE = "MINDIE_MS_COORDINATOR_MANAGE_TOKEN_FILE"
OPEN_PATHS = frozenset({"/v1/startup", "/v1/health", "/v1/readiness", "/v2/health/live", "/v2/health/ready"})
MAX_TOKEN = 4096


class ManageAuthError(Exception):
    """The token cannot be used: the coordinator does not start (exit 1, this message)."""


def _checked(token: bytes, where: str) -> bytes:
    if not token:
        raise ManageAuthError(f"{where} is empty")
    if len(token) > MAX_TOKEN:
        raise ManageAuthError(f"{where} is longer than {MAX_TOKEN} bytes")
    if any(c <= 0x20 or c >= 0x7f for c in token):  # it travels in a header: visible ASCII only
        raise ManageAuthError(f"{where} holds a space, a control character or a non-ASCII byte")
    return token


def load_token(env: Mapping[str, str] = os.environ) -> Optional[bytes]:
    """The manage port's bearer token from the environment, None when none is set."""
    path = env.get(ENV_TOKEN_FILE, "").strip()
    value = env.get(ENV_TOKEN, "")
    if path and value:
        raise ManageAuthError(f"{ENV_TOKEN_FILE} and {ENV_TOKEN} are both set: set one")
    if value:
        return _checked(value.strip().encode("utf-8", "surrogateescape"), ENV_TOKEN)
    if not path:
        return None
    try:
        st = os.stat(path)
        if env.get("MINDIE_TLS_CHECK_PERMISSIONS", "1") != "0" and st.st_mode & 0o077:
            raise ManageAuthError(f"{ENV_TOKEN_FILE} {path} is readable by others (mode "
                                  f"{stat.S_IMODE(st.st_mode):o}): chmod 600 it")
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN + 2)
    except OSError as e:
        raise ManageAuthError(f"{ENV_TOKEN_FILE} {path}: {e.strerror or e}") from None
    return _checked(raw.rstrip(b"\r\n"), f"{ENV_TOKEN_FILE} {path}")


class BearerToken:
    """Falcon middleware: 401 without the token, except on the probes."""

    def __init__(self, token: bytes) -> None:
        self.token = token
        self._refused = 0
        self._logged_at = 0.0

    async def process_request(self, req, resp) -> None:
        if req.path in OPEN_PATHS:
            return
        scheme, _, cred = (req.get_header("Authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(cred.strip().encode("utf-8", "surrogateescape"),
                                                              self.token):
            return
        self._refused += 1
        now = time.monotonic()
        if now - self._logged_at >= 10.0:  # a flood of bad calls is one line per 10 s, with its count
            log.warning("manage port: %d request(s) without the bearer token refused (last: %s %s from %s)",
                        self._refused, req.method, req.path, req.remote_addr)
            self._refused, self._logged_at = 0, now
        raise falcon.HTTPUnauthorized(title="Unauthorized", description=(
            "The manage port needs the header Authorization: Bearer <token> (the coordinator's "
            f"{ENV_TOKEN_FILE} or {ENV_TOKEN})."), challenges=["Bearer"])


def middleware(env: Mapping[str, str] = os.environ) -> list:
    """The manage app's middleware: the token check when a token is configured."""
    token = load_token(env)
    if token is None:
        return []
    log.info("manage port: every route but the probes needs the bearer token (%s)",
             ENV_TOKEN_FILE if env.get(ENV_TOKEN_FILE, "").strip() else ENV_TOKEN)
    return [BearerToken(token)]
