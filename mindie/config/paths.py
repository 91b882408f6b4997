"""The config's file paths made absolute (relative ones: from the config file's directory, so every
process agrees on them), and the run directory: the one default (``default_run_dir``, a server's
or a fleet's) and its creation, private to this user (``ensure_run_dir``)."""
import os
import stat
from typing import Mapping

from mindie.config.provenance import ConfigError
from mindie.config.schema import Config

# ServerConfig's TLS file and directory paths (the fleet launcher resolves the same keys in the
# files it writes: coordinator/fleet/plan.py).
SERVER_TLS_PATHS = ("tls_ca_path", "tls_cert", "tls_pk", "tls_pk_pwd", "tls_crl_path", "management_tls_cert",
                    "management_tls_pk", "management_tls_pk_pwd", "management_tls_crl_path", "metrics_tls_cert",
                    "metrics_tls_pk", "metrics_tls_pk_pwd", "metrics_tls_crl_path")


def resolve_paths(config: Config, base_dir: str, env: Mapping[str, str]) -> None:
    """Make file paths absolute (relative: from ``base_dir``) so every process agrees on them."""

    def absolute(p: str) -> str:
        p = p.strip()
        return os.path.join(base_dir, os.path.expanduser(p)) if p else ""

    for m in config.backend.model_deploy.models:
        m.model_weight_path = absolute(m.model_weight_path)
        for opts in m.models.values():
            opts.chat_template = absolute(opts.chat_template)
    for lm in config.backend.model_deploy.lora_modules:
        lm.path = absolute(lm.path)
    config.backend.model_deploy.lora_root = absolute(config.backend.model_deploy.lora_root)
    config.backend.worker_curve_key_dir = absolute(config.backend.worker_curve_key_dir)
    config.backend.cpu_tuning.kernel_cache = absolute(config.backend.cpu_tuning.kernel_cache)
    s = config.server
    for name in SERVER_TLS_PATHS:
        setattr(s, name, absolute(getattr(s, name)))
    s.run_dir = absolute(s.run_dir) or default_run_dir(s.port, env)
    s.responses_store_path = absolute(s.responses_store_path)  # "" = <runDir>/responses (the front end)


def default_run_dir(port: int, env: Mapping[str, str] = os.environ, *, fleet: bool = False) -> str:
    """$XDG_RUNTIME_DIR/mindie-py/<port>, else <$TMPDIR or /tmp>/mindie-py-<uid>/<port>; a fleet's
    (scripts/motor.sh, ``port`` its coordinator's predict port): $XDG_RUNTIME_DIR/mindie-motor/<port>,
    else <$TMPDIR or /tmp>/mindie-py-<uid>/motor-<port>.

    The port keeps two servers (fleets) on one host from binding the same ipc:// endpoints; the
    path stays short, as the instances' ipc sockets live below a fleet's.
    """
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return os.path.join(xdg, "mindie-motor" if fleet else "mindie-py", str(port))
    tmp = env.get("TMPDIR", "") or "/tmp"
    return os.path.join(tmp, f"mindie-py-{os.getuid()}", f"motor-{port}" if fleet else str(port))


def ensure_run_dir(path: str) -> str:
    """Create ``path`` (and its mindie-py parent) mode 0700; refuse one another user could enter."""
    parent = os.path.dirname(path)
    for d in (parent, path):
        try:
            os.makedirs(d, 0o700, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create {d}: {e.strerror or e}", "ServerConfig.runDir") from None
        if d == parent and os.path.basename(d) not in ("mindie-py", f"mindie-py-{os.getuid()}"):
            continue  # a user-chosen parent (e.g. /var/run) is not ours to judge
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigError(f"{d} must be a directory owned by uid {os.getuid()} with mode 0700 "
                              f"(found uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})", "ServerConfig.runDir")
    return path
